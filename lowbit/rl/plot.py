"""RL curves of one or several run folders in one figure: reward, held-out accuracy, and the
mean and max |log pi_rollout - log pi_train| per step (matplotlib, Agg backend)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from lowbit.train.metrics import read_metrics
from lowbit.train.plot import pyplot, save_figure

__all__ = ["plot_rl_runs"]

_PANELS = (("train", "reward", "reward"),
           ("eval", "eval/accuracy", "held-out accuracy (greedy)"),
           ("train", "sampling/sampling_logp_difference/mean", "mean |logp rollout - logp train|"),
           ("train", "sampling/sampling_logp_difference/max", "max |logp rollout - logp train|"))


def plot_rl_runs(run_dirs: Sequence[str | Path], out_path: str | Path, title: str | None = None) -> Path:
    plt = pyplot()

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for run_dir in run_dirs:
        run_dir = Path(run_dir)
        records = read_metrics(run_dir)
        config_file = run_dir / "config.json"
        label = run_dir.name
        if config_file.is_file():
            label = json.loads(config_file.read_text()).get("run_name") or run_dir.name
        for ax, (event, key, _) in zip(axes.flat, _PANELS):
            points = [(r["step"], r[key]) for r in records
                      if r["event"] == event and isinstance(r.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points), label=label, marker="o" if event == "eval" else None,
                        markersize=3, linewidth=1)
    for ax, (_, _, name) in zip(axes.flat, _PANELS):
        ax.set_title(name, fontsize="medium")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return save_figure(fig, out_path, dpi=110)
