"""Loss curves of one or several run folders in one figure (matplotlib, Agg backend).

The x axis is tokens seen, so runs with different batch sizes line up; when all runs take
the same number of tokens per step, a second axis on top shows the step. Training loss is
a thin solid line, validation loss a dashed line with markers, one colour per run.
`plot_gap_bands` draws runs repeated over seeds: means and a band of one standard deviation.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from collections.abc import Sequence

from lowbit.files import write_stream_atomic
from lowbit.train.metrics import read_metrics


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only: no display needed, none opened);
    imported here, at first use, so that nothing else of lowbit pays for matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, out_path: str | Path, dpi: int = 120) -> Path:
    """Lay out `fig`, write it to `out_path` (its folder created if missing), close it.

    Every figure lowbit draws is saved here, through a temporary file renamed over `out_path`
    (lowbit.files.write_stream_atomic): a full disk leaves the previous figure, never
    an empty or torn PNG, and is an OSError naming `out_path`."""
    out_path = Path(out_path)
    try:
        fig.tight_layout()
        write_stream_atomic(out_path, lambda f: fig.savefig(
            f, format=out_path.suffix.lstrip(".").lower() or "png", dpi=dpi))
    finally:
        pyplot().close(fig)
    return out_path


def plot_runs(run_dirs: Sequence[str | Path], out_path: str | Path,
              title: str | None = None) -> Path:
    """Draw the train and val loss curves of `run_dirs` into the PNG `out_path`."""
    from matplotlib.ticker import EngFormatter

    plt = pyplot()

    if not run_dirs:
        raise ValueError("plot needs at least one run folder")
    out_path = _check_out_path(Path(out_path))
    runs = [_load_run(Path(d)) for d in run_dirs]
    # past a few runs the legend (two entries a run) would cover the curves: it goes beside them
    beside = len(runs) > 3
    fig, ax = plt.subplots(figsize=(11.5, 5) if beside else (8, 5))
    for run, color in zip(runs, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 10):
        train = [(r["tokens"], r["loss"]) for r in run["metrics"]
                 if r["event"] == "train" and isinstance(r["loss"], (int, float))]
        val = [(r["tokens"], r["val_loss"]) for r in run["metrics"]
               if r["event"] == "eval" and isinstance(r["val_loss"], (int, float))]
        if train:
            ax.plot(*zip(*train), color=color, linewidth=1, alpha=0.8,
                    label=f"{run['label']} train")
        if val:
            ax.plot(*zip(*val), color=color, linestyle="--", marker="o", markersize=3,
                    label=f"{run['label']} val")
    ax.set_xlabel("tokens")
    ax.xaxis.set_major_formatter(EngFormatter())  # 1.5M rather than 1.5 with a 1e6 offset
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    if beside:
        ax.legend(fontsize="x-small" if len(runs) > 8 else "small", loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    else:
        ax.legend(fontsize="small")
    tokens_per_step = {run["tokens_per_step"] for run in runs}
    if len(tokens_per_step) == 1 and None not in tokens_per_step:
        per_step = tokens_per_step.pop()
        top = ax.secondary_xaxis("top", functions=(lambda t: t / per_step, lambda s: s * per_step))
        top.set_xlabel("step")
    ax.set_title(_wrapped(title or ", ".join(run["label"] for run in runs)), fontsize="medium")
    return save_figure(fig, out_path)


def _wrapped(title: str, width: int = 80) -> str:
    """A figure title broken into lines of at most `width` characters (at ", " and spaces),
    so that a long list of runs is not cut at the figure's edge."""
    import textwrap

    return "\n".join(textwrap.wrap(title, width, break_long_words=False, break_on_hyphens=False))


def _check_out_path(out_path: Path) -> Path:
    """The figure's file: a .png whose folder exists (nothing is created but the file)."""
    if out_path.is_dir():
        raise ValueError(f"--out {out_path} is a folder; give a file name, e.g. "
                         f"{out_path / 'loss.png'}")
    if out_path.suffix.lower() != ".png":
        raise ValueError(f"--out {out_path} must name a .png file, e.g. {out_path.with_suffix('.png')}")
    if not out_path.parent.is_dir():
        raise ValueError(f"--out {out_path}: the folder {out_path.parent} does not exist; "
                         f"create it first (mkdir -p {out_path.parent})")
    return out_path


def _load_run(run_dir: Path) -> dict:
    metrics = read_metrics(run_dir)
    # config.json read here, not through RunDir (which imports this module to draw loss.png)
    config_file = run_dir / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    recipe = config.get("recipe")
    label = run_dir.name
    if recipe is not None and recipe not in run_dir.name:
        label += f" ({recipe})"
    tokens_per_step = None
    if {"batch_size", "grad_accum_steps", "seq_len"} <= config.keys():
        tokens_per_step = config["batch_size"] * config["grad_accum_steps"] * config["seq_len"]
    return {"metrics": metrics, "label": label, "tokens_per_step": tokens_per_step}


def plot_gap_bands(curves: dict[str, dict[int, Sequence[tuple[int, float]]]],
                   out_path: str | Path, metric: str = "val loss",
                   title: str | None = None, relative: bool = True) -> Path:
    """Runs over seeds: curves[arm][seed] = [(step, value), ...], the first arm the baseline.

    Left, each arm's value per step, the mean over seeds and a band of +- one standard
    deviation; right, each other arm's gap to the same seed's baseline in % (relative False:
    the difference, in the metric's units), the mean over the paired seeds and its band. A step
    enters where at least one seed has both values."""
    plt = pyplot()

    arms = list(curves)
    base = {seed: dict(curve) for seed, curve in curves[arms[0]].items()}
    fig, (ax_value, ax_gap) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"] * 10
    for arm, color in zip(arms, colors):
        per_step: dict[int, list[float]] = {}
        gap_per_step: dict[int, list[float]] = {}
        for seed, curve in curves[arm].items():
            for step, value in curve:
                if not math.isfinite(value):
                    continue
                per_step.setdefault(step, []).append(value)
                b = base.get(seed, {}).get(step)
                if arm != arms[0] and b is not None and math.isfinite(b) and (b != 0 or not relative):
                    gap_per_step.setdefault(step, []).append(
                        (value - b) / b * 100 if relative else value - b)
        for ax, data in ((ax_value, per_step), (ax_gap, gap_per_step)):
            if not data:
                continue
            steps = sorted(data)
            means = [sum(data[s]) / len(data[s]) for s in steps]
            stds = [_std(data[s]) for s in steps]
            ax.plot(steps, means, color=color, marker="o", markersize=3,
                    label=f"{arm} (n={max(len(v) for v in data.values())})")
            ax.fill_between(steps, [m - d for m, d in zip(means, stds)],
                            [m + d for m, d in zip(means, stds)], color=color, alpha=0.2)
    ax_gap.axhline(0, color="black", linewidth=0.8)
    # a long metric's label in lines the axis height holds (it was cut at the figure's edge)
    ax_value.set(xlabel="step", ylabel=_wrapped(f"{metric} (mean ± sd over seeds)", 60))
    unit = "%" if relative else "difference"
    ax_gap.set(xlabel="step", ylabel=_wrapped(f"gap to {arms[0]} ({unit}, mean ± sd over paired seeds)", 60))
    for ax in (ax_value, ax_gap):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle(_wrapped(title or ", ".join(arms), 120), fontsize="medium")
    return save_figure(fig, out_path)


def _std(values: Sequence[float]) -> float:
    """Sample standard deviation; 0 for one value (no band)."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
