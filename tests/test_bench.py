"""`lowbit bench train` runs and reports ratios to its baseline (speed goals live in benchmarks,
not in unit tests: this checks the table, not the numbers)."""

import json
import os
import threading

import pytest
import torch

from lowbit.bench import bench_train, format_rows
from lowbit.cli import main

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_bench_train_rows_and_table():
    rows = bench_train("tiny", ["bf16", "stable-fp4"], seq_len=32, batch_size=2, steps=2, warmup=1,
                       progress=lambda message: None)
    assert [r["recipe"] for r in rows] == ["bf16", "stable-fp4"]
    assert rows[0]["time_vs_base"] == 1.0 and rows[1]["step_ms"] > 0
    # the optimizer the step ran (lowbit.train.build.build_optimizer's: torch's AdamW on the CPU)
    assert {r["optimizer"] for r in rows} == {"torch.optim.adamw.AdamW"}
    table = format_rows(rows)
    assert "time vs bf16" in table and "stable-fp4" in table


def test_bench_train_compiles_the_whole_model_or_each_layer(capsys):
    # --compile (the whole model, lowbit train's) and --compile layers (each decoder layer,
    # lowbit rl's): the same losses as eager on the same batches
    rows = {}
    for compile in (None, "model", "layers"):
        [row] = bench_train("tiny", ["bf16"], seq_len=16, batch_size=2, steps=1, warmup=1,
                            compile=compile, progress=lambda message: None)
        assert row["compile"] == compile
        rows[compile] = row
    for compile in ("model", "layers"):
        assert rows[compile]["loss"] == pytest.approx(rows[None]["loss"], rel=1e-5)
    with pytest.raises(ValueError, match="--compile must be model or layers"):
        bench_train("tiny", ["bf16"], compile="blocks")
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "train", "--compile", "blocks"])
    assert exit_.value.code == 2 and "invalid choice: 'blocks'" in capsys.readouterr().err


def test_bench_train_interleave_times_blocks_in_turns():
    order = []
    rows = bench_train("tiny", ["bf16", "qat/int2:g32/jacquant/k2/elem/upd", "qat/int2:g32/ste/kd"],
                       seq_len=16, batch_size=1, steps=1, warmup=1, interleave=3, progress=order.append)
    for r in rows:   # one untimed step, then three timed blocks of one step each
        assert len(r["block_ms"]) == 3 and r["steps_run"] == 4
        assert r["step_ms"] == pytest.approx(sorted(r["block_ms"])[1])   # the median of the three
        assert r["peak_mem_gib"] is None   # the models shared the device
    assert [m.split(":")[0] for m in order] == ["bf16", "qat/int2", "qat/int2"]
    assert rows[2]["recipe"].endswith("/kd")   # distilled: a teacher's forward in every step


def test_bench_cli_json_and_errors(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["bench", "train", "--recipes", "bf16,mxfp4", "--seq-len", "32", "--batch-size", "2",
                 "--steps", "1", "--warmup", "0", "--json", str(out)]) == 0
    assert [r["recipe"] for r in json.loads(out.read_text())] == ["bf16", "mxfp4"]
    capsys.readouterr()
    assert main(["bench", "train", "--recipes", "fp2"]) == 2
    assert "unknown recipe 'fp2'" in capsys.readouterr().err
    assert main(["bench", "train", "--cuda-graph", "--device", "cpu"]) == 2
    assert "--cuda-graph captures the step on a CUDA GPU" in capsys.readouterr().err
    assert main(["bench", "train", "--device", "gpu0"]) == 2
    assert "device must be auto, cpu, cuda or cuda:N (got 'gpu0')" in capsys.readouterr().err
    assert main(["bench", "train", "--interleave", "0"]) == 2
    assert "--interleave must be >= 1 (got 0)" in capsys.readouterr().err
    assert main(["bench", "train", "--trace", str(tmp_path / "traces")]) == 2
    assert "--trace writes the profiled step: add --profile" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("kept")
    assert main(["bench", "train", "--profile", "--trace", str(tmp_path / "a-file")]) == 2
    assert "is a file; give a folder for the traces" in capsys.readouterr().err
    assert (tmp_path / "a-file").read_text() == "kept"


def test_bench_train_counts_the_steps_it_redoes(monkeypatch):
    """bench train times lowbit.train's own step, redos of inexact FP8 folds included, and
    counts them: none on the CPU (its folds are exact), and the step whose deferred fold check
    is forced to count an inexact value (the third of warm-up + timed steps here) is named."""
    import contextlib

    import lowbit.train.step as step_module
    from lowbit.dispatch.fold_check import deferred_fold_check

    rows = bench_train("tiny", ["bf16", "stable-fp4-fp8"], seq_len=32, batch_size=2, steps=2,
                       warmup=1, progress=lambda message: None)
    assert [(r["fold_redo_steps"], r["steps_run"]) for r in rows] == [(0, 3), (0, 3)]  # CPU: exact
    assert rows[1]["fold_redo_at"] == []
    checks = []

    @contextlib.contextmanager
    def flagging(device):
        with deferred_fold_check(device) as check:
            checks.append(check)
            if len(checks) == 2:
                check.counter += 1
            yield check

    monkeypatch.setattr(step_module, "deferred_fold_check", flagging)
    rows = bench_train("tiny", ["stable-fp4-fp8"], seq_len=32, batch_size=2, steps=2, warmup=1,
                       progress=lambda message: None)
    assert len(checks) == 3 and rows[0]["fold_redo_steps"] == 1 and rows[0]["fold_redo_at"] == [2]
    assert ("stable-fp4-fp8: 1 of 3 steps (number 2, warm-up included) had inexact one-chunk FP8 "
            "folds") in format_rows(rows)


