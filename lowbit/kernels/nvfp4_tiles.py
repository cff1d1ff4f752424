"""The NVFP4 GEMM's weight layout (lowbit.formats.nvfp4_tiles) made in one Triton launch.

    tiles = nvfp4_tiles_triton(codes, block_scales, row_scales, in_features)   # same bits
    nvfp4_tiles_triton(codes, block_scales, row_scales, in_features, out=tiles)  # in place

The reference re-lays a weight with about 35 torch ops (a table lookup a plane), each a kernel
launch on a GPU, and a weight sync re-lays every linear of the model (what that cost, before
and after this kernel: docs/results/rollout.md). This kernel writes the same three tensors --
words, scales and row scales -- in one launch a weight, and with `out` into the tensors a CUDA
graph already reads (no copy after).

Each program takes BLOCK_R rows of one 128-column tile: for each plane j (NVFP4 block j of the
tile) it gathers the 16 codes' nibbles from the packed bytes and looks up the bits each code
sets in its word (lowbit.formats.nvfp4_tiles' slot table: the planes' bits are disjoint, so
the word is their OR); the 8 block scales of the tile are decoded from their E4M3 bytes and
written times 2^119 as bfloat16 (exact), and the first tile's programs write the row scales
times 2^7. Padding rows and columns get zero words and zero scales, as the reference's.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lowbit.formats.nvfp4_tiles import ROW_BIAS, ROW_PAD, TILE_K, NVFP4Tiles, slot_table_on
from lowbit.kernels.launch import cdiv

__all__ = ["nvfp4_tiles_triton"]

BLOCK_R = 32


@triton.jit
def _nvfp4_tiles_kernel(codes_ptr, bscale_ptr, rscale_ptr, table_ptr, words_ptr, scales_ptr,
                        rows_out_ptr, total_rows, n, n_pad, code_bytes, n_blocks, T,
                        ROW_BIAS: tl.constexpr, BLOCK_R: tl.constexpr):
    pid_r = tl.program_id(0)
    t = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)         # padded row index over every expert
    in_range = r < total_rows
    e = r // n_pad
    row = r % n_pad
    live = in_range & (row < n)
    src = (e * n + row).to(tl.int64)                   # the row in the unpadded inputs
    i = tl.arange(0, 16)
    word = tl.zeros((BLOCK_R, 16), dtype=tl.int32)
    for j in tl.static_range(8):
        col = t * 128 + 16 * j + i                     # this plane's 16 columns
        byte = col // 2
        ok = live[:, None] & (byte < code_bytes)[None, :]
        b = tl.load(codes_ptr + src[:, None] * code_bytes + byte[None, :], mask=ok, other=0)
        nib = (b.to(tl.int32) >> ((col % 2) * 4)[None, :]) & 15
        word = word | tl.load(table_ptr + j * 16 + nib)
    out_row = r.to(tl.int64)
    tl.store(words_ptr + out_row[:, None] * (T * 16) + t * 16 + i[None, :], word,
             mask=in_range[:, None])

    # the tile's 8 block scales: E4M3 bytes decoded, times 2^119, exact in bfloat16
    jb = tl.arange(0, 8)
    blk = t * 8 + jb
    ok = live[:, None] & (blk < n_blocks)[None, :]
    s = tl.load(bscale_ptr + src[:, None] * n_blocks + blk[None, :], mask=ok, other=0).to(tl.int32)
    sign = (s >> 7) & 1
    ex = (s >> 3) & 15
    man = s & 7
    # normal: (1 + man/8) 2^(ex-7) 2^119, built as float32 bits; subnormal: man 2^-9 2^119
    normal = ((ex + 239) << 23) | (man << 20)
    value = tl.where(ex == 0, man.to(tl.float32) * 1.2980742146337069e33,   # 2^110
                     normal.to(tl.float32, bitcast=True))
    value = tl.where((ex == 15) & (man == 7), float("nan"), value)
    # the sign as a bit (negating would give +0.0 for -0.0 where it compiles to 0 - x)
    value = (value.to(tl.int32, bitcast=True) | (sign << 31)).to(tl.float32, bitcast=True)
    tl.store(scales_ptr + out_row[:, None] * (T * 8) + blk[None, :], value.to(tl.bfloat16),
             mask=in_range[:, None])

    if t == 0:
        rs = tl.load(rscale_ptr + src, mask=live, other=0.0)
        tl.store(rows_out_ptr + (e * n + row).to(tl.int64), rs * ROW_BIAS, mask=live)


@torch.no_grad()
def nvfp4_tiles_triton(codes: torch.Tensor, block_scales: torch.Tensor, row_scales: torch.Tensor,
                       in_features: int, out: NVFP4Tiles | None = None) -> NVFP4Tiles:
    """lowbit.formats.nvfp4_tiles's layout, the same bits, in one launch: codes (.., N, Kp/2)
    uint8, block scales (.., N, Kp/16) float8_e4m3fn, row scales (.., N) float32, all on one
    device (CUDA, or the CPU under TRITON_INTERPRET=1). out: tiles of this shape whose tensors
    are written in place (returned); None allocates new ones."""
    lead, n = codes.shape[:-2], codes.shape[-2]
    code_bytes = codes.shape[-1]
    T = -(-(code_bytes * 2) // TILE_K)
    n_pad = -(-n // ROW_PAD) * ROW_PAD
    if out is None:
        out = NVFP4Tiles(
            torch.empty(*lead, n_pad, T * 16, dtype=torch.int32, device=codes.device),
            torch.empty(*lead, n_pad, T * 8, dtype=torch.bfloat16, device=codes.device),
            torch.empty(*lead, n, dtype=torch.float32, device=codes.device), n, in_features)
    elif (tuple(out.words.shape) != (*lead, n_pad, T * 16) or out.in_features != in_features
          or out.out_features != n or tuple(out.scales.shape) != (*lead, n_pad, T * 8)
          or tuple(out.row_scales.shape) != (*lead, n)
          or (out.words.dtype, out.scales.dtype, out.row_scales.dtype)
          != (torch.int32, torch.bfloat16, torch.float32)
          or any(t.device != codes.device or not t.is_contiguous()
                 for t in (out.words, out.scales, out.row_scales))):
        raise ValueError(f"out holds tiles of shape {tuple(out.words.shape)}, not the "
                         f"{(*lead, n_pad, T * 16)} these codes make (or tensors of another "
                         f"shape, dtype or device, or not contiguous)")
    table = slot_table_on(codes.device)
    codes = codes.contiguous()
    scale_bytes = block_scales.contiguous().view(torch.uint8)
    rows = row_scales.to(torch.float32).contiguous()
    total = math.prod(lead) * n_pad
    grid = (cdiv(total, BLOCK_R), T)
    _nvfp4_tiles_kernel[grid](codes, scale_bytes, rows, table, out.words, out.scales,
                              out.row_scales, total, n, n_pad, code_bytes,
                              block_scales.shape[-1], T, ROW_BIAS=ROW_BIAS, BLOCK_R=BLOCK_R)
    return out
