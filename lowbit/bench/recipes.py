"""`lowbit bench recipes`: several recipes trained side by side on one GPU, one `lowbit train`
process each, on the same tokens and seed; then one table and plots.

    lowbit bench recipes --name english-small --recipes bf16,mxfp4,nvfp4,stable-fp4 \\
        --deadline-min 8 -- --model small --corpus english --tokenizer bpe --steps 900
    lowbit bench recipes --name smoke --recipes bf16,stable-fp4 --out /tmp/runs \\
        -- --model tiny --seq-len 32 --batch-size 2 --steps 4 --device cpu      # CPU smoke

Everything after `--` is passed to every `lowbit train` run, which this adds --recipe,
--run-name NAME-<recipe> and --out-dir to. The flags are checked, the recipes looked up and
the data tokenized once (so the parallel runs read the cache) before any run starts. Runs
still going at the deadline (counted from the start) are stopped; the comparison then uses
the last evaluation step every run reached (equal tokens).

--fit-min M sizes the schedule to the machine instead of --steps: every recipe first trains
for --probe-s seconds, all in parallel as in the real runs (no evaluation or diagnostics), and
the slowest recipe's step time over the probe's last --probe-window-s seconds (after Triton's
first compilations, which a cold cache makes slow), its start-up time and the evaluation and
diagnostic costs set --steps (a multiple of --eval-every) so that it ends in about M minutes.
The full cosine schedule then runs to its end, which a deadline alone cannot give.

Writes OUT/NAME-<recipe>/ (each run folder, and its log beside it) and OUT/NAME/: summary.md,
summary.json, loss.png, gradbias.png (dW cosine to BF16 and the forward/backward weight
difference, from each run's diagnostics), gap.png (each recipe's validation-loss gap to the
first, per evaluation) and runs.tar.gz (each run's config, metrics, final numbers and log, and
the probe's). Measured comparisons: docs/results/stable-fp4.md.
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

__all__ = ["compare_recipes", "check_train_args", "run_parallel", "fit_steps", "summarize"]

# flags of `lowbit train` that this sets for every run, or that do not make sense here
_OWN_FLAGS = ("--recipe", "--run-name", "--out-dir", "--compare", "--resume")


class _TrainArgsParser(argparse.ArgumentParser):
    def error(self, message):  # one line through lowbit's CLI, not argparse's usage and exit
        raise ValueError(f"in the `lowbit train` flags after --: {message}")


def check_train_args(train_args: list[str]):
    """The TrainConfig the `lowbit train` flags describe (without --recipe); a bad flag, or one
    of those this command sets itself, is refused in one line (ValueError)."""
    from lowbit.train.cli_args import add_train_arguments, config_from_args

    own = [a for a in train_args if a.split("=")[0] in _OWN_FLAGS]
    if own:
        raise ValueError(f"lowbit bench recipes sets {', '.join(_OWN_FLAGS)} itself; drop "
                         f"{', '.join(own)} from the flags after --")
    parser = _TrainArgsParser(prog="lowbit train", add_help=False)
    add_train_arguments(parser)
    return config_from_args(parser.parse_args(train_args))


def compare_recipes(name: str, recipes: str, train_args: list[str], *, out: str = "runs",
                    deadline_min: float = 8.0, fit_min: float | None = None,
                    probe_s: float = 75.0, probe_window_s: float = 30.0,
                    progress=print) -> dict:
    """Run the comparison of the module doc; returns summary.json's content."""
    from lowbit.recipes import recipe_names
    from lowbit.train.build import build_data

    t0 = time.time()
    train_args = [a for a in train_args if a != "--"]
    names = [r.strip() for r in recipes.split(",") if r.strip()]
    unknown = [r for r in names if r not in recipe_names()]
    if not names or unknown:
        raise ValueError(f"unknown recipe(s) {', '.join(unknown) or '(none given)'}; choose "
                         f"from {', '.join(recipe_names())}")
    if len(set(names)) != len(names):
        raise ValueError(f"--recipes names a recipe twice: {recipes}")
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"--name must be a folder name, got {name!r}")
    if deadline_min <= 0 or (fit_min is not None and fit_min <= 0) or probe_s <= 0:
        raise ValueError("--deadline-min, --fit-min and --probe-s must be > 0")
    config = check_train_args(train_args)
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    data = build_data(config)          # tokenized (and the BPE trained) once, then cached
    progress(f"data ready in {time.time() - t0:.0f} s")
    if fit_min is not None:
        steps = fit_steps(config, names, train_args, out=root, name=name, minutes=fit_min,
                          probe_s=probe_s, window_s=probe_window_s,
                          epoch_tokens=data.tokens_per_epoch, progress=progress)
        train_args = [*train_args, "--steps", str(steps)]
    run_parallel({r: f"{name}-{r}" for r in names}, train_args, root, t0 + deadline_min * 60,
                 progress)
    summary = summarize(name, names, root, progress)
    progress(f"total {time.time() - t0:.0f} s")
    return summary


