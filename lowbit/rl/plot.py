"""RL curves of one or several run folders in one figure: reward, held-out accuracy, and the
mean and max |log pi_rollout - log pi_train| per step (matplotlib, Agg backend). Per-step
curves are drawn as a trailing mean over about 1/30 of the run (raw values are in
metrics.jsonl); runs of one setting share a colour, a second seed is dashed, a third dotted."""

from __future__ import annotations

from pathlib import Path
from collections.abc import Sequence

from lowbit.rl.config import RLConfig
from lowbit.train.metrics import read_metrics
from lowbit.train.plot import pyplot, save_figure
from lowbit.train.run_dir import RunDir

__all__ = ["plot_rl_runs"]

_PANELS = (("train", "reward", "reward"),
           ("eval", "eval/accuracy", "held-out accuracy, own engine (greedy)"),
           ("eval", "eval/accuracy_bf16", "held-out accuracy, trainer's weights in bf16"),
           ("train", "sampling/sampling_logp_difference/mean", "mean |logp rollout - logp train|"),
           ("train", "sampling/sampling_logp_difference/max", "max |logp rollout - logp train|"))


def plot_rl_runs(run_dirs: Sequence[str | Path], out_path: str | Path, title: str | None = None) -> Path:
    plt = pyplot()
    runs = []   # (folder, setting, seed)
    for run_dir in map(Path, run_dirs):
        record = RunDir(run_dir).config_record()
        if record is not None:
            config = RLConfig.from_dict(record)
            runs.append((run_dir, config.setting, config.seed))
        else:
            runs.append((run_dir, run_dir.name, 0))
    several_seeds = len({seed for _, _, seed in runs}) > 1
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    axes.flat[-1].set_visible(False)   # five panels
    colours, seen = {}, {}
    for run_dir, setting, seed in runs:
        records = read_metrics(run_dir)
        colour = colours.setdefault(setting, f"C{len(colours) % 10}")
        seen[setting] = seen.get(setting, 0) + 1
        style = ("-", "--", ":", "-.")[min(seen[setting] - 1, 3)]
        label = f"{setting}, seed {seed}" if several_seeds else setting
        for ax, (event, key, _) in zip(axes.flat, _PANELS):
            points = [(r["step"], r[key]) for r in records
                      if r["event"] == event and isinstance(r.get(key), (int, float))]
            if not points:
                continue
            steps, values = zip(*points)
            if event == "train":
                values = _trailing_mean(values, max(1, len(values) // 30))
            ax.plot(steps, values, label=label, color=colour, linestyle=style,
                    marker="o" if event == "eval" else None, markersize=3, linewidth=1)
    for ax, (_, _, name) in zip(axes.flat, _PANELS):
        ax.set_title(name, fontsize="medium")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return save_figure(fig, out_path, dpi=110)


def _trailing_mean(values, window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
