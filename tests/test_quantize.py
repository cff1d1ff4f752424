"""Properties of the reference quantizer: transposition invariance, stochastic rounding,
truncation-free scales, idempotence, padding, special values, dtypes, layouts, storage."""

import pytest
import torch

import lowbit
from lowbit.formats.quantize import blocked

ALL_FORMATS = ["nvfp4", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2", "int2", "int3", "int4", "int8",
               "ternary", "binary"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def spread(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 8, shape, generator=g).float())


@pytest.mark.parametrize("fmt, kw", [("nvfp4", {}), ("nvfp4", {"tensor_scale": False}),
                                     ("mxfp4", {"scale_rule": "rceil"}), ("mxfp4", {}),
                                     ("mxfp8_e4m3", {}), ("int4", {}), ("ternary", {})])
@pytest.mark.parametrize("b", [16, 32])
def test_2d_transpose_is_the_same_bits(fmt, kw, b):
    x = spread((3, 70, 45))  # batch dim, and neither dim divisible by the tile
    q = lowbit.quantize(x, fmt, block=(b, b), **kw)
    qt = lowbit.quantize(x.mT, fmt, block=(b, b), **kw)
    assert torch.equal(q.t().codes, qt.codes)
    assert torch.equal(q.t().scales.view(torch.uint8) if q.scales.dtype != torch.float32 else q.t().scales,
                       qt.scales.view(torch.uint8) if qt.scales.dtype != torch.float32 else qt.scales)
    assert torch.equal(q.t().dequantize(), q.dequantize().mT)
    assert torch.equal(q.t().t().codes, q.codes)


@pytest.mark.parametrize("fmt, kw", [("nvfp4", {"tensor_scale": False}), ("mxfp4", {"scale_rule": "rceil"}),
                                     ("mxfp8_e5m2", {"scale_rule": "floor"}), ("int4", {})])
def test_2d_tile_equals_its_values_as_one_1d_block(fmt, kw):
    """Independent check of 2D tiling: a b x b tile is one block of b*b values."""
    b = 16
    x = spread((32, 48), seed=4)
    q2d = lowbit.quantize(x, fmt, block=(b, b), **kw).dequantize()
    for i in range(0, 32, b):
        for j in range(0, 48, b):
            tile = x[i:i + b, j:j + b].reshape(1, b * b)
            ref = lowbit.quantize(tile, fmt, block=(1, b * b), **kw).dequantize().reshape(b, b)
            assert torch.equal(q2d[i:i + b, j:j + b], ref)


def test_1d_transpose_refuses_with_a_clear_message():
    q = lowbit.quantize(torch.randn(32, 32), "mxfp4")
    with pytest.raises(ValueError, match="1D blocks.*quantize x.mT instead"):
        q.t()


def grid_neighbours(x, q):
    """The representable values just below and just above each x (float64), from the block
    scales of q and every code of its element format."""
    from lowbit.formats.elements import decode
    element = q.spec.info.element
    grid = decode(torch.arange(2 ** element.code_bits, dtype=torch.uint8), element).double()
    grid = torch.unique(grid[torch.isfinite(grid)]).float()
    # the same float32 product dequantize() computes
    candidates = (grid * q.element_scales()[..., None]).double()        # (..., n_grid)
    xd = x.double()[..., None]
    lo = torch.where(candidates <= xd, candidates, -torch.inf).amax(-1)
    hi = torch.where(candidates >= xd, candidates, torch.inf).amin(-1)
    return lo, hi


@pytest.mark.parametrize("fmt, kw", [("nvfp4", {}), ("mxfp4", {"scale_rule": "rceil"}),
                                     ("mxfp4", {"scale_rule": "rceil", "block": (32, 32)}),
                                     ("mxfp8_e4m3", {"scale_rule": "rceil"}), ("int4", {})])
