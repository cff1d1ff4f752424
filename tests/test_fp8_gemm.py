"""MXFP4 folded into FP8 E4M3 (lowbit.formats.fold, lowbit.kernels.fp8_gemm): the folding is bit-exact, the GEMM
on the folded operands equals an fp64 GEMM of the dequantized operands within its bound.

CPU tests (CI): the exactness window enumerated from torch's own E4M3 cast; fold / fold_operand
against QTensor.dequantize bit for bit, on quantized random tensors (floor and rceil, 1D blocks
and 2D tiles, block exponents spread over +-6 and +-30 binades) and on QTensors built code by
code (all-zero blocks, spans at and one past the window, the smallest and largest exponents,
NaN blocks, -0); what fold_report counts; the emulated GEMM for the three GEMMs of a linear
layer within the float32-accumulation bound gamma_K * (|A| |B|^T).
GPU tests (marked gpu, skipped without CUDA): the CUDA fold equals the CPU fold;
torch._scaled_mm against fp64 with the bounds below.
"""

import pytest
import torch

from lowbit.formats import QTensor, QuantSpec, quantize
from lowbit.formats.elements import E2M1_VALUES, pack_codes
from lowbit.formats.fold import (
    SHIFT_MAX, SHIFT_MIN, WINDOW_SPAN, FoldedOperand, fold, fold_operand, fold_report,
    shift_table, weight_operands,
)
from lowbit.kernels.fp8_gemm import fp4_gemm_fp8, gemm_pieces, grouped_fp4_gemm_fp8

RULES = ["floor", "rceil"]
BLOCKS = [(1, 32), (32, 32), (16, 16)]
# Relative Frobenius error of torch._scaled_mm (float32 output) against fp64, per use_fast_accum.
# Issue 4's probe on the H200 measured 1.1e-4 without fast accumulation and 8e-4..1.4e-3 with
# it; these bounds leave ~4x margin and have not yet been run on a GPU: tighten them from what
# benchmarks/bench_fp8_gemm.py measures.
GPU_REL_BOUND = {False: 5e-4, True: 5e-3}


# ---- helpers -------------------------------------------------------------------------------

def spread(rows, cols, binades, seed=0, tile=(1, 32)):
    """Gaussian values times 2^U{-binades..binades}, one exponent per tile (1D block or 2D
    tile), so the quantized block exponents spread as much."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    br, bc = tile
    e = torch.randint(-binades, binades + 1, (-(-rows // br), -(-cols // bc)), generator=g).float()
    mag = torch.exp2(e).repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]
    return x * mag


def make_q(codes, exps, block, rule="rceil"):
    """A QTensor from unpacked codes (R, C) and unbiased block exponents (255 - 127: NaN)."""
    rows, cols = codes.shape
    b = block[1]
    padded = torch.nn.functional.pad(codes.to(torch.uint8), (0, (-cols) % b))
    scales = (torch.as_tensor(exps) + 127).to(torch.uint8)
    spec = QuantSpec.make("mxfp4", block, rule)
    return QTensor(pack_codes(padded, 4), scales, None, spec, (rows, cols), torch.float32)


def exact_values(q):
    """E2M1(code) * 2^s in float64, independent of QTensor.dequantize (NaN blocks NaN)."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    codes = q.unpacked_codes()
    values = torch.where((codes & 8) != 0, -mags[(codes & 7).long()], mags[(codes & 7).long()])
    scales = q.scales
    br, b = q.spec.block
    if br > 1:
        scales = scales.repeat_interleave(br, 0)[: q.shape[0]]
    scales = scales.repeat_interleave(b, 1)[:, : q.shape[1]]
    scale = torch.exp2(scales.to(torch.float64) - 127)
    return torch.where(scales == 255, float("nan"), values * scale)


def folded_float64(op):
    """fp8 * factor of a FoldedOperand in float64 (exact: no float32 overflow)."""
    lengths = torch.tensor([b - a for a, b in zip(op.bounds[:-1], op.bounds[1:])])
    return op.fp8.double() * op.factors.double().repeat_interleave(lengths, dim=1)


def assert_bits_equal(actual, expected):
    """Equal bit for bit (so -0.0 != 0.0), NaN where expected is NaN (any NaN payload)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    view = {torch.float32: torch.int32, torch.float64: torch.int64}[actual.dtype]
    a, e = actual.view(view), expected.view(view)
    assert torch.equal(a[~nan], e[~nan]), f"{int((a != e)[~nan].sum())} values differ"


def reference_gemm(a, b):
    """fp64 GEMM of the dequantized operands (a @ b.T) and the float32-accumulation bound
    gamma_K * (|A| |B|^T) of the emulated path."""
    a64 = a.dequantize(torch.float32).double()
    b64 = b.dequantize(torch.float32).double()
    k = a64.shape[1]
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
    return a64 @ b64.T, gamma * (a64.abs() @ b64.abs().T)


def random_codes(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)


# ---- the window ----------------------------------------------------------------------------

def test_window_is_what_e4m3_holds():
    """Every E2M1 code times 2^t, cast with torch's E4M3: exact for all codes iff t in [-8, 6];
    one step below, exactly 0.5 and 1.5 go (0.5 to zero); one step above, 6 overflows 448."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    values = torch.cat([mags, -mags])
    exact_shifts = []
    for t in range(-14, 12):
        v = values * 2.0**t
        stored = v.to(torch.float32).to(torch.float8_e4m3fn).to(torch.float64)
        if torch.equal(stored, v):
            exact_shifts.append(t)
    assert exact_shifts == list(range(SHIFT_MIN, SHIFT_MAX + 1))
    assert (SHIFT_MIN, SHIFT_MAX, WINDOW_SPAN) == (-8, 6, 14)
    below = mags * 2.0 ** (SHIFT_MIN - 1)
    stored = below.to(torch.float32).to(torch.float8_e4m3fn).to(torch.float64)
    assert [E2M1_VALUES[i] for i in range(8) if stored[i] != below[i]] == [0.5, 1.5]
    assert stored[1] == 0                                         # 0.5 * 2^-9: a tie, to zero
    assert 6.0 * 2.0 ** (SHIFT_MAX + 1) > 448


