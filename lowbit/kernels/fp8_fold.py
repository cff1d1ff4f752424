"""Quantize to MXFP4 and fold into FP8 E4M3 in two Triton passes over x, with no QTensor between.

    a = quantize_fold_mxfp4(x, spec)                 # == fold_operand(quantize_with_spec(x, spec))
    a_t = quantize_fold_mxfp4(x, spec2d, transpose=True)   # == fold_operand(q, transpose=True)
    a, a_t = quantize_fold_mxfp4_with_transpose(x, spec2d) # both, from the same two passes

The result equals `fold_operand(quantize_with_spec(x, spec), transpose)` bit for bit: the same
E4M3 bytes, factors, K-chunk bounds and NaN rows (lowbit/kernels/fp8_gemm.py derives the
folding; lowbit/kernels/quantize.py how the quantizer's bits match the reference).

Why two passes: a row's factor, and where K splits into chunks, depend on the exponents of all
its blocks, so no element can be written before the whole row has been quantized. Each pass
quantizes the tile (the quantize kernel's own scale and rounding helpers, so the same codes;
for stochastic rounding the same Philox uniforms, which depend only on the seed and the
element's index). Two ways to fold:

One K-chunk, no host sync (`_fold_one_chunk`, tried first):
1. `_row_max_kernel`: per row of x (and with square 2D tiles per row of x^T, i.e. column of x)
   the largest exponent of a block holding a nonzero code, and whether it holds a NaN block,
   raised across the row's tiles with atomic max. A block's exponent alone does not say it is
   live: a block whose scale clamps at 2^-127 can round to zeros.
2. `_fold_one_chunk_kernel`: the row's factor exponent f = max(s_max - 6, -126), each block's
   row of fp8_gemm's shift table, (s - f) - SHIFT_MIN (the NaN row for NaN blocks), and
   table[row * 16 + code] = E2M1(code) * 2^(s - f) written for x and x^T from the same
   registers (x^T's blocks are the same tiles). Factors and NaN rows come from the first tile
   column (row). A live block below the window (its row spans more than 14 binades) cannot be
   written exactly: its nonzero values are added to an int64 counter on the device.
   Outside `fp8_gemm.deferred_fold_check()` the counter is read back (the one host sync) and a
   nonzero count falls back to the planned fold; inside one, nothing is read back: the check's
   counter accumulates over every fold and its owner (lowbit.train's step) redoes the work if
   it is nonzero.

Planned (`_fold_planned`, exact for any span, one host sync per K-chunk):
1. `_block_exponents_kernel` writes the E8M0 scale codes and, per row-block, a live flag.
2. Torch ops on those (R, K/b) tensors: the chunk bounds and factors by fp8_gemm's own rules
   (`_Blocks.chunk_bounds` / `plan`) and each block's table row.
3. `_fold_kernel` writes table[row * 16 + code] as above.

Traffic per element (bf16 x): pass 1 reads 2 bytes, pass 2 reads 2 and writes 1 (2 with the
transpose). Re-reading x costs less than writing codes in pass 1 and reading them back would
save, since pass 1 would then also have to write codes (0.5 B) and pass 2 still read them.
Measured GPU time (H200, 2026-11-29, `benchmarks/bench_fp8_fold.py`, 8192x5504 bf16, CUDA-graph
replay): copy 0.044 ms, stable-fp4's fake-quantize-with-transpose 0.074 ms, pass 1 0.089 ms,
pass 2 with the transpose 0.266 ms (0.342 ms with the E4M3 bits computed instead of gathered
from the table: ENCODE). Pass 2 runs at about a sixth of copy bandwidth; see
docs/results/kernels.md.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from lowbit.formats.spec import QuantSpec, ScaleKind, ScaleRule
from lowbit.kernels import _seed_tensor, supports
from lowbit.kernels import fp8_gemm
from lowbit.kernels import quantize as kq
from lowbit.kernels.fp8_gemm import FoldedOperand
from lowbit.kernels.quantize import (
    _block_max, _expand, _load_float32, _pow2_wide, _round_to_grid, _uniforms,
)

__all__ = ["quantize_fold_mxfp4", "quantize_fold_mxfp4_with_transpose"]

_NAN_ROW = fp8_gemm._NAN_ROW   # the shift-table row of E4M3 NaNs
# how the one-chunk fold turns (shift, code) into E4M3 bits: "gather" from fp8_gemm's table, or
# "compute" them (benchmarks/bench_fp8_fold.py times both)
ENCODE = "gather"
# the same numbers as Triton constants
NONE_C = tl.constexpr(fp8_gemm._NONE_HI)
SHIFT_MIN_C = tl.constexpr(fp8_gemm.SHIFT_MIN)
SHIFT_MAX_C = tl.constexpr(fp8_gemm.SHIFT_MAX)
NAN_ROW_C = tl.constexpr(_NAN_ROW)
FACTOR_EXP_MIN_C = tl.constexpr(fp8_gemm._FACTOR_EXP_MIN)


@triton.jit
def _e2m1_codes(x, u, RCEIL: tl.constexpr, STOCHASTIC: tl.constexpr, BR: tl.constexpr,
                BC: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr):
    """(TR, TC) float32 -> (codes (TR, TC) int32, sign in bit 3, 0 in NaN/Inf blocks;
    E8M0 scale codes (TR/BR, TC/BC), 255 for NaN/Inf blocks): the quantize kernel's MX path
    for E2M1, step for step (see lowbit/kernels/quantize.py)."""
    bits = x.to(tl.int32, bitcast=True)
    amax_bits = _block_max(bits & 0x7FFFFFFF, TILE_R, TILE_C, BR, BC)
    bad = amax_bits >= 0x7F800000
    if RCEIL:  # amax / 6 rounded up to a power of two, on the bits
        amax = amax_bits.to(tl.float32, bitcast=True)
        d_bits = tl.math.div_rn(amax, 6.0).to(tl.int32, bitcast=True)
        d_exp = d_bits >> 23
        d_man = d_bits & 0x7FFFFF
        unbiased = tl.where(d_exp > 0, d_exp - 127 + (d_man != 0).to(tl.int32),
                            -127 + (d_man > 0x400000).to(tl.int32))
        unbiased = tl.where(d_bits == 0, -127, unbiased)
    else:      # floor: 2^(floor(log2 amax) - 2)
        unbiased = (amax_bits >> 23) - 127 - 2
    unbiased = tl.minimum(tl.maximum(unbiased, -127), 127)
    scale_code = tl.where(bad, 255, unbiased + 127)
    mag = tl.minimum(tl.abs(x * _expand(_pow2_wide(-unbiased), TILE_R, TILE_C, BR, BC)), 6.0)
    steps, bexp = _round_to_grid(mag, u, 0, 1, STOCHASTIC)
    codes = steps + ((bexp - 127) << 1)
    if STOCHASTIC:
        codes = tl.minimum(codes, 7)
    keep = _expand(tl.where(bad, 0, 0xF), TILE_R, TILE_C, BR, BC)
    return (codes | ((bits >> 28) & 8)) & keep, scale_code


@triton.jit
def _load_codes(x_ptr, seed_ptr, R, C, stride_r, stride_c, pid_r, pid_c,
                RCEIL: tl.constexpr, STOCHASTIC: tl.constexpr, GROUP4: tl.constexpr,
                BR: tl.constexpr, BC: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr,
                NATIVE_CAST: tl.constexpr):
    rows = pid_r * TILE_R + tl.arange(0, TILE_R)
    cols = pid_c * TILE_C + tl.arange(0, TILE_C)
    in_bounds = (rows[:, None] < R) & (cols[None, :] < C)
    ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_r + cols[None, :] * stride_c
    x = _load_float32(ptrs, in_bounds, NATIVE_CAST)                    # padding = 0
    u = 0.0
    if STOCHASTIC:  # the seed contract: x is 2-D, so element (r, c) has index r * C + c
        u = _uniforms(tl.load(seed_ptr), 0, C, rows, pid_c * TILE_C, TILE_R, TILE_C, GROUP4)
    codes, scale_code = _e2m1_codes(x, u, RCEIL, STOCHASTIC, BR, BC, TILE_R, TILE_C)
    return codes, scale_code, rows, cols, in_bounds


@triton.jit
def _row_blocks(codes, scale_code, BR: tl.constexpr, BC: tl.constexpr, TILE_R: tl.constexpr,
                TILE_C: tl.constexpr):
    """Per row-block (1 x BC along K) of the tile, (TR, TC/BC): (unbiased exponent, how many
    nonzero codes it holds, NaN). (NaN blocks hold zero codes.)"""
    if BR == 1:
        code = scale_code
    else:
        code = _expand(scale_code, TILE_R, TILE_C // BC, BR, 1)
    nonzero = tl.sum(tl.reshape(((codes & 7) != 0).to(tl.int32), (TILE_R, TILE_C // BC, BC)),
                     axis=2)
    return code - 127, nonzero, code == 255


@triton.jit
def _col_blocks(codes, scale_code, BR: tl.constexpr, BC: tl.constexpr, TILE_R: tl.constexpr,
                TILE_C: tl.constexpr):
    """Per row-block of x^T (a column segment of BR rows of x), (TR/BR, TC): as _row_blocks."""
    code = _expand(scale_code, TILE_R // BR, TILE_C, 1, BC)
    nonzero = tl.sum(tl.reshape(((codes & 7) != 0).to(tl.int32), (TILE_R // BR, BR, TILE_C)),
                     axis=1)
    return code - 127, nonzero, code == 255


@triton.jit
def _table_rows(exp, nonzero, nan, f):
    """fp8_gemm's shift-table row per block for factor exponent f (broadcast to exp's shape),
    and how many nonzero values each block leaves inexact. f >= s_max - SHIFT_MAX, so no live
    block is above the window; one below it gets the row of SHIFT_MIN (wrong) and counts its
    nonzero values. A block of zeros takes the row of shift 0 (+-0 in every row), as
    fp8_gemm's fold does."""
    shift = exp - f
    live = nonzero > 0
    row = tl.where(live, tl.maximum(shift - SHIFT_MIN_C, 0), -SHIFT_MIN_C)
    return tl.where(nan, NAN_ROW_C, row), tl.where(live & (shift < SHIFT_MIN_C), nonzero, 0)


