"""Faults a user meets mid-run, simulated: a full disk while writing a checkpoint, a figure, a
summary or metrics.jsonl; an interrupted comparison continued with --resume; RL rollouts that
carry no learning signal; an empty tensor in a safetensors file; a weight of the wrong shape
sent to the rollout engine. Each test fails without its fix; docs/reliability.md lists them.
"""

from __future__ import annotations

import errno
import io
import json
import os

import pytest
import torch
from run_helpers import RL, SMALL, cli, finished_run, one_line_error, use_pattern_data

import lowbit.qat.run as qat_run
import lowbit.rl.compare as rl_compare
import lowbit.train.metrics as metrics
from lowbit.cli import build_parser, main
from lowbit.models import build_model
from lowbit.models.config import ModelConfig
from lowbit.rl.cli_args import config_from_args
from lowbit.rl.engine import RolloutEngine
from lowbit.rl.trainer import GRPOTrainer
from lowbit.train.checkpoint import (TEMP_SUFFIX, CheckpointStore, load_checkpoint,
                                     save_checkpoint, write_json_atomic)
from lowbit.train.runner import TrainingInterrupted
from lowbit.train.metrics import MetricsLog
from lowbit.train.step import TrainStep

TRAIN = ["train", "--recipe", "bf16", *SMALL, "--steps", "4", "--checkpoint-every", "2",
         "--eval-every", "0", "--eval-batches", "1", "--no-progress", "--device", "cpu",
         "--no-diagnostics", "--run-name", "run"]
QAT = ["qat", "--weights", "int4:g32", "--steps", "4", "--eval-every", "2", "--checkpoint-every",
       "2", "--warmup-steps", "1", "--no-baselines", "--device", "cpu", "--no-progress",
       "--run-name", "q"]
NO_SPACE = "no space left on device; free space on its disk, or choose another path"


@pytest.fixture
def pattern_data(monkeypatch):
    use_pattern_data(monkeypatch)








def temp_files(folder) -> list:
    return [p for p in folder.rglob("*") if p.name.endswith(TEMP_SUFFIX)]


def no_space() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))   # as a write raises it: no file name


class FullDisk(io.RawIOBase):
    """A file whose writes fail with ENOSPC after `room` bytes, as a full disk's do."""

    def __init__(self, file, room: int = 1000):
        self.file, self.room = file, room

    def writable(self):
        return True

    def write(self, data):
        self.room -= len(data)
        if self.room < 0:
            raise no_space()
        return self.file.write(data)


# --- 1. a full disk during a checkpoint write ------------------------------------------------

