"""Quantized linear layers, recipes and the converter."""

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch
from torch import nn

import lowbit
from lowbit.diagnostics import sqnr_db
from lowbit.formats import QuantSpec
from lowbit.models import ModelConfig, build_model
from lowbit.nn import (QuantExperts, QuantLinear, convert_to_quantized_training, quantization_disabled,
                       reuse_weight_operands)
from lowbit.ops import fake_quantize, gemm_operands, operand, quant_linear, random_hadamard
from lowbit.ops.compiled import op_key
from lowbit.recipes import LinearRecipe, get_recipe, recipe_names


def linear_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 192, generator=g)
    x[:, 5] *= 20  # an outlier channel, as real activations have
    w = torch.randn(128, 192, generator=g) * 0.05
    dy = torch.randn(256, 128, generator=g)
    return x, w, dy


def run_linear(x, w, dy, recipe, bias=None):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    y = quant_linear(x, w, bias, recipe)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def test_quantization_off_is_exactly_nn_linear():
    torch.manual_seed(0)
    ref = nn.Linear(48, 32)
    q = QuantLinear.from_linear(nn.Linear(48, 32), None)
    q.weight.data.copy_(ref.weight.data)
    q.bias.data.copy_(ref.bias.data)
    x = torch.randn(3, 7, 48)
    for module in (ref, q):
        module.zero_grad()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa), q(xb)
    assert torch.equal(ya, yb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(xa.grad, xb.grad) and torch.equal(ref.weight.grad, q.weight.grad)
    assert torch.equal(ref.bias.grad, q.bias.grad)


def test_all_operands_high_precision_through_the_function_matches_f_linear():
    # An explicit recipe whose six operands are None takes the plain F.linear path too,
    # and the autograd.Function on identity operands gives the same GEMMs.
    from lowbit.ops.linear import QuantLinearFunction
    x, w, dy = linear_inputs()
    ident = LinearRecipe()
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = QuantLinearFunction.apply(xa, wa, None, ident)
    y.backward(dy)
    ref = run_linear(x, w, dy, None)
    assert torch.equal(y, ref[0]) and torch.equal(xa.grad, ref[1]) and torch.equal(wa.grad, ref[2])


# measured (tests/test_nn.py inputs, seed 1): out / dX / dW SQNR in dB, minus ~2 dB of margin
SQNR_FLOORS = {
    "mxfp4": (12, 13.5, 13.5), "nvfp4": (15, 13, 14), "stable-fp4": (8.5, 9.5, 7.5),
    "stable-fp4-1d": (12, 11.5, 11.5), "stable-fp4-floor": (9, 11.5, 8.5),
    "stable-fp4-nosr": (8.5, 11.5, 8), "stable-fp4-b16": (10.5, 10.5, 9.5),
    "stable-fp4-qk-fp4": (8.5, 9.5, 7.5), "stable-fp4-dy1d": (8.5, 11.5, 8),
    "stable-fp4-fp8": (8.5, 9.5, 7.5), "stable-fp4-fp8-fast": (8.5, 9.5, 7.5),
    "stable-nvfp4-16x16": (12, 12, 11), "stable-nvfp4-dy1d": (12, 13, 11.5),
    "stable-fp4-dy16": (8.5, 10.5, 8), "stable-fp4-dy8": (8.5, 11, 8.5),
}


def test_the_fast_fp8_recipe_is_stable_fp4_fp8_fast_accumulating_every_gemm():
    fast, base = get_recipe("stable-fp4-fp8-fast"), get_recipe("stable-fp4-fp8")
    assert fast.linear.fast_accum == ("fprop", "dgrad", "wgrad") and base.linear.fast_accum == ("fprop",)
    assert fast.linear == dataclasses.replace(base.linear, fast_accum=fast.linear.fast_accum)
    assert fast.overrides == base.overrides and "every GEMM fast-accumulating" in fast.note


@pytest.mark.parametrize("name", [n for n in recipe_names() if n != "bf16"])
def test_sqnr_floors_per_recipe(name):
    x, w, dy = linear_inputs()
    ref = run_linear(x, w, dy, None)
    torch.manual_seed(1)
    out = run_linear(x, w, dy, get_recipe(name).linear)
    floors = SQNR_FLOORS[name]
    for label, a, b, floor in zip(("out", "dX", "dW"), ref, out, floors):
        assert sqnr_db(a, b) > floor, (name, label, sqnr_db(a, b))
        assert sqnr_db(a, b) < 40, "a recipe that quantizes nothing would pass the floor"


def test_2d_recipes_use_bit_identical_operands_forward_and_backward():
    r = get_recipe("stable-fp4-nosr").linear
    x, w, dy = linear_inputs()
    _, dx, dw = run_linear(x, w, dy, r)
    w_fprop = fake_quantize(w, r.fprop_w)
    x_fprop = fake_quantize(x, r.fprop_x)
    dy_q = fake_quantize(dy, r.dgrad_dy)
    assert torch.equal(dx, dy_q @ w_fprop)        # dgrad used the fprop weight, bit for bit
    assert torch.equal(dw, dy_q.mT @ x_fprop)     # wgrad used the fprop X and the dgrad dY
    ops = gemm_operands(x, w, dy, r)
    assert torch.equal(ops["fprop_w"], ops["dgrad_w"]) and torch.equal(ops["fprop_x"], ops["wgrad_x"])


def test_1d_recipes_use_different_weights_forward_and_backward():
    r = get_recipe("mxfp4").linear
    x, w, dy = linear_inputs()
    ops = gemm_operands(x, w, dy, r)
    assert not torch.equal(ops["fprop_w"], ops["dgrad_w"])
    assert torch.equal(ops["dgrad_w"], operand(w, r.dgrad_w, reduce_dim=0))
    _, dx, _ = run_linear(x, w, dy, r)
    assert torch.equal(dx, ops["dgrad_dy"] @ ops["dgrad_w"])


def test_random_hadamard_cancels_in_the_product():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 40, generator=g), torch.randn(6, 40, generator=g)
    signs = torch.randint(0, 2, (16,), generator=g) * 2 - 1
    ra, rb = random_hadamard(a, signs), random_hadamard(b, signs)
    assert ra.shape == (8, 48)
    torch.testing.assert_close(ra @ rb.mT, a @ b.mT, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ra[:, :40], a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_hadamard_is_the_float32_sum_rounded_once(dtype):
    """In bf16 / fp16 the transform equals the exact (float64) product rounded once to the
    dtype: entries +-1/4 make every product exact, and with magnitudes within 2^+-4 a float32
    sum of 16 of them is exact too. In float32, within float32 accumulation's bound. Inputs are
    a non-contiguous view, as the wgrad operands (dY^T, X^T) are."""
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(37, 12, generator=g) * torch.logspace(-1, 1, 37)[:, None]).to(dtype).mT
    signs = torch.randint(0, 2, (16,), generator=g) * 2 - 1
    got = random_hadamard(t, signs)                                    # (12, 48)
    assert got.dtype == dtype and got.shape == (12, 48)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    exact = (torch.nn.functional.pad(t.double(), (0, 11)).reshape(12, 3, 16)
             @ (h / 4 * signs.double()[:, None])).reshape(12, 48)
    if dtype == torch.float32:
        bound = 16 * 2.0**-24 * (torch.nn.functional.pad(t.double().abs(), (0, 11))
                                 .reshape(12, 3, 16) @ (h.abs() / 4)).reshape(12, 48)
        assert ((got.double() - exact).abs() <= bound).all()
    else:
        assert torch.equal(got, exact.to(dtype))


