"""Profile one lowbit rl step per phase (generate / train_on / sync): wall, GPU kernel time, top kernels.
usage: python rl-step-profile-2026-12-05.py OUT.json STEP -- <lowbit rl arguments>"""
import json, sys, time, collections
import torch
from torch.profiler import profile, ProfilerActivity
from lowbit.rl import trainer as T
from lowbit import cli

out_path, prof_step = sys.argv[1], int(sys.argv[2])
argv = sys.argv[sys.argv.index("--") + 1:]
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
report = {"argv": argv, "phases": {}}

def wrap(name):
    orig = getattr(T.GRPOTrainer, name)
    def f(self, *a, **k):
        if getattr(self, "_prof_step", None) != prof_step:
            return orig(self, *a, **k)
        if torch.cuda.is_available(): torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            r = orig(self, *a, **k)
            if torch.cuda.is_available(): torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        kern = collections.Counter(); count = collections.Counter(); cpu_ops = collections.Counter()
        for e in prof.events():
            dt = getattr(e, "device_type", None)
            if dt is not None and str(dt).endswith("CUDA"):
                kern[e.name[:90]] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                count[e.name[:90]] += 1
        for e in prof.key_averages():
            cpu_ops[e.key[:60]] = e.count
        gpu_us = sum(kern.values())
        report["phases"][name] = {"wall_s": wall, "gpu_kernel_s": gpu_us / 1e6, "kernels": sum(count.values()),
            "top": [(k, round(v / 1e3, 2), count[k]) for k, v in kern.most_common(25)],
            "top_cpu_ops": cpu_ops.most_common(25)}
        print(f"== {name}: wall {wall:.3f}s gpu {gpu_us/1e6:.3f}s kernels {sum(count.values())}", flush=True)
        for k, v, n in report["phases"][name]["top"][:15]:
            print(f"   {v:9.2f} ms {n:6d}  {k}")
        return r
    setattr(T.GRPOTrainer, name, f)

for n in ("generate", "train_on", "sync"):
    wrap(n)
orig_one = T.GRPOTrainer.one_step
def one_step(self, step):
    self._prof_step = step
    return orig_one(self, step)
T.GRPOTrainer.one_step = one_step
try:
    rc = cli.main(argv)
finally:
    json.dump(report, open(out_path, "w"), indent=1)
sys.exit(rc)
