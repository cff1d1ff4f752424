"""benchmarks/tune.py's sweeps still run (their CPU smoke modes: tiny shapes, the kernels in
Triton's interpreter) and every config they try gives the default's bits, so a GPU is never
spent on a sweep that breaks before it measures anything; and every Triton kernel variant
compiles for Hopper on this CPU (tune.py compile-sm90)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowbit.bench import run_meta
from run_helpers import ROOT, script_module

TUNE = ROOT / "benchmarks" / "tune.py"


@pytest.fixture(scope="module")
def tune():
    """benchmarks/tune.py as a module: its smoke modes run in this process, whose Triton
    already runs in the interpreter on the CPU (tests/conftest.py)."""
    pytest.importorskip("triton")
    return script_module(TUNE)


def smoke(tune, tmp_path, *args) -> dict:
    out = tmp_path / "results.json"
    assert tune.main([*args, "--smoke", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["meta"]["device"] == "cpu"
    return report["results"]


def test_amax_sweep_smoke(tune, tmp_path):
    results = smoke(tune, tmp_path, "amax")
    [configs] = [row["configs"] for row in results.values()]
    assert len(configs) == 6 and sum("hadamard" in k for k in configs) == 3
    assert sum(k.endswith(" default") for k in configs) == 2       # what lowbit launches
    assert all(isinstance(v, dict) and v["same"] for v in configs.values()), configs


def test_fold_sweep_smoke(tune, tmp_path, capsys):
    results = smoke(tune, tmp_path, "fold", "--operands", "X,dY")
    assert set(results) == {"X 96x96", "dY 64x128"}
    for row in results.values():
        swept = {k: v for k, v in row.items() if k.startswith("pass") or k == "best"}
        assert len(swept) == 5 and all(isinstance(v, dict) and v["same"] for v in swept.values())
    assert capsys.readouterr().out.count("every config equal to the default: True") == 2
    assert tune.main(["fold", "--smoke", "--operands", "X,Q"]) == 2
    assert "--operands takes X, W and dY; got 'X,Q'" in capsys.readouterr().err


def test_engine_gemm_sweep_smoke(tune, tmp_path, capsys):
    results = smoke(tune, tmp_path, "engine-gemm")
    assert set(results) == {"smoke M=1", "smoke M=3"}
    # the NVFP4 kernel's one smoke tile, at both row counts (one tensor-core kernel for all)
    assert len(results["smoke M=1"]["tiles"]) == 1 and len(results["smoke M=3"]["tiles"]) == 1
    for row in results.values():
        assert all(isinstance(v, dict) and v["same"] for v in row["tiles"].values()), row["tiles"]
    assert capsys.readouterr().out.count("fastest nvfp4: untimed") == 2


def test_activation_sweep_smoke(tune, tmp_path, capsys):
    results = smoke(tune, tmp_path, "activation")
    assert set(results) == {f"K=48 M={m} rac={r}" for m in (1, 3) for r in (0.0, 0.25)}
    for row in results.values():   # every warp count gives the default's bits
        assert set(row["warps"]) == {"2", "4"} and all(v["same"] for v in row["warps"].values()), row
        if row["rac"]:   # RAC's radix select without its early stop: the same bits
            assert row["every_radix_step"]["same"] and row["early_stop"]["same"], row
            assert set(row["ties_at_the_cut"]) == {"True", "False"}, row
            assert all(v["same"] for v in row["ties_at_the_cut"].values()), row   # the reference's bits
    assert capsys.readouterr().out.count("fastest: untimed") == 4
    # bad lists are refused in one line, exit 2, before anything runs
    for flag, value in (("--rows", "x"), ("--warps", "0")):
        with pytest.raises(SystemExit) as stop:
            tune.main(["activation", "--smoke", flag, value])
        assert stop.value.code == 2
        assert f"{flag}: expected comma-separated positive integers, got '{value}'" in capsys.readouterr().err
    assert tune.main(["activation", "--smoke", "--warps", "2,3"]) == 2
    assert "--warps takes powers of two from 1 to 32; got [3]" in capsys.readouterr().err


def test_nvfp4_sweep_smoke(tune, tmp_path, capsys):
    results = smoke(tune, tmp_path, "nvfp4", "--amax")
    rotated = results["dY^T rht 32x64"]
    for table in (results["dY 32x64"]["configs"], rotated["configs"], rotated["rht_rows"],
                  rotated["amax"]):
        assert table and all(isinstance(v, dict) and v["same"] for v in table.values()), table
    assert "2/2 configs equal the transposed-view kernel" in capsys.readouterr().out


def test_fp8_gemm_sweep_smoke_errors_against_fp64(tune, tmp_path):
    """The row-wise torch._scaled_mm (on the CPU here) with bf16 output is within bf16's
    rounding of an fp64 GEMM of the same E4M3 values."""
    [row] = smoke(tune, tmp_path, "fp8-gemm").values()
    assert 0 < row["err_rowwise"] < 4e-3 and 0 < row["err_bf16_mm"] < 4e-3


def test_host_overhead_smoke(tune, tmp_path, capsys):
    results = smoke(tune, tmp_path, "host-overhead", "--profile", "stable-fp4-fp8")
    assert set(results) == {"bf16", "stable-fp4", "stable-fp4-fp8", "nvfp4", "mxfp4"}
    assert all(us > 0 for us in results.values())
    assert "tottime" in capsys.readouterr().out        # the cProfile of --profile's recipe
    assert tune.main(["host-overhead", "--smoke", "--profile", "fp3"]) == 2
    assert "--profile: unknown recipe 'fp3'" in capsys.readouterr().err


def test_sweeps_without_a_gpu_refuse_in_one_line(tune, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the sweep would run")
    assert tune.main(["fp8-gemm"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lowbit: error: tune.py fp8-gemm measures on "
                                                   "a CUDA GPU and this machine has none")
    with pytest.raises(SystemExit) as exit_:
        tune.main(["sweep-everything"])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


@pytest.mark.slow
def test_every_kernel_variant_compiles_for_hopper(tmp_path):
    """Triton's compiler and ptxas run on the CPU: each kernel variant the library launches
    compiles for sm_90 (the interpreter-run tests cannot see a construct only the compiler
    rejects). In a fresh process: the kernels must be compiled, not interpreted."""
    triton = pytest.importorskip("triton")

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton build has no ptxas")
    out = tmp_path / "compile.json"
    # a spread of 48 of the variants: compiling all of them from a cold Triton cache takes
    # minutes on a 2-core CPU (`tune.py compile-sm90` alone does; the GPU tests run them all)
    run = subprocess.run([sys.executable, str(TUNE), "compile-sm90", "--limit", "48", "--json",
                          str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=1500,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "48 of " in run.stdout and " 0 failed" in run.stdout
    results = json.loads(out.read_text())["results"]
    assert results["failed"] == [] and results["variants"] > 200 and results["compiled"] == 48
    assert set(results["kernels"]) == {"_quantize_kernel", "tensor_amax_kernel",
                                       "_uniforms_kernel", "_band_max_kernel",
                                       "_fold_one_chunk_kernel", "_live_blocks_kernel",
                                       "_fold_kernel", "_rht_rows_kernel",
                                       "engine_linear_kernel", "nvfp4_linear_kernel",
                                       "_decode_attention_kernel",
                                       "_decode_attention_combine_kernel",
                                       "activation_kernel", "_nvfp4_tiles_kernel"}   # the rollout engine's


def test_activation_sass_counts_racs_forms_compiled_for_sm90(tmp_path):
    """tune.py activation-sass: the activation pass compiled for sm_90 on this CPU in each of
    RAC's forms (in a fresh process: the kernels compiled, not interpreted); RAC costs
    instructions, its groups of 64 fewer than the row-wide choice (at K 256 too)."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm").exists():
        pytest.skip("this triton build has no nvdisasm")
    out = tmp_path / "sass.json"
    run = subprocess.run([sys.executable, str(TUNE), "activation-sass", "--widths", "256", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {k.removeprefix("K=256 "): v["instructions"] for k, v in json.loads(out.read_text())["results"].items()}
    assert set(rows) == {"no RAC", "RAC over the row", "RAC in groups of 64", "RAC in groups of 64, folded"}
    assert rows["no RAC"] < rows["RAC in groups of 64"] < rows["RAC over the row"]
    assert rows["RAC in groups of 64, folded"] <= rows["RAC in groups of 64"]


def test_stable_fp4_seeds_smoke_writes_the_tables_to_paste(tmp_path, corpus_env, capsys):
    """benchmarks/stable_fp4_seeds.py --smoke: the GPU comparison's code path on the tiny model
    (two recipes, one seed, in this process), its per-layer diagnostics and its summary."""
    module = script_module(ROOT / "benchmarks" / "stable_fp4_seeds.py")
    assert module.main(["--out", str(tmp_path), "--smoke", "--recipes", "bf16,stable-fp4-dy8",
                        "--seeds", "0"]) == 0
    text = (tmp_path / "summary.md").read_text()
    assert text in capsys.readouterr().out                  # printed, ready to paste
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["comparison"]["step"] == 2
    ops = results["diagnostics"]["operands"]["stable-fp4-dy8"]
    assert 0 < ops["dw_cos"] <= 1 and 0 < ops["flush_dy"] < 1 and ops["clip_x"] == 0
    assert "| stable-fp4-dy8 | " in text and "dW cosine per layer kind" in text
    assert not list(tmp_path.glob("*/checkpoints"))          # deleted after the runs
    assert module.main(["--out", str(tmp_path), "--smoke", "--seeds", "0",
                        "--diag-seed", "1"]) == 2


def test_qat_experiment_refuses_a_bad_setting_before_creating_anything(tmp_path, monkeypatch, capsys):
    out = tmp_path / "never"
    script = ROOT / "benchmarks" / "qat_experiment.py"
    r = subprocess.run([sys.executable, str(script), "--out", str(out), "--settings",
                        "bf16/ste/0,int2:g64/ste/0/fast"], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "unknown option 'fast'" in r.stderr and not out.exists()
    qat_experiment = script_module(script)   # the rest in-process
    for bad, says in (("int2:g64/ste/x", "WEIGHTS/ESTIMATOR/SEED"), ("int2:g64/ste/0/lrx", "no learning rate")):
        monkeypatch.setattr(sys, "argv", [str(script), "--out", str(out), "--settings", f"bf16/ste/0,{bad}"])
        with pytest.raises(SystemExit) as exit_:
            qat_experiment.main()
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
    (tmp_path / "unfinished").mkdir()   # --base: a run folder with no final.json
    monkeypatch.setattr(sys, "argv", [str(script), "--out", str(out), "--base", str(tmp_path / "unfinished")])
    with pytest.raises(SystemExit) as exit_:
        qat_experiment.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "not a finished" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_qat_experiment_summary_compares_with_the_best_ste_arm_at_common_steps(tmp_path, monkeypatch):
    # synthetic run folders: the gaps to each seed's control at every shared evaluation, the
    # ratio to STE at --qat-lr and to the best STE arm (any LR), flips at a common step, and a
    # run that never trained listed as failed
    qe = script_module(ROOT / "benchmarks" / "qat_experiment.py")
    specs = ["bf16/ste/0", "int2:g64/ste/0", "int2:g64/ste/0/lr2e-4", "int2:g64/jacquant/0",
             "int2:g64/ste/0/lr3e-4", "bf16/ste/0/sgd/lr0.3", "int2:g64/ste/0/sgd/lr0.3",
             "int2:g64/jacquant/0/group/grad/sgd/lr0.3"]
    settings = [qe.parse_setting(text) for text in specs]
    assert [s[4] for s in settings] == ["adamw"] * 5 + ["sgd"] * 3
    losses = {"bf16-ste-s0": (3.0, 2.0, 1.9, 1.8), "int2g64-ste-s0": (3.0, 2.5, 2.3, 2.2),
              "int2g64-ste-lr2e-4-s0": (3.0, 2.4, 2.2, 2.05), "int2g64-jacquant-s0": (3.0, 2.3, 2.25, 2.15),
              "bf16-ste-sgd-lr0.3-s0": (3.0, 2.3, 2.1, 2.0),
              "int2g64-ste-sgd-lr0.3-s0": (3.0, 2.8, 2.6, 2.5),
              "int2g64-jacquant-group-grad-sgd-lr0.3-s0": (3.0, 2.6, 2.4, 2.3)}
    steps = (0, 10, 20, 30)
    for name, curve in losses.items():
        run = tmp_path / f"{name}-x"
        run.mkdir()
        last = 30 if name != "int2g64-jacquant-s0" else 20   # stopped earlier: compared at 20
        records = [{"event": "eval", "step": st, "val_loss": v} for st, v in zip(steps, curve) if st <= last]
        if name != "bf16-ste-s0":
            records += [{"event": "qat", "step": st, "qat/code_flips": 0.01 * st / 10}
                        for st in range(10, last + 1, 10)]
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    summary, table = qe.summarize(settings, tmp_path, {"bf16": 1.5}, 1e-4)
    assert summary["compared_at_step"] == 20 and list(summary["failed"]) == ["int2g64-ste-lr3e-4-s0"]
    gaps = summary["gaps_by_step"]
    assert gaps["int2g64-ste-s0"] == pytest.approx({10: 0.5, 20: 0.4})
    assert gaps["int2g64-jacquant-s0"] == pytest.approx({10: 0.3, 20: 0.35})
    ratios = {r["run"]: r for r in summary["gap_ratios"]}
    jq = ratios["int2g64-jacquant-s0"]
    assert jq["ste"] == "int2g64-ste-s0" and jq["gap_ratio"] == pytest.approx(0.35 / 0.4)
    assert jq["best_ste"] == "int2g64-ste-lr2e-4-s0" and jq["ratio_best"] == pytest.approx(0.35 / 0.3)
    # an SGD arm against STE under SGD at its own LR, never against AdamW's STE, each gap to the
    # bf16 control under SGD at that LR
    sgd = ratios["int2g64-jacquant-group-grad-sgd-lr0.3-s0"]
    assert sgd["ste"] == sgd["best_ste"] == "int2g64-ste-sgd-lr0.3-s0"
    assert sgd["gap_ratio"] == pytest.approx((2.4 - 2.1) / (2.6 - 2.1))
    assert gaps["int2g64-ste-sgd-lr0.3-s0"] == pytest.approx({10: 0.5, 20: 0.5})
    assert "int2g64-ste-sgd-lr0.3-s0" not in ratios
    assert summary["code_flips_at"]["step"] == 20
    assert summary["code_flips_at"]["flips"]["int2g64-ste-s0"] == pytest.approx(0.03)
    rows = {r["setting"]: r for r in summary["rows"]}
    assert rows["int2g64-ste-s0"]["evals"][-1] == [30, 2.2] and rows["int2g64-ste-s0"]["step"] == 20
    assert "| int2g64-jacquant-s0 | +0.3500 | +0.3000 | +0.3500 |" in table
    # the figure, and --plot redrawing it from a results file (the summary under "results")
    qe.plot(summary["rows"], {"bf16": 1.5, "gptq int2:g64": 3.0}, tmp_path / "figure.png")
    saved = tmp_path / "qat.json"
    saved.write_text(json.dumps({"meta": {}, "results": {"rows": summary["rows"], "baselines": {"bf16": 1.5}}}))
    monkeypatch.setattr(sys, "argv", ["qat_experiment.py", "--plot", str(saved), str(tmp_path / "again.png")])
    qe.main()
    assert (tmp_path / "figure.png").stat().st_size > 10_000 and (tmp_path / "again.png").stat().st_size > 10_000
    for bad in (tmp_path / "missing.json", tmp_path / "figure.png"):   # no file; not JSON
        monkeypatch.setattr(sys, "argv", ["qat_experiment.py", "--plot", str(bad), str(tmp_path / "x.png")])
        with pytest.raises(SystemExit) as exit_:
            qe.main()
        assert exit_.value.code == 2 and not (tmp_path / "x.png").exists()


def test_multi_gpu_scaling_smoke(tmp_path):
    """benchmarks/multi_gpu.py --smoke: one process, then two under torchrun (gloo), and the
    scaling table from their rows."""
    multi_gpu = script_module(ROOT / "benchmarks" / "multi_gpu.py")
    assert multi_gpu.main(["--out", str(tmp_path), "--smoke", "--modes", "ddp"]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["meta"]["machine"].endswith("2 processes (gloo)")
    rows = {(r["recipe"], r["processes"]): r for r in report["results"]}
    assert set(rows) == {("bf16", 1), ("stable-fp4", 1), ("bf16", 2), ("stable-fp4", 2)}
    for recipe in ("bf16", "stable-fp4"):
        one, two = rows[recipe, 1], rows[recipe, 2]
        assert two["parallel"] == "ddp" and one["scaling"] == 1.0
        assert two["scaling"] == pytest.approx(two["tokens_per_s"] / one["tokens_per_s"])
        # the two-process run trains twice the rows a step: 2 processes x 2 rows x 32 tokens
        assert two["tokens_per_s"] == pytest.approx(4 * 32 / (two["step_ms"] / 1e3))
    assert "| stable-fp4 | 2 | ddp |" in (tmp_path / "summary.md").read_text()
    assert multi_gpu.main(["--out", str(tmp_path), "--smoke", "--modes", "tp"]) == 2


def test_rl_step_smoke_times_every_mode_against_bf16(tmp_path, monkeypatch):
    # benchmarks/rl_step.py on a tiny Hugging Face folder on the CPU: a `lowbit rl` process per
    # mode, each mode's median step times, the table against bf16's; the commit a results file
    # names is LOWBIT_COMMIT's where it is set (code run without its git history)
    pytest.importorskip("tokenizers")
    monkeypatch.setenv("LOWBIT_COMMIT", "0123abc")
    rl_step = script_module(ROOT / "benchmarks" / "rl_step.py")
    assert rl_step.main(["--smoke", "--out", str(tmp_path), "--modes", "bf16,quads", "--rounds", "2"]) == 0
    result = json.loads((tmp_path / "rl-step.json").read_text())
    assert set(result["meta"]) >= {"date", "commit", "machine", "command"}
    assert result["meta"]["commit"] == "0123abc"
    # the machine in words ("2-core CPU", "one H100"), never "unknown"
    assert result["meta"]["machine"] == run_meta("cuda" if torch.cuda.is_available() else "cpu")["machine"]
    assert result["meta"]["command"].startswith("python benchmarks/rl_step.py --smoke")
    rows = result["results"]["rows"]
    assert [(r["mode"], r["round"]) for r in rows] == [("bf16", 0), ("quads", 0), ("bf16", 1), ("quads", 1)]
    assert all(r["steps_timed"] == 1 for r in rows)
    for r in rows:
        assert r["step_s"] == pytest.approx(sum(r[k] for k in rl_step.TIMES))
        assert all(len(r["per_step"][k]) == 1 and r["per_step"][k][0] == r[k] for k in rl_step.TIMES)
    # --rounds 2: the modes in turns, each round's ratio against that round's bf16
    bf16, quads = result["results"]["summary"]
    assert bf16["vs_bf16"] == [1.0, 1.0] and quads["rounds"] == 2
    assert quads["vs_bf16"] == pytest.approx([rows[1]["step_s"] / rows[0]["step_s"],
                                              rows[3]["step_s"] / rows[2]["step_s"]])
    assert quads["step_s"] == pytest.approx((rows[1]["step_s"] + rows[3]["step_s"]) / 2)
    assert (tmp_path / "runs" / "quads-round1" / "metrics.jsonl").is_file()
    # each run's checkpoint removed once read (gigabytes each at a real shape)
    assert not any((tmp_path / "runs").glob("*/checkpoints"))
    assert "| quads |" in (tmp_path / "rl-step.md").read_text()
    with pytest.raises(SystemExit):
        rl_step.main(["--smoke", "--out", str(tmp_path), "--rounds", "0"])


def test_rl_raw_refuses_bad_folders_in_one_line_and_writes_nothing(tmp_path, capsys):
    rl_raw = script_module(ROOT / "benchmarks" / "rl_raw.py")
    meta = ["--date", "2026-12-06", "--commit", "abc1234", "--machine", "2-core CPU", "--command", "x"]
    broken = tmp_path / "cmp" / "rl-a"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{not json")
    (broken / "metrics.jsonl").write_text("")
    out = tmp_path / "raw.json"
    for args, message in (([str(out), f"a={tmp_path / 'cmp'}"], "is not JSON"),
                          ([str(out), f"a={tmp_path / 'none'}"], "is not LABEL=DIR"),
                          ([str(out), str(tmp_path)], "is not LABEL=DIR"),
                          ([str(out), f"a={tmp_path}"], "holds no rl-* run folders"),
                          ([str(tmp_path / "no" / "raw.json"), f"a={tmp_path / 'cmp'}"], "does not exist")):
        with pytest.raises(SystemExit) as exit_info:
            rl_raw.main([*args, *meta])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and "Traceback" not in err, args
        assert not out.exists()


def test_qat_experiment_runs_at_most_max_procs_at_once(tmp_path):
    # --smoke on the CPU, two settings one at a time: the second run starts (its folder's
    # config) after the first has ended (its final.json), and both finish
    out = tmp_path / "qe"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "qat_experiment.py"), "--out", str(out),
                        "--smoke", "--skip-overhead", "--settings", "bf16/ste/0,int2:g64/ste/0", "--max-procs", "1",
                        "--qat-steps", "2"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (first,) = [p for p in (out / "qat").glob("bf16-ste-s0-*") if not p.name.endswith("summary")]
    (second,) = [p for p in (out / "qat").glob("int2g64-ste-s0-*") if not p.name.endswith("summary")]
    assert (first / "final.json").stat().st_mtime <= (second / "config.json").stat().st_mtime
    assert json.loads((out / "summary.json").read_text())["meta"]["failed"] == {}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "qat_experiment.py"), "--out", str(tmp_path / "x"),
                        "--max-procs", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and "--max-procs must be a positive integer" in r.stderr
