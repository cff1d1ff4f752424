"""Decode attention over each row's own cache length (flash-decoding), for a position-indexed
KV cache: row b holds its tokens at columns 0..p_b - 1, and p_b = positions[b] differs by row.

For each row b, with G = H / KV query heads per kv head (HF's repeat_kv order):

    q, k = rope(qk_norm(q), p_b), rope(qk_norm(k), p_b)       # each rounded to dt, as the engine
    k_cache[b, :, p_b], v_cache[b, :, p_b] = k, v
    out[b, h] = softmax(q[h] . K[b, h // G, 0..p_b] / sqrt(D)) @ V[b, h // G, 0..p_b]

Grid. One program per (row, kv head, split) takes the G query heads that share the kv head as
the rows of one tile (padded to 16 for tl.dot), so each K and V tile is read once for all of
them. Nothing past p_b is read, so a step costs what the row has written, not the cache's size.

Split and combine. The columns 0..L-1 are cut into `splits` equal chunks; a program runs an
online softmax over its chunk's part of [0, p_b] and leaves a float32 partial (running max m,
sum l, unnormalized acc), and a second kernel merges a head's partials:
out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s with M = max_s m_s. A chunk past p_b
leaves an empty partial (m = -inf, l = 0). With one split the program writes out itself.
Splits let a small batch fill the GPU on a long cache (`default_splits`); the count depends
on shapes alone, never on positions, so one CUDA graph serves every step and a row's bits
depend on its own data and the split count only (batch invariance).

The new column. The program whose chunk holds p_b writes the new k and v (one writer per
row and kv head) and takes the column from registers; no program reads column p_b from memory
in the step, so no read races the write.

Rounding. q and k round where `_rotate` rounds (the engine's eager
decoder's points); the softmax and the sums run in float32; the output rounds to dt once, as
acc / l. In bf16 / fp16 on the GPU the tensor cores multiply q and K in dt (q holds dt's
values, so that is what the eager path multiplies) and P rounded to dt by V; in float32, and
under Triton's interpreter, the dots run on float32 operands without TF32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.kernels import interpret_mode
from lowbit.kernels.launch import cdiv, pdl_launch, wait_for_inputs

__all__ = ["decode_attention", "default_splits", "MIN_CHUNK"]

MIN_CHUNK = 64
"""The fewest cache columns `default_splits` gives a split: shorter chunks cost more in
partials and in the merge than their extra programs win."""

PROGRAMS_PER_SM = 2
"""`default_splits` aims at this many programs per multiprocessor."""

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def default_splits(B: int, KV: int, L: int, device: torch.device | str) -> int:
    """The split count `decode_attention` runs with: enough (row, kv head, split) programs for
    PROGRAMS_PER_SM on each multiprocessor, in chunks of at least MIN_CHUNK of the L columns;
    1 off the GPU (the interpreter, where more programs only cost time). Shapes alone decide,
    so every step of a batch runs the same kernels."""
    device = torch.device(device)
    if device.type != "cuda" or interpret_mode():
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(cdiv(PROGRAMS_PER_SM * sms, B * KV), L // MIN_CHUNK))


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
    # each product rounded to dt, then the sum: the engine's (and the trainer's) x * cos +
    # rotate_half(x) * sin in dt, never one fused multiply-add
    return ((x * cos).to(dt).to(tl.float32) + (xr * sin).to(dt).to(tl.float32)).to(dt).to(tl.float32)


@triton.jit
def _decode_attention_kernel(qkv_ptr, norm_ptr, cos_ptr, sin_ptr, pos_ptr, k_ptr, v_ptr, out_ptr,
                             m_ptr, l_ptr, acc_ptr, prefix_row_ptr, prefix_len_ptr,
                             stride_qkv, stride_kb, stride_kh, stride_kl,
                             stride_out, stride_rope, L, chunk, splits, sm_scale, eps,
                             H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr,
                             QK_NORM: tl.constexpr, DIRECT: tl.constexpr, F32_DOT: tl.constexpr,
                             GROUP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                             PREFIX: tl.constexpr, PDL: tl.constexpr):
    dt = qkv_ptr.dtype.element_ty
    G: tl.constexpr = H // KV
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rd = tl.arange(0, BLOCK_D)
    d_ok = rd < D
    pos = tl.load(pos_ptr + b)
    if PREFIX:   # columns 0..prefix_len - 1 are read from the prompt's row
        prefix_row = tl.load(prefix_row_ptr + b).to(tl.int64)
        prefix_len = tl.load(prefix_len_ptr + b)
    cos = tl.load(cos_ptr + pos * stride_rope + rd, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_rope + rd, mask=d_ok, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)     # q|k|v and the cache may be the kernel before's to write
    row = qkv_ptr + b * stride_qkv
    rg = tl.arange(0, GROUP)
    g_ok = rg < G
    heads = kvh * G + rg                                  # the query heads, padded to GROUP
    # _rotate norms over axis 0, so the group's q goes in as (BLOCK_D, GROUP) and turns back
    q = _rotate(row, (heads * D)[None, :], rd[:, None], d_ok[:, None] & g_ok[None, :], D,
                norm_ptr, (heads * D)[None, :], eps, cos[:, None], sin[:, None], QK_NORM, dt)
    q = tl.trans(q)                                       # (GROUP, BLOCK_D), dt's values
    k = _rotate(row, (H + kvh) * D, rd, d_ok, D, norm_ptr, (H + kvh) * D, eps, cos, sin, QK_NORM, dt)
    v = tl.load(row + (H + KV + kvh) * D + rd, mask=d_ok, other=0.0)

    lo = split * chunk
    hi = tl.minimum(lo + chunk, L)
    holds = (lo <= pos) & (pos < hi)                      # this chunk has the new column
    cache = b.to(tl.int64) * stride_kb + kvh * stride_kh
    write = tl.where(holds, d_ok, False)   # (not d_ok & holds: the interpreter makes that int)
    tl.store(k_ptr + cache + pos * stride_kl + rd, k.to(dt), mask=write)
    tl.store(v_ptr + cache + pos * stride_kl + rd, v, mask=write)
    # online softmax, started from the new column where this chunk holds it (an empty partial
    # elsewhere); exp(s - s) rather than 1, so a NaN or infinite score stays NaN as in softmax
    s_new = tl.sum(q * k[None, :], axis=1) * sm_scale
    m = tl.where(holds, s_new, float("-inf"))
    p_new = tl.where(holds, tl.exp(s_new - m), 0.0)
    l = p_new
    acc = tl.where(holds, p_new[:, None] * v.to(tl.float32)[None, :], 0.0)   # (GROUP, BLOCK_D)
    rn = tl.arange(0, BLOCK_N)
    end = tl.minimum(hi, pos)                             # the written columns of this chunk
    for start in tl.range(lo, end, BLOCK_N):
        cols = start + rn
        col_ok = cols < end
        if PREFIX:
            rows = tl.where(cols < prefix_len, prefix_row, b.to(tl.int64))
            offs = rows[:, None] * stride_kb + kvh * stride_kh + cols[:, None] * stride_kl + rd[None, :]
        else:
            offs = cache + cols[:, None] * stride_kl + rd[None, :]
        kv_ok = col_ok[:, None] & d_ok[None, :]
        keys = tl.load(k_ptr + offs, mask=kv_ok, other=0.0)                  # (BLOCK_N, BLOCK_D)
        values = tl.load(v_ptr + offs, mask=kv_ok, other=0.0)
        if F32_DOT:
            s = tl.dot(q, tl.trans(keys.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q.to(dt), tl.trans(keys))          # exact products of dt's values
        s = tl.where(col_ok[None, :], s * sm_scale, float("-inf"))           # (GROUP, BLOCK_N)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if F32_DOT:
            acc = tl.dot(p, values.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
        else:   # P rounded to dt for the tensor cores, as flash attention does
            acc = tl.dot(p.to(dt), values, acc * alpha[:, None])
        m = m_new
    if DIRECT:
        out = out_ptr + b * stride_out + heads[:, None] * D + rd[None, :]
        tl.store(out, (acc / l[:, None]).to(dt), mask=g_ok[:, None] & d_ok[None, :])
    else:
        part = (b * H + heads) * splits + split           # partials (B, H, splits[, D])
        tl.store(m_ptr + part, m, mask=g_ok)
        tl.store(l_ptr + part, l, mask=g_ok)
        tl.store(acc_ptr + part[:, None] * D + rd[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_attention_combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, stride_out, splits,
                                     H: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                                     BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One program per (row, query head): the partials merged, rescaled to their common max."""
    wait_for_inputs(PDL)     # every partial is the split kernel's to write
    b, h = tl.program_id(0), tl.program_id(1)
    rd = tl.arange(0, BLOCK_D)
    d_ok = rd < D
    rs = tl.arange(0, BLOCK_S)
    first = (b * H + h) * splits
    m_max = tl.full([], float("-inf"), tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        m = tl.load(m_ptr + first + s0 + rs, mask=s0 + rs < splits, other=float("-inf"))
        m_max = tl.maximum(m_max, tl.max(m, axis=0))
    l = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        s_ok = s0 + rs < splits
        part = first + s0 + rs
        m = tl.load(m_ptr + part, mask=s_ok, other=float("-inf"))
        w = tl.exp(m - m_max)                 # 0 for an empty partial (m = -inf)
        l += tl.sum(w * tl.load(l_ptr + part, mask=s_ok, other=0.0), axis=0)
        a = tl.load(acc_ptr + part[:, None] * D + rd[None, :], mask=s_ok[:, None] & d_ok[None, :],
                    other=0.0)
        acc += tl.sum(w[:, None] * a, axis=0)
    tl.store(out_ptr + b * stride_out + h * D + rd, (acc / l).to(out_ptr.dtype.element_ty), mask=d_ok)


def decode_attention(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                     n_heads: int, n_kv_heads: int, qk_norm: torch.Tensor | None = None,
                     eps: float = 1e-6, splits: int | None = None, pdl: bool = False,
                     prefix_rows: torch.Tensor | None = None,
                     prefix_lens: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step's attention for B rows: (B, (H + 2 KV) D) q|k|v -> (B, H D) in qkv's dtype.

    k_cache, v_cache (B', KV, L, D), B' >= B, are read and written in place: row b's new k and
    v go to column p_b = positions[b] ((B,) int32 / int64 on the device; 0 <= p_b < L, not
    checked: reading it would sync) and its H query heads attend over columns 0..p_b.
    qk_norm (H + KV, D): Qwen3's q_norm and k_norm side by side. cos, sin_signed (max_pos, D):
    the engine's RoPE tables (sin's first half negated). splits: how many chunks the L columns
    are cut into (`default_splits` where None). pdl: launch with programmatic dependent launch
    where lowbit.kernels.launch.pdl_supported (else ignored): the kernel reads positions and the
    tables before it waits on the kernel before it, which must not write them.
    prefix_rows, prefix_lens ((B,) int on the device, both or neither): a shared prompt. Row b
    reads its columns 0..prefix_lens[b] - 1 from cache row prefix_rows[b] (which holds that
    prompt) and the rest from its own row: GRPO's copies of a prompt read the same memory
    for it, not a copy each. The values are those of the prompt copied into every row; the
    new column must lie past the prefix (p_b >= prefix_lens[b]), and no row may write into
    another's prefix (each row writes its own row only, at its own position)."""
    H, KV = n_heads, n_kv_heads
    if qkv.dim() != 2 or qkv.dtype not in _DTYPES:
        raise ValueError(f"qkv is {tuple(qkv.shape)} {qkv.dtype}: expected (B, (H + 2 KV) * D) "
                         f"in float32, bfloat16 or float16")
    B = qkv.shape[0]
    if (k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[1] != KV
            or k_cache.shape[0] < B):
        raise ValueError(f"the caches are {tuple(k_cache.shape)} and {tuple(v_cache.shape)}: "
                         f"expected both (B' >= {B}, {KV}, L, D)")
    D, L = k_cache.shape[-1], k_cache.shape[2]
    if H < 1 or KV < 1 or H % KV or qkv.shape[1] != (H + 2 * KV) * D:
        raise ValueError(f"qkv is {tuple(qkv.shape)}: expected (B, (H + 2 KV) * D) with "
                         f"H={H}, KV={KV}, D={D}, and H a multiple of KV")
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride() or D % 2:
        raise ValueError("the caches need the same strides, unit stride along an even head_dim")
    if positions.shape != (B,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions is {tuple(positions.shape)} {positions.dtype}: "
                         f"expected ({B},) int32 or int64")
    if cos.dim() != 2 or cos.shape[1] != D or sin_signed.shape != cos.shape:
        raise ValueError(f"cos and sin_signed are {tuple(cos.shape)} and {tuple(sin_signed.shape)}: "
                         f"expected both (max_pos, {D})")
    if qk_norm is not None and tuple(qk_norm.shape) != (H + KV, D):
        raise ValueError(f"qk_norm is {tuple(qk_norm.shape)}: expected ({H + KV}, {D})")
    tensors = [t for t in (k_cache, v_cache, qk_norm) if t is not None]
    if any(t.dtype != qkv.dtype for t in tensors):
        raise ValueError(f"the caches and qk_norm need qkv's dtype ({qkv.dtype})")
    if any(t.device != qkv.device for t in tensors + [positions, cos, sin_signed]):
        raise ValueError(f"decode_attention needs every tensor on qkv's device ({qkv.device})")
    if (prefix_rows is None) != (prefix_lens is None):
        raise ValueError("prefix_rows and prefix_lens go together: give both or neither")
    prefix = prefix_rows is not None
    if prefix and any(t.shape != (B,) or t.dtype not in (torch.int32, torch.int64) or t.device != qkv.device
                      for t in (prefix_rows, prefix_lens)):
        raise ValueError(f"prefix_rows and prefix_lens are {tuple(prefix_rows.shape)} {prefix_rows.dtype} "
                         f"and {tuple(prefix_lens.shape)} {prefix_lens.dtype}: expected ({B},) int32 or "
                         f"int64 each, on qkv's device")
    splits = default_splits(B, KV, L, qkv.device) if splits is None else splits
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits is {splits!r}: expected a positive int")

    # the kernel reads both tables by cos's row stride (the engine's are contiguous already)
    qkv, cos, sin_signed = qkv.contiguous(), cos.contiguous(), sin_signed.contiguous()
    out = torch.empty(B, H * D, dtype=qkv.dtype, device=qkv.device)
    direct = splits == 1
    # float32 partials (B, H, splits) and (B, H, splits, D); none for one split
    m, l, acc = ((out, out, out) if direct else
                 (torch.empty(B, H, splits, device=qkv.device),
                  torch.empty(B, H, splits, device=qkv.device),
                  torch.empty(B, H, splits, D, device=qkv.device)))
    BLOCK_D = max(16, triton.next_power_of_2(D))          # tl.dot takes 16 or more
    launch = pdl_launch(pdl, qkv.device)
    _decode_attention_kernel[(B, KV, splits)](
        qkv, qk_norm.contiguous() if qk_norm is not None else qkv, cos, sin_signed, positions,
        k_cache, v_cache, out, m, l, acc, prefix_rows if prefix else positions,
        prefix_lens if prefix else positions, qkv.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), out.stride(0), cos.stride(0), L, cdiv(L, splits), splits,
        1.0 / D ** 0.5, eps, H=H, KV=KV, D=D, QK_NORM=qk_norm is not None, DIRECT=direct,
        # float32 operands get no TF32; the interpreter's bf16 / fp16 dot is wrong, and in
        # float32 the products of dt's values are exact all the same
        F32_DOT=qkv.dtype == torch.float32 or interpret_mode(),
        GROUP=max(16, triton.next_power_of_2(H // KV)), BLOCK_D=BLOCK_D,
        # the interpreter: short tiles, so the tests cross tile and chunk edges
        BLOCK_N=16 if interpret_mode() else 64, PREFIX=prefix, num_warps=4,
        # float32: no fused multiply-add where the eager ops round a product (RoPE)
        enable_fp_fusion=qkv.dtype != torch.float32, **launch)
    if not direct:
        _decode_attention_combine_kernel[(B, H)](
            m, l, acc, out, out.stride(0), splits, H=H, D=D,
            BLOCK_S=min(16, triton.next_power_of_2(splits)), BLOCK_D=BLOCK_D, num_warps=4,
            **launch)
    return out
