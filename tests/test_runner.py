"""The run loop every job plugs into (lowbit.train.runner), driven by a toy job: when it
evaluates, checkpoints, logs and stops; what a checkpoint holds and how a run resumes from one;
a call that stops early; a job's stop; NaN/Inf steps; Ctrl-C. `lowbit train` and `lowbit rl`
are its two real jobs (tests/test_train.py, tests/test_rl_grpo.py run them)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from lowbit.config import RunConfig
from lowbit.train.checkpoint import load_checkpoint
from lowbit.train.run_dir import RunDir
from lowbit.train.runner import (Cadence, NonFiniteLossError, RunLoop, Start, StepOutcome,
                                 TrainingInterrupted)


@dataclass
class ToyConfig(RunConfig):
    steps: int = 6


class ToyJob:
    """Counts: its 'loss' is the number of steps done; records every call."""

    def __init__(self, nan_at=(), stop_at=None, interrupt_at=None, done=0) -> None:
        self.calls: list[tuple] = []
        self.done = done
        self.nan_at, self.stop_at, self.interrupt_at = set(nan_at), stop_at, interrupt_at
        self.nan_run = 0
        self.draws = 0   # the run's figure: at most once a minute at a checkpoint, and at the end

    def describe(self) -> str:
        return "a toy"

    def step(self, step: int) -> StepOutcome:
        if step == self.interrupt_at:
            raise KeyboardInterrupt
        self.calls.append(("step", step))
        self.done += 1
        self.nan_run = self.nan_run + 1 if step in self.nan_at else 0
        return StepOutcome(events=[{"event": "note", "step": step + 1}], messages=[f"did {step}"],
                           nonfinite_in_a_row=self.nan_run, stop=step + 1 == self.stop_at)

    def train_record(self, step, outcome, step_time_s) -> dict:
        return {"loss": float(self.done)}

    def train_line(self, record, total) -> str:
        return f"step {record['step']}/{total}"

    def evaluate(self, step, records) -> tuple[dict, str]:
        self.calls.append(("eval", step))
        return {"score": float(step)}, f"eval at {step}"

    def after_step(self, step):
        self.calls.append(("after", step))
        return {"probe": 1.0}

    def state(self) -> dict:
        return {"done": self.done}

    def finish(self, step, records, wall_time_s):
        return ("result", step), {"steps": step}, f"done at {step}"

    def draw(self) -> None:
        self.draws += 1


def _loop(tmp_path, job, start=None, **cadence) -> tuple[RunLoop, RunDir]:
    config = ToyConfig()
    folder = RunDir(tmp_path / "toy")
    folder.lock()
    folder.start(config, fresh=start is None or not start.resumed)
    cadence = Cadence(**{"total_steps": 6, **cadence})
    return RunLoop(job, folder, config, cadence, start or Start(), progress=False), folder


def _records(folder: RunDir) -> list[dict]:
    return [json.loads(line) for line in (folder.path / "metrics.jsonl").read_text().splitlines()]


def test_the_cadence_and_what_a_run_writes(tmp_path, figures):
    job = ToyJob()
    loop, folder = _loop(tmp_path, job, eval_every=4, checkpoint_every=4, log_every=2,
                         after_step_every=3)
    assert loop.run() == ("result", 6)
    assert job.calls == [("eval", 0), ("step", 0), ("step", 1), ("step", 2), ("after", 3),
                         ("step", 3), ("eval", 4), ("step", 4), ("step", 5), ("after", 6),
                         ("eval", 6)]
    records = _records(folder)
    assert [(r["event"], r["step"]) for r in records if r["event"] != "note"] == [
        ("eval", 0), ("train", 2), ("diagnostics", 3), ("train", 4), ("eval", 4), ("train", 6),
        ("diagnostics", 6), ("eval", 6)]
    assert [r["loss"] for r in records if r["event"] == "train"] == [2.0, 4.0, 6.0]
    assert all("step_time_s" not in r for r in records)   # the job's numbers, as it gives them
    checkpoint = load_checkpoint(folder.checkpoint)
    assert checkpoint["step"] == 6 and checkpoint["done"] == 6
    assert set(checkpoint) >= {"version", "step", "config", "rng", "metrics", "wall_time_s"}
    assert json.loads((folder.path / "final.json").read_text()) == {"steps": 6}
    assert job.draws == 1   # at the end: the first redraw at a checkpoint comes a minute in


@pytest.mark.parametrize("on, minutes, draws", [(True, 0.0, 1), (True, 1.01, 3), (False, 1.01, 0)])
def test_a_run_redraws_its_figure_at_most_once_a_minute_and_at_the_end(tmp_path, monkeypatch, on, minutes,
                                                                       draws):
    import lowbit.train.run_dir as run_dir

    monkeypatch.setenv("LOWBIT_FIGURES", "1" if on else "0")
    clock = iter(range(10**6))   # each read of the clock `minutes` later than the one before
    monkeypatch.setattr(run_dir, "time", SimpleNamespace(monotonic=lambda: next(clock) * minutes * 60))
    job = ToyJob()
    # checkpoints at steps 4 and 6 (the end), each a redraw once a minute has passed; then the end's
    loop, _ = _loop(tmp_path, job, checkpoint_every=4)
    loop.run()
    assert job.draws == draws


def test_a_resume_starts_where_the_checkpoint_left_and_does_not_evaluate_again(tmp_path):
    job = ToyJob()
    loop, folder = _loop(tmp_path, job, eval_every=2, checkpoint_every=2, steps_this_call=3)
    assert loop.run() == ("result", 3)
    assert not (folder.path / "final.json").exists()       # this call's end is not the run's
    checkpoint = load_checkpoint(folder.checkpoint)
    assert checkpoint["step"] == 3                          # checkpointed at this call's end
    folder.release()

    start = Start.of(checkpoint)
    assert (start.step, start.resumed) == (3, True) and start.records == checkpoint["metrics"]
    resumed = ToyJob(done=checkpoint["done"])
    loop, folder = _loop(tmp_path, resumed, start=start, eval_every=2, checkpoint_every=2)
    loop.run()
    assert resumed.calls == [("step", 3), ("eval", 4), ("step", 4), ("step", 5), ("eval", 6)]
    assert [r["step"] for r in _records(folder) if r["event"] == "eval"] == [0, 2, 4, 6]
    assert json.loads((folder.path / "final.json").read_text()) == {"steps": 6}


def test_a_job_that_stops_ends_the_run_evaluated_and_checkpointed(tmp_path):
    job = ToyJob(stop_at=2)
    loop, folder = _loop(tmp_path, job, eval_every=0, checkpoint_every=0)
    assert loop.run() == ("result", 2)
    assert job.calls == [("step", 0), ("step", 1), ("eval", 2)]
    assert load_checkpoint(folder.checkpoint)["step"] == 2
    assert json.loads((folder.path / "final.json").read_text()) == {"steps": 2}


def test_nonfinite_steps_in_a_row_stop_the_run_naming_the_last_checkpoint(tmp_path):
    job = ToyJob(nan_at={3, 4})
    loop, folder = _loop(tmp_path, job, checkpoint_every=2, max_nonfinite=2)
    with pytest.raises(NonFiniteLossError, match="stopped at step 5: the loss or gradient norm "
                                                 "was NaN/Inf for 2 steps in a row") as stopped:
        loop.run()
    assert stopped.value.step == 5 and stopped.value.checkpoint == folder.checkpoint
    assert load_checkpoint(folder.checkpoint)["step"] == 4   # from before the second
    assert not (folder.path / "final.json").exists()


def test_ctrl_c_says_the_step_and_the_checkpoint_to_resume_from(tmp_path):
    loop, folder = _loop(tmp_path, ToyJob(interrupt_at=3), checkpoint_every=2)
    with pytest.raises(TrainingInterrupted) as interrupted:
        loop.run()
    assert str(interrupted.value) == (f"at step 3; the last checkpoint is step 2 "
                                      f"({folder.checkpoint}): run the same command with "
                                      f"--resume to continue")
    loop, _ = _loop(tmp_path / "early", ToyJob(interrupt_at=1), checkpoint_every=2)
    with pytest.raises(TrainingInterrupted, match="before the first checkpoint"):
        loop.run()


def test_a_time_limit_stops_the_call_at_a_step_end_checkpointed_and_a_resume_finishes(
        tmp_path, monkeypatch, capsys):
    # a clock that moves 10 s a step, the command started at 0: with a 25 s limit the call
    # stops after step 3
    import lowbit.train.runner as runner
    from lowbit.config import CALL_STARTED

    clock = [0.0]
    monkeypatch.setattr(runner.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(runner.time, "time", lambda: clock[0])
    monkeypatch.setenv(CALL_STARTED, "0")

    class Slow(ToyJob):
        def step(self, step):
            clock[0] += 10.0
            return super().step(step)

    job = Slow()
    loop, folder = _loop(tmp_path, job, eval_every=2, checkpoint_every=0, seconds_this_call=25.0)
    loop.tell = print
    assert loop.run() == ("result", 3) and loop.stopped_for_time
    assert job.calls == [("eval", 0), ("step", 0), ("step", 1), ("eval", 2), ("step", 2)]
    assert load_checkpoint(folder.checkpoint)["step"] == 3 and not (folder.path / "final.json").exists()
    out = capsys.readouterr().out
    assert "stopped at step 3/6, 0.416667 minutes after the command started (--stop-after-minutes)" in out
    assert "--resume to continue" in out and "done at" not in out
    folder.release()

    resumed = Slow(done=3)
    monkeypatch.setenv(CALL_STARTED, str(clock[0]))   # a new command
    loop, folder = _loop(tmp_path, resumed, start=Start.of(load_checkpoint(folder.checkpoint)),
                         eval_every=2, checkpoint_every=0, seconds_this_call=1000.0)
    assert loop.run() == ("result", 6) and not loop.stopped_for_time
    assert json.loads((folder.path / "final.json").read_text()) == {"steps": 6}
    # the last step is the run's end, not a stop, however late it comes; and a call that
    # starts past its limit (setup took it all) still takes a step
    loop, folder = _loop(tmp_path / "late", Slow(), seconds_this_call=1.0, total_steps=1)
    assert loop.run() == ("result", 1) and not loop.stopped_for_time
    assert (folder.path / "final.json").exists()
    monkeypatch.setenv(CALL_STARTED, str(clock[0] - 100.0))   # setup took the whole limit
    loop, folder = _loop(tmp_path / "past", Slow(), seconds_this_call=1.0)
    assert loop.run() == ("result", 1) and loop.stopped_for_time


def test_a_long_run_says_how_long_after_its_first_steps_with_progress_off(tmp_path, monkeypatch, capsys):
    # a clock that moves 10 s a step: after 5 steps, 95 steps of 10 s are left (15 min 50 s, and
    # 11 s guessed for the last evaluation and checkpoint),
    # said with progress bars off (a short run's estimate is not)
    import lowbit.train.runner as runner

    clock = [0.0]
    monkeypatch.setattr(runner.time, "perf_counter", lambda: clock[0])

    class Slow(ToyJob):
        def step(self, step):
            clock[0] += 10.0
            return super().step(step)

    loop, folder = _loop(tmp_path, Slow(), total_steps=100, eval_every=0, checkpoint_every=0)
    loop.tell = print
    loop.run()
    out = capsys.readouterr().out
    assert out.count("to go") == 1 and "about 16 min 01 s to go (10.00 s a step for 95 steps" in out
    folder.release()
    loop, folder = _loop(tmp_path / "short", Slow(), total_steps=20, eval_every=0, checkpoint_every=0)
    loop.tell = print
    loop.run()
    assert "to go" not in capsys.readouterr().out       # 2 min 30 s: only with progress bars
