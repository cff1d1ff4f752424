"""Prototype: NVFP4 W4A16 GEMM, swap-AB on tensor cores, weight re-laid per 128-column tile:
word (n, t*16 + i) holds code j (bits 4j..4j+3) of column t*128 + 16*j + i, so plane j of a tile
is NVFP4 block j: one per-row scale per plane. Values: bf16(e2m1 * 2^-126 [bits]) * bf16(e4m3 * 2^119)
= e2m1*e4m3*2^-7 exactly; acc * (row_scale * 2^7) at the end."""
import torch
import triton
import triton.language as tl


@triton.jit
def _e4m3(bits, NATIVE: tl.constexpr):
    if NATIVE:
        return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    b = bits.to(tl.int32)
    e = (b >> 3) & 15
    m = b & 7
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125,
                   ((e + 120) << 23 | m << 20).to(tl.float32, bitcast=True))
    mag = tl.where((e == 15) & (m == 7), float("nan"), mag)
    return tl.where(b >= 128, -mag, mag)


@triton.jit
def _decode8(words, s0, s1, s2, s3, s4, s5, s6, s7):
    """8 planes of bf16 values e2m1 * 2^-126 * s_j from words laid out by relayout."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 a, b, t, u;
        prmt.b32 a, $8, $9, 0x5410;
        prmt.b32 b, $8, $9, 0x7632;
        and.b32 t, a, 0x81C081C0;
        mul.rn.bf16x2 $0, t, $10;
        and.b32 t, b, 0x81C081C0;
        mul.rn.bf16x2 $1, t, $11;
        shl.b32 t, a, 3;
        and.b32 t, t, 0x81C081C0;
        mul.rn.bf16x2 $2, t, $12;
        shl.b32 t, b, 3;
        and.b32 t, t, 0x81C081C0;
        mul.rn.bf16x2 $3, t, $13;
        shl.b32 t, a, 6;
        and.b32 t, t, 0x81C081C0;
        mul.rn.bf16x2 $4, t, $14;
        shl.b32 t, b, 6;
        and.b32 t, t, 0x81C081C0;
        mul.rn.bf16x2 $5, t, $15;
        shl.b32 t, a, 1;
        and.b32 t, t, 0x80008000;
        shr.b32 u, a, 5;
        and.b32 u, u, 0x01000100;
        or.b32 t, t, u;
        shr.b32 u, a, 4;
        and.b32 u, u, 0x00C000C0;
        or.b32 t, t, u;
        mul.rn.bf16x2 $6, t, $16;
        shl.b32 t, b, 1;
        and.b32 t, t, 0x80008000;
        shr.b32 u, b, 5;
        and.b32 u, u, 0x01000100;
        or.b32 t, t, u;
        shr.b32 u, b, 4;
        and.b32 u, u, 0x00C000C0;
        or.b32 t, t, u;
        mul.rn.bf16x2 $7, t, $17;
        }
        """,
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r",
        args=[words, s0, s1, s2, s3, s4, s5, s6, s7],
        dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)


@triton.jit
def w4a16_kernel(x_ptr, wq_ptr, bs_ptr, rs_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_bsn,
                 stride_ym, TILES_PER_SPLIT, NATIVE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    ri = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    rows = rn.to(tl.int64)
    t0 = pid_k * TILES_PER_SPLIT
    for t in range(t0, t0 + TILES_PER_SPLIT):
        words = tl.load(wq_ptr + rows[:, None] * stride_wn + t * 16 + ri[None, :])
        s_all = tl.load(bs_ptr + rows[:, None] * stride_bsn + t * 8 + tl.arange(0, 8)[None, :])
        e, o = tl.split(tl.reshape(s_all, (BLOCK_N, 4, 2)))
        e0, e1 = tl.split(tl.reshape(e, (BLOCK_N, 2, 2)))
        o0, o1 = tl.split(tl.reshape(o, (BLOCK_N, 2, 2)))
        s0, s4 = tl.split(e0)
        s2, s6 = tl.split(e1)
        s1, s5 = tl.split(o0)
        s3, s7 = tl.split(o1)
        z = tl.zeros([BLOCK_N, 16], tl.bfloat16)
        s0 = s0[:, None] + z
        s1 = s1[:, None] + z
        s2 = s2[:, None] + z
        s3 = s3[:, None] + z
        s4 = s4[:, None] + z
        s5 = s5[:, None] + z
        s6 = s6[:, None] + z
        s7 = s7[:, None] + z
        v0, v1, v2, v3, v4, v5, v6, v7 = _decode8(words, s0, s1, s2, s3, s4, s5, s6, s7)
        kk = t * 128 + ri
        x_ptrs = x_ptr + rm[None, :] * stride_xm + kk[:, None]
        x_ok = m_ok[None, :]
        acc = tl.dot(v0, tl.load(x_ptrs + 0, mask=x_ok & (kk < K)[:, None], other=0.0), acc)
        acc = tl.dot(v1, tl.load(x_ptrs + 16, mask=x_ok & (kk + 16 < K)[:, None], other=0.0), acc)
        acc = tl.dot(v2, tl.load(x_ptrs + 32, mask=x_ok & (kk + 32 < K)[:, None], other=0.0), acc)
        acc = tl.dot(v3, tl.load(x_ptrs + 48, mask=x_ok & (kk + 48 < K)[:, None], other=0.0), acc)
        acc = tl.dot(v4, tl.load(x_ptrs + 64, mask=x_ok & (kk + 64 < K)[:, None], other=0.0), acc)
        acc = tl.dot(v5, tl.load(x_ptrs + 80, mask=x_ok & (kk + 80 < K)[:, None], other=0.0), acc)
        acc = tl.dot(v6, tl.load(x_ptrs + 96, mask=x_ok & (kk + 96 < K)[:, None], other=0.0), acc)
        acc = tl.dot(v7, tl.load(x_ptrs + 112, mask=x_ok & (kk + 112 < K)[:, None], other=0.0), acc)
    rs = tl.load(rs_ptr + rn, mask=n_ok, other=0.0) * 128.0
    out = acc * rs[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], out.to(y_ptr.dtype.element_ty),
                 mask=m_ok[None, :] & n_ok[:, None])
    else:
        tl.atomic_add(y_ptr + rm[None, :] * stride_ym + rn[:, None], out, mask=m_ok[None, :] & n_ok[:, None], sem="relaxed")