def test_stochastic_rounding_unbiased_neighbours_and_seeded(fmt, kw):
    x = spread((4, 64), seed=7)
    draws = torch.stack([
        lowbit.quantize(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(s), **kw)
        .dequantize().double() for s in range(400)])
    # NVFP4's E4M3 block scale can round down, so a block's max may clip (deterministically);
    # the claims hold for every value inside its block's range, which is all of them for rceil.
    q = lowbit.quantize(x, fmt, **kw)
    inside = x.abs() <= q.block_max()
    assert inside.float().mean() > 0.95 and (inside.all() or fmt == "nvfp4")
    lo, hi = grid_neighbours(x, q)
    x, lo, hi, draws = x[inside].double(), lo[inside], hi[inside], draws[:, inside]
    # each draw is one of the two grid neighbours of x
    assert ((draws == lo) | (draws == hi)).all()
    # unbiased: the mean is within a few standard errors of x (a two-point draw, P(hi) = p)
    p = ((x - lo) / (hi - lo)).nan_to_num(0.0)
    stderr = (hi - lo) * (p * (1 - p) / draws.shape[0]).sqrt()
    assert ((draws.mean(0) - x).abs() <= 5 * stderr + 1e-9 * x.abs()).all()
    # same seed, same bits
    x = spread((4, 64), seed=7)
    a = lowbit.quantize(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(3), **kw)
    b = lowbit.quantize(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(3), **kw)
    c = lowbit.quantize(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(4), **kw)
    assert torch.equal(a.codes, b.codes) and not torch.equal(a.codes, c.codes)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"])
def test_rceil_never_clips_floor_does(fmt):
    x = spread((64, 256), seed=9)
    # block maxima just below each power of two times the element max: floor clips these
    x[:, 0] = 7.9 * torch.exp2(torch.randint(-20, 20, (64,)).float())
    x[:, 32] = torch.nextafter(torch.tensor(6.0), torch.tensor(0.0)) * 2.0 ** 5
    q = lowbit.quantize(x, fmt, scale_rule="rceil")
    assert (x.abs() <= q.block_max()).all()
    assert (q.dequantize().abs() <= q.block_max()).all()
    if fmt == "mxfp4":
        qf = lowbit.quantize(x, fmt, scale_rule="floor")
        assert (x.abs() > qf.block_max()).any()


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_rne_is_idempotent(fmt):
    x = spread((16, 256), seed=2)
    q1 = lowbit.quantize(x, fmt)
    q2 = lowbit.quantize(q1.dequantize(), fmt)
    if fmt in ("ternary", "binary"):  # absmean scales are not a fixed point of their own output
        assert torch.equal(q2.unpacked_codes(), q1.unpacked_codes())
    else:
        assert torch.equal(q2.codes, q1.codes)
        assert torch.equal(q2.dequantize(), q1.dequantize())


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("shape", [(5,), (3, 17), (2, 3, 33), (1, 1)])
def test_shapes_not_divisible_by_the_block(fmt, shape):
    x = spread(shape, seed=1)
    q = lowbit.quantize(x, fmt)
    out = q.dequantize()
    assert out.shape == x.shape and out.dtype == x.dtype
    # the padded result equals quantizing the explicitly zero-padded tensor and cropping
    b = q.spec.block[1]
    pad = (-shape[-1]) % b
    xp = torch.nn.functional.pad(x, (0, pad))
    ref = lowbit.quantize(xp, fmt).dequantize()[..., : shape[-1]]
    if fmt in ("ternary", "binary"):
        # their scale is the mean |x| of the real values only, not of the zero padding
        blocks = torch.nn.functional.pad(x, (0, pad)).reshape(*shape[:-1], -1, b)
        counts = torch.full(blocks.shape[:-1], float(b))
        counts[..., -1] = b - pad
        scale = (blocks.abs().sum(-1) / counts)[..., None]
        grid = torch.round(blocks / scale).clamp(-1, 1)
        if fmt == "binary":
            grid = torch.where(blocks < 0, -1.0, 1.0)
        ref = (grid * scale).reshape(*shape[:-1], -1)[..., : shape[-1]]
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)  # sum order differs: 1-ulp scales
    else:
        assert torch.equal(out, ref)


