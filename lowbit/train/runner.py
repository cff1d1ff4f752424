"""The run loop every lowbit job plugs into: `lowbit train` (QAT and RL's warm start run
train()) and `lowbit rl`. The loop owns the cadence and everything around a step; the job owns
what a step, an evaluation, a checkpoint's contents and the final record are.

    result = RunLoop(job, folder, config, cadence, Start.of(checkpoint)).run()

What run() does:
  say the start line (resuming or starting, where, at which step, job.describe())
  until the last step (or this call's last, cadence.steps_this_call):
    evaluate when due: every eval_every steps, at a fresh run's step 0, at the last step
    checkpoint when due: every checkpoint_every steps, at the last, at this call's end
    outcome = job.step(i)              its events and messages go to the log and the user
    NaN/Inf steps in a row reaching cadence.max_nonfinite: NonFiniteLossError, naming the
      last checkpoint, which is from before them
    every log_every steps (and at the last): a train record (job.train_record), and a line
      when the progress bar is not on a terminal
    every after_step_every steps: job.after_step (lowbit train's diagnostics), its record logged
  Ctrl-C: TrainingInterrupted, naming the step, the last checkpoint and --resume
  at the end: job.finish -> final.json (only once the last step is reached), the plot, the
    done line
After its first few steps the loop says how long the rest should take.

Every checkpoint holds the same fields (CHECKPOINT_VERSION): version, step, config, rng,
metrics (the log's records so far), wall_time_s, and what job.state() adds (model, optimizer,
data_fingerprint, consecutive_nonfinite and the job's own). Start.of reads the shared ones back.

Under torchrun every rank runs the loop; only rank 0 (is_main) logs, writes and plots, but every
rank calls job.state() (gathering FSDP's shards is collective).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from collections.abc import Callable

import torch
from tqdm import tqdm

from lowbit.config import RunConfig, call_started
from lowbit.train.checkpoint import CHECKPOINT_VERSION, rng_state
from lowbit.train.metrics import MetricsLog
from lowbit.train.run_dir import RunDir

__all__ = ["RunLoop", "Job", "Cadence", "Start", "StepOutcome", "NonFiniteLossError",
           "TrainingInterrupted", "nonfinite_message", "interrupted_message"]


class NonFiniteLossError(RuntimeError):
    """Raised after cadence.max_nonfinite optimizer steps in a row had a NaN/Inf loss or
    gradient norm. The last checkpoint on disk is the one from before they began. The message
    says what happened (nonfinite_message); each command adds what to try, in flags it has."""

    def __init__(self, message: str, step: int, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run; the message says the step, the last checkpoint and how to resume."""


def nonfinite_message(step: int, in_a_row: int, checkpoint: Path | None) -> str:
    """What a job stopped by a NaN/Inf loss says (every lowbit job: train, QAT, RL); the
    command adds what to try."""
    kept = (f"the last checkpoint, {checkpoint}, is from before and intact" if checkpoint
            else "no checkpoint had been written yet")
    steps = f" for {in_a_row} steps in a row" if in_a_row > 1 else ""
    return f"stopped at step {step}: the loss or gradient norm was NaN/Inf{steps}; {kept}."


def interrupted_message(step: int, checkpoint_step: int | None, checkpoint: Path | None) -> str:
    """What a job stopped by Ctrl-C says after `lowbit: interrupted ` (every lowbit job)."""
    if checkpoint_step is None:
        return (f"at step {step}, before the first checkpoint; nothing to resume: start "
                f"again with --overwrite (or a smaller --checkpoint-every)")
    return (f"at step {step}; the last checkpoint is step {checkpoint_step} "
            f"({checkpoint}): run the same command with --resume to continue")


