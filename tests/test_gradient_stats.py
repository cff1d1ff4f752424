"""lowbit.diagnostics.gradients: bias and variance of a weight gradient told apart -- the
estimator on draws of known bias and noise, then recipes on a tiny model (a recipe that rounds
only to nearest has no variance; a stochastic operand has)."""

import json

import pytest
import torch

from lowbit.diagnostics.gradients import (OPERANDS, bias_variance, format_report,
                                          gradient_bias_variance, plot_report)
from lowbit.models import ModelConfig, Transformer


def _draws(g, bias, sigma, n, seed):
    gen = torch.Generator().manual_seed(seed)
    total, square = torch.zeros_like(g), torch.zeros_like(g)
    for _ in range(n):
        d = g + bias + sigma * torch.randn(g.shape, generator=gen, dtype=torch.float64)
        total += d
        square += d * d
    return total, square


@pytest.mark.parametrize("bias", [0.0, 0.05])
def test_the_estimator_recovers_a_known_bias_and_variance(bias):
    g = torch.randn(4000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    n, sigma = 64, 0.5
    total, square = _draws(g, bias, sigma, n, seed=1)
    bias2, bias2_var, variance, norm2 = bias_variance(g, total, square, n)
    assert abs(bias2 - bias**2 * g.numel()) < 4 * bias2_var**0.5      # within 4 standard errors
    assert variance == pytest.approx(sigma**2 * g.numel(), rel=0.05)
    assert norm2 == pytest.approx((g * g).sum().item())
    if bias:
        assert bias2 > 10 * bias2_var**0.5                              # a real bias shows


def test_recipes_on_a_tiny_model_split_bias_from_variance(tmp_path):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny", vocab_size=64, n_layers=2))
    idx = torch.randint(0, 64, (2, 32))
    seen = []
    report = gradient_bias_variance(model, idx[:, :-1], idx[:, 1:], ["mxfp4", "stable-fp4"],
                                    draws=4, operands=True, progress=lambda *a: seen.append(a))
    assert len(seen) == 14 and seen[0] == ("mxfp4", "all", 2) and ("stable-fp4", "all", 4) in seen
    rows = {(r.recipe, r.operands): r for r in report.model_rows()}
    assert set(rows) == {(r, o) for r in ("mxfp4", "stable-fp4") for o in ("all", *OPERANDS)}
    # mxfp4 rounds to nearest everywhere: the same gradient every draw, a bias and no variance
    assert rows["mxfp4", "all"].variance == 0 and rows["mxfp4", "all"].bias2_se == 0
    assert rows["mxfp4", "all"].bias > 0
    # stable-fp4 rounds dY stochastically: variance there, none from the forward operands alone
    assert rows["stable-fp4", "dgrad_dy"].variance > 0 and rows["stable-fp4", "all"].variance > 0
    assert rows["stable-fp4", "fprop_x"].variance == 0
    # the deterministic configurations stop after two identical draws; the stochastic take all
    assert rows["mxfp4", "all"].draws == rows["stable-fp4", "fprop_x"].draws == 2
    assert rows["stable-fp4", "dgrad_dy"].draws == rows["stable-fp4", "all"].draws == 4
    assert any(r.layer != "model" for r in report.rows)
    assert "stable-fp4" in format_report(report) and "model.layers.0" in format_report(report, layers=True)
    plot_report(report, str(tmp_path / "g.png"))
    assert (tmp_path / "g.png").stat().st_size > 0
    # the caller's model and random state are left alone
    assert not any(type(m).__name__.startswith("Quant") for m in model.modules())
    with pytest.raises(ValueError, match="draws must be >= 2"):
        gradient_bias_variance(model, idx[:, :-1], idx[:, 1:], ["mxfp4"], draws=1)


def test_lowbit_inspect_gradients_reads_a_run(tmp_path, corpus_env, capsys):
    from lowbit.cli import main

    out = ["--out-dir", str(tmp_path / "runs"), "--no-progress"]
    assert main(["train", "--recipe", "bf16", "--steps", "2", "--eval-batches", "1",
                 "--seq-len", "32", "--batch-size", "2", "--run-name", "r", *out]) == 0
    capsys.readouterr()
    png = tmp_path / "g.png"
    assert main(["inspect", "--gradients", str(tmp_path / "runs" / "r"), "--recipes",
                 "mxfp4,stable-fp4", "--draws", "2", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "mxfp4" in text and "stable-fp4" in text and png.stat().st_size > 0
    # --json: one JSON document on stdout (the plot's line on stderr), with a results file's meta
    assert main(["inspect", "--gradients", str(tmp_path / "runs" / "r"), "--recipes", "mxfp4",
                 "--draws", "2", "--json", "--plot", str(png)]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert {"date", "commit", "machine", "command"} <= report["meta"].keys()
    assert {r["recipe"] for r in report["results"]["rows"]} == {"mxfp4"} and "plot:" in err
    assert main(["inspect", "--gradients", str(tmp_path / "nothing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert main(["inspect", "model.safetensors", "--gradients", str(tmp_path / "runs" / "r")]) == 2