@triton.jit
def _e4m3_bits(table_row, codes, table_ptr, GATHER: tl.constexpr):
    """E4M3 bits of E2M1(code) * 2^(table_row + SHIFT_MIN) (NaN for the NaN row): fp8_gemm's
    shift table entry, by a gather from it or computed (the same 256 values; a test checks).
    Computed: magnitude code m is 1.0 * 2^-1 (m = 1) or (1 + (m & 1) / 2) * 2^((m >> 1) - 1);
    the result's exponent E = that + shift is normal in E4M3 from -6 and a subnormal
    (2 + mant) * 2^(E + 8) * 2^-9 down to -9 (the window's floor)."""
    if GATHER:
        return tl.load(table_ptr + ((table_row << 4) | codes))
    m = codes & 7
    big = m >= 2
    mant = tl.where(big, m & 1, 0)
    e = tl.where(big, (m >> 1) - 1, -1) + table_row + SHIFT_MIN_C
    sub = ((2 + mant) << tl.maximum(e + 9, 0)) >> 1
    mag = tl.where(e >= -6, ((e + 7) << 3) | (mant << 2), sub)
    bits = tl.where(m == 0, 0, mag) | ((codes & 8) << 4)
    return tl.where(table_row == NAN_ROW_C, 0x7F, bits).to(tl.uint8)


