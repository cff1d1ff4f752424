"""Train several recipes side by side on one GPU (parallel processes), same tokens and seed.

    python benchmarks/train_recipes.py --name english-small --recipes bf16,mxfp4,nvfp4,stable-fp4 \
        --deadline-min 8 -- --model small --corpus english --tokenizer bpe --steps 900 ...

Everything after `--` is passed to every `lowbit train` run (plus --recipe and --run-name).
The data is tokenized once before the runs start. Runs still going at the deadline are
stopped; the comparison then uses the last evaluation step every run reached (equal tokens).

--fit-min M sizes the schedule to the machine instead of --steps: every recipe first trains
for --probe-s seconds, all in parallel as in the real runs (no evaluation or diagnostics),
and the slowest recipe's step time over the probe's last --probe-window-s seconds (after
Triton's first compilations, which a cold cache makes slow), its start-up time and the
evaluation and diagnostic costs set --steps (a multiple of --eval-every) so that it ends in
about M minutes. The full cosine schedule then runs to its end, which a deadline alone
cannot give. The probe's logs go into runs.tar.gz with the runs.
Writes <out>/<name>/: summary.md, summary.json, loss.png, gradbias.png, gap.png (each
recipe's validation-loss gap to the first recipe, per evaluation), runs.tar.gz (each run's
config, metrics and final numbers); with $OUT set, copies them there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--recipes", required=True)
    parser.add_argument("--out-dir", default="runs")
    parser.add_argument("--deadline-min", type=float, default=8.0)
    parser.add_argument("--fit-min", type=float, default=None,
                        help="choose --steps so the slowest recipe ends in about this many minutes")
    parser.add_argument("--probe-s", type=float, default=75.0)
    parser.add_argument("--probe-window-s", type=float, default=30.0)
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    train_args = [a for a in args.train_args if a != "--"]
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    from lowbit.recipes import recipe_names
    unknown = [r for r in recipes if r not in recipe_names()]
    if not recipes or unknown:
        parser.error(f"unknown recipe(s) {', '.join(unknown) or '(none given)'}; choose from "
                     f"{', '.join(recipe_names())}")
    out = Path(args.out_dir)
    t0 = time.time()

    out.mkdir(parents=True, exist_ok=True)
    config, epoch_tokens = prepare_data(train_args)
    print(f"data ready in {time.time() - t0:.0f} s", flush=True)
    if args.fit_min is not None:
        steps = fit_steps(config, recipes, train_args, out, args.name, args.fit_min, args.probe_s,
                          args.probe_window_s, epoch_tokens)
        train_args = [*train_args, "--steps", str(steps)]
    deadline = t0 + args.deadline_min * 60
    run_parallel({r: f"{args.name}-{r}" for r in recipes}, train_args, out, deadline)
    summarize(args.name, recipes, out)
    print(f"total {time.time() - t0:.0f} s", flush=True)


def run_parallel(runs: dict[str, str], train_args: list[str], out: Path, deadline: float) -> None:
    """Start `lowbit train` for each recipe -> run name at once; stop those still going at the
    deadline (SIGTERM to the process group)."""
    procs = {}
    for recipe, run in runs.items():
        log = open(out / f"{run}.log", "w")
        cmd = [sys.executable, "-m", "lowbit.cli", "train", *train_args, "--recipe", recipe,
               "--run-name", run, "--out-dir", str(out), "--no-progress", "--overwrite"]
        procs[recipe] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True), log)
    while any(p.poll() is None for p, _ in procs.values()) and time.time() < deadline:
        time.sleep(2)
    for recipe, (p, log) in procs.items():
        if p.poll() is None:
            print(f"{runs[recipe]}: stopped at the deadline", flush=True)
            os.killpg(p.pid, signal.SIGTERM)
        p.wait()
        log.close()


def fit_steps(config, recipes: list[str], train_args: list[str], out: Path, name: str,
              minutes: float, probe_s: float, window_s: float, epoch_tokens: int) -> int:
    """Train every recipe in parallel for probe_s seconds and return the --steps that lets the
    slowest one finish in `minutes` (see the module doc)."""
    t0 = time.time()
    # as many steps as 3 epochs allow (more would warn of overfitting); the probe ends first
    probe_steps = max(50, 3 * epoch_tokens // config.tokens_per_step)
    probe_args = [*train_args, "--steps", str(probe_steps), "--eval-every", "0", "--log-every", "1",
                  "--checkpoint-every", "0", "--no-diagnostics"]
    runs = {r: f"{name}-{r}-probe" for r in recipes}
    run_parallel(runs, probe_args, out, t0 + probe_s)
    worst_step, worst_start = 0.0, 0.0
    for recipe, run in runs.items():
        log = out / f"{run}.log"
        records = [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines()
                   if '"event": "train"' in line] if (out / run / "metrics.jsonl").exists() else []
        if len(records) < 4:
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise SystemExit(f"probe: {recipe} made {len(records)} steps in {probe_s:.0f} s; "
                             f"raise --probe-s or shrink the model. Its log ends:\n{tail}")
        # the steps that ended in the last window_s seconds (at least the last 3)
        ends, total = [], 0.0
        for r in records:
            total += r["step_time_s"]
            ends.append(total)
        late = [r["step_time_s"] for r, end in zip(records, ends) if end > total - window_s]
        times = sorted(late if len(late) >= 3 else [r["step_time_s"] for r in records[-3:]])
        step_s = times[len(times) // 2]
        start_s = probe_s - total
        print(f"probe {recipe}: {len(records)} steps, median {step_s * 1e3:.0f} ms/step over the "
              f"last {len(times)} (all {len(recipes)} in parallel; first step "
              f"{records[0]['step_time_s']:.1f} s), start-up {start_s:.0f} s", flush=True)
        worst_step, worst_start = max(worst_step, step_s), max(worst_start, start_s)
        shutil.copy(out / run / "metrics.jsonl", out / f"{run}.metrics.jsonl")
        shutil.rmtree(out / run, ignore_errors=True)
    every = config.eval_every or 1
    # an evaluation batch is a forward pass (~1/3 of a step); a diagnostic ~3 steps
    per_step = worst_step * (1 + config.eval_batches / (3 * every)
                             + (3 / config.diag_every if config.diagnostics and config.diag_every else 0))
    budget = minutes * 60 - worst_start - 2 * config.eval_batches * worst_step
    steps = int(budget / per_step) // every * every
    if steps < every:
        raise SystemExit(f"probe: {worst_step * 1e3:.0f} ms/step leaves no room for {every} steps "
                         f"in {minutes} min")
    print(f"fitted --steps {steps} ({steps * config.tokens_per_step / 1e6:.1f}M tokens a run) "
          f"in {time.time() - t0:.0f} s of probing", flush=True)
    return steps


def prepare_data(train_args: list[str]):
    """Tokenize (and train the BPE) once, so the parallel runs read the cache; returns the
    runs' TrainConfig."""
    from lowbit.data import load_dataset
    from lowbit.train.cli_args import add_train_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_train_arguments(p)
    config = config_from_args(p.parse_args(train_args))
    data = load_dataset(config.corpus, tokenizer=config.tokenizer, vocab_size=config.bpe_vocab_size,
                        data_dir=config.data_dir, max_bytes=config.corpus_max_bytes)
    return config, data.tokens_per_epoch