def test_a_full_disk_while_checkpointing_is_one_line_naming_the_file_and_keeps_the_previous_one(
        tmp_path, capsys, pattern_data, monkeypatch):
    real_save, saves = torch.save, []

    def second_save_finds_the_disk_full(state, f, *args, **kwargs):
        saves.append(1)
        return real_save(state, FullDisk(f) if len(saves) == 2 else f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", second_save_finds_the_disk_full)
    code, err = cli(capsys, *TRAIN, "--out-dir", tmp_path)
    latest = tmp_path / "run" / "checkpoints" / "latest.pt"
    # torch's zip writer turns the OSError into a RuntimeError; lowbit says the file and errno
    assert one_line_error(code, err) == f"lowbit: error: {latest}: {NO_SPACE}"
    assert temp_files(tmp_path) == []
    assert load_checkpoint(latest)["step"] == 2   # the previous checkpoint, whole
    assert CheckpointStore(latest.parent).load().state["step"] == 2

    # an error that carries no errno still names the file; one whose text says it keeps it
    for error, code in ((RuntimeError("PytorchStreamWriter failed writing file data/0"), None),
                        (RuntimeError("I/O error: No space left on device (os error 28)"), 28)):
        def failing_save(state, f, *args, error=error, **kwargs):
            f.write(b"\0" * 64)
            raise error
        monkeypatch.setattr(torch, "save", failing_save)
        with pytest.raises(OSError) as raised:
            save_checkpoint({"version": 2, "step": 3}, latest)
        assert (raised.value.errno, raised.value.filename) == (code, str(latest))
        assert load_checkpoint(latest)["step"] == 2 and temp_files(tmp_path) == []


# --- 2. every write names its file; a figure is never left empty ----------------------------

def test_file_system_errors_name_the_file_and_a_failed_figure_leaves_the_old_one(
        tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"event": "train", "step": s, "tokens": 16 * s, "loss": 3.0 / s}) + "\n"
        for s in (1, 2, 3)))
    figure = tmp_path / "loss.png"
    assert cli(capsys, "plot", run, "--out", figure)[0] == 0
    before = figure.read_bytes()

    from matplotlib.figure import Figure

    def savefig_on_a_full_disk(self, fname, **kwargs):
        file = open(fname, "wb") if isinstance(fname, (str, os.PathLike)) else fname
        file.write(b"\x89PNG")
        raise no_space()

    monkeypatch.setattr(Figure, "savefig", savefig_on_a_full_disk)
    code, err = cli(capsys, "plot", run, "--out", figure)
    assert one_line_error(code, err) == f"lowbit: error: {figure}: {NO_SPACE}"
    assert figure.read_bytes() == before   # not an empty or torn PNG
    code, err = cli(capsys, "plot", run, "--out", tmp_path / "new.png")
    one_line_error(code, err, str(tmp_path / "new.png"))
    assert not (tmp_path / "new.png").exists() and temp_files(tmp_path) == []
    monkeypatch.undo()

    # summaries (summary.json, table.md, final.json): an fsync that fails names the file
    real_fsync = os.fsync

    def fsync_on_a_full_disk(fd):
        raise no_space()

    monkeypatch.setattr(os, "fsync", fsync_on_a_full_disk)
    with pytest.raises(OSError) as raised:
        write_json_atomic(tmp_path / "summary.json", {"a": 1})
    assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, str(tmp_path / "summary.json"))
    assert not (tmp_path / "summary.json").exists() and temp_files(tmp_path) == []
    monkeypatch.setattr(os, "fsync", real_fsync)

    # metrics.jsonl, appended record by record
    real_open = open

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        if "a" in mode:
            file.write = lambda text: (_ for _ in ()).throw(no_space())
        return file

    monkeypatch.setattr(metrics, "open", open_on_a_full_disk, raising=False)
    log = MetricsLog(run, [], 0, lambda message: None)
    with pytest.raises(OSError) as raised:
        log.write({"event": "train", "step": 4, "loss": 1.0})
    log.close()
    assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, str(run / "metrics.jsonl"))


# --- 3. comparisons: every folder checked first, --resume continues them ---------------------