def test_stochastic_rounding_follows_the_global_seed():
    x, w, dy = linear_inputs()
    r = get_recipe("stable-fp4").linear
    torch.manual_seed(5)
    a = run_linear(x, w, dy, r)
    torch.manual_seed(5)
    b = run_linear(x, w, dy, r)
    torch.manual_seed(6)
    c = run_linear(x, w, dy, r)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[2], c[2])


def test_autocast_bf16_on_cpu():
    x, w, _ = linear_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = quant_linear(x, w, None, get_recipe("stable-fp4").linear)
    assert y.dtype == torch.bfloat16


def test_recipe_validation_and_lookup():
    two_d = QuantSpec.make("mxfp4", (32, 32), "rceil")
    with pytest.raises(ValueError, match="must use 1D blocks"):
        LinearRecipe(wgrad_x=two_d, wgrad_hadamard=True)
    with pytest.raises(ValueError, match="unknown recipe 'fp2'; known recipes: bf16"):
        get_recipe("fp2")
    r = get_recipe("stable-fp4")
    assert r.linear_for("model.layers.3.self_attn.q_proj").fprop_w.format == "mxfp8_e4m3"
    assert r.linear_for("model.layers.3.self_attn.v_proj").fprop_w.format == "mxfp4"
    nv = get_recipe("nvfp4")
    assert nv.linear_for("model.layers.0.mlp.up_proj", n_blocks=4) is None
    assert nv.linear_for("model.layers.3.mlp.up_proj", n_blocks=4) is None
    assert nv.linear_for("model.layers.2.mlp.up_proj", n_blocks=4) is not None
    # "no recipe" is one test, Recipe.quantizes: bf16's, and any recipe with no linear
    from lowbit.recipes import Recipe, quantizes
    from lowbit.train.build import resolve_recipe
    assert not quantizes("bf16") and quantizes("stable-fp4") and quantizes(nv)
    assert not quantizes(Recipe("plain", None)) and resolve_recipe("bf16") is None
    assert resolve_recipe("nvfp4").name == "nvfp4"
    with pytest.raises(ValueError, match="unknown recipe 'fp2'"):
        quantizes("fp2")
    report = lowbit.quantize_(tiny_model(), Recipe("plain", None))
    assert report.swapped == [] and report.warning == ""   # nothing asked, nothing to warn of