def read_run(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()] if (run_dir / "metrics.jsonl").exists() else []
    final = json.loads((run_dir / "final.json").read_text()) if (run_dir / "final.json").exists() else None
    return {"records": records, "final": final}


def summarize(name: str, recipes: list[str], out: Path) -> None:
    from lowbit.train.plot import plot_runs

    runs = {r: read_run(out / f"{name}-{r}") for r in recipes}
    evals = {r: {e["step"]: e for e in d["records"] if e.get("event") == "eval"} for r, d in runs.items()}
    common = set.intersection(*(set(e) for e in evals.values())) if evals else set()
    step = max(common) if common else None
    base = evals[recipes[0]].get(step) if step is not None else None
    rows = []
    for r in recipes:
        d, e = runs[r], evals[r].get(step) if step is not None else None
        train = [x for x in d["records"] if x.get("event") == "train"]
        diag = [x for x in d["records"] if x.get("event") == "diagnostics"]
        skips = sum(1 for x in d["records"] if x.get("event") == "nonfinite_skip")
        mean = lambda key: (sum(x[key] for x in diag if key in x) / max(1, sum(key in x for x in diag))
                            if any(key in x for x in diag) else None)
        rows.append({
            "recipe": r, "steps_done": train[-1]["step"] if train else 0,
            "finished": d["final"] is not None,
            "val_loss": e["val_loss"] if e else None,
            "gap_pct": (e["val_loss"] - base["val_loss"]) / base["val_loss"] * 100 if e and base else None,
            "tokens_per_s": train[-1]["tokens_per_s"] if train else None,
            "nonfinite_skips": skips,
            "dw_cos": mean("diag/dw_cos"), "dx_cos": mean("diag/dx_cos"),
            "w_fwd_bwd_rel_diff": mean("diag/w_fwd_bwd_rel_diff"), "clip_x": mean("diag/clip_x"),
        })
    fmt = lambda v, f: "—" if v is None else format(v, f)
    lines = [f"Comparison at step {step} (the last evaluation every run reached).", "",
             "| recipe | val loss | gap vs " + recipes[0] + " | steps | tok/s (last) | dW cos | dX cos | "
             "W fwd/bwd diff | X clipped | NaN skips |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        lines.append(f"| {row['recipe']} | {fmt(row['val_loss'], '.4f')} | {fmt(row['gap_pct'], '+.2f')}% | "
                     f"{row['steps_done']}{'' if row['finished'] else ' (stopped)'} | "
                     f"{fmt(row['tokens_per_s'], ',.0f')} | {fmt(row['dw_cos'], '.4f')} | "
                     f"{fmt(row['dx_cos'], '.4f')} | {fmt(row['w_fwd_bwd_rel_diff'], '.4f')} | "
                     f"{fmt(row['clip_x'], '.4f')} | {row['nonfinite_skips']} |")
    table = "\n".join(lines) + "\n"
    dest = out / name
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "summary.md").write_text(table)
    (dest / "summary.json").write_text(json.dumps({"step": step, "rows": rows}, indent=2))
    run_dirs = [out / f"{name}-{r}" for r in recipes if (out / f"{name}-{r}" / "metrics.jsonl").exists()]
    try:
        plot_runs(run_dirs, dest / "loss.png", title=f"{name}: validation loss")
    except Exception as e:  # a plot must not lose the numbers
        print(f"loss plot failed: {e}")
    plot_gradient_bias(runs, dest / "gradbias.png", name)
    plot_gaps(evals, recipes, dest / "gap.png", name)
    with tarfile.open(dest / "runs.tar.gz", "w:gz") as tar:
        for r in recipes:
            run_dir = out / f"{name}-{r}"
            for f in ("config.json", "metrics.jsonl", "final.json"):
                if (run_dir / f).exists():
                    tar.add(run_dir / f, arcname=f"{name}-{r}/{f}")
            if (out / f"{name}-{r}.log").exists():
                tar.add(out / f"{name}-{r}.log", arcname=f"{name}-{r}/train.log")
            for f in (f"{name}-{r}-probe.log", f"{name}-{r}-probe.metrics.jsonl"):
                if (out / f).exists():
                    tar.add(out / f, arcname=f"probe/{f}")
    print(table, flush=True)
    if os.environ.get("OUT"):
        target = Path(os.environ["OUT"]) / name
        target.mkdir(parents=True, exist_ok=True)
        for f in ("summary.md", "summary.json", "loss.png", "gradbias.png", "gap.png", "runs.tar.gz"):
            if (dest / f).exists():
                shutil.copy(dest / f, target / f)