def test_qat_compare_checks_every_folder_first_and_resume_continues_it(tmp_path, capsys,
                                                                      pattern_data, monkeypatch):
    source, out = finished_run(tmp_path), tmp_path / "qat"
    compare = [*QAT, "--out-dir", out, "--from", source, "--compare", "ste,lsq,clipped-ste"]
    ste, lsq, clipped = (out / f"q-int4-g32-{e}" for e in ("ste", "lsq", "clipped-ste"))
    clipped.mkdir(parents=True)
    (clipped / "config.json").write_text("{}")
    code, err = cli(capsys, *compare)
    one_line_error(code, err, str(clipped), "--overwrite")
    assert not ste.exists()   # refused before the first run started
    (clipped / "config.json").unlink()

    real_call, calls = TrainStep.__call__, []

    def interrupt_the_second_run_at_its_step_3(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4 + 3:
            raise KeyboardInterrupt
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(TrainStep, "__call__", interrupt_the_second_run_at_its_step_3)
    code, err = cli(capsys, *compare)
    assert code == 130, err
    monkeypatch.setattr(TrainStep, "__call__", real_call)
    finished = {p.name: p.read_bytes() for p in ste.rglob("*") if p.is_file()}
    assert load_checkpoint(lsq / "checkpoints" / "latest.pt")["step"] == 2
    assert not (lsq / "final.json").exists() and not (clipped / "checkpoints").exists()

    real_train, trained = qat_run.train, []

    def recording_train(config, **kwargs):
        trained.append((config.name, kwargs["resume"]))
        return real_train(config, **kwargs)

    monkeypatch.setattr(qat_run, "train", recording_train)
    code, err = cli(capsys, *compare, "--resume")
    assert code == 0, err
    assert trained == [(lsq.name, True), (clipped.name, False)]   # the finished run is kept
    assert {p.name: p.read_bytes() for p in ste.rglob("*") if p.is_file()} == finished
    assert load_checkpoint(lsq / "checkpoints" / "latest.pt")["step"] == 4
    (folder,) = out.glob("q-*-summary")   # named by the setting (int4:g32, three arms)
    assert folder.name == "q-int4-g32-ste+lsq+clipped-ste-summary"
    summary = json.loads((folder / "summary.json").read_text())
    assert [r["estimator"] for r in summary["runs"]] == ["ste", "lsq", "clipped-ste"]
    assert (folder / "seeds" / "summary.md").is_file()


def test_an_rl_setting_label_reads_back_as_its_config(tmp_path):
    """RLConfig.setting (the label --compare names runs by) and config_for_setting are inverses,
    for every part a label can have; `+is` alone is token-level IS."""
    base = config_from_args(build_parser().parse_args([*RL, "--out-dir", str(tmp_path)]))
    for label in ["bf16", "nvfp4", "nvfp4+quads", "nvfp4+quads@0.5", "nvfp4+is-sequence",
                  "nvfp4+qat+static-act", "nvfp4+quads@0.1+is-token+static-act", "nvfp4+quads+g64",
                  "nvfp4@0.5+g16+is-token"]:
        config = rl_compare.config_for_setting(base, label)
        assert config.setting == label
        assert rl_compare.config_for_setting(base, config.setting) == config
    assert rl_compare.config_for_setting(base, "bf16+is").importance_sampling == "token"
    with pytest.raises(ValueError, match="ROLLOUT"):
        rl_compare.config_for_setting(base, "bf16+static-act")
    with pytest.raises(ValueError, match="groups RAC's channels"):
        rl_compare.config_for_setting(base, "nvfp4+g64")      # a group needs RAC
    for label in ("nvfp4+quads+g064", "nvfp4+quads+g0", "nvfp4+quads+g64@0.5"):   # not canonical
        with pytest.raises(ValueError, match="ROLLOUT"):
            rl_compare.config_for_setting(base, label)


def test_rl_compare_checks_every_folder_first_and_resume_continues_it(tmp_path, monkeypatch):
    base = config_from_args(build_parser().parse_args([*RL, "--out-dir", str(tmp_path)]))
    settings = ["bf16", "bf16+is"]
    first, second = (tmp_path / rl_compare.config_for_setting(base, s).name for s in settings)
    second.mkdir()
    (second / "config.json").write_text("{}")
    with pytest.raises(ValueError) as refused:
        rl_compare.compare_settings(base, settings)
    assert f"{second} holds a run" in str(refused.value) and "--overwrite" in str(refused.value)
    assert not first.exists()   # refused before the first run started
    (second / "config.json").unlink()

    real_step = GRPOTrainer.one_step

    def interrupt_the_second_run_at_step_3(self, step):   # step: the steps done before it
        if self.config.importance_sampling != "none" and step == 2:
            raise KeyboardInterrupt
        return real_step(self, step)

    monkeypatch.setattr(GRPOTrainer, "one_step", interrupt_the_second_run_at_step_3)
    with pytest.raises(TrainingInterrupted):
        rl_compare.compare_settings(base, settings)
    monkeypatch.setattr(GRPOTrainer, "one_step", real_step)
    finished = (first / "final.json").read_bytes()

    real_run, runs = rl_compare.run_rl, []

    def recording_run(config, **kwargs):
        runs.append((config.name, kwargs["resume"]))
        return real_run(config, **kwargs)

    monkeypatch.setattr(rl_compare, "run_rl", recording_run)
    results, folder = rl_compare.compare_settings(base, settings, resume=True)
    assert runs == [(second.name, True)]   # the finished run is taken as it is
    assert (first / "final.json").read_bytes() == finished
    assert [r.steps for r in results] == [4, 4] and (folder / "summary.md").is_file()


# --- 4. RL without a learning signal says so ---------------------------------------------------

def test_rl_logs_the_fraction_of_groups_without_reward_variance_and_warns_once(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(GRPOTrainer, "score", lambda self, problems, rollout:
                        torch.zeros(len(problems)))
    code, err = cli(capsys, *RL, "--out-dir", tmp_path, "--steps", "6")
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "no learning signal" in line]
    assert len(warnings) == 1, err
    assert warnings[0].startswith("lowbit: warning: no learning signal: every group's rewards "
                                  "are equal") and "first 5 steps" in warnings[0]
    records = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["frac_reward_zero_std"] for r in records if r["event"] == "train"] == [1.0] * 6

    # a run shorter than that says so at its last step
    code, err = cli(capsys, *RL, "--out-dir", tmp_path, "--steps", "3", "--run-name", "short")
    assert code == 0 and err.count("no learning signal") == 1 and "first 3 steps" in err, err

    # one group of two with a signal: half the groups, no warning
    monkeypatch.setattr(GRPOTrainer, "score", lambda self, problems, rollout:
                        torch.tensor([0.0, 1.0] + [0.0] * (len(problems) - 2)))
    code, err = cli(capsys, *RL, "--out-dir", tmp_path, "--steps", "5", "--run-name", "signal")
    assert code == 0 and "no learning signal" not in err, err
    records = [json.loads(line) for line in (tmp_path / "signal" / "metrics.jsonl").read_text().splitlines()]
    assert {r["frac_reward_zero_std"] for r in records if r["event"] == "train"} == {0.5}