def test_padded_2d_tiles_do_not_read_past_the_tensor():
    x = spread((20, 20), seed=5)
    big = torch.full((32, 32), 1e6)
    big[:20, :20] = x
    view = big[:20, :20]   # a non-contiguous view inside a larger buffer of huge values
    q = lowbit.quantize(view, "mxfp4", block=(16, 16), scale_rule="rceil")
    assert torch.equal(q.dequantize(), lowbit.quantize(x, "mxfp4", block=(16, 16), scale_rule="rceil").dequantize())


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("block", [None, (16, 16)])
def test_nan_and_inf_make_their_block_nan_and_nothing_else(fmt, block):
    if block and fmt in ("binary",):
        block = (16, 16)
    x = spread((32, 256), seed=3)
    x[0, 5] = float("nan")
    x[20, 130] = float("inf")
    x[21, 131] = -float("inf")
    kw = {"block": block} if block else {}
    q = lowbit.quantize(x, fmt, **kw)
    out = q.dequantize()
    bad = torch.zeros_like(x, dtype=torch.bool)
    br, bc = q.spec.block
    for (r, c) in [(0, 5), (20, 130), (21, 131)]:
        r0, c0 = (r // br) * br, (c // bc) * bc
        bad[r0:r0 + br, c0:c0 + bc] = True
    assert torch.isnan(out[bad]).all()
    assert torch.isfinite(out[~bad]).all()
    # the finite blocks are what they would be without the bad values (nvfp4: same tensor scale)
    clean = x.clone()
    clean[bad] = 0
    if fmt != "nvfp4":
        ref = lowbit.quantize(clean, fmt, **kw).dequantize()
        same = ~bad
        if fmt in ("ternary", "binary"):
            pass  # absmean scales: per block, unaffected too
        assert torch.equal(out[same], ref[same])


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_all_zero_gives_zeros(fmt):
    for x in (torch.zeros(4, 128), torch.zeros(64, 64)):
        out = lowbit.quantize(x, fmt).dequantize()
        assert torch.equal(out, torch.zeros_like(x)) or (fmt == "binary" and not torch.isnan(out).any())
        if fmt == "binary":
            assert torch.equal(out.abs(), torch.zeros_like(x))  # sign(0) = +1, but the scale is 0


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8_e4m3", "int4"])
def test_huge_and_tiny_magnitudes(fmt):
    for mag in (1e30, 3e38, 1e-30, 1e-20):
        x = spread((8, 64), seed=8)
        x = x / x.abs().amax() * mag
        out = lowbit.quantize(x, fmt, **({"scale_rule": "rceil"} if fmt.startswith("mx") else {})).dequantize()
        assert torch.isfinite(out).all()
        rel = ((out.double() - x.double()).norm() / x.double().norm()).item()
        assert rel < 0.25, (fmt, mag, rel)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8_e4m3", "int8"])
def test_input_dtypes_give_the_same_bits_as_their_float32_values(fmt, dtype):
    x = spread((8, 128), seed=6).to(dtype)
    q = lowbit.quantize(x, fmt)
    q32 = lowbit.quantize(x.float(), fmt)
    assert torch.equal(q.codes, q32.codes)
    assert q.dequantize().dtype == dtype
    assert torch.equal(q.dequantize(), q32.dequantize().to(dtype))


def test_fp16_dequantize_saturates_instead_of_overflowing():
    x = torch.full((1, 32), 65504.0, dtype=torch.float16)
    x[0, 1] = 60000
    out = lowbit.quantize(x, "mxfp4", scale_rule="rceil").dequantize()
    assert torch.isfinite(out).all() and out.max() == 65504


def test_non_contiguous_inputs():
    base = spread((64, 128), seed=11)
    for view in (base.t(), base[:, ::2], base.reshape(8, 8, 128).permute(1, 0, 2)):
        for fmt in ("nvfp4", "mxfp4", "int4"):
            assert torch.equal(lowbit.quantize(view, fmt).codes, lowbit.quantize(view.contiguous(), fmt).codes)


def test_nbytes_is_the_packed_size():
    x = torch.randn(256, 512)
    assert lowbit.quantize(x, "nvfp4").nbytes == 256 * 256 + 256 * 32 + 4
    assert lowbit.quantize(x, "mxfp4").nbytes == 256 * 256 + 256 * 16
    assert lowbit.quantize(x, "mxfp8_e4m3").nbytes == 256 * 512 + 256 * 16
    assert lowbit.quantize(x, "int4", block=(1, 128)).nbytes == 256 * 256 + 256 * 4 * 4
    assert lowbit.quantize(x, "binary").nbytes == 256 * 64 + 256 * 4 * 4
    assert lowbit.quantize(x, "nvfp4", block=(16, 16)).nbytes == 256 * 256 + 16 * 32 + 4


@pytest.mark.parametrize("fmt, kw", [("nvfp4", {}), ("nvfp4", {"block": (16, 16), "tensor_scale": False}),
                                     ("mxfp4", {"scale_rule": "rceil"}), ("mxfp8_e5m2", {}),
                                     ("int3", {}), ("ternary", {}), ("binary", {})])
def test_save_load_roundtrip_is_bit_exact(tmp_path, fmt, kw):
    x = spread((3, 40, 72), seed=12).to(torch.bfloat16)
    q = lowbit.quantize(x, fmt, **kw)
    path = tmp_path / "q.safetensors"
    lowbit.save_qtensors(path, {"layers.0.w": q, "v": lowbit.quantize(x[0, 0], fmt)})
    loaded = lowbit.load_qtensors(path)
    r = loaded["layers.0.w"]
    assert torch.equal(r.codes, q.codes) and r.spec == q.spec and r.shape == q.shape and r.dtype == q.dtype
    assert torch.equal(r.dequantize(), q.dequantize())
    assert loaded["v"].shape == (72,)
    assert not list(tmp_path.glob("*.tmp"))


def test_load_rejects_other_files(tmp_path):
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="not a lowbit QTensor file"):
        lowbit.load_qtensors(tmp_path / "plain.safetensors")
    with pytest.raises(FileNotFoundError):
        lowbit.load_qtensors(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("args, kwargs, match", [
    ((torch.randn(4, 32), "fp3"), {}, "unknown format 'fp3'; known formats: nvfp4"),
    ((torch.randn(4, 32), "mxfp4"), {"scale_rule": "ceil"}, "unknown scale_rule 'ceil'"),
    ((torch.randn(4, 32), "nvfp4"), {"scale_rule": "rceil"}, "scale_rule applies to MX formats only"),
    ((torch.randn(4, 32), "mxfp4"), {"tensor_scale": True}, "tensor_scale applies to nvfp4 only"),
    ((torch.randn(4, 32), "mxfp4"), {"block": (16, 32)}, "square 2D tiles"),
    ((torch.randn(4, 32), "mxfp4"), {"block": (1, 7)}, "multiple of 2"),
    ((torch.randn(4, 32), "mxfp4"), {"rounding": "nearest"}, "unknown rounding"),
    ((torch.randn(32), "mxfp4"), {"block": (32, 32)}, "at least 2 dims"),
    ((torch.arange(32), "mxfp4"), {}, "float32, bfloat16 or float16"),
    ((torch.randn(0, 32), "mxfp4"), {}, "non-empty"),
])
def test_bad_arguments_say_what_to_do(args, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        lowbit.quantize(*args, **kwargs)


def test_blocked_layout():
    x = torch.arange(6 * 10, dtype=torch.float32).reshape(6, 10)
    b, pad_rows = blocked(x, (4, 4))
    assert b.shape == (2, 4, 3, 4) and pad_rows == 2
    assert torch.equal(b[0, :, 0, :], x[:4, :4])
    assert (b[1, 2:] == 0).all() and (b[:, :, 2, 2:] == 0).all()


@pytest.mark.parametrize("fmt, kw", [("nvfp4", {}), ("nvfp4", {"tensor_scale": False, "block": (16, 16)}),
                                     ("mxfp4", {"scale_rule": "rceil", "block": (32, 32)}),
                                     ("mxfp4", {}), ("mxfp8_e4m3", {}), ("mxfp8_e5m2", {"scale_rule": "rceil"}),
                                     ("int3", {}), ("int8", {}), ("ternary", {}), ("binary", {})])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_dequantize_equals_dequantize_of_quantize(fmt, kw, dtype):
    from lowbit.formats import QuantSpec, quantize_dequantize
    x = spread((3, 40, 72), seed=13)
    x[0, 0, 0] = float("nan")
    x[1, 5, 9] = float("inf")
    x = x.to(dtype)
    spec = QuantSpec.make(fmt, **kw)
    for rounding in ("rne", "stochastic"):
        spec_r = QuantSpec.make(fmt, rounding=rounding, **kw)
        a = quantize_dequantize(x, spec_r, generator=torch.Generator().manual_seed(1))
        generator = torch.Generator().manual_seed(1) if rounding == "stochastic" else None
        b = lowbit.quantize(x, fmt, rounding=rounding, generator=generator,
                            **kw).dequantize()
        assert a.dtype == dtype and torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    assert spec.format == fmt


@pytest.mark.parametrize("fmt", ["int2", "int4", "int8", "ternary"])
def test_integer_grids_tiny_blocks_and_negative_zero(fmt):
    """A block of float32 subnormals has a scale with no finite reciprocal: it is divided, not
    multiplied by inf (which made its zeros NaN). Integer codes have no -0, so fake quantization
    gives +0 where quantize().dequantize() does: the two agree bit for bit."""
    from lowbit.formats import QuantSpec, quantize_dequantize

    x = spread((4, 256), seed=21)
    x[0] = torch.linspace(-1, 1, 256) * 2.0**-140                  # subnormals, one a zero
    x[1] = -torch.rand(256) * 1e-3
    x[1, :4] = torch.tensor([5.0, -0.0, 0.0, -1e-9])                # small negatives round to 0
    spec = QuantSpec.make(fmt)
    a = quantize_dequantize(x, spec)
    b = lowbit.quantize(x, fmt).dequantize()
    assert not a.isnan().any()
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert (a[0] != 0).any() and (a[0].abs() <= x[0].abs().max() * 1.01).all()


def test_rceil_block_whose_amax_over_max_underflows_takes_the_smallest_scale():
    x = torch.zeros(1, 32)
    x[0, 0] = 2.0 ** -149  # float32's smallest subnormal: amax / 6 underflows to 0
    q = lowbit.quantize(x, "mxfp8_e5m2", scale_rule="rceil")
    assert q.scales.item() == 0 and torch.isfinite(q.dequantize()).all()


@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
def test_nvfp4_segment_tensor_scales_equal_each_segment_quantized_alone(block):
    # an MoE layer's experts' rows, each run of rows under its own FP32 tensor scale
    # (segment_tensor_scales, one per row, taken per block): bit for bit each run's own
    # quantization, with a huge, a tiny, an empty and an all-zero run, NaN and Inf, odd widths
    from bits import expert_segments

    from lowbit.formats import QuantSpec, quantize_dequantize
    from lowbit.formats.quantize import segment_tensor_scales, tensor_scale_of
    x, ends = expert_segments(0, huge=1e5, tiny=1e-20)
    scales = segment_tensor_scales(x, ends)
    assert scales.shape == (100, 1)
    assert torch.equal(scales[20], tensor_scale_of(x[16:48]).reshape(1))    # finite values only
    spec = QuantSpec.make("nvfp4", block)
    got = quantize_dequantize(x, spec, tensor_scale=scales)
    for start, end in ((0, 16), (16, 48), (48, 64), (64, 96), (96, 100)):   # rows past the end: their own
        torch.testing.assert_close(got[start:end], quantize_dequantize(x[start:end], spec),
                                   rtol=0, atol=0, equal_nan=True)
    for dtype in (torch.bfloat16, torch.float16):
        xd = x.to(dtype).clamp(-6e4, 6e4)
        torch.testing.assert_close(quantize_dequantize(xd, spec, tensor_scale=segment_tensor_scales(xd, ends))[16:48],
                                   quantize_dequantize(xd[16:48], spec), rtol=0, atol=0, equal_nan=True)
    # the same along columns (the wgrad operands, tokens along the blocks), non-contiguous
    got_t = quantize_dequantize(x.mT, spec, tensor_scale=scales.mT)
    torch.testing.assert_close(got_t[:, 16:48], quantize_dequantize(x[16:48].mT, spec),
                               rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="broadcasts"):
        quantize_dequantize(x, spec, tensor_scale=torch.ones(3))


@pytest.mark.parametrize("rows_each,ends", [(1, [16, 16, 48, 64, 96]), (16, [16, 16, 48, 64, 96]),
                                            (4, [6]), (16, [17]), (16, [20, 48]), (16, [0, 0]),
                                            (16, [32, 200])])
def test_segment_scales_from_amax_against_a_loop_over_the_segments(rows_each, ends):
    # each run of rows_each rows takes the scale of the segment its first row lies in, from the
    # maximum over the runs whose first rows lie there (ends need not be multiples of rows_each;
    # an empty segment, ends past the rows, rows past the last end)
    from lowbit.formats.quantize import segment_scales_from_amax, tensor_scale_from_amax

    g = torch.Generator().manual_seed(len(ends) + rows_each)
    amax = torch.rand(7, generator=g) * torch.logspace(-3, 3, 7)
    ends_t = torch.tensor(ends, dtype=torch.int32)
    got = segment_scales_from_amax(amax, ends_t, rows_each)
    first_rows = [i * rows_each for i in range(7)]
    segment = [sum(1 for e in ends if e <= r) for r in first_rows]
    seg_max = {s: max(float(amax[i]) for i in range(7) if segment[i] == s) for s in set(segment)}
    want = torch.stack([tensor_scale_from_amax(torch.tensor(seg_max[s])) for s in segment])
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "int4"])
def test_the_reference_on_cuda_is_the_cpus_bit_for_bit(fmt):
    # the scales' divisions by a constant are IEEE's on CUDA too (lowbit.formats.quantize.divide):
    # CUDA divides by a Python number as a product with its reciprocal, which once put an NVFP4
    # tensor scale a last place off the kernels' and the grouped MoE experts 3.45% off the loop
    from lowbit import dispatch
    from lowbit.formats import QuantSpec
    from lowbit.formats.quantize import divide, tensor_scale_from_amax

    g = torch.Generator().manual_seed(0)
    amax = (torch.rand(4096, generator=g) * 1000).to(torch.bfloat16).float()
    on_gpu = amax.cuda()
    torch.cuda.set_sync_debug_mode("error")          # the divisor made on the device: no wait
    try:
        scales, sixths = tensor_scale_from_amax(on_gpu), divide(on_gpu, 6.0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(scales.cpu(), tensor_scale_from_amax(amax))
    assert torch.equal(sixths.cpu(), (amax.double() / 6.0).float())
    x = torch.randn(64, 96, generator=g) * torch.logspace(-3, 3, 64)[:, None]
    x = x.to(torch.bfloat16)
    spec = QuantSpec.make(fmt, (1, 32) if fmt != "nvfp4" else (1, 16))
    with dispatch.force_reference():
        got = dispatch.quantize_dequantize(x.cuda(), spec).cpu()
        want = dispatch.quantize_dequantize(x, spec)
    assert torch.equal(got, want)
