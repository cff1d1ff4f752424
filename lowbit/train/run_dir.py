"""A run folder, `<out_dir>/<name>/`: what it holds, and what may be done in it.

    config.json          the TrainConfig (written at the start)
    metrics.jsonl        one record per line (lowbit.train.metrics), TensorBoard events beside
    checkpoints/latest.pt  the last checkpoint, and the ones before it as step-<N>.pt
                         (lowbit.train.checkpoint.CheckpointStore: checksummed, written, then renamed)
    loss.png             the loss curves, redrawn at a checkpoint (at most once every
                         PLOT_EVERY_S seconds: matplotlib takes ~0.5 s) and at the end
    final.json           the final numbers (written at the end)

`RunDir.check` refuses, before anything is written, what cannot be done there: a new run in a
folder that holds one (without overwrite), a resume without a usable checkpoint, or one whose
saved config differs in a field that changes the run. `RunDir.start` removes the temporary
files of writes a killed run left behind. Nothing else in the folder is ever touched.

Other jobs (lowbit.rl) keep their runs in a RunDir too: they name the files they write and how
their config is compared with a checkpoint's, and get the same checks and checkpoints.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

from lowbit.train.checkpoint import (CheckpointError, CheckpointStore, checkpoint_path,
                                     remove_temp_files, write_text_atomic)
from lowbit.train.config import TrainConfig, changed_fields

__all__ = ["RunDir", "PLOT_EVERY_S"]

PLOT_EVERY_S = 60.0

_FILES = ("config.json", "metrics.jsonl", "final.json", "loss.png")


class RunDir:
    """files: the names the job writes at the top of the folder (a fresh or overwritten run
    removes them); changed(saved_config_dict, config) lists the fields a resume may not change
    (default: TrainConfig's rule)."""

    def __init__(self, path: str | Path, keep_checkpoints: int = 2,
                 files: tuple[str, ...] = _FILES,
                 changed: Callable[[dict, object], list[str]] = changed_fields) -> None:
        self.path = Path(path)
        self.checkpoints = CheckpointStore(self.path / "checkpoints", keep_checkpoints)
        self.files, self.changed = files, changed
        self._plotted_at = -math.inf

    @property
    def checkpoint(self) -> Path:
        """The newest checkpoint's path (checkpoints/latest.pt)."""
        return checkpoint_path(self.path)

    def produced_files(self) -> list[Path]:
        """What a run writes here (and a fresh or overwritten run removes)."""
        return [*(self.path / n for n in self.files), *self.checkpoints.files(),
                *self.path.glob("events.out.tfevents.*")]

    def check(self, config: TrainConfig | Any, resume: bool, overwrite: bool,
              warn: Callable[[str], None] | None = None) -> dict | None:
        """Refuse what cannot be done here; return the checkpoint to resume from, or None.

        warn(message) hears about each newer checkpoint that was damaged and skipped."""
        if resume and overwrite:
            raise ValueError("resume and overwrite exclude each other; pick one")
        for folder in (self.path.parent, self.path, self.checkpoints.folder):
            if folder.exists() and not folder.is_dir():
                raise ValueError(f"{folder} is a file, not a folder; choose another --out-dir "
                                 f"(or --run-name)")
        if not resume:
            if not overwrite and any(p.exists() for p in self.produced_files()):
                if not self.checkpoints.exists():
                    raise ValueError(f"{self.path} holds a run that stopped before its first "
                                     f"checkpoint; pass --overwrite to start it over, or choose "
                                     f"another --run-name")
                raise ValueError(f"{self.path} already holds a run; pass --resume to continue it, "
                                 f"--overwrite to start over, or choose another --run-name")
            return None
        if not self.checkpoints.exists():
            raise ValueError(f"cannot resume: {self.path} has no checkpoint ({self.checkpoint}); "
                             f"start the run without --resume, with --overwrite if the folder "
                             f"holds the files of a run that stopped before its first checkpoint")
        try:
            loaded = self.checkpoints.load()
        except CheckpointError as e:
            raise CheckpointError(f"cannot resume {self.path}: {e}; start over with --overwrite"
                                  ) from None
        for reason in loaded.skipped:
            if warn is not None:
                warn(f"lowbit: warning: skipped a damaged checkpoint: {reason}")
        if loaded.skipped and warn is not None:
            warn(f"lowbit: warning: resuming from {loaded.path} (step {loaded.state['step']}), "
                 f"the newest checkpoint that verified")
        checkpoint = loaded.state
        changes = self.changed(checkpoint["config"], config)
        if changes:
            raise ValueError(f"cannot resume {self.path}: the config differs from the checkpoint's "
                             f"in {'; '.join(changes)}; use the saved values (see "
                             f"{self.path / 'config.json'}) or start a new run with --run-name")
        return checkpoint

    def start(self, config: TrainConfig | Any, fresh: bool) -> list[tuple[Path, int]]:
        """Create the folder and write config.json; a fresh run first removes what an
        overwritten one left behind. Every start removes the temporary files of writes a
        killed run left (returned as (path, bytes), for the caller to report)."""
        removed = remove_temp_files(self.path) + self.checkpoints.remove_temp_files()
        if fresh:
            for path in self.produced_files():
                path.unlink(missing_ok=True)
        self.path.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.path / "config.json", json.dumps(config.to_dict(), indent=2) + "\n")
        return removed

    def save_checkpoint(self, state: dict) -> Path:
        """Save the run's checkpoint (CheckpointStore.save) and return its path."""
        return self.checkpoints.save(state)

    def write_final(self, final: dict) -> None:
        write_text_atomic(self.path / "final.json", json.dumps(final, indent=2) + "\n")

    def plot(self, force: bool = False, draw: Callable[[], None] | None = None) -> None:
        """Redraw loss.png from metrics.jsonl (matplotlib is imported only here), or call
        draw() for a job's own figure; unless force, at most once every PLOT_EVERY_S seconds."""
        if not force and time.monotonic() - self._plotted_at < PLOT_EVERY_S:
            return
        if draw is None:
            from lowbit.train.plot import plot_runs

            plot_runs([self.path], self.path / "loss.png")
        else:
            draw()
        self._plotted_at = time.monotonic()
