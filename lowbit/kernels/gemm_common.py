"""Pieces the rollout engine's GEMM kernels share (lowbit.kernels.engine_linear's dense / FP8
kernel and lowbit.kernels.nvfp4_gemm's): a row tile's rows, plain or grouped by expert, and the
output's epilogue (rounding, bias, residual, as the engine's eager decoder rounds)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["row_tile", "store_output"]


@triton.jit
def row_tile(tile, M, tile_expert_ptr, row_ids_ptr, GROUPED: tl.constexpr, ROW_DIV: tl.constexpr,
              BLOCK_M: tl.constexpr):
    """A row tile's rows: (x rows, output rows, valid, expert, skip): plain, BLOCK_M rows from
    tile * BLOCK_M; grouped, its expert's listed rows (see moe_align), skip for a tile of no
    expert."""
    rm = tl.arange(0, BLOCK_M)
    if GROUPED:
        expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
        rows = tl.load(row_ids_ptr + tile * BLOCK_M + rm).to(tl.int64)
        m_ok = rows >= 0
        x_rows = tl.where(m_ok, rows // ROW_DIV, 0)
        out_rows = tl.where(m_ok, rows, 0)
        skip = expert < 0
        expert = tl.maximum(expert, 0)
    else:
        out_rows = tile.to(tl.int64) * BLOCK_M + rm
        m_ok = out_rows < M
        x_rows = out_rows
        expert = tile.to(tl.int64) * 0
        skip = expert != 0
    return x_rows, out_rows, m_ok, expert, skip


@triton.jit
def store_output(y, y_ptr, bias_ptr, res_ptr, rows, cols, ok, stride_ym, stride_rm, HAS_BIAS: tl.constexpr,
           HAS_RES: tl.constexpr, dt: tl.constexpr):
    """y (dt, rows x cols broadcast) + bias (rounded) + residual (rounded), stored."""
    if HAS_BIAS:
        b = tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + b).to(dt)
    if HAS_RES:
        r = tl.load(res_ptr + rows * stride_rm + cols, mask=ok, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dt)
    tl.store(y_ptr + rows * stride_ym + cols, y, mask=ok)
