"""lowbit.models.moe's grouped expert GEMMs (torch._grouped_mm over all experts) against the
per-expert loop they replace: the same outputs and gradients (uneven groups, an empty expert,
one expert taking every token, dropped slots), no host read-back (a full-graph compile), and
quantized experts grouped where that is the per-expert numerics (emulated and FP8 GEMMs), kept
on the per-expert path where it is not. GPU tests (marked gpu): the grouped FP8 GEMM on CUDA
(torch._scaled_grouped_mm) against the group-by-group GEMMs, and the experts on it against
the per-expert loop."""

import pytest
import torch
from kernel_paths import kernels_on_cpu

from lowbit.models.moe import Experts, ExpertRows, gather_rows, grouped_mm_supported
from lowbit.nn import QuantExperts
from lowbit.ops.grouped import grouped_quant_linear, groups_exactly, row_tile
from lowbit.recipes import get_recipe


class PerExpert(Experts):
    """The reference: each expert's GEMM in turn."""

    def _can_group(self, x, weight):
        return False


def _experts(E=6, C=32, F=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    grouped, reference = Experts(E, C, F), PerExpert(E, C, F)
    with torch.no_grad():
        grouped.gate_up_proj.copy_(torch.randn(E, 2 * F, C, generator=g) * 0.2)
        grouped.down_proj.copy_(torch.randn(E, C, F, generator=g) * 0.2)
    reference.load_state_dict(grouped.state_dict())
    return grouped.to(dtype), reference.to(dtype)


def _routing(N, E, k, case, g):
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    if case == "uneven":
        index[: N // 2, 0] = 2                       # expert 2 takes many slots
        index[index == 4] = 5                        # expert 4 takes none
    elif case == "one expert takes every token":
        index[:, 0] = 1
    elif case == "dropped slots":
        index[0, 1], index[3, 0] = E, E              # index E: a dropped slot (expert parallelism)
    return index


@pytest.fixture
def unwritten_rows_are_nan(monkeypatch):
    """torch._grouped_mm and the grouped FP8 GEMM (torch._scaled_grouped_mm on CUDA) leave the
    output rows past the last group unwritten: make them NaN (as uninitialized memory may be),
    forward and backward, so a row that holds no slot and leaks shows."""
    import lowbit.ops.grouped as grouped_ops
    real, real_fp8 = torch._grouped_mm, grouped_ops.grouped_fp4_gemm_fp8

    def past_the_groups_nan(out, ends):
        out = out.clone()
        out[int(ends[-1]):] = float("nan")
        return out

    def grouped_mm(a, b, offs=None, **kw):
        out = real(a, b, offs=offs, **kw)
        return past_the_groups_nan(out, offs) if offs is not None and a.dim() == 2 and b.dim() == 3 else out

    def grouped_fp8(a, b, ends, along, **kw):
        out = real_fp8(a, b, ends, along, **kw)
        return past_the_groups_nan(out, ends) if along == "rows" else out
    monkeypatch.setattr(torch, "_grouped_mm", grouped_mm)
    monkeypatch.setattr(grouped_ops, "grouped_fp4_gemm_fp8", grouped_fp8)


@pytest.mark.parametrize("case", ["uneven", "one expert takes every token", "dropped slots"])
def test_grouped_experts_equal_the_per_expert_loop_forward_and_gradients(case, unwritten_rows_are_nan):
    g = torch.Generator().manual_seed(1)
    N, E, k = 20, 6, 2
    grouped, reference = _experts(E)
    assert grouped_mm_supported(torch.zeros(1, 32, dtype=torch.bfloat16), grouped.gate_up_proj)
    index = _routing(N, E, k, case, g)
    weights = torch.rand(N, k, generator=g).to(torch.bfloat16)
    results = []
    for module in (grouped, reference):
        x = torch.randn(N, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        x.requires_grad_(True)
        w = weights.clone().requires_grad_(True)
        y = module(x, index, w)
        grads = torch.autograd.grad(y.float().square().sum(),
                                    [x, w, module.gate_up_proj, module.down_proj])
        results.append((y, *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
        assert a.isfinite().all()
    if case == "dropped slots":                       # a dropped slot adds nothing
        assert torch.equal(results[0][0][0], _only_kept(grouped, index, weights)[0])


def _only_kept(module, index, weights):
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    w = torch.where(index < module.num_experts, weights, torch.zeros_like(weights))
    return module(x, torch.where(index < module.num_experts, index, 0), w)


def test_grouped_experts_under_autocast_equal_the_loop():
    # float32 parameters, bf16 autocast (lowbit train's bf16): the grouped GEMM takes the
    # autocast dtype as F.linear does
    grouped, reference = _experts(dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 32, generator=g)
    index, w = _routing(16, 6, 2, "uneven", g), torch.rand(16, 2, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert grouped_mm_supported(x, grouped.gate_up_proj)
        torch.testing.assert_close(grouped(x, index, w), reference(x, index, w), atol=2e-2, rtol=2e-2)
    assert not grouped_mm_supported(x, grouped.gate_up_proj)       # float32 outside autocast


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_grouped_experts_compile_in_one_graph(device):
    # no host read-back of the group sizes: the whole forward traces as one graph (on CUDA the
    # device's capability check folds to a constant)
    grouped, _ = _experts()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(12, 32, generator=g).to(torch.bfloat16)
    index, w = _routing(12, 6, 2, "uneven", g), torch.rand(12, 2, generator=g).to(torch.bfloat16)
    grouped, x, index, w = grouped.to(device), x.to(device), index.to(device), w.to(device)
    assert grouped_mm_supported(x, grouped.gate_up_proj)   # a GPU before Hopper fails here
    compiled = torch.compile(grouped, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x, index, w), grouped(x, index, w))


class QuantPerExpert(QuantExperts):
    """The quantized reference: each expert's quant_linear in turn."""

    def _can_group(self, x, weight):
        return False


def _nvfp4_rne(hadamard=False):
    """NVFP4's operands (1x16 X and dY under FP32 tensor scales, 16x16 weights) rounded to
    nearest: every quantization deterministic, so grouped and per-expert compare bit for bit."""
    from lowbit.formats import QuantSpec
    from lowbit.recipes import LinearRecipe
    x, w = QuantSpec.make("nvfp4", (1, 16)), QuantSpec.make("nvfp4", (16, 16))
    return LinearRecipe(fprop_x=x, fprop_w=w, dgrad_dy=x, dgrad_w=w, wgrad_dy=x, wgrad_x=x,
                        wgrad_hadamard=hadamard)


def _quantized_pair(name, seed=0):
    base, _ = _experts(E=6, C=64, F=32, seed=seed)
    if name == "asymmetric-qat":                  # QUADS' trainer side: NVFP4 weights in fprop
        from lowbit.rl.trainer_side import asymmetric_qat_recipe
        recipe = asymmetric_qat_recipe().linear_for("model.layers.1.mlp.experts", 4)
    elif name == "nvfp4-rne":
        recipe = _nvfp4_rne()
    else:
        recipe = get_recipe(name).linear_for("model.layers.1.mlp.experts", 4)
    return base, QuantExperts(base, recipe), QuantPerExpert(base, recipe), recipe


def _run(module, base, x, index, w, seed):
    xx = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    y = module(xx, index, w)
    return (y, *torch.autograd.grad(y.float().square().sum(), [xx, base.gate_up_proj, base.down_proj]))


@pytest.mark.parametrize("name", ["stable-fp4-nosr", "mxfp4", "asymmetric-qat"])
@pytest.mark.parametrize("case", ["uneven", "one expert takes every token", "dropped slots"])
def test_quantized_grouped_experts_equal_the_per_expert_loop_bit_for_bit(name, case, unwritten_rows_are_nan):
    # round-to-nearest recipes without tensor scales on X and dY: every quantized operand is
    # the per-expert path's, bit for bit (32-row tiles never straddle two experts; NVFP4
    # weights, tensor-scaled, under each expert's own scale), and the grouped GEMMs agree to
    # accumulation order -- here, on the CPU, exactly; the rows a grouped GEMM leaves
    # unwritten (NaN here) reach nothing
    g = torch.Generator().manual_seed(5)
    base, grouped, reference, recipe = _quantized_pair(name)
    assert groups_exactly(recipe) and row_tile(recipe) == (1 if name == "asymmetric-qat" else 32)
    N = 40
    x = torch.randn(N, 64, generator=g).to(torch.bfloat16)
    index, w = _routing(N, 6, 2, case, g), torch.rand(N, 2, generator=g).to(torch.bfloat16)
    for a, b in zip(_run(grouped, base, x, index, w, 0), _run(reference, base, x, index, w, 0)):
        assert torch.equal(a, b)


def _draws_alike(base, grouped, reference, seed):
    """A stochastically rounding recipe (dY): grouped and per-expert forwards equal (they
    round to nearest), gradients from other draws of the same distribution. Returns the
    inputs (x, index, w)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    index, w = _routing(40, 6, 2, "uneven", g), torch.rand(40, 2, generator=g).to(torch.bfloat16)
    got, want = _run(grouped, base, x, index, w, 0), _run(reference, base, x, index, w, 0)
    assert torch.equal(got[0], want[0])                  # the forward rounds to nearest
    for a, b in zip(got[1:], want[1:]):                  # dY's stochastic rounding: other draws
        assert a.isfinite().all() and abs(a.float().norm() / b.float().norm() - 1) < 0.2
    return x, index, w


def test_stochastic_rounding_draws_differently_but_alike():
    base, grouped, reference, recipe = _quantized_pair("stable-fp4")
    _draws_alike(base, grouped, reference, 6)


@pytest.mark.parametrize("kernels", ["reference", "kernels"])
@pytest.mark.parametrize("case", ["uneven", "one expert takes every token", "dropped slots"])
def test_nvfp4_grouped_experts_take_each_experts_tensor_scale_bit_for_bit(case, kernels, unwritten_rows_are_nan,
                                                                         monkeypatch):
    # X's and dY's FP32 tensor scales are each expert's own (its segment of the layout), as
    # the per-expert loop quantizes them: forward and all three gradients bit for bit, with
    # one expert's tokens 1000x larger than the rest (a shared scale would flush the others);
    # "kernels": both paths on the fused kernels (Triton's interpreter), the grouped one taking
    # its scales per row and per column
    if kernels == "kernels":
        kernels_on_cpu(monkeypatch)
    g = torch.Generator().manual_seed(7)
    base, grouped, reference, recipe = _quantized_pair("nvfp4-rne")
    assert groups_exactly(recipe) and row_tile(recipe) == 16
    N = 40
    x = torch.randn(N, 64, generator=g)
    index = _routing(N, 6, 2, case, g)
    x[(index == 1).any(dim=1)] *= 1000.0                  # expert 1's tokens (and their others)
    x, w = x.to(torch.bfloat16), torch.rand(N, 2, generator=g).to(torch.bfloat16)
    got, want = _run(grouped, base, x, index, w, 0), _run(reference, base, x, index, w, 0)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # one tensor scale over every expert's rows (what grouping without segments would do) differs
    from lowbit.ops.gemms import operand
    rows = ExpertRows.route(index, 6, 16)
    xs = gather_rows(x, rows.source, rows.slot_row, 2)
    assert not torch.equal(operand(xs, recipe.fprop_x, 1, rows.ends), operand(xs, recipe.fprop_x, 1))


@pytest.mark.parametrize("C", [64, 40])
def test_nvfp4_grouped_weights_take_each_experts_tensor_scale(C, unwritten_rows_are_nan):
    # the stacked weights under one tensor scale per expert (expert 2's 1e4x the rest, expert
    # 3's all zero): in one call where the projection's rows are a multiple of 16 (the 16x16
    # tiles stay within an expert), expert by expert where not (C 40: down_proj's 40 rows);
    # forward and gradients bit for bit the per-expert loop's
    base, _ = _experts(E=6, C=C, F=32, seed=2)
    with torch.no_grad():
        for w in (base.gate_up_proj, base.down_proj):
            w[2] *= 1e4
            w[3] = 0
    recipe = _nvfp4_rne()
    grouped, reference = QuantExperts(base, recipe), QuantPerExpert(base, recipe)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(24, C, generator=g).to(torch.bfloat16)
    index, w = _routing(24, 6, 2, "uneven", g), torch.rand(24, 2, generator=g).to(torch.bfloat16)
    for a, b in zip(_run(grouped, base, x, index, w, 0), _run(reference, base, x, index, w, 0)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", ["reference", "kernels"])
def test_nvfp4_rotated_wgrad_operands_are_each_segments_own(kernels, dtype, monkeypatch):
    # the random Hadamard transform and quantization of the wgrad operands, segment by segment:
    # each expert's rows rotated and quantized alone, under the same signs, bit for bit;
    # "kernels": the rotated maxima per 16 rows and the fused kernel (Triton's interpreter)
    from lowbit.dispatch import rotated_fake_quantize
    if kernels == "kernels":
        kernels_on_cpu(monkeypatch)
    g = torch.Generator().manual_seed(8)
    spec = _nvfp4_rne().wgrad_dy
    ends = torch.tensor([16, 16, 48, 80], dtype=torch.int32)   # an empty segment; one of 32 rows
    t = torch.randn(96, 24, generator=g)
    t[16:48] *= 1e4
    t[60, 3] = float("nan")                                    # NaN in segment 3: its block only
    t[80:] = 0                                                 # rows past the last end hold nothing
    t = t.to(dtype)
    signs = torch.randint(0, 2, (16,), generator=g) * 2 - 1
    got = rotated_fake_quantize(t, spec, signs, segment_ends=ends)
    starts = [0, 16, 16, 48]
    for start, end in zip(starts, ends.tolist()):
        if end > start:
            want = rotated_fake_quantize(t[start:end], spec, signs)
            torch.testing.assert_close(got[start:end], want, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(got[48:64, 3]).all() and not torch.isnan(got[48:64, :3]).any()
    assert got[80:].eq(0).all()


def test_a_rotation_with_shorter_token_blocks_pads_experts_to_16_rows(unwritten_rows_are_nan, monkeypatch):
    # a weight-only NVFP4 recipe with the Hadamard transform on wgrad: its tokens' operands have
    # no blocks, yet each expert's rows start at a multiple of 16, so no 16-row rotation block
    # mixes two experts; with one fixed draw of signs, bit for bit the loop's
    from lowbit.recipes import LinearRecipe
    w = _nvfp4_rne().fprop_w
    recipe = LinearRecipe(fprop_w=w, dgrad_w=w, wgrad_hadamard=True)
    assert row_tile(recipe) == 16 and row_tile(_nvfp4_rne()) == 16
    real = torch.randint
    monkeypatch.setattr(torch, "randint", lambda low, high, size, **kw: (
        torch.tensor([1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 1, 0, 1, 1, 0, 0], device=kw.get("device"))
        if tuple(size) == (16,) else real(low, high, size, **kw)))
    base, _ = _experts(E=6, C=64, F=32, seed=4)
    grouped, reference = QuantExperts(base, recipe), QuantPerExpert(base, recipe)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(20, 64, generator=g).to(torch.bfloat16)
    index, wts = _routing(20, 6, 2, "uneven", g), torch.rand(20, 2, generator=g).to(torch.bfloat16)
    for a, b in zip(_run(grouped, base, x, index, wts, 0), _run(reference, base, x, index, wts, 0)):
        assert torch.equal(a, b)


def test_nvfp4_grouped_draws_alike():
    # the recipe itself: SR on dY and one draw of the Hadamard signs for the layer (the loop
    # draws one per expert): the forward equal, gradients from other draws alike; so its
    # experts group (on emulated GEMMs: NVFP4 has no FP8 form)
    base, grouped, reference, recipe = _quantized_pair("nvfp4")
    assert recipe.wgrad_hadamard and groups_exactly(recipe) and row_tile(recipe) == 16
    _draws_alike(base, grouped, reference, 9)


def test_training_flops_count_the_active_experts_only():
    from lowbit.bench.train import training_flops_per_token
    from lowbit.models import ModelConfig, Transformer

    dense = Transformer(ModelConfig.preset("tiny"))
    moe = Transformer(ModelConfig.preset("tiny", n_experts=4, experts_per_token=2))
    for net in (dense, moe):
        flops, active = training_flops_per_token(net, seq_len=64)
        cfg = net.config
        linears = sum(m.weight.numel() for m in net.modules() if isinstance(m, torch.nn.Linear))
        experts = sum((m.gate_up_proj.numel() + m.down_proj.numel()) // 2
                      for m in net.modules() if isinstance(m, Experts))          # k / E = 1/2
        routers = sum(m.mlp.gate.weight.numel() for m in net.model.layers) if cfg.is_moe else 0
        assert active == linears + experts + routers
        assert flops == 6 * active + 6 * cfg.n_layers * 64 * cfg.n_heads * cfg.head_dim


# ---- FP8 GEMMs (stable-fp4-fp8): one grouped FP8 GEMM per pass ------------------------------

def _fp8_pair(name, E=6, C=64, F=32):
    base, _ = _experts(E=E, C=C, F=F)
    recipe = get_recipe(name).linear_for("model.layers.1.mlp.experts", 4)
    if recipe.gemm.value != "fp8":
        recipe = recipe.with_gemm("fp8")
    return base, QuantExperts(base, recipe), QuantPerExpert(base, recipe), recipe


@pytest.mark.parametrize("name", ["stable-fp4-nosr", "mxfp4"])
@pytest.mark.parametrize("case", ["uneven", "one expert takes every token", "dropped slots"])
def test_fp8_grouped_experts_equal_the_per_expert_loop_bit_for_bit(name, case, monkeypatch,
                                                                   unwritten_rows_are_nan):
    # round-to-nearest MXFP4 on FP8 GEMMs: the same quantized operands as each expert's own
    # QuantLinearFP8Function, multiplied exactly (on the CPU the FP32-accumulating emulation,
    # group by group): equal bit for bit, forward and both gradients
    import lowbit.ops.grouped as grouped_ops
    calls = []
    real = grouped_ops.grouped_fp4_gemm_fp8          # rows past the groups NaN: the fixture's
    monkeypatch.setattr(grouped_ops, "grouped_fp4_gemm_fp8",
                        lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    g = torch.Generator().manual_seed(7)
    base, grouped, reference, recipe = _fp8_pair(name)
    assert groups_exactly(recipe, tuple(base.gate_up_proj.shape)) and not groups_exactly(recipe)
    x = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    index, w = _routing(40, 6, 2, case, g), torch.rand(40, 2, generator=g).to(torch.bfloat16)
    got, want = _run(grouped, base, x, index, w, 0), _run(reference, base, x, index, w, 0)
    assert calls == ["rows", "rows", "rows", "k", "rows", "k"]     # 2 projections x 3 GEMMs
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_fp8_stochastic_rounding_and_tiles_that_straddle_experts():
    base, grouped, reference, recipe = _fp8_pair("stable-fp4-fp8")
    x, index, w = _draws_alike(base, grouped, reference, 8)
    # experts 48 wide: a 32x32 tile of the stacked (E * 48, 64) weight holds two experts' rows,
    # so these run expert by expert, and the grouped call refuses them
    base, grouped, reference, recipe = _fp8_pair("stable-fp4-nosr", F=24)
    assert not groups_exactly(recipe, tuple(base.gate_up_proj.shape))
    assert not grouped._can_group(x, base.gate_up_proj)
    for a, b in zip(_run(grouped, base, x, index, w, 0), _run(reference, base, x, index, w, 0)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="straddle two experts"):
        grouped_quant_linear(x, base.gate_up_proj, torch.full((6,), 40, dtype=torch.int32), recipe)


def test_fp8_grouped_nan_and_extreme_magnitudes():
    # huge and tiny rows, and a row spanning more binades than one factor holds (folded in
    # K-chunks): exact and equal; a NaN token: NaN where the per-expert loop has it (its own
    # rows and those sharing its 32x32 tiles)
    g = torch.Generator().manual_seed(9)
    base, grouped, reference, recipe = _fp8_pair("stable-fp4-nosr")
    x = torch.randn(40, 64, generator=g)
    x[3] *= 2.0 ** 60
    x[5] *= 2.0 ** -60
    x[7, :32] *= 2.0 ** 40
    x = x.to(torch.bfloat16)
    index, w = _routing(40, 6, 2, "uneven", g), torch.rand(40, 2, generator=g).to(torch.bfloat16)
    got = grouped(x, index, w)
    assert got.isfinite().all() and torch.equal(got, reference(x, index, w))
    assert got[3].abs().max() > 2.0 ** 40
    x[9, 4] = float("nan")
    got, want = grouped(x, index, w), reference(x, index, w)
    assert got[9].isnan().all() and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.where(got.isnan(), 0, got), torch.where(want.isnan(), 0, want))


@pytest.fixture
def fold_kernels(monkeypatch):
    """lowbit.dispatch hands CPU tensors to the fused fold kernels too (Triton's interpreter)."""
    kernels_on_cpu(monkeypatch)


def test_fp8_grouped_folds_are_observed_under_the_experts_names(fold_kernels):
    # lowbit bench folds names each QuantExperts module; its grouped FP8 GEMMs then report
    # every fold, forward and backward, under "<module>.gate_up_proj" / ".down_proj", and an
    # unnamed module's as "" (what the fold observer is told). The fused fold kernels (here
    # under Triton's interpreter, in a deferred check) count what they leave inexact: a
    # token 2^40 above the rest leaves its row's other blocks out of the fprop fold's window
    from lowbit.dispatch.fold_check import deferred_fold_check, observe_folds
    g = torch.Generator().manual_seed(12)
    base, grouped, _, _ = _fp8_pair("stable-fp4-nosr")
    x = torch.randn(40, 64, generator=g)
    x[7, :32] *= 2.0 ** 40
    x = x.to(torch.bfloat16)
    index, w = _routing(40, 6, 2, "uneven", g), torch.rand(40, 2, generator=g).to(torch.bfloat16)
    for name, layers in (("model.layers.1.mlp.experts", ["model.layers.1.mlp.experts.gate_up_proj",
                                                         "model.layers.1.mlp.experts.down_proj"]),
                         ("", [""])):
        grouped.layer_name = name
        seen = []
        with deferred_fold_check(x.device) as check, observe_folds(
                lambda layer, operand, count: seen.append((layer, operand, count))):
            _run(grouped, base, x, index, w, 0)
        assert sorted({layer for layer, _, _ in seen}) == sorted(layers)
        for layer in layers:   # X and W (W^T beside it) in the forward, dY in the backward: X^T and W^T kept
            ops = [op for lay, op, _ in seen if lay == layer]
            both = 2 if layer == "" else 1                  # unnamed: both projections as ""
            assert ops == ["X", "W"] * both + ["dY"] * both, ops
        counts = {}
        for layer, operand, count in seen:
            counts[(layer, operand)] = counts.get((layer, operand), 0) + int(count)
        assert sum(counts.values()) == check.inexact_values() > 0
        assert counts[(layers[0], "X")] > 0             # the gate_up projection's input


def test_fp8_grouped_experts_on_the_fold_kernels_leave_unwritten_rows_out(fold_kernels,
                                                                           unwritten_rows_are_nan):
    # the fused fold kernels (Triton's interpreter here) fold dY^T over every row of the layout,
    # those past the groups too: whatever the GEMMs leave there (NaN here) must not reach a
    # fold, or every expert's dW takes it
    g = torch.Generator().manual_seed(17)
    base, grouped, reference, _ = _fp8_pair("stable-fp4-nosr")
    x = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    index, w = _routing(40, 6, 2, "dropped slots", g), torch.rand(40, 2, generator=g).to(torch.bfloat16)
    for a, b in zip(_run(grouped, base, x, index, w, 0), _run(reference, base, x, index, w, 0)):
        assert a.isfinite().all() and torch.equal(a, b)


def test_fp8_grouped_wgrad_folds_one_factor_per_row_and_expert(fold_kernels):
    # the fused fold kernels (here under Triton's interpreter) inside a deferred fold check:
    # tokens routed to experts 0-1 are 2^15 times the rest, routed to 2-3, so a row of X^T or
    # dY^T spans ~40 binades over every expert's tokens, but few within one. The grouped
    # wgrad operands take a factor per row and expert, as each expert's own fold does: no
    # value is inexact and the gradients equal the per-expert loop's bit for bit. A NaN in one
    # token's input makes only its experts' dW rows NaN, as in the loop.
    from lowbit.dispatch.fold_check import deferred_fold_check
    g = torch.Generator().manual_seed(13)
    base, grouped, reference, recipe = _fp8_pair("stable-fp4-nosr")
    x = torch.randn(40, 64, generator=g)
    x[:20] *= 2.0 ** 15
    x = x.to(torch.bfloat16)
    index = torch.tensor([[0, 1]] * 20 + [[2, 3]] * 20)
    w = torch.rand(40, 2, generator=g).to(torch.bfloat16)
    results = []
    for module in (grouped, reference):
        with deferred_fold_check(x.device) as check:
            results.append(_run(module, base, x, index, w, 0))
        assert check.inexact_values() == 0
    for a, b in zip(*results):
        assert a.isfinite().all() and torch.equal(a, b)
    x[30, 7] = float("nan")                   # a token of experts 2 and 3
    (_, _, dw_up, dw_down), (_, _, ref_up, ref_down) = [_run(m, base, x, index, w, 0)
                                                        for m in (grouped, reference)]
    for got, want in ((dw_up, ref_up), (dw_down, ref_down)):
        assert torch.equal(got.isnan(), want.isnan()) and got[:2].isfinite().all()
        assert got[2:4].isnan().any()
        assert torch.equal(torch.where(got.isnan(), 0, got), torch.where(want.isnan(), 0, want))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["uneven", "one expert takes every token", "dropped slots"])
def test_fp8_grouped_experts_on_cuda_equal_the_per_expert_loop(case):
    # the grouped FP8 GEMM (torch._scaled_grouped_mm) against each expert's torch._scaled_mm:
    # the same operands, other accumulation orders (and fprop's fast accumulation)
    g = torch.Generator().manual_seed(10)
    base, grouped, reference, recipe = _fp8_pair("stable-fp4-nosr", E=8, C=256, F=128)
    base.cuda()
    x = torch.randn(512, 256, generator=g).to(torch.bfloat16).cuda()
    index = _routing(512, 8, 2, case, g).cuda()
    w = torch.rand(512, 2, generator=g).to(torch.bfloat16).cuda()
    for a, b in zip(_run(grouped, base, x, index, w, 0), _run(reference, base, x, index, w, 0)):
        assert a.isfinite().all()
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 2e-2, rel


@pytest.mark.gpu
@pytest.mark.parametrize("hadamard", [False, True])
def test_nvfp4_grouped_experts_on_cuda_equal_the_per_expert_loop(hadamard, monkeypatch):
    # on the GPU's kernels (the segments' maxima, the quantize kernel under given scales, the
    # rotated wgrad operands) against the loop's per-expert kernels, one fixed draw of the
    # Hadamard signs: the same operands, the grouped GEMMs' other accumulation order
    real = torch.randint
    monkeypatch.setattr(torch, "randint", lambda low, high, size, **kw: (
        torch.tensor([1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 1, 0, 1, 1, 0, 0], device=kw.get("device"))
        if tuple(size) == (16,) else real(low, high, size, **kw)))
    g = torch.Generator().manual_seed(13)
    base, _ = _experts(E=8, C=256, F=128, seed=3)
    with torch.no_grad():
        base.gate_up_proj[2] *= 1e3                      # one expert's weights far larger
    recipe = _nvfp4_rne(hadamard)
    grouped, reference = QuantExperts(base, recipe), QuantPerExpert(base, recipe)
    base.cuda()
    x = torch.randn(512, 256, generator=g)
    index = _routing(512, 8, 2, "uneven", g)
    x[(index == 1).any(dim=1)] *= 1e3
    x, index = x.to(torch.bfloat16).cuda(), index.cuda()
    w = torch.rand(512, 2, generator=g).to(torch.bfloat16).cuda()
    outputs = ("y", "dx", "d gate_up", "d down")
    for name, a, b in zip(outputs, _run(grouped, base, x, index, w, 0), _run(reference, base, x, index, w, 0)):
        assert a.isfinite().all() and b.isfinite().all(), name
        # both divided by the reference's largest magnitude first: the gradients reach ~1e26
        # here (tokens 1e3 times the rest through weights 1e3 times the rest), where a float32
        # sum of squares overflows to inf (and inf / inf is the NaN this once measured)
        top = b.float().abs().max()
        rel = ((a.float() - b.float()) / top).norm() / (b.float() / top).norm()
        assert rel.item() < 2e-2, (name, rel.item())


@pytest.mark.parametrize("gemm", ["emulated", "fp8"])
def test_a_token_whose_slots_are_all_dropped_takes_no_part_whatever_it_holds(gemm):
    # the layout's rows that hold no slot are zeros in and out: a NaN token routed nowhere
    # reaches no other token's output, no dX but its own (zero) and, through a quantization
    # spanning tokens (FP8's wgrad fold factors and NaN rows), no dW
    base, grouped, _, _ = (_fp8_pair if gemm == "fp8" else _quantized_pair)("stable-fp4-nosr")
    g = torch.Generator().manual_seed(11)
    x = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    index, w = _routing(40, 6, 2, "uneven", g), torch.rand(40, 2, generator=g).to(torch.bfloat16)
    index[0] = 6                                   # both of token 0's slots dropped
    clean = x.clone()
    x[0] = float("nan")
    (y, dx, dw_up, dw_down), (y_clean, dx_clean, *dw_clean) = [_run(grouped, base, t, index, w, 0)
                                                             for t in (x, clean)]
    assert torch.equal(y, y_clean) and not y[0].any() and not dx[0].any()
    assert torch.equal(dx, dx_clean)
    for got, want in zip((dw_up, dw_down), dw_clean):
        assert got.isfinite().all() and torch.equal(got, want)


@pytest.mark.parametrize("tile", [1, 32])
def test_expert_rows_put_each_slot_in_its_experts_group_once(tile):
    # the layout both projections run in: each kept slot on one row of its expert's group, in
    # the tokens' order, every group starting at a multiple of the tile; source and slot_row
    # inverse to each other; dropped slots nowhere; P rows fixed by the shapes alone
    g = torch.Generator().manual_seed(15)
    N, E, k = 50, 6, 2
    index = _routing(N, E, k, "dropped slots", g)
    index[10:30, 0] = 2                             # uneven, one expert over a tile
    rows = ExpertRows.route(index, E, tile)
    flat = index.reshape(-1)
    R = N * k
    assert rows.source.shape == ((R,) if tile == 1 else ((R + E * (tile - 1) + 15) // 16 * 16,))
    assert torch.equal(rows.counts, torch.bincount(flat[flat < E], minlength=E))
    ends = rows.ends.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    assert (starts % tile == 0).all() and (ends - starts >= rows.counts).all()
    for s in range(R):
        r = int(rows.slot_row[s])
        if flat[s] == E:
            assert r == -1
            continue
        e = int(flat[s])
        assert starts[e] <= r < starts[e] + rows.counts[e] and rows.source[r] == s
    assert int(rows.filled.sum()) == int((flat < E).sum())
    for e in range(E):                              # the tokens' order within a group
        group = rows.source[int(starts[e]):int(starts[e] + rows.counts[e])]
        assert (group.diff() > 0).all() and (flat[group] == e).all()


def test_gather_rows_gradient_equals_the_scatter_add_it_replaces():
    g = torch.Generator().manual_seed(16)
    N, k, C = 7, 3, 5
    x = torch.randn(N, C, generator=g, requires_grad=True)
    rows = ExpertRows.route(torch.randint(0, 5, (N, k), generator=g), 4, tile=4)   # 4: dropped
    out = gather_rows(x, rows.source, rows.slot_row, copies=k)
    valid = rows.filled[:, None]
    want = torch.where(valid, x.repeat_interleave(k, 0)[rows.source.clamp(min=0)], 0)
    cotangent = torch.randn(out.shape, generator=g)
    got_grad, = torch.autograd.grad(out, x, cotangent)
    want_grad, = torch.autograd.grad(want, x, cotangent)
    assert torch.equal(out, want)
    torch.testing.assert_close(got_grad, want_grad)


def test_fold_inexact_adapt_moves_an_experts_module_off_the_fp8_path(fold_kernels):
    # --fold-inexact adapt names each QuantExperts module; a grouped projection whose exact folds
    # needed K-chunks is reported as "<module>.gate_up_proj" and moves the whole module (one
    # recipe for both projections) to the emulated GEMMs; a checkpoint's module name moves it too
    from torch import nn

    from lowbit.dispatch.fold_check import watch_chunked_folds
    from lowbit.recipes import Gemm
    from lowbit.train.fold_policy import FoldPolicy

    base, grouped, _, recipe = _fp8_pair("stable-fp4-nosr")
    model = nn.Module()
    model.experts = grouped
    policy = FoldPolicy("adapt", model)
    assert grouped.layer_name == "experts"
    g = torch.Generator().manual_seed(14)
    x = torch.randn(40, 64, generator=g)
    x[7, :32] *= 2.0 ** 40                    # a row of X past one factor's window: K-chunks
    x = x.to(torch.bfloat16)
    index, w = _routing(40, 6, 2, "uneven", g), torch.rand(40, 2, generator=g).to(torch.bfloat16)
    with watch_chunked_folds() as chunked:
        grouped(x, index, w)
    assert "experts.gate_up_proj" in chunked
    assert policy.adapt(sorted(chunked)) == ["experts"]
    assert grouped.linear_recipe.gemm is Gemm.EMULATED and policy.emulated_layers == ["experts"]
    again = _fp8_pair("stable-fp4-nosr")[1]
    model.experts = again
    FoldPolicy("adapt", model).restore(["experts"])
    assert again.linear_recipe.gemm is Gemm.EMULATED

