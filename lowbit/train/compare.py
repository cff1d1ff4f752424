"""Train several recipes on the same data order and seed, then one figure and one table.

The runs go one after another, each in its own run folder, then `<out_dir>/<name>/` gets
loss.png (all curves), summary.md and summary.json: final validation loss and perplexity of
each run and its gap to the first run (the baseline, normally bf16) in percent. A run that
stops on non-finite losses is kept in the table as "stopped at step N" and the comparison
goes on: an unstable recipe is a result, not an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from lowbit.train.build import resolve_recipe
from lowbit.train.checkpoint import write_text_atomic
from lowbit.train.config import TrainConfig
from lowbit.train.loop import NonFiniteLossError, train
from lowbit.train.plot import plot_runs
from lowbit.train.run_dir import RunDir

# What may differ between the runs of a comparison; everything else must match, or the
# curves would differ for reasons other than the recipe.
_MAY_DIFFER = frozenset({"recipe", "run_name", "progress"})


@dataclass
class CompareRow:
    run: str
    recipe: str
    val_loss: float | None
    """Final validation loss; None if the run stopped early."""
    val_ppl: float | None
    gap_pct: float | None
    """(val_loss - baseline val_loss) / baseline val_loss * 100; the first run is the baseline."""
    status: str
    """"ok", or "stopped at step N (non-finite loss)"."""


@dataclass
class Comparison:
    rows: list[CompareRow]
    figure: Path
    table: Path


def compare(configs: Sequence[TrainConfig], name: str | None = None, *,
            overwrite: bool = False) -> Comparison:
    """Run each config in turn and write the combined figure and summary under
    `<out_dir>/<name>/` (default name "compare-<model>-<corpus>")."""
    _check_comparable(configs)
    check_runs(configs, overwrite)
    base = configs[0]
    summary_dir = Path(base.out_dir) / (name or f"compare-{base.model}-{base.corpus}")
    rows: list[CompareRow] = []
    for config in configs:
        try:
            result = train(config, overwrite=overwrite)
        except NonFiniteLossError as e:
            rows.append(CompareRow(config.name, config.recipe, None, None, None,
                                   f"stopped at step {e.step} (non-finite loss)"))
            continue
        rows.append(CompareRow(config.name, config.recipe, result.val_loss, result.val_ppl,
                               None, "ok"))
    baseline = rows[0].val_loss
    for row in rows:
        if baseline is not None and row.val_loss is not None:
            row.gap_pct = (row.val_loss - baseline) / baseline * 100

    summary_dir.mkdir(parents=True, exist_ok=True)
    figure = plot_runs([Path(c.out_dir) / c.name for c in configs], summary_dir / "loss.png",
                       title=f"{base.model} on {base.corpus}, {base.total_steps} steps")
    table = summary_dir / "summary.md"
    write_text_atomic(table, format_table(rows))
    write_text_atomic(summary_dir / "summary.json",
                      json.dumps([row.__dict__ for row in rows], indent=2) + "\n")
    return Comparison(rows, figure, table)


def format_table(rows: Sequence[CompareRow]) -> str:
    """A Markdown table; the gap column is relative to the first row."""
    lines = [f"| run | recipe | val loss | val ppl | gap vs {rows[0].recipe} | status |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for row in rows:
        loss = "—" if row.val_loss is None else f"{row.val_loss:.4f}"
        ppl = "—" if row.val_ppl is None else f"{row.val_ppl:.2f}"
        gap = "—" if row.gap_pct is None else f"{row.gap_pct:+.2f}%"
        lines.append(f"| {row.run} | {row.recipe} | {loss} | {ppl} | {gap} | {row.status} |")
    return "\n".join(lines) + "\n"


def check_runs(configs: Sequence[TrainConfig], overwrite: bool = False) -> None:
    """Refuse, before the first run's first step, what would stop a later run: an unknown
    recipe, or a run folder that cannot be started (one holding a run, without overwrite)."""
    for config in configs:
        resolve_recipe(config.recipe)
    for config in configs:
        RunDir(Path(config.out_dir) / config.name).check(config, resume=False, overwrite=overwrite)


def _check_comparable(configs: Sequence[TrainConfig]) -> None:
    if len(configs) < 2:
        raise ValueError("compare needs at least two runs, e.g. --compare bf16,mxfp4")
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"compare needs one run folder per run, got {names}; give each "
                         f"recipe once")
    first = configs[0].to_dict()
    for config in configs[1:]:
        for key, value in config.to_dict().items():
            if key not in _MAY_DIFFER and value != first[key]:
                raise ValueError(f"compared runs must differ only in recipe; {config.name} has "
                                 f"{key}={value!r} but {configs[0].name} has {first[key]!r}")