def test_shift_table_matches_the_cast():
    table = shift_table(torch.device("cpu")).view(torch.float8_e4m3fn).reshape(16, 16)
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    values = torch.cat([mags, -mags])
    for row, t in enumerate(range(SHIFT_MIN, SHIFT_MAX + 1)):
        assert torch.equal(table[row].to(torch.float64), values * 2.0**t)
    assert torch.isnan(table[15].float()).all()


# ---- folding: quantized random tensors -------------------------------------------------------

@pytest.mark.parametrize("binades", [6, 30])
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("rule", RULES)
def test_fold_quantized_random(rule, block, binades):
    x = spread(96, 320, binades, seed=binades, tile=block)
    q = quantize(x, "mxfp4", block=block, scale_rule=rule)
    deq = q.dequantize(torch.float32)
    op = fold_operand(q)
    assert op.fp8.dtype == torch.float8_e4m3fn and op.fp8.shape == (96, 320)
    assert op.factors.dtype == torch.float32 and op.factors.shape == (96, len(op.bounds) - 1)
    assert_bits_equal(op.unfold(), deq)
    report = fold_report(q)
    assert report.chunks == len(op.bounds) - 1
    if report.rows_over_window == 0:
        fp8, row_factor = fold(q)
        assert row_factor.shape == (96, 1)
        assert_bits_equal(fp8.float() * row_factor, deq)
        assert torch.equal(fp8.view(torch.uint8), op.fp8.view(torch.uint8))
        assert report.chunks == 1 and report.values_inexact == 0
    else:
        with pytest.raises(ValueError, match="fold_operand"):
            fold(q)
        assert report.chunks > 1
    if binades == 30:
        assert report.rows_over_window > 0 and report.values_inexact > 0
    if block[0] > 1:  # the transposed operand from the same bits
        assert_bits_equal(fold_operand(q, transpose=True).unfold(), deq.T)


def test_factors_are_normal_powers_of_two():
    exps = torch.tensor([[-127, -127], [-127, -120], [125, 120], [0, -14]])
    q = make_q(random_codes(4, 64), exps, (1, 32))
    op = fold_operand(q)
    mant, _ = torch.frexp(op.factors)
    assert (mant == 0.5).all()                                    # powers of two
    assert (op.factors >= 2.0**-126).all()                        # never a float32 subnormal
    assert_bits_equal(op.unfold(), q.dequantize(torch.float32))


# ---- folding: adversarial QTensors built code by code ------------------------------------------

