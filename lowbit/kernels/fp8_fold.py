"""Quantize to MXFP4 and fold into FP8 E4M3 in two Triton passes over x, with no QTensor between.

    a = quantize_fold_mxfp4(x, spec)                 # == fold_operand(quantize_with_spec(x, spec))
    a_t = quantize_fold_mxfp4(x, spec2d, transpose=True)   # == fold_operand(q, transpose=True)
    a, a_t = quantize_fold_mxfp4_with_transpose(x, spec2d) # both, from the same two passes

The result equals `fold_operand(quantize_with_spec(x, spec), transpose)` bit for bit: the same
E4M3 bytes, factors, K-chunk bounds and NaN rows (lowbit/kernels/fp8_gemm.py derives the
folding; lowbit/kernels/quantize.py how the quantizer's bits match the reference).

Why two passes: a row's factor, and where K splits into chunks, depend on the exponents of all
its blocks, so no element can be written before the whole row has been quantized.
1. `_block_exponents_kernel` quantizes each tile (the quantize kernel's own scale and rounding
   helpers, so the same codes) and writes only what the folding plan needs: the E8M0 scale
   codes and, per row-block (1 x b along K), whether it holds a nonzero code. A block's
   exponent alone does not say that: a block whose scale clamps at 2^-127 can round to zeros.
2. Torch ops on those (R, K/b) tensors: the chunk bounds and factors by fp8_gemm's own rules
   (`_Blocks.chunk_bounds` / `factor_exponents`), and per block the row of fp8_gemm's shift
   table, (s - f) - SHIFT_MIN, or the NaN row. One host sync per chunk, as fold_operand.
3. `_fold_kernel` quantizes the tile again -- the same deterministic arithmetic, and for
   stochastic rounding the same Philox uniforms (they depend only on the seed and the element's
   index), so the same codes -- and writes table[row * 16 + code]: E2M1(code) * 2^(s - f),
   exact by construction, from the table fold_operand uses. With square 2D tiles the
   transposed operand comes from the same registers: x^T's blocks are the same tiles, and its
   row-blocks are x's column segments, which pass 1 marks live too.

Traffic per element (bf16 x): pass 1 reads 2 bytes, pass 2 reads 2 and writes 1 (2 with the
transpose). Re-reading x costs less than writing codes in pass 1 and reading them back would
save, since pass 1 would then also have to write codes (0.5 B) and pass 2 still read them.
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
from lowbit.kernels.fp8_gemm import SHIFT_MIN, FoldedOperand
from lowbit.kernels.quantize import (
    _block_max, _expand, _load_float32, _pow2_wide, _round_to_grid, _uniforms,
)

__all__ = ["quantize_fold_mxfp4", "quantize_fold_mxfp4_with_transpose"]

_NAN_ROW = 15   # fp8_gemm's shift-table row of E4M3 NaNs


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
    nonzero = ((codes & 7) != 0).to(tl.int32)
    scale_cols = pid_c * (TILE_C // BC) + tl.arange(0, TILE_C // BC)
    scale_rows = pid_r * (TILE_R // BR) + tl.arange(0, TILE_R // BR)
    live = tl.max(tl.reshape(nonzero, (TILE_R, TILE_C // BC, BC)), axis=2)   # (TR, TC/BC)
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
        live_t = tl.max(tl.reshape(nonzero, (TILE_R // BR, BR, TILE_C)), axis=1)  # (TR/BR, TC)
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
        index = (_expand(table_row.to(tl.int32), TILE_R, TILE_C, 1, BC) << 4) | codes
        tl.store(fp8_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :],
                 tl.load(table_ptr + index), mask=in_bounds)
    if TRANSPOSE:
        scale_rows = pid_r * (TILE_R // BR) + tl.arange(0, TILE_R // BR)
        table_row_t = tl.load(
            shift_row_t_ptr + cols.to(tl.int64)[:, None] * n_scale_rows + scale_rows[None, :],
            mask=(cols[:, None] < C) & (scale_rows[None, :] < n_scale_rows), other=0)
        index_t = (_expand(table_row_t.to(tl.int32), TILE_C, TILE_R, 1, BR) << 4) | tl.trans(codes)
        tl.store(fp8_t_ptr + cols.to(tl.int64)[:, None] * R + rows[None, :],
                 tl.load(table_ptr + index_t), mask=tl.trans(in_bounds))


# ---- host side -----------------------------------------------------------------------------

class _BlockExponents(fp8_gemm._Blocks):
    """fp8_gemm's chunking and factor rules (chunk_bounds, factor_exponents), on the block
    exponents and live flags pass 1 wrote instead of a QTensor's codes."""

    def __init__(self, scale_codes: torch.Tensor, live: torch.Tensor, k: int, b: int):
        # scale_codes, live: (rows, n_blocks), one entry per row-block of b along K
        self.rows, self.n_blocks = scale_codes.shape
        self.k, self.b = k, b
        self.nan = scale_codes == 255
        self.exps = scale_codes.to(torch.int32) - 127
        self.live = live.bool() & ~self.nan

    def plan(self) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """(table rows (R, n_blocks) uint8, factors (R, n_chunks) float32, bounds along K),
        as fp8_gemm's _Blocks.fold / shifted compute them."""
        block_bounds = self.chunk_bounds()
        f = self.factor_exponents(block_bounds)                                 # (R, n_chunks)
        lengths = torch.tensor([b - a for a, b in zip(block_bounds[:-1], block_bounds[1:])],
                               device=f.device)
        shift = self.exps - f.repeat_interleave(lengths, dim=1)                 # (R, nb)
        row = torch.where(self.live, shift - SHIFT_MIN, -SHIFT_MIN)             # zeros: any row
        row = torch.where(self.nan, _NAN_ROW, row).to(torch.uint8)
        factors = ((f + 127) << 23).view(torch.float32)                         # 2^f, exact
        bounds = tuple(min(u * self.b, self.k) for u in block_bounds)
        return row.contiguous(), factors, bounds


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


