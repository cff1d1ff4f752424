"""lowbit.kernels.engine_linear (the rollout engine's GEMM on dense, FP8 and packed-NVFP4 weights)
against lowbit.formats.LinearWeight.dequantize and plain PyTorch: the weight it multiplies bit for
bit, its prologues and epilogues, RAC's second input, and the grouped expert GEMM. Runs the kernels
on the GPU where there is one, else in Triton's interpreter on the CPU."""

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from lowbit.formats import QuantSpec, quantize_with_spec  # noqa: E402
from lowbit.formats.linear_weight import LinearWeight, WeightStorage  # noqa: E402
from lowbit.kernels import engine_linear as el  # noqa: E402
from lowbit.kernels.nvfp4_gemm import nvfp4_tile  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float16: dict(atol=4e-3, rtol=4e-3)}
FORMATS = ("dense", "fp8", "nvfp4")


def _weight(fmt: str, w: torch.Tensor, dtype: torch.dtype, spread: float = 40.0) -> LinearWeight:
    """w (N, K) stored in `fmt`; nvfp4 as two parts with their own tensor scales (a fused q|k),
    the second `spread` times the first."""
    w = w.to(DEV, dtype)
    if fmt == "dense":
        return LinearWeight.dense(w)
    if fmt == "fp8":
        spec = QuantSpec.make("mxfp8_e4m3", (1, w.shape[1]), "rceil")
        return LinearWeight.from_qtensors([quantize_with_spec(w, spec)], dtype)
    half = w.shape[0] // 2
    spec = QuantSpec.make("nvfp4", (1, 16))
    return LinearWeight.from_qtensors([quantize_with_spec(w[:half], spec),
                                       quantize_with_spec(w[half:] * spread, spec)], dtype)


def _adversarial(N, K, g):
    """Weights with an all-zero block, huge and tiny rows, exact E2M1 grid values (ties)."""
    w = torch.randn(N, K, generator=g)
    w[0, :16] = 0.0
    w[1] *= 1e30
    w[2] *= 1e-30
    w[3, : min(K, 32)] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25] * 4)[: min(K, 32)]
    return w


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 5])
def test_the_kernel_multiplies_the_weights_gemm_values_bit_for_bit(fmt, M):
    # with one-hot rows, y's columns are single weight values (products with 1, sums of zeros),
    # so float32 outputs show every decoded value exactly: dense and FP8 the dequantized
    # weight, NVFP4 its exact values (reference_values; the tiles decode to the same)
    g = torch.Generator().manual_seed(0)
    N, K = 24, 70                                          # K not a multiple of 16 or of the tile
    w = _weight(fmt, _adversarial(N, K, g), torch.float32)
    expected = w.reference_values()
    if fmt == "nvfp4":
        assert torch.equal(w.tiles().values(), expected)
        # and they are the QTensors' values up to dequantize's second rounding
        torch.testing.assert_close(expected, w.dequantize(), rtol=2 ** -23, atol=0)
    else:
        assert torch.equal(expected, w.dequantize())
    for start in range(0, K, M):
        rows = torch.arange(start, min(start + M, K))
        x = F.one_hot(rows, K).float().to(DEV)
        y = el.linear(x, w)
        assert torch.equal(y, expected[:, rows].T), (fmt, start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 3, 33])
def test_linear_matches_dequantize_then_gemm(dtype, fmt, M):
    g = torch.Generator().manual_seed(M)
    N, K = 40, 96
    # (parts of one scale: the interpreter rounds float32 -> bf16 by truncation, which a
    # large part would turn into large absolute differences)
    w = _weight(fmt, torch.randn(N, K, generator=g) / math.sqrt(K), dtype, spread=1.0)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    expected = F.linear(x.float(), w.reference_values().float()).to(dtype)
    torch.testing.assert_close(el.linear(x, w), expected, **TOL[dtype])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 4])