SLOT_BITS = {0: (15, (8, 7, 6)), 1: (12, (5, 4, 3)), 2: (9, (2, 1, 0)), 3: (14, (13, 11, 10))}


def relayout(codes: torch.Tensor, scales: torch.Tensor, block_n: int = 128):
    """codes (N, Kp/2) uint8 (low nibble = even column), scales (N, Kp/16) e4m3 ->
    words (Np, T*16) int32, scales (Np, T*8) bf16 (e4m3 * 2^119), T = ceil(Kp/128), Np = N
    padded to block_n. Word (n, t*16 + i): plane j (column t*128 + 16j + i) in lane j % 2,
    slot j // 2 (SLOT_BITS: sign bit, mag bits high to low)."""
    N = codes.shape[0]
    Kp = codes.shape[1] * 2
    T = -(-Kp // 128)
    Np = -(-N // block_n) * block_n
    c = torch.zeros(Np, T * 128, dtype=torch.int64, device=codes.device)
    c[:N, 0:Kp:2] = (codes & 15).long()
    c[:N, 1:Kp:2] = (codes >> 4).long()
    c = c.view(Np, T, 8, 16)
    words = torch.zeros(Np, T, 16, dtype=torch.int64, device=codes.device)
    for j in range(8):
        cj = c[:, :, j, :]
        base = 16 * (j % 2)
        sign_bit, mag_bits = SLOT_BITS[j // 2]
        words |= ((cj >> 3) & 1) << (base + sign_bit)
        for m, bit in zip((2, 1, 0), mag_bits):
            words |= ((cj >> m) & 1) << (base + bit)
    words = words.view(Np, T * 16)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    s = torch.zeros(Np, T * 8, dtype=torch.float32, device=codes.device)
    s[:N, :scales.shape[1]] = scales.float() * 2.0 ** 119
    return words.contiguous(), s.to(torch.bfloat16).contiguous()


def emulate_decode(words: torch.Tensor, s: torch.Tensor):
    """The asm's arithmetic in numpy-like torch ops: (Np, T*128) float32 values."""
    import numpy as np
    q = words.numpy().view(np.uint32).astype(np.uint64)
    Np, W = q.shape
    T = W // 16
    out = np.zeros((Np, T, 8, 16), dtype=np.float32)
    qq = q.reshape(Np, T, 16)
    sv = s.float().numpy().reshape(Np, T, 8)
    for j in range(8):
        lane = j % 2
        h = (qq >> (16 * lane)) & 0xFFFF
        slot = j // 2
        if slot == 0:
            b = h & 0x81C0
        elif slot == 1:
            b = (h << 3) & 0x81C0
        elif slot == 2:
            b = (h << 6) & 0x81C0
        else:
            b = ((h << 1) & 0x8000) | ((h >> 5) & 0x100) | ((h >> 4) & 0xC0)
        f32 = (b.astype(np.uint32) << 16).view(np.float32)
        out[:, :, j, :] = f32 * sv[:, :, j:j + 1]
    return torch.from_numpy(out.reshape(Np, T * 128))


def gemm(x, words, s, rs, N, K, BLOCK_N=64, BLOCK_M=16, SPLIT_K=1, num_warps=4, num_stages=3):
    M = x.shape[0]
    T = words.shape[1] // 16
    assert T % SPLIT_K == 0
    if SPLIT_K == 1:
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    else:
        y = torch.zeros(M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(M, BLOCK_M), SPLIT_K)
    w4a16_kernel[grid](x, words, s, rs, y, M, N, K, x.stride(0), words.stride(0), s.stride(0), y.stride(0),
                       T // SPLIT_K, NATIVE=x.is_cuda, BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M, SPLIT_K=SPLIT_K,
                       num_warps=num_warps, num_stages=num_stages)
    return y.to(x.dtype)
