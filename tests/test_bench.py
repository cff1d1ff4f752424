"""`lowbit bench train` runs and reports ratios to its baseline (speed goals live in benchmarks,
not in unit tests: this checks the table, not the numbers)."""

import json

from lowbit.bench import bench_train, format_rows
from lowbit.cli import main


def test_bench_train_rows_and_table():
    rows = bench_train("tiny", ["bf16", "stable-fp4"], seq_len=32, batch_size=2, steps=2, warmup=1,
                       progress=lambda message: None)
    assert [r["recipe"] for r in rows] == ["bf16", "stable-fp4"]
    assert rows[0]["time_vs_base"] == 1.0 and rows[1]["step_ms"] > 0
    table = format_rows(rows)
    assert "time vs bf16" in table and "stable-fp4" in table


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
    assert main(["bench", "train", "--cuda-graph", "--n-experts", "4"]) == 2
    assert "--cuda-graph needs a dense model" in capsys.readouterr().err
    assert main(["bench", "train", "--device", "gpu0"]) == 2
    assert "device must be auto, cpu, cuda or cuda:N (got 'gpu0')" in capsys.readouterr().err


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


def test_bench_kernels_runs_under_the_interpreter(tmp_path, capsys):
    """`lowbit bench kernels` end to end on the CPU (conftest sets TRITON_INTERPRET=1 there):
    every timed kernel runs, the table and JSON come out; the numbers mean nothing here."""
    import pytest
    import torch

    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("on a GPU this would time the real shapes; the CPU path is what this checks")
    from lowbit.bench.kernels import timed_kernels

    out = tmp_path / "kernels.json"
    assert main(["bench", "kernels", "--shapes", "32x64", "--no-torchao", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "timings mean nothing" in text and "fq+t mxfp4 rceil 32x32 rne" in text
    rows = json.loads(out.read_text())
    assert [r["kernel"] for r in rows] == [label for label, _, _ in timed_kernels()]
    assert not [r for r in rows if "error" in r]
    assert main(["bench", "kernels", "--shapes", "32by64"]) == 2
    assert "bad shape '32by64'" in capsys.readouterr().err


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
    assert idle_gaps([])["idle_ms"] == 0