@dataclass(frozen=True)
class Cadence:
    """When the loop evaluates, checkpoints, logs and stops (0: only at the last step)."""

    total_steps: int
    eval_every: int = 0
    checkpoint_every: int = 0
    log_every: int = 1
    max_nonfinite: int = 1
    """NaN/Inf steps in a row that stop the run."""
    steps_this_call: int | None = None
    """Steps one call of RunLoop.run takes before it returns, the run checkpointed but not
    finished, for a later --resume (lowbit rl --max-steps-per-session); None: to the end."""
    seconds_this_call: float | None = None
    """Wall-clock seconds, counted from the lowbit command's start (lowbit.config.call_started:
    its setup included), after which a call stops at the end of its step, checkpointed but not
    finished, for a later --resume (--stop-after-minutes: a job's time limit on a cluster, as
    Megatron's --exit-duration-in-mins); None: no limit. Every call takes at least one step.
    Under torchrun the ranks agree (rank 0's clock decides)."""
    after_step_every: int = 0
    """Steps between job.after_step calls (0: never)."""
    eval_cost_steps: float = 1.0
    """An evaluation's time in steps, guessed for the duration estimate until one is timed."""


@dataclass
class Start:
    """Where a run starts: step 0, or what a checkpoint holds."""

    step: int = 0
    records: list[dict] = field(default_factory=list)
    wall_before: float = 0.0
    """Wall time of the run before this resume."""
    resumed: bool = False

    @classmethod
    def of(cls, checkpoint: dict | None) -> Start:
        if checkpoint is None:
            return cls()
        return cls(checkpoint["step"], checkpoint["metrics"], checkpoint["wall_time_s"], True)


@dataclass
class StepOutcome:
    """What one job.step did, for the loop."""

    events: list[dict] = field(default_factory=list)
    """Records to log now (e.g. fold_redo, nonfinite_skip, a hook's)."""
    messages: list[str] = field(default_factory=list)
    """What to tell the user about them."""
    nonfinite_in_a_row: int = 0
    """Optimizer steps in a row, this one included, whose loss or gradient norm was NaN/Inf."""
    stop: bool = False
    """End the run after this step (evaluated and checkpointed as its last)."""
    untimed_s: float = 0.0
    """Seconds of the step that are not step time (capturing a CUDA graph)."""
    postfix: dict = field(default_factory=dict)
    """The progress bar's numbers."""


class Job(Protocol):
    def describe(self) -> str:
        """The start line's tail: parameters, numerics, device, batch."""

    def step(self, step: int) -> StepOutcome:
        """Run step `step` (0-based)."""

    def train_record(self, step: int, outcome: StepOutcome, step_time_s: float) -> dict:
        """The numbers of the train record logged after step `step` (steps completed), with
        the mean step time since the last one."""

    def train_line(self, record: dict, total: int) -> str:
        """The record as a line, printed when the progress bar is not on a terminal."""

    def evaluate(self, step: int, records: list[dict]) -> tuple[dict, str]:
        """An eval record's numbers at step `step`, and the line that says them; `records`:
        the log so far."""

    def after_step(self, step: int) -> dict | None:
        """Work after the step's record, every cadence.after_step_every steps (a record's
        numbers, logged as "diagnostics")."""

    def state(self) -> dict | None:
        """The checkpoint's fields besides the loop's (model, optimizer, data_fingerprint,
        consecutive_nonfinite, the job's own); None on ranks that write nothing."""

    def finish(self, step: int, records: list[dict], wall_time_s: float) -> tuple[object, dict, str]:
        """(the run's result, final.json's contents, the done line)."""

    def draw(self) -> None:
        """Draw the run's figure (RunDir.plot calls it at most once a minute, and at the end)."""


