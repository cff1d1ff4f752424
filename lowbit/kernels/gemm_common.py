"""Pieces the rollout engine's GEMM kernels share (lowbit.kernels.engine_linear's dense / FP8
kernel and lowbit.kernels.nvfp4_gemm's): a row tile's rows, plain or grouped by expert, the
input's prologue (the engine's RMSNorm, or SiLU(gate) * up) and the output's epilogue (rounding,
bias, residual), each rounded as the engine's eager decoder rounds."""

from __future__ import annotations

import triton
import triton.language as tl

from lowbit.kernels.quantize import to_output

__all__ = ["input_values", "row_rstd", "row_tile", "store_output"]


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


@triton.jit
def input_values(x_ptrs, kk, ok, K, norm_ptr, rstd, PROLOGUE: tl.constexpr, NATIVE_CAST: tl.constexpr):
    """The GEMM's input at columns kk (any shape, broadcast against the row pointers x_ptrs and
    rstd) after the prologue, float32, each value rounded to x's dtype where the eager ops
    round (to nearest even, under the interpreter too: NATIVE_CAST off, see to_output)."""
    if PROLOGUE == 2:   # x holds [gate | up], K columns each: F.silu(gate) * up, two roundings
        g = tl.load(x_ptrs + kk, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(x_ptrs + K + kk, mask=ok, other=0.0).to(tl.float32)
        s = to_output(tl.math.div_rn(g, 1.0 + tl.exp(-g)), x_ptrs, NATIVE_CAST).to(tl.float32)
        xv = to_output(s * u, x_ptrs, NATIVE_CAST).to(tl.float32)
    else:
        xv = tl.load(x_ptrs + kk, mask=ok, other=0.0).to(tl.float32)
    if PROLOGUE == 1:   # weight * rms_norm(x): rounded after the norm and after the weight
        g = tl.load(norm_ptr + kk, mask=ok, other=0.0).to(tl.float32)
        xv = to_output(to_output(xv * rstd, x_ptrs, NATIVE_CAST).to(tl.float32) * g, x_ptrs,
                       NATIVE_CAST).to(tl.float32)
    return xv


@triton.jit
def row_rstd(x_ptrs, row_ok, K, eps, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / RMS of each row, (ROWS, 1) (x_ptrs: (ROWS, 1) row pointers): RMSNorm's statistic,
    from one more read of the (short) rows."""
    rk = tl.arange(0, BLOCK_K)[None, :]
    ss = tl.zeros([ROWS], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        xv = tl.load(x_ptrs + kk, mask=row_ok & (kk < K), other=0.0).to(tl.float32)
        ss += tl.sum(xv * xv, axis=1)
    return tl.rsqrt(tl.math.div_rn(ss, K * 1.0) + eps)[:, None]