@triton.jit
def _factor_exponent(hi):
    """f = max(s_max - SHIFT_MAX, -126) over a row's live blocks, 0 for a row with none."""
    return tl.where(hi > NONE_C, tl.maximum(hi - SHIFT_MAX_C, FACTOR_EXP_MIN_C), 0)


@triton.jit
def _row_max_kernel(
    x_ptr, seed_ptr, stats_ptr, stats_t_ptr,
    R, C, stride_r, stride_c,
    RCEIL: tl.constexpr, STOCHASTIC: tl.constexpr, GROUP4: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr,
    ROWS: tl.constexpr, TRANSPOSE: tl.constexpr, NATIVE_CAST: tl.constexpr,
):
    # Pass 1 of the one-chunk fold. stats: (2, R) int32 = (largest live block exponent, holds a
    # NaN block) per row of x, initialised to NONE and raised with atomic max across the row's
    # column tiles; stats_t: (2, C), the same per row of x^T (column of x).
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    codes, scale_code, rows, cols, _ = _load_codes(
        x_ptr, seed_ptr, R, C, stride_r, stride_c, pid_r, pid_c, RCEIL, STOCHASTIC, GROUP4,
        BR, BC, TILE_R, TILE_C, NATIVE_CAST)
    if ROWS:
        exp, nonzero, nan = _row_blocks(codes, scale_code, BR, BC, TILE_R, TILE_C)
        hi = tl.max(tl.where(nonzero > 0, exp, NONE_C), axis=1)                # (TR,)
        any_nan = tl.max(nan.to(tl.int32), axis=1)
        tl.atomic_max(stats_ptr + rows, hi, mask=(rows < R) & (hi > NONE_C))
        tl.atomic_max(stats_ptr + R + rows, any_nan, mask=(rows < R) & (any_nan > 0))
    if TRANSPOSE:
        exp, nonzero, nan = _col_blocks(codes, scale_code, BR, BC, TILE_R, TILE_C)
        hi = tl.max(tl.where(nonzero > 0, exp, NONE_C), axis=0)                # (TC,)
        any_nan = tl.max(nan.to(tl.int32), axis=0)
        tl.atomic_max(stats_t_ptr + cols, hi, mask=(cols < C) & (hi > NONE_C))
        tl.atomic_max(stats_t_ptr + C + cols, any_nan, mask=(cols < C) & (any_nan > 0))


