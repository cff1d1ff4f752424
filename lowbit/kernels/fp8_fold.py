"""Quantize to MXFP4 and fold into FP8 E4M3 in two Triton passes over x, with no QTensor between.

    a = quantize_fold_mxfp4(x, spec)                 # == fold_operand(quantize_with_spec(x, spec))
    a_t = quantize_fold_mxfp4(x, spec2d, transpose=True)   # == fold_operand(q, transpose=True)
    a, a_t = quantize_fold_mxfp4_with_transpose(x, spec2d) # both, from the same two passes

The result equals `fold_operand(quantize_with_spec(x, spec), transpose)` bit for bit: the same
E4M3 bytes, factors, K-chunk bounds and NaN rows (lowbit/formats/fold.py derives the
folding; lowbit/kernels/quantize.py how the quantizer's bits match the reference).

Why two passes: a row's factor, and where K splits into chunks, depend on the exponents of all
its blocks, so no element can be written before the whole row's scales are known. Pass 2
quantizes the tile with the quantize kernel's own scale and rounding helpers (so the same
codes; for stochastic rounding the same Philox uniforms, which depend only on the seed and the
element's index). Two ways to fold:

One K-chunk, no host sync (`_fold_one_chunk`, tried first):
1. `_band_max_kernel`: per row of x the largest exponent of a finite block, and whether the row
   holds a NaN/Inf block, raised across the row's tiles with atomic max; with square 2D tiles
   the same per column (row of x^T). The fold takes the factor from every finite block's
   exponent, live or not (a block whose codes are all zero has the smallest exponent unless it
   is a zero row-segment of a 2D tile), so this pass needs only the block scales, from the
   blocks' amaxes: no element is rounded. And with 2D tiles all BR rows of a tile band share
   their blocks' exponents, so the stats are kept per band (BR rows), not per row.
2. `_fold_one_chunk_kernel`: each band's factor exponent f = max(s_max - 6, -126), each block's
   shift s - f, and the E4M3 bytes of E2M1(code) * 2^(s - f) for x and x^T (x^T's blocks are
   the same tiles) from the same registers: the FP4 value times 2^(s - f) is exact in float32
   and on E4M3's grid, so a float32 -> E4M3 conversion writes it. Factors and NaN rows come
   from the first tile column (row). A live block below the window (its row spans more than
   14 binades) cannot be written exactly: its nonzero values are added to an int64 counter on
   the device (counted only in tiles holding a block below the window; an all-zero block can
   be one, and adds nothing).
   Without a deferred fold check's counter (lowbit.dispatch.fold_check) the count is read back
   (the one host sync) and a nonzero count falls back to the planned fold; with one, nothing is
   read back: the counter accumulates over every fold and the check's owner (lowbit.train's
   step) redoes the work if it is nonzero.

Planned (`_fold_planned`, exact for any span, one host sync per K-chunk):
1. `_live_blocks_kernel` writes the E8M0 scale codes and, per row-block, a live flag.
2. Torch ops on those (R, K/b) tensors: the chunk bounds and factors by the reference fold's
   own rules (`BlockExponents.chunk_bounds` / `plan`) and each block's row of its shift table.
3. `_fold_kernel` writes the E4M3 bytes as pass 2 above, with each block's shift from its row.

Traffic per element (bf16 x): pass 1 reads 2 bytes, pass 2 reads 2 and writes 1 (2 with the
transpose). Measured GPU times: docs/results/kernels.md (`lowbit bench fp8`).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from lowbit.formats import fold
from lowbit.formats.fold import BlockExponents, FoldedOperand
from lowbit.formats.quantize import check_input
from lowbit.formats.spec import QuantSpec, ScaleKind, ScaleRule
from lowbit.kernels import quantize as kq
from lowbit.kernels import seed_tensor, supports
from lowbit.kernels.launch import cdiv
from lowbit.kernels.quantize import (
    SIGN_MASK, block_max, e8m0_exponent, expand_blocks, load_float32, philox_uniforms, pow2,
    pow2_wide, round_value,
)

__all__ = ["quantize_fold_mxfp4", "quantize_fold_mxfp4_with_transpose", "fold_configs",
           "fold_pass_one", "encode_shifted"]

# the reference fold's numbers as Triton constants
NONE_C = tl.constexpr(fold.NONE_HI)
SHIFT_MIN_C = tl.constexpr(fold.SHIFT_MIN)
SHIFT_MAX_C = tl.constexpr(fold.SHIFT_MAX)
NAN_ROW_C = tl.constexpr(fold.NAN_ROW)
FACTOR_EXP_MIN_C = tl.constexpr(fold.FACTOR_EXP_MIN)


@triton.jit
def _load_tile(x_ptr, R, C, stride_r, stride_c, pid_r, pid_c, TILE_R: tl.constexpr,
               TILE_C: tl.constexpr, NATIVE_CAST: tl.constexpr, EVEN: tl.constexpr):
    """x's tile as float32 (padding 0), its rows and columns, and which elements are in x
    (EVEN: the tiles cover x exactly, so the load is not masked; stores need no mask either)."""
    rows = pid_r * TILE_R + tl.arange(0, TILE_R)
    cols = pid_c * TILE_C + tl.arange(0, TILE_C)
    ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_r + cols.to(tl.int64)[None, :] * stride_c
    in_bounds = (rows[:, None] < R) & (cols[None, :] < C)
    if EVEN:
        x = load_float32(ptrs, None, NATIVE_CAST)
    else:
        x = load_float32(ptrs, in_bounds, NATIVE_CAST)
    return x, rows, cols, in_bounds


@triton.jit
def _block_exponents(x, RCEIL: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                     TILE_R: tl.constexpr, TILE_C: tl.constexpr):
    """(TR, TC) float32 -> per block (TR/BR, TC/BC): the E8M0 scale exponent (unbiased) and
    whether the block holds a NaN or Inf (scale code 255): the quantize kernel's MX scales."""
    amax_bits = block_max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, TILE_R, TILE_C, BR, BC)
    return e8m0_exponent(amax_bits, 2, 6.0, RCEIL), amax_bits >= 0x7F800000


