"""The 2D-tile variants of stable-fp4 (stable-nvfp4-16x16, stable-nvfp4-dy1d, stable-fp4-dy16,
stable-fp4-dy8): their tiles are transposition invariant bit for bit (quantizing the transpose
gives the transpose of the quantized), NVFP4 tile scales are the E4M3 code of an independent
computation, and each layer uses one quantized copy of an operand for both of its GEMMs (under
stochastic rounding too: the same draw)."""

from __future__ import annotations

import pytest
import torch

from lowbit.formats import QuantSpec, quantize_dequantize, quantize_with_spec
from lowbit.kernels import quantize_triton_with_transpose
from lowbit.kernels.checks import adversarial, assert_bits_equal, assert_same_qtensor
from lowbit.ops.gemms import emulated_backward, emulated_forward, gemm_operands, operand
from lowbit.recipes import get_recipe

VARIANTS = ("stable-nvfp4-16x16", "stable-nvfp4-dy1d", "stable-fp4-dy16", "stable-fp4-dy8")


def tile_specs() -> list[QuantSpec]:
    """Every 2D spec the variants use (the default linear's and the q/k override's), in RNE."""
    specs = []
    for name in VARIANTS:
        recipe = get_recipe(name)
        for linear in (recipe.linear, *(o for _, o in recipe.overrides)):
            for s in (linear.fprop_x, linear.fprop_w, linear.dgrad_dy):
                rne = QuantSpec.make(s.format, s.block, s.scale_rule, "rne", s.tensor_scale)
                if s.is_2d and rne not in specs:
                    specs.append(rne)
    return specs


def nonfinite_tiles(t: torch.Tensor, b: int) -> torch.Tensor:
    """True on every element of a b x b tile (from the top left) that holds a NaN or an Inf."""
    rows, cols = t.shape[-2:]
    bad = (~torch.isfinite(t)).float().reshape(-1, 1, rows, cols)
    pooled = torch.nn.functional.max_pool2d(bad, b, b, ceil_mode=True)
    spread_out = pooled.repeat_interleave(b, -2).repeat_interleave(b, -1)[..., :rows, :cols]
    return spread_out.reshape(t.shape) > 0


def spec_id(spec):
    return f"{spec.format}-{spec.block[0]}x{spec.block[1]}"


def test_the_variants_tile_what_they_say():
    specs = tile_specs()
    assert QuantSpec.make("nvfp4", (16, 16), tensor_scale=True) in specs
    assert QuantSpec.make("mxfp4", (8, 8), "rceil") in specs
    assert QuantSpec.make("mxfp4", (16, 16), "rceil") in specs
    r = get_recipe("stable-nvfp4-16x16").linear
    assert {r.fprop_x.block, r.fprop_w.block, r.dgrad_dy.block} == {(16, 16)}
    assert r.fprop_w.tensor_scale and r.dgrad_dy.rounding.value == "stochastic"
    r = get_recipe("stable-fp4-dy8").linear
    assert (r.fprop_x.block, r.dgrad_dy.block, r.wgrad_dy.block) == ((32, 32), (8, 8), (8, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("spec", tile_specs(), ids=spec_id)
def test_quantizing_the_transpose_is_the_transpose_of_the_quantized(spec, dtype):
    # ties, zeros, huge, tiny and subnormal tiles, NaN/Inf, and a shape that no tile divides
    x = adversarial(64, 96, spec, seed=3)
    x[5, 7] = float("nan")
    odd = torch.randn(2, 37, 50) * torch.logspace(-8, 8, 50)
    odd[0, :16, :16] = 0.0
    for t in (x, odd, x[:, ::2]):                       # the last one is not contiguous
        if dtype is torch.float16:
            t = t.clamp(-6e4, 6e4)                       # finite in float16 (NaN stays NaN)
        t = t.to(dtype)
        q, q_of_t = quantize_with_spec(t, spec), quantize_with_spec(t.mT, spec)
        assert_same_qtensor(q.t(), q_of_t)
        assert_bits_equal(quantize_dequantize(t.mT, spec), quantize_dequantize(t, spec).mT)
        # NaN exactly on the tiles that hold a NaN or an Inf
        assert torch.equal(torch.isnan(quantize_dequantize(t, spec)), nonfinite_tiles(t, spec.block[0]))


def test_nvfp4_tile_scales_are_e4m3_of_the_tile_max_over_six_under_the_tensor_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 40, generator=g) * torch.exp2(torch.randint(-10, 10, (48, 40), generator=g))
    spec = QuantSpec.make("nvfp4", (16, 16), tensor_scale=True)
    q = quantize_with_spec(x, spec)
    s_t = x.abs().max() / (448 * 6)
    padded = torch.nn.functional.pad(x, (0, 8))                                    # 48 x 48
    tile_max = padded.reshape(3, 16, 3, 16).abs().amax(dim=(1, 3))
    expected = (tile_max / 6 / s_t).clamp(2**-6, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.tensor_scale, s_t)
    assert torch.equal(q.scales.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("name", VARIANTS)
def test_one_quantized_copy_serves_an_operand_and_its_transpose(name):
    r = get_recipe(name).linear
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 48, generator=g), torch.randn(40, 48, generator=g) * 0.1
    dy = torch.randn(64, 40, generator=g) * torch.logspace(-4, 0, 64)[:, None]  # tokens differ
    ops = gemm_operands(x, w, dy, r)
    assert torch.equal(ops["fprop_w"], ops["dgrad_w"]) and torch.equal(ops["fprop_x"], ops["wgrad_x"])
    # the GEMMs multiply exactly those copies; dY's stochastic draw is made once, in dgrad,
    # and with square tiles wgrad takes that same copy
    y, x_f, w_f = emulated_forward(x, w, r)
    torch.manual_seed(7)
    dx, dw = emulated_backward(dy, x_f, w_f, r, need_dx=True, need_dw=True)
    torch.manual_seed(7)
    dy_d = operand(dy, r.dgrad_dy, reduce_dim=1)
    assert torch.equal(dx, dy_d @ w_f)
    if r.dgrad_dy.is_2d:
        assert torch.equal(dw, dy_d.mT @ x_f)
    else:   # 1x16 dY blocks: wgrad quantizes dY again, along tokens, and the copies differ
        assert not torch.equal(dw, dy_d.mT @ x_f)
        assert not torch.equal(ops["dgrad_dy"], ops["wgrad_dy"])


@pytest.mark.parametrize("spec", [QuantSpec.make("mxfp4", (8, 8), "rceil"),
                                  QuantSpec.make("mxfp8_e4m3", (8, 8), "rceil")], ids=spec_id)
def test_the_kernel_quantizes_8x8_tiles_and_their_transpose_like_the_reference(spec):
    # the 16x16 tiles of NVFP4 and MX are in tests/test_kernels.py; dY's 8x8 ones are new
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = adversarial(32, 48, spec, seed=4).to(device)
    q, q_t = quantize_triton_with_transpose(x, spec)
    assert_same_qtensor(q, quantize_with_spec(x.cpu(), spec))
    assert_same_qtensor(q_t, quantize_with_spec(x.cpu().mT, spec))
