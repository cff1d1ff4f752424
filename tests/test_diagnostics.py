"""Training diagnostics: operand consistency, gradient bias against BF16, clipping."""

import torch

import lowbit
from lowbit.diagnostics.training import cosine, relative_difference, training_diagnostics
from lowbit.models import ModelConfig, build_model


def converted(recipe, n_experts=0):
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=128, dim=64, n_layers=3, n_heads=4, max_seq_len=32,
                                    n_experts=n_experts))
    lowbit.quantize_(model, recipe)
    return model


def test_2d_recipe_has_consistent_operands_and_no_clipping():
    model = converted("stable-fp4")
    idx = torch.randint(0, 128, (4, 32))
    d = training_diagnostics(model, idx, idx)
    for key in ("w_fwd_bwd_rel_diff", "x_fwd_bwd_rel_diff", "dy_dgrad_wgrad_rel_diff",
                "clip_w", "clip_x", "clip_dy"):
        assert d[f"diag/{key}"] == 0.0, key
    assert 0.5 < d["diag/dw_cos"] < 1.0 and 0.5 < d["diag/dx_cos"] < 1.0
    assert d["diag/dw_rel_err"] > 0


def test_1d_recipe_has_inconsistent_operands_and_floor_clips():
    model = converted("mxfp4")
    idx = torch.randint(0, 128, (4, 32))
    d = training_diagnostics(model, idx, idx)
    assert d["diag/w_fwd_bwd_rel_diff"] > 0.01 and d["diag/x_fwd_bwd_rel_diff"] > 0.01
    assert d["diag/clip_w"] > 0 and d["diag/clip_x"] > 0


def test_diagnostics_leave_rng_and_grads_untouched():
    model = converted("stable-fp4", n_experts=4)
    idx = torch.randint(0, 128, (4, 32))
    model(idx, idx).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    state = torch.random.get_rng_state()
    d = training_diagnostics(model, idx, idx)
    assert torch.equal(state, torch.random.get_rng_state())
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters())
    assert "diag/dw_cos" in d


def test_bf16_model_has_no_diagnostics_and_helpers():
    assert training_diagnostics(converted("bf16"), torch.zeros(1, 4, dtype=torch.long),
                                torch.zeros(1, 4, dtype=torch.long)) == {}
    a = torch.tensor([1.0, 0.0])
    assert cosine(a, a) == 1.0 and cosine(a, torch.tensor([0.0, 1.0])) == 0.0
    assert relative_difference(a, torch.tensor([1.0, 1.0])) == 1.0


def test_flushed_counts_nonzero_values_below_half_a_grid_step():
    from lowbit.diagnostics.training import flushed
    from lowbit.formats import QuantSpec, quantize_dequantize

    # one 1x32 MXFP4 block with max 6: rceil scale 1, grid step 0.5 near zero, so |x| < 0.25
    # flushes (0.25 is a tie to even: 0), 0.26 rounds to 0.5; zeros do not count
    x = torch.tensor([[6.0, 0.2, -0.24, 0.25, 0.26, 1.0, 0.0, 0.0] + [3.0] * 24])
    q = quantize_dequantize(x, QuantSpec.make("mxfp4", (1, 32), "rceil"))
    assert flushed(x, q) == 3 / 30


def test_per_layer_diagnostics_name_every_quantized_layer_and_average_to_the_means():
    from lowbit.diagnostics.training import per_layer_training_diagnostics
    from lowbit.nn import QuantLinear

    model = converted("stable-fp4-nosr")
    idx = torch.randint(0, 128, (2, 32))
    d = per_layer_training_diagnostics(model, (idx, idx), step=0)
    layers = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    for key in ("dw_cos", "dx_cos", "flush_dy", "flush_x", "clip_x"):
        per = [d[f"diag/layer/{n}/{key}"] for n in layers]
        assert d[f"diag/{key}"] == sum(per) / len(per), key
    assert 0 < d["diag/flush_dy"] < 1   # 32x32 dY tiles flush small tokens' gradients
    assert d["diag/flush_dy_wgrad"] == d["diag/flush_dy"]  # one copy of dY for both GEMMs
    plain = training_diagnostics(model, idx, idx)
    assert not any("/layer/" in k for k in plain) and plain["diag/dw_cos"] == d["diag/dw_cos"]