def _quantize_fold(x, spec, seed, generator, rows_out: bool, transpose: bool):
    _check(x, spec, transpose)
    n_rows, k = x.shape
    br, bc = spec.block
    n_scale_cols = -(-k // bc)
    n_scale_rows = -(-n_rows // br)
    stochastic = spec.rounding.value == "stochastic"
    seed_t = _seed_tensor(seed, generator, x.device) if stochastic else None
    tile_r, tile_c, num_warps = kq.default_config(n_rows, k, spec.block)
    dev, u8 = x.device, torch.uint8
    empty = torch.empty(0, device=dev, dtype=u8)
    scales = torch.empty(n_rows if br == 1 else n_scale_rows, n_scale_cols, device=dev, dtype=u8)
    live = torch.empty(n_rows, n_scale_cols, device=dev, dtype=u8)
    live_t = torch.empty(k, n_scale_rows, device=dev, dtype=u8) if transpose else empty
    grid = (triton.cdiv(k, tile_c), triton.cdiv(n_rows, tile_r))
    if grid[1] > 65535:
        raise ValueError(f"shape {tuple(x.shape)} needs {grid[1]} row tiles, past CUDA's 65535")
    common = dict(RCEIL=spec.scale_rule is ScaleRule.RCEIL, STOCHASTIC=stochastic,
                  GROUP4=(k % 4 == 0 and tile_c % 4 == 0), BR=br, BC=bc, TILE_R=tile_r,
                  TILE_C=tile_c, NATIVE_CAST=not kq.INTERPRET, num_warps=num_warps)
    seed_arg = seed_t if stochastic else empty
    with torch.cuda.device(dev) if x.is_cuda else contextlib.nullcontext():
        _block_exponents_kernel[grid](x, seed_arg, scales, live, live_t, n_rows, k, *x.stride(),
                                      n_scale_rows, n_scale_cols, TRANSPOSE=transpose, **common)
        row_plan = t_plan = None
        table_row = table_row_t = empty
        if rows_out:
            per_row = scales if br == 1 else scales.repeat_interleave(br, dim=0)[:n_rows]
            blocks = _BlockExponents(per_row, live, k, bc)
            table_row, factors, bounds = blocks.plan()
            row_plan = (factors, bounds, blocks.nan.any(dim=1))
        if transpose:   # x^T's row-blocks: x's tile columns, one row of scales per column of x
            per_col = scales.t().repeat_interleave(bc, dim=0)[:k]
            blocks_t = _BlockExponents(per_col, live_t, n_rows, br)
            table_row_t, factors_t, bounds_t = blocks_t.plan()
            t_plan = (factors_t, bounds_t, blocks_t.nan.any(dim=1))
        fp8 = torch.empty(n_rows, k, device=dev, dtype=u8) if rows_out else empty
        fp8_t = torch.empty(k, n_rows, device=dev, dtype=u8) if transpose else empty
        _fold_kernel[grid](x, seed_arg, fp8_gemm._shift_table(dev), table_row, table_row_t,
                           fp8, fp8_t, n_rows, k, *x.stride(), n_scale_rows, n_scale_cols,
                           ROWS=rows_out, TRANSPOSE=transpose, **common)
    out = []
    if rows_out:
        out.append(FoldedOperand(fp8.view(torch.float8_e4m3fn), *row_plan))
    if transpose:
        out.append(FoldedOperand(fp8_t.view(torch.float8_e4m3fn), *t_plan))
    return out


def quantize_fold_mxfp4(x: torch.Tensor, spec: QuantSpec, transpose: bool = False, seed=None, *,
                        generator: torch.Generator | None = None) -> FoldedOperand:
    """Quantize a 2-D x (rows, K) to MXFP4 with `spec` and fold it into FP8: equal bit for bit
    to `fold_operand(quantize_with_spec(x, spec), transpose)` (RNE), or, for stochastic
    rounding, to `fold_operand(quantize_triton(x, spec, seed), transpose)` (the seed contract of
    lowbit/kernels/quantize.py; seed as there: an int, a one-element int64 tensor, or None to
    draw one from `generator`).

    spec: MXFP4, floor or rceil, 1D (1, b) blocks or square (b, b) tiles (`supports(spec)`).
    transpose=True returns x^T's operand (K becomes the rows' dim; square 2D tiles only).
    Chunk bounds are read back to the host, one sync per chunk, as fold_operand does."""
    return _quantize_fold(x, spec, seed, generator, rows_out=not transpose,
                          transpose=transpose)[0]


def quantize_fold_mxfp4_with_transpose(x: torch.Tensor, spec: QuantSpec, seed=None, *,
                                       generator: torch.Generator | None = None,
                                       ) -> tuple[FoldedOperand, FoldedOperand]:
    """(x's operand, x^T's operand) from the same two passes (square 2D tiles only): the
    fprop and wgrad operands of an activation, or the fprop and dgrad operands of a weight."""
    a, a_t = _quantize_fold(x, spec, seed, generator, rows_out=True, transpose=True)
    return a, a_t