def tiny_model(n_experts=0):
    cfg = ModelConfig(vocab_size=128, dim=64, n_layers=3, n_heads=4, max_seq_len=32,
                      n_experts=n_experts, experts_per_token=2)
    torch.manual_seed(0)
    return build_model(cfg)


@pytest.mark.parametrize("recipe", ["mxfp4", "nvfp4", "stable-fp4"])
@pytest.mark.parametrize("n_experts", [0, 4])
def test_every_parameter_gets_a_gradient(recipe, n_experts):
    model = tiny_model(n_experts)
    report = convert_to_quantized_training(model, recipe)
    assert report.swapped
    idx = torch.randint(0, 128, (8, 32))
    out = model(idx, idx)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("recipe,fused,grouped", [("nvfp4", False, False), ("nvfp4", True, False),
                                                  ("asymmetric", True, False), ("asymmetric", True, True),
                                                  ("stable-fp4", False, True)])
def test_reused_weight_operands_give_the_same_steps_and_follow_each_update(recipe, fused, grouped):
    # two micro-batches, a no-grad pass and two optimizer steps with the cache and without:
    # the same losses, gradients and weights; each weight quantized once per update
    import copy

    from lowbit.rl.trainer_side import asymmetric_qat_recipe
    base = tiny_model(4)
    convert_to_quantized_training(base, asymmetric_qat_recipe() if recipe == "asymmetric" else recipe)
    idx = torch.randint(0, 128, (3, 4, 32), generator=torch.Generator().manual_seed(1))
    # grouped: bf16 autocast, where the experts run on one grouped GEMM (lowbit.ops.grouped)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=grouped)
    results = []
    for reuse in (False, True):
        model = copy.deepcopy(base)
        # a fused AdamW moves no version counter: the optimizer's hook clears the cache
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        losses, seen = [], []
        torch.manual_seed(5)   # stable-fp4's stochastic rounding: the same draws in both
        with reuse_weight_operands(model, opt) if reuse else contextlib.nullcontext() as cache:
            for _ in range(2):
                with torch.no_grad(), autocast:
                    losses.append(model(idx[0], idx[0]).loss)
                for b in (1, 2):
                    with autocast:
                        loss = model(idx[b], idx[b]).loss
                    loss.backward()
                    losses.append(loss.detach())
                if cache is not None:
                    seen.append({k: v[1] for k, v in cache.entries.items()})
                opt.step()
                opt.zero_grad()
        results.append((torch.stack(losses), [p.detach().clone() for p in model.parameters()]))
        if reuse:
            assert all(m.weight_cache is None for m in model.modules() if hasattr(m, "weight_cache"))
            assert not cache.entries
            if recipe == "stable-fp4":   # its forward weight rounds to nearest, reused
                assert seen[0]
            # one entry a weight (experts: one an expert), each a new tensor after the update
            weights = sum(1 if isinstance(m, QuantLinear) else 2 if grouped else 2 * m.num_experts
                          for m in model.modules() if isinstance(m, (QuantLinear, QuantExperts)))
            assert len(seen[0]) == weights and seen[0].keys() == seen[1].keys()
            assert all(seen[0][k] is not seen[1][k] for k in seen[0])
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_reused_weight_operands_refuse_sharded_parameters():
    # FSDP2's gathered weights reuse freed memory, which the cache's keys cannot tell apart
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        layer = QuantLinear.from_linear(nn.Linear(8, 8), get_recipe("nvfp4").linear)
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.data, init_device_mesh("cpu", (1,)),
                                                      [Replicate()]))
        with pytest.raises(ValueError, match="FSDP-sharded"):
            with reuse_weight_operands(layer, torch.optim.SGD(layer.parameters(), lr=0.1)):
                pass
        assert layer.weight_cache is None
    finally:
        dist.destroy_process_group()


def test_convert_reports_and_disabling_restores_the_model():
    model = tiny_model(4)
    idx = torch.randint(0, 128, (2, 32))
    before = model(idx).logits
    report = convert_to_quantized_training(model, "stable-fp4")
    swapped = {n for n, _, _ in report.swapped}
    kept = {n: why for n, _, why in report.kept}
    assert "model.layers.1.mlp.experts" in swapped and "model.layers.0.self_attn.q_proj" in swapped
    assert "lm_head" in kept and "model.embed_tokens" in kept and "model.layers.0.mlp.gate" in kept
    assert "model.norm" in kept
    assert isinstance(model.model.layers[1].mlp.experts, QuantExperts)
    assert "quantized" in str(report) and "kept" in str(report)
    with quantization_disabled(model):
        assert torch.equal(model(idx).logits, before)
    assert not torch.equal(model(idx).logits, before)
    with pytest.raises(ValueError, match="already converted"):
        convert_to_quantized_training(model, "stable-fp4")


def test_convert_with_a_filter_and_bf16():
    model = tiny_model()
    report = convert_to_quantized_training(model, "mxfp4", module_filter_fn=lambda m, name: "mlp" in name)
    assert all("mlp" in n for n, _, _ in report.swapped)
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)
    assert not isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    model = tiny_model()
    report = convert_to_quantized_training(model, "bf16")
    assert not report.swapped


