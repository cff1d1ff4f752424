"""QUADS experiment: GRPO with bf16 / fp8 / naive NVFP4 / QAT-only / QUADS (QAT + RAC) rollouts on
the same seeds and warm start, plus a RAC-ratio ablation; every setting a `lowbit rl` process,
all running at once (one GPU is enough: the policy is small).

    PYTHONPATH=. python benchmarks/quads.py --out results/quads           # one H200, ~6 min
    PYTHONPATH=. python benchmarks/quads.py --smoke --out /tmp/quads      # CPU, a minute

Writes under --out: one run folder per setting (metrics.jsonl, rl.png, final.json), then
summary.md / summary.json (reward first and last 10 steps, held-out accuracy, mean and max
|log pi_rollout - log pi_train|, k3 KL, rollout tokens/s) and rl.png (reward, held-out
accuracy, mean and max log-prob gap per step), and meta.json (date, commit, machine,
command). The warm start is trained once, before the runs start, and read by all of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = ["bf16", "fp8", "nvfp4-w4a16", "nvfp4", "nvfp4+qat", "nvfp4+quads",
            "nvfp4+is", "nvfp4+quads@0.125", "nvfp4+quads@0.5", "nvfp4+quads@1"]
SMOKE_SETTINGS = ["bf16", "nvfp4", "nvfp4+quads"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the runs and the summary")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help="comma-separated rollout[+align][@rac_ratio][+gG][+is][+static-act] (default: %(default)s)")
    p.add_argument("--model", default="small")
    p.add_argument("--n-experts", type=int, default=8)
    p.add_argument("--task", default="add")
    p.add_argument("--task-size", type=int, default=2)
    p.add_argument("--warmstart-steps", type=int, default=1500)
    p.add_argument("--warmstart-lr", type=float, default=3e-3)
    p.add_argument("--warmstart-target", type=float, default=None,
                   help="stop the warm start at this validation accuracy (see lowbit rl --help)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0, help="RL seed of every setting; the warm start's too")
    p.add_argument("--more-seeds", default="1",
                   help="comma-separated further RL seeds, run for --seed-settings (default: %(default)s)")
    p.add_argument("--seed-settings", default="bf16,nvfp4,nvfp4+quads",
                   help="the settings the further seeds run (default: %(default)s)")
    p.add_argument("--device", default="auto")
    p.add_argument("--timeout", type=int, default=420, help="seconds each run may take")
    p.add_argument("--smoke", action="store_true", help="tiny model, 3 settings, 3 steps (CPU)")
    args = p.parse_args()
    settings = [s for s in args.settings.split(",") if s]
    more_seeds = [int(x) for x in args.more_seeds.split(",") if x.strip()]
    seed_settings = [s for s in args.seed_settings.split(",") if s]
    if args.smoke:
        settings, seed_settings = SMOKE_SETTINGS, SMOKE_SETTINGS[:1]
        args.model, args.task_size, args.warmstart_steps, args.steps = "tiny", 1, 20, 3
        args.prompts_per_step, args.num_generations, args.timeout = 2, 4, 300
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from lowbit.bench import git_commit
    from lowbit.data.tasks import get_task
    from lowbit.rl.compare import config_for_setting, format_summary, summary_rows, write_summary
    from lowbit.rl.config import RLConfig
    from lowbit.rl.warmstart import policy_config, warm_start
    from lowbit.train.config import resolve_device

    common = ["--model", args.model, "--n-experts", str(args.n_experts), "--task", args.task,
              "--task-size", str(args.task_size), "--warmstart-steps", str(args.warmstart_steps),
              "--warmstart-lr", str(args.warmstart_lr),
              *(["--warmstart-target", str(args.warmstart_target)] if args.warmstart_target else []),
              "--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step),
              "--num-generations", str(args.num_generations), "--lr", str(args.lr),
              "--warmstart-seed", str(args.seed), "--device", args.device, "--out-dir", str(out),
              "--eval-every", "25" if not args.smoke else "2", "--eval-problems",
              "256" if not args.smoke else "8", "--checkpoint-every", "50"]
    if args.smoke:
        common += ["--max-completion-length", "4"]
    base = RLConfig(model=args.model, n_experts=args.n_experts, task=args.task,
                    task_size=args.task_size, warmstart_steps=args.warmstart_steps,
                    warmstart_lr=args.warmstart_lr, warmstart_target=args.warmstart_target,
                    seed=args.seed, out_dir=str(out), progress=False,
                    eval_problems=256 if not args.smoke else 8,
                    max_completion_length=4 if args.smoke else 8)
    runs = [(s, args.seed) for s in settings] + [(s, seed) for seed in more_seeds
                                                  for s in seed_settings]
    configs = [dataclasses.replace(config_for_setting(base, s), seed=seed)   # refuses a bad setting now
               for s, seed in runs]
    for config in configs:
        config.run_name = f"{config.name}-s{config.seed}"
    task = get_task(args.task, digits=args.task_size)
    t0 = time.time()
    warm_start(base, task, policy_config(base, task), str(resolve_device(args.device)), print)
    print(f"warm start ready ({time.time() - t0:.0f} s); launching {len(configs)} runs")

    procs = []
    for config in configs:
        flags = ["--rollout", config.rollout, "--align", config.align, "--seed", str(config.seed),
                 "--rac-ratio", str(config.rac_ratio), "--rac-group", str(config.rac_group),
                 "--is", config.importance_sampling,
                 "--rollout-activation-scale", config.rollout_activation_scale,
                 "--run-name", config.run_name]
        log = open(out / f"{config.name}.log", "w")
        cmd = [sys.executable, "-m", "lowbit", "rl", *common, *flags, "--overwrite", "--no-progress"]
        procs.append((config, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    failed = []
    for config, proc, log in procs:
        try:
            rc = proc.wait(timeout=max(1, args.timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        log.close()
        if rc != 0:
            failed.append(f"{config.name}: {rc}")
    folders = [out / c.name for c in configs if (out / c.name / "metrics.jsonl").is_file()]
    policy = f"{args.model}{f' MoE {args.n_experts}x top-2' if args.n_experts else ''}"
    write_summary(folders, out, title=f"{policy} on {task.name}: rollout precision vs log-prob gap")
    print(format_summary(summary_rows(folders)))
    meta = {"date": datetime.date.today().isoformat(), "commit": git_commit(), "machine": _machine(),
            "command": " ".join(["python", *sys.argv]), "runs": [c.name for c in configs],
            "failed": failed,
            "wall_s": time.time() - t0}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    if failed:
        print("failed or timed out: " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else 0


def _machine() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()})"


if __name__ == "__main__":
    sys.exit(main())