def test_bench_kernels_runs_under_the_interpreter(tmp_path, capsys, monkeypatch):
    """`lowbit bench kernels --check` end to end on the CPU (conftest sets TRITON_INTERPRET=1
    there): every check passes bit for bit against the reference, every timed kernel runs, the
    tables and JSON come out; the timings mean nothing here."""
    import pytest
    import torch

    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("on a GPU this would time the real shapes; the CPU path is what this checks")
    from lowbit.bench.kernels import check_specs, timed_kernels

    out = tmp_path / "kernels.json"
    monkeypatch.delenv("LOWBIT_MACHINE", raising=False)   # the machine's own words, not a label
    assert main(["bench", "kernels", "--check", "--shapes", "32x64", "--no-torchao", "--json",
                 str(out)]) == 0
    text = capsys.readouterr().out
    assert "timings mean nothing" in text and "fq+t mxfp4 rceil 32x32 rne" in text
    report = json.loads(out.read_text())
    # what docs/results needs of a results file (tests/test_results.py), written by the command
    meta = report["meta"]
    assert {"date", "commit", "machine", "command"} <= meta.keys()
    assert meta["machine"] == f"{os.cpu_count()}-core CPU" and meta["commit"]
    import datetime   # the date as a results file carries it; the moment beside it
    assert datetime.date.fromisoformat(meta["date"]).isoformat() == meta["date"]
    assert meta["time"].startswith(meta["date"] + "T")
    rows = report["timings"]
    assert [r["kernel"] for r in rows] == [label for label, _, _ in timed_kernels()]
    assert not [r for r in rows if "error" in r]
    checks = report["checks"]
    assert [r for r in checks if not r["passed"]] == []
    # per spec: 3 dtypes, 2 adversarial, 3-D, non-contiguous, stochastic, and 1-D or 2 transposed
    specs = check_specs("cpu")
    assert len(checks) == sum(10 if s.is_2d else 9 for s in specs) + 1 + 1 + 4
    assert f"checks: {len(checks)} passed, 0 failed" in text
    assert report["meta"]["device"] == "cpu" and report["meta"]["torch"] == torch.__version__
    assert main(["bench", "kernels", "--shapes", "32by64"]) == 2
    assert "bad shape '32by64'" in capsys.readouterr().err


def test_bench_kernels_check_finds_a_wrong_bit(monkeypatch, tmp_path, capsys):
    """--check reports a kernel whose fake quantization differs from the reference in one
    value (the sign of -0.0 here), names the checks that saw it, and exits 1."""
    import pytest

    pytest.importorskip("triton")
    import lowbit.bench.kernels as bench_kernels
    import lowbit.kernels as kernels

    real = kernels.fake_quantize_triton

    def off_by_a_sign(x, spec, *args, **kwargs):
        out = real(x, spec, *args, **kwargs)
        out.view(-1)[0] = -out.view(-1)[0]          # 0.0 becomes -0.0: other bits too
        return out

    monkeypatch.setattr(kernels, "fake_quantize_triton", off_by_a_sign)
    monkeypatch.setattr(bench_kernels, "check_specs", lambda device: [
        bench_kernels.kernel_spec("mxfp4", "floor", (1, 32))])
    monkeypatch.setitem(bench_kernels.CHECK_SIZES["cpu"], "hadamard", [])
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "kernels", "--check", "--shapes", "32x64", "--no-torchao", "--json",
              str(tmp_path / "k.json")])
    assert exit_.value.code == 1
    failed = [r["check"] for r in json.loads((tmp_path / "k.json").read_text())["checks"]
              if not r["passed"]]
    assert "q mxfp4 floor 1x32 rne random bf16" in failed and len(failed) >= 8
    assert "FAIL q mxfp4 floor 1x32 rne random bf16" in capsys.readouterr().out


def test_moved_bytes_counts_reads_and_writes():
    from lowbit.bench.kernels import kernel_spec, moved_bytes

    stable = kernel_spec("mxfp4", "rceil", (32, 32))
    nvfp4 = kernel_spec("nvfp4", None, (1, 16), True)
    # 64x64 bf16: 8192 bytes read; MXFP4 codes 2048 bytes + 2x2 tile scales
    assert moved_bytes(stable, "q", (64, 64)) == 8192 + 2048 + 4
    assert moved_bytes(stable, "q+t", (64, 64)) == 8192 + 2 * (2048 + 4)
    assert moved_bytes(stable, "fq", (64, 64)) == 2 * 8192
    assert moved_bytes(stable, "fq+t", (64, 64)) == 3 * 8192
    # NVFP4 1x16: one E4M3 scale per 16 values, plus the 4-byte tensor scale; 40 cols pad to 48
    assert moved_bytes(nvfp4, "q", (2, 40)) == 2 * 40 * 2 + 2 * 48 // 2 + 2 * 3 + 4


def test_bench_train_on_a_corpus_takes_a_new_text_batch_each_step(corpus_env, monkeypatch):
    """--corpus: step i trains on the corpus's batch i (byte tokens, a 256-token model), the
    same batches for every recipe; the table says what it trained on."""
    import lowbit.train.build as build_module
    from lowbit.train import TrainingData

    seen = []
    build = build_module.build_data

    def recording(config) -> TrainingData:
        data = build(config)
        batch = data.train_batch

        def train_batch(step):
            seen.append(step)
            return batch(step)
        data.train_batch = train_batch
        return data

    monkeypatch.setattr(build_module, "build_data", recording)
    rows = bench_train("tiny", ["bf16", "mxfp4"], seq_len=32, batch_size=2, steps=2, warmup=1,
                       corpus="tinyshakespeare", progress=lambda message: None)
    from lowbit.models import ModelConfig, build_model

    assert seen == [0, 1, 2] * 2                      # warm-up then timed steps, per recipe
    byte_model = build_model(ModelConfig.preset("tiny", vocab_size=256, max_seq_len=32))
    assert rows[0]["params"] == sum(p.numel() for p in byte_model.parameters())
    assert rows[0]["corpus"] == "tinyshakespeare"
    assert "tinyshakespeare bytes" in format_rows(rows)


def test_idle_gaps_merges_overlaps_and_sums_idle_time_by_neighbours():
    from lowbit.bench.timing import idle_gaps

    # two streams overlap on [10, 40); idle [40, 100) after "b", [110, 115) and [120, 122)
    spans = [(0.0, 30.0, "a"), (10.0, 40.0, "b"), (100.0, 110.0, "c"), (115.0, 120.0, "b"),
             (20.0, 25.0, "inside"), (122.0, 130.0, "c")]
    got = idle_gaps(spans, top=1)
    assert got["timeline_ms"] == 0.13
    assert got["idle_ms"] == (60.0 + 5.0 + 2.0) / 1e3
    assert got["idle_gap_count"] == 3
    assert got["idle_histogram"]["< 5 us"] == {"gaps": 1, "ms": 0.002}
    assert got["idle_histogram"]["5-20 us"] == {"gaps": 1, "ms": 0.005}
    assert got["idle_histogram"]["20-100 us"] == {"gaps": 1, "ms": 0.06}
    assert got["top_gaps_ms"] == {"b -> c": 0.062}     # both b -> c gaps, summed
    assert got["longest_gaps"] == [{"at_ms": 0.04, "ms": 0.06, "before": "b", "after": "c"}]
    assert [g["ms"] for g in idle_gaps(spans)["longest_gaps"]] == [0.06, 0.005, 0.002]
    assert idle_gaps([])["idle_ms"] == 0