def hf_models():
    pytest.importorskip("transformers")
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    yield "llama", LlamaForCausalLM(LlamaConfig(**common)), 0
    yield "qwen3", Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16)), 0
    yield "qwen3-moe", Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, head_dim=16, num_experts=4,
                                                            num_experts_per_tok=2,
                                                            moe_intermediate_size=32,
                                                            decoder_sparse_step=1)), 2


@pytest.mark.parametrize("recipe", ["stable-fp4", "nvfp4"])
def test_hugging_face_models_convert_including_experts(recipe):
    for name, model, n_expert_modules in hf_models():
        torch.manual_seed(0)
        idx = torch.randint(0, 128, (2, 16))
        before = model(idx).logits.detach()
        report = convert_to_quantized_training(model, recipe)
        kinds = [k for _, k, _ in report.swapped]
        per_layer = 4 + (0 if n_expert_modules else 3)
        n_quantized_layers = 2 if recipe == "stable-fp4" else 0   # nvfp4 keeps first/last block
        assert kinds.count("linear") == per_layer * n_quantized_layers, (name, report)
        if n_expert_modules and recipe == "stable-fp4":
            assert kinds.count("experts") == n_expert_modules
            assert isinstance(model.model.layers[0].mlp.experts, QuantExperts)
            assert "model.layers.0.mlp.gate" in {n for n, _, _ in report.kept}
        assert "lm_head" in {n for n, _, _ in report.kept}
        with quantization_disabled(model):
            torch.testing.assert_close(model(idx).logits, before, rtol=1e-5, atol=1e-5)
        out = model(idx, labels=idx)
        out.loss.backward()
        assert torch.isfinite(out.loss)
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, (name, missing)


@pytest.mark.parametrize("name", ["stable-fp4", "mxfp4", "stable-fp4-nosr"])
def test_fp8_tensor_core_gemms_multiply_the_same_fp4_operands(name, monkeypatch):
    """gemm='fp8' folds the MXFP4 operands into FP8 + power-of-two factors; on the CPU the
    folded GEMM is emulated in FP32, so it must match the dequantize + GEMM path."""
    from dataclasses import replace

    import lowbit.ops.gemms as gemms
    calls = []
    real = gemms.fp4_gemm_fp8
    monkeypatch.setattr(gemms, "fp4_gemm_fp8", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w, dy = linear_inputs()
    emulated = get_recipe(name).linear
    torch.manual_seed(3)
    ref = run_linear(x, w, dy, emulated)
    torch.manual_seed(3)
    out = run_linear(x, w, dy, replace(emulated, gemm="fp8"))
    assert len(calls) == 3  # fprop, dgrad, wgrad
    for a, b in zip(ref, out):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_fp8_gemm_needs_mxfp4_operands():
    nv = get_recipe("nvfp4").linear
    from dataclasses import replace
    with pytest.raises(ValueError, match="every operand must be MXFP4"):
        replace(nv, wgrad_hadamard=False, gemm="fp8")
    with pytest.raises(ValueError, match="unknown gemm 'int8'; use one of 'emulated', 'fp8'"):
        replace(get_recipe("mxfp4").linear, gemm="int8")


def test_fast_accumulation_is_chosen_per_fp8_gemm(monkeypatch):
    """fast_accum names the FP8 GEMMs that fast-accumulate: validated, kept in GEMM order, part
    of the recipe's op key, refused on emulated GEMMs; each GEMM passes its own flag to
    fp4_gemm_fp8 (the CPU's emulation ignores it: the values equal the promoting recipe's).
    stable-fp4-fp8 fast-accumulates in fprop only, as Transformer Engine does."""
    from dataclasses import replace

    import lowbit.ops.gemms as gemms

    fp8 = replace(get_recipe("stable-fp4").linear, gemm="fp8")
    with pytest.raises(ValueError, match="fast_accum names GEMMs, 'fprop', 'dgrad', 'wgrad'; "
                                         "got 'forward'"):
        replace(fp8, fast_accum=("forward",))
    with pytest.raises(ValueError, match="needs gemm='fp8'"):
        replace(get_recipe("stable-fp4").linear, fast_accum=("fprop",))
    both = replace(fp8, fast_accum=("wgrad", "fprop"))
    assert both.fast_accum == ("fprop", "wgrad")
    assert replace(fp8, fast_accum="dgrad").fast_accum == ("dgrad",)
    assert op_key(both) != op_key(fp8) and "fast accumulation: fprop, wgrad" in both.describe()
    s8 = get_recipe("stable-fp4-fp8")
    assert s8.linear.fast_accum == ("fprop",)
    assert s8.linear_for("model.layers.0.self_attn.v_proj").gemm.value == "emulated"

    flags = []
    real = gemms.fp4_gemm_fp8
    monkeypatch.setattr(gemms, "fp4_gemm_fp8",
                        lambda *a, use_fast_accum=False, **k: flags.append(use_fast_accum)
                        or real(*a, use_fast_accum=use_fast_accum, **k))
    x, w, dy = linear_inputs()
    torch.manual_seed(3)
    plain = run_linear(x, w, dy, fp8)
    assert flags == [False, False, False]
    flags.clear()
    torch.manual_seed(3)
    fast = run_linear(x, w, dy, both)
    assert flags == [True, False, True]                   # fprop, dgrad, wgrad
    for a, b in zip(plain, fast):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["stable-fp4", "stable-fp4-fp8", "nvfp4", "mxfp4"])
