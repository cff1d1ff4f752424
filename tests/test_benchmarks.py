"""The GPU benchmark scripts still run (their CPU smoke modes), so a device call is never spent
on a script that breaks before it measures anything; and train_recipes.py's step fitting and
summary work end to end on a tiny CPU run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def script(name: str, *args: str, env: dict | None = None, timeout: int = 600):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args], cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1", **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_bench_kernels_smoke():
    pytest.importorskip("triton")
    run = script("bench_kernels.py", "--smoke", "--no-torchao")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "0 failed" in run.stdout


@pytest.mark.slow
def test_every_kernel_variant_compiles_for_hopper():
    """Triton's compiler and ptxas run on the CPU: each kernel variant the library launches
    compiles for sm_90 (the interpreter-run tests cannot see a construct only the compiler
    rejects)."""
    pytest.importorskip("triton")
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton build has no ptxas")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_sm90.py")],
                         cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " 0 failed" in run.stdout
    for kernel in ("_quantize_kernel", "_tensor_amax_kernel", "_uniforms_kernel",
                   "_band_max_kernel", "_fold_one_chunk_kernel", "_live_blocks_kernel",
                   "_fold_kernel", "_rht_rows_kernel"):
        assert kernel in run.stdout, kernel


def test_bench_fp8_fold_smoke():
    pytest.importorskip("triton")
    run = script("bench_fp8_fold.py", "--smoke")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


@pytest.mark.parametrize("name, args, expect", [
    ("sweep_fold.py", (), "equal=True"),
    ("sweep_nvfp4.py", ("--amax",), "2/2 configs equal the transposed-view kernel"),
])
def test_config_sweeps_smoke(name, args, expect, tmp_path):
    """The tile sweeps run end to end on tiny shapes, every swept config giving the default's
    bits (so a device call spends its time timing, not failing)."""
    pytest.importorskip("triton")
    run = script(name, "--smoke", *args, env={"OUT": str(tmp_path)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert expect in run.stdout and "equal=False" not in run.stdout
    assert list(tmp_path.glob("*.json"))


def test_sweeps_without_a_gpu_say_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the sweep would run")
    run = script("sweep_fp8_gemm.py")
    assert run.returncode == 1 and "this machine has none" in run.stderr


def test_fold_inexact_smoke(tmp_path, corpus_env):
    """The fold diagnosis trains the tiny model on the CPU (exact folds there: counts 0)."""
    run = script("fold_inexact.py", "--model", "tiny", "--seq-len", "64", "--steps", "2",
                 "--device", "cpu", env={**corpus_env, "OUT": str(tmp_path)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    steps = json.loads((tmp_path / "fold_inexact.json").read_text())["steps"]
    assert [(s["step"], s["rounded"]) for s in steps] == [(1, 0), (2, 0)]


def test_host_overhead_runs():
    pytest.importorskip("triton")
    run = script("host_overhead.py")
    assert run.returncode == 0, run.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines() if "us per linear" in line)
    assert set(lines) == {"bf16", "stable-fp4", "stable-fp4-fp8", "nvfp4", "mxfp4"}


@pytest.mark.slow
def test_train_recipes_fits_steps_and_summarizes(tmp_path, corpus_env):
    out = tmp_path / "runs"
    run = script("train_recipes.py", "--name", "t", "--recipes", "bf16,stable-fp4",
                 "--out-dir", str(out), "--fit-min", "0.25", "--probe-s", "12",
                 "--probe-window-s", "5", "--deadline-min", "3", "--",
                 "--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--eval-every", "5",
                 "--eval-batches", "1", "--diag-every", "5", "--device", "cpu",
                 env={"OMP_NUM_THREADS": "1"})   # LOWBIT_CACHE: corpus_env's
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "fitted --steps" in run.stdout
    steps = int(run.stdout.split("fitted --steps ")[1].split()[0])
    assert steps >= 5 and steps % 5 == 0
    summary = json.loads((out / "t" / "summary.json").read_text())
    assert [r["recipe"] for r in summary["rows"]] == ["bf16", "stable-fp4"]
    assert all(r["finished"] and r["steps_done"] == steps for r in summary["rows"])
    assert summary["step"] == steps and summary["rows"][0]["gap_pct"] == 0
    for f in ("summary.md", "loss.png", "gradbias.png", "gap.png"):
        assert (out / "t" / f).stat().st_size > 0
    with tarfile.open(out / "t" / "runs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"t-bf16/metrics.jsonl", "t-stable-fp4/final.json",
            "probe/t-stable-fp4-probe.metrics.jsonl"} <= names


def test_train_recipes_refuses_an_unknown_recipe_before_starting(tmp_path):
    run = script("train_recipes.py", "--name", "t", "--recipes", "bf16,fp3", "--out-dir",
                 str(tmp_path / "runs"), "--", "--model", "tiny", timeout=120)
    assert run.returncode == 2 and "unknown recipe(s) fp3" in run.stderr
    assert not (tmp_path / "runs").exists()
