"""Count the torch ops one lowbit rl step's train_on and sync run on the CPU (a tiny model), and
the ops nvfp4_tiles runs for one weight."""
import json, sys, collections
import torch
from torch.profiler import profile, ProfilerActivity
from lowbit.rl import trainer as T
from lowbit import cli
from lowbit.formats.nvfp4_tiles import nvfp4_tiles

def count(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        r = fn()
    ops = [e for e in prof.events() if e.name.startswith("aten::")]
    return r, len(ops)

out = {}
codes = torch.randint(0, 256, (6144, 512), dtype=torch.uint8)
bs = torch.rand(6144, 64).mul(100).to(torch.float8_e4m3fn)
_, out["nvfp4_tiles_ops_6144x1024"] = count(lambda: nvfp4_tiles(codes, bs, torch.rand(6144), 1024))
for name in ("train_on", "sync"):
    orig = getattr(T.GRPOTrainer, name)
    def f(self, *a, _orig=orig, _name=name, **k):
        if getattr(self, "_n", 0) == 1:
            r, n = count(lambda: _orig(self, *a, **k)); out[_name + "_ops"] = n; return r
        return _orig(self, *a, **k)
    setattr(T.GRPOTrainer, name, f)
orig_one = T.GRPOTrainer.one_step
def one_step(self, step):
    self._n = step
    return orig_one(self, step)
T.GRPOTrainer.one_step = one_step
orig_q = None
cli.main(sys.argv[2:])
json.dump(out, open(sys.argv[1], "w"))
print(out)