@triton.jit
def _fold_one_chunk_kernel(
    x_ptr, seed_ptr, table_ptr, stats_ptr, stats_t_ptr, fp8_ptr, fp8_t_ptr,
    factors_ptr, factors_t_ptr, nan_ptr, nan_t_ptr, over_ptr,
    R, C, stride_r, stride_c,
    RCEIL: tl.constexpr, STOCHASTIC: tl.constexpr, GROUP4: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr,
    ROWS: tl.constexpr, TRANSPOSE: tl.constexpr, NATIVE_CAST: tl.constexpr,
    GATHER: tl.constexpr,
):
    # Pass 2 of the one-chunk fold: one factor per row from pass 1's stats, each block's table
    # row computed here, E4M3 bytes written; the first tile column (row) writes the factors and
    # NaN flags of x's (x^T's) rows. over: int64 counter of the nonzero values left inexact.
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    codes, scale_code, rows, cols, in_bounds = _load_codes(
        x_ptr, seed_ptr, R, C, stride_r, stride_c, pid_r, pid_c, RCEIL, STOCHASTIC, GROUP4,
        BR, BC, TILE_R, TILE_C, NATIVE_CAST)
    n_over = 0
    if ROWS:
        f = _factor_exponent(tl.load(stats_ptr + rows, mask=rows < R, other=NONE_C))  # (TR,)
        exp, nonzero, nan = _row_blocks(codes, scale_code, BR, BC, TILE_R, TILE_C)
        table_row, over = _table_rows(exp, nonzero, nan, f[:, None])          # (TR, TC/BC)
        n_over += tl.sum(over)
        bits = _e4m3_bits(_expand(table_row, TILE_R, TILE_C, 1, BC), codes, table_ptr, GATHER)
        tl.store(fp8_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], bits, mask=in_bounds)
        if pid_c == 0:
            has_nan = tl.load(stats_ptr + R + rows, mask=rows < R, other=0) > 0
            tl.store(factors_ptr + rows, ((f + 127) << 23).to(tl.float32, bitcast=True),
                     mask=rows < R)
            tl.store(nan_ptr + rows, has_nan.to(tl.uint8), mask=rows < R)
    if TRANSPOSE:
        f_t = _factor_exponent(tl.load(stats_t_ptr + cols, mask=cols < C, other=NONE_C))  # (TC,)
        exp_t, nonzero_t, nan_t = _col_blocks(codes, scale_code, BR, BC, TILE_R, TILE_C)
        table_row_t, over_t = _table_rows(exp_t, nonzero_t, nan_t, f_t[None, :])  # (TR/BR, TC)
        n_over += tl.sum(over_t)
        bits_t = _e4m3_bits(_expand(tl.trans(table_row_t), TILE_C, TILE_R, 1, BR),
                            tl.trans(codes), table_ptr, GATHER)
        tl.store(fp8_t_ptr + cols.to(tl.int64)[:, None] * R + rows[None, :], bits_t,
                 mask=tl.trans(in_bounds))
        if pid_r == 0:
            has_nan_t = tl.load(stats_t_ptr + C + cols, mask=cols < C, other=0) > 0
            tl.store(factors_t_ptr + cols, ((f_t + 127) << 23).to(tl.float32, bitcast=True),
                     mask=cols < C)
            tl.store(nan_t_ptr + cols, has_nan_t.to(tl.uint8), mask=cols < C)
    if n_over > 0:
        tl.atomic_add(over_ptr, n_over.to(tl.int64))


