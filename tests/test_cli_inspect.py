"""`lowbit inspect`: the table, JSON, safetensors files and folders, and one-line errors."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from lowbit.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def checkpoint(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": (torch.randn(64, 96, generator=g) * 0.02).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(96, 80, generator=g) * 0.02,
        "model.norm.weight": torch.ones(96, dtype=torch.float16),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def test_random_table(capsys):
    code, out, _ = run(capsys, "inspect", "--random", "128x256", "--formats", "nvfp4,mxfp4,mxfp8_e4m3,int4",
                       "--no-progress")
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].split()[:4] == ["tensor", "shape", "format", "SQNR"]
    rows = {line.split()[2]: line.split() for line in lines[2:]}
    assert set(rows) == {"nvfp4", "mxfp4", "mxfp8_e4m3", "int4"}
    # FP8 has ~10 dB more SQNR than FP4 on Gaussian data; bytes relative to bf16
    assert float(rows["mxfp8_e4m3"][3]) > float(rows["nvfp4"][3]) + 8
    assert rows["nvfp4"][-1] == f"{(128 * 128 + 128 * 16 + 4) / (128 * 256 * 2):.3f}x"
    assert len({len(line) for line in lines[2:]}) == 1  # aligned


def test_json_matches_the_library(capsys, checkpoint):
    path, tensors = checkpoint
    code, out, _ = run(capsys, "inspect", str(path), "--formats", "nvfp4,mxfp4:rceil:32x32", "--json")
    assert code == 0
    rows = json.loads(out)
    assert len(rows) == 3 * 2
    row = next(r for r in rows if r["tensor"].endswith("q_proj.weight") and r["format"] == "nvfp4")
    import lowbit
    from lowbit.diagnostics import quantization_error
    x = tensors["model.layers.0.self_attn.q_proj.weight"]
    expected = quantization_error(x, lowbit.quantize(x, "nvfp4"))
    assert row["sqnr_db"] == pytest.approx(expected.sqnr_db, rel=1e-12)
    assert row["nbytes"] == expected.nbytes and row["bf16_nbytes"] == 64 * 96 * 2
    norm_2d = next(r for r in rows if r["tensor"] == "model.norm.weight" and r["format"] != "nvfp4")
    assert "1-D tensor" in norm_2d["note"]
    rceil = [r for r in rows if r["format"] == "mxfp4:rceil:32x32" and "clipped" in r]
    assert all(r["clipped"] == 0 for r in rceil)  # truncation-free scales never clip


def test_sharded_folder_and_filter(capsys, tmp_path):
    for i in range(2):
        save_file({f"layer{i}.weight": torch.randn(32, 32)}, str(tmp_path / f"model-0000{i}.safetensors"))
    code, out, _ = run(capsys, "inspect", str(tmp_path), "--formats", "mxfp4", "--filter", "layer1", "--json")
    assert code == 0
    assert [r["tensor"] for r in json.loads(out)] == ["model-00001.safetensors:layer1.weight"]


def test_non_float_tensor_is_refused_or_skipped(capsys, tmp_path):
    path = tmp_path / "mixed.safetensors"
    save_file({"w": torch.randn(16, 32), "position_ids": torch.arange(16)}, str(path))
    code, out, err = run(capsys, "inspect", str(path))
    assert code == 2 and "position_ids" in err and "--skip-non-float" in err and out == ""
    code, out, _ = run(capsys, "inspect", str(path), "--skip-non-float", "--formats", "int8", "--json")
    assert code == 0 and [r["tensor"] for r in json.loads(out)] == ["w"]


@pytest.mark.parametrize("argv, message", [
    (["--random", "12xq"], "malformed shape"),
    (["--random", "4096x0"], "zero-sized dim"),
    (["--random", "100000x100000"], "more than --random inspects"),
    (["--random", "4x4", "--formats", "fp3"], "unknown format 'fp3'"),
    (["--random", "4x4", "--formats", "mxfp4:ceil"], "unknown option 'ceil'"),
    (["--random", "4x4", "--formats", "nvfp4:rceil"], "scale_rule applies to MX formats only"),
    (["missing.safetensors"], "no such file or folder"),
    ([], "give either a safetensors path or --random"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, message):
    code, out, err = run(capsys, "inspect", *argv)
    assert code == 2 and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_corrupt_file(capsys, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    code, _, err = run(capsys, "inspect", str(bad))
    assert code == 2 and "not a readable safetensors file" in err


def test_console_script_exit_code():
    proc = subprocess.run([sys.executable, "-m", "lowbit.cli", "inspect", "--random", "4x"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "lowbit: error: malformed shape '4x' for --random; write it like 4096x4096"