@triton.jit
def _e2m1_values(x, e, u, STOCHASTIC: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                 TILE_R: tl.constexpr, TILE_C: tl.constexpr):
    """The tile's FP4 values without their block scales, E2M1(code) as float32 (TR, TC) with
    x's sign (meaningless in NaN/Inf blocks; +-0 iff the code's magnitude is 0): the quantize
    kernel's MX path for E2M1, step for step."""
    mag = tl.minimum(tl.abs(x * expand_blocks(pow2_wide(-e), TILE_R, TILE_C, BR, BC)), 6.0)
    value = round_value(mag, u, 0, 1, 6.0, STOCHASTIC)
    sign = x.to(tl.int32, bitcast=True) & SIGN_MASK           # copysign, -0.0 too
    return (value.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def encode_shifted(values, shift, bad, BR: tl.constexpr, BC: tl.constexpr, TILE_R: tl.constexpr,
            TILE_C: tl.constexpr, NATIVE_CAST: tl.constexpr):
    """E4M3 bits, uint8 (TR, TC), of values * 2^shift with one shift per block (TR/BR, TC/BC),
    and E4M3 NaN (0x7F) in NaN/Inf blocks. A shift below the window is taken as SHIFT_MIN (the
    caller counts those blocks' values as inexact); in the window, E2M1 * 2^shift is an E4M3
    value, so the product is exact and the float32 -> E4M3 conversion only re-encodes it (so
    also in Triton's interpreter, whose conversion is wrong only off E4M3's grid and for NaN).
    NaN blocks scale by NaN: the GPU's conversion (cvt.rn.satfinite) gives 0x7F for a NaN;
    the interpreter's does not, so there it is set."""
    t = tl.minimum(tl.maximum(shift, SHIFT_MIN_C), SHIFT_MAX_C)
    scale = tl.where(bad, 0x7FC00000, (t + 127) << 23).to(tl.float32, bitcast=True)  # NaN / 2^t
    scaled = values * expand_blocks(scale, TILE_R, TILE_C, BR, BC)
    bits = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    if not NATIVE_CAST:
        bits = tl.where(scaled != scaled, 0x7F, bits).to(tl.uint8)
    return bits


@triton.jit
def _factor_exponent(hi):
    """f = max(s_max - SHIFT_MAX, -126) over a row's finite blocks, 0 for a row with none."""
    return tl.where(hi > NONE_C, tl.maximum(hi - SHIFT_MAX_C, FACTOR_EXP_MIN_C), 0)


@triton.jit
def _band_max_kernel(
    x_ptr, scales_ptr, stats_ptr, stats_t_ptr, segment_ptr,
    R, C, stride_r, stride_c, n_bands, n_bands_t, n_segments,
    RCEIL: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, TILE_R: tl.constexpr,
    TILE_C: tl.constexpr, ROWS: tl.constexpr, TRANSPOSE: tl.constexpr, NATIVE_CAST: tl.constexpr,
    EVEN: tl.constexpr, SEGMENTED: tl.constexpr,
):
    # Pass 1 of the one-chunk fold. scales: (n_bands, n_bands_t) uint8, each block's E8M0 code
    # (255: NaN/Inf), for pass 2. stats: (2, n_bands) int32, per band of rows (a row for 1D
    # blocks, BR rows for 2D tiles, which share every block exponent) the largest exponent of
    # a finite block and whether it holds a NaN/Inf block, initialised to NONE and raised with
    # atomic max across the band's tiles; stats_t (2, n_segments, n_bands_t) the same per band
    # of columns (rows of x^T) and segment of x's rows (SEGMENTED: segment_ptr holds each row
    # band's segment, and a tile is one band; else one segment). The scales alone decide the
    # factor, so no element is rounded here.
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    x, _, _, _ = _load_tile(x_ptr, R, C, stride_r, stride_c, pid_r, pid_c, TILE_R, TILE_C,
                            NATIVE_CAST, EVEN)
    e, bad = _block_exponents(x, RCEIL, BR, BC, TILE_R, TILE_C)
    bands = pid_r * (TILE_R // BR) + tl.arange(0, TILE_R // BR)
    bands_t = pid_c * (TILE_C // BC) + tl.arange(0, TILE_C // BC)
    real = (bands[:, None] < n_bands) & (bands_t[None, :] < n_bands_t)   # not the tile's padding
    tl.store(scales_ptr + bands.to(tl.int64)[:, None] * n_bands_t + bands_t[None, :],
             tl.where(bad, 255, e + 127).to(tl.uint8), mask=real)
    e = tl.where(real & ~bad, e, NONE_C)
    nan = (real & bad).to(tl.int32)
    if ROWS:
        hi = tl.max(e, axis=1)
        any_nan = tl.max(nan, axis=1)
        tl.atomic_max(stats_ptr + bands, hi, mask=(bands < n_bands) & (hi > NONE_C))
        tl.atomic_max(stats_ptr + n_bands + bands, any_nan, mask=(bands < n_bands) & (any_nan > 0))
    if TRANSPOSE:
        hi_t = tl.max(e, axis=0)
        any_nan_t = tl.max(nan, axis=0)
        at = _segment_stats(stats_t_ptr, segment_ptr, pid_r, n_bands_t, SEGMENTED) + bands_t
        tl.atomic_max(at, hi_t, mask=(bands_t < n_bands_t) & (hi_t > NONE_C))
        tl.atomic_max(at + n_segments * n_bands_t, any_nan_t,
                      mask=(bands_t < n_bands_t) & (any_nan_t > 0))


@triton.jit
def _segment_stats(stats_t_ptr, segment_ptr, pid_r, n_bands_t, SEGMENTED: tl.constexpr):
    """Where the x^T stats of row tile pid_r's segment start (SEGMENTED: a tile is one band of
    rows, whose segment segment_ptr holds)."""
    if SEGMENTED:
        return stats_t_ptr + tl.load(segment_ptr + pid_r).to(tl.int64) * n_bands_t
    else:
        return stats_t_ptr


@triton.jit
def _store_factors(stats_ptr, n_bands, factors_ptr, nan_ptr, idx, n, B: tl.constexpr):
    """Each row's factor 2^f and NaN flag (uint8) from its band's stats (row idx, band idx // B)."""
    hi = tl.load(stats_ptr + idx // B, mask=idx < n, other=NONE_C)
    tl.store(factors_ptr + idx, pow2(_factor_exponent(hi)), mask=idx < n)
    has_nan = tl.load(stats_ptr + n_bands + idx // B, mask=idx < n, other=0) > 0
    tl.store(nan_ptr + idx, has_nan.to(tl.uint8), mask=idx < n)


@triton.jit
def _fold_one_chunk_kernel(
    x_ptr, seed_ptr, scales_ptr, stats_ptr, stats_t_ptr, segment_ptr, fp8_ptr, fp8_t_ptr,
    factors_ptr, factors_t_ptr, nan_ptr, nan_t_ptr, over_ptr,
    R, C, stride_r, stride_c, n_bands, n_bands_t,
    RCEIL: tl.constexpr, STOCHASTIC: tl.constexpr, GROUP4: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr,
    ROWS: tl.constexpr, TRANSPOSE: tl.constexpr, NATIVE_CAST: tl.constexpr, EVEN: tl.constexpr,
    SEGMENTED: tl.constexpr,
):
    # Pass 2 of the one-chunk fold: the block scales pass 1 wrote, one factor per band from its
    # stats, one shift per block, the E4M3 bytes of x (and x^T from the same registers); the
    # first tile column (row) writes the factors and NaN flags of x's (x^T's) rows (SEGMENTED:
    # x^T's factor of each tile is its row segment's, and the host writes x^T's factors). over:
    # int64 counter of the nonzero values in blocks below their row's window (left inexact).
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    x, rows, cols, in_bounds = _load_tile(x_ptr, R, C, stride_r, stride_c, pid_r, pid_c,
                                          TILE_R, TILE_C, NATIVE_CAST, EVEN)
    u = 0.0
    if STOCHASTIC:  # the seed contract: x is 2-D, so element (r, c) has index r * C + c
        u = philox_uniforms(tl.load(seed_ptr), 0, C, rows, pid_c * TILE_C, TILE_R, TILE_C, GROUP4)
    bands = pid_r * (TILE_R // BR) + tl.arange(0, TILE_R // BR)
    bands_t = pid_c * (TILE_C // BC) + tl.arange(0, TILE_C // BC)
    code = tl.load(scales_ptr + bands.to(tl.int64)[:, None] * n_bands_t + bands_t[None, :],
                   mask=(bands[:, None] < n_bands) & (bands_t[None, :] < n_bands_t),
                   other=0).to(tl.int32)
    e, bad = code - 127, code == 255
    values = _e2m1_values(x, e, u, STOCHASTIC, BR, BC, TILE_R, TILE_C)
    below = tl.zeros((TILE_R // BR, TILE_C // BC), dtype=tl.int32)
    if ROWS:
        f = _factor_exponent(tl.load(stats_ptr + bands, mask=bands < n_bands, other=NONE_C))
        shift = e - f[:, None]
        bits = encode_shifted(values, shift, bad, BR, BC, TILE_R, TILE_C, NATIVE_CAST)
        if EVEN:
            tl.store(fp8_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], bits)
        else:
            tl.store(fp8_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], bits,
                     mask=in_bounds)
        below += (shift < SHIFT_MIN_C).to(tl.int32)
        if pid_c == 0:
            _store_factors(stats_ptr, n_bands, factors_ptr, nan_ptr, rows, R, BR)
    if TRANSPOSE:
        at = _segment_stats(stats_t_ptr, segment_ptr, pid_r, n_bands_t, SEGMENTED) + bands_t
        f_t = _factor_exponent(tl.load(at, mask=bands_t < n_bands_t, other=NONE_C))
        shift_t = e - f_t[None, :]
        bits_t = encode_shifted(values, shift_t, bad, BR, BC, TILE_R, TILE_C, NATIVE_CAST)
        if EVEN:
            tl.store(fp8_t_ptr + cols.to(tl.int64)[:, None] * R + rows[None, :], tl.trans(bits_t))
        else:
            tl.store(fp8_t_ptr + cols.to(tl.int64)[:, None] * R + rows[None, :], tl.trans(bits_t),
                     mask=tl.trans(in_bounds))
        below += (shift_t < SHIFT_MIN_C).to(tl.int32)
        if pid_r == 0 and not SEGMENTED:
            _store_factors(stats_t_ptr, n_bands_t, factors_t_ptr, nan_t_ptr, cols, C, BC)
    real = (bands[:, None] < n_bands) & (bands_t[None, :] < n_bands_t)   # not the tile's padding
    below = tl.where(bad | ~real, 0, below)
    if tl.max(tl.max(below, axis=1), axis=0) > 0:   # count what the window loses
        # per element: how many of its operands (x's, x^T's) leave it inexact
        lost = (values != 0).to(tl.int32) * expand_blocks(below, TILE_R, TILE_C, BR, BC)
        tl.atomic_add(over_ptr, tl.sum(tl.sum(lost, axis=1), axis=0).to(tl.int64))


@triton.jit
def _live_blocks_kernel(
    x_ptr, seed_ptr, scales_ptr, live_ptr, live_t_ptr,
    R, C, stride_r, stride_c, n_scale_rows, n_scale_cols,
    RCEIL: tl.constexpr, STOCHASTIC: tl.constexpr, GROUP4: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr,
    TRANSPOSE: tl.constexpr, NATIVE_CAST: tl.constexpr,
):
    # Pass 1 of the planned fold. scales: (R, nC) for 1D blocks, (nR, nC) for 2D tiles (E8M0
    # codes); live: (R, nC) uint8, a row-block (1 x BC along K) holds a nonzero finite code;
    # live_t: (C, nR), the same for x^T's row-blocks (x's column segments of BR rows)
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    x, rows, cols, _ = _load_tile(x_ptr, R, C, stride_r, stride_c, pid_r, pid_c, TILE_R,
                                  TILE_C, NATIVE_CAST, False)
    u = 0.0
    if STOCHASTIC:
        u = philox_uniforms(tl.load(seed_ptr), 0, C, rows, pid_c * TILE_C, TILE_R, TILE_C, GROUP4)
    e, bad = _block_exponents(x, RCEIL, BR, BC, TILE_R, TILE_C)
    nonzero = (_e2m1_values(x, e, u, STOCHASTIC, BR, BC, TILE_R, TILE_C) != 0).to(tl.int32)
    bad_i = bad.to(tl.int32)
    scale_cols = pid_c * (TILE_C // BC) + tl.arange(0, TILE_C // BC)
    scale_rows = pid_r * (TILE_R // BR) + tl.arange(0, TILE_R // BR)
    live = block_max(nonzero, TILE_R, TILE_C, 1, BC) > 0                      # (TR, TC/BC)
    if BR > 1:
        bad_i = expand_blocks(bad_i, TILE_R, TILE_C // BC, BR, 1)
    row_mask = (rows[:, None] < R) & (scale_cols[None, :] < n_scale_cols)
    tl.store(live_ptr + rows.to(tl.int64)[:, None] * n_scale_cols + scale_cols[None, :],
             (live & (bad_i == 0)).to(tl.uint8), mask=row_mask)
    scale_code = tl.where(bad, 255, e + 127).to(tl.uint8)
    if BR == 1:
        tl.store(scales_ptr + rows.to(tl.int64)[:, None] * n_scale_cols + scale_cols[None, :],
                 scale_code, mask=row_mask)
    else:
        tl.store(scales_ptr + scale_rows[:, None] * n_scale_cols + scale_cols[None, :],
                 scale_code,
                 mask=(scale_rows[:, None] < n_scale_rows) & (scale_cols[None, :] < n_scale_cols))
    if TRANSPOSE:
        live_t = block_max(nonzero, TILE_R, TILE_C, BR, 1) > 0                 # (TR/BR, TC)
        live_t = live_t & (expand_blocks(bad.to(tl.int32), TILE_R // BR, TILE_C, 1, BC) == 0)
        tl.store(live_t_ptr + cols.to(tl.int64)[:, None] * n_scale_rows + scale_rows[None, :],
                 tl.trans(live_t).to(tl.uint8),
                 mask=(cols[:, None] < C) & (scale_rows[None, :] < n_scale_rows))


@triton.jit
def _fold_kernel(
    x_ptr, seed_ptr, shift_row_ptr, shift_row_t_ptr, fp8_ptr, fp8_t_ptr,
    R, C, stride_r, stride_c, n_scale_rows, n_scale_cols,
    RCEIL: tl.constexpr, STOCHASTIC: tl.constexpr, GROUP4: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr,
    ROWS: tl.constexpr, TRANSPOSE: tl.constexpr, NATIVE_CAST: tl.constexpr,
):
    # Pass 2 of the planned fold. shift_row: (R, nC) uint8, the reference fold's shift-table row
    # (shift - SHIFT_MIN, or the NaN row) per row-block of x; shift_row_t: (C, nR) of x^T's.
    # fp8: (R, C) E4M3 bits of x's operand; fp8_t: (C, R) of x^T's.
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    x, rows, cols, in_bounds = _load_tile(x_ptr, R, C, stride_r, stride_c, pid_r, pid_c,
                                          TILE_R, TILE_C, NATIVE_CAST, False)
    u = 0.0
    if STOCHASTIC:
        u = philox_uniforms(tl.load(seed_ptr), 0, C, rows, pid_c * TILE_C, TILE_R, TILE_C, GROUP4)
    e, _ = _block_exponents(x, RCEIL, BR, BC, TILE_R, TILE_C)
    values = _e2m1_values(x, e, u, STOCHASTIC, BR, BC, TILE_R, TILE_C)
    if ROWS:
        scale_cols = pid_c * (TILE_C // BC) + tl.arange(0, TILE_C // BC)
        row = tl.load(
            shift_row_ptr + rows.to(tl.int64)[:, None] * n_scale_cols + scale_cols[None, :],
            mask=(rows[:, None] < R) & (scale_cols[None, :] < n_scale_cols), other=0).to(tl.int32)
        bits = encode_shifted(values, row + SHIFT_MIN_C, row == NAN_ROW_C, 1, BC, TILE_R, TILE_C,
                       NATIVE_CAST)
        tl.store(fp8_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], bits, mask=in_bounds)
    if TRANSPOSE:
        scale_rows = pid_r * (TILE_R // BR) + tl.arange(0, TILE_R // BR)
        row_t = tl.load(
            shift_row_t_ptr + cols.to(tl.int64)[:, None] * n_scale_rows + scale_rows[None, :],
            mask=(cols[:, None] < C) & (scale_rows[None, :] < n_scale_rows), other=0)
        row_t = tl.trans(row_t.to(tl.int32))                                   # (TR/BR, TC)
        bits_t = encode_shifted(values, row_t + SHIFT_MIN_C, row_t == NAN_ROW_C, BR, 1, TILE_R, TILE_C,
                         NATIVE_CAST)
        tl.store(fp8_t_ptr + cols.to(tl.int64)[:, None] * R + rows[None, :], tl.trans(bits_t),
                 mask=tl.trans(in_bounds))


# ---- host side -----------------------------------------------------------------------------

class _PassOneExponents(BlockExponents):
    """The reference fold's chunking, factor and table-row rules (chunk_bounds, plan), on the
    block exponents and live flags pass 1 wrote instead of a QTensor's codes."""

    def __init__(self, scale_codes: torch.Tensor, live: torch.Tensor, k: int, b: int):
        # scale_codes, live: (rows, n_blocks), one entry per row-block of b along K
        self.rows, self.n_blocks = scale_codes.shape
        self.k, self.b = k, b
        self.nan = scale_codes == 255
        self.exps = scale_codes.to(torch.int32) - 127
        self.live = live.bool() & ~self.nan


def _check(x: torch.Tensor, spec: QuantSpec, transpose: bool) -> None:
    check_input(x, spec)
    info = spec.info
    if info.scale_kind is not ScaleKind.E8M0 or info.element.name != "e2m1":
        raise ValueError(f"only MXFP4 (E2M1 elements, E8M0 scales) folds into FP8 exactly; got "
                         f"{spec} (NVFP4 stays on the emulated path: see lowbit.formats.fold)")
    if not supports(spec):
        raise NotImplementedError(f"the Triton kernels do not cover block {spec.block}")
    if x.dim() != 2:
        raise ValueError(f"quantize_fold_mxfp4 takes a 2-D tensor (rows, K), got shape "
                         f"{tuple(x.shape)}")
    if transpose and not spec.is_2d:
        raise ValueError(f"transpose=True needs square 2D tiles, got block {spec.block}: 1D "
                         "blocks of x^T are a different quantization (quantize x.t() instead)")
    kq.require_kernel_tensor(x)


class _Tiles:
    """One kernel's launch geometry on x: grid, tile and warps, and whether the tiles cover x
    exactly (EVEN: no masks)."""

    def __init__(self, rows: int, k: int, config: kq.TileConfig, block: tuple[int, int]):
        tile_r, tile_c, num_warps = config
        if tile_r % block[0] or tile_c % block[1]:
            raise ValueError(f"tile {tuple(config)} does not hold whole {block} blocks")
        self.grid = (cdiv(k, tile_c), cdiv(rows, tile_r))
        if self.grid[1] > 65535:
            raise ValueError(f"shape {(rows, k)} needs {self.grid[1]} row tiles, past CUDA's "
                             "65535")
        self.kw = dict(TILE_R=tile_r, TILE_C=tile_c, num_warps=num_warps)
        self.even = rows % tile_r == 0 and k % tile_c == 0
        self.group4 = k % 4 == 0 and tile_c % 4 == 0


def fold_configs(rows: int, k: int, block: tuple[int, int]) -> tuple[kq.TileConfig, kq.TileConfig]:
    """(pass 1, pass 2) tiles of the one-chunk fold. Pass 2 takes the quantize kernel's
    default tile (32x128 elements for 32x32 blocks, 4 warps); pass 1, which only reads, twice
    its columns (benchmarks/tune.py fold on an H200, 2026-11-30, 32x32 tiles, both passes:
    40.8 -> 38.2 us at 8192x2048, 27.6 -> 25.3 at 5504x2048, 27.4 -> 25.7 at 2048x5504, the best
    of 11 tiles and warp counts there; at 8192x5504 no tile beat the default, and this one was
    1% slower, 121.0 against 119.8 us)."""
    cfg = kq.default_config(rows, k, block)
    wide = kq.TileConfig(cfg[0], max(cfg[1], min(256, kq.pow2_at_least(k))), cfg[2])
    return wide, cfg


class _Launch:
    """One operand's launch geometry and the arguments both passes of either fold share.
    configs: (pass 1, pass 2) TileConfigs of the one-chunk fold (default `fold_configs`); the
    planned fold takes the quantize kernel's default tile. Block scales and band stats are
    per block, not per tile, so the two passes may tile x differently."""

    def __init__(self, x: torch.Tensor, spec: QuantSpec, seed, generator, transpose: bool,
                 configs=None):
        _check(x, spec, transpose)
        self.x, self.spec = x, spec
        self.rows, self.k = x.shape
        br, bc = spec.block
        self.n_scale_cols = -(-self.k // bc)
        self.n_scale_rows = -(-self.rows // br)
        stochastic = spec.rounding.value == "stochastic"
        self.empty = kq.empty_arg(x.device, torch.uint8)
        # drawn once: a fold that is redone (the planned path after the one-chunk one) must
        # see the same uniforms
        self.seed = seed_tensor(seed, generator, x.device) if stochastic else self.empty
        pass1, pass2 = configs or fold_configs(self.rows, self.k, spec.block)
        self.pass1 = _Tiles(self.rows, self.k, pass1, spec.block)
        self.pass2 = _Tiles(self.rows, self.k, pass2, spec.block)
        self.planned = _Tiles(self.rows, self.k, kq.default_config(self.rows, self.k, spec.block),
                              spec.block)
        # what every kernel takes; those that round elements also take `rounding`
        self.common = dict(RCEIL=spec.scale_rule is ScaleRule.RCEIL, BR=br, BC=bc,
                           NATIVE_CAST=not kq.INTERPRET)
        self.stochastic = stochastic

    def rounding(self, tiles: _Tiles) -> dict:
        return dict(STOCHASTIC=self.stochastic, GROUP4=tiles.group4)


def _band_segments(ends: torch.Tensor, n_bands: int, br: int) -> torch.Tensor:
    """(n_bands,) int32 on ends' device: the segment of each band of br rows, the first
    segment whose end lies past the band's first row (bands past the last end: the last
    segment). No host sync."""
    starts = torch.arange(n_bands, device=ends.device, dtype=torch.int64) * br
    return torch.searchsorted(ends.to(torch.int64), starts, right=True).clamp_(
        max=max(ends.shape[0] - 1, 0)).to(torch.int32)


def _segment_factors(stats_t: torch.Tensor, n_segments: int, k: int, bc: int):
    """x^T's (k, n_segments) factors from the per-segment stats pass 1 raised (2^f of each row
    in each segment) and NaN flags (the row's segment holds a NaN block). Torch ops on the
    device, no host sync."""
    hi, nan = stats_t.view(2, n_segments, -1)
    factors = fold.power_of_two(fold.factor_exponent(hi))
    return (factors.repeat_interleave(bc, dim=1)[:, :k].t().contiguous(),
            (nan > 0).repeat_interleave(bc, dim=1)[:, :k].t().contiguous())


def _fold_one_chunk(L: _Launch, rows_out: bool, transpose: bool, over: torch.Tensor,
                    segment_ends: torch.Tensor | None = None):
    """Both passes with ONE factor per row and no host sync: exact iff no live block falls
    outside its row's window; `over` (int64, 1 element) is raised by the count of the nonzero
    values in blocks that do, and the operand is then not to be used. segment_ends: x^T's
    factors per row and segment of x's rows instead (see quantize_fold_mxfp4)."""
    x, dev, u8 = L.x, L.x.device, torch.uint8
    n_rows, k = L.rows, L.k
    n_bands, n_bands_t = L.n_scale_rows, L.n_scale_cols   # bands of BR rows (1D: rows), of BC cols
    segmented = segment_ends is not None
    n_segments = segment_ends.shape[0] if segmented else 1
    stats = torch.full((2 * n_bands + (2 * n_segments * n_bands_t if transpose else 0),),
                       fold.NONE_HI, dtype=torch.int32, device=dev)
    stats_rows, stats_t = stats[:2 * n_bands], stats[2 * n_bands:]
    segments = L.empty
    if segmented:
        br = L.spec.block[0]
        segments = _band_segments(segment_ends, n_bands, br)
        # an end inside a band of rows would put two segments under one factor: such a fold
        # is not to be used, so the ends off a tile boundary count as inexact (no host read)
        over += ((segment_ends % br != 0) & (segment_ends < n_rows)).sum()
    f32 = torch.float32
    fp8 = torch.empty(n_rows, k, device=dev, dtype=u8) if rows_out else L.empty
    fp8_t = torch.empty(k, n_rows, device=dev, dtype=u8) if transpose else L.empty
    factors = torch.empty(n_rows, 1, device=dev, dtype=f32) if rows_out else L.empty
    factors_t = torch.empty(k, 1, device=dev, dtype=f32) if transpose and not segmented else L.empty
    nan = torch.empty(n_rows, device=dev, dtype=u8) if rows_out else L.empty
    nan_t = torch.empty(k, device=dev, dtype=u8) if transpose and not segmented else L.empty
    scales = torch.empty(n_bands, n_bands_t, device=dev, dtype=u8)
    flags = dict(ROWS=rows_out, TRANSPOSE=transpose, SEGMENTED=segmented, **L.common)
    p1, p2 = L.pass1, L.pass2
    with kq.on_device(L.x):
        _band_max_kernel[p1.grid](x, scales, stats_rows, stats_t, segments, n_rows, k,
                                  *x.stride(), n_bands, n_bands_t, n_segments, EVEN=p1.even,
                                  **p1.kw, **flags)
        _fold_one_chunk_kernel[p2.grid](
            x, L.seed, scales, stats_rows, stats_t, segments, fp8, fp8_t, factors, factors_t,
            nan, nan_t, over, n_rows, k, *x.stride(), n_bands, n_bands_t, EVEN=p2.even,
            **p2.kw, **flags, **L.rounding(p2))
        if segmented:
            factors_t, nan_t = _segment_factors(stats_t, n_segments, k, L.spec.block[1])
    out = []
    if rows_out:
        out.append(FoldedOperand(fp8.view(torch.float8_e4m3fn), factors, (0, k),
                                 nan.view(torch.bool)))
    if transpose:
        out.append(FoldedOperand(fp8_t.view(torch.float8_e4m3fn), factors_t, (0, n_rows),
                                 nan_t if segmented else nan_t.view(torch.bool),
                                 segment_ends if segmented else None))
    return out


def _fold_planned(L: _Launch, rows_out: bool, transpose: bool):
    """Both passes with the reference fold's K-chunk plan in between (exact for any span; one host sync
    per chunk)."""
    x, dev, u8, empty = L.x, L.x.device, torch.uint8, L.empty
    n_rows, k = L.rows, L.k
    br, bc = L.spec.block
    n_scale_rows, n_scale_cols = L.n_scale_rows, L.n_scale_cols
    scales = torch.empty(n_rows if br == 1 else n_scale_rows, n_scale_cols, device=dev, dtype=u8)
    live = torch.empty(n_rows, n_scale_cols, device=dev, dtype=u8)
    live_t = torch.empty(k, n_scale_rows, device=dev, dtype=u8) if transpose else empty
    with kq.on_device(L.x):
        P = L.planned
        _live_blocks_kernel[P.grid](x, L.seed, scales, live, live_t, n_rows, k, *x.stride(),
                                    n_scale_rows, n_scale_cols, TRANSPOSE=transpose,
                                    **P.kw, **L.common, **L.rounding(P))
        row_plan = t_plan = None
        table_row = table_row_t = empty
        if rows_out:
            per_row = scales if br == 1 else scales.repeat_interleave(br, dim=0)[:n_rows]
            blocks = _PassOneExponents(per_row, live, k, bc)
            table_row, factors, bounds = blocks.plan(blocks.chunk_bounds())
            row_plan = (factors, bounds, blocks.nan.any(dim=1))
        if transpose:   # x^T's row-blocks: x's tile columns, one row of scales per column of x
            per_col = scales.t().repeat_interleave(bc, dim=0)[:k]
            blocks_t = _PassOneExponents(per_col, live_t, n_rows, br)
            table_row_t, factors_t, bounds_t = blocks_t.plan(blocks_t.chunk_bounds())
            t_plan = (factors_t, bounds_t, blocks_t.nan.any(dim=1))
        fp8 = torch.empty(n_rows, k, device=dev, dtype=u8) if rows_out else empty
        fp8_t = torch.empty(k, n_rows, device=dev, dtype=u8) if transpose else empty
        _fold_kernel[P.grid](x, L.seed, table_row, table_row_t, fp8, fp8_t, n_rows, k,
                             *x.stride(), n_scale_rows, n_scale_cols, ROWS=rows_out,
                             TRANSPOSE=transpose, **P.kw, **L.common, **L.rounding(P))
    out = []
    if rows_out:
        out.append(FoldedOperand(fp8.view(torch.float8_e4m3fn), *row_plan))
    if transpose:
        out.append(FoldedOperand(fp8_t.view(torch.float8_e4m3fn), *t_plan))
    return out


_PATHS = ("auto", "one_chunk", "planned")


def _check_segments(L: _Launch, ends: torch.Tensor, transpose: bool) -> None:
    """segment_ends' contract, as far as it can be checked without reading it back (an end
    off a tile boundary is counted as inexact by the one-chunk fold)."""
    if not transpose:
        raise ValueError("segment_ends gives x^T's operand factors per segment: pass "
                         "transpose=True (or use quantize_fold_mxfp4_with_transpose)")
    if not L.spec.is_2d:
        raise ValueError("segment_ends gives x^T per-segment factors: it needs square 2D tiles "
                         f"(x^T's operand from x's quantization), got block {L.spec.block}")
    if (not isinstance(ends, torch.Tensor) or ends.dim() != 1 or ends.numel() == 0
            or ends.dtype not in (torch.int32, torch.int64) or ends.device != L.x.device):
        raise ValueError(f"segment_ends must be a non-empty 1-D int32/int64 tensor on {L.x.device}, "
                         f"got {getattr(ends, 'dtype', type(ends).__name__)} "
                         f"{tuple(getattr(ends, 'shape', ()))}")
    if L.pass1.kw["TILE_R"] != L.spec.block[0] or L.pass2.kw["TILE_R"] != L.spec.block[0]:
        raise ValueError(f"segment_ends needs tiles of one band of rows ({L.spec.block[0]}), got "
                         f"{L.pass1.kw['TILE_R']} and {L.pass2.kw['TILE_R']} rows")


def _quantize_fold(x, spec, seed, generator, rows_out: bool, transpose: bool, counter,
                   path: str = "auto", configs=None, segment_ends=None):
    """The one-chunk fold first. With a `counter` (a deferred fold check's) it is the answer,
    and the counter says afterwards whether any block fell outside its window (then the work
    is to be redone without one). Without, its count is read back (one host sync) and, if
    nonzero, the planned fold (K-chunks) is the answer. path "one_chunk" / "planned" takes
    that fold alone (tests, tuning and the sm_90 compile check reach each path this way)."""
    if path not in _PATHS:
        raise ValueError(f"path must be one of {', '.join(_PATHS)}, got {path!r}")
    if segment_ends is not None and configs is None and x.dim() == 2:
        # one band of rows a tile, so that each tile lies in one segment
        configs = tuple(kq.TileConfig(spec.block[0], c[1], c[2])
                        for c in fold_configs(*x.shape, spec.block))
    L = _Launch(x, spec, seed, generator, transpose, configs)
    if segment_ends is not None:
        _check_segments(L, segment_ends, transpose)
    if x.numel() == 0 or path == "planned":
        return _fold_planned(L, rows_out, transpose)
    if counter is not None and (counter.dtype != torch.int64 or counter.numel() != 1
                                or counter.device != x.device):
        raise ValueError(f"counter must be one int64 on {x.device}, got {counter.dtype} "
                         f"{tuple(counter.shape)} on {counter.device}")
    over = counter if counter is not None else torch.zeros(1, dtype=torch.int64, device=x.device)
    out = _fold_one_chunk(L, rows_out, transpose, over, segment_ends)
    if counter is not None or path == "one_chunk" or int(over.item()) == 0:
        return out
    return _fold_planned(L, rows_out, transpose)


def quantize_fold_mxfp4(x: torch.Tensor, spec: QuantSpec, transpose: bool = False, seed=None, *,
                        generator: torch.Generator | None = None,
                        counter: torch.Tensor | None = None, path: str = "auto",
                        configs=None, segment_ends: torch.Tensor | None = None) -> FoldedOperand:
    """Quantize a 2-D x (rows, K) to MXFP4 with `spec` and fold it into FP8: equal bit for bit
    to `fold_operand(quantize_with_spec(x, spec), transpose)` (RNE), or, for stochastic
    rounding, to `fold_operand(quantize_triton(x, spec, seed), transpose)` (the seed contract of
    lowbit/kernels/quantize.py; seed as there: an int, a one-element int64 tensor, or None to
    draw one from `generator`).

    spec: MXFP4, floor or rceil, 1D (1, b) blocks or square (b, b) tiles (`supports(spec)`).
    transpose=True returns x^T's operand (K becomes the rows' dim; square 2D tiles only).
    One host sync (whether one factor per row kept every block exact; if not, one more per
    K-chunk of the planned fold); none with a `counter` (one int64 on x's device: a deferred
    fold check's, lowbit.dispatch.fold_check), to which the count of values one factor per row
    leaves inexact is added instead of falling back.
    path: "auto" (the above), "one_chunk" (that fold alone, never falling back: rows past the
    window are inexact and counted in `counter` if given) or "planned" (the K-chunked fold,
    exact, one host sync per chunk). configs: (pass 1, pass 2) TileConfigs of the one-chunk
    fold (default `fold_configs`).
    segment_ends: with transpose (square tiles), x's rows fall into segments ending at these
    rows (an (S,) int32/int64 tensor on x's device, non-decreasing, each a multiple of the tile's
    rows; the last at most x's rows; rows past it count in the last segment), and x^T's
    one-chunk operand takes one factor per row AND segment: factors and nan_rows (K, S), and
    `segment_ends` set (the operand of a grouped GEMM whose groups split K, each expert's
    tokens: lowbit.kernels.fp8_gemm.grouped_fp4_gemm_fp8). Nothing is read back; an end off
    a tile boundary is counted as inexact, like a value the window loses. Each segment's window is its own, so values
    are inexact only where a segment spans more than the window; where the planned fold is
    taken (path "planned", or "auto" without a counter after an inexact one-chunk fold), the
    operand is the usual K-chunked one."""
    return _quantize_fold(x, spec, seed, generator, rows_out=not transpose,
                          transpose=transpose, counter=counter, path=path, configs=configs,
                          segment_ends=segment_ends)[0]


def quantize_fold_mxfp4_with_transpose(x: torch.Tensor, spec: QuantSpec, seed=None, *,
                                       generator: torch.Generator | None = None,
                                       counter: torch.Tensor | None = None, path: str = "auto",
                                       configs=None, segment_ends: torch.Tensor | None = None
                                       ) -> tuple[FoldedOperand, FoldedOperand]:
    """(x's operand, x^T's operand) from the same two passes (square 2D tiles only): the
    fprop and wgrad operands of an activation, or the fprop and dgrad operands of a weight.
    Arguments as quantize_fold_mxfp4's (segment_ends: x^T's factors per segment; x's are
    per row as ever)."""
    a, a_t = _quantize_fold(x, spec, seed, generator, rows_out=True, transpose=True,
                            counter=counter, path=path, configs=configs,
                            segment_ends=segment_ends)
    return a, a_t


def fold_pass_one(x: torch.Tensor, spec: QuantSpec, transpose: bool = True,
                  configs=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1 of the one-chunk fold alone (to time it): each tile band's largest finite block
    exponent and NaN flag, for x's rows and, with `transpose`, its columns. Returns the E8M0
    scale codes (bands x bands_t, uint8) and the band stats (int32)."""
    L = _Launch(x, spec, None, None, transpose, configs)
    n_bands, n_bands_t = L.n_scale_rows, L.n_scale_cols
    stats = torch.full((2 * n_bands + (2 * n_bands_t if transpose else 0),), fold.NONE_HI,
                       dtype=torch.int32, device=x.device)
    scales = torch.empty(n_bands, n_bands_t, dtype=torch.uint8, device=x.device)
    p1 = L.pass1
    with kq.on_device(x):
        _band_max_kernel[p1.grid](x, scales, stats[:2 * n_bands], stats[2 * n_bands:], L.empty,
                                  L.rows, L.k, *x.stride(), n_bands, n_bands_t, 1, ROWS=True,
                                  TRANSPOSE=transpose, EVEN=p1.even, SEGMENTED=False, **p1.kw,
                                  **L.common)
    return scales, stats