def plot_gaps(evals: dict, recipes: list[str], path: Path, name: str) -> None:
    """Validation-loss gap of every recipe to the first (the baseline), in %, per evaluation
    step both reached: at equal tokens the curves a loss plot draws on top of each other."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = evals[recipes[0]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for recipe in recipes[1:]:
        steps = sorted(s for s in evals[recipe] if s in base and s > 0)
        gaps = [(evals[recipe][s]["val_loss"] / base[s]["val_loss"] - 1) * 100 for s in steps]
        ax.plot(steps, gaps, marker="o", ms=3, label=recipe)
    ax.axhline(0, color="black", lw=0.8)
    ax.set(title=f"{name}: validation loss vs {recipes[0]}", xlabel="step",
           ylabel=f"gap to {recipes[0]} (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_gradient_bias(runs: dict, path: Path, name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for recipe, d in runs.items():
        diag = [x for x in d["records"] if x.get("event") == "diagnostics" and "diag/dw_cos" in x]
        if not diag:
            continue
        steps = [x["step"] for x in diag]
        axes[0].plot(steps, [x["diag/dw_cos"] for x in diag], label=recipe)
        axes[1].plot(steps, [x.get("diag/w_fwd_bwd_rel_diff", math.nan) for x in diag], label=recipe)
    axes[0].set(title="dW cosine vs BF16 (same batch)", xlabel="step")
    axes[1].set(title="||W_fprop - W_dgrad|| / ||W_fprop||", xlabel="step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
