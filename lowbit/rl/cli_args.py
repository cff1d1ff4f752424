"""`lowbit rl`: its flags (RLConfig's fields) and what it runs.

Value flags default to None, meaning "RLConfig's default" (shown in --help), so that
config_from_args can tell what the user set: a flag given explicitly wins over --quick's value.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from lowbit.rl.config import ALIGNMENTS, RLConfig
from lowbit.rl.grpo import IS_LEVELS, IS_MODES, LOSS_TYPES, SCALE_REWARDS
from lowbit.rl.precision import Precision

__all__ = ["add_rl_arguments", "run_rl_command", "config_from_args", "QUICK"]

# --quick: the same pipeline at a size CI runs in seconds
QUICK = dict(warmstart_steps=20, steps=3, prompts_per_step=2, num_generations=4,
             eval_problems=8, eval_every=2, checkpoint_every=2, max_completion_length=4)

_FLAGS = {  # flag -> (RLConfig field, type, help)
    "--model": ("model", str, "policy: a preset of lowbit.models, or PATH of a Hugging Face model "
                              "folder (its weights and tokenizer; no warm start) (default: %(default)s)"),
    "--n-layers": ("n_layers", int, "override the preset's depth"),
    "--dim": ("dim", int, "override the preset's width"),
    "--n-experts": ("n_experts", int, "MoE policy with this many experts (top-2); 0: dense"),
    "--warmstart-steps": ("warmstart_steps", int, "supervised steps before RL, cached (default: 150; "
                                                  "none for a Hugging Face --model PATH)"),
    "--warmstart-seed": ("warmstart_seed", int, "seed of the warm start (default: --seed)"),
    "--warmstart-lr": ("warmstart_lr", float, "peak learning rate of the warm start (default: %(default)s)"),
    "--warmstart-target": ("warmstart_target", float, "stop the warm start once the bf16 engine's greedy "
                           "accuracy on 256 validation problems reaches this (e.g. 0.3; default: "
                           "train all --warmstart-steps)"),
    "--task": ("task", str, "add, mul, countdown or gsm8k (default: %(default)s)"),
    "--task-size": ("task_size", int, "digits (add, mul) or numbers (countdown) (default: %(default)s)"),
    "--data-dir": ("data_dir", str, "folder holding gsm8k/"),
    "--rollout": ("rollout", str, f"engine precision: {', '.join(p.value for p in Precision)} (default: %(default)s)"),
    "--align": ("align", str, f"trainer/engine alignment: {', '.join(ALIGNMENTS)} (default: %(default)s)"),
    "--rollout-activation-scale": ("rollout_activation_scale", str,
                                   "NVFP4 rollouts' activation scale: per-token (a power-of-two "
                                   "scale per token) or static (a served NVFP4 checkpoint's: one "
                                   "calibrated FP32 scale per linear, recalibrated at each weight "
                                   "sync) (default: %(default)s)"),
    "--rac-ratio": ("rac_ratio", float, "fraction of input channels RAC compensates (default: 0.25 under quads, else 0)"),
    "--num-generations": ("num_generations", int, "completions per prompt (default: %(default)s)"),
    "--prompts-per-step": ("prompts_per_step", int, "prompts per step (default: %(default)s)"),
    "--max-completion-length": ("max_completion_length", int, "new tokens per completion at most (default: %(default)s)"),
    "--temperature": ("temperature", float, "sampling temperature (default: %(default)s)"),
    "--top-p": ("top_p", float, "nucleus sampling (default: %(default)s)"),
    "--top-k": ("top_k", int, "top-k sampling, 0: off (default: %(default)s)"),
    "--loss-type": ("loss_type", str, f"{', '.join(LOSS_TYPES)} (default: %(default)s)"),
    "--epsilon": ("epsilon", float, "lower PPO clip (default: %(default)s)"),
    "--epsilon-high": ("epsilon_high", float, "upper PPO clip (default: %(default)s)"),
    "--beta": ("beta", float, "weight of the k3 KL to the warm-start policy (default: %(default)s)"),
    "--scale-rewards": ("scale_rewards", str, f"{', '.join(SCALE_REWARDS)} (default: %(default)s)"),
    "--num-iterations": ("num_iterations", int, "optimizer steps per batch of rollouts (default: %(default)s)"),
    "--is": ("importance_sampling", str, f"mismatch correction: {', '.join(IS_LEVELS)} (default: %(default)s)"),
    "--is-mode": ("is_mode", str, f"{', '.join(IS_MODES)} (default: %(default)s)"),
    "--is-cap": ("is_cap", float, "importance-weight cap C (default: %(default)s)"),
    "--lr": ("lr", float, "AdamW learning rate, constant (default: %(default)s)"),
    "--steps": ("steps", int, "RL steps (default: %(default)s)"),
    "--eval-every": ("eval_every", int, "held-out accuracy every N steps (default: %(default)s)"),
    "--eval-problems": ("eval_problems", int, "size of the held-out set (default: %(default)s)"),
    "--checkpoint-every": ("checkpoint_every", int, "checkpoint every N steps (default: %(default)s)"),
    "--seed": ("seed", int, "seed of prompts, sampling and (unless --warmstart-seed) the warm start (default: %(default)s)"),
    "--device": ("device", str, "trainer device: auto, cpu, cuda, cuda:N (default: %(default)s)"),
    "--engine-device": ("engine_device", str, "rollout engine's device (default: the trainer's)"),
    "--out-dir": ("out_dir", str, "parent folder of run folders (default: %(default)s)"),
    "--run-name": ("run_name", str, "run folder name (default: from the settings)"),
}


def add_rl_arguments(p: argparse.ArgumentParser) -> None:
    defaults = RLConfig()
    for flag, (field, kind, text) in _FLAGS.items():
        # None: not given (RLConfig fills in its default; rac_ratio's, warmstart_steps' and
        # warmstart_seed's depend on other flags, and their help says how)
        shown = str(getattr(defaults, field)).replace("%", "%%")
        p.add_argument(flag, dest=field, type=kind, default=None,
                       help=text.replace("%(default)s", shown))
    p.add_argument("--mask-truncated-completions", action="store_true",
                   help="leave completions that hit --max-completion-length out of the loss")
    p.add_argument("--routing-replay", action="store_true",
                   help="MoE: the trainer replays the engine's expert choices")
    p.add_argument("--compile-decode", action="store_true",
                   help="compile the rollout engine's decode step (torch.compile; dense policies): "
                        "a minute of compiling per batch size, faster decode after")
    p.add_argument("--packed-gemm", action="store_true",
                   help="NVFP4 rollouts: multiply the packed weights on the tiled NVFP4 kernel "
                        "(faster than bf16 at 8-32 rows on an H200, slower at 1 and 128; 0.4x "
                        "its memory) instead of a dequantized bf16 copy")
    p.add_argument("--compare", metavar="SETTINGS",
                   help="run these settings on the same seeds and plot them together, e.g. "
                        "bf16,fp8,nvfp4,nvfp4+qat,nvfp4+quads (rollout[+align][@rac_ratio][+is])")
    p.add_argument("--seeds", metavar="SEEDS",
                   help="with --compare: every setting at each of these seeds (e.g. 0,1,2; a seed "
                        "fixes the prompts, sampling and warm start), and the change in the bf16 "
                        "evaluator's held-out accuracy from step 0 against the first setting, "
                        "paired by seed (mean, sd, 95%% CI, verdict) in <folder>/seeds/")
    p.add_argument("--quick", action="store_true",
                   help="a few seconds' version of the same run (for CI): " +
                        ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    p.add_argument("--resume", action="store_true", help="continue the run folder's checkpoint")
    p.add_argument("--overwrite", action="store_true", help="start over in a folder that holds a run")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or per-step lines")


def config_from_args(args: argparse.Namespace) -> RLConfig:
    """The RLConfig the flags describe: those given, then --quick's values for the others,
    then RLConfig's defaults."""
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(RLConfig)
              if getattr(args, f.name, None) is not None}
    fields["progress"] = not args.no_progress
    if args.quick:
        from lowbit.models import is_model_folder
        quick = {k: v for k, v in QUICK.items() if k not in fields}
        if is_model_folder(fields.get("model") or RLConfig.model):
            quick.pop("warmstart_steps", None)   # a Hugging Face policy has no warm start
        fields.update(quick)
    return RLConfig(**fields)


