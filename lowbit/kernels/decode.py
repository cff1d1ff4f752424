"""Decode-step kernels for the rollout engine: a decoder layer in five launches at small batch.

At batch 1 a decode step reads every weight once and does almost no arithmetic per byte, so
its speed is the speed at which it streams weights, and the launches between the GEMMs (norms,
RoPE, cache writes, SiLU, residual adds: about twelve per layer) cost as much again in GPU time
and gaps (docs/results/quads.md has the profile). These kernels fold that work into the GEMMs'
prologues and epilogues and into one attention kernel:

    qkv = linear(x, W_qkv, norm=ln_1)                   # RMSNorm prologue
    y   = attention(qkv, k_cache, v_cache, ...)         # q/k norm, RoPE, cache write, attention
    x   = linear(y, W_o, residual=x)                    # residual-add epilogue
    gu  = linear(x, W_gate_up, norm=ln_2)
    x   = linear(gu, W_down, silu_mul=True, residual=x) # SiLU(gate) * up prologue

`linear` is a GEMV for M <= 16 rows: each program owns BLOCK_N output features and streams
their weight rows over K once. One row multiplies on the CUDA cores, accumulating products
elementwise and summing once at the end; several rows share each weight tile on the tensor
cores (rows padded to 16). The engine uses them for one row (ENGINE_MAX_ROWS), where they beat
cuBLAS's GEMMs with their launches between; at 8 and 16 rows the tensor-core tile does not yet
stream as fast as cuBLAS. `attention` runs one program
per (row, query head) over the cache columns written so far, read from a device tensor, so one
CUDA graph serves every step and a step reads only the filled part of the cache.

Launches. With pdl=True on Hopper (`pdl_supported`) each kernel is launched with programmatic
dependent launch: it starts while the kernel before it finishes, reads what that kernel cannot
have written (the GEMV's first weight tile; attention's position and RoPE rows), then waits for
it and lets the next one start. A batch-1 step is about 128 kernels, and the gap between two
of them is a large part of a step that streams 2 GB in about a millisecond (on an H200 it took
a 1.1B Llama's batch-1 step from 989-999 to 1,020-1,074 steps/s; docs/results/quads.md).

Rounding. Each kernel rounds where the engine's plain-PyTorch decoder (lowbit.rl.engine) rounds
to the compute dtype: the normalized input before and after its weight, the GEMM's output before
the bias and again before the residual add, SiLU's output and the product with up, the rotated
q and k. The float32 sums run in a different order than cuBLAS's and cuDNN's, so results agree
to rounding, not bit for bit (tests/test_decode_kernels.py holds them to the reference in float32
under Triton's interpreter, and in bf16 on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.kernels import interpret_mode

__all__ = ["linear", "attention", "default_tile", "pdl_supported", "MAX_ROWS", "ENGINE_MAX_ROWS"]

MAX_ROWS = 16
"""The most rows (batch size) `linear` takes."""

ENGINE_MAX_ROWS = 1
"""The batch sizes the rollout engine runs on these kernels by default: one row. At 8 and 16
rows the tensor-core tile ran slower than the compiled decoder's cuBLAS GEMMs on an H200
(docs/results/quads.md), so the engine keeps cuBLAS there."""

_NONE, _RMS_NORM, _SILU_MUL = 0, 1, 2


def default_tile(M: int, N: int, K: int) -> dict:
    """The tile `linear` runs with: for one row, the CUDA-core tile that streamed each of
    TinyLlama-1.1B's projections from HBM fastest on an H200 (`benchmarks/tune.py decode`
    sweeps 32 tiles; docs/results/quads.md); for more rows, a tensor-core tile."""
    if M > 1:
        return {"BLOCK_N": 32, "BLOCK_K": 256, "USE_DOT": True, "num_warps": 4, "num_stages": 3}
    long_k = K > 4096    # long rows: more rows per program, more warps per row
    return {"BLOCK_N": 8 if long_k else 2, "BLOCK_K": min(1024, triton.next_power_of_2(K)),
            "USE_DOT": False, "num_warps": 8 if long_k else 4}


@triton.jit
def _linear_kernel(x_ptr, w_ptr, bias_ptr, norm_ptr, res_ptr, y_ptr, M, N, K,
                   stride_xm, stride_wn, stride_rm, stride_ym, eps,
                   PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                   F32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, DOT_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                   PDL: tl.constexpr):
    dt = y_ptr.dtype.element_ty
    if USE_DOT or BLOCK_M > 1:   # (launched without PDL: see linear)
        acc = _linear_dot(x_ptr, w_ptr, norm_ptr, M, N, K, stride_xm, stride_wn, eps, PROLOGUE,
                          F32_DOT, dt, DOT_M, BLOCK_N, BLOCK_K)
        rm = tl.arange(0, DOT_M)
    else:
        acc = _linear_one_row(x_ptr, w_ptr, norm_ptr, N, K, stride_wn, eps, PROLOGUE, dt,
                              BLOCK_N, BLOCK_K, PDL)
        rm = tl.arange(0, 1)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    y = acc.to(dt)
    if HAS_BIAS:
        b = tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + b[None, :]).to(dt)
    out_ok = m_ok[:, None] & n_ok[None, :]
    if HAS_RES:
        r = tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :], mask=out_ok, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dt)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=out_ok)


@triton.jit
def _input_tile(x_rows, rm_ok, kk, k_ok, K, norm_ptr, rstd, PROLOGUE: tl.constexpr, dt: tl.constexpr):
    """The GEMM's input x[:, kk] after the prologue, (rows, BLOCK_K) float32, each value rounded
    to dt where the eager ops round."""
    x_ok = rm_ok[:, None] & k_ok[None, :]
    if PROLOGUE == 2:   # x holds [gate | up], K columns each: F.silu(gate) * up, two roundings
        g = tl.load(x_rows + kk[None, :], mask=x_ok, other=0.0).to(tl.float32)
        u = tl.load(x_rows + K + kk[None, :], mask=x_ok, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        xv = (s * u).to(dt).to(tl.float32)
    else:
        xv = tl.load(x_rows + kk[None, :], mask=x_ok, other=0.0).to(tl.float32)
    if PROLOGUE == 1:   # weight * rms_norm(x): rounded after the norm and after the weight
        g = tl.load(norm_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        xv = ((xv * rstd[:, None]).to(dt).to(tl.float32) * g[None, :]).to(dt).to(tl.float32)
    return xv


@triton.jit
def _row_rstd(x_rows, rm_ok, K, eps, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / RMS of each row (RMSNorm's statistic): each program reads the short rows once more."""
    rk = tl.arange(0, BLOCK_K)
    ss = tl.zeros([ROWS], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        xv = tl.load(x_rows + kk[None, :], mask=rm_ok[:, None] & (kk < K)[None, :],
                     other=0.0).to(tl.float32)
        ss += tl.sum(xv * xv, axis=1)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def _linear_dot(x_ptr, w_ptr, norm_ptr, M, N, K, stride_xm, stride_wn, eps, PROLOGUE: tl.constexpr,
                F32_DOT: tl.constexpr, dt: tl.constexpr, DOT_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """(DOT_M, BLOCK_N) float32 on the tensor cores, the rows past M zero: the weight tile is
    read once for all rows, and the pipeliner keeps several tiles in flight."""
    rm = tl.arange(0, DOT_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm[:, None] * stride_xm
    rstd = tl.zeros([DOT_M], tl.float32)
    if PROLOGUE == 1:
        rstd = _row_rstd(x_rows, m_ok, K, eps, DOT_M, BLOCK_K)
    acc = tl.zeros([DOT_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        xv = _input_tile(x_rows, m_ok, kk, k_ok, K, norm_ptr, rstd, PROLOGUE, dt)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)          # (BLOCK_K, BLOCK_N)
        # xv holds values of dt exactly, so the products are exact and only the sums round
        if F32_DOT:
            acc = tl.dot(xv, w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(xv.to(dt), w, acc)
    return acc


@triton.jit
def _linear_one_row(x_ptr, w_ptr, norm_ptr, N, K, stride_wn, eps, PROLOGUE: tl.constexpr,
                    dt: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PDL: tl.constexpr):
    """(1, BLOCK_N) float32 for one row on the CUDA cores: products accumulate elementwise over
    K and are summed once at the end. Each weight tile is fetched one iteration ahead, the
    first before the wait on the kernel launched before this one (PDL: it does not write the
    weights), so that fetch overlaps that kernel's tail."""
    rm = tl.arange(0, 1)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < 1, rn < N
    w_rows = w_ptr + rn[:, None] * stride_wn
    w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :], other=0.0)
    _wait_for_inputs(PDL)
    x_rows = x_ptr + rm[:, None]
    rstd = tl.zeros([1], tl.float32)
    if PROLOGUE == 1:
        rstd = _row_rstd(x_rows, m_ok, K, eps, 1, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        xv = _input_tile(x_rows, m_ok, kk, kk < K, K, norm_ptr, rstd, PROLOGUE, dt)  # (1, BLOCK_K)
        acc += w.to(tl.float32) * xv
        nk = kk + BLOCK_K      # the next tile (past K on the last iteration: all masked, no read)
        w = tl.load(w_rows + nk[None, :], mask=n_ok[:, None] & (nk < K)[None, :], other=0.0)
    return tl.sum(acc, axis=1)[None, :]


@triton.jit
def _wait_for_inputs(PDL: tl.constexpr):
    """Under programmatic dependent launch (PDL), wait until the kernel launched before this
    one has finished and its writes are visible, then let the next kernel start launching (its
    programs wait the same way before they read anything this one writes)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along its last dim (what the kernels index by)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           norm: torch.Tensor | None = None, eps: float = 1e-6, silu_mul: bool = False,
           residual: torch.Tensor | None = None, tile: dict | None = None,
           pdl: bool = False) -> torch.Tensor:
    """y = f(x) @ weight.T (+ bias) (+ residual), (M, K_in) -> (M, N) in x's dtype, M <= 16.

    f is the identity, or with norm (K,) the engine's RMSNorm `norm * rms_norm(x, eps)`, or with
    silu_mul `F.silu(x[:, :K]) * x[:, K:]` (x is (M, 2K): gate|up). weight (N, K), bias (N,),
    residual (M, N), all in x's dtype. tile: {"BLOCK_N", "BLOCK_K", "USE_DOT"} and optionally
    num_warps / num_stages, instead of default_tile(M, N, K) (under Triton's interpreter: a
    small tile, on the tensor cores for M > 1). pdl: launch the one-row CUDA-core tile with
    programmatic dependent launch where `pdl_supported` (else ignored): the kernel starts while
    the one before it finishes, fetching its first weight tile before it waits, so that kernel
    must not write the weight."""
    if norm is not None and silu_mul:
        raise ValueError("linear takes one prologue: norm or silu_mul, not both")
    M = x.shape[0]
    N, K = weight.shape
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"linear is a GEMV for 1..{MAX_ROWS} rows (got {M}); use F.linear")
    if x.shape[1] != (2 * K if silu_mul else K):
        raise ValueError(f"x is {tuple(x.shape)} for a weight of {tuple(weight.shape)}"
                         + (" (silu_mul reads gate|up: 2K columns)" if silu_mul else ""))
    tensors = [t for t in (weight, bias, norm, residual) if t is not None]
    if any(t.dtype != x.dtype or t.device != x.device for t in tensors):
        raise ValueError(f"linear needs every operand in x's dtype and device ({x.dtype}, {x.device})")
    x, weight = _rows(x), _rows(weight)
    residual = None if residual is None else _rows(residual)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    prologue = _RMS_NORM if norm is not None else _SILU_MUL if silu_mul else _NONE
    if tile is None:   # the interpreter: a small tile, so the programs loop over K
        tile = {"BLOCK_N": 16, "BLOCK_K": 32, "USE_DOT": M > 1} if interpret_mode() else default_tile(M, N, K)
    _linear_kernel[(triton.cdiv(N, tile["BLOCK_N"]),)](
        x, weight, bias if bias is not None else y, norm.contiguous() if norm is not None else y,
        residual if residual is not None else y, y, M, N, K,
        x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0,
        y.stride(0), eps, PROLOGUE=prologue, HAS_BIAS=bias is not None,
        # float32 operands get no TF32; the interpreter's bf16 / fp16 dot is wrong, and in
        # float32 the products of dt's values are exact all the same
        HAS_RES=residual is not None, F32_DOT=x.dtype == torch.float32 or interpret_mode(),
        BLOCK_M=triton.next_power_of_2(M), DOT_M=max(16, triton.next_power_of_2(M)),
        # PDL on the one-row tile only: the tensor-core tile ran slower with it at 8 rows
        **_pdl_launch(pdl and M == 1 and not tile["USE_DOT"], x), **tile)
    return y


def pdl_supported(device: torch.device | str) -> bool:
    """Programmatic dependent launch applies: a CUDA device of compute capability 9.0 or newer
    (Hopper), kernels compiled rather than interpreted."""
    device = torch.device(device)
    return (device.type == "cuda" and not interpret_mode()
            and torch.cuda.get_device_capability(device)[0] >= 9)


def _pdl_launch(pdl: bool, x: torch.Tensor) -> dict:
    """The launch arguments for `pdl`: the kernel's PDL constexpr, and Triton's launch_pdl."""
    on = bool(pdl) and pdl_supported(x.device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def _rotate(x_ptr, offs, rd, ok, D, norm_ptr, norm_offs, eps, cos, sin,
            QK_NORM: tl.constexpr, dt: tl.constexpr):
    """One head's vector at x_ptr + offs: optionally RMS-normed (Qwen3's q_norm / k_norm),
    then rotated, x * cos + roll(x, D/2) * sin_signed, rounded to dt."""
    half = D // 2
    x = tl.load(x_ptr + offs + rd, mask=ok, other=0.0).to(tl.float32)
    rolled = tl.where(rd < half, rd + half, rd - half)
    xr = tl.load(x_ptr + offs + rolled, mask=ok, other=0.0).to(tl.float32)
    if QK_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        g = tl.load(norm_ptr + norm_offs + rd, mask=ok, other=0.0).to(tl.float32)
        gr = tl.load(norm_ptr + norm_offs + rolled, mask=ok, other=0.0).to(tl.float32)
        x = ((x * rstd).to(dt).to(tl.float32) * g).to(dt).to(tl.float32)
        xr = ((xr * rstd).to(dt).to(tl.float32) * gr).to(dt).to(tl.float32)
    x = x.to(dt).to(tl.float32)
    xr = xr.to(dt).to(tl.float32)
    return (x * cos + xr * sin).to(dt).to(tl.float32)


@triton.jit
def _attention_kernel(qkv_ptr, norm_ptr, cos_ptr, sin_ptr, pos_ptr, col_ptr, k_ptr, v_ptr,
                      valid_ptr, out_ptr, stride_qkv, stride_kb, stride_kh, stride_kl,
                      stride_valid, stride_out, stride_rope, sm_scale, eps,
                      H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, PDL: tl.constexpr):
    dt = out_ptr.dtype.element_ty
    b, h = tl.program_id(0), tl.program_id(1)
    kvh = h // (H // KV)                          # HF's repeat_kv: head h reads KV head h // (H/KV)
    rd = tl.arange(0, BLOCK_D)
    d_ok = rd < D
    pos = tl.load(pos_ptr + b)
    col = tl.load(col_ptr)
    cos = tl.load(cos_ptr + pos * stride_rope + rd, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_rope + rd, mask=d_ok, other=0.0).to(tl.float32)
    _wait_for_inputs(PDL)     # q|k|v and the cache may be the kernel before's to write
    row = qkv_ptr + b * stride_qkv
    q = _rotate(row, h * D, rd, d_ok, D, norm_ptr, h * D, eps, cos, sin, QK_NORM, dt)
    k = _rotate(row, (H + kvh) * D, rd, d_ok, D, norm_ptr, (H + kvh) * D, eps, cos, sin, QK_NORM, dt)
    v = tl.load(row + (H + KV + kvh) * D + rd, mask=d_ok, other=0.0)
    cache = b * stride_kb + kvh * stride_kh
    # one program per KV head writes its column
    write = d_ok & ((rd * 0 + h % (H // KV)) == 0)
    tl.store(k_ptr + cache + col * stride_kl + rd, k.to(dt), mask=write)
    tl.store(v_ptr + cache + col * stride_kl + rd, v, mask=write)
    # online softmax, started from the new column (held in registers, always visible)
    m = tl.sum(q * k, axis=0) * sm_scale
    l = tl.full([], 1.0, tl.float32)
    acc = v.to(tl.float32)
    rl = tl.arange(0, BLOCK_L)
    for start in range(0, col, BLOCK_L):          # the columns written before this one
        cols = start + rl
        written = cols < col
        # the three loads are independent (the mask waits on none), so they overlap
        visible = tl.load(valid_ptr + b * stride_valid + cols, mask=written, other=0) != 0
        offs = cache + cols[:, None] * stride_kl + rd[None, :]
        kv_ok = written[:, None] & d_ok[None, :]
        keys = tl.load(k_ptr + offs, mask=kv_ok, other=0.0).to(tl.float32)
        values = tl.load(v_ptr + offs, mask=kv_ok, other=0.0).to(tl.float32)
        s = tl.sum(keys * q[None, :], axis=1) * sm_scale
        s = tl.where(visible & written, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * values, axis=0)
        m = m_new
    tl.store(out_ptr + b * stride_out + h * D + rd, (acc / l).to(dt), mask=d_ok)


def attention(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              key_valid: torch.Tensor, positions: torch.Tensor, col: torch.Tensor,
              cos: torch.Tensor, sin_signed: torch.Tensor, n_heads: int, n_kv_heads: int,
              qk_norm: torch.Tensor | None = None, eps: float = 1e-6,
              pdl: bool = False) -> torch.Tensor:
    """One decode step's attention for B rows: (B, (H + 2 KV) D) q|k|v -> (B, H D).

    Each row's q and k are normed (qk_norm (H + KV, D): Qwen3's q_norm and k_norm), rotated at
    its position (positions (B,)), and its k and v are written to cache column col (a (1,)
    device tensor). Its query heads then attend over that column and every earlier column that
    key_valid ((B', > col) bool) marks; the caches (B', KV, L, D) are read and written in place
    (B' >= B). cos and sin_signed (max_pos, D) are the engine's RoPE tables (sin's first half
    negated). pdl: launch with programmatic dependent launch where `pdl_supported` (else
    ignored): the kernel starts while the one before it finishes and reads positions, col and
    the tables before it waits, so that kernel must not write them."""
    B = qkv.shape[0]
    H, KV = n_heads, n_kv_heads
    D = k_cache.shape[-1]
    if qkv.shape[1] != (H + 2 * KV) * D or H % KV:
        raise ValueError(f"qkv is {tuple(qkv.shape)}: expected (B, (H + 2 KV) * D) with "
                         f"H={H}, KV={KV}, D={D}, and H a multiple of KV")
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride() or D % 2:
        raise ValueError("the caches need the same strides, unit stride along an even head_dim")
    if qk_norm is not None and tuple(qk_norm.shape) != (H + KV, D):
        raise ValueError(f"qk_norm is {tuple(qk_norm.shape)}: expected ({H + KV}, {D})")
    # the kernel reads both tables by cos's row stride (the engine's are contiguous already)
    qkv, cos, sin_signed = _rows(qkv), cos.contiguous(), sin_signed.contiguous()
    out = torch.empty(B, H * D, dtype=qkv.dtype, device=qkv.device)
    _attention_kernel[(B, H)](
        qkv, qk_norm.contiguous() if qk_norm is not None else qkv, cos, sin_signed,
        positions.reshape(B).contiguous(), col, k_cache, v_cache, key_valid, out,
        qkv.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        key_valid.stride(0), out.stride(0), cos.stride(0), 1.0 / D ** 0.5, eps,
        H=H, KV=KV, D=D, QK_NORM=qk_norm is not None,
        # one or two column blocks cover an RL rollout's cache (8 warps: fastest on an H200)
        BLOCK_D=triton.next_power_of_2(D), BLOCK_L=256 if D <= 64 else 128, num_warps=8,
        **_pdl_launch(pdl, qkv))
    return out
