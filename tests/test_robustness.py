"""lowbit driven as a user drives it, wrongly: damaged checkpoints, other data, bad flags,
killed runs, damaged files. Each test asserts the exit code and the one-line message (no
traceback), and that nothing was lost or created. docs/reliability.md tabulates them.

Training runs use a stand-in model and data (milliseconds a step) through the real CLI,
except the data-fingerprint test, which trains the real tiny model on a real corpus copy.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from run_helpers import VOCAB, PatternData

import lowbit.train.loop as loop
from lowbit.cli import main
from lowbit.train import TrainConfig, train
from lowbit.train.checkpoint import (CheckpointError, CheckpointStore, checkpoint_path,
                                     load_checkpoint, save_checkpoint)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)   # draws from the RNG the checkpoint must restore
        self.head = nn.Linear(16, VOCAB)

    def forward(self, idx, targets):
        logits = self.head(self.drop(torch.tanh(self.mix(self.embed(idx)))))  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return SimpleNamespace(logits=logits, loss=loss, aux_loss=torch.zeros(()))


def config(tmp_path, **overrides) -> TrainConfig:
    fields = dict(out_dir=str(tmp_path / "runs"), run_name="run", max_steps=8, warmup_steps=1,
                  batch_size=2, seq_len=8, eval_every=0, eval_batches=1, log_every=1,
                  checkpoint_every=4, progress=False, device="cpu", recipe="bf16")
    return TrainConfig(**{**fields, **overrides})


def fit(cfg, **kwargs):
    torch.manual_seed(0)
    return train(cfg, model=TinyLM(), data=PatternData(cfg), **kwargs)


@pytest.fixture
def stand_ins(monkeypatch):
    """`lowbit train` builds the stand-ins (shift: the data's, settable by the test)."""
    data = {"shift": 0}
    monkeypatch.setattr(loop, "build_data", lambda c: PatternData(c, data["shift"]))
    monkeypatch.setattr(loop, "build_model", lambda c, vocab_size: TinyLM())
    return data


TRAIN = ["train", "--recipe", "bf16", "--steps", "8", "--checkpoint-every", "4",
         "--eval-every", "0", "--eval-batches", "1", "--batch-size", "2", "--seq-len", "8",
         "--no-progress", "--device", "cpu", "--run-name", "run"]


def cli(capsys, *argv) -> tuple[int, str]:
    """Run `lowbit ARGV` in this process; (exit code, stderr)."""
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's errors
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def one_line_error(code, err, *fragments) -> None:
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if not line.startswith("lowbit: warning")]
    assert len(lines) == 1 and lines[0].startswith("lowbit: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def flip_a_weight_byte(path) -> None:
    """Flip one byte inside a stored tensor (not in zip or pickle metadata): the file still
    loads, with one changed weight."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size >= 64)
        start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    data = bytearray(path.read_bytes())
    data[start + info.file_size // 2] ^= 0x40
    path.write_bytes(bytes(data))


# --- checkpoints: checksum, history, fallback -----------------------------------------------------

def test_a_flipped_byte_is_detected_and_resume_falls_back_to_the_previous_checkpoint(tmp_path, capsys):
    whole = fit(config(tmp_path, run_name="whole"))
    fit(config(tmp_path))
    folder = checkpoint_path(tmp_path / "runs" / "run").parent
    assert sorted(p.name for p in folder.iterdir()) == ["latest.pt", "step-00000004.pt"]
    flip_a_weight_byte(folder / "latest.pt")
    with pytest.raises(CheckpointError, match="do not match its checksum"):
        load_checkpoint(folder / "latest.pt")
    resumed = fit(config(tmp_path), resume=True)
    err = capsys.readouterr().err
    assert "skipped a damaged checkpoint" in err and "resuming from" in err and "step 4" in err
    assert resumed.train_losses == whole.train_losses       # steps 5..8 again, bit for bit
    assert load_checkpoint(folder / "latest.pt")["step"] == 8


@pytest.mark.parametrize("damage", ["truncated", "empty", "text", "random bytes", "flipped byte"])
def test_resume_on_a_damaged_checkpoint_is_one_line_that_offers_overwrite(tmp_path, capsys,
                                                                          stand_ins, damage):
    code, err = cli(capsys, *TRAIN, "--out-dir", str(tmp_path), "--keep-checkpoints", "1")
    assert code == 0, err
    latest = tmp_path / "run" / "checkpoints" / "latest.pt"
    good = latest.read_bytes()
    if damage == "flipped byte":
        flip_a_weight_byte(latest)
    else:
        latest.write_bytes({"truncated": good[: len(good) // 2], "empty": b"",
                            "text": b"this is not a checkpoint\n",
                            "random bytes": torch.randint(0, 256, (4096,), dtype=torch.uint8,
                                                          generator=torch.Generator().manual_seed(1)
                                                          ).numpy().tobytes()}[damage])
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    code, err = cli(capsys, *TRAIN, "--out-dir", str(tmp_path), "--resume")
    one_line_error(code, err, str(latest), "--overwrite")
    assert "weights_only" not in err
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before  # nothing touched


def test_keep_checkpoints_keeps_the_newest_n(tmp_path):
    fit(config(tmp_path, max_steps=16, keep_checkpoints=3))
    folder = tmp_path / "runs" / "run" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["latest.pt", "step-00000008.pt",
                                                        "step-00000012.pt"]
    assert [load_checkpoint(folder / f"step-0000000{s}.pt")["step"] for s in (8,)] == [8]
    fit(config(tmp_path, run_name="one", keep_checkpoints=1))
    assert [p.name for p in (tmp_path / "runs" / "one" / "checkpoints").iterdir()] == ["latest.pt"]


def test_a_kill_between_the_two_renames_resumes_from_the_previous_checkpoint(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path, keep=2)
    store.save({"version": 2, "step": 4, "w": torch.ones(3)})
    real_replace = __import__("os").replace
    calls = []

    def replace_then_die(src, dst):
        calls.append(dst)
        real_replace(src, dst)
        if len(calls) == 1:   # latest.pt -> step-00000004.pt done, the new file not yet renamed
            raise KeyboardInterrupt

    monkeypatch.setattr("lowbit.train.checkpoint.os.replace", replace_then_die)
    with pytest.raises(KeyboardInterrupt):
        store.save({"version": 2, "step": 8, "w": torch.zeros(3)})
    monkeypatch.undo()
    loaded = CheckpointStore(tmp_path).load()
    assert loaded.state["step"] == 4 and loaded.path.name == "step-00000004.pt"
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000004.pt"]  # the temp file removed


def test_temp_files_of_a_killed_write_are_removed_at_start_and_on_overwrite(tmp_path, capsys,
                                                                           stand_ins):
    code, _ = cli(capsys, *TRAIN, "--out-dir", str(tmp_path))
    assert code == 0
    folder = tmp_path / "run" / "checkpoints"
    leftovers = [folder / ".latest.pt.4242.0badcafe.tmp", tmp_path / "run" / ".final.json.77.deadbeef.tmp"]
    keep = tmp_path / "run" / "notes.txt"   # not ours: never touched
    for path in [*leftovers, keep]:
        path.write_bytes(b"x" * 1000)
    code, err = cli(capsys, *TRAIN, "--out-dir", str(tmp_path), "--resume")
    assert code == 0, err
    assert not any(p.exists() for p in leftovers) and keep.is_file()
    leftovers[0].write_bytes(b"x" * 1000)
    code, err = cli(capsys, *TRAIN, "--out-dir", str(tmp_path), "--overwrite")
    assert code == 0 and not leftovers[0].exists() and keep.is_file()


def test_save_checkpoint_stores_a_checksum_that_load_verifies(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint({"version": 2, "step": 3, "w": torch.arange(4.0), "note": [1, (2, "a")]}, path)
    state = torch.load(path, weights_only=True)
    assert len(state["sha256"]) == 64
    assert load_checkpoint(path)["w"].tolist() == [0, 1, 2, 3]
    state["note"] = [1, (2, "b")]   # a plain value changed, the checksum kept
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="do not match its checksum"):
        load_checkpoint(path)


# --- a resumed run must read the data it started with ----------------------------------------

def test_resume_on_other_data_is_refused(tmp_path, capsys, stand_ins):
    assert cli(capsys, *TRAIN, "--out-dir", str(tmp_path))[0] == 0
    stand_ins["shift"] = 1
    code, err = cli(capsys, *TRAIN, "--out-dir", str(tmp_path), "--resume")
    one_line_error(code, err, "not the data the run started with", "--data-dir")


def test_resume_with_data_dir_pointing_at_another_corpus_is_refused(tmp_path, capsys, corpus_env):
    from lowbit.data import data_root

    original, other = tmp_path / "data", tmp_path / "other"
    for folder, edit in ((original, False), (other, True)):
        (folder / "tinyshakespeare").mkdir(parents=True)
        text = (data_root() / "tinyshakespeare" / "input.txt").read_text()[:30000]
        (folder / "tinyshakespeare" / "input.txt").write_text(text.replace("Citizen", "Ci7izen") if edit else text)
    run = ["train", "--recipe", "bf16", "--steps", "2", "--batch-size", "2", "--seq-len", "32",
           "--eval-batches", "1", "--no-diagnostics", "--no-progress", "--device", "cpu",
           "--out-dir", str(tmp_path / "runs"), "--run-name", "real"]
    assert cli(capsys, *run, "--data-dir", str(original))[0] == 0
    code, err = cli(capsys, *run, "--data-dir", str(other), "--resume")
    one_line_error(code, err, "not the data the run started with")
    assert cli(capsys, *run, "--data-dir", str(shutil.copytree(original, tmp_path / "moved")),
               "--resume")[0] == 0   # the same corpus, moved: resumes


# --- messages that get the user unstuck -----------------------------------------------------

def test_a_run_killed_before_its_first_checkpoint_is_offered_overwrite_both_ways(tmp_path, capsys,
                                                                                stand_ins):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    code, err = cli(capsys, *TRAIN, "--out-dir", str(tmp_path), "--resume")
    one_line_error(code, err, "has no checkpoint", "--overwrite")
    code, err = cli(capsys, *TRAIN, "--out-dir", str(tmp_path))
    one_line_error(code, err, "before its first checkpoint", "--overwrite")
    assert "--resume" not in err


def test_ctrl_c_names_the_last_checkpoint_and_the_resume_command(tmp_path, capsys, stand_ins,
                                                                monkeypatch):
    real_step = loop.TrainStep.__call__

    def interrupt_at_step_6(self, step, *batch):
        if step == 6:
            raise KeyboardInterrupt
        return real_step(self, step, *batch)

    monkeypatch.setattr(loop.TrainStep, "__call__", interrupt_at_step_6)
    code, err = cli(capsys, *TRAIN, "--out-dir", str(tmp_path))
    assert code == 130
    assert err.strip() == (f"lowbit: interrupted at step 6; the last checkpoint is step 4 "
                           f"({tmp_path / 'run' / 'checkpoints' / 'latest.pt'}): run the same "
                           f"command with --resume to continue")


def test_out_dir_that_is_a_file_is_one_line(tmp_path, capsys, stand_ins):
    (tmp_path / "file").write_text("x")
    code, err = cli(capsys, *TRAIN, "--out-dir", str(tmp_path / "file"))
    one_line_error(code, err, "is a file, not a folder")
    assert (tmp_path / "file").read_text() == "x"


# --- a comparison is validated whole before its first step ----------------------------------------

def test_compare_refuses_an_unknown_recipe_or_a_taken_folder_before_training_anything(tmp_path, capsys,
                                                                                      stand_ins):
    common = [a for a in TRAIN if a not in ("--recipe", "bf16", "--run-name", "run")]
    code, err = cli(capsys, *common, "--out-dir", str(tmp_path), "--compare", "bf16,nosuch")
    one_line_error(code, err, "nosuch")
    assert not tmp_path.joinpath("tiny-tinyshakespeare-bf16").exists()
    taken = tmp_path / "cmp-mxfp4"
    taken.mkdir()
    (taken / "config.json").write_text("{}")
    code, err = cli(capsys, *common, "--out-dir", str(tmp_path), "--compare", "bf16,mxfp4",
                    "--run-name", "cmp")
    one_line_error(code, err, "cmp-mxfp4", "--overwrite")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cmp-mxfp4"]   # bf16 never started


# --- lowbit plot ------------------------------------------------------------------------------

def test_plot_out_must_be_a_png_in_an_existing_folder(tmp_path, capsys):
    fit(config(tmp_path, max_steps=2, checkpoint_every=0))
    run = str(tmp_path / "runs" / "run")
    (tmp_path / "figs").mkdir()
    for out, message in ((tmp_path / "figs", "is a folder"),
                         (tmp_path / "missing" / "deeper" / "p.png", "does not exist"),
                         (tmp_path / "curves", "must name a .png file")):
        code, err = cli(capsys, "plot", run, "--out", str(out))
        one_line_error(code, err, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figs", "runs"]   # nothing created
    assert not list((tmp_path / "figs").iterdir())


def test_plot_leaves_out_a_torn_last_metrics_line_and_names_a_damaged_one(tmp_path, capsys):
    fit(config(tmp_path, max_steps=2, checkpoint_every=0))
    metrics = tmp_path / "runs" / "run" / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + '{"event": "train", "st')      # killed mid-write
    code, err = cli(capsys, "plot", str(metrics.parent), "--out", str(tmp_path / "p.png"))
    assert code == 0 and (tmp_path / "p.png").is_file()
    assert "torn last line" in err and str(metrics) in err
    metrics.write_text('{"event": "train", "st\n' + whole)   # damaged in the middle
    code, err = cli(capsys, "plot", str(metrics.parent), "--out", str(tmp_path / "p.png"))
    one_line_error(code, err, f"{metrics}, line 1")


# --- lowbit inspect: non-finite values are counted and named; bad input is one line -------------

def _safetensors(tmp_path, **tensors):
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    return str(path)


def test_inspect_counts_and_names_nonfinite_values_instead_of_scoring_them(tmp_path, capsys):
    part = torch.randn(4, 64)
    part[0, 3], part[2, 40] = float("nan"), float("inf")
    path = _safetensors(tmp_path, all_nan=torch.full((2, 32), float("nan")), part=part,
                        clean=torch.randn(2, 32))
    assert main(["inspect", path, "--formats", "nvfp4,mxfp4", "--json", "--no-progress"]) == 0
    rows = {(r["tensor"], r["format"]): r for r in json.loads(capsys.readouterr().out)}
    for fmt, block in (("nvfp4", 16), ("mxfp4", 32)):
        dead = rows[("all_nan", fmt)]
        assert dead["nonfinite"] == 64 and dead["nan"] == 64
        assert dead["sqnr_db"] == "nan" and "nothing finite to measure" in dead["note"]
        partial = rows[("part", fmt)]
        assert partial["nonfinite"] == 2 and partial["made_nonfinite"] == 2 * (block - 1)
        assert torch.isfinite(torch.tensor(partial["sqnr_db"])) and "1 NaN and 1 Inf" in partial["note"]
        assert rows[("clean", fmt)]["note"] == ""
    main(["inspect", path, "--formats", "nvfp4", "--no-progress"])
    table = capsys.readouterr().out
    line = next(row for row in table.splitlines() if row.startswith("all_nan"))
    assert " inf " not in f" {line} " and "nothing finite to measure" in line and " 64 " in line


def test_inspect_refuses_a_bad_regex_in_one_line_and_reads_fp8_tensors(tmp_path, capsys):
    path = _safetensors(tmp_path, w=torch.randn(4, 32).to(torch.float8_e4m3fn),
                        ids=torch.arange(8, dtype=torch.int32))
    one_line_error(*cli(capsys, "inspect", path, "--filter", "(unclosed"), "not a valid regular expression")
    one_line_error(*cli(capsys, "inspect", path), "'ids'", "I32", "--skip-non-float")
    assert main(["inspect", path, "--skip-non-float", "--formats", "mxfp4", "--no-progress"]) == 0
    assert "w" in capsys.readouterr().out


# --- lowbit.convert: all or nothing, and never silently nothing ------------------------------------

def _blocks(n_layers: int) -> nn.Module:
    from lowbit.models import ModelConfig, build_model

    return build_model(ModelConfig.preset("tiny", n_layers=n_layers, vocab_size=64))


def test_convert_refuses_a_partly_converted_model_without_changing_it():
    import lowbit
    from lowbit.nn import QuantLinear

    model = _blocks(4)
    late = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and "layers.3" in n][0]
    lowbit.quantize_(model.get_submodule(late.rsplit(".", 1)[0]), "stable-fp4")  # one block done
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match="already converted.*nothing was changed"):
        lowbit.quantize_(model, "stable-fp4")
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == \
        sum(isinstance(m, QuantLinear) for m in model.get_submodule(late.rsplit(".", 1)[0]).modules())


def test_convert_reports_modules_it_does_not_understand_and_warns_when_it_quantizes_nothing():
    import lowbit

    transformers_utils = pytest.importorskip("transformers.pytorch_utils")
    gpt2_like = nn.ModuleDict({"c_attn": transformers_utils.Conv1D(96, 32),
                               "lm_head": nn.Linear(32, 64)})
    with pytest.warns(UserWarning, match="quantized no module.*Conv1D"):
        report = lowbit.quantize_(gpt2_like, "stable-fp4")
    assert [(n, t) for n, t, _ in report.not_understood] == [("c_attn", "Conv1D")]
    assert "unknown    c_attn" in str(report) and "(32, 96)" in str(report)
    with pytest.warns(UserWarning, match="'nvfp4' quantized no module"):
        report = lowbit.quantize_(_blocks(2), "nvfp4")     # its first/last-block rule keeps both
    assert not report.swapped and "first/last 1 blocks" in str(report)


# --- every format's scales stay finite for every finite input -----------------------------------

@pytest.mark.parametrize("fmt, options", [
    ("nvfp4", {}), ("nvfp4", {"tensor_scale": False}), ("mxfp4", {}), ("mxfp4", {"scale_rule": "rceil"}),
    ("mxfp8_e4m3", {"scale_rule": "rceil"}), ("mxfp8_e5m2", {}), ("int2", {}), ("int4", {}),
    ("int8", {"block": (32, 32)}), ("ternary", {}), ("ternary", {"block": (32, 32)}), ("binary", {}),
])
def test_a_finite_input_never_comes_back_nonfinite_even_at_float32s_edges(fmt, options):
    from lowbit.formats import QuantSpec, quantize, quantize_dequantize

    g = torch.Generator().manual_seed(0)
    for amax in (3.4028e38, 1e38, 1e37, 1e36, 1.0, 1e-30, 1e-38, 1e-44):
        x = (torch.rand(32, 128, generator=g) * 2 - 1) * amax
        x[0, :] = amax                      # whole blocks at the magnitude
        q = quantize(x, fmt, **options)
        assert torch.isfinite(q.dequantize()).all(), (fmt, options, amax)
        if q.scales.dtype != torch.uint8:          # E8M0 codes are exponents, 255 only for NaN
            assert torch.isfinite(q.scales.float()).all(), (fmt, options, amax)
        else:
            assert (q.scales != 255).all()
        spec = QuantSpec.make(fmt, **options)
        assert torch.isfinite(quantize_dequantize(x, spec)).all(), (fmt, options, amax)


# --- the library's input errors: one clear exception, not an AttributeError deep inside ---------

def test_quantize_refuses_what_is_not_a_tensor_and_options_that_mean_nothing():
    import numpy as np

    import lowbit

    for x, hint in ((None, "NoneType"), ([1.0, 2.0], "torch.tensor(x)"),
                    (np.ones(32, np.float32), "torch.from_numpy(x)")):
        with pytest.raises(TypeError, match=re_escape(hint)):
            lowbit.quantize(x, "nvfp4")
    x = torch.randn(4, 32)
    for kwargs, message in ((dict(tensor_scale=True), "tensor_scale applies to nvfp4 only"),
                            (dict(block=(1, 32.0)), "pair of integers"),
                            (dict(generator=torch.Generator()), "stochastic rounding only")):
        with pytest.raises(ValueError, match=message):
            lowbit.quantize(x, "mxfp4", **kwargs)
    lowbit.quantize(x, "mxfp4", rounding="stochastic", generator=torch.Generator())  # meaningful


def test_dequantize_to_float64_is_the_float32_values_widened():
    import lowbit

    x = torch.randn(8, 64)
    for fmt in ("nvfp4", "mxfp4", "int4"):
        q = lowbit.quantize(x, fmt)
        assert torch.equal(q.dequantize(torch.float64), q.dequantize(torch.float32).double())


def test_load_qtensors_names_a_damaged_file(tmp_path):
    import lowbit

    path = tmp_path / "q.safetensors"
    lowbit.save_qtensors(path, {"w": lowbit.quantize(torch.randn(16, 64), "nvfp4")})
    whole = path.read_bytes()
    for damaged in (whole[: len(whole) // 2], b"", b"not safetensors at all"):
        path.write_bytes(damaged)
        with pytest.raises(ValueError, match=re_escape(str(path))):
            lowbit.load_qtensors(path)


def test_inspect_refuses_an_option_that_means_nothing(capsys):
    one_line_error(*cli(capsys, "inspect", "--random", "8x32", "--formats", "mxfp4:single"),
                   "tensor_scale applies to nvfp4 only")


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


# --- lowbit bench: refused before it measures --------------------------------------------------

def test_bench_json_pointing_at_a_folder_is_refused_before_the_benchmark_runs(tmp_path, capsys,
                                                                              monkeypatch):
    import lowbit.bench.train as bench_train_module   # where `lowbit bench train` looks it up

    ran = []
    monkeypatch.setattr(bench_train_module, "bench_train", lambda *a, **k: ran.append(1) or [])
    one_line_error(*cli(capsys, "bench", "train", "--json", str(tmp_path)), "is a folder")
    (tmp_path / "file").write_text("x")
    one_line_error(*cli(capsys, "bench", "train", "--json", str(tmp_path / "file" / "b.json")),
                   "is a file, not a folder")
    assert not ran


def test_bench_kernels_without_triton_is_one_line(capsys, monkeypatch):
    import lowbit.kernels as kernels

    monkeypatch.setattr(kernels, "triton_importable", lambda: False)
    one_line_error(*cli(capsys, "bench", "kernels"), "needs triton")


def test_a_seq_len_past_the_presets_context_is_said(tmp_path, capsys, stand_ins):
    code, err = cli(capsys, *TRAIN, "--out-dir", str(tmp_path), "--seq-len", "1100", "--steps", "1")
    assert code == 0
    assert "--seq-len 1100 exceeds the tiny preset's context of 1024 tokens" in err
    code, err = cli(capsys, *TRAIN, "--out-dir", str(tmp_path), "--run-name", "short")
    assert "exceeds" not in err


def _bad_flag_rows():
    """(command, expected text) from docs/reliability.md's bad-flag table."""
    import re
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "reliability.md").read_text()
    table = text.split("## Bad flags, per command", 1)[1]
    rows = re.findall(r"^\| `lowbit ([^`]*)` \| (.+?) \|$", table, flags=re.M)
    assert len(rows) >= 60, "the bad-flag table lost its rows"
    return rows