@triton.jit
def _block_exponents_kernel(
    x_ptr, seed_ptr, scales_ptr, live_ptr, live_t_ptr,
    R, C, stride_r, stride_c, n_scale_rows, n_scale_cols,
    RCEIL: tl.constexpr, STOCHASTIC: tl.constexpr, GROUP4: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr,
    TRANSPOSE: tl.constexpr, NATIVE_CAST: tl.constexpr,
):
    # scales: (R, nC) for 1D blocks, (nR, nC) for 2D tiles; live: (R, nC) uint8, a row-block
    # holds a nonzero code; live_t: (C, nR), the same for x^T's row-blocks (x's column segments)
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    codes, scale_code, rows, cols, _ = _load_codes(
        x_ptr, seed_ptr, R, C, stride_r, stride_c, pid_r, pid_c, RCEIL, STOCHASTIC, GROUP4,
        BR, BC, TILE_R, TILE_C, NATIVE_CAST)
    scale_cols = pid_c * (TILE_C // BC) + tl.arange(0, TILE_C // BC)
    scale_rows = pid_r * (TILE_R // BR) + tl.arange(0, TILE_R // BR)
    _, nonzero, _ = _row_blocks(codes, scale_code, BR, BC, TILE_R, TILE_C)     # (TR, TC/BC)
    live = nonzero > 0
    row_mask = (rows[:, None] < R) & (scale_cols[None, :] < n_scale_cols)
    tl.store(live_ptr + rows.to(tl.int64)[:, None] * n_scale_cols + scale_cols[None, :],
             live.to(tl.uint8), mask=row_mask)
    if BR == 1:
        tl.store(scales_ptr + rows.to(tl.int64)[:, None] * n_scale_cols + scale_cols[None, :],
                 scale_code.to(tl.uint8), mask=row_mask)
    else:
        tl.store(scales_ptr + scale_rows[:, None] * n_scale_cols + scale_cols[None, :],
                 scale_code.to(tl.uint8),
                 mask=(scale_rows[:, None] < n_scale_rows) & (scale_cols[None, :] < n_scale_cols))
    if TRANSPOSE:
        _, nonzero_t, _ = _col_blocks(codes, scale_code, BR, BC, TILE_R, TILE_C)  # (TR/BR, TC)
        live_t = nonzero_t > 0
        tl.store(live_t_ptr + cols.to(tl.int64)[:, None] * n_scale_rows + scale_rows[None, :],
                 tl.trans(live_t).to(tl.uint8),
                 mask=(cols[:, None] < C) & (scale_rows[None, :] < n_scale_rows))


@triton.jit
def _fold_kernel(
    x_ptr, seed_ptr, table_ptr, shift_row_ptr, shift_row_t_ptr, fp8_ptr, fp8_t_ptr,
    R, C, stride_r, stride_c, n_scale_rows, n_scale_cols,
    RCEIL: tl.constexpr, STOCHASTIC: tl.constexpr, GROUP4: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr,
    ROWS: tl.constexpr, TRANSPOSE: tl.constexpr, NATIVE_CAST: tl.constexpr,
):
    # shift_row: (R, nC) uint8 table row per row-block of x; shift_row_t: (C, nR) of x^T.
    # fp8: (R, C) E4M3 bits of x's operand; fp8_t: (C, R) of x^T's.
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    codes, _, rows, cols, in_bounds = _load_codes(
        x_ptr, seed_ptr, R, C, stride_r, stride_c, pid_r, pid_c, RCEIL, STOCHASTIC, GROUP4,
        BR, BC, TILE_R, TILE_C, NATIVE_CAST)
    if ROWS:
        scale_cols = pid_c * (TILE_C // BC) + tl.arange(0, TILE_C // BC)
        table_row = tl.load(
            shift_row_ptr + rows.to(tl.int64)[:, None] * n_scale_cols + scale_cols[None, :],
            mask=(rows[:, None] < R) & (scale_cols[None, :] < n_scale_cols), other=0)
        bits = _e4m3_bits(_expand(table_row.to(tl.int32), TILE_R, TILE_C, 1, BC), codes,
                          table_ptr, True)
        tl.store(fp8_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], bits, mask=in_bounds)
    if TRANSPOSE:
        scale_rows = pid_r * (TILE_R // BR) + tl.arange(0, TILE_R // BR)
        table_row_t = tl.load(
            shift_row_t_ptr + cols.to(tl.int64)[:, None] * n_scale_rows + scale_rows[None, :],
            mask=(cols[:, None] < C) & (scale_rows[None, :] < n_scale_rows), other=0)
        bits_t = _e4m3_bits(_expand(table_row_t.to(tl.int32), TILE_C, TILE_R, 1, BR),
                            tl.trans(codes), table_ptr, True)
        tl.store(fp8_t_ptr + cols.to(tl.int64)[:, None] * R + rows[None, :], bits_t,
                 mask=tl.trans(in_bounds))


# ---- host side -----------------------------------------------------------------------------

class _BlockExponents(fp8_gemm._Blocks):
    """fp8_gemm's chunking, factor and table-row rules (chunk_bounds, plan), on the block
    exponents and live flags pass 1 wrote instead of a QTensor's codes."""

    def __init__(self, scale_codes: torch.Tensor, live: torch.Tensor, k: int, b: int):
        # scale_codes, live: (rows, n_blocks), one entry per row-block of b along K
        self.rows, self.n_blocks = scale_codes.shape
        self.k, self.b = k, b
        self.nan = scale_codes == 255
        self.exps = scale_codes.to(torch.int32) - 127
        self.live = live.bool() & ~self.nan


def _check(x: torch.Tensor, spec: QuantSpec, transpose: bool) -> None:
    from lowbit.formats.quantize import _check_input

    _check_input(x, spec)
    info = spec.info
    if info.scale_kind is not ScaleKind.E8M0 or info.element.name != "e2m1":
        raise ValueError(f"only MXFP4 (E2M1 elements, E8M0 scales) folds into FP8 exactly; got "
                         f"{spec} (NVFP4 stays on the emulated path: see fp8_gemm)")
    if not supports(spec):
        raise NotImplementedError(f"the Triton kernels do not cover block {spec.block}")
    if x.dim() != 2:
        raise ValueError(f"quantize_fold_mxfp4 takes a 2-D tensor (rows, K), got shape "
                         f"{tuple(x.shape)}")
    if transpose and not spec.is_2d:
        raise ValueError(f"transpose=True needs square 2D tiles, got block {spec.block}: 1D "
                         "blocks of x^T are a different quantization (quantize x.t() instead)")
    if not (x.is_cuda or kq.INTERPRET):
        raise RuntimeError("the Triton kernels need a CUDA tensor, or TRITON_INTERPRET=1 set "
                           "before triton is first imported (CPU interpreter, for tests)")


class _Launch:
    """One operand's launch geometry and the arguments both passes of either fold share."""

    def __init__(self, x: torch.Tensor, spec: QuantSpec, seed, generator, transpose: bool):
        _check(x, spec, transpose)
        self.x, self.spec = x, spec
        self.rows, self.k = x.shape
        br, bc = spec.block
        self.n_scale_cols = -(-self.k // bc)
        self.n_scale_rows = -(-self.rows // br)
        stochastic = spec.rounding.value == "stochastic"
        self.empty = kq._empty(x.device, torch.uint8)
        # drawn once: a fold that is redone (the planned path after the one-chunk one) must
        # see the same uniforms
        self.seed = _seed_tensor(seed, generator, x.device) if stochastic else self.empty
        tile_r, tile_c, num_warps = kq.default_config(self.rows, self.k, spec.block)
        self.grid = (triton.cdiv(self.k, tile_c), triton.cdiv(self.rows, tile_r))
        if self.grid[1] > 65535:
            raise ValueError(f"shape {tuple(x.shape)} needs {self.grid[1]} row tiles, past "
                             "CUDA's 65535")
        self.common = dict(RCEIL=spec.scale_rule is ScaleRule.RCEIL, STOCHASTIC=stochastic,
                           GROUP4=(self.k % 4 == 0 and tile_c % 4 == 0), BR=br, BC=bc,
                           TILE_R=tile_r, TILE_C=tile_c, NATIVE_CAST=not kq.INTERPRET,
                           num_warps=num_warps)

    def device_scope(self):
        return torch.cuda.device(self.x.device) if self.x.is_cuda else contextlib.nullcontext()


def _fold_one_chunk(L: _Launch, rows_out: bool, transpose: bool, over: torch.Tensor):
    """Both passes with ONE factor per row and no host sync: exact iff no live block falls
    outside its row's window; `over` (int64, 1 element) is raised by the count of the nonzero
    values in blocks that do, and the operand is then not to be used."""
    x, dev, u8 = L.x, L.x.device, torch.uint8
    n_rows, k = L.rows, L.k
    stats = torch.full((2 * n_rows + (2 * k if transpose else 0),), fp8_gemm._NONE_HI,
                       dtype=torch.int32, device=dev)
    stats_rows, stats_t = stats[:2 * n_rows], stats[2 * n_rows:]
    f32 = torch.float32
    fp8 = torch.empty(n_rows, k, device=dev, dtype=u8) if rows_out else L.empty
    fp8_t = torch.empty(k, n_rows, device=dev, dtype=u8) if transpose else L.empty
    factors = torch.empty(n_rows, 1, device=dev, dtype=f32) if rows_out else L.empty
    factors_t = torch.empty(k, 1, device=dev, dtype=f32) if transpose else L.empty
    nan = torch.empty(n_rows, device=dev, dtype=u8) if rows_out else L.empty
    nan_t = torch.empty(k, device=dev, dtype=u8) if transpose else L.empty
    flags = dict(ROWS=rows_out, TRANSPOSE=transpose, **L.common)
    with L.device_scope():
        _row_max_kernel[L.grid](x, L.seed, stats_rows, stats_t, n_rows, k, *x.stride(), **flags)
        _fold_one_chunk_kernel[L.grid](
            x, L.seed, fp8_gemm._shift_table(dev), stats_rows, stats_t, fp8, fp8_t, factors,
            factors_t, nan, nan_t, over, n_rows, k, *x.stride(), GATHER=ENCODE == "gather",
            **flags)
    out = []
    if rows_out:
        out.append(FoldedOperand(fp8.view(torch.float8_e4m3fn), factors, (0, k),
                                 nan.view(torch.bool)))
    if transpose:
        out.append(FoldedOperand(fp8_t.view(torch.float8_e4m3fn), factors_t, (0, n_rows),
                                 nan_t.view(torch.bool)))
    return out


def _fold_planned(L: _Launch, rows_out: bool, transpose: bool):
    """Both passes with fp8_gemm's K-chunk plan in between (exact for any span; one host sync
    per chunk)."""
    x, dev, u8, empty = L.x, L.x.device, torch.uint8, L.empty
    n_rows, k = L.rows, L.k
    br, bc = L.spec.block
    n_scale_rows, n_scale_cols = L.n_scale_rows, L.n_scale_cols
    scales = torch.empty(n_rows if br == 1 else n_scale_rows, n_scale_cols, device=dev, dtype=u8)
    live = torch.empty(n_rows, n_scale_cols, device=dev, dtype=u8)
    live_t = torch.empty(k, n_scale_rows, device=dev, dtype=u8) if transpose else empty
    with L.device_scope():
        _block_exponents_kernel[L.grid](x, L.seed, scales, live, live_t, n_rows, k, *x.stride(),
                                        n_scale_rows, n_scale_cols, TRANSPOSE=transpose,
                                        **L.common)
        row_plan = t_plan = None
        table_row = table_row_t = empty
        if rows_out:
            per_row = scales if br == 1 else scales.repeat_interleave(br, dim=0)[:n_rows]
            blocks = _BlockExponents(per_row, live, k, bc)
            table_row, factors, bounds = blocks.plan(blocks.chunk_bounds())
            row_plan = (factors, bounds, blocks.nan.any(dim=1))
        if transpose:   # x^T's row-blocks: x's tile columns, one row of scales per column of x
            per_col = scales.t().repeat_interleave(bc, dim=0)[:k]
            blocks_t = _BlockExponents(per_col, live_t, n_rows, br)
            table_row_t, factors_t, bounds_t = blocks_t.plan(blocks_t.chunk_bounds())
            t_plan = (factors_t, bounds_t, blocks_t.nan.any(dim=1))
        fp8 = torch.empty(n_rows, k, device=dev, dtype=u8) if rows_out else empty
        fp8_t = torch.empty(k, n_rows, device=dev, dtype=u8) if transpose else empty
        _fold_kernel[L.grid](x, L.seed, fp8_gemm._shift_table(dev), table_row, table_row_t,
                             fp8, fp8_t, n_rows, k, *x.stride(), n_scale_rows, n_scale_cols,
                             ROWS=rows_out, TRANSPOSE=transpose, **L.common)
    out = []
    if rows_out:
        out.append(FoldedOperand(fp8.view(torch.float8_e4m3fn), *row_plan))
    if transpose:
        out.append(FoldedOperand(fp8_t.view(torch.float8_e4m3fn), *t_plan))
    return out


def _quantize_fold(x, spec, seed, generator, rows_out: bool, transpose: bool, check):
    """The one-chunk fold first. Inside fp8_gemm.deferred_fold_check() it is the answer, and the
    check's device counter says afterwards whether any block fell outside its window (then
    the work is to be redone outside the check). Outside one, its count is read back (one
    host sync) and, if nonzero, the planned fold (K-chunks) is the answer."""
    L = _Launch(x, spec, seed, generator, transpose)
    if x.numel() == 0:
        return _fold_planned(L, rows_out, transpose)
    check = fp8_gemm.resolve_check(check, x.device)
    over = (check.counter if check is not None
            else torch.zeros(1, dtype=torch.int64, device=x.device))
    out = _fold_one_chunk(L, rows_out, transpose, over)
    if check is not None or int(over.item()) == 0:
        return out
    return _fold_planned(L, rows_out, transpose)


def quantize_fold_mxfp4(x: torch.Tensor, spec: QuantSpec, transpose: bool = False, seed=None, *,
                        generator: torch.Generator | None = None,
                        check=fp8_gemm.ACTIVE) -> FoldedOperand:
    """Quantize a 2-D x (rows, K) to MXFP4 with `spec` and fold it into FP8: equal bit for bit
    to `fold_operand(quantize_with_spec(x, spec), transpose)` (RNE), or, for stochastic
    rounding, to `fold_operand(quantize_triton(x, spec, seed), transpose)` (the seed contract of
    lowbit/kernels/quantize.py; seed as there: an int, a one-element int64 tensor, or None to
    draw one from `generator`).

    spec: MXFP4, floor or rceil, 1D (1, b) blocks or square (b, b) tiles (`supports(spec)`).
    transpose=True returns x^T's operand (K becomes the rows' dim; square 2D tiles only).
    One host sync (whether one factor per row kept every block exact; if not, one more per
    K-chunk of the planned fold); none under a deferred fold check (`check`: fp8_gemm.ACTIVE =
    the calling thread's deferred_fold_check(), if any; a FoldCheck; or None), which counts
    what one factor per row leaves inexact instead of falling back."""
    return _quantize_fold(x, spec, seed, generator, rows_out=not transpose,
                          transpose=transpose, check=check)[0]


def quantize_fold_mxfp4_with_transpose(x: torch.Tensor, spec: QuantSpec, seed=None, *,
                                       generator: torch.Generator | None = None,
                                       check=fp8_gemm.ACTIVE,
                                       ) -> tuple[FoldedOperand, FoldedOperand]:
    """(x's operand, x^T's operand) from the same two passes (square 2D tiles only): the
    fprop and wgrad operands of an activation, or the fprop and dgrad operands of a weight."""
    a, a_t = _quantize_fold(x, spec, seed, generator, rows_out=True, transpose=True,
                            check=check)
    return a, a_t