def run_rl_command(args: argparse.Namespace) -> None:
    from lowbit.rl.compare import compare_settings, format_summary, summary_rows
    from lowbit.train.compare import parse_seeds
    from lowbit.rl.trainer import run_rl
    from lowbit.train.loop import NonFiniteLossError

    config = config_from_args(args)
    seeds = None
    if args.seeds is not None:
        if not args.compare:
            raise ValueError("--seeds goes with --compare SETTINGS (the seeds of the comparison)")
        if args.seed is not None:
            raise ValueError("--seeds names the seeds of the comparison; drop --seed")
        seeds = parse_seeds(args.seeds)
    try:
        if args.compare:
            settings = [s for s in args.compare.split(",") if s.strip()]
            results, folder = compare_settings(config, settings, overwrite=args.overwrite,
                                               resume=args.resume, seeds=seeds)
        else:
            results = [run_rl(config, resume=args.resume, overwrite=args.overwrite)]
    except NonFiniteLossError as e:   # one line and exit code 1, as `lowbit train`'s
        print(f"lowbit: error: {e} Try a lower --lr", file=sys.stderr)
        raise SystemExit(1) from None
    print(format_summary(summary_rows([r.run_dir for r in results])), end="")
    if args.compare:
        print("\n" + (folder / "seeds" / "summary.md").read_text(), end="")
        print(f"figures and tables: {folder} (rl.png, summary.md), {folder / 'seeds'} "
              f"(seeds.png, summary.md)")
    else:
        print(f"run folder: {results[0].run_dir} (metrics.jsonl, rl.png, checkpoints/)")