class RunLoop:
    """A run, or the part of it one call takes (cadence.steps_this_call): `job` driven at
    `cadence` from `start`, in `folder` (whose lock the caller holds), `config` being what
    checkpoints store. With progress off only the start and
    done lines print; is_main False (a torchrun rank other than 0) logs and writes nothing."""

    def __init__(self, job: Job, folder: RunDir, config: RunConfig, cadence: Cadence,
                 start: Start, *, progress: bool = True, is_main: bool = True) -> None:
        self.job, self.folder, self.config, self.cadence, self.start = (job, folder, config,
                                                                        cadence, start)
        self.is_main = is_main
        self.progress = progress and is_main
        self.say = tqdm.write if self.progress else (lambda message: None)
        self.tell = tqdm.write if is_main else (lambda message: None)
        """The run's start and done lines, which print with progress off too."""
        self.last_checkpoint_step = start.step if start.resumed else None
        self.stopped_for_time = False
        """The last call of run() stopped at cadence.seconds_this_call, before the run's end."""

    @property
    def last_checkpoint(self) -> Path | None:
        """The run's newest checkpoint file, None before the first."""
        return self.folder.checkpoint if self.last_checkpoint_step is not None else None

    def run(self):
        """Run to the last step (or this call's last), then return job.finish's result."""
        job, cadence, start, say = self.job, self.cadence, self.start, self.say
        total = cadence.total_steps
        end = total if cadence.steps_this_call is None else min(total, start.step + cadence.steps_this_call)
        self.tell(f"{'resuming' if start.resumed else 'starting'} {self.folder.path} at step "
                  f"{start.step}/{total}: {job.describe()}")
        log = MetricsLog(self.folder.path, start.records, start.step, say) if self.is_main else _NoLog()
        on_terminal = self.progress and sys.stderr.isatty()
        bar = tqdm(total=total, initial=start.step, disable=not on_terminal, unit="step",
                   dynamic_ncols=True)
        self.t_start_call = time.perf_counter()
        window = [0.0, 0]   # step time and steps since the last train record
        clock = _Clock(cadence, start.step)
        step = start.step   # steps completed
        try:
            while True:
                if (step > start.step or not start.resumed) and _due(step, total, cadence.eval_every):
                    with clock.timing("eval"):
                        values, line = job.evaluate(step, log.records)
                        log.write({"event": "eval", "step": step, **values})
                        say(line)
                if step > start.step and (_due(step, total, cadence.checkpoint_every) or step == end):
                    with clock.timing("checkpoint"):
                        self._checkpoint(step, log)
                if step in (total, end):
                    break
                t0 = time.perf_counter()
                outcome = job.step(step)
                step += 1
                seconds = time.perf_counter() - t0 - outcome.untimed_s
                clock.stepped(step, seconds, say, self.tell)
                for record in outcome.events:
                    log.write(record)
                for message in outcome.messages:
                    say(message)
                if outcome.stop and step < total:
                    say(f"step {step}: the step hook ended the run")
                    total = end = step   # evaluated and checkpointed as the last step, then done
                if outcome.nonfinite_in_a_row >= cadence.max_nonfinite:
                    raise NonFiniteLossError(
                        nonfinite_message(step, cadence.max_nonfinite, self.last_checkpoint),
                        step, self.last_checkpoint)
                window[0] += seconds
                window[1] += 1
                bar.update(1)
                bar.set_postfix(outcome.postfix, refresh=False)
                if step % cadence.log_every == 0 or step == total:
                    record = {"event": "train", "step": step,
                              **job.train_record(step, outcome, window[0] / window[1])}
                    log.write(record)
                    window[:] = [0.0, 0]
                    if self.progress and not on_terminal:
                        say(job.train_line(record, total))
                if cadence.after_step_every and step % cadence.after_step_every == 0:
                    with clock.timing("after_step"):
                        values = job.after_step(step)
                    if values is not None:
                        log.write({"event": "diagnostics", "step": step, **values})
                if step < end and self._out_of_time():
                    end = step   # checkpointed at the top of the loop, then returned
                    self.stopped_for_time = True
        except KeyboardInterrupt:
            raise TrainingInterrupted(interrupted_message(step, self.last_checkpoint_step,
                                                          self.last_checkpoint)) from None
        finally:
            bar.close()
            log.close()
        result, final, line = job.finish(step, log.records, self.wall_time_s())
        if self.is_main:
            if step >= total:   # a call stopped by steps_this_call is not the end
                self.folder.write_final(final)
            self.folder.plot(force=True, draw=job.draw)
        if self.stopped_for_time:   # not done: said so instead of the done line
            line = (f"stopped at step {step}/{total}, {cadence.seconds_this_call / 60:g} minutes "
                    f"after the command started (--stop-after-minutes), checkpointed: run the same "
                    f"command with --resume to continue -> {self.folder.path}")
        self.tell(line)
        return result

    def _out_of_time(self) -> bool:
        """seconds_this_call have passed since the command started; under torchrun, as rank 0
        reads its clock (one all-reduce a step, only with a limit), so that every rank stops at
        the same step."""
        limit = self.cadence.seconds_this_call
        if limit is None:
            return False
        over = time.time() - call_started() >= limit
        if torch.distributed.is_available() and torch.distributed.is_initialized() and (
                torch.distributed.get_world_size() > 1):
            device = (torch.device("cuda", torch.cuda.current_device())
                      if torch.distributed.get_backend() == "nccl" else torch.device("cpu"))
            flag = torch.tensor([float(over and torch.distributed.get_rank() == 0)], device=device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            over = bool(flag.item())
        return over

    def wall_time_s(self) -> float:
        """The run's wall time, its time before this resume included."""
        return self.start.wall_before + time.perf_counter() - self.t_start_call

    def _checkpoint(self, step: int, log) -> None:
        state = self.job.state()   # on every rank: gathering FSDP's shards is collective
        if not self.is_main:
            return
        self.folder.save_checkpoint({
            "version": CHECKPOINT_VERSION, "step": step, "config": self.config.to_dict(),
            "rng": rng_state(), "metrics": log.records, "wall_time_s": self.wall_time_s(),
            **state})
        self.last_checkpoint_step = step
        self.folder.plot(draw=self.job.draw)   # at most once a minute; always at the end


class _Clock:
    """The run's expected duration, said once after its first few steps (with progress bars
    off too when it is LONG_S or more, so a long CPU run says so early): their time a step
    (the first, which warms up caches and kernels, left out) and that of the evaluations,
    checkpoints and after-step work timed so far, times how many of each are left."""

    PROBE = 5   # steps timed before the estimate

    def __init__(self, cadence: Cadence, start: int) -> None:
        self.cadence, self.start = cadence, start
        self.step_times: list[float] = []
        self.spent: dict[str, list[float]] = {"eval": [], "checkpoint": [], "after_step": []}

    @contextlib.contextmanager
    def timing(self, what: str):
        t = time.perf_counter()
        yield
        self.spent[what].append(time.perf_counter() - t)

    LONG_S = 600   # a run expected to take longer says so with progress bars off too

    def stepped(self, step: int, seconds: float, say: Callable[[str], None],
                tell: Callable[[str], None]) -> None:
        self.step_times.append(seconds)
        c = self.cadence
        left = c.total_steps - step
        if len(self.step_times) != self.PROBE or left <= 0:
            return
        per_step = sum(self.step_times[1:]) / (self.PROBE - 1)
        counts = {"eval": _count(step, c.total_steps, c.eval_every),
                  "checkpoint": _count(step, c.total_steps, c.checkpoint_every),
                  "after_step": left // c.after_step_every if c.after_step_every else 0}
        # an event not timed yet (the first checkpoint, the first diagnostics) is guessed as
        # a few steps' time
        guess = {"eval": per_step * c.eval_cost_steps, "checkpoint": 1.0,
                 "after_step": 3 * per_step}
        extra = sum(n * (sum(self.spent[k]) / len(self.spent[k]) if self.spent[k] else guess[k])
                    for k, n in counts.items())
        eta = left * per_step + extra
        (tell if eta >= self.LONG_S else say)(
            f"about {_duration(eta)} to go ({per_step:.2f} s a step for {left} steps"
            f"{f', {_duration(extra)} of evaluations, checkpoints and diagnostics' if extra >= 1 else ''})")


def _due(step: int, total: int, every: int) -> bool:
    """At the last step, and every `every` steps (0: only at the last)."""
    return step == total or (every > 0 and step % every == 0)


def _count(step: int, total: int, every: int) -> int:
    """How many of the steps after `step`, up to total, are due (see _due)."""
    return sum(_due(s, total, every) for s in range(step + 1, total + 1))


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class _NoLog:
    """The metrics log of ranks other than 0, which write nothing."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass
