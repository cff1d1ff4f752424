"""The rollout engine's GEMM: y = f(x) @ W^T on a dense, FP8 or packed-NVFP4 weight, read as
stored and dequantized in registers, for any number of rows; experts grouped in one launch.

Decode is memory-bound: a step reads every weight once and does a few FLOPs per byte. So the
kernels read what the weight stores (lowbit.formats.LinearWeight: NVFP4 at 0.5625 bytes a
parameter, FP8 at 1, dense bf16 at 2) and form each weight value in registers, as Marlin does
on GPUs without FP4 tensor cores, then multiply in the compute dtype. `linear` and
`grouped_linear` take any of the three; NVFP4 weights go to lowbit.kernels.nvfp4_gemm (the
weight re-laid as tiles at sync, decoded into the tensor cores' register operand), dense and
FP8 ones to this module's kernel:

    fp8:    w = e4m3(code) * row_scale       (a power of two: exact in bf16 and float32)

-- LinearWeight.dequantize's products, so the kernel multiplies exactly the dequantized weight
and differs from dequantize-then-GEMM by accumulation order only. Two tiles:
- one row (M = 1) on the CUDA cores: each program owns BLOCK_N output features, streams their
  weight over K once (the next tile fetched while this one multiplies), accumulates products
  elementwise and sums once at the end; with programmatic dependent launch (pdl) it fetches
  its first weight tile before waiting on the kernel before it;
- several rows on the tensor cores: (BLOCK_M, BLOCK_N) output tiles over a grid of row
  tiles, the weight tile decoded once per program for all its rows.

The activation side is the caller's: f(x) is x, or the engine's RMSNorm of x, or SiLU(gate) *
up (prologues, each rounded where the eager ops round; for NVFP4 computed by one activation
pass, lowbit.kernels.activation_quant's mode "none", before the GEMM), and `x2`, a second
activation multiplied by the same weight tile into the same accumulator (RAC's compensated
residual: one read of W for both), so W4A4 numerics cost no extra weight traffic.
Grouped (MoE): the rows are gathered: each row tile belongs to one expert (`tile_expert`, -1 for
a tile with no work) and lists its rows (`row_ids`, -1 past the end); a row r reads x row
r // row_div and writes output row r. `moe_align` builds both on the device, so the expert
grouping needs no host read-back and fits in a CUDA graph.
Rounding of the output: the float32 accumulator is rounded to dt, then a bias is added (and
rounded), then a residual (and rounded), as the engine's eager decoder rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.formats.linear_weight import LinearWeight, WeightStorage
from lowbit.kernels import interpret_mode
from lowbit.kernels.gemm_common import row_tile, store_output
from lowbit.kernels.launch import cdiv, pdl_launch, wait_for_inputs
from lowbit.kernels.nvfp4_gemm import nvfp4_linear
from lowbit.kernels.quantize import to_output

__all__ = ["linear", "grouped_linear", "moe_align", "default_tile", "engine_linear_kernel",
           "MAX_ROWS", "GROUP_BLOCK_M"]

MAX_ROWS = 1 << 20
"""The most rows one call takes (prefill of a batch included)."""

_NONE, _RMS_NORM, _SILU_MUL = 0, 1, 2
GROUP_BLOCK_M = 16
"""Rows per tile of grouped_linear (an expert's rows padded to a multiple of it)."""
_FORMAT = {WeightStorage.DENSE: 0, WeightStorage.FP8: 1}


def default_tile(M: int, N: int, K: int, format: WeightStorage) -> dict:
    """The tile `linear` runs a dense or FP8 weight with: for one row, a CUDA-core tile; for
    more, a tensor-core tile whose row count grows with M."""
    if M == 1:
        if format is WeightStorage.DENSE:
            long_k = K > 4096   # long rows: more rows per program, more warps per row
            return {"BLOCK_N": 8 if long_k else 2, "BLOCK_K": min(1024, triton.next_power_of_2(K)),
                    "USE_DOT": False, "num_warps": 8 if long_k else 4}
        return {"BLOCK_N": 8, "BLOCK_K": min(512, max(16, triton.next_power_of_2(K))),
                "USE_DOT": False, "num_warps": 4}
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128
    if block_m <= 32:
        return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 128, "USE_DOT": True,
                "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": block_m, "BLOCK_N": 128, "BLOCK_K": 64, "USE_DOT": True,
            "num_warps": 8 if block_m == 128 else 4, "num_stages": 3}


# ---- decoding ---------------------------------------------------------------------------------

@triton.jit
def _e4m3(bits, NATIVE_CAST: tl.constexpr):
    """E4M3 bit patterns (uint8) -> float32 values (0x7f / 0xff: NaN)."""
    if NATIVE_CAST:
        return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    b = bits.to(tl.int32)
    e = (b >> 3) & 15
    m = b & 7
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125,                        # m * 2^-9
                   ((e + 120) << 23 | m << 20).to(tl.float32, bitcast=True))
    mag = tl.where((e == 15) & (m == 7), float("nan"), mag)
    return tl.where(b >= 128, -mag, mag)


@triton.jit
def _saturate(v, LIMIT: tl.constexpr):
    """dequantize()'s clamp at the compute dtype's largest finite value (NaN stays NaN)."""
    return tl.where(v > LIMIT, LIMIT, tl.where(v < -LIMIT, -LIMIT, v))


@triton.jit
def _weight_tile(w_ptr, rn, n_ok, k0, K, stride_wn, BLOCK_K: tl.constexpr):
    """The stored values of a dense or FP8 (BLOCK_N, BLOCK_K) weight tile at column k0 (FP8:
    E4M3 bytes); columns past K read as zeros."""
    kk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + kk[None, :],
                   mask=n_ok[:, None] & (kk < K)[None, :], other=0)


@triton.jit
def _weight_values(data, row_scale, FORMAT: tl.constexpr, NATIVE_CAST: tl.constexpr,
                   SATURATE: tl.constexpr, LIMIT: tl.constexpr, dt: tl.constexpr):
    """The tile's values in dt: dense as stored, FP8 e4m3(code) * row_scale (saturated as
    dequantize saturates)."""
    if FORMAT == 0:
        v = data
    else:
        v = _e4m3(data, NATIVE_CAST) * row_scale[:, None]
        if SATURATE:
            v = _saturate(v, LIMIT)
        v = v.to(dt)
    return v


# ---- the activation side ------------------------------------------------------------------------

@triton.jit
def _input_values(x_ptrs, kk, ok, K, norm_ptr, rstd, PROLOGUE: tl.constexpr, NATIVE_CAST: tl.constexpr):
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
def _row_rstd(x_ptrs, row_ok, K, eps, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / RMS of each row, (ROWS, 1) (x_ptrs: (ROWS, 1) row pointers): RMSNorm's statistic,
    from one more read of the (short) rows."""
    rk = tl.arange(0, BLOCK_K)[None, :]
    ss = tl.zeros([ROWS], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        xv = tl.load(x_ptrs + kk, mask=row_ok & (kk < K), other=0.0).to(tl.float32)
        ss += tl.sum(xv * xv, axis=1)
    return tl.rsqrt(tl.math.div_rn(ss, K * 1.0) + eps)[:, None]


# ---- dense and FP8 ------------------------------------------------------------------------------

@triton.jit
def engine_linear_kernel(x_ptr, x2_ptr, w_ptr, rs_ptr, bias_ptr, norm_ptr, res_ptr, y_ptr,
                          tile_expert_ptr, row_ids_ptr, M, N, K, stride_xm, stride_x2m, stride_wn,
                          stride_we, stride_rse, stride_rm, stride_ym, eps,
                          FORMAT: tl.constexpr, PROLOGUE: tl.constexpr, HAS_X2: tl.constexpr,
                          HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GROUPED: tl.constexpr,
                          ROW_DIV: tl.constexpr, SATURATE: tl.constexpr, LIMIT: tl.constexpr,
                          F32_DOT: tl.constexpr, NATIVE_CAST: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          USE_DOT: tl.constexpr, PDL: tl.constexpr):
    dt = y_ptr.dtype.element_ty
    # the tensor-core grid: (row tiles, column tiles); the one-row grid: (column tiles,) --
    # row tiles on axis 0, which takes 2^31 - 1 programs (axis 1 takes 65535)
    rn = tl.program_id(1 if USE_DOT else 0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    if USE_DOT:
        tile = tl.program_id(0)
        x_rows, out_rows, m_ok, expert, skip = row_tile(tile, M, tile_expert_ptr, row_ids_ptr,
                                                          GROUPED, ROW_DIV, BLOCK_M)
        if skip:
            return
        w_ptr += expert * stride_we
        rs_ptr += expert * stride_rse
        acc = _dot_rows(x_ptr, x2_ptr, w_ptr, rs_ptr, norm_ptr, x_rows, m_ok, rn, n_ok,
                        K, stride_xm, stride_x2m, stride_wn, eps, FORMAT, PROLOGUE,
                        HAS_X2, SATURATE, LIMIT, F32_DOT, NATIVE_CAST, dt, BLOCK_M, BLOCK_N,
                        BLOCK_K)
    else:
        acc = _one_row(x_ptr, x2_ptr, w_ptr, rs_ptr, norm_ptr, rn, n_ok, K, stride_wn, eps,
                       FORMAT, PROLOGUE, HAS_X2, SATURATE, LIMIT, NATIVE_CAST, dt, BLOCK_N,
                       BLOCK_K, PDL)
        out_rows = tl.arange(0, 1)
        m_ok = out_rows < 1
    store_output(acc.to(dt), y_ptr, bias_ptr, res_ptr, out_rows[:, None], rn[None, :],
           m_ok[:, None] & n_ok[None, :], stride_ym, stride_rm, HAS_BIAS, HAS_RES, dt)


@triton.jit
def _dot_rows(x_ptr, x2_ptr, w_ptr, rs_ptr, norm_ptr, x_rows, m_ok, rn, n_ok, K,
              stride_xm, stride_x2m, stride_wn, eps, FORMAT: tl.constexpr,
              PROLOGUE: tl.constexpr, HAS_X2: tl.constexpr, SATURATE: tl.constexpr,
              LIMIT: tl.constexpr, F32_DOT: tl.constexpr, NATIVE_CAST: tl.constexpr,
              dt: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(BLOCK_M, BLOCK_N) float32 on the tensor cores: each weight tile is decoded once for all
    the tile's rows; the pipeliner keeps several tiles in flight."""
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm                                 # (BLOCK_M, 1)
    row_ok = m_ok[:, None]
    rstd = tl.zeros([BLOCK_M, 1], tl.float32)
    if PROLOGUE == 1:
        rstd = _row_rstd(x_ptrs, row_ok, K, eps, BLOCK_M, BLOCK_K)
    row_scale = tl.zeros([BLOCK_N], tl.float32)
    if FORMAT != 0:
        row_scale = tl.load(rs_ptr + rn, mask=n_ok, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _weight_values(_weight_tile(w_ptr, rn, n_ok, k0, K, stride_wn, BLOCK_K), row_scale,
                           FORMAT, NATIVE_CAST, SATURATE, LIMIT, dt)
        cols = k0 + tl.arange(0, BLOCK_K)[None, :]
        # x's values and w's are dt's values exactly, so the products are exact and only the
        # sums round
        acc = _dot(_input_values(x_ptrs, cols, row_ok & (cols < K), K, norm_ptr, rstd, PROLOGUE, NATIVE_CAST),
                   w, acc, F32_DOT, dt)
        if HAS_X2:   # RAC: the compensated residual against the same weight tile
            x2_ptrs = x2_ptr + x_rows[:, None] * stride_x2m
            acc = _dot(tl.load(x2_ptrs + cols, mask=row_ok & (cols < K), other=0.0).to(tl.float32),
                       w, acc, F32_DOT, dt)
    return acc


@triton.jit
def _dot(xv, w, acc, F32_DOT: tl.constexpr, dt: tl.constexpr):
    """acc + xv @ w^T on the tensor cores: xv (M, k) float32 holding dt's values, w (N, k) dt."""
    if F32_DOT:
        acc = tl.dot(xv, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(xv.to(dt), tl.trans(w), acc)
    return acc


@triton.jit
def _one_row(x_ptr, x2_ptr, w_ptr, rs_ptr, norm_ptr, rn, n_ok, K, stride_wn, eps,
             FORMAT: tl.constexpr, PROLOGUE: tl.constexpr, HAS_X2: tl.constexpr,
             SATURATE: tl.constexpr, LIMIT: tl.constexpr, NATIVE_CAST: tl.constexpr,
             dt: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """(1, BLOCK_N) float32 for one row on the CUDA cores: products accumulate elementwise over
    K and are summed once at the end. Each weight tile is fetched one iteration ahead, the
    first before the wait on the kernel launched before this one (PDL: it does not write the
    weights), so that fetch overlaps that kernel's tail."""
    data = _weight_tile(w_ptr, rn, n_ok, 0, K, stride_wn, BLOCK_K)
    row_scale = tl.zeros([BLOCK_N], tl.float32)
    if FORMAT != 0:
        row_scale = tl.load(rs_ptr + rn, mask=n_ok, other=0.0)
    wait_for_inputs(PDL)
    zero = tl.zeros([1, 1], tl.int32)
    x_ptrs = x_ptr + zero
    rstd = tl.zeros([1, 1], tl.float32)
    if PROLOGUE == 1:
        rstd = _row_rstd(x_ptrs, zero == 0, K, eps, 1, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _weight_values(data, row_scale, FORMAT, NATIVE_CAST, SATURATE, LIMIT, dt).to(tl.float32)
        cols = k0 + tl.arange(0, BLOCK_K)[None, :]
        acc += w * _input_values(x_ptrs, cols, cols < K, K, norm_ptr, rstd, PROLOGUE, NATIVE_CAST)
        if HAS_X2:   # RAC's residual: its own exact products, into the same sums
            acc += w * tl.load(x2_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        # the next tile (past K on the last iteration: all masked, no read)
        data = _weight_tile(w_ptr, rn, n_ok, k0 + BLOCK_K, K, stride_wn, BLOCK_K)
    return tl.sum(acc, axis=1)[None, :]


# ---- launching ------------------------------------------------------------------------------------

def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along its last dim (what the kernels index by)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _weight_args(weight: LinearWeight, x: torch.Tensor) -> dict:
    """The dense / FP8 kernel's weight pointers, strides and constexprs."""
    data, rs = weight.data, weight.row_scales
    return dict(
        w=data, rs=rs if rs is not None else data,
        stride_wn=data.stride(-2), stride_we=data.stride(0) if data.dim() == 3 else 0,
        stride_rse=rs.stride(0) if rs is not None and rs.dim() == 2 else 0,
        FORMAT=_FORMAT[weight.format], SATURATE=weight.may_saturate,
        LIMIT=torch.finfo(x.dtype).max, NATIVE_CAST=x.is_cuda and not interpret_mode())


def _check(x: torch.Tensor, weight: LinearWeight, k_in: int, tensors) -> None:
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"the weight's compute dtype and device ({weight.dtype}, {weight.device}) "
                         f"must be x's ({x.dtype}, {x.device})")
    if x.dim() != 2 or x.shape[1] != k_in:
        raise ValueError(f"x is {tuple(x.shape)} for a weight of in_features {weight.in_features}"
                         + (" (silu_mul reads gate|up: 2K columns)" if k_in != weight.in_features else ""))
    if any(t.dtype != x.dtype or t.device != x.device for t in tensors if t is not None):
        raise ValueError(f"linear needs every operand in x's dtype and device ({x.dtype}, {x.device})")




def linear(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None, *,
           x2: torch.Tensor | None = None, norm: torch.Tensor | None = None, eps: float = 1e-6,
           silu_mul: bool = False, residual: torch.Tensor | None = None, tile: dict | None = None,
           pdl: bool = False) -> torch.Tensor:
    """y = (f(x) + x2) @ W^T (+ bias) (+ residual): (M, K_in) -> (M, N) in x's dtype.

    weight: a 2-D LinearWeight of x's dtype and device (N, K). f is the identity, or with norm
    (K,) the engine's RMSNorm `norm * rms_norm(x, eps)`, or with silu_mul `F.silu(x[:, :K]) *
    x[:, K:]` (x is (M, 2K): gate|up). x2 (M, K): a second input against the same weight, added
    in the float32 accumulator (RAC's residual; no prologue with it). bias (N,), residual
    (M, N). tile: the kernel's tile instead of the default (dense / FP8: default_tile's keys;
    NVFP4: lowbit.kernels.nvfp4_gemm.nvfp4_tile's). pdl: launch the dense / FP8 one-row tile with
    programmatic dependent launch where `pdl_supported` (the kernel before it must not write the
    weight)."""
    if norm is not None and silu_mul:
        raise ValueError("linear takes one prologue: norm or silu_mul, not both")
    if x2 is not None and (norm is not None or silu_mul):
        raise ValueError("x2 (RAC's residual) goes with a plain input: no prologue")
    if weight.n_experts is not None:
        raise ValueError("a stack of experts goes through grouped_linear")
    M = x.shape[0]
    N, K = weight.out_features, weight.in_features
    _check(x, weight, 2 * K if silu_mul else K, (bias, norm, residual, x2))
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"linear takes 1..{MAX_ROWS} rows (got {M})")
    if x2 is not None and tuple(x2.shape) != (M, K):
        raise ValueError(f"x2 is {tuple(x2.shape)}: expected ({M}, {K})")
    x = _rows(x)
    x2 = None if x2 is None else _rows(x2)
    residual = None if residual is None else _rows(residual)
    norm = None if norm is None else norm.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    prologue = _RMS_NORM if norm is not None else _SILU_MUL if silu_mul else _NONE
    if weight.format is WeightStorage.NVFP4:
        nvfp4_linear(_prologue_pass(x, norm, eps, silu_mul), x2, weight, y, bias, residual, M,
                      None, None, 1, tile)
        return y
    if tile is None:
        tile = _interpreter_tile(M) if interpret_mode() else default_tile(M, N, K, weight.format)
    tile = dict(tile)
    block_m = tile.pop("BLOCK_M", 16)
    block_m = block_m if tile["USE_DOT"] else 1
    if not tile["USE_DOT"] and M != 1:
        raise ValueError("the CUDA-core tile (USE_DOT False) takes one row")
    wa = _weight_args(weight, x)
    grid = ((cdiv(M, block_m), cdiv(N, tile["BLOCK_N"])) if tile["USE_DOT"]
            else (cdiv(N, tile["BLOCK_N"]),))
    engine_linear_kernel[grid](
        x, x2 if x2 is not None else x, wa["w"], wa["rs"], bias if bias is not None else y,
        norm if norm is not None else y, residual if residual is not None else y, y, y, y, M, N,
        K, x.stride(0), x2.stride(0) if x2 is not None else 0, wa["stride_wn"], 0, 0,
        residual.stride(0) if residual is not None else 0, y.stride(0), eps,
        FORMAT=wa["FORMAT"], PROLOGUE=prologue, HAS_X2=x2 is not None, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, GROUPED=False, ROW_DIV=1, SATURATE=wa["SATURATE"],
        LIMIT=wa["LIMIT"], F32_DOT=_f32_dot(x), NATIVE_CAST=wa["NATIVE_CAST"], BLOCK_M=block_m,
        **pdl_launch(pdl and M == 1 and not tile["USE_DOT"], x.device), **tile)
    return y


def _f32_dot(x: torch.Tensor) -> bool:
    """The tensor-core tiles multiply in float32 (exact products of dt's values; ieee): for
    float32 operands (no TF32), and under the interpreter, whose bf16 / fp16 dot is wrong."""
    return x.dtype == torch.float32 or interpret_mode()


def _prologue_pass(x: torch.Tensor, norm: torch.Tensor | None, eps: float,
                   silu_mul: bool) -> torch.Tensor:
    """The NVFP4 GEMM's input: x, or its prologue's output from one activation pass
    (lowbit.kernels.activation_quant, mode "none": rounded as the prologues here round). The
    NVFP4 kernel reads its activations straight into the MMA's operand; a prologue computed in
    the kernel stages them through shared memory once for every tile of every program (tried,
    and measured slower: docs/results/rollout.md, 2026-12-06)."""
    if norm is None and not silu_mul:
        return x
    from lowbit.kernels import activation_quant
    return activation_quant.quantize_activations(x, "none", norm=norm, eps=eps, silu_mul=silu_mul)[0]


def moe_align(expert_of_row: torch.Tensor, n_experts: int,
              block_m: int = GROUP_BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by expert into tiles of block_m rows, on the device with fixed shapes (no
    host read-back: a CUDA graph can hold it). expert_of_row (R,) int -> (tile_expert (T,)
    int32: each tile's expert, -1 for the unused tiles at the end; row_ids (T * block_m,)
    int32: each tile's rows in increasing order, -1 past an expert's last row), with T =
    ceil(R / block_m) + min(E, R), enough for any routing."""
    dev = expert_of_row.device
    R = expert_of_row.shape[0]
    tiles_max = -(-R // block_m) + min(n_experts, R)
    experts = expert_of_row.long()
    # counts by scatter-add: torch.bincount reads its input's max back to the host on CUDA
    counts = torch.zeros(n_experts, dtype=torch.long, device=dev).scatter_add_(
        0, experts, torch.ones_like(experts))
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)                                     # (E,)
    order = torch.argsort(experts, stable=True)                           # rows by expert
    sorted_experts = experts[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(R, device=dev) - first_of_expert[sorted_experts]
    slot = (tile_end - tiles)[sorted_experts] * block_m + rank
    row_ids = torch.full((tiles_max * block_m,), -1, dtype=torch.int32, device=dev)
    row_ids.scatter_(0, slot, order.to(torch.int32))
    tile_expert = torch.searchsorted(tile_end, torch.arange(tiles_max, device=dev), right=True)
    tile_expert = torch.where(tile_expert < n_experts, tile_expert, -1).to(torch.int32)
    return tile_expert, row_ids


def grouped_linear(x: torch.Tensor, weight: LinearWeight, tile_expert: torch.Tensor,
                   row_ids: torch.Tensor, n_rows: int, row_div: int = 1, *,
                   x2: torch.Tensor | None = None, silu_mul: bool = False,
                   block_m: int = GROUP_BLOCK_M, tile: dict | None = None) -> torch.Tensor:
    """Expert GEMMs in one launch: out[r] = (f(x[r // row_div]) + x2[r // row_div]) @ W[e]^T for
    every row r that tile_expert / row_ids (moe_align, with the same block_m) give expert e;
    (n_rows, N) in x's dtype, rows listed nowhere left unwritten. f: the identity, or with
    silu_mul SiLU(gate) * up of x = [gate | up].

    weight: a stack of experts (E, N, K); x (T, K) (and x2, RAC's residual); tile_expert (tiles,)
    int32, -1 for a tile with no rows; row_ids (tiles * block_m,) int32, -1 past a tile's rows."""
    if weight.n_experts is None:
        raise ValueError("grouped_linear takes a stack of experts (LinearWeight.stack)")
    if x2 is not None and silu_mul:
        raise ValueError("x2 (RAC's residual) goes with a plain input: no prologue")
    N, K = weight.out_features, weight.in_features
    _check(x, weight, 2 * K if silu_mul else K, (x2,))
    if row_ids.numel() != tile_expert.numel() * block_m:
        raise ValueError(f"row_ids holds {row_ids.numel()} rows for {tile_expert.numel()} tiles "
                         f"of {block_m}")
    x = _rows(x)
    x2 = None if x2 is None else _rows(x2)
    y = torch.empty(n_rows, N, dtype=x.dtype, device=x.device)
    prologue = _SILU_MUL if silu_mul else _NONE
    if weight.format is WeightStorage.NVFP4:
        nvfp4_linear(_prologue_pass(x, None, 0.0, silu_mul), x2, weight, y, None, None, n_rows,
                      tile_expert, row_ids, row_div, tile, block_m)
        return y
    tile = dict(tile or ({"BLOCK_N": 16, "BLOCK_K": 32, "USE_DOT": True} if interpret_mode() else
                         {"BLOCK_N": 64, "BLOCK_K": 128, "USE_DOT": True, "num_warps": 4,
                          "num_stages": 3}))
    tile.pop("BLOCK_M", None)
    wa = _weight_args(weight, x)
    engine_linear_kernel[(tile_expert.numel(), cdiv(N, tile["BLOCK_N"]))](
        x, x2 if x2 is not None else x, wa["w"], wa["rs"], y, y, y, y, tile_expert, row_ids,
        n_rows, N, K, x.stride(0), x2.stride(0) if x2 is not None else 0, wa["stride_wn"],
        wa["stride_we"], wa["stride_rse"], 0, y.stride(0), 0.0, FORMAT=wa["FORMAT"],
        PROLOGUE=prologue, HAS_X2=x2 is not None, HAS_BIAS=False, HAS_RES=False, GROUPED=True,
        ROW_DIV=row_div, SATURATE=wa["SATURATE"], LIMIT=wa["LIMIT"], F32_DOT=_f32_dot(x),
        NATIVE_CAST=wa["NATIVE_CAST"], BLOCK_M=block_m, PDL=False, **tile)
    return y


def _interpreter_tile(M: int) -> dict:
    """Under the interpreter: a small tile, so the programs loop over K."""
    return {"BLOCK_N": 16, "BLOCK_K": 32, "USE_DOT": M > 1, "BLOCK_M": 16}


