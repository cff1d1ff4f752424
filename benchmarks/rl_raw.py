"""Gather `lowbit rl --compare` folders into one raw results file for docs/results/: every run's
evaluations (own engine, bf16 and W4A16 evaluators, collapse flag) and per-step health (reward,
log-prob gap, k3, entropy, length, IS capping, routing agreement, times), and each folder's
paired tables (seeds/, seeds-w4a16/ and the per-run summary), under the results-file meta.

    python benchmarks/rl_raw.py OUT.json main=runs/m32/main replay=runs/m32/replay \\
        --date 2026-12-06 --commit 0c405a9 --machine "one H100" --command "bash benchmarks/quads_moe.sh DIR" \\
        [--notes "..."]

Keys are <label>/<run folder>; per_step["step"] names each entry's step. A path to a run folder,
in whatever form a comparison wrote it, becomes the folder's name: no path of the machine the
runs were on is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lowbit.files import write_text_atomic
from lowbit.rl.config import RLConfig
from lowbit.train.metrics import read_metrics
from lowbit.train.run_dir import RunDir

CONFIG_KEYS = ("rollout", "align", "rac_ratio", "rac_group", "rac_fold", "importance_sampling",
               "rollout_activation_scale", "lr",
               "steps", "eval_every", "eval_problems", "max_completion_length", "routing_replay", "n_experts",
               "task", "task_size", "seed", "eval_w4a16")
EVAL_KEYS = {"accuracy_own_engine": "eval/accuracy", "accuracy_bf16": "eval/accuracy_bf16",
             "accuracy_w4a16": "eval/accuracy_w4a16", "collapsed": "eval/collapsed"}
STEP_KEYS = {"reward": "reward", "logp_gap_mean": "sampling/sampling_logp_difference/mean",
             "logp_gap_max": "sampling/sampling_logp_difference/max", "kl_k3": "sampling/kl_k3",
             "entropy": "entropy", "completion_length": "completions/mean_length",
             "is_ratio_capped_frac": "sampling/importance_sampling_ratio/capped_frac",
             "routing_agreement": "routing/agreement", "generate_s": "time/generate_s", "train_s": "time/train_s",
             "sync_s": "time/sync_s"}


def rounded(value, digits: int = 5):
    return round(value, digits) if isinstance(value, float) else value


def run_record(run_dir: Path) -> dict:
    """One run folder's config (the keys above), evaluations and per-step health."""
    config = RunDir(run_dir).config_record()
    records = read_metrics(run_dir)   # each step once: a resume rewrites it to the checkpoint's
    train = [r for r in records if r.get("event") == "train"]
    evals = [r for r in records if r.get("event") == "eval"]
    return {
        "setting": RLConfig.from_dict(config).setting,
        "seed": config.get("seed"),
        "config": {k: config[k] for k in CONFIG_KEYS if k in config},
        "steps_run": train[-1]["step"] if train else 0,
        "first_step": train[0]["step"] if train else None,
        "evals": [{"step": e["step"], **{k: e.get(src) for k, src in EVAL_KEYS.items()}} for e in evals],
        "per_step": {"step": [r["step"] for r in train],
                     **{k: [rounded(r.get(src)) for r in train] for k, src in STEP_KEYS.items()}},
    }


def comparison_record(folder: Path) -> dict:
    """The paired tables a `lowbit rl --compare` folder wrote (compare-<task>/...), by name."""
    out = {}
    for compare in sorted(folder.glob("compare-*")):
        for name, path in (("seeds", compare / "seeds" / "summary.json"),
                           ("seeds-w4a16", compare / "seeds-w4a16" / "summary.json"),
                           ("per_run_summary", compare / "summary.json")):
            if path.is_file():
                out[name] = json.loads(path.read_text())
    return out


def without_paths(value, names: set[str]):
    """value with every string that is a path to one of the run folders `names` (in whatever
    form the comparison wrote it: relative, absolute) replaced by the folder's name."""
    if isinstance(value, dict):
        return {k: without_paths(v, names) for k, v in value.items()}
    if isinstance(value, list):
        return [without_paths(v, names) for v in value]
    if isinstance(value, str) and "/" in value and Path(value).name in names:
        return Path(value).name
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the results file to write (.json)")
    p.add_argument("folders", nargs="+", metavar="LABEL=DIR", help="`lowbit rl --compare` output folders")
    for flag in ("date", "commit", "machine", "command"):
        p.add_argument(f"--{flag}", required=True)
    p.add_argument("--notes", default=None)
    args = p.parse_args(argv)
    if not Path(args.out).resolve().parent.is_dir():
        p.error(f"{args.out}: its folder does not exist; create it or write the file elsewhere")
    runs, comparisons = {}, {}
    for item in args.folders:
        label, sep, path = item.partition("=")
        folder = Path(path)
        if not sep or not label or not folder.is_dir():
            p.error(f"{item!r} is not LABEL=DIR with DIR a folder; give e.g. main=runs/m32/main")
        found = sorted(d for d in folder.glob("rl-*") if (d / "config.json").is_file())
        if not found:
            p.error(f"{folder} holds no rl-* run folders; give a `lowbit rl --compare` output folder")
        try:   # a run folder or table that is not what lowbit rl writes: one line, nothing written
            for run_dir in found:
                runs[f"{label}/{run_dir.name}"] = run_record(run_dir)
            comparisons[label] = comparison_record(folder)
        except (ValueError, KeyError, TypeError) as e:
            p.error(f"{folder}: {e}")
    meta = {"date": args.date, "commit": args.commit, "machine": args.machine, "command": args.command}
    if args.notes:
        meta["notes"] = args.notes
    names = {key.split("/", 1)[1] for key in runs}
    results = without_paths({"runs": runs, "comparisons": comparisons}, names)
    write_text_atomic(args.out, json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print(f"{args.out}: {len(runs)} runs, comparisons {', '.join(comparisons)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