def test_prologues_epilogues_and_a_second_input(fmt, M):
    dtype = torch.float32
    g = torch.Generator().manual_seed(7)
    N, K = 32, 48
    w = _weight(fmt, torch.randn(N, K, generator=g), dtype)
    wv = w.reference_values()
    x = torch.randn(M, 2 * K, generator=g).to(DEV)
    bias, res = torch.randn(N, generator=g).to(DEV), torch.randn(M, N, generator=g).to(DEV)
    norm = (1 + 0.1 * torch.randn(K, generator=g)).to(DEV)
    xk = x[:, :K]
    normed = norm * F.rms_norm(xk, (K,), eps=1e-5)
    torch.testing.assert_close(el.linear(xk, w, bias, norm=norm, eps=1e-5, residual=res),
                               res + (F.linear(normed, wv) + bias), **TOL[dtype])
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(el.linear(x, w, silu_mul=True), F.linear(F.silu(gate) * up, wv),
                               **TOL[dtype])
    x2 = torch.randn(M, K, generator=g).to(DEV)
    torch.testing.assert_close(el.linear(xk, w, x2=x2), F.linear(xk, wv) + F.linear(x2, wv), **TOL[dtype])


def test_nan_in_a_block_stays_nan_and_overflow_follows_the_reference():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 64, generator=g)
    w[5, 20] = float("nan")
    lw = _weight("nvfp4", w, torch.float32)
    x = torch.ones(2, 64, device=DEV)
    y = el.linear(x, lw)
    assert y[:, 5].isnan().all() and not y[:, :5].isnan().any() and not y[:, 6:].isnan().any()
    # fp16 compute with row scales whose products pass fp16's max (made up: a quantized fp16
    # tensor stays below its amax): the exact weight in float32, the output rounded once to
    # fp16 -- inf where the reference's float32 GEMM rounds to inf, not dequantize's clamp
    codes = _weight("nvfp4", torch.randn(16, 32, generator=g), torch.float16, spread=1.0)
    row_scales = torch.full((16,), 40.0, device=DEV)
    lw16 = LinearWeight(WeightStorage.NVFP4, codes.data, codes.block_scales, row_scales, 32, torch.float16)
    eye = torch.eye(32, dtype=torch.float16, device=DEV)
    expected = lw16.reference_values().T.to(torch.float16)
    assert expected.isinf().any()
    for cols in (slice(0, 1), slice(0, 32)):
        assert torch.equal(el.linear(eye[cols], lw16), expected[cols])
    # huge row scales (past 2^127 / 448 / 6 would overflow float32 itself): exact all the same
    huge = LinearWeight(WeightStorage.NVFP4, codes.data, codes.block_scales,
                        torch.full((16,), 1e33, device=DEV), 32, torch.float32)
    eye32 = torch.eye(32, device=DEV)
    for cols in (slice(0, 1), slice(0, 32)):
        assert torch.equal(el.linear(eye32[cols], huge), huge.reference_values()[:, cols].T)


def test_non_contiguous_inputs_and_odd_shapes():
    g = torch.Generator().manual_seed(4)
    w = _weight("nvfp4", torch.randn(18, 50, generator=g), torch.float32)    # N and K odd sizes
    x = torch.randn(50, 7, generator=g).to(DEV).T                            # a transposed view
    torch.testing.assert_close(el.linear(x, w), F.linear(x, w.reference_values()), **TOL[torch.float32])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("silu_mul", [False, True])
