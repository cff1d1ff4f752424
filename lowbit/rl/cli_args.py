"""`lowbit rl`: its flags (declared with RLConfig's fields, lowbit.config.flag) and what it runs.

Those flags default to None, meaning "RLConfig's default" (shown in --help), so that
config_from_args can tell what the user set: a flag given explicitly wins over --quick's value.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lowbit.config import add_flags, flag_values
from lowbit.rl.config import MODEL_FOLDER_LR, RLConfig

__all__ = ["add_rl_arguments", "run_rl_command", "config_from_args", "QUICK"]

# --quick: the same pipeline at a size CI runs in seconds
QUICK = dict(warmstart_steps=20, steps=3, prompts_per_step=2, num_generations=4,
             eval_problems=8, eval_every=2, checkpoint_every=2, max_completion_length=4)

# the flags a --compare setting names (lowbit.rl.compare.config_for_setting), by RLConfig field
SETTING_FLAGS = {"rollout": "--rollout", "align": "--align", "rac_ratio": "--rac-ratio",
                 "rac_group": "--rac-group", "rac_fold": "--rac-fold", "importance_sampling": "--is",
                 "rollout_activation_scale": "--rollout-activation-scale"}


def add_rl_arguments(p: argparse.ArgumentParser) -> None:
    # the flags RLConfig's fields declare; None, not given, leaves RLConfig's default (rac_ratio's,
    # warmstart_steps' and warmstart_seed's depend on other flags, and their help says how)
    add_flags(p, RLConfig)
    p.add_argument("--compare", metavar="SETTINGS",
                   help="run these settings on the same seeds and plot them together, e.g. "
                        "bf16,fp8,nvfp4,nvfp4+qat,nvfp4+quads (rollout[+align][@rac_ratio][+gG][+is][+static-act])")
    p.add_argument("--seeds", metavar="SEEDS",
                   help="with --compare: every setting at each of these seeds (e.g. 0,1,2; a seed "
                        "fixes the prompts, sampling and warm start), and the change in the bf16 "
                        "evaluator's held-out accuracy from step 0 against the first setting, "
                        "paired by seed (mean, sd, 95%% CI, verdict) in <folder>/seeds/")
    p.add_argument("--parallel-runs", metavar="N", type=int, default=1,
                   help="with --compare: run N runs at once, each in a process of its own (on "
                        "one GPU they share it; default: 1, one after another)")
    p.add_argument("--compare-window", metavar="N", type=int, default=None,
                   help="with --compare: the paired statistics take each run's mean over its last N "
                        "evaluations (default: 5; 1: the compared evaluation alone)")
    p.add_argument("--quick", action="store_true",
                   help="a few seconds' version of the same run (for CI): " +
                        ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    p.add_argument("--resume", action="store_true", help="continue the run folder's checkpoint")
    p.add_argument("--overwrite", action="store_true", help="start over in a folder that holds a run")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or per-step lines")


def config_from_args(args: argparse.Namespace) -> RLConfig:
    """The RLConfig the flags describe: those given, then --quick's values for the others,
    then RLConfig's defaults."""
    from lowbit.models import is_model_folder

    fields = flag_values(args, RLConfig)
    fields["progress"] = not args.no_progress
    folder = is_model_folder(fields.get("model") or RLConfig.model)
    if folder:   # a trained model: RL's gentle rate, not the presets'
        fields.setdefault("lr", MODEL_FOLDER_LR)
    if args.quick:
        quick = {k: v for k, v in QUICK.items() if k not in fields}
        if folder:
            quick.pop("warmstart_steps", None)   # a Hugging Face policy has no warm start
        fields.update(quick)
    return RLConfig(**fields)


def run_rl_command(args: argparse.Namespace) -> None:
    from lowbit.rl.compare import EVAL_WINDOW, compare_settings, format_summary, summary_rows
    from lowbit.train.compare import parse_seeds
    from lowbit.rl.trainer import run_rl
    from lowbit.train.runner import NonFiniteLossError

    named = [flag for name, flag in SETTING_FLAGS.items() if getattr(args, name, None) is not None]
    if args.compare and named:
        raise ValueError(f"each --compare setting names its own rollout (ROLLOUT[+ALIGN][@RATIO]"
                         f"[+gG][+fold][+is[-LEVEL]][+static-act], e.g. nvfp4+quads+g64+fold): drop "
                         f"{', '.join(named)}")
    config = config_from_args(args)
    seeds = None
    if args.seeds is not None:
        if not args.compare:
            raise ValueError("--seeds goes with --compare SETTINGS (the seeds of the comparison)")
        if args.seed is not None:
            raise ValueError("--seeds names the seeds of the comparison; drop --seed")
        seeds = parse_seeds(args.seeds)
    if args.compare_window is not None and not args.compare:
        raise ValueError("--compare-window goes with --compare SETTINGS (it sets the paired "
                         "statistics' average)")
    if args.parallel_runs != 1 and not args.compare:
        raise ValueError("--parallel-runs goes with --compare SETTINGS (the runs of the comparison)")
    try:
        if args.compare:
            settings = [s for s in args.compare.split(",") if s.strip()]
            results, folder = compare_settings(config, settings, overwrite=args.overwrite,
                                               resume=args.resume, seeds=seeds,
                                               parallel_runs=args.parallel_runs,
                                               window=EVAL_WINDOW if args.compare_window is None
                                               else args.compare_window)
        else:
            results = [run_rl(config, resume=args.resume, overwrite=args.overwrite)]
    except NonFiniteLossError as e:   # one line and exit code 1, as `lowbit train`'s
        print(f"lowbit: error: {e} Try a lower --lr", file=sys.stderr)
        raise SystemExit(1) from None
    print(format_summary(summary_rows([r.run_dir for r in results])), end="")
    if args.compare:
        print("\n" + (folder / "seeds" / "summary.md").read_text(), end="")
        w4a16 = folder / "seeds-w4a16"
        if w4a16.is_dir():   # a setting trains with QAT: the W4A16 evaluator's table too
            print("\n" + (w4a16 / "summary.md").read_text(), end="")
        print(f"figures and tables: {folder} (rl.png, summary.md), {folder / 'seeds'} "
              f"(seeds.png, summary.md)" + (f", {w4a16} (the same on the W4A16 evaluator)"
                                            if w4a16.is_dir() else ""))
    else:
        figure = ", rl.png" if (Path(results[0].run_dir) / "rl.png").is_file() else ""
        print(f"run folder: {results[0].run_dir} (metrics.jsonl{figure}, checkpoints/)")