def test_the_compiled_ops_pass_torch_library_opcheck(recipe):
    """lowbit::quant_linear and its backward as torch.library checks custom ops: the fake
    (meta) outputs match the real ones in shape, dtype and strides, and the autograd formula
    gives eager's gradients under AOTAutograd (checked with round-to-nearest gradients and no
    Hadamard transform, since opcheck runs the op several times and random draws differ each
    time). N = 40 is not a multiple of 16."""
    from dataclasses import replace

    from lowbit.formats.spec import Rounding

    lin = get_recipe(recipe).linear
    nearest = replace(lin, dgrad_dy=replace(lin.dgrad_dy, rounding=Rounding.RNE),
                      wgrad_dy=replace(lin.wgrad_dy, rounding=Rounding.RNE),
                      wgrad_hadamard=False)   # nvfp4's random signs: drawn anew too
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g, requires_grad=True)
    w = torch.randn(40, 96, generator=g, requires_grad=True)
    dy = torch.randn(64, 40, generator=g)
    for r in (lin, nearest):
        torch.library.opcheck(torch.ops.lowbit.quant_linear.default,
                              (x, w, op_key(r), True, True),
                              test_utils=("test_schema", "test_faketensor"))
        torch.library.opcheck(torch.ops.lowbit.quant_linear_backward.default,
                              (dy, x.detach(), w.detach(), op_key(r), False, False, True, True),
                              test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.lowbit.quant_linear.default,
                          (x, w, op_key(nearest), True, True),
                          test_utils=("test_aot_dispatch_dynamic",))


@pytest.mark.parametrize("recipe", ["stable-fp4", "nvfp4"])
def test_the_compiled_emulated_linear_quantizes_shared_operands_once(monkeypatch, recipe,
                                                                     compiled_quant_linear):
    """Compiled, an emulated layer's forward op returns the quantized X and W where square
    tiles let the backward reuse them (stable-fp4: both; nvfp4: W's 16x16 tiles), as the eager
    Function saves them: the backward quantizes only dY (and nvfp4's 1D X along tokens), and
    the output and gradients are the eager layer's bit for bit."""
    import lowbit.ops.gemms as gemms
    from lowbit.ops import quant_linear

    lin = get_recipe(recipe).linear
    g = torch.Generator().manual_seed(3)
    x, w, dy = (torch.randn(*shape, generator=g) for shape in ((64, 96), (48, 96), (64, 48)))

    def run(fn):
        torch.manual_seed(7)
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi, None, lin, "l")
        y.backward(dy)
        return y.detach(), xi.grad, wi.grad

    eager = run(quant_linear)
    quantized = []
    real = gemms.operand
    monkeypatch.setattr(gemms, "operand", lambda t, spec, reduce_dim: (
        quantized.append((tuple(t.shape), reduce_dim)) or real(t, spec, reduce_dim)))
    compiled = run(compiled_quant_linear)
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
    assert [q for q in quantized if q[0] == (48, 96)] == [((48, 96), 1)]   # W: forward only
    # X: forward only (nvfp4's wgrad X is rotated along tokens first: a (96, 64) operand)
    assert [q for q in quantized if q[0] == (64, 96)] == [((64, 96), 1)]