def test_gpu_events_keep_kernels_named_with_a_lambda_and_leave_out_annotations():
    from types import SimpleNamespace

    from lowbit.bench.timing import gpu_events

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    event = lambda name, device, annotation=False: SimpleNamespace(name=name, device_type=device,
                                                                   is_user_annotation=annotation)
    kernel = event("void at::native::index_elementwise_kernel<128, 4, ...::{lambda(int)#1}>(long)", cuda)
    copy = event("Memcpy DtoD (Device -> Device)", cuda)
    events = [event("Optimizer.step#AdamW.step", cpu, True), kernel, copy,
              event("Optimizer.step#AdamW.step", cuda),          # the GPU's copy, not flagged
              event("ProfilerStep#3", cuda, True), event("aten::index_copy_", cpu)]
    assert gpu_events(SimpleNamespace(events=lambda: events)) == [kernel, copy]


@pytest.mark.gpu
def test_profile_step_counts_every_kernel_the_trace_holds(tmp_path):
    """The profile's kernel time is the trace's: PyTorch's lambda-named kernels (masked_fill,
    index_copy, copies) included, the optimizer step's annotation left out."""
    import gzip

    from lowbit.bench.timing import profile_step

    dev = torch.device("cuda")
    model = torch.nn.Linear(256, 256, device=dev)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(512, 256, device=dev)

    def step():
        y = model(x).masked_fill(x > 2, 0.0).index_copy(0, torch.arange(8, device=dev), x[:8])
        y.float().square().mean().backward()
        optimizer.step()

    step()
    trace = tmp_path / "step.json.gz"
    got = profile_step(step, dev, trace=str(trace))
    events = json.load(gzip.open(trace))["traceEvents"]
    device_ms = sum(e["dur"] for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")) / 1e3
    names = {e["name"] for e in events if e.get("cat") == "kernel"}
    assert any("#" in name for name in names)          # the case the profile used to drop
    assert got["kernel_ms"] == pytest.approx(device_ms, rel=1e-3)


# ---- lowbit bench fp8 ----------------------------------------------------------------------------

def test_bench_fp8_smoke_checks_and_errors_against_fp64(tmp_path, capsys):
    """`lowbit bench fp8 --smoke`: every section runs on the CPU in Triton's interpreter; the
    fold checks pass bit for bit; the FP8 GEMM (through torch._scaled_mm and its emulation)
    is within float32 accumulation of an fp64 GEMM of the same FP4 operands, and its bf16
    output within bf16's own rounding of it; every timed call ran."""
    import pytest

    pytest.importorskip("triton")
    from lowbit.bench.fp8 import FOLD_COLUMNS, SECTIONS

    import os
    import subprocess
    import sys

    out = tmp_path / "fp8.json"
    # in a process of its own, with the interpreter and no GPU: the CPU smoke run, also on a
    # machine with a GPU (whose FP8 GEMMs accumulate differently: `lowbit bench fp8` proper)
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "lowbit.cli", "bench", "fp8", "--smoke",
                           "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report) == {"meta", *SECTIONS}
    checks = report["checks"]
    assert len(checks) == 14 and all(r["passed"] for r in checks)
    assert sum("one-chunk" in r["check"] or "quantize_fold" in r["check"] for r in checks) == 8
    errors = report["errors"]
    assert len(errors) == 12 and {r["gemm"] for r in errors} == {"fprop", "dgrad", "wgrad"}
    assert any(r["pieces"] > 1 for r in errors)          # K-chunked GEMMs are measured too
    for r in errors:
        for key in ("fp8_acc_f32", "fp8_fast_f32", "emulated_f32"):
            assert r[key]["rel_fro"] < 1e-6, (r["spec"], r["scales"], r["gemm"], key)
        for key in ("fp8_acc_bf16", "fp8_fast_bf16"):
            assert r[key]["rel_fro"] <= 1.01 * r["ref_in_bf16"]["rel_fro"] + 1e-12
    for section in ("gemm", "fold"):
        assert not [k for r in report[section] for k in r if k.endswith("_error")]
    assert all(f"{c}_ms" in report["fold"][0] for c in FOLD_COLUMNS)
    assert "checks: 14 passed, 0 failed" in done.stdout
    # an MoE layer's six expert GEMMs, grouped, each equal to its experts' products
    grouped = report["grouped"]
    assert [r["shape"].split(": ")[1] for r in grouped] == [
        "gate_up fprop", "gate_up dgrad", "gate_up wgrad", "down fprop", "down dgrad", "down wgrad"]
    for r in grouped:
        assert r["bf16_grouped_rel_err"] < 1e-2 and r["bf16_grouped_ms"] > 0 and r["bf16_mm_ms"] > 0
        assert r["fp8"] == "no FP8 grouped GEMM on this device"


def test_bench_fp8_grouped_check_finds_a_wrong_layout():
    """The grouped section's check fails a GEMM that multiplies the wrong expert's weight."""
    from lowbit.bench.fp8_grouped import grouped_error

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(24, 16, generator=g), torch.randn(3, 8, 16, generator=g)
    ends = torch.tensor([8, 16, 24], dtype=torch.int32)
    right = torch._grouped_mm(a.bfloat16(), b.bfloat16().transpose(-2, -1), offs=ends)
    wrong = torch._grouped_mm(a.bfloat16(), b.flip(0).bfloat16().transpose(-2, -1), offs=ends)
    assert grouped_error(right, a, b, ends, "rows") < 1e-2 < grouped_error(wrong, a, b, ends, "rows")
    at, bt = torch.randn(8, 24, generator=g), torch.randn(16, 24, generator=g)
    right = torch._grouped_mm(at.bfloat16(), bt.bfloat16().t(), offs=ends)
    assert right.shape == (3, 8, 16)
    assert grouped_error(right, at, bt, ends, "k") < 1e-2 < grouped_error(right.flip(0), at, bt, ends, "k")


def test_bench_fp8_fold_checks_find_a_wrong_fold(monkeypatch):
    """The fold checks fail where the fused fold's bytes differ from the reference fold's."""
    import pytest

    pytest.importorskip("triton")
    import lowbit.kernels.fp8_fold as fp8_fold
    from lowbit.bench.fp8 import fold_checks

    real = fp8_fold.quantize_fold_mxfp4

    def wrong(x, spec, *args, **kwargs):
        folded = real(x, spec, *args, **kwargs)
        folded.fp8.view(torch.uint8)[0, 0] ^= 1
        return folded

    monkeypatch.setattr(fp8_fold, "quantize_fold_mxfp4", wrong)
    rows = fold_checks("cpu", progress=lambda message: None)
    failed = [r["check"] for r in rows if not r["passed"]]
    assert failed and all(label.startswith("quantize_fold_mxfp4") for label in failed)
    assert len(failed) == sum(label.startswith("quantize_fold_mxfp4") for label in
                              (r["check"] for r in rows))


def test_bench_fp8_refuses_in_one_line(capsys):
    import torch

    assert main(["bench", "fp8", "--sections", "checks,speed"]) == 2
    assert "--sections takes checks, errors, gemm, fold, passes, grouped; got 'checks,speed'" in (
        capsys.readouterr().err)
    if torch.cuda.is_available():
        return
    assert main(["bench", "fp8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "measures on a CUDA GPU and this machine has none" in err


# ---- lowbit bench folds --------------------------------------------------------------------------

def _spread_tokens(rows, cols, seed):
    """(rows, cols) gaussians, tokens 0-31 times 2^-20 and 32-63 times 2^20: along tokens (a
    row of the transpose) 40 binades, past one FP8 fold window; along features, one tile scale."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.tensor([-20.0, 20.0])).repeat_interleave(32)[:rows, None]
    return torch.randn(rows, cols, generator=g) * scale


def _values_outside_window(t: torch.Tensor, spec) -> int:
    """What the one-K-chunk fold of t^T must count: the nonzero values that one factor per row
    leaves below the window, by the reference fold's rules (lowbit.formats.fold)."""
    from lowbit.formats import quantize_with_spec
    from lowbit.formats.fold import SHIFT_MIN, BlockExponents

    blocks = BlockExponents(quantize_with_spec(t, spec), transpose=True)
    f = blocks.factor_exponents([0, blocks.n_blocks])
    over = blocks.live & (blocks.exps - f < SHIFT_MIN)
    return int((((blocks.codes & 0x7) != 0).sum(dim=-1) * over).sum())


@pytest.mark.parametrize("compiled", [False, True])
def test_fold_observer_credits_the_backward_to_its_own_layer(monkeypatch, compiled,
                                                             compiled_quant_linear):
    """Two FP8 layers, "a" then "b" (b's forward runs last, its backward first); a's dY spans
    40 binades along tokens, so the one-chunk fold of dY^T (wgrad) rounds values. The fold
    observer is told exactly that count for (a, dY), the reference fold's count, and nothing
    for any other layer or operand -- not for b, the last forward -- eagerly and under
    torch.compile, with the backward on another thread as autograd runs CUDA's; the counts add
    up to the deferred fold check's. (The fold kernels run on the CPU under the interpreter.)"""
    pytest.importorskip("triton")
    from dataclasses import replace

    from lowbit.bench.folds import FoldCounts
    from lowbit.dispatch.fold_check import deferred_fold_check, observe_folds
    from kernel_paths import kernels_on_cpu
    from lowbit.formats.spec import Rounding
    from lowbit.ops import quant_linear
    from lowbit.recipes import get_recipe

    kernels_on_cpu(monkeypatch)
    lin = get_recipe("stable-fp4-fp8").linear
    dy_spec = replace(lin.dgrad_dy, rounding=Rounding.RNE)   # the reference's bits: countable
    lin = replace(lin, dgrad_dy=dy_spec, wgrad_dy=dy_spec)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 96, generator=g)
    w_a, w_b = torch.randn(40, 96, generator=g), torch.randn(40, 96, generator=g)
    dy_a, dy_b = _spread_tokens(64, 40, 1), torch.randn(64, 40, generator=g)
    expected = _values_outside_window(dy_a, dy_spec)
    # on a GPU the kernels run there; on the CPU under the interpreter
    x, w_a, w_b, dy_a, dy_b = (t.to(DEVICE) for t in (x, w_a, w_b, dy_a, dy_b))
    linear = compiled_quant_linear if compiled else quant_linear
    counts = FoldCounts()
    a, b = w_a.clone().requires_grad_(), w_b.clone().requires_grad_()
    with deferred_fold_check(x.device) as check, observe_folds(counts):
        y_a = linear(x, a, None, lin, "a")
        y_b = linear(x, b, None, lin, "b")
        worker = threading.Thread(target=torch.autograd.backward, args=([y_a, y_b], [dy_a, dy_b]))
        worker.start()
        worker.join()
    seen = counts.read()
    assert expected > 0
    assert seen == {(layer, operand): expected if (layer, operand) == ("a", "dY") else 0
                    for layer in "ab" for operand in ("X", "W", "dY")}
    assert check.inexact_values() == expected
    assert a.grad is not None and b.grad is not None


def test_bench_folds_counts_per_layer_and_operand(tmp_path, corpus_env, capsys):
    """`lowbit bench folds` on the CPU: every FP8 layer of the tiny model, by module name, and
    operand is counted (zero: the CPU's reference folds are exact); the JSON has the steps."""
    out = tmp_path / "folds.json"
    assert main(["bench", "folds", "--model", "tiny", "--seq-len", "32", "--batch-size", "2",
                 "--steps", "2", "--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    steps = report["steps"]
    assert [(s["step"], s["rounded"], s["redone"]) for s in steps] == [(1, 0, False), (2, 0, False)]
    fp8 = ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # q/k/v emulated
    assert list(steps[0]["by_operand"]) == [f"model.layers.{i}.{m} {o}" for i in range(3)
                                            for m in fp8 for o in ("X", "W", "dY")]
    assert set(steps[0]["by_operand"].values()) == {0}
    assert report["args"]["model"] == "tiny" and report["meta"]["device"] == "cpu"
    assert "0 values rounded over 2 steps in the folds of 12 FP8 layers" in capsys.readouterr().out


def test_bench_folds_credits_a_layers_wide_gradient_to_it(monkeypatch, corpus_env):
    """A one-block tiny model whose o_proj receives a dY spanning 40 binades along tokens (its
    output's gradient scaled by 2^-40 on the first sequence): the step's inexact values are all
    o_proj's dY, none the last forward's (down_proj), the step is redone, and the counts sum
    to the step's own. (The fold kernels run on the CPU under the interpreter.)"""
    pytest.importorskip("triton")
    import dataclasses

    import lowbit.train.build as build
    from lowbit.bench.folds import count_inexact_folds
    from lowbit.kernels import supports

    # the folds (codes=True) on the kernels; fake quantization stays on the reference
    monkeypatch.setattr("lowbit.dispatch._quantizers.use_kernels",
                        lambda x, spec, codes=True: codes and supports(spec, codes))
    build_model, apply_recipe = build.build_model, build.apply_recipe
    monkeypatch.setattr(build, "build_model", lambda config, vocab_size=None: build_model(
        dataclasses.replace(config, n_layers=1), vocab_size))
    scale = torch.tensor([2.0**-40, 1.0], device=DEVICE)[:, None, None]

    def scale_dy(module, inputs, y):
        y.register_hook(lambda grad: grad * scale.to(grad.dtype))

    def applying(net, recipe):
        report = apply_recipe(net, recipe)
        net.get_submodule("model.layers.0.self_attn.o_proj").register_forward_hook(scale_dy)
        return report

    monkeypatch.setattr(build, "apply_recipe", applying)
    [step] = count_inexact_folds("tiny", seq_len=32, batch_size=2, steps=1, device=DEVICE,
                                 progress=lambda message: None)
    wide = "model.layers.0.self_attn.o_proj dY"
    assert step["rounded"] > 0 and step["redone"]
    assert step["by_operand"][wide] == step["rounded"]
    assert {k for k, n in step["by_operand"].items() if n} == {wide}
    assert step["by_operand"]["model.layers.0.mlp.down_proj dY"] == 0


# ---- lowbit bench recipes ------------------------------------------------------------------------

@pytest.mark.slow
def test_bench_recipes_fits_steps_and_summarizes(tmp_path, corpus_env, capsys, monkeypatch):
    """Two recipes in parallel on the CPU: the probe fits --steps, both runs finish them, the
    table, summary, plots and archive come out."""
    import tarfile

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "runs"
    assert main(["bench", "recipes", "--name", "t", "--recipes", "bf16,stable-fp4", "--out",
                 str(out), "--fit-min", "0.15", "--probe-s", "15", "--probe-window-s", "4",
                 "--deadline-min", "3", "--", "--model", "tiny", "--seq-len", "32",
                 "--batch-size", "2", "--eval-every", "5", "--eval-batches", "1",
                 "--diag-every", "5", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "fitted --steps" in text
    steps = int(text.split("fitted --steps ")[1].split()[0])
    assert steps >= 5 and steps % 5 == 0
    summary = json.loads((out / "t" / "summary.json").read_text())
    assert [r["recipe"] for r in summary["rows"]] == ["bf16", "stable-fp4"]
    assert all(r["finished"] and r["steps_done"] == steps for r in summary["rows"])
    assert summary["step"] == steps and summary["rows"][0]["gap_pct"] == 0
    assert summary["rows"][1]["dw_cos"] is not None          # the quantized run's diagnostics
    for f in ("summary.md", "loss.png", "gradbias.png", "gap.png"):
        assert (out / "t" / f).stat().st_size > 0
    with tarfile.open(out / "t" / "runs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"t-bf16/metrics.jsonl", "t-stable-fp4/final.json", "t-bf16/train.log",
            "probe/t-stable-fp4-probe.metrics.jsonl"} <= names


def test_bench_recipes_refuses_before_starting_anything(tmp_path, capsys):
    out = tmp_path / "runs"
    base = ["bench", "recipes", "--name", "t", "--out", str(out)]
    assert main([*base, "--recipes", "bf16,fp3", "--", "--model", "tiny"]) == 2
    assert "unknown recipe(s) fp3; choose from" in capsys.readouterr().err
    assert main([*base, "--recipes", "bf16,mxfp4", "--", "--model", "tiny", "--stpes", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --stpes 3" in err
    assert main([*base, "--recipes", "bf16,mxfp4", "--", "--recipe", "nvfp4"]) == 2
    assert "sets --recipe, --run-name, --out-dir, --compare, --resume itself" in (
        capsys.readouterr().err)
    assert not out.exists()


def test_bench_rollout_times_every_mode_beside_generate(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    assert main(["bench", "rollout", "--modes", "bf16,nvfp4+rac0.25", "--batch-sizes", "1,2",
                 "--new-tokens", "3", "--prompt-len", "4", "--repeats", "1", "--device", "cpu",
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| lowbit engine | nvfp4+rac0.25 |" in table
    assert "| transformers generate | bf16, static cache |" in table
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {(r["impl"], r["mode"], r["batch"]) for r in rows} == {
        (impl, mode, b) for b in (1, 2) for impl, mode in
        [("lowbit engine", "bf16"), ("lowbit engine", "nvfp4+rac0.25"),
         ("transformers generate", "bf16, dynamic cache"),
         ("transformers generate", "bf16, static cache")]}
    for r in rows:   # the decode rate excludes prefill: whole call minus a one-token call
        assert r["generate_s"] > 0 and r["decode_steps_per_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 3 / r["generate_s"])
    # no bandwidth measured off CUDA, so no row has a limit; every engine row has its bytes
    assert report["bandwidth_bytes_per_s"] is None and report["meta"]["device"] == "cpu"
    assert not any("of_limit" in r for r in rows)
    assert all(r["bytes_per_step"] > 0 for r in rows if r["impl"] == "lowbit engine")
    assert set(report["weight_bytes"]) == set(report["gpu_weight_bytes"]) == {"bf16", "nvfp4+rac0.25"}
    assert "- batch 2: nvfp4+rac0.25 " in table and "x bf16" in table
    # the work of one decode step, counted per mode (on the CPU: aten operators)
    assert report["decode_step_ops_unit"] == "aten operators"
    assert set(report["decode_step_ops"]) == {"bf16", "nvfp4+rac0.25"}
    assert 0 < report["decode_step_ops"]["bf16"] < report["decode_step_ops"]["nvfp4+rac0.25"]


def test_bench_rollout_compile_adds_compiled_rows(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    assert main(["bench", "rollout", "--modes", "bf16", "--batch-sizes", "1", "--new-tokens", "2",
                 "--prompt-len", "2", "--repeats", "1", "--device", "cpu", "--no-generate",
                 "--compile", "--json", str(out)]) == 0
    assert "| lowbit engine | bf16 compiled |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["bf16", "bf16 compiled"]
    assert rows[1]["compiled"] == "default" and rows[1]["decode_kernels"] is False


def test_bench_rollout_profile_splits_each_decode_step_by_kernel_class(tmp_path, capsys):
    from lowbit.bench.timing import kernel_category

    assert [kernel_category(n) for n in ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "sm90_xmma_gemm_bf16",
                                         "fmha_cutlassF_bf16_aligned_64x64_rf_sm80",
                                         "triton_poi_fused_add_mul_0", "triton_tem_fused_mm_t_view_6",
                                         "aten::linear", "aten::rms_norm", "_linear_kernel",
                                         "_attention_kernel")] == [
        "gemm (bf16/fp32)", "gemm (bf16/fp32)", "attention", "other", "gemm (bf16/fp32)",
        "gemm (bf16/fp32)", "other", "gemm (bf16/fp32)", "attention"]
    out = tmp_path / "rollout.json"
    assert main(["bench", "rollout", "--modes", "bf16", "--batch-sizes", "2", "--new-tokens", "3",
                 "--prompt-len", "2", "--repeats", "1", "--no-generate", "--profile", "--device",
                 "cpu", "--json", str(out)]) == 0
    assert "| mode | batch | step us | busy us | busy |" in capsys.readouterr().out
    report = json.loads(out.read_text())
    prof = report["profiles"]["bf16"]["2"]
    # on the CPU the times are one profiled call each, minus another: their sign is noise on a
    # busy 2-core machine (CI saw -6.6 ms), so only the counts and the sums are checked here
    assert prof["step_us"] > 0
    # the classes round to 0.01 us
    assert sum(us for us, _ in prof["classes"].values()) == pytest.approx(prof["busy_us"], rel=1e-3, abs=0.1)
    assert prof["classes"]["gemm (bf16/fp32)"][1] == 2 * 4 + 1   # 2 layers x (qkv, o, gate_up, down) + head
    assert prof["kernels_per_step"] == pytest.approx(report["decode_step_ops"]["bf16"], abs=1)


ROLLOUT_MODELS = ["llama-tiny", "qwen3-tiny", "qwen3-moe-tiny"]


@pytest.mark.parametrize("model", ROLLOUT_MODELS)
def test_bench_rollout_runs_every_mode_of_every_model_kind(model, monkeypatch):
    import lowbit.bench.rollout as rollout
    from lowbit.bench.rollout import MODES, bench_rollout, format_rollout_rows

    # a bandwidth as CUDA would measure it: then every engine row has its fraction of the limit
    monkeypatch.setattr(rollout, "copy_bandwidth", lambda device: 1e9)
    result = bench_rollout(model, list(MODES), batch_sizes=(3,), prompt_len=3, new_tokens=2,
                           repeats=1, say=lambda line: None)
    rows = result["rows"]
    engine = [r for r in rows if r["impl"] == "lowbit engine"]
    assert [r["mode"] for r in engine] == list(MODES)
    assert {r["mode"] for r in rows if r["impl"] == "transformers generate"} == {
        "bf16, dynamic cache", "bf16, static cache"}
    for r in rows:
        if r["impl"] == "lowbit engine":
            assert r["of_limit"] == pytest.approx(r["decode_steps_per_s"] * r["bytes_per_step"] / 1e9)
        else:
            assert "of_limit" not in r and "bytes_per_step" not in r
    # each mode stores its own weights: bf16's fp32 values on the CPU, fp8 a byte, nvfp4 0.5625
    # (codes and block scales), each plus a float32 scale a row
    weights = result["weight_bytes"]
    assert weights["bf16"] > weights["fp8"] > weights["nvfp4-w4a16"] == weights["nvfp4"]
    assert 0.5625 / 4 < weights["nvfp4"] / weights["bf16"] < 0.65 / 4
    for mode in MODES:   # the linear weights, plus embeddings, head, norms (and routers)
        assert result["gpu_weight_bytes"][mode] > weights[mode] + result["head_bytes"]
    moe = model == "qwen3-moe-tiny"
    assert (result["params_active"] < result["params_total"]) == moe
    if moe:   # 3 tokens of 2 experts in 8: 8 (1 - (6/8)^3) expected, at least 2 routed
        assert engine[0]["expected_experts_per_layer"] == pytest.approx(8 * (1 - 0.75 ** 3))
        assert all(2 <= r["routed_experts_per_layer"] <= 6 for r in engine)
    else:     # weights + head + 3 rows of a cache 3 + 2/2 tokens long on average
        for r in engine:
            assert r["bytes_per_step"] == pytest.approx(weights[r["mode"]] + result["head_bytes"]
                                                        + 3 * 4 * result["kv_bytes_per_token"])
    text = format_rollout_rows(result)
    ratios = [line for line in text.splitlines() if line.startswith("- batch 3: fp8 ")]
    assert len(ratios) == 1
    for pair in ("fp8 ", "nvfp4-w4a16 ", "x bf16", "x nvfp4-w4a16", "nvfp4+rac0.25 ", "x nvfp4,", "x fp8"):
        assert pair in ratios[0]
    assert "| nvfp4 | " in text and "| mode | linear weights | vs bf16 |" in text
    assert "| bf16 | 3 |" in text and "Bandwidth limit: 0.00 TB/s" in text


def test_bench_rollout_bytes_per_step_count_weights_head_kv_and_routed_experts():
    import itertools

    from lowbit.bench.rollout import DecodeReads, expected_distinct_experts, hf_config
    from lowbit.models.hf import config_from_hf
    from lowbit.models.transformer import Transformer
    from lowbit.rl.engine import RolloutEngine

    # the expected distinct experts of B tokens, each choosing k of E, against every outcome
    for E, k, B in ((4, 2, 2), (5, 2, 3), (6, 1, 4), (8, 3, 2)):
        choices = list(itertools.combinations(range(E), k))
        outcomes = list(itertools.product(choices, repeat=B))
        brute = sum(len(set().union(*o)) for o in outcomes) / len(outcomes)
        assert expected_distinct_experts(E, k, B) == pytest.approx(brute, rel=1e-12)
    assert expected_distinct_experts(48, 8, 1) == pytest.approx(8)
    assert expected_distinct_experts(48, 8, 256) == pytest.approx(48)

    # the arithmetic: weights + head + routed experts + each row's mean cache (P + N/2 tokens)
    reads = DecodeReads(dense_bytes=1000, head_bytes=300, kv_bytes_per_token=10, expert_bytes=50,
                        moe_layers=2, n_experts=4, experts_per_token=2)
    experts = 4 * (1 - (1 - 2 / 4) ** 3)                 # 3.5 of 4
    assert reads.per_step(batch=3, prompt_len=8, new_tokens=5) == pytest.approx(
        1000 + 300 + 2 * experts * 50 + 3 * (8 + 5 / 2) * 10)
    dense = DecodeReads(dense_bytes=1000, head_bytes=300, kv_bytes_per_token=10)
    assert dense.per_step(batch=2, prompt_len=4, new_tokens=3) == 1000 + 300 + 2 * 5.5 * 10
    # decode step j of N - 1 reads P + j cache entries: their mean is P + N / 2
    P, N = 8, 5
    assert sum(P + j for j in range(1, N)) / (N - 1) == P + N / 2

    # ... and the parts as an engine stores them
    transformers_config, _ = hf_config("qwen3-moe-tiny")
    config = config_from_hf(transformers_config.to_dict())
    for precision in ("bf16", "nvfp4"):
        engine = RolloutEngine(config, precision, max_batch_size=1, max_seq_len=8)
        torch.manual_seed(0)
        engine.load_state_dict(Transformer(config).state_dict())
        reads = DecodeReads.of(engine)
        C, E, L = config.dim, config.n_experts, config.n_layers
        routers = L * E * C * 4                          # float32 on the CPU
        assert reads.moe_layers == L and (reads.n_experts, reads.experts_per_token) == (E, 2)
        assert reads.dense_bytes + L * E * reads.expert_bytes - routers == engine.weight_bytes()
        assert reads.head_bytes == config.vocab_size * C * 4
        assert reads.kv_bytes_per_token == 2 * L * config.n_kv_heads * config.head_dim * 4
        if precision == "bf16":
            assert reads.expert_bytes == 3 * C * config.moe_ffn_dim * 4


def test_bench_rollout_models_have_the_named_shapes():
    from lowbit.bench.rollout import MODELS, hf_config
    from lowbit.models.hf import config_from_hf

    configs = {name: config_from_hf(hf_config(name)[0].to_dict(), name) for name in MODELS}
    qwen, moe = configs["qwen3-0.6b"], configs["qwen3-moe-1b"]
    assert (qwen.dim, qwen.n_layers, qwen.n_heads, qwen.n_kv_heads, qwen.head_dim, qwen.ffn_dim,
            qwen.vocab_size, qwen.tie_embeddings, qwen.rope_theta, qwen.norm_eps, qwen.qk_norm) == (
        1024, 28, 16, 8, 128, 3072, 151936, True, 1e6, 1e-6, True)
    assert qwen.num_parameters() == 596_049_920            # Qwen3-0.6B's count
    assert (moe.dim, moe.n_layers, moe.n_heads, moe.n_kv_heads, moe.head_dim, moe.n_experts,
            moe.moe_ffn_dim, moe.experts_per_token, moe.moe_norm_topk, moe.vocab_size) == (
        1024, 16, 16, 4, 64, 48, 384, 8, True, 151936)
    assert moe.num_parameters() == 1_259_899_904 and moe.num_parameters(active=True) == 504_925_184
    assert all(configs[name].max_seq_len >= 2048 for name in ("llama-1.1b", "qwen3-0.6b", "qwen3-moe-1b"))


def test_bench_rollout_refuses_in_one_line(capsys):
    from lowbit.bench.rollout import bench_rollout

    base = ["bench", "rollout", "--device", "cpu", "--no-generate", "--repeats", "1"]
    with pytest.raises(SystemExit) as exit_:
        main([*base, "--model", "qwen3-7b"])
    assert exit_.value.code == 2 and "invalid choice: 'qwen3-7b'" in capsys.readouterr().err
    for args, says in ((["--batch-sizes", "1,100000000", "--new-tokens", "2"],
                        "--batch-sizes 100000000 does not fit"),
                       (["--prompt-len", "500", "--new-tokens", "20"], "exceeds the model's 512 positions")):
        assert main([*base, *args]) == 2
        err = capsys.readouterr().err
        assert says in err and err.strip().count("\n") == 0, err
    with pytest.raises(ValueError, match="unknown --model 'qwen3-7b'"):
        bench_rollout("qwen3-7b")


def test_bench_rollout_compiles_dense_models_only():
    from lowbit.bench.rollout import bench_rollout

    result = bench_rollout("qwen3-moe-tiny", ["bf16"], batch_sizes=(1,), prompt_len=2, new_tokens=2,
                           repeats=1, generate_baseline=False, say=lambda line: None,
                           compile_decode=True, decode_kernels="off")
    assert [r["mode"] for r in result["rows"]] == ["bf16"]
    assert result["rows"][0]["decode_kernels"] is False and result["rows"][0]["compiled"] is None
    assert result["notes"] == [
        "compiled rows: skipped (the engine compiles a dense model's decode step only)"]


def test_bench_rollout_table_explains_a_busy_time_above_the_step():
    from lowbit.bench.rollout import format_rollout_rows

    def result(busy_us):
        prof = {"busy_us": busy_us, "step_us": 955.0, "kernels_per_step": 128,
                "classes": {"gemm (bf16/fp32)": [busy_us, 89]}, "top": []}
        return {"rows": [], "batch_sizes": [1], "limit_steps_per_s": None,
                "profiles": {"bf16, decode kernels": {1: prof}}}

    # kernels launched with programmatic dependent launch overlap, each counting its wait
    assert "| bf16, decode kernels | 1 | 955 | 1409 | 148% |" in format_rollout_rows(result(1409.0))
    assert "the kernels overlap (programmatic dependent launch)" in format_rollout_rows(result(1409.0))
    assert "overlap" not in format_rollout_rows(result(900.0))
    # the batch-1 bf16 row runs on the decode kernels by default: it is the one set against generate
    rows = [{"impl": "lowbit engine", "mode": "bf16, decode kernels", "batch": 1, "decode_steps_per_s": 1000.0,
             "tokens_per_s": 990.0},
            {"impl": "transformers generate", "mode": "bf16, dynamic cache", "batch": 1,
             "decode_steps_per_s": 25.0, "tokens_per_s": 24.75}]
    table = format_rollout_rows({**result(900.0), "rows": rows})
    assert "- batch 1: engine bf16, decode kernels 40.0x the tokens/s of generate (bf16, dynamic cache)" in table


def test_bench_rollout_table_sets_modes_against_each_other_and_the_limit():
    from lowbit.bench.rollout import format_rollout_rows

    speeds = {"bf16": 400.0, "fp8": 600.0, "nvfp4-w4a16": 924.0, "nvfp4": 800.0, "nvfp4+rac0.25": 600.0}
    rows = [{"impl": "lowbit engine", "mode": f"{m}{suffix}", "precision": m, "batch": 8,
             "decode_kernels": bool(suffix), "decode_steps_per_s": v * scale, "tokens_per_s": 8 * v,
             "bytes_per_step": 1e9 / (1 + i), "limit_steps_per_s": 4000.0 * (1 + i),
             "of_limit": v * scale / (4000.0 * (1 + i))}
            for suffix, scale in ((", decode kernels", 1.0), ("", 0.5))
            for i, (m, v) in enumerate(speeds.items())]
    weights = {"bf16": 2e9, "fp8": 1e9, "nvfp4-w4a16": 0.5625e9, "nvfp4": 0.5625e9, "nvfp4+rac0.25": 0.5625e9}
    result = {"rows": rows, "batch_sizes": [8], "model": "llama-1.1b", "architecture": "LlamaForCausalLM",
              "params_total": 1_100_048_384, "params_active": 1_100_048_384, "prompt_len": 128,
              "new_tokens": 256, "bandwidth_bytes_per_s": 4e12, "weight_bytes": weights,
              "gpu_weight_bytes": {m: w + 0.5e9 for m, w in weights.items()}}
    text = format_rollout_rows(result)
    assert ("- batch 8, decode kernels: fp8 1.50x bf16, nvfp4-w4a16 2.31x bf16, nvfp4 2.00x bf16, "
            "nvfp4+rac0.25 1.50x bf16, nvfp4 0.87x nvfp4-w4a16, nvfp4+rac0.25 0.75x nvfp4, "
            "nvfp4 1.33x fp8") in text
    assert "- batch 8 without decode kernels: fp8 1.50x bf16, nvfp4-w4a16 2.31x bf16," in text
    assert "| nvfp4 | 0.562 GB | 0.28x | 1.062 GB | 0.42x |" in text
    assert "Bandwidth limit: 4.00 TB/s" in text
    assert "| bf16, decode kernels | 8 | 1.000 GB | 4,000 | 400.0 | 10% |" in text
    assert "llama-1.1b (LlamaForCausalLM): 1.10B parameters, 1.10B active a token" in text


def test_exposed_communication_is_what_no_compute_kernel_overlaps():
    from lowbit.bench.timing import exposed, kernel_category

    assert kernel_category("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "communication (nccl)"
    assert kernel_category("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "communication (nccl)"
    # two collectives (the second given as two overlapping pieces) against compute 5..25, 40..45
    communication = [(0, 10), (20, 26), (24, 30)]
    compute = [(5, 15), (12, 25), (40, 45)]
    assert exposed(communication, compute) == 5 + 5     # 0..5 and 25..30
    assert exposed(communication, []) == 20
    assert exposed([], compute) == 0
    assert exposed([(0, 10)], [(0, 10), (2, 3)]) == 0


def test_qat_settings_take_refresh_interval_per_element_b_and_mse_scales():
    from lowbit.bench.train import qat_setting

    assert qat_setting("nvfp4") is None                      # a recipe, not a QAT setting
    plain = qat_setting("qat/int2:g64/ste")
    assert (plain.weights, plain.estimator, plain.scale_init) == ("int2:g64", "ste", "absmax")
    full = qat_setting("qat/int2:g64/jacquant/k100/elem/mse")
    assert full.jacquant.refresh_every == 100 and full.jacquant.per_element
    assert full.scale_init == "mse" and full.estimator == "jacquant"
    for bad, says in (("qat/int2", "WEIGHTS/ESTIMATOR"), ("qat/int2:g64/ste/fast", "unknown option 'fast'"),
                      ("qat/int2:g64/magic", "unknown estimator")):
        with pytest.raises(ValueError, match=says):
            qat_setting(bad)


def test_bench_train_says_when_a_recipe_quantized_nothing(monkeypatch):
    # (a 2-layer Hugging Face model under nvfp4's first/last-block rule, say): its row would read
    # as a speed-up of the recipe; the table says it trained bf16
    import lowbit.train.build as build
    from lowbit.bench.train import bench_train, format_rows

    real = build.apply_recipe
    monkeypatch.setattr(build, "apply_recipe", lambda net, recipe: (
        real(net, recipe) if recipe is None or recipe.name == "bf16" else
        "lowbit.quantize_: recipe 'nvfp4': 0 modules quantized, 21 kept in high precision"))
    rows = bench_train("tiny", ("bf16", "nvfp4"), seq_len=16, batch_size=2, steps=1, warmup=0,
                       progress=lambda m: None)
    text = format_rows(rows)
    assert rows[0]["note"] is None and "nvfp4 quantized no module" in rows[1]["note"]
    assert "nvfp4: nvfp4 quantized no module of this model" in text
    row = next(line for line in text.splitlines() if line.startswith("nvfp4 (bf16: nothing quantized)"))
    assert "x" not in row.split("quantized)")[1]       # no ratio against bf16 for it
