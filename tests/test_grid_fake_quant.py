"""QAT's fused fake-quantize kernel (lowbit/kernels/grid_fake_quant.py) against the reference
(lowbit.formats.quantize.grid_fake_quantize), bit for bit, and the reference against PyTorch's
own fake quantizer. Without a GPU the kernel runs in Triton's interpreter on small shapes."""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set; run with "
                    "TRITON_INTERPRET=1 in the environment", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from lowbit import dispatch  # noqa: E402
from lowbit.formats.elements import BINARY, SEQ2, TERNARY, int_format, uint_format  # noqa: E402
from lowbit.formats.quantize import grid_fake_quantize  # noqa: E402
from lowbit.kernels.checks import assert_bits_equal  # noqa: E402
from lowbit.kernels.grid_fake_quant import grid_fake_quantize as kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SYMMETRIC = [int_format(2), int_format(3), int_format(4), int_format(8), TERNARY, BINARY, SEQ2]


def weights(shape, group, element, seed=0, dtype=torch.float32):
    """Random weights and per-group scales, with the edges mixed in: values on the grid, at
    ties (k + 0.5 steps) and one ulp either side, past the range, an all-zero group, -0.0,
    huge and tiny magnitudes, NaN and ±Inf."""
    g = torch.Generator().manual_seed(seed)
    *lead, k = shape
    scales = torch.exp2(torch.randint(-6, 4, (*lead, k // group), generator=g).float())
    scales[..., 0] = 0.37                                  # a scale that is not a power of two
    steps = torch.randint(-2 * int(element.max_value) - 2, 2 * int(element.max_value) + 3, shape,
                          generator=g).float() / 2        # integers and ties, past the range too
    x = steps + torch.randn(shape, generator=g) * 0.2 * (torch.rand(shape, generator=g) < 0.3)
    x = torch.where(torch.rand(shape, generator=g) < 0.1, torch.nextafter(x, x + 1), x)
    w = (x.view(*lead, k // group, group) * scales[..., None]).reshape(shape)
    flat = w.view(-1)
    flat[:group] = 0.0                                     # an all-zero group
    flat[group] = -0.0
    flat[group + 1], flat[group + 2], flat[group + 3] = 3e38, -1e-30, 1e-40
    flat[group + 4], flat[group + 5], flat[group + 6] = float("nan"), float("inf"), float("-inf")
    return w.to(dtype), scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("element", SYMMETRIC, ids=lambda e: e.name)
def test_the_kernel_is_the_reference_bit_for_bit(element, dtype):
    w, scales = weights((6, 96), 32, element)
    w = w.to(dtype)
    out, inside = kernel(w.to(DEVICE), scales.to(DEVICE), None, element, 32, inside=True)
    ref, ref_inside = grid_fake_quantize(w, scales, None, element, 32, inside=True)
    assert_bits_equal(out, ref)
    assert torch.equal(inside.cpu(), ref_inside)
    assert torch.isnan(out[0, 32 + 4]) and out.dtype == dtype   # NaN stays NaN


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_asymmetric_grids_take_their_zero_points(bits, dtype):
    element = uint_format(bits)
    w, scales = weights((4, 64), 16, int_format(bits), seed=bits)
    zeros = torch.randint(0, 2 ** bits, scales.shape, generator=torch.Generator().manual_seed(1)).float()
    w = w.to(dtype)
    out, inside = kernel(w.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), element, 16, inside=True)
    ref, ref_inside = grid_fake_quantize(w, scales, zeros, element, 16, inside=True)
    assert_bits_equal(out, ref)
    assert torch.equal(inside.cpu(), ref_inside)
    # zero points as a QTensor stores them (uint8): the same grid, -z taken in float
    as_stored, _ = grid_fake_quantize(w, scales, zeros.to(torch.uint8), element, 16)
    assert_bits_equal(as_stored, ref)


def test_three_dimensional_and_non_contiguous_weights():
    element = int_format(4)
    w, scales = weights((3, 8, 64), 16, element, seed=3)            # experts (E, out, in)
    out, _ = kernel(w.to(DEVICE), scales.to(DEVICE), None, element, 16)
    assert_bits_equal(out, grid_fake_quantize(w, scales, None, element, 16)[0])
    wide, _ = weights((64, 8), 8, element, seed=4)
    w_t = wide.t()                                                   # (8, 64), strided
    s_t = torch.exp2(torch.randint(-3, 3, (8, 8)).float())
    out, inside = kernel(w_t.to(DEVICE), s_t.to(DEVICE), None, element, 8)
    assert inside is None
    assert_bits_equal(out, grid_fake_quantize(w_t.contiguous(), s_t, None, element, 8)[0])


def test_the_reference_is_pytorchs_fake_quantizer_under_power_of_two_scales():
    # torch.fake_quantize_per_channel_affine multiplies by 1 / s, which is exact for s = 2^k:
    # an independent implementation of round(w / s) clamped, times s, one scale per group
    element = int_format(4)
    w, scales = weights((8, 64), 16, element, seed=5)
    finite = torch.isfinite(w) & (w.abs() < 1e30)
    w = torch.where(finite, w, 0.0)
    scales[..., 0] = 0.5
    ours, _ = grid_fake_quantize(w, scales, None, element, 16)
    flat = w.view(-1, 16)
    theirs = torch.fake_quantize_per_channel_affine(
        flat, scales.reshape(-1), torch.zeros(flat.shape[0], dtype=torch.int32), 0, -7, 7)
    assert torch.equal(ours, theirs.view_as(w))


def test_dispatch_runs_the_kernel_on_cuda_only_and_qat_matches_the_reference(monkeypatch):
    import lowbit.kernels.grid_fake_quant as module
    from lowbit.qat import QATConfig, fake_quantize
    from lowbit.qat.quantizer import GroupQuantizer

    calls = []
    monkeypatch.setattr(module, "grid_fake_quantize",
                        lambda *a, **k: calls.append(a[0].device.type) or kernel(*a, **k))
    element = int_format(2)
    w, scales = weights((4, 64), 32, element, seed=6)
    out, inside = dispatch.grid_fake_quantize(w, scales, None, element, 32, inside=True)
    ref, ref_inside = grid_fake_quantize(w, scales, None, element, 32, inside=True)
    assert_bits_equal(out, ref)
    assert torch.equal(inside, ref_inside)
    # QAT's forward (clipped STE: the mask passes the gradient) on the kernel's path
    q = GroupQuantizer(QATConfig(weights="int2:g32").format, w.shape)
    latent = torch.where(torch.isfinite(w), w, 0.0).to(DEVICE).requires_grad_()
    out = fake_quantize(latent, scales.to(DEVICE), None, None, q, "clipped-ste")
    out.sum().backward()
    ref, ref_inside = grid_fake_quantize(latent.detach().cpu(), scales, None, element, 32, inside=True)
    assert_bits_equal(out.detach(), ref)
    assert torch.equal(latent.grad.cpu(), ref_inside.float())
    assert calls == (["cuda"] if DEVICE == "cuda" else [])   # the kernel on CUDA, never on the CPU


def test_refusals():
    with pytest.raises(ValueError, match="must divide"):
        kernel(torch.ones(2, 30), torch.ones(2, 1), None, int_format(4), 16)
    from lowbit.formats.elements import E2M1
    with pytest.raises(ValueError, match="integer-like grids"):
        kernel(torch.ones(2, 32), torch.ones(2, 2), None, E2M1, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("spec,element", [("int2:g32", int_format(2)), ("ternary:g32", TERNARY),
                                          ("int4:g32", int_format(4))])
def test_the_kernel_under_torch_compile_is_the_eager_kernel(spec, element):
    # QAT under `--compile`: Inductor launches the kernel itself, passing Python floats as
    # float64, which once widened the grid arithmetic and failed the kernel's build
    from lowbit.qat import QATConfig, fake_quantize
    from lowbit.qat.quantizer import GroupQuantizer
    config = QATConfig(weights=spec)
    w, scales = weights((64, 128), 32, element, seed=9)
    q = GroupQuantizer(config.format, w.shape)
    latent = torch.where(torch.isfinite(w), w, 0.0).cuda().requires_grad_()
    scales, seed = scales.cuda(), torch.randn(64, 128, generator=torch.Generator().manual_seed(1)).cuda()

    def forward(latent):
        return fake_quantize(latent, scales, None, None, q, "clipped-ste")

    outputs, grads = [], []
    for fn in (forward, torch.compile(forward)):
        out = fn(latent)
        (grad,) = torch.autograd.grad(out, latent, seed)
        outputs.append(out.detach())
        grads.append(grad)
    assert_bits_equal(outputs[1], outputs[0])
    assert_bits_equal(grads[1], grads[0])
