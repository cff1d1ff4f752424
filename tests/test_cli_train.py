"""The default `lowbit train` (stable-fp4, tiny model, Tiny Shakespeare), shortened, as a user runs it."""

import json
import subprocess
import sys

from lowbit.cli import main


def test_default_train_command_writes_a_complete_run_folder(tmp_path, corpus_env):
    proc = subprocess.run(
        [sys.executable, "-m", "lowbit.cli", "train", "--steps", "12", "--eval-every", "6",
         "--eval-batches", "2", "--diag-every", "6", "--out-dir", str(tmp_path / "runs"), "--no-progress"],
        capture_output=True, text=True, env={**corpus_env, "LOWBIT_FIGURES": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "runs" / "tiny-tinyshakespeare-stable-fp4"
    # --no-progress: the start and done lines, no step or evaluation lines
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"starting {run} at step 0/12"), proc.stdout
    assert lines[-1].startswith("done: val loss") and lines[-1].endswith(str(run)), proc.stdout
    assert not any(line.startswith("step ") for line in lines), proc.stdout
    for name in ("config.json", "metrics.jsonl", "loss.png", "final.json", "checkpoints/latest.pt"):
        assert (run / name).is_file(), name
    assert list(run.glob("events.out.tfevents.*")) or list(run.glob("tb/events.out.tfevents.*")) \
        or list(run.rglob("events.out.tfevents.*"))
    final = json.loads((run / "final.json").read_text())
    assert final["recipe"] == "stable-fp4" and final["steps"] == 12 and final["val_ppl"] > 1
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    diag = [r for r in records if r["event"] == "diagnostics"]
    assert diag and diag[0]["diag/w_fwd_bwd_rel_diff"] == 0.0 and 0 < diag[0]["diag/dw_cos"] <= 1


def test_a_run_that_repeats_its_data_more_than_3_times_warns(tmp_path, corpus_env, capsys):
    assert main(["train", "--recipe", "bf16", "--steps", "4", "--batch-size", "64",
                 "--seq-len", "256", "--corpus-max-bytes", "20000", "--eval-batches", "1",
                 "--out-dir", str(tmp_path / "runs"), "--no-progress"]) == 0
    assert "reads its training split 3.3 times" in capsys.readouterr().err
    final = json.loads((tmp_path / "runs" / "tiny-tinyshakespeare-bf16" / "final.json").read_text())
    assert final["epochs"] > 3


def test_seq_len_longer_than_a_split_is_refused_before_the_run_folder_exists(tmp_path, corpus_env,
                                                                            capsys):
    assert main(["train", "--seq-len", "5000000", "--steps", "2",
                 "--out-dir", str(tmp_path / "runs")]) == 2
    assert "use a shorter seq_len" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_resume_takes_the_runs_saved_flags_and_refuses_a_changed_one(tmp_path, corpus_env, capsys):
    out = ["--out-dir", str(tmp_path / "runs"), "--no-progress"]
    short = ["--recipe", "bf16", "--steps", "3", "--checkpoint-every", "2", "--eval-batches", "1",
             "--seq-len", "32", "--batch-size", "2"]
    assert main(["train", *short, "--run-name", "r", *out]) == 0
    run = tmp_path / "runs" / "r"
    (run / "final.json").unlink()                       # as if stopped after its checkpoint at 2
    # only the run's name given again: its other flags come from its config.json
    assert main(["train", "--resume", "--run-name", "r", *out]) == 0
    final = json.loads((run / "final.json").read_text())
    assert final["steps"] == 3 and final["recipe"] == "bf16"
    capsys.readouterr()
    # a flag given now that the run did not start with: refused, naming it
    assert main(["train", "--resume", "--run-name", "r", "--steps", "6", *out]) == 2
    assert "max_steps: 3 -> 6" in capsys.readouterr().err


def test_an_interrupted_comparison_continues_with_resume(tmp_path, corpus_env, capsys):
    args = ["train", "--compare", "bf16,mxfp4", "--steps", "2", "--eval-batches", "1",
            "--seq-len", "32", "--batch-size", "2", "--out-dir", str(tmp_path / "runs"),
            "--no-progress"]
    assert main(args) == 0
    first = tmp_path / "runs" / "tiny-tinyshakespeare-bf16" / "final.json"
    second = tmp_path / "runs" / "tiny-tinyshakespeare-mxfp4" / "final.json"
    kept = first.read_bytes()
    second.unlink()                                   # as if stopped in its last steps
    capsys.readouterr()
    assert main(args + ["--resume"]) == 0             # the finished run kept, the other finished
    assert first.read_bytes() == kept and second.is_file()
    assert "bf16" in capsys.readouterr().out