@pytest.mark.parametrize("recipe", ["stable-fp4", "stable-fp4-fp8"])
@pytest.mark.parametrize("needs", ["x", "weight", "both"])
def test_the_compiled_linear_equals_eager_when_only_one_input_needs_a_gradient(
        recipe, needs, compiled_quant_linear):
    """A frozen weight (or an input that needs no gradient): the compiled ops keep and save
    only what the one backward GEMM needs, and give eager's output and gradient bit for bit.
    The emulated backward op also takes the inputs themselves where the forward kept nothing
    (a direct call), quantizing them as the forward would have."""
    from lowbit.ops import quant_linear

    lin = get_recipe(recipe).linear
    g = torch.Generator().manual_seed(3)
    x, w, dy = (torch.randn(*shape, generator=g) for shape in ((64, 96), (48, 96), (64, 48)))

    def run(fn):
        torch.manual_seed(7)
        xi = x.clone().requires_grad_(needs in ("x", "both"))
        wi = w.clone().requires_grad_(needs in ("weight", "both"))
        y = fn(xi, wi, None, lin, "l")
        y.backward(dy)
        return y.detach(), xi.grad, wi.grad

    eager = run(quant_linear)
    compiled = run(compiled_quant_linear)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(compiled, eager))
    if recipe == "stable-fp4":
        _, x_f, w_f = torch.ops.lowbit.quant_linear(x, w, op_key(lin), True, True)
        grads = []
        for a, b, kept in ((x, w, False), (x_f, w_f, True)):
            torch.manual_seed(7)   # dY rounds stochastically: the same draws
            grads.append(torch.ops.lowbit.quant_linear_backward(dy, a, b, op_key(lin), kept,
                                                                kept, True, True))
        assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("needs", ["x", "weight", "both"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_a_compiled_weight_only_linear_traces_its_gemms_on_the_weight_it_is_handed(
        monkeypatch, needs, autocast, compiled_quant_linear):
    """A weight-only recipe (QUADS' asymmetric QAT: NVFP4 W in the forward, all else high
    precision) handed its quantized W compiles to its three GEMMs traced, no op at all (the
    op pair's emulated GEMMs never run, nothing is quantized): the output and the gradients
    (dX through W itself, dW, db) are eager's bit for bit under AOTAutograd's eager backend,
    under bf16 autocast too, with a bias and odd sizes (45 rows of 100). (Inductor may sum db
    in another order: float rounding.) Without the weight it compiles to the op pair, as other
    recipes."""
    import lowbit.ops.compiled as compiled_ops
    import lowbit.ops.gemms as gemms
    from lowbit.rl.trainer_side import asymmetric_qat_recipe

    lin = asymmetric_qat_recipe().linear
    assert lin.weight_only and not get_recipe("nvfp4").linear.weight_only
    assert not get_recipe("stable-fp4-fp8").linear.weight_only
    g = torch.Generator().manual_seed(3)
    x, w, b, dy = (torch.randn(*shape, generator=g) for shape in ((45, 100), (24, 100), (24,), (45, 24)))
    dtype = torch.bfloat16 if autocast else torch.float32
    w_f = operand(w.to(dtype), lin.fprop_w, reduce_dim=1)

    def run(fn, handed):
        xi = x.clone().requires_grad_(needs in ("x", "both"))
        wi = w.clone().requires_grad_(needs in ("weight", "both"))
        bi = b.clone().requires_grad_(needs in ("weight", "both"))
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            y = fn(xi, wi, bi, lin, "l", None, handed)
        y.backward(dy.to(y.dtype))
        return y.detach(), xi.grad, wi.grad, bi.grad

    eager = run(quant_linear, None)
    assert eager[0].dtype == dtype
    assert all(torch.equal(a, c) for a, c in zip(run(quant_linear, w_f), eager) if a is not None)
    pair, quantized = [], []
    monkeypatch.setattr(compiled_ops, "emulated_forward", lambda *a, **k: pair.append("forward"))
    monkeypatch.setattr(compiled_ops, "emulated_backward", lambda *a, **k: pair.append("backward"))
    monkeypatch.setattr(gemms, "operand", lambda *a, **k: quantized.append(a))
    compiled = run(compiled_quant_linear, w_f)
    assert pair == [] and quantized == []
    assert all((a is None and c is None) or (a.dtype == c.dtype and torch.equal(a, c))
               for a, c in zip(compiled, eager))
    monkeypatch.undo()
    torch._dynamo.reset()
    pair = []
    monkeypatch.setattr(compiled_ops, "emulated_forward",
                        lambda *a, **k: pair.append("forward") or gemms.emulated_forward(*a, **k))
    run(compiled_quant_linear, None)
    assert pair == ["forward"]


def test_reused_weight_operands_reach_compiled_layers_once_a_step():
    """A model whose decoder layers are compiled (as lowbit rl --compile), trained under
    reuse_weight_operands with asymmetric QAT: each weight is quantized once an update (by the
    model's forward hook, outside the compiled layers), the second update compiles nothing new,
    and the losses, gradients and updated weights are the eager model's bit for
    bit (two updates of two micro-batches and a no-grad pass, bf16 autocast). A layer called
    on its own after its weight changed in place quantizes the new weight."""
    import copy

    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    import lowbit.ops.compiled as compiled_ops
    import lowbit.ops.gemms as gemms
    from lowbit.rl.trainer_side import apply_asymmetric_qat

    base = tiny_model()
    apply_asymmetric_qat(base)
    idx = torch.randint(0, 128, (3, 4, 32), generator=torch.Generator().manual_seed(1))
    results, counter = [], CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    for compiled in (False, True):
        model = copy.deepcopy(base)
        if compiled:
            for layer in model.model.layers:
                layer.compile(backend=counter, dynamic=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, grads, taken, frames = [], [], [], []
        real, pair = gemms.operand, compiled_ops.emulated_forward
        with mock.patch.object(gemms, "operand",
                               lambda t, *a, **k: taken.append(tuple(t.shape)) or real(t, *a, **k)), \
                mock.patch.object(compiled_ops, "emulated_forward",
                                  lambda *a, **k: taken.append("op pair") or pair(*a, **k)):
            with reuse_weight_operands(model, opt):
                for _ in range(2):
                    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
                        losses.append(model(idx[0], idx[0]).loss)
                    for b in (1, 2):
                        with torch.autocast("cpu", torch.bfloat16):
                            loss = model(idx[b], idx[b]).loss
                        loss.backward()
                        losses.append(loss.detach())
                    grads += [p.grad.clone() for p in model.parameters() if p.grad is not None]
                    opt.step()
                    opt.zero_grad()
                    frames.append(counter.frame_count)
        linears = [m for m in model.modules() if isinstance(m, QuantLinear) and m.linear_recipe]
        assert len(taken) == 2 * len(linears) and "op pair" not in taken   # each weight once an update
        assert all(m.weight_operand is None for m in linears)
        results.append((torch.stack(losses), grads, [p.detach().clone() for p in model.parameters()]))
    assert frames[0] > 0 and frames[1] == frames[0]   # new weights and operands: no new graph
    for a, b in zip(results[0], results[1]):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    torch._dynamo.reset()
    # eagerly, an operand taken before an in-place change of its weight is not used
    layer = linears[0]
    with reuse_weight_operands(model, opt):
        with torch.no_grad():
            model(idx[0], idx[0])
            layer.weight.mul_(2)
        x = torch.randn(3, layer.in_features)
        fresh = quant_linear(x, layer.weight, layer.bias, layer.linear_recipe)
        assert layer.weight_operand is not None and torch.equal(layer(x), fresh)


def test_reused_weight_operands_leave_copies_and_loads_alone():
    """The operand hook serves the model it was put on: a deepcopy made inside the block (an
    old-policy snapshot, say) carries an inert one and none of the layers' operands, and its
    forwards leave the original's layers alone inside the block and after it; the model
    pickles inside the block; load_state_dict drops the layers' operands (a compiled layer
    could not tell its weight changed)."""
    import copy
    import io

    from lowbit.rl.trainer_side import apply_asymmetric_qat

    model = tiny_model()
    apply_asymmetric_qat(model)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear) and m.linear_recipe]
    idx = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with reuse_weight_operands(model, opt):
        model(idx, idx)
        assert all(m.weight_operand is not None for m in linears)
        snapshot = copy.deepcopy(model)
        torch.save(model, io.BytesIO())
        model.load_state_dict(model.state_dict())
        assert all(m.weight_operand is None for m in linears)
        snapshot(idx, idx)
        assert all(m.weight_operand is None for m in linears)
        model(idx, idx)
    snapshot(idx, idx)
    assert all(m.weight_operand is None for m in linears)
    assert all(m.weight_operand is None for m in snapshot.modules() if isinstance(m, QuantLinear))


def _converted_tiny_model(recipe):
    """A fresh tiny model converted to `recipe` (dynamo's caches reset), and
    loss_and_grads(forward) -> (loss, [gradients]) of one step on a fixed batch, seeded."""
    import torch._dynamo

    torch._dynamo.reset()
    model = tiny_model(0)
    convert_to_quantized_training(model, recipe)
    idx = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))

    def loss_and_grads(forward):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        loss = forward(idx, idx).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    return model, loss_and_grads


