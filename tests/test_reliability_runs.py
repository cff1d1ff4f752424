"""The run folders of `lowbit train`, `lowbit qat` and `lowbit rl` driven as a user drives them,
wrongly (as a reliability probe did): two processes on one folder, `--quick` beside explicit flags, a
resume on other data or another source, a NaN loss, Ctrl-C. Each test asserts the exit code,
the one line said, and that nothing a live run wrote was lost. docs/reliability.md tabulates them.

Runs are tiny: stand-in data (no corpus read), one-layer models, a few steps on the CPU.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from run_helpers import RL, SMALL, PatternData, cli, finished_run, one_line_error, use_pattern_data

from lowbit.cli import build_parser, main
from lowbit.rl import grpo
from lowbit.rl.cli_args import QUICK, config_from_args
from lowbit.rl.trainer import GRPOTrainer
from lowbit.train import TrainConfig, train
from lowbit.train.checkpoint import load_checkpoint, write_json_atomic
from lowbit.train.run_dir import LOCK_FILE, RunDir
from lowbit.train.step import TrainStep


@pytest.fixture
def pattern_data(monkeypatch):
    use_pattern_data(monkeypatch)


TRAIN = ["train", "--recipe", "bf16", *SMALL, "--steps", "6", "--checkpoint-every", "2",
         "--eval-every", "0", "--eval-batches", "1", "--no-progress", "--device", "cpu",
         "--no-diagnostics", "--run-name", "run"]
QAT = ["qat", "--estimator", "ste", "--weights", "int4:g32", "--steps", "4", "--eval-every", "2",
       "--checkpoint-every", "2", "--warmup-steps", "1", "--no-baselines", "--device", "cpu",
       "--no-progress", "--run-name", "q"]








def strict_json_file(path):
    """The file's JSON, refusing the bare NaN / Infinity that Python's json writes by default."""
    def refuse(name):
        raise AssertionError(f"{path} holds a bare {name}: not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


@contextlib.contextmanager
def held_by_another_process(folder):
    """Another process holds `folder`'s run lock (a plain flock on the lock file, as a live lowbit
    run holds it) until the block ends, when it is killed: a dead process holds no lock."""
    folder.mkdir(parents=True, exist_ok=True)
    code = ("import fcntl, sys; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
            "f.truncate(0); f.write('4242'); f.flush(); print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(folder / LOCK_FILE)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait(timeout=30)


def contents(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


# --- 1. one writer per run folder ----------------------------------------------------------

def test_a_folder_another_process_writes_is_refused_even_with_overwrite_or_resume(tmp_path, capsys,
                                                                                 pattern_data):
    run = tmp_path / "run"
    # a live run before its first checkpoint: config.json and metrics.jsonl, no checkpoint
    run.mkdir()
    (run / "config.json").write_text("{}\n")
    (run / "metrics.jsonl").write_text('{"event": "train", "step": 1, "loss": 3.0}\n')
    before = contents(run)
    with held_by_another_process(run):
        for extra in ([], ["--overwrite"], ["--resume"]):
            code, err = cli(capsys, *TRAIN, "--out-dir", tmp_path, *extra)
            one_line_error(code, err, f"{run} is in use", "another lowbit process (pid 4242)")
            assert contents(run) == before                    # nothing read as stopped, or removed
        code, err = cli(capsys, *RL, "--out-dir", tmp_path, "--run-name", "run", "--overwrite")
        one_line_error(code, err, f"{run} is in use", "another lowbit process")
        assert contents(run) == before
    # the holder is dead: its lock went with it, and --overwrite starts over
    code, err = cli(capsys, *TRAIN, "--out-dir", tmp_path, "--overwrite")
    assert code == 0, err
    assert load_checkpoint(run / "checkpoints" / "latest.pt")["step"] == 6


def test_train_and_rl_hold_their_folder_for_the_runs_life_and_release_it(tmp_path, monkeypatch):
    attempts = []

    def second_writer(folder):
        second = RunDir(folder)
        try:
            second.lock()   # another open file: flock refuses it as it would another process
        except ValueError as e:
            attempts.append(str(e))
        else:
            attempts.append("taken")
            second.release()

    config = TrainConfig(model="tiny", n_layers=1, dim=64, seq_len=8, batch_size=2, max_steps=3,
                         warmup_steps=0, eval_every=0, eval_batches=1, checkpoint_every=0,
                         recipe="bf16", device="cpu", progress=False, diagnostics=False,
                         out_dir=str(tmp_path), run_name="t")
    train(config, data=PatternData(config), on_step=lambda step: second_writer(tmp_path / "t"))
    assert len(attempts) == 3 and all("is in use" in a for a in attempts)
    second_writer(tmp_path / "t")
    assert attempts[-1] == "taken"   # released at the end

    attempts.clear()
    real_step = GRPOTrainer.one_step
    monkeypatch.setattr(GRPOTrainer, "one_step",
                        lambda self, step: (second_writer(self.run_dir), real_step(self, step))[1])
    assert main([*RL, "--out-dir", str(tmp_path)]) == 0
    assert len(attempts) == 4 and all("is in use" in a for a in attempts)
    second_writer(tmp_path / "rl")
    assert attempts[-1] == "taken"


def test_a_refused_or_failed_job_lets_go_of_its_folder(tmp_path, capsys):
    parse = lambda *argv: config_from_args(build_parser().parse_args([*RL, "--out-dir", str(tmp_path),
                                                                      *argv]))
    (tmp_path / "rl").mkdir()
    with pytest.raises(FileNotFoundError):
        GRPOTrainer(parse("--task", "gsm8k", "--data-dir", str(tmp_path / "no-such")))
    with RunDir(tmp_path / "rl") as folder:
        folder.lock()   # not held by the trainer that failed (its exception is still alive)
    assert main([*RL, "--out-dir", str(tmp_path), "--steps", "2"]) == 0
    with pytest.raises(ValueError, match="config differs"):
        GRPOTrainer(parse("--steps", "2", "--lr", "1e-4"), resume=True)
    with pytest.raises(ValueError, match="already holds a run"):   # not "in use": released
        GRPOTrainer(parse("--steps", "2"))


# --- 2. flags given explicitly win over --quick -------------------------------------------

def test_rl_quick_fills_in_only_the_flags_not_given(tmp_path):
    parse = lambda *argv: config_from_args(build_parser().parse_args(["rl", "--quick", *argv]))
    quick = parse()
    assert {k: getattr(quick, k) for k in QUICK} == QUICK
    given = parse("--steps", "5", "--warmstart-steps", "0", "--eval-every", "0",
                  "--checkpoint-every", "20")   # 20 is RLConfig's default: still given
    assert (given.steps, given.warmstart_steps, given.eval_every, given.checkpoint_every) == (5, 0, 0, 20)
    assert (given.num_generations, given.max_completion_length) == (QUICK["num_generations"],
                                                                    QUICK["max_completion_length"])
    plain = config_from_args(build_parser().parse_args(["rl"]))
    assert (plain.steps, plain.task_size, plain.warmstart_steps) == (40, 1, 150)   # RLConfig's


# --- 3. a resume reads the data and the source it started with --------------------------

def _gsm8k(folder, offset: int):
    (folder / "gsm8k").mkdir(parents=True)
    for split, first in (("train", 0), ("test", 10)):
        rows = [{"question": f"{a}+{offset}?", "answer": f"#### {a + offset}"}
                for a in range(first, first + 6)]
        (folder / "gsm8k" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_rl_resume_on_other_problems_is_refused_and_a_moved_copy_resumes(tmp_path, capsys):
    first, other = _gsm8k(tmp_path / "a", 1), _gsm8k(tmp_path / "b", 2)
    gsm8k = [*RL, "--out-dir", tmp_path / "runs", "--task", "gsm8k"]
    assert cli(capsys, *gsm8k, "--data-dir", first, "--steps", "2")[0] == 0
    code, err = cli(capsys, *gsm8k, "--data-dir", other, "--steps", "2", "--resume")
    one_line_error(code, err, "cannot resume", "not the data the run started with", "--data-dir")
    shutil.copytree(first, tmp_path / "moved")
    code, err = cli(capsys, *gsm8k, "--data-dir", tmp_path / "moved", "--steps", "2", "--resume")
    assert code == 0, err





def test_qat_resume_from_another_source_is_refused_and_a_moved_one_resumes(tmp_path, capsys,
                                                                          pattern_data):
    source, other = finished_run(tmp_path, "src", 0), finished_run(tmp_path, "other", 1)
    out = ["--out-dir", tmp_path / "qat"]
    assert cli(capsys, *QAT, *out, "--from", source)[0] == 0
    code, err = cli(capsys, *QAT, *out, "--from", other, "--resume")
    one_line_error(code, err, "cannot resume", "started from other weights", str(source), "--from")
    moved = shutil.copytree(source, tmp_path / "moved")
    code, err = cli(capsys, *QAT, *out, "--from", moved, "--resume")
    assert code == 0, err
    run = tmp_path / "qat" / "q-int4-g32-ste"
    before = contents(run)
    with held_by_another_process(run):   # QAT's runs take the lock too (through train())
        code, err = cli(capsys, *QAT, *out, "--from", source, "--overwrite")
        one_line_error(code, err, f"{run} is in use", "another lowbit process")
    assert contents(run) == before


# --- 4, 5. a NaN loss stops the run in one line; every JSON file is strict ------------------

def test_rl_stops_at_the_first_nan_loss_and_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    real_loss, calls = grpo.policy_loss, []

    def nan_from_the_third_step(*args, **kwargs):
        calls.append(1)
        loss, metrics = real_loss(*args, **kwargs)
        return (loss * math.nan if len(calls) >= 3 else loss), metrics

    monkeypatch.setattr(grpo, "policy_loss", nan_from_the_third_step)
    code, err = cli(capsys, *RL, "--out-dir", tmp_path)
    latest = tmp_path / "rl" / "checkpoints" / "latest.pt"
    line = one_line_error(code, err, exit_code=1)
    assert line == (f"lowbit: error: stopped at step 3: the loss or gradient norm was NaN/Inf; "
                    f"the last checkpoint, {latest}, is from before and intact. Try a lower --lr")
    saved = load_checkpoint(latest)
    assert saved["step"] == 2 and all(torch.isfinite(t).all() for t in saved["model"].values())
    assert not (tmp_path / "rl" / "final.json").exists()
    for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda name: pytest.fail(f"bare {name}"))


def test_qat_on_nan_is_one_line_naming_only_qat_flags(tmp_path, capsys, pattern_data, monkeypatch):
    source = finished_run(tmp_path, "src", 0)
    real_loss = TrainStep.loss

    def nan_loss(self, batch):
        return real_loss(self, batch) * math.nan

    monkeypatch.setattr(TrainStep, "loss", nan_loss)
    code, err = cli(capsys, *QAT, "--out-dir", tmp_path / "qat", "--from", source, "--steps", "8")
    line = one_line_error(code, err, "stopped at step 5", "5 steps in a row", exit_code=1)
    flags = {word.strip(",.") for word in line.split() if word.startswith("--")}
    assert flags == {"--lr", "--warmup-steps"}
    with pytest.raises(SystemExit):
        main(["qat", "--help"])
    usage = capsys.readouterr().out
    assert all(f"[{flag} " in usage for flag in flags) and "--grad-clip" not in usage


def test_every_json_file_is_strict_json_with_nan_and_inf_as_strings(tmp_path):
    values = {"loss": math.nan, "ppl": math.inf, "rows": [{"gap": -math.inf}, (1.5, math.nan)]}
    RunDir(tmp_path / "run").write_final(values)   # lowbit train's and QAT's final.json
    assert strict_json_file(tmp_path / "run" / "final.json")["loss"] == "nan"
    # RL's final.json with a NaN reward (a run whose every step was logged non-finite)
    args = build_parser().parse_args([*RL, "--out-dir", str(tmp_path), "--steps", "1"])
    trainer = GRPOTrainer(config_from_args(args))
    trainer.run()
    _, final, _ = trainer.finish(1, [{"event": "train", "reward": math.nan,
                                      "sampling/kl_k3": math.inf}], 1.0)
    trainer.folder.write_final(final)
    final = strict_json_file(tmp_path / "rl" / "final.json")
    assert (final["final_reward"], final["sampling/kl_k3"]) == ("nan", "inf")
    # the one writer behind them and the summaries (float() reads the strings back)
    write_json_atomic(tmp_path / "a.json", values)
    assert strict_json_file(tmp_path / "a.json") == {
        "loss": "nan", "ppl": "inf", "rows": [{"gap": "-inf"}, [1.5, "nan"]]}


# --- 6. Ctrl-C in RL says where to resume from -------------------------------------------

def test_rl_ctrl_c_names_the_last_checkpoint_and_the_resume_command(tmp_path, capsys, monkeypatch):
    real_step = GRPOTrainer.one_step

    def interrupt_at_step_3(self, step):
        if step == 3:
            raise KeyboardInterrupt
        return real_step(self, step)

    monkeypatch.setattr(GRPOTrainer, "one_step", interrupt_at_step_3)
    code, err = cli(capsys, *RL, "--out-dir", tmp_path)
    assert code == 130
    assert err.strip() == (f"lowbit: interrupted at step 3; the last checkpoint is step 2 "
                           f"({tmp_path / 'rl' / 'checkpoints' / 'latest.pt'}): run the same "
                           f"command with --resume to continue")
    monkeypatch.undo()
    code, err = cli(capsys, *RL, "--out-dir", tmp_path, "--resume")
    assert code == 0, err
    assert load_checkpoint(tmp_path / "rl" / "checkpoints" / "latest.pt")["step"] == 4
