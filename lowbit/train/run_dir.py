"""A run folder, `<out_dir>/<name>/`: what it holds, and what may be done in it.

    config.json          the TrainConfig (written at the start)
    job.json             what made the run: the job, QAT's settings, the weights it started
                         from (lowbit.train.job_record.JobRecord; written at the start)
    metrics.jsonl        one record per line (lowbit.train.metrics), TensorBoard events beside
    checkpoints/latest.pt  the last checkpoint, and the ones before it as step-<N>.pt
                         (lowbit.train.checkpoint.CheckpointStore: checksummed, written, then renamed)
    loss.png             the loss curves, redrawn at a checkpoint (at most once every
                         PLOT_EVERY_S seconds, the first a minute in: matplotlib takes
                         0.5-1 s) and at the end
    final.json           the final numbers (written at the end)
    .lowbit.lock         the lock a lowbit process holds while it writes the folder (below)

`RunDir.check` refuses, before anything is written, what cannot be done there: a new run in a
folder that holds one (without overwrite), a resume without a usable checkpoint, or one whose
saved config or job record differs in a field that changes the run, or whose job started from
other weights. `RunDir.start` removes the temporary
files of writes a killed run left behind. Nothing else in the folder is ever touched.

One writer at a time. The process that runs (or resumes, or overwrites) a folder holds an
advisory lock on `.lowbit.lock` in it from `check` (or, for a folder that does not exist yet,
from `start`) until `release`, and a second lowbit process is refused in one line, before it
reads or removes anything. The lock is `fcntl.flock`: the OS drops it when its process ends,
killed or not, so a folder is never left locked; the file stays (removing it would let two
processes lock two different files of one name). A process that only reads a finished run
(`lowbit qat --from`, `lowbit export`) calls `check_free` first: a folder a live run holds is
refused (its last checkpoint is not the model the run will end with). Such a reader opens the
run with `RunDir.open`, the one place that reads a run back (config, job record, checkpoint,
final record).

Other jobs (lowbit.rl) keep their runs in a RunDir too: they name the files they write, their
config (a lowbit.config.RunConfig) says which fields a resume may change, and they get the same
checks and checkpoints (they write no job record).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

from lowbit.config import RunConfig
from lowbit.train.checkpoint import (CheckpointError, CheckpointStore, check_same_start,
                                     checkpoint_path, load_checkpoint, remove_temp_files,
                                     write_json_atomic)
from lowbit.train.config import TrainConfig
from lowbit.train.job_record import JOB_FILE, JobRecord

__all__ = ["RunDir", "SavedRun", "PLOT_EVERY_S", "LOCK_FILE", "FIGURES_VARIABLE", "figures_on"]

PLOT_EVERY_S = 60.0
FIGURES_VARIABLE = "LOWBIT_FIGURES"
LOCK_FILE = ".lowbit.lock"

_FILES = ("config.json", JOB_FILE, "metrics.jsonl", "final.json", "loss.png")


@dataclass(frozen=True)
class SavedRun:
    """A run read back by `RunDir.open`: what QAT, export, RL's warm start and the diagnostics
    start from."""

    path: Path
    config: TrainConfig | None
    """From the checkpoint (checksummed), not from config.json; None for another job's run
    (lowbit rl's), whose checkpoint holds its policy's ModelConfig as "model_config" and its
    tokenizer folder (or None: bytes) as "tokenizer_dir"."""
    job: JobRecord | None
    """What made the run (QAT's settings, the weights it started from), from the checkpoint
    (JobRecord.of_checkpoint: a run saved before job records too); None for another job's run."""
    state: dict           # the newest checkpoint: "model", "optimizer", "step", "config", ...
    final: dict | None    # final.json; None for a run that stopped before its last step


class RunDir:
    """files: the names the job writes at the top of the folder (a fresh or overwritten run
    removes them). A resume compares the job's config (a lowbit.config.RunConfig) with the
    checkpoint's by its changed_fields. Used as a context manager, it releases the folder's
    lock on leaving."""

    def __init__(self, path: str | Path, keep_checkpoints: int = 2,
                 files: tuple[str, ...] = _FILES) -> None:
        self.path = Path(path)
        self.checkpoints = CheckpointStore(self.path / "checkpoints", keep_checkpoints)
        self.files = files
        self._plotted_at = time.monotonic()   # the first redraw a minute in: a short run draws once, at its end
        self._lock = None             # the open lock file, while this process holds the folder
        self._absent_at_check = False  # check() found no folder, so it could not lock it yet

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def lock(self) -> None:
        """Hold the folder (created if need be) for this process until release(); a
        ValueError, naming the folder, if another process holds it."""
        if self._lock is not None:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        lock = open(self.path / LOCK_FILE, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip()
            lock.close()
            raise ValueError(f"{self._in_use(holder)}, or choose another --run-name") from None
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")   # for the message above; the lock is the flock
        lock.flush()
        self._lock = lock

    def check_free(self) -> None:
        """For a process that only reads the folder (QAT's --from, export): a ValueError, naming
        the folder, if another process holds it (a live run, whose files are not final). A
        shared, non-blocking flock on the lock file, let go of at once; creates nothing."""
        if not (self.path / LOCK_FILE).is_file():   # no lowbit process ever wrote here
            return
        with open(self.path / LOCK_FILE) as lock:   # lock files are never removed
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ValueError(self._in_use(lock.read().strip())) from None

    def _in_use(self, holder: str) -> str:
        return (f"{self.path} is in use: another lowbit process"
                f"{f' (pid {holder})' if holder.isdigit() else ''} is writing it; "
                f"wait for it to end")

    def release(self) -> None:
        """Let other processes have the folder (closing the file drops the flock)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    @property
    def finished(self) -> bool:
        """The run reached its last step: final.json and its checkpoint are both there."""
        return (self.path / "final.json").is_file() and self.checkpoint.is_file()

    @property
    def result_only(self) -> bool:
        """final.json is there and no checkpoint: a finished run whose checkpoints were removed
        (to save space, or to carry its results elsewhere). A comparison takes its result as it
        is, once `check_result` finds it was run with the config asked for; nothing can
        continue it or start from its weights."""
        return (self.path / "final.json").is_file() and not self.checkpoints.exists()

    def check_result(self, config: RunConfig, job: JobRecord | None = None) -> None:
        """Refuse, in one line, a result_only run that another process holds, or that a resume
        of it would refuse: config.json differing from `config`, or (given the run's job record)
        job.json -- or for a run written before job records, config.json's job fields -- from
        `job`, starting weights included (check_same_start). Its result answers only the
        question it was run for. Takes the folder's lock, as check() does."""
        self.lock()
        saved = self.config_record()
        if saved is None:
            raise ValueError(f"{self.path} holds final.json but no config.json, so what it ran "
                             f"cannot be checked; remove the folder, or choose another --run-name")
        # the state a checkpoint would hold: config.json's config, job.json's record if any
        job_file = self.path / JOB_FILE
        state = {"config": saved, **({"job": json.loads(job_file.read_text())}
                                     if job_file.is_file() else {})}
        changes, job_changes, saved_job = _differences(state, config, job)
        if changes or job_changes:
            raise ValueError(f"cannot take {self.path}'s result: its config.json differs from "
                             f"the config asked for in {'; '.join(sorted(changes + job_changes))} "
                             f"(its checkpoints were removed, so it cannot continue); use the "
                             f"saved values, or remove the folder to run it again")
        if saved_job is not None:
            check_same_start(saved_job.init_fingerprint, job.init_fingerprint, self.path,
                             saved_job.init_from)

    def open(self, allow_unfinished: bool = False, use: str = "read") -> SavedRun:
        """Read a finished run back, a lowbit train run or a lowbit rl run (config None), after
        `check_readable`; a damaged checkpoint is a CheckpointError, one line."""
        self.check_readable(allow_unfinished, use)
        state = load_checkpoint(self.checkpoint)
        if "model_config" in state:   # a lowbit rl run
            return SavedRun(self.path, None, None, state, self.final_record())
        try:
            config = TrainConfig.from_dict(state["config"])
        except ValueError as e:   # e.g. an RL run saved before its checkpoints held model_config
            raise ValueError(f"{self.path} is not a lowbit train run ({e}); if it is a lowbit rl "
                             f"run from an older lowbit, its checkpoint lacks the policy's "
                             f"model_config, which reading it back needs") from None
        return SavedRun(self.path, config, JobRecord.of_checkpoint(state), state,
                        self.final_record())

    def check_readable(self, allow_unfinished: bool = False, use: str = "read") -> None:
        """Refuse in one line (ValueError) a folder that holds no run, one a live process holds,
        or one without final.json (unless allow_unfinished: its last checkpoint is read then).
        `use` completes the advice: "pass --allow-unfinished to {use} its last checkpoint"."""
        if not self.checkpoint.is_file():
            raise ValueError(f"{self.path} is not a finished lowbit train run folder (it has no "
                             f"{self.checkpoint.relative_to(self.path)}); give the folder a "
                             f"`lowbit train` run wrote")
        self.check_free()   # a live run's checkpoint is not the model it will end with
        final_file = self.path / "final.json"
        if not final_file.is_file() and not allow_unfinished:
            raise ValueError(f"{self.path} holds an unfinished run (no final.json: it stopped "
                             f"before its last step); finish it with --resume, "
                             f"or pass --allow-unfinished to {use} its last checkpoint")

    def open_train_run(self, allow_unfinished: bool = False, use: str = "read") -> SavedRun:
        """`open`, for a reader that needs a lowbit train run's config (QAT's --from, inspect
        --gradients): another job's run is refused in one line saying how to hand it over."""
        saved = self.open(allow_unfinished, use)
        if saved.config is None:
            raise ValueError(f"{self.path} is a lowbit rl run, not a lowbit train run; its "
                             f"policy leaves as a Hugging Face folder (lowbit export {self.path} "
                             f"--format bf16 --out DIR), which lowbit qat takes as --model DIR")
        return saved

    def final_record(self) -> dict | None:
        """final.json's record, or None if the run has not written it."""
        return self._record("final.json", "remove it and finish the run with --resume")

    def config_record(self) -> dict | None:
        """config.json's record (the run's config as it was written), or None if there is none."""
        return self._record("config.json", "start the run again with --overwrite")

    def _record(self, name: str, fix: str) -> dict | None:
        file = self.path / name
        if not file.is_file():
            return None
        try:
            return json.loads(file.read_text())
        except (ValueError, UnicodeDecodeError):
            raise ValueError(f"{file} is not JSON (a run writes it atomically, so something "
                             f"else changed it); restore it, or {fix}") from None

    @property
    def checkpoint(self) -> Path:
        """The newest checkpoint's path (checkpoints/latest.pt)."""
        return checkpoint_path(self.path)

    def produced_files(self) -> list[Path]:
        """What a run writes here (and a fresh or overwritten run removes)."""
        return [*(self.path / n for n in self.files), *self.checkpoints.files(),
                *self.path.glob("events.out.tfevents.*")]

    def check(self, config: RunConfig, resume: bool, overwrite: bool,
              warn: Callable[[str], None] | None = None, lock: bool = True,
              job: JobRecord | None = None) -> dict | None:
        """Refuse what cannot be done here; return the checkpoint to resume from, or None.

        warn(message) hears about each newer checkpoint that was damaged and skipped. lock:
        take the folder's lock first, if the folder exists (start() takes it otherwise); False
        for the processes of a distributed run that only read it. job: the run's job record
        (train()'s runs), which a resume checks as it checks the config, and whose starting
        weights must be the checkpoint's (check_same_start); None for jobs that keep none."""
        if resume and overwrite:
            raise ValueError("resume and overwrite exclude each other; pick one")
        for folder in (self.path.parent, self.path, self.checkpoints.folder):
            if folder.exists() and not folder.is_dir():
                raise ValueError(f"{folder} is a file, not a folder; choose another --out-dir "
                                 f"(or --run-name)")
        if lock:
            # before anything below reads the folder: what a live run has not written yet
            # (its first checkpoint) must not read as a run that stopped
            self._absent_at_check = not self.path.is_dir()
            if not self._absent_at_check:
                self.lock()
        try:
            return self._checkpoint_to_resume(config, job, resume, overwrite, warn)
        except BaseException:
            self.release()   # a refused run holds no folder
            raise

    def _checkpoint_to_resume(self, config: RunConfig, job: JobRecord | None, resume: bool,
                              overwrite: bool, warn: Callable[[str], None] | None) -> dict | None:
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
        changes, job_changes, saved_job = _differences(checkpoint, config, job)
        if changes or job_changes:
            # a run saved before job records keeps its job's fields in config.json
            job_file = JOB_FILE if (self.path / JOB_FILE).is_file() else "config.json"
            files = (["config.json"] if changes else []) + ([job_file] if job_changes else [])
            see = " and ".join(str(self.path / name) for name in dict.fromkeys(files))
            raise ValueError(f"cannot resume {self.path}: the config differs from the checkpoint's "
                             f"in {'; '.join(sorted(changes + job_changes))}; use the saved values "
                             f"(see {see}) or start a new run with --run-name")
        if job is not None:
            check_same_start(saved_job.init_fingerprint, job.init_fingerprint, self.path,
                             saved_job.init_from)
        return checkpoint

    def start(self, config: RunConfig, fresh: bool,
              job: JobRecord | None = None) -> list[tuple[Path, int]]:
        """Create the folder and write config.json (and job.json, given the run's job record:
        a run resumed from before job records gets one too); a fresh run first removes what an
        overwritten one left behind. Every start removes the temporary files of writes a
        killed run left (returned as (path, bytes), for the caller to report). Takes the
        folder's lock if check() could not (the folder did not exist then)."""
        locked_now = self._lock is None
        self.lock()
        if locked_now and self._absent_at_check and any(p.exists() for p in self.produced_files()):
            self.release()
            raise ValueError(f"{self.path} was started by another lowbit process while this one "
                             f"was getting ready; choose another --run-name")
        removed = remove_temp_files(self.path) + self.checkpoints.remove_temp_files()
        if fresh:
            for path in self.produced_files():
                path.unlink(missing_ok=True)
        write_json_atomic(self.path / "config.json", config.to_dict())
        if job is not None:
            write_json_atomic(self.path / JOB_FILE, job.to_dict())
        return removed

    def save_checkpoint(self, state: dict) -> Path:
        """Save the run's checkpoint (CheckpointStore.save) and return its path."""
        return self.checkpoints.save(state)

    def write_final(self, final: dict) -> None:
        """final.json, strict JSON (NaN/Inf as the strings "nan"/"inf": strict_json)."""
        write_json_atomic(self.path / "final.json", final)

    def plot(self, force: bool = False, draw: Callable[[], None] | None = None) -> None:
        """Redraw loss.png from metrics.jsonl (matplotlib is imported only here), or call
        draw() for a job's own figure; unless force, at most once every PLOT_EVERY_S seconds;
        never where figures are off (`figures_on`)."""
        if not figures_on() or (not force and time.monotonic() - self._plotted_at < PLOT_EVERY_S):
            return
        if draw is None:
            from lowbit.train.plot import plot_runs

            plot_runs([self.path], self.path / "loss.png")
        else:
            draw()
        self._plotted_at = time.monotonic()


def figures_on() -> bool:
    """Whether run folders get their figure (loss.png, rl.png, qat.png): yes unless
    $LOWBIT_FIGURES is 0. A sweep of many runs, or a test suite, turns them off (matplotlib
    takes 0.5-1 s a figure) and draws what it wants afterwards with `lowbit plot RUN ...`."""
    return os.environ.get(FIGURES_VARIABLE, "1") != "0"


def _differences(state: dict, config: RunConfig, job: JobRecord | None
                 ) -> tuple[list[str], list[str], JobRecord | None]:
    """A saved run's state (a checkpoint's, or config.json and job.json as one) against the
    config and job record asked for: the config's changed fields, the job's, and the saved job
    record (JobRecord.of_checkpoint; None without a job asked for)."""
    saved_job = None if job is None else JobRecord.of_checkpoint(state)
    return (config.changed_fields(state["config"]),
            [] if job is None else job.changed_fields(saved_job.to_dict()), saved_job)