def test_inductor_compiles_an_fp8_recipe_model_to_eager_loss_and_gradients():
    """torch.compile's default backend (inductor, CPU) on a stable-fp4-fp8 model: the custom
    ops, with the FP8 forward's kept transposes (CPU bounds among its outputs), compile and
    run; the loss and the gradients are eager's within 1e-6 and 1e-5 (inductor fuses the norms,
    the softmax and the residual adds, whose fp32 arithmetic then rounds in another order; the
    quantized layers themselves are bitwise eager's: the test above)."""
    model, loss_and_grads = _converted_tiny_model("stable-fp4-fp8")
    eager = loss_and_grads(model)
    compiled = loss_and_grads(torch.compile(model))
    assert abs(compiled[0] - eager[0]) <= 1e-6 * eager[0]
    for a, b in zip(compiled[1], eager[1]):
        assert (a - b).norm() <= 1e-5 * b.norm()


def test_a_linear_recipe_names_itself_to_the_ops_by_a_key_that_survives_copies():
    """The custom ops take the recipe's op_key (a string); equal recipes share one, and a
    pickled or deep-copied recipe gets this process's key for its value."""
    import copy
    import pickle
    from dataclasses import replace

    from lowbit.formats.spec import Rounding
    from lowbit.ops.compiled import recipe_for_op_key

    lin = get_recipe("stable-fp4").linear
    same = replace(lin)
    other = replace(lin, dgrad_dy=replace(lin.dgrad_dy, rounding=Rounding.RNE))
    assert op_key(same) == op_key(lin) and op_key(other) != op_key(lin)
    assert recipe_for_op_key(op_key(other)) == other
    for copied in (pickle.loads(pickle.dumps(other)), copy.deepcopy(other)):
        assert copied == other and recipe_for_op_key(op_key(copied)) == other