def every_code_row(n_blocks, b=32):
    """Each block holds all 16 codes (twice for b = 32)."""
    return torch.arange(16, dtype=torch.uint8).repeat(n_blocks * b // 16)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
def test_span_at_the_window_folds_with_one_factor(block):
    b = block[1]
    rows = 2 * b if block[0] > 1 else 3
    nb = 4
    codes = every_code_row(nb, b).repeat(rows, 1)
    exps = torch.tensor([[5, 5 - WINDOW_SPAN, -3, 5]]).repeat(rows // block[0], 1)
    q = make_q(codes, exps, block)
    fp8, row_factor = fold(q)
    assert_bits_equal(fp8.float() * row_factor, q.dequantize(torch.float32))
    assert torch.equal(row_factor, torch.full_like(row_factor, 2.0 ** (5 - SHIFT_MAX)))
    report = fold_report(q)
    assert (report.rows_over_window, report.values_inexact, report.max_span, report.chunks) == \
        (0, 0, WINDOW_SPAN, 1)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
def test_span_one_past_the_window_is_chunked_and_reported(block):
    b = block[1]
    rows = 2 * b if block[0] > 1 else 3
    codes = every_code_row(4, b).repeat(rows, 1)
    exps = torch.tensor([[5, 5 - WINDOW_SPAN - 1, -3, 4]]).repeat(rows // block[0], 1)
    q = make_q(codes, exps, block)
    with pytest.raises(ValueError, match=r"span more than 14 binades \(max 15\)"):
        fold(q)
    report = fold_report(q)
    # one factor: the block at 5 - 15 gets shift -9, where exactly 0.5 and 1.5 (both signs)
    # are inexact and 0.5 flushes to zero; per block of b: 4 codes of 16, b / 16 times each
    per_block = 4 * b // 16
    assert report.rows == rows and report.rows_over_window == rows and report.max_span == 15
    assert report.values_inexact == rows * per_block
    assert report.values_flushed == rows * per_block // 2
    assert report.values == rows * 4 * 14 * b // 16              # 14 nonzero codes of 16
    op = fold_operand(q)
    assert op.bounds == (0, b, 4 * b) and report.chunks == 2     # greedy: [5] | [-10, -3, 4]
    assert_bits_equal(op.unfold(), q.dequantize(torch.float32))


@pytest.mark.parametrize("span", [15, 16, 17, 20, 30])
def test_report_counts_match_rounding_by_hand(span):
    """One factor per row puts the small block at shift t = 6 - span <= -9, below E4M3's normal
    range, where the grid is the multiples of 2^-9: a magnitude m is exact iff m * 2^(t + 9) is
    an integer, and flushed iff it rounds (half to even) to 0."""
    b, rows = 32, 3
    q = make_q(every_code_row(2, b).repeat(rows, 1), torch.tensor([[5, 5 - span]] * rows), (1, b))
    t = 6 - span
    inexact = flushed = 0
    for m in E2M1_VALUES[1:]:
        x = m * 2.0 ** (t + 9)
        inexact += x != int(x)
        flushed += round(x) == 0
    copies = rows * 2 * b // 16                                   # each magnitude: +-, b/16 times
    report = fold_report(q)
    assert (report.values_inexact, report.values_flushed) == (inexact * copies, flushed * copies)
    assert report.max_span == span and report.rows_over_window == rows and report.chunks == 2
    assert_bits_equal(fold_operand(q).unfold(), q.dequantize(torch.float32))


def test_greedy_chunks_are_fewest():
    # exponents per block: 0, 14, 0, 15, 1, -127 (all-zero block: ignored), 1
    codes = every_code_row(7).reshape(1, -1).clone()
    codes[:, 5 * 32: 6 * 32] = 0
    q = make_q(codes, torch.tensor([[0, 14, 0, 15, 1, -127, 1]]), (1, 32))
    op = fold_operand(q)
    assert op.bounds == (0, 96, 224)                             # [0, 14, 0] | [15, 1, -, 1]
    assert torch.equal(op.factors, torch.tensor([[2.0**8, 2.0**9]]))
    assert_bits_equal(op.unfold(), q.dequantize(torch.float32))


def test_all_zero_blocks_do_not_widen_the_span():
    codes = every_code_row(4).repeat(5, 1)
    codes[:, 32:64] = 0                                           # block 1: zeros, exponent -127
    codes[1, 64:96] = 8                                           # row 1, block 2: -0 only
    codes[2] = 0                                                  # row 2: all zero
    q = make_q(codes, torch.tensor([[100, -127, 95, 100]]).repeat(5, 1), (1, 32))
    fp8, row_factor = fold(q)
    assert_bits_equal(fp8.float() * row_factor, q.dequantize(torch.float32))
    # the factor comes from the scales alone, live or not (an all-zero row of a real QTensor
    # has exponent -127 blocks; here it keeps its neighbours' 100): 2^(100 - 6)
    assert row_factor[2, 0] == 2.0**94
    bits = fp8.view(torch.uint8)
    assert (bits[1, 64:96] == 0x80).all()                         # -0 stays -0
    assert fold_report(q).max_span == 5


@pytest.mark.parametrize("exps", [[-127, -127], [-127, -113], [-126, -120], [-120, -106],
                                  [120, 125], [113, 125], [0, 0]])
def test_tiny_and_huge_exponents(exps):
    codes = every_code_row(2).repeat(3, 1)
    q = make_q(codes, torch.tensor([exps]).repeat(3, 1), (1, 32))
    fp8, row_factor = fold(q)
    assert_bits_equal(fp8.float() * row_factor, q.dequantize(torch.float32))
    assert_bits_equal(fp8.double() * row_factor.double(), exact_values(q))


def test_beyond_float32_stays_exact_in_float64():
    """Exponent 127 (and 126) blocks can hold |v| >= 2^128: float32 cannot, dequantize saturates;
    the folded form keeps the value (float32 product +-Inf, float64 product exact)."""
    codes = every_code_row(2).repeat(2, 1)
    q = make_q(codes, torch.tensor([[127, 120], [126, 113]]), (1, 32))
    op = fold_operand(q)
    exact = exact_values(q)
    assert_bits_equal(folded_float64(op), exact)
    big = exact.abs() >= 2.0**128
    assert big.any()
    deq = q.dequantize(torch.float32)
    assert torch.equal(deq[big].abs(), torch.full_like(deq[big], torch.finfo(torch.float32).max))
    assert torch.isinf(op.unfold()[big]).all()
    assert_bits_equal(op.unfold()[~big], deq[~big])


def test_random_codes_and_wild_exponents():
    """Exponents uniform over all of E8M0 (-127..127), NaN blocks too: many chunks, still exact."""
    g = torch.Generator().manual_seed(3)
    codes = random_codes(40, 256, seed=3)
    exps = torch.randint(-127, 128, (40, 8), generator=g)
    exps[torch.rand(40, 8, generator=g) < 0.05] = 128             # NaN blocks
    q = make_q(codes, exps, (1, 32))
    op = fold_operand(q)
    assert len(op.bounds) > 2
    exact = exact_values(q)
    finite = exact.abs() < 2.0**128
    assert_bits_equal(op.unfold()[finite], q.dequantize(torch.float32)[finite])
    assert_bits_equal(folded_float64(op), exact)
    assert torch.equal(op.nan_rows, (exps == 128).any(1))


def test_nan_blocks_stay_nan_in_fold_and_gemm():
    codes = every_code_row(2).repeat(4, 1)
    exps = torch.tensor([[0, 0], [128, 3], [0, -5], [2, 128]])
    a = make_q(codes, exps, (1, 32))
    b = make_q(every_code_row(2).repeat(3, 1), torch.tensor([[0, 1], [2, 128], [-1, 0]]), (1, 32))
    fp8, row_factor = fold(a)
    assert_bits_equal(fp8.float() * row_factor, a.dequantize(torch.float32))
    out = fp4_gemm_fp8(a, b, out_dtype=torch.float32)
    ref, _ = reference_gemm(a, b)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))      # rows 1, 3 and column 1
    assert torch.isnan(out[1]).all() and torch.isnan(out[:, 1]).all()


# ---- the GEMM, emulated (CPU) ----------------------------------------------------------------

def linear_operands(tokens, d_in, d_out, binades, block, rule, seed=0):
    """The six operands of a linear layer's GEMMs, as (name, a, b) with C = a @ b^T:
    fprop X (tokens, in) . W (out, in); dgrad dY (tokens, out) . W^T (in, out);
    wgrad dY^T (out, tokens) . X^T (in, tokens). 2D tiles: the transposes are free; 1D blocks:
    each orientation is its own quantization along that GEMM's K."""
    x = spread(tokens, d_in, binades, seed, block)
    w = spread(d_out, d_in, binades, seed + 1, block)
    dy = spread(tokens, d_out, binades, seed + 2, block)

    def q(t):
        return quantize(t.contiguous(), "mxfp4", block=block, scale_rule=rule)

    if block[0] > 1:
        qx, qw, qdy = q(x), q(w), q(dy)
        return [("fprop", qx, qw), ("dgrad", qdy, qw.t()), ("wgrad", qdy.t(), qx.t())]
    return [("fprop", q(x), q(w)), ("dgrad", q(dy), q(w.T)), ("wgrad", q(dy.T), q(x.T))]


@pytest.mark.parametrize("binades", [6, 30])
@pytest.mark.parametrize("block", [(1, 32), (32, 32)], ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("rule", RULES)
def test_emulated_gemm_within_float32_accumulation(rule, block, binades):
    for name, a, b in linear_operands(64, 192, 96, binades, block, rule):
        ref, bound = reference_gemm(a, b)
        out = fp4_gemm_fp8(a, b, out_dtype=torch.float64)
        assert out.shape == ref.shape
        assert ((out - ref).abs() <= bound).all(), name
        # one rounding to the output dtype after that
        out_bf16 = fp4_gemm_fp8(a, b)
        assert out_bf16.dtype == torch.bfloat16
        ulp = torch.exp2(torch.frexp(ref)[1].double() - 8)        # bf16's spacing at |ref|
        assert ((out_bf16.double() - ref).abs() <= bound + ulp).all(), name


def test_gemm_takes_folded_operands_and_weight_pairs():
    block, rule = (32, 32), "rceil"
    x = quantize(spread(64, 128, 6, 0), "mxfp4", block=block, scale_rule=rule)
    w = quantize(spread(96, 128, 6, 1), "mxfp4", block=block, scale_rule=rule)
    dy = quantize(spread(64, 96, 6, 2), "mxfp4", block=block, scale_rule=rule)
    w_fprop, w_dgrad = weight_operands(w)
    assert isinstance(w_dgrad, FoldedOperand) and w_dgrad.shape == (128, 96)
    assert_bits_equal(w_fprop.unfold(), w.dequantize(torch.float32))
    assert_bits_equal(w_dgrad.unfold(), w.dequantize(torch.float32).T)
    y = fp4_gemm_fp8(x, w_fprop, out_dtype=torch.float32)
    assert torch.equal(y, fp4_gemm_fp8(x, w, out_dtype=torch.float32))
    dx = fp4_gemm_fp8(dy, w_dgrad, out_dtype=torch.float64)
    ref, bound = reference_gemm(dy, w.t())
    assert ((dx - ref).abs() <= bound).all()


def test_chunked_operands_with_different_bounds():
    """a and b chunked differently: the GEMM runs over the union of their boundaries."""
    codes_a, codes_b = random_codes(8, 256, 1), random_codes(6, 256, 2)
    a = make_q(codes_a, torch.tensor([[0, 20, 20, 20, 40, 40, 40, 40]]).repeat(8, 1), (1, 32))
    b = make_q(codes_b, torch.tensor([[0, 0, -30, -30, -30, -30, 10, 10]]).repeat(6, 1), (1, 32))
    assert fold_operand(a).bounds == (0, 32, 128, 256)
    assert fold_operand(b).bounds == (0, 64, 192, 256)
    assert len(gemm_pieces(fold_operand(a), fold_operand(b))) == 5
    ref, bound = reference_gemm(a, b)
    out = fp4_gemm_fp8(a, b, out_dtype=torch.float64)
    assert ((out - ref).abs() <= bound).all()


def test_scaled_mm_call_conventions_on_cpu():
    """The CUDA code path (padding K and N to 16, a row-major, b column-major, (M, 1) and
    (1, N) scales, chunks) run through torch's CPU _scaled_mm where this torch has one."""
    a = quantize(spread(24, 200, 30, 5), "mxfp4", block=(1, 32), scale_rule="rceil")
    b = quantize(spread(40, 200, 6, 6), "mxfp4", block=(1, 32), scale_rule="floor")
    fa, fb = fold_operand(a), fold_operand(b)
    pieces = gemm_pieces(fa, fb)
    try:
        out = fp4_gemm_fp8(fa, fb, torch.float32, backend="scaled_mm")
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"no CPU torch._scaled_mm here: {e}")
    assert len(pieces) > 1
    ref, bound = reference_gemm(a, b)
    assert ((out.double() - ref).abs() <= bound + ref.abs() * 2.0**-24).all()
    try:   # bf16 output takes the row-wise scales directly, which not every CPU build has
        fb1 = fold_operand(b)
        assert gemm_pieces(fb1, fb1) == [(0, 200, 0, 0)]
        one = fp4_gemm_fp8(fb1, fb1, torch.bfloat16, backend="scaled_mm")
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"this torch's CPU _scaled_mm has no row-wise scales: {str(e)[:200]}")
    ref_b, bound_b = reference_gemm(b, b)
    ulp = torch.exp2(torch.frexp(ref_b)[1].double() - 8)
    assert ((one.double() - ref_b).abs() <= bound_b + ulp).all()


