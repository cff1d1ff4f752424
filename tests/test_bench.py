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