def test_stable_fp4_fp8_keeps_v_proj_and_the_mxfp8_qk_emulated():
    """stable-fp4-fp8 multiplies on FP8 tensor cores everywhere but v_proj (whose dV spans too
    many binades along tokens for one fold window) and the MXFP8 q/k projections; every layer
    quantizes exactly as stable-fp4 does."""

    from lowbit.recipes import Gemm

    fp8, plain = tiny_model(0), tiny_model(0)
    convert_to_quantized_training(fp8, "stable-fp4-fp8")
    convert_to_quantized_training(plain, "stable-fp4")
    layers = {n: m.linear_recipe for n, m in fp8.named_modules() if isinstance(m, QuantLinear)}
    emulated = sorted(n.rsplit(".", 1)[1] for n, r in layers.items()
                      if r is not None and r.gemm is Gemm.EMULATED)
    assert set(emulated) == {"q_proj", "k_proj", "v_proj"}
    assert any(r is not None and r.gemm is Gemm.FP8 for r in layers.values())
    for name, module in plain.named_modules():
        if isinstance(module, QuantLinear) and module.linear_recipe is not None:
            assert layers[name].with_gemm(Gemm.EMULATED) == module.linear_recipe, name


def test_stable_fp4_fp8_trains_a_moe_model():
    model = tiny_model(4)
    report = convert_to_quantized_training(model, "stable-fp4-fp8")
    assert any("FP8 tensor cores" in what for _, _, what in report.swapped)
    idx = torch.randint(0, 128, (4, 32))
    out = model(idx, idx)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def _sr_forward_recipe():
    """stable-fp4 with stochastic rounding on X in the forward: not compilable as custom ops
    (the backward could not requantize X to the same values)."""
    from dataclasses import replace

    from lowbit.formats.spec import Rounding
    from lowbit.recipes import Recipe

    base = get_recipe("stable-fp4")
    lin = replace(base.linear, fprop_x=replace(base.linear.fprop_x, rounding=Rounding.STOCHASTIC),
                  wgrad_x=replace(base.linear.wgrad_x, rounding=Rounding.STOCHASTIC))
    return Recipe("stable-fp4-sr-x", lin, base.overrides)


@pytest.mark.parametrize("recipe", ["stable-fp4", "stable-fp4-fp8", "nvfp4", "sr-forward"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_traces_quantized_layers_as_custom_ops(recipe, backend):
    """Under torch.compile the quantized layers are custom ops (lowbit.ops.compiled): the model
    compiles as one graph with no break, and the loss and the gradients are the eager model's,
    bit for bit (dynamo alone, and with AOTAutograd's compiled backward; the same seeds for
    stochastic rounding). A recipe whose forward rounds stochastically keeps its quantized
    layers eager, as graph breaks, with the same result."""
    import torch._dynamo

    model, loss_and_grads = _converted_tiny_model(
        _sr_forward_recipe() if recipe == "sr-forward" else recipe)
    eager = loss_and_grads(model)
    breaks = torch._dynamo.utils.counters["graph_break"]
    breaks.clear()
    compiled = loss_and_grads(torch.compile(model, backend=backend))
    assert torch.equal(compiled[0], eager[0])
    if recipe == "sr-forward":
        assert sum(breaks.values()) > 0      # the quantized layers ran eagerly
        if backend == "aot_eager":
            # each region between two breaks gets its own compiled backward, which sums the
            # residual stream's gradients in another order: norms and embeddings move ~1e-7
            for a, b in zip(compiled[1], eager[1]):
                assert (a - b).norm() <= 1e-6 * a.norm()
            return
    else:
        assert dict(breaks) == {}
    assert all(torch.equal(a, b) for a, b in zip(compiled[1], eager[1]))


def test_quantize_takes_a_recipe_name_a_recipe_or_a_qat_config_and_convert_is_deprecated():
    """lowbit.quantize_(model, config) in torchao's shape: a recipe's name and its config object
    swap the same modules; a QATConfig fake-quantizes the weights (lowbit.qat.prepare); the old
    lowbit.convert still works and says it is deprecated."""
    from lowbit.qat import QATConfig
    from lowbit.recipes import stable_fp4

    def swapped(config, **kwargs):
        torch.manual_seed(0)
        model = build_model(ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=2,
                                        max_seq_len=16))
        return model, lowbit.quantize_(model, config, **kwargs)

    by_name, report = swapped("stable-fp4")
    by_object, report_object = swapped(stable_fp4())
    assert report.swapped == report_object.swapped and report.swapped
    x = torch.randint(0, 64, (2, 16))
    torch.manual_seed(1)
    a = by_name(x).logits
    torch.manual_seed(1)
    assert torch.equal(a, by_object(x).logits)
    _, only_mlp = swapped("stable-fp4", filter_fn=lambda m, name: "mlp" in name)
    assert only_mlp.swapped and all("mlp" in name for name, _, _ in only_mlp.swapped)

    prepared, qat_report = swapped(QATConfig(weights="int2:g32", estimator="ste"))
    assert qat_report.prepared and not any(isinstance(m, QuantLinear) for m in prepared.modules())
    with pytest.raises(TypeError, match="takes a recipe"):
        lowbit.quantize_(prepared, 4)
    with pytest.warns(DeprecationWarning, match="lowbit.quantize_"):
        lowbit.convert(swapped("bf16")[0], "stable-fp4")