# ---- errors --------------------------------------------------------------------------------

def test_rejects_what_does_not_fold():
    x = torch.randn(32, 64)
    with pytest.raises(ValueError, match="NVFP4 stays on the emulated path"):
        fold_operand(quantize(x, "nvfp4"))
    with pytest.raises(ValueError, match="only MXFP4"):
        fold_operand(quantize(x, "mxfp8_e4m3", scale_rule="rceil"))
    with pytest.raises(ValueError, match="square 2D tiles"):
        fold_operand(quantize(x, "mxfp4"), transpose=True)
    with pytest.raises(ValueError, match="2-D QTensor"):
        fold_operand(quantize(torch.randn(2, 32, 64), "mxfp4"))
    with pytest.raises(TypeError, match="QTensor"):
        fold_operand(x)
    with pytest.raises(ValueError, match="same K"):
        fp4_gemm_fp8(quantize(x, "mxfp4"), quantize(torch.randn(16, 96), "mxfp4"))


# ---- GPU: folding on CUDA, torch._scaled_mm ---------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("binades", [6, 30])
def test_cuda_fold_equals_cpu_fold(block, binades):
    q = quantize(spread(256, 512, binades, 7, block), "mxfp4", block=block, scale_rule="rceil")
    cpu, gpu = fold_operand(q), fold_operand(q.to("cuda"))
    assert gpu.bounds == cpu.bounds
    assert torch.equal(gpu.fp8.view(torch.uint8).cpu(), cpu.fp8.view(torch.uint8))
    assert torch.equal(gpu.factors.cpu(), cpu.factors)
    assert_bits_equal(gpu.unfold().cpu(), q.dequantize(torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("use_fast_accum", [False, True])
@pytest.mark.parametrize("binades", [6, 30])
@pytest.mark.parametrize("block", [(1, 32), (32, 32)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_scaled_mm_against_fp64(block, binades, use_fast_accum):
    for name, a, b in linear_operands(512, 1024, 768, binades, block, "rceil", seed=11):
        ref, _ = reference_gemm(a, b)
        ref = ref.cuda()
        ga, gb = a.to("cuda"), b.to("cuda")
        out32 = fp4_gemm_fp8(ga, gb, out_dtype=torch.float32, use_fast_accum=use_fast_accum)
        rel = ((out32.double() - ref).norm() / ref.norm()).item()
        assert rel <= GPU_REL_BOUND[use_fast_accum], (name, rel)
        out16 = fp4_gemm_fp8(ga, gb, use_fast_accum=use_fast_accum)
        rounding = ((ref.bfloat16().double() - ref).norm() / ref.norm()).item()
        rel16 = ((out16.double() - ref).norm() / ref.norm()).item()
        assert rel16 <= rounding + GPU_REL_BOUND[use_fast_accum], (name, rel16, rounding)


@pytest.mark.gpu
def test_scaled_mm_nan_rows_and_columns():
    codes = every_code_row(2).repeat(16, 1)
    exps = torch.zeros(16, 2, dtype=torch.long)
    exps[3, 1] = 128
    a = make_q(codes, exps, (1, 32))
    exps_b = torch.zeros(32, 2, dtype=torch.long)
    exps_b[5, 0] = 128
    b = make_q(every_code_row(2).repeat(32, 1), exps_b, (1, 32))
    out = fp4_gemm_fp8(a.to("cuda"), b.to("cuda"), out_dtype=torch.float32).cpu()
    ref, _ = reference_gemm(a, b)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))


def test_fp8_linear_folds_transposed_copies_only_for_a_backward(monkeypatch):
    """stable-fp4-fp8's forward makes the transposed folded copies of X and W only when a
    backward will use them: not under no_grad (evaluation), not for X^T when W needs no
    gradient; the output is the same either way."""
    import lowbit.dispatch as dispatch
    from lowbit.dispatch.fold_check import ACTIVE
    from lowbit.ops import quant_linear
    from lowbit.recipes import get_recipe

    calls = []
    original = dispatch.quantize_fold
    monkeypatch.setattr(dispatch, "quantize_fold",
                        lambda t, spec, transpose_too=False, check=ACTIVE:
                        calls.append(transpose_too) or original(t, spec, transpose_too, check))
    lin = get_recipe("stable-fp4-fp8").linear
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    y = quant_linear(x, w, None, lin)
    assert calls == [True, True]           # X and W, each with its transpose
    calls.clear()
    with torch.no_grad():
        y_eval = quant_linear(x, w, None, lin)
    assert calls == [False, False] and torch.equal(y_eval, y.detach())
    calls.clear()
    quant_linear(x, w.detach(), None, lin)
    assert calls == [False, True]          # dX needs W^T; no dW, so no X^T


# ---- every expert at once: grouped_fp4_gemm_fp8 --------------------------------------------

def grouped_operands(seed=0, binades=30):
    """(A rows (P, K) with 4 groups, one empty, B stacked (4 * 48, K); A^T-style (M, P) and
    (N, P) for groups along K), MXFP4 with exponents spread so that folds need K-chunks."""
    q = lambda rows, cols, s: quantize(spread(rows, cols, binades, s), "mxfp4", block=(1, 32))  # noqa: E731
    ends = torch.tensor([32, 32, 96, 128], dtype=torch.int32)      # group 1 empty
    return q(128, 96, seed), q(4 * 48, 96, seed + 1), q(32, 128, seed + 2), q(48, 128, seed + 3), ends


def test_folded_operand_rows_and_columns_are_the_same_values():
    a = fold_operand(quantize(spread(40, 200, 30, 3), "mxfp4", block=(1, 32)))
    assert len(a.bounds) > 2
    whole = folded_float64(a)
    assert torch.equal(folded_float64(a.rows(8, 20)), whole[8:20])
    for start, stop in [(0, 200), (10, 75), (64, 65), (150, 200)]:
        part = a.columns(start, stop)
        assert part.bounds[0] == 0 and part.bounds[-1] == stop - start
        assert part.factors.shape[1] == len(part.bounds) - 1
        assert torch.equal(folded_float64(part), whole[:, start:stop])


def float64_gemm(a64, b64):
    """a64 @ b64.T and the float32-accumulation bound gamma_K * (|A| |B|^T)."""
    k = a64.shape[1]
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
    return a64 @ b64.T, gamma * (a64.abs() @ b64.abs().T)


@pytest.mark.parametrize("backend", [None, "loop"])
def test_grouped_gemm_is_each_groups_gemm(backend):
    qa, qb, qm, qn, ends = grouped_operands()
    fa, fb, fm, fn = map(fold_operand, (qa, qb, qm, qn))
    assert len(fa.bounds) > 2 and len(fm.bounds) > 2             # chunked operands
    a64, b64, m64, n64 = map(folded_float64, (fa, fb, fm, fn))
    starts = [0, *ends.tolist()]
    out = grouped_fp4_gemm_fp8(fa, fb, ends, "rows", torch.float64, backend=backend)
    out_k = grouped_fp4_gemm_fp8(fm, fn, ends, "k", torch.float64, backend=backend)
    assert out.shape == (128, 48) and out_k.shape == (4, 32, 48)
    assert torch.equal(out_k[1], torch.zeros(32, 48, dtype=torch.float64))   # the empty group
    for e in range(4):
        lo, hi = starts[e], starts[e + 1]
        want, bound = float64_gemm(a64[lo:hi], b64[e * 48:(e + 1) * 48])
        assert ((out[lo:hi] - want).abs() <= bound).all()
        want, bound = float64_gemm(m64[:, lo:hi], n64[:, lo:hi])
        assert ((out_k[e] - want).abs() <= bound).all()
        if hi > lo:   # each group is exactly fp4_gemm_fp8 on its own slices
            assert torch.equal(out_k[e], fp4_gemm_fp8(fm.columns(lo, hi), fn.columns(lo, hi), torch.float64))
            assert torch.equal(out[lo:hi], fp4_gemm_fp8(fa.rows(lo, hi), fb.rows(e * 48, (e + 1) * 48),
                                                        torch.float64))


def fake_scaled_grouped_mm(calls):
    """torch._scaled_grouped_mm on the CPU: its argument checks (torch's meta kernel, the CUDA
    kernel's rules) on meta copies, then what it computes -- row-wise scales, group-major for
    groups along K -- in float64, cast to bf16."""
    def run(a, b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
        meta = [t.to("meta") if t is not None else None for t in (a, b, scale_a, scale_b, offs)]
        torch.ops.aten._scaled_grouped_mm(*meta, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
        calls.append((a.dim(), b.dim()))
        a64, b64, starts = a.double(), b.double(), [0, *offs.tolist()]
        if b.dim() == 3:                                          # (P, K) x (E, K, N): rows
            out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
            for e in range(b.shape[0]):
                r0, r1 = starts[e], starts[e + 1]
                out[r0:r1] = (a64[r0:r1] * scale_a[r0:r1, None]) @ (b64[e] * scale_b[e][None, :])
        else:                                                     # (M, P) x (P, N): along K
            m, n, groups = a.shape[0], b.shape[1], offs.shape[0]
            out = torch.empty(groups, m, n, dtype=torch.float64)
            for e in range(groups):
                k0, k1 = starts[e], starts[e + 1]
                out[e] = ((a64[:, k0:k1] * scale_a[e * m:(e + 1) * m, None])
                          @ (b64[k0:k1] * scale_b[e * n:(e + 1) * n][None, :]))
        return out.to(out_dtype)
    return run


def test_scaled_grouped_mm_call_conventions_on_cpu(monkeypatch):
    """The CUDA path's arguments (layouts, scale shapes and order, offsets) checked by torch's
    own meta kernel and run through a float64 model of the op: equal to the loop's result."""
    calls = []
    monkeypatch.setattr(torch, "_scaled_grouped_mm", fake_scaled_grouped_mm(calls), raising=False)
    qa, qb, qm, qn, ends = grouped_operands(binades=3)
    fa, fb, fm, fn = map(fold_operand, (qa, qb, qm, qn))
    assert all(len(f.bounds) == 2 for f in (fa, fb, fm, fn))     # one chunk each
    for along, a, b in [("rows", fa, fb), ("k", fm, fn)]:
        got = grouped_fp4_gemm_fp8(a, b, ends, along, backend="scaled_grouped_mm")
        want = grouped_fp4_gemm_fp8(a, b, ends, along, torch.float64, backend="loop")
        if along == "k":
            assert torch.equal(got[1], torch.zeros_like(got[1]))  # the empty group
        torch.testing.assert_close(got.double(), want.bfloat16().double(), rtol=2**-7, atol=0)
    assert calls == [(2, 3), (2, 2)]


def side_by_side(binades, seed=5, segmented=False):
    """B for b_layout="side_by_side": 4 experts' (48, 96) operands side by side, (48, 4 * 96), MXFP4 blocked
    along K (blocks within an expert); segmented: folded expert by expert into one factor per
    row and expert (as the fold kernels write W^T's operand), else folded as one tensor."""
    q = quantize(spread(48, 4 * 96, binades, seed), "mxfp4", block=(1, 32))
    if not segmented:
        return fold_operand(q)
    parts = [fold_operand(quantize(q.dequantize(torch.float32)[:, e * 96:(e + 1) * 96], "mxfp4",
                                   block=(1, 32))) for e in range(4)]
    assert all(len(p.bounds) == 2 for p in parts)
    return FoldedOperand(torch.cat([p.fp8 for p in parts], dim=1),
                         torch.cat([p.factors for p in parts], dim=1), (0, 4 * 96),
                         torch.stack([p.nan_rows for p in parts], dim=1),
                         torch.tensor([96, 192, 288, 384], dtype=torch.int32))


@pytest.mark.parametrize("segmented", [False, True])
@pytest.mark.parametrize("backend", [None, "loop"])
def test_grouped_gemm_takes_the_experts_operands_side_by_side(backend, segmented):
    # dgrad on the forward's W^T operand: B_e = B[:, e K:(e + 1) K], each group exactly
    # fp4_gemm_fp8 on its rows of A and its column block of B
    qa, _, _, _, ends = grouped_operands(binades=3 if segmented else 30)
    fa, fs = fold_operand(qa), side_by_side(3 if segmented else 30, segmented=segmented)
    assert (len(fs.bounds) > 2) == (not segmented)
    out = grouped_fp4_gemm_fp8(fa, fs, ends, "rows", torch.float64, backend=backend, b_layout="side_by_side")
    starts = [0, *ends.tolist()]
    whole = fs.unfold().double() if segmented else folded_float64(fs)   # 3 binades: float32 holds it
    for e in range(4):
        lo, hi = starts[e], starts[e + 1]
        if hi > lo:
            b_e = FoldedOperand(fs.fp8[:, e * 96:(e + 1) * 96], fs.factors[:, e:e + 1], (0, 96),
                                fs.nan_rows[:, e]) if segmented else fs.columns(e * 96, (e + 1) * 96)
            assert torch.equal(folded_float64(b_e), whole[:, e * 96:(e + 1) * 96])
            assert torch.equal(out[lo:hi], fp4_gemm_fp8(fa.rows(lo, hi), b_e, torch.float64))


def test_scaled_grouped_mm_takes_the_experts_operands_side_by_side_on_cpu(monkeypatch):
    """b_layout="side_by_side" on the CUDA path's call (B_e^T as a strided view of its column
    block, the factors per row and expert expert-major), checked by torch's meta kernel and the
    float64 model of the op against the loop; a NaN block in one expert's B makes NaN only that
    expert's rows; an unsegmented B goes group by group (its NaN flags span every expert)."""
    calls = []
    monkeypatch.setattr(torch, "_scaled_grouped_mm", fake_scaled_grouped_mm(calls), raising=False)
    qa, _, _, _, ends = grouped_operands(binades=3)
    fa = fold_operand(qa)
    fs = side_by_side(3, segmented=True)
    fs.fp8[5, 0] = float("nan")                        # expert 0's column block, row 5
    fs = FoldedOperand(fs.fp8, fs.factors, fs.bounds,
                       fs.nan_rows | ((torch.arange(4) == 0)[None, :] & (torch.arange(48) == 5)[:, None]),
                       fs.segment_ends)
    got = grouped_fp4_gemm_fp8(fa, fs, ends, "rows", backend="scaled_grouped_mm", b_layout="side_by_side")
    want = grouped_fp4_gemm_fp8(fa, fs, ends, "rows", torch.float64, backend="loop", b_layout="side_by_side")
    rows = int(ends[-1])
    torch.testing.assert_close(got[:rows].double(), want[:rows].bfloat16().double(), rtol=2**-7, atol=0,
                               equal_nan=True)
    nan_rows = torch.isnan(got[:rows, 5])
    assert nan_rows[:32].all() and not nan_rows[32:].any()   # expert 0 holds rows 0..31
    assert calls == [(2, 3)]
    with pytest.raises(ValueError, match="segmented by expert"):
        grouped_fp4_gemm_fp8(fa, side_by_side(3), ends, "rows", backend="scaled_grouped_mm",
                             b_layout="side_by_side")


def test_grouped_gemm_refuses_what_it_cannot_do():
    qa, qb, _, _, ends = grouped_operands()
    fa, fb = fold_operand(qa), fold_operand(qb)
    with pytest.raises(ValueError, match="along must be"):
        grouped_fp4_gemm_fp8(fa, fb, ends, "cols")
    with pytest.raises(ValueError, match="backend must be"):
        grouped_fp4_gemm_fp8(fa, fb, ends, "rows", backend="cublas")
    with pytest.raises(ValueError, match="same K"):
        grouped_fp4_gemm_fp8(fa, fb.rows(0, 190), ends, "rows")
    with pytest.raises(ValueError, match="one K-chunk"):
        grouped_fp4_gemm_fp8(fa, fb, ends, "rows", backend="scaled_grouped_mm")
    with pytest.raises(ValueError, match="b_layout must be"):
        grouped_fp4_gemm_fp8(fa, fb, ends, "k", b_layout="side_by_side")
    with pytest.raises(ValueError, match="same K"):   # stacked B given as side by side
        grouped_fp4_gemm_fp8(fa, fb, ends, "rows", b_layout="side_by_side")
    fs = side_by_side(3, segmented=True)
    fs = FoldedOperand(fs.fp8, fs.factors[:, :2], fs.bounds, fs.nan_rows[:, :2], fs.segment_ends[:2])
    with pytest.raises(ValueError, match="one per group"):
        grouped_fp4_gemm_fp8(fa, fs, ends, "rows", b_layout="side_by_side")


@pytest.mark.gpu
@pytest.mark.parametrize("binades", [3, 30])
def test_scaled_grouped_mm_equals_the_group_by_group_gemms(binades):
    qa, qb, qm, qn, ends = grouped_operands(binades=binades)
    fa, fb, fm, fn = (fold_operand(q.to("cuda")) for q in (qa, qb, qm, qn))
    ends = ends.cuda()
    fs = side_by_side(binades, segmented=binades == 3)
    fs = FoldedOperand(fs.fp8.cuda(), fs.factors.cuda(), fs.bounds, fs.nan_rows.cuda(),
                       None if fs.segment_ends is None else fs.segment_ends.cuda())
    for along, a, b, b_layout in [("rows", fa, fb, "stacked"), ("k", fm, fn, "stacked"),
                                  ("rows", fa, fs, "side_by_side")]:
        want = grouped_fp4_gemm_fp8(a, b, ends, along, torch.float32, backend="loop",
                                    b_layout=b_layout).cpu().double()
        one_chunk = len(a.bounds) == len(b.bounds) == 2
        assert one_chunk == (binades == 3)
        got = grouped_fp4_gemm_fp8(a, b, ends, along,   # the grouped GEMM where one chunk each
                                   backend="scaled_grouped_mm" if one_chunk else None, b_layout=b_layout)
        rows = ends[-1].item() if along == "rows" else got.shape[0]
        got, want = got[:rows].cpu().double(), want[:rows]
        rel = ((got - want).norm() / want.norm()).item()
        assert rel <= 2**-8 + GPU_REL_BOUND[False], (along, rel)


@pytest.mark.gpu
def test_scaled_grouped_mm_takes_factors_per_row_and_group():
    # wgrad operands whose tokens (K) come from groups at magnitudes 2^36 apart, folded by the
    # kernels with one factor per row and group (segment_ends): the grouped GEMM on them equals
    # the group-by-group GEMMs on the same operands, and each group's exact GEMM
    from lowbit.formats import QuantSpec, quantize_with_spec
    from lowbit.kernels.fp8_fold import quantize_fold_mxfp4
    spec = QuantSpec.make("mxfp4", (32, 32), "floor")
    g = torch.Generator().manual_seed(21)
    ends = torch.tensor([64, 64, 192, 256], dtype=torch.int32, device="cuda")
    xs = []
    for start, end, e in ((0, 64, 18), (64, 192, -18), (192, 256, 0)):
        xs.append(torch.randn(end - start, 96 + 48, generator=g) * 2.0 ** e)
    x = torch.cat(xs).to(torch.bfloat16).cuda()
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    a = quantize_fold_mxfp4(x[:, :96].contiguous(), spec, transpose=True, counter=counter,
                            segment_ends=ends)
    b = quantize_fold_mxfp4(x[:, 96:].contiguous(), spec, transpose=True, counter=counter,
                            segment_ends=ends)
    assert counter.item() == 0 and a.segment_ends is ends
    got = grouped_fp4_gemm_fp8(a, b, ends, "k", backend="scaled_grouped_mm").cpu().double()
    loop = grouped_fp4_gemm_fp8(a, b, ends, "k", torch.float32, backend="loop").cpu().double()
    qa = quantize_with_spec(x[:, :96].cpu().float(), spec).dequantize(torch.float64)
    qb = quantize_with_spec(x[:, 96:].cpu().float(), spec).dequantize(torch.float64)
    assert not got[1].any()                       # the empty group
    for e, (start, end) in enumerate(((0, 64), (64, 64), (64, 192), (192, 256))):
        if end == start:
            continue
        exact = qa[start:end].T @ qb[start:end]
        for c in (got[e], loop[e]):
            rel = ((c - exact).norm() / exact.norm()).item()
            assert rel <= 2**-8 + GPU_REL_BOUND[False], (e, rel)


def test_operands_with_factors_per_group_run_group_by_group_and_nowhere_else():
    # on the CPU (the fold kernels under Triton's interpreter) the group-by-group path takes
    # each group's factors; a plain GEMM and the rows layout refuse such an operand
    pytest.importorskip("triton")
    from lowbit.formats import quantize_with_spec
    from lowbit.kernels.fp8_fold import quantize_fold_mxfp4
    spec = QuantSpec.make("mxfp4", (32, 32), "floor")
    g = torch.Generator().manual_seed(22)
    x = torch.cat([torch.randn(32, 64, generator=g) * 2.0 ** 20,
                   torch.randn(64, 64, generator=g) * 2.0 ** -20])
    ends = torch.tensor([32, 96], dtype=torch.int32)
    a = quantize_fold_mxfp4(x[:, :32].contiguous(), spec, transpose=True, segment_ends=ends,
                            counter=torch.zeros(1, dtype=torch.int64))
    b = quantize_fold_mxfp4(x[:, 32:].contiguous(), spec, transpose=True, segment_ends=ends,
                            counter=torch.zeros(1, dtype=torch.int64))
    got = grouped_fp4_gemm_fp8(a, b, ends, "k", torch.float64).double()
    qa = quantize_with_spec(x[:, :32], spec).dequantize(torch.float64)
    qb = quantize_with_spec(x[:, 32:], spec).dequantize(torch.float64)
    for e, (start, end) in enumerate(((0, 32), (32, 96))):
        exact = qa[start:end].T @ qb[start:end]
        assert ((got[e] - exact).norm() / exact.norm()).item() < 1e-6
    with pytest.raises(ValueError, match="grouped_fp4_gemm_fp8"):
        fp4_gemm_fp8(a, b)
    with pytest.raises(ValueError, match="along='k'"):
        grouped_fp4_gemm_fp8(a, b, ends, "rows")