def run_parallel(runs: dict[str, str], train_args: list[str], out: Path, deadline: float,
                 progress=print) -> None:
    """Start `lowbit train` for each recipe -> run name at once, each in its own process group
    with its log at OUT/<run>.log; stop those still going at the deadline (time.time()) with
    SIGTERM to their group."""
    procs = {}
    for recipe, run in runs.items():
        log = open(out / f"{run}.log", "w")
        cmd = [sys.executable, "-m", "lowbit.cli", "train", *train_args, "--recipe", recipe,
               "--run-name", run, "--out-dir", str(out), "--no-progress", "--overwrite"]
        procs[recipe] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True), log)
    while any(p.poll() is None for p, _ in procs.values()) and time.time() < deadline:
        time.sleep(1)
    for recipe, (p, log) in procs.items():
        if p.poll() is None:
            progress(f"{runs[recipe]}: stopped at the deadline")
            os.killpg(p.pid, signal.SIGTERM)
        p.wait()
        log.close()


def _train_records(run_dir: Path) -> list[dict]:
    from lowbit.train.metrics import read_metrics

    if not (run_dir / "metrics.jsonl").exists():
        return []
    return [r for r in read_metrics(run_dir) if r.get("event") == "train"]


def fit_steps(config, recipes: list[str], train_args: list[str], *, out: Path, name: str,
              minutes: float, probe_s: float, window_s: float, epoch_tokens: int,
              progress=print) -> int:
    """Train every recipe in parallel for probe_s seconds and return the --steps that lets the
    slowest one finish in `minutes` (see the module doc). The probes' metrics and logs stay in
    OUT as <name>-<recipe>-probe.{metrics.jsonl,log}."""
    t0 = time.time()
    # as many steps as 3 epochs allow (more would warn of overfitting); the probe ends first
    probe_steps = max(50, 3 * epoch_tokens // config.tokens_per_step)
    probe_args = [*train_args, "--steps", str(probe_steps), "--eval-every", "0", "--log-every",
                  "1", "--checkpoint-every", "0", "--no-diagnostics"]
    runs = {r: f"{name}-{r}-probe" for r in recipes}
    run_parallel(runs, probe_args, out, t0 + probe_s, progress)
    worst_step, worst_start = 0.0, 0.0
    for recipe, run in runs.items():
        records = _train_records(out / run)
        if len(records) < 4:
            log = out / f"{run}.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise ValueError(f"the probe of {recipe} made {len(records)} steps in {probe_s:.0f} "
                             f"s; raise --probe-s or shrink the model. Its log ends: "
                             f"{' | '.join(tail.splitlines()[-5:])}")
        # the steps that ended in the last window_s seconds (at least the last 3)
        ends, total = [], 0.0
        for r in records:
            total += r["step_time_s"]
            ends.append(total)
        late = [r["step_time_s"] for r, end in zip(records, ends) if end > total - window_s]
        times = sorted(late if len(late) >= 3 else [r["step_time_s"] for r in records[-3:]])
        step_s = times[len(times) // 2]
        start_s = probe_s - total
        progress(f"probe {recipe}: {len(records)} steps, median {step_s * 1e3:.0f} ms/step over "
                 f"the last {len(times)} (all {len(recipes)} in parallel; first step "
                 f"{records[0]['step_time_s']:.1f} s), start-up {start_s:.0f} s")
        worst_step, worst_start = max(worst_step, step_s), max(worst_start, start_s)
        shutil.copy(out / run / "metrics.jsonl", out / f"{run}.metrics.jsonl")
        shutil.rmtree(out / run, ignore_errors=True)
    every = config.eval_every or 1
    # an evaluation batch is a forward pass (~1/3 of a step); a diagnostic ~3 steps
    per_step = worst_step * (1 + config.eval_batches / (3 * every)
                             + (3 / config.diag_every
                                if config.diagnostics and config.diag_every else 0))
    budget = minutes * 60 - worst_start - 2 * config.eval_batches * worst_step
    steps = int(budget / per_step) // every * every
    if steps < every:
        raise ValueError(f"the probe's {worst_step * 1e3:.0f} ms/step leaves no room for "
                         f"{every} steps in {minutes} min; raise --fit-min")
    progress(f"fitted --steps {steps} ({steps * config.tokens_per_step / 1e6:.1f}M tokens a "
             f"run) in {time.time() - t0:.0f} s of probing")
    return steps


def _number(value) -> float | None:
    """A metric as a float; None for a missing one (non-finite ones are logged as strings)."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _read_run(run_dir: Path) -> dict:
    from lowbit.train.metrics import read_metrics
    from lowbit.train.run_dir import RunDir

    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    return {"records": records, "final": RunDir(run_dir).final_record()}


def summarize(name: str, recipes: list[str], out: Path, progress=print) -> dict:
    """Write OUT/NAME/'s table, plots and archive from the run folders; returns the summary
    ({"step": the last evaluation step every run reached, "rows": one per recipe})."""
    from lowbit.train.plot import plot_runs

    runs = {r: _read_run(out / f"{name}-{r}") for r in recipes}
    evals = {r: {e["step"]: e for e in d["records"] if e.get("event") == "eval"}
             for r, d in runs.items()}
    common = set.intersection(*(set(e) for e in evals.values()))
    step = max(common) if common else None
    base = evals[recipes[0]].get(step) if step is not None else None
    rows = []
    for r in recipes:
        d, e = runs[r], evals[r].get(step) if step is not None else None
        train = [x for x in d["records"] if x.get("event") == "train"]
        diag = [x for x in d["records"] if x.get("event") == "diagnostics"]

        def mean(key):
            values = [v for v in (_number(x.get(key)) for x in diag) if v is not None]
            return sum(values) / len(values) if values else None

        val = _number(e["val_loss"]) if e else None
        base_val = _number(base["val_loss"]) if base else None
        rows.append({
            "recipe": r, "steps_done": train[-1]["step"] if train else 0,
            "finished": d["final"] is not None, "val_loss": val,
            "gap_pct": (val - base_val) / base_val * 100 if val is not None and base_val else None,
            "tokens_per_s": _number(train[-1].get("tokens_per_s")) if train else None,
            "nonfinite_skips": sum(1 for x in d["records"] if x.get("event") == "nonfinite_skip"),
            "dw_cos": mean("diag/dw_cos"), "dx_cos": mean("diag/dx_cos"),
            "w_fwd_bwd_rel_diff": mean("diag/w_fwd_bwd_rel_diff"), "clip_x": mean("diag/clip_x"),
        })
    table = format_summary(step, recipes[0], rows)
    dest = out / name
    dest.mkdir(parents=True, exist_ok=True)
    summary = {"step": step, "rows": rows}
    (dest / "summary.md").write_text(table)
    (dest / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    run_dirs = [out / f"{name}-{r}" for r in recipes
                if (out / f"{name}-{r}" / "metrics.jsonl").exists()]
    if run_dirs:
        plot_runs(run_dirs, dest / "loss.png", title=f"{name}: validation loss")
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
    progress(table)
    return summary


def format_summary(step, baseline: str, rows: list[dict]) -> str:
    """summary.md: a Markdown table, the gap relative to the first recipe."""
    def fmt(v, f):
        return "—" if v is None else format(v, f)

    lines = [f"Comparison at step {step} (the last evaluation every run reached).", "",
             f"| recipe | val loss | gap vs {baseline} | steps | tok/s (last) | dW cos | dX cos | "
             "W fwd/bwd diff | X clipped | NaN skips |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        lines.append(f"| {row['recipe']} | {fmt(row['val_loss'], '.4f')} | "
                     f"{fmt(row['gap_pct'], '+.2f')}% | {row['steps_done']}"
                     f"{'' if row['finished'] else ' (stopped)'} | "
                     f"{fmt(row['tokens_per_s'], ',.0f')} | {fmt(row['dw_cos'], '.4f')} | "
                     f"{fmt(row['dx_cos'], '.4f')} | {fmt(row['w_fwd_bwd_rel_diff'], '.4f')} | "
                     f"{fmt(row['clip_x'], '.4f')} | {row['nonfinite_skips']} |")
    return "\n".join(lines) + "\n"


def plot_gaps(evals: dict, recipes: list[str], path: Path, name: str) -> None:
    """Validation-loss gap of every recipe to the first (the baseline), in %, per evaluation
    step both reached: at equal tokens, the curves a loss plot draws on top of each other."""
    from lowbit.train.plot import pyplot, save_figure

    plt = pyplot()

    base = evals[recipes[0]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for recipe in recipes[1:]:
        steps = [s for s in sorted(evals[recipe]) if s in base and s > 0
                 and _number(evals[recipe][s]["val_loss"]) is not None
                 and _number(base[s]["val_loss"])]
        gaps = [(_number(evals[recipe][s]["val_loss"]) / _number(base[s]["val_loss"]) - 1) * 100
                for s in steps]
        ax.plot(steps, gaps, marker="o", ms=3, label=recipe)
    ax.axhline(0, color="black", lw=0.8)
    ax.set(title=f"{name}: validation loss vs {recipes[0]}", xlabel="step",
           ylabel=f"gap to {recipes[0]} (%)")
    ax.grid(alpha=0.3)
    if len(recipes) > 1:
        ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_gradient_bias(runs: dict, path: Path, name: str) -> None:
    """Per recipe and diagnostics step: dW's cosine to BF16's on the same batch, and the
    relative difference between the weights the forward and the backward GEMMs used."""
    from lowbit.train.plot import pyplot, save_figure

    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for recipe, d in runs.items():
        diag = [x for x in d["records"] if x.get("event") == "diagnostics" and "diag/dw_cos" in x]
        if not diag:
            continue
        steps = [x["step"] for x in diag]
        axes[0].plot(steps, [_number(x["diag/dw_cos"]) for x in diag], label=recipe)
        diffs = [_number(x.get("diag/w_fwd_bwd_rel_diff")) for x in diag]
        axes[1].plot(steps, [math.nan if v is None else v for v in diffs], label=recipe)
    axes[0].set(title="dW cosine vs BF16 (same batch)", xlabel="step")
    axes[1].set(title="||W_fprop - W_dgrad|| / ||W_fprop||", xlabel="step")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(name)
    save_figure(fig, path)