def test_grouped_experts_equal_one_gemm_per_expert(fmt, silu_mul):
    g = torch.Generator().manual_seed(5)
    E, N, K, T, k = 5, 24, 48, 9, 2
    experts = LinearWeight.stack([_weight(fmt, torch.randn(N, K, generator=g), torch.float32, 1.0)
                                  for _ in range(E)])
    x = torch.randn(T, 2 * K if silu_mul else K, generator=g).to(DEV)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEV)
    index[:, 0] = 3                                        # one expert with many rows, one with none
    rows = index.reshape(-1)
    tile_expert, row_ids = el.moe_align(rows, E)
    y = el.grouped_linear(x, experts, tile_expert, row_ids, T * k, row_div=k, silu_mul=silu_mul)
    xin = x if not silu_mul else F.silu(x[:, :K]) * x[:, K:]
    for r in range(T * k):
        expected = F.linear(xin[r // k], experts.expert(int(rows[r])).reference_values())
        torch.testing.assert_close(y[r], expected, **TOL[torch.float32])


def test_moe_align_groups_rows_by_expert():
    rows = torch.tensor([2, 0, 2, 2, 1, 0, 2] * 5, device=DEV)      # 35 rows, expert 3 unused
    tile_expert, row_ids = el.moe_align(rows, 4, block_m=16)
    tiles = row_ids.view(-1, 16)
    seen = []
    for t, e in enumerate(tile_expert.tolist()):
        listed = [r for r in tiles[t].tolist() if r >= 0]
        if e < 0:
            assert not listed
            continue
        assert listed == sorted(listed) and all(int(rows[r]) == e for r in listed)
        seen += listed
    assert sorted(seen) == list(range(35))                  # every row once
    assert tile_expert.numel() == -(-35 // 16) + 4           # fixed size: no host read-back


def test_linear_refuses_what_it_cannot_do():
    w = _weight("nvfp4", torch.randn(16, 32), torch.float32)
    x = torch.randn(2, 32, device=DEV)
    with pytest.raises(ValueError, match="one prologue"):
        el.linear(x, w, norm=torch.ones(32, device=DEV), silu_mul=True)
    with pytest.raises(ValueError, match="in_features"):
        el.linear(x[:, :31], w)
    with pytest.raises(ValueError, match="dtype"):
        el.linear(x.double(), w)
    with pytest.raises(ValueError, match="no prologue"):
        el.linear(x, w, x2=x, norm=torch.ones(32, device=DEV))
    with pytest.raises(ValueError, match="grouped_linear"):
        el.linear(x, LinearWeight.stack([w, w]))
    assert w.format is WeightStorage.NVFP4 and w.nbytes == 16 * 16 + 16 * 2 + 16 * 4
    with pytest.raises(ValueError, match="re-lays NVFP4"):
        LinearWeight.dense(x).tiles()


def test_nvfp4_tiles_hold_the_exact_weight_and_follow_a_sync_in_place():
    g = torch.Generator().manual_seed(8)
    N, K = 200, 300                       # rows padded to 256, K to 3 tiles of 128 (one partial)
    w = _adversarial(N, K, g)
    w[7, 40] = float("nan")               # a NaN block scale
    lw = _weight("nvfp4", w, torch.bfloat16)
    tiles = lw.tiles()
    assert tiles.words.shape == (256, 3 * 16) and tiles.scales.shape == (256, 3 * 8)
    v, ref = tiles.values(), lw.reference_values()
    assert torch.equal(v.isnan(), ref.isnan()) and v[7].isnan().any()
    assert torch.equal(v.nan_to_num(), ref.nan_to_num())
    stacked = LinearWeight.stack([lw, _weight("nvfp4", torch.randn(N, K, generator=g), torch.bfloat16)])
    assert torch.equal(stacked.tiles().values()[0].nan_to_num(), v.nan_to_num())
    # a sync: the same tensors, the other weight's values
    other = _weight("nvfp4", torch.randn(N, K, generator=g), torch.bfloat16)
    ptrs = (tiles.words.data_ptr(), tiles.scales.data_ptr(), tiles.row_scales.data_ptr())
    lw.copy_(other)
    assert lw.tiles() is tiles and ptrs == (tiles.words.data_ptr(), tiles.scales.data_ptr(),
                                            tiles.row_scales.data_ptr())
    assert torch.equal(tiles.values(), other.reference_values())


def _same_tiles(a, b):
    # bit patterns, but for a NaN's payload (a NaN scale is a NaN in both)
    def bits(t, view):
        return torch.where(t.isnan(), 0, t.view(view))
    return (torch.equal(a.words, b.words) and torch.equal(a.scales.isnan(), b.scales.isnan())
            and torch.equal(bits(a.scales, torch.int16), bits(b.scales, torch.int16))
            and torch.equal(a.row_scales.isnan(), b.row_scales.isnan())
            and torch.equal(bits(a.row_scales, torch.int32), bits(b.row_scales, torch.int32))
            and (a.out_features, a.in_features) == (b.out_features, b.in_features))


@pytest.mark.parametrize("N,K", [(200, 300), (1, 16), (130, 40), (7, 1000)])
def test_the_tiles_kernel_writes_the_references_bits_in_one_launch(N, K):
    # adversarial weights (zero block, rows at 1e30 and 1e-30: E4M3 subnormal scales, ties),
    # a NaN and an Inf, shapes off the tile and row padding, experts stacked, and in place
    from lowbit.formats.nvfp4_tiles import nvfp4_tiles
    from lowbit.kernels.nvfp4_tiles import nvfp4_tiles_triton
    g = torch.Generator().manual_seed(N + K)
    w = _adversarial(max(N, 4), K, g)[:N]
    if N > 7:
        w[5, K // 2] = float("nan")
        w[6, 0] = float("inf")
    for dtype in (torch.bfloat16, torch.float32):
        lw = _weight("nvfp4", w, dtype) if N > 1 else LinearWeight.from_qtensors(
            [quantize_with_spec(w.to(DEV, dtype), QuantSpec.make("nvfp4", (1, 16)))], dtype)
        ref = nvfp4_tiles(lw.data, lw.block_scales, lw.row_scales, lw.in_features)
        mine = nvfp4_tiles_triton(lw.data, lw.block_scales, lw.row_scales, lw.in_features)
        assert _same_tiles(mine, ref)
    if N > 7:
        assert ref.scales[5].isnan().any() and ref.row_scales.isfinite().all()
        # every E4M3 byte as a block scale (the quantizer floors scales at 2^-6, so its own
        # never reach the subnormals, zero, negatives or 0x7F): the layout decodes each alike
        every = torch.arange(lw.block_scales.numel(), device=DEV) % 256
        lw.block_scales.view(torch.uint8).copy_(every.view(lw.block_scales.shape).to(torch.uint8))
        args = (lw.data, lw.block_scales, lw.row_scales, lw.in_features)
        assert _same_tiles(nvfp4_tiles_triton(*args), nvfp4_tiles(*args))
    stacked = LinearWeight.stack([lw, _weight("nvfp4", torch.randn(N, K, generator=g) * 1e-3, dtype)
                                  if N > 1 else lw])
    args = (stacked.data, stacked.block_scales, stacked.row_scales, stacked.in_features)
    ref = nvfp4_tiles(*args)
    assert _same_tiles(nvfp4_tiles_triton(*args), ref)
    # in place, over garbage: the same tensors hold the reference's bits
    out = nvfp4_tiles(*args)
    for t in (out.words, out.scales, out.row_scales):
        t.view(torch.uint8).fill_(0xA5)
    ptrs = [t.data_ptr() for t in (out.words, out.scales, out.row_scales)]
    assert nvfp4_tiles_triton(*args, out=out) is out and _same_tiles(out, ref)
    assert ptrs == [t.data_ptr() for t in (out.words, out.scales, out.row_scales)]
    with pytest.raises(ValueError, match="out holds tiles"):
        nvfp4_tiles_triton(lw.data, lw.block_scales, lw.row_scales, lw.in_features, out=out)


def test_a_weight_made_by_the_tiles_kernel_is_re_laid_by_it_at_a_sync():
    from lowbit.kernels import nvfp4_tiles as kt
    g = torch.Generator().manual_seed(3)
    lw = _weight("nvfp4", torch.randn(40, 96, generator=g), torch.bfloat16)
    calls = []

    def counted(*args, **kw):
        calls.append(kw.get("out") is not None)
        return kt.nvfp4_tiles_triton(*args, **kw)
    tiles = lw.tiles(counted)
    other = _weight("nvfp4", torch.randn(40, 96, generator=g), torch.bfloat16)
    lw.copy_(other)
    assert calls == [False, True] and lw.tiles() is tiles
    assert torch.equal(tiles.values(), other.reference_values())


@pytest.mark.parametrize("M", [1, 6])
def test_nvfp4_split_over_k_sums_in_the_workspace_and_leaves_it_zeroed(M):
    # K of 3 tiles: split over K (the interpreter's tile splits in two, the GPU's default from
    # 16 tiles up); the second call sees a workspace the first left clean
    g = torch.Generator().manual_seed(9)
    N, K = 72, 300
    lw = _weight("nvfp4", torch.randn(N, K, generator=g) / math.sqrt(K), torch.float32)
    x = torch.randn(M, K, generator=g).to(DEV)
    bias, res = torch.randn(N, generator=g).to(DEV), torch.randn(M, N, generator=g).to(DEV)
    expected = res + (F.linear(x, lw.reference_values()) + bias)
    for tile in ({"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 3, "num_warps": 4, "num_stages": 1},
                 {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 2, "num_warps": 4, "num_stages": 1},
                 None):
        for _ in range(2):   # float32 sums of 300 products in another order: the reference's own
            # error against float64 is up to 3.4e-5 here, the kernel's up to 5.9e-5 (one H100)
            torch.testing.assert_close(el.linear(x, lw, bias, residual=res, tile=tile), expected,
                                       atol=1e-4, rtol=1e-4)
    assert nvfp4_tile(1, 2560, 16)["SPLIT_K"] == 4 and nvfp4_tile(1, 4096, 8)["SPLIT_K"] == 1
    # many rows: split while the tiles leave SMs idle, not once they fill a wave
    assert nvfp4_tile(128, 2048, 16)["SPLIT_K"] == 4 and nvfp4_tile(128, 11264, 16)["SPLIT_K"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_one_row_on_the_cuda_cores_is_the_tensor_core_tile(dtype):
    # USE_DOT False: one row, each decoded plane times its 16 columns summed elementwise in
    # float32; the tensor-core tile's result up to accumulation order (K 300: a partial tile;
    # split over K and not; a second input, bias and residual; a NaN block stays NaN)
    g = torch.Generator().manual_seed(13)
    N, K = 40, 300
    raw = torch.randn(N, K, generator=g) / math.sqrt(K)
    raw[3, 16:32] = float("nan")
    lw = _weight("nvfp4", raw, dtype)
    x, x2 = (torch.randn(1, K, generator=g).to(dtype).to(DEV) for _ in range(2))
    bias, res = torch.randn(N, generator=g).to(dtype).to(DEV), torch.randn(1, N, generator=g).to(dtype).to(DEV)
    mma = {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1}
    # float32: the two orders of 300 float32 additions differ by a few ulps of the partial sums
    tol = dict(atol=5e-5, rtol=1e-5) if dtype == torch.float32 else TOL[dtype]
    want = el.linear(x, lw, bias, residual=res, tile=mma)
    want2 = el.linear(x, lw, x2=x2, tile=mma)
    assert torch.isnan(want[0, 3]) and torch.isfinite(want[0, :3]).all()
    for split in (1, 2, 3):
        gemv = {"BLOCK_M": 1, "BLOCK_N": 16, "SPLIT_K": split, "USE_DOT": False, "num_warps": 4,
                "num_stages": 1}
        got = el.linear(x, lw, bias, residual=res, tile=gemv)
        torch.testing.assert_close(got, want, equal_nan=True, **tol)
        torch.testing.assert_close(el.linear(x, lw, x2=x2, tile=gemv), want2, equal_nan=True, **tol)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
    with pytest.raises(ValueError, match="takes one row"):
        el.linear(torch.cat([x, x]), lw, tile=gemv)


def test_nvfp4_tiles_over_two_ks_multiply_the_exact_weight():
    # one-hot rows show each value bit for bit over K of two tiles, the second partial; and a
    # second input (RAC's) on the same decoded tiles
    g = torch.Generator().manual_seed(3)
    N, K = 40, 200
    w = _weight("nvfp4", _adversarial(N, K, g), torch.float32)
    expected = w.reference_values()
    tile = {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1}
    for start in range(0, K, 7):
        rows = torch.arange(start, min(start + 7, K))
        x = F.one_hot(rows, K).float().to(DEV)
        assert torch.equal(el.linear(x, w, tile=tile), expected[:, rows].T), start
    x, x2 = torch.randn(2, 5, K, generator=g).to(DEV)
    w = _weight("nvfp4", torch.randn(N, K, generator=g) / math.sqrt(K), torch.float32)
    wv = w.reference_values()
    torch.testing.assert_close(el.linear(x, w, x2=x2, tile=tile), F.linear(x, wv) + F.linear(x2, wv),
                               atol=1e-4, rtol=1e-5)      # sums of 400 products, in any order


def test_an_outgrown_split_k_workspace_stays_alive_for_the_graphs_that_captured_it():
    # a CUDA graph captured on the workspace keeps its pointer: a larger call that grows the
    # workspace must not free the old one (its memory would go to another tensor under the graph)
    from lowbit.kernels import nvfp4_gemm
    dev = torch.device(DEV)
    before, _ = nvfp4_gemm.split_k_workspace(dev, 0, 0)
    grown, _ = nvfp4_gemm.split_k_workspace(dev, before.numel() + 1, 0)
    assert grown.data_ptr() != before.data_ptr()
    assert any(part is before for part, _ in nvfp4_gemm.RETIRED_WORKSPACES)
    # a call with no split over K asks for no workspace at all
    g = torch.Generator().manual_seed(2)
    lw = _weight("nvfp4", torch.randn(64, 128, generator=g), torch.float32)
    tile = {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1}
    el.linear(torch.randn(200, 128, generator=g).to(DEV), lw, tile=tile)
    assert nvfp4_gemm.WORKSPACES[dev][0] is grown


def test_settle_fixes_every_weights_saturation_flag_with_one_read(monkeypatch):
    """LinearWeight.settle reads the saturation flags of many weights at once (a weight sync's
    hundreds): the same flags each weight reads alone (a float16 weight past 65504 saturates, a
    NaN row scale does, a dense weight never); one stacked read from the device for all."""
    spec = QuantSpec.make("nvfp4")

    def weights():
        torch.manual_seed(0)
        made = []
        for peak, dtype in ((1.0, torch.bfloat16), (7e4, torch.float16), (1e4, torch.float16),
                            (float("inf"), torch.bfloat16)):   # Inf: its block is NaN, the scale finite
            w = torch.randn(16, 32)
            w[0, 0] = peak
            made.append(LinearWeight.from_qtensors([quantize_with_spec(w, spec)], dtype))
        nan = made[0]
        made.append(LinearWeight(nan.format, nan.data, nan.block_scales,
                                 torch.full_like(nan.row_scales, float("nan")), nan.in_features, nan.dtype))
        return made + [LinearWeight.dense(torch.randn(4, 8))]

    expected = [w.may_saturate for w in weights()]      # each read alone, on first use
    assert expected == [False, True, False, False, True, False]
    settled, reads = weights(), []
    real_stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda ts, *a, **k: reads.append(len(ts)) or real_stack(ts, *a, **k))
    LinearWeight.settle(settled)
    monkeypatch.setattr(torch, "stack", real_stack)
    assert reads == [5]                                  # the five with row scales, in one read
    assert all(w.settled for w in settled)               # not read again on use
    assert [w.may_saturate for w in settled] == expected