@pytest.mark.parametrize("command,says", _bad_flag_rows(), ids=lambda v: v if " " in v else None)
def test_every_bad_flag_in_the_reliability_table_is_one_line_and_creates_nothing(
        command, says, tmp_path, monkeypatch, capsys, corpus_env):
    import shlex

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / ".cache-outside"))
    (tmp_path / "afile").write_text("not a folder\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    try:
        code = main(shlex.split(command))
    except SystemExit as e:   # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("lowbit: error: "), err
    assert says.replace("`", "") in lines[0].replace("`", ""), err
    after = sorted(p.name for p in tmp_path.iterdir() if p.name != ".cache-outside")
    assert after == before, f"{command} created {set(after) - set(before)}"


def test_kill_9_at_random_moments_then_resume_gives_the_uninterrupted_curve(tmp_path, capsys,
                                                                          stand_ins):
    """The real CLI in a forked process, SIGKILLed at seeded random moments (while stepping,
    writing metrics, or mid-checkpoint), resumed each time as the messages say (--resume; or
    --overwrite when no checkpoint was written yet): the final curve equals one run never
    killed, every step logged once, no temp file left behind. A kill waits for a seeded number
    of new steps in the log, then a seeded fraction of a step: it lands however fast or loaded
    the machine is."""
    import multiprocessing
    import os
    import random
    import signal
    import time

    argv = [*TRAIN, "--steps", "60", "--checkpoint-every", "5", "--log-every", "1"]
    code, err = cli(capsys, *argv, "--out-dir", str(tmp_path / "warm"))   # caches, imports
    assert code == 0, err
    code, err = cli(capsys, *argv, "--out-dir", str(tmp_path / "whole"))
    assert code == 0, err
    whole = [json.loads(line) for line in (tmp_path / "whole" / "run" / "metrics.jsonl").open()]

    def child(extra):
        torch.set_num_threads(1)
        os._exit(main([*argv, "--out-dir", str(tmp_path / "killed"), *extra]))

    def logged_steps() -> int:   # train records in the log now (a line being written is not)
        try:
            return (run / "metrics.jsonl").read_text().count('"event": "train"')
        except FileNotFoundError:
            return 0

    fork = multiprocessing.get_context("fork")
    rng, run = random.Random(0), tmp_path / "killed" / "run"
    kills = 0
    for attempt in range(8):
        has_checkpoint = (run / "checkpoints" / "latest.pt").exists() or any(
            (run / "checkpoints").glob("step-*.pt"))
        extra = ["--resume"] if has_checkpoint else (["--overwrite"] if run.exists() else [])
        before = logged_steps() if has_checkpoint else 0
        process = fork.Process(target=child, args=(extra,))
        process.start()
        if kills < 4:   # four kills, each some steps past where this start begins, then none
            target, step_s = before + rng.randint(2, 9), 0.0
            while process.is_alive() and logged_steps() < target:
                time.sleep(0.002)
            last = time.perf_counter()
            while process.is_alive() and logged_steps() < target + 1 and step_s < 5:
                time.sleep(0.002)       # one step's time, to kill at a fraction of the next
                step_s = time.perf_counter() - last
            time.sleep(rng.uniform(0, 1) * step_s)
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
                process.join()
                kills += 1
                continue
        process.join()
        assert process.exitcode == 0, f"attempt {attempt} ({extra}) exited {process.exitcode}"
        if (run / "final.json").exists():
            break
    assert (run / "final.json").exists(), "the run never finished in 8 starts"
    assert kills == 4, f"only {kills} kills landed; lengthen the run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    train_records = [(r["step"], r["loss"]) for r in records if r["event"] == "train"]
    assert train_records == [(r["step"], r["loss"]) for r in whole if r["event"] == "train"]
    assert [r["step"] for r in records if r["event"] == "train"] == list(range(1, 61))
    assert json.loads((run / "final.json").read_text())["val_loss"] == json.loads(
        (tmp_path / "whole" / "run" / "final.json").read_text())["val_loss"]
    assert not list(run.rglob("*.tmp"))