# --- 5. an empty tensor in a safetensors file -------------------------------------------------

def test_inspect_skips_an_empty_tensor_with_a_note_naming_it(tmp_path, capsys):
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"empty.weight": torch.zeros(0, 32), "w": torch.randn(16, 32)}, str(path))
    code = main(["inspect", str(path), "--formats", "nvfp4", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    empty = [line for line in out.splitlines() if line.startswith("empty.weight")]
    assert len(empty) == 1 and "0x32" in empty[0] and "empty tensor" in empty[0], out
    assert any(line.startswith("w ") and "0.2" in line for line in out.splitlines()), out


# --- 6. the rollout engine refuses a weight of the wrong shape ----------------------------------

@pytest.mark.parametrize("moe", [False, True])
def test_the_rollout_engine_refuses_a_weight_of_the_wrong_shape_naming_it(moe):
    config = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                         n_experts=4 if moe else 0)
    engine = RolloutEngine(config, max_batch_size=2)
    state = build_model(config).state_dict()
    engine.load_state_dict(state)
    name, wrong = (("model.layers.1.mlp.experts.down_proj", (4, 64, 8)) if moe else
                   ("model.layers.1.self_attn.k_proj.weight", (16, 64)))
    expected = tuple(state[name].shape)
    with pytest.raises(ValueError) as raised:
        engine.load_state_dict({**state, name: torch.zeros(wrong)})
    assert f"{name!r} has shape {wrong}, not the {expected}" in str(raised.value)


@pytest.mark.parametrize("command, advice", [("rl", "lower --micro-batch-size"),
                                             ("train", "raise --grad-accum-steps"),
                                             ("qat", "lower --batch-size")])
def test_out_of_gpu_memory_is_one_line_with_what_to_lower(command, advice, tmp_path, monkeypatch,
                                                            capsys):
    # what a 128-completion RL step of a 152k-vocabulary policy met on one H200 (2026-12-05)
    message = ("CUDA out of memory. Tried to allocate 10.29 GiB. GPU 0 has a total capacity of "
               "139.80 GiB of which 5.92 GiB is free. Including non-PyTorch memory, ...")

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(message)

    monkeypatch.setattr("lowbit.rl.trainer.run_rl", out_of_memory)
    monkeypatch.setattr("lowbit.train.cli_args.train", out_of_memory)
    monkeypatch.setattr("lowbit.qat.cli_args.run_qat", out_of_memory)
    code, err = cli(capsys, command, "--out-dir", tmp_path, "--no-progress")
    line = one_line_error(code, err, "out of memory (CUDA out of memory. Tried to allocate 10.29 GiB)",
                          advice, exit_code=1)
    assert "GPU 0 has" not in line


def test_rl_compare_in_parallel_processes_gives_the_sequential_runs(tmp_path, capsys):
    # --parallel-runs 2: each run in a process of its own; the warm start they share is trained
    # by one while the other waits for it (two trainings at once would collide on its folder);
    # a run is the one `lowbit rl` makes alone (rewards equal, losses to the threads' rounding)
    from lowbit.cli import main
    from lowbit.train.metrics import read_metrics

    assert main(["rl", "--quick", "--rollout", "bf16", "--align", "none", "--no-progress",
                 "--out-dir", str(tmp_path / "alone")]) == 0
    assert main(["rl", "--quick", "--compare", "bf16,nvfp4", "--no-progress", "--parallel-runs", "2",
                 "--out-dir", str(tmp_path / "par")]) == 0
    out = capsys.readouterr().out
    assert "| bf16 |" in out and "| nvfp4 |" in out
    assert len([p for p in (tmp_path / "par" / "warmstart").iterdir() if p.is_dir()]) == 1
    (alone,) = [p for p in (tmp_path / "alone").iterdir() if p.name.startswith("rl-")]
    runs = [[r for r in read_metrics(folder) if r["event"] in ("train", "eval")]
            for folder in (alone, tmp_path / "par" / alone.name)]
    assert [r["step"] for r in runs[0]] == [r["step"] for r in runs[1]] and runs[0]
    for a, b in zip(*runs):
        assert a.get("reward") == b.get("reward") and a.get("eval/accuracy") == b.get("eval/accuracy")
        if "loss" in a:
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    assert (tmp_path / "par" / "rl-tiny-add-nvfp4" / "final.json").is_file()
    assert main(["rl", "--quick", "--parallel-runs", "2", "--out-dir", str(tmp_path)]) == 2
    assert "--parallel-runs goes with --compare" in capsys.readouterr().err


def test_rl_stop_after_minutes_stops_checkpointed_and_resume_finishes(tmp_path, capsys):
    # a limit shorter than a step: the call stops at step 1's end, checkpointed, no final.json;
    # the same command with --resume (no limit) finishes the run
    from lowbit.cli import main

    flags = ["rl", "--quick", "--rollout", "bf16", "--align", "none", "--no-progress",
             "--out-dir", str(tmp_path)]
    assert main([*flags, "--stop-after-minutes", "1e-9"]) == 0
    (run,) = [p for p in tmp_path.iterdir() if p.name.startswith("rl-")]
    assert not (run / "final.json").exists() and (run / "checkpoints").is_dir()
    said = capsys.readouterr()
    assert "stopped at step 1/3" in said.out + said.err and "--resume to continue" in said.out + said.err
    assert main([*flags, "--resume"]) == 0
    assert json.loads((run / "final.json").read_text())["steps"] == 3
    assert main([*flags, "--stop-after-minutes", "-1", "--overwrite"]) == 2
    assert "stop_after_minutes must be a positive number" in capsys.readouterr().err
