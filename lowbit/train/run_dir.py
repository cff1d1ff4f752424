"""A run folder, `<out_dir>/<name>/`: what it holds, and what may be done in it.

    config.json          the TrainConfig (written at the start)
    metrics.jsonl        one record per line (lowbit.train.metrics), TensorBoard events beside
    checkpoints/latest.pt  the last checkpoint (lowbit.train.checkpoint: written, then renamed)
    loss.png             the loss curves, redrawn at every checkpoint and at the end
    final.json           the final numbers (written at the end)

`RunDir.check` refuses, before anything is written, what cannot be done there: a new run in a
folder that holds one (without overwrite), a resume without a checkpoint, or one whose saved
config differs in a field that changes the run. Nothing else in the folder is ever touched.
"""

from __future__ import annotations

import json
from pathlib import Path

from lowbit.train.checkpoint import checkpoint_path, load_checkpoint, write_text_atomic
from lowbit.train.config import TrainConfig, changed_fields

__all__ = ["RunDir"]

_FILES = ("config.json", "metrics.jsonl", "final.json", "loss.png")


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def checkpoint(self) -> Path:
        return checkpoint_path(self.path)

    def produced_files(self) -> list[Path]:
        """What a run writes here (and a fresh or overwritten run removes)."""
        return [*(self.path / n for n in _FILES), self.checkpoint,
                *self.path.glob("events.out.tfevents.*")]

    def check(self, config: TrainConfig, resume: bool, overwrite: bool) -> dict | None:
        """Refuse what cannot be done here; return the checkpoint to resume from, or None."""
        if resume and overwrite:
            raise ValueError("resume and overwrite exclude each other; pick one")
        if not resume:
            if not overwrite and any(p.exists() for p in self.produced_files()):
                raise ValueError(f"{self.path} already holds a run; pass --resume to continue it, "
                                 f"--overwrite to start over, or choose another --run-name")
            return None
        if not self.checkpoint.is_file():
            raise ValueError(f"cannot resume: {self.path} has no checkpoint ({self.checkpoint}); "
                             f"start the run without --resume")
        checkpoint = load_checkpoint(self.checkpoint)
        changes = changed_fields(checkpoint["config"], config)
        if changes:
            raise ValueError(f"cannot resume {self.path}: the config differs from the checkpoint's "
                             f"in {'; '.join(changes)}; use the saved values (see "
                             f"{self.path / 'config.json'}) or start a new run with --run-name")
        return checkpoint

    def start(self, config: TrainConfig, fresh: bool) -> None:
        """Create the folder and write config.json; a fresh run first removes what an
        overwritten one left behind."""
        if fresh:
            for path in self.produced_files():
                path.unlink(missing_ok=True)
        self.path.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.path / "config.json", json.dumps(config.to_dict(), indent=2) + "\n")

    def write_final(self, final: dict) -> None:
        write_text_atomic(self.path / "final.json", json.dumps(final, indent=2) + "\n")

    def plot(self) -> None:
        """Redraw loss.png from metrics.jsonl (matplotlib is imported only here)."""
        from lowbit.train.plot import plot_runs

        plot_runs([self.path], self.path / "loss.png")
