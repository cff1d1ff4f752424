"""Packed NVFP4 weights re-laid for the rollout engine's tensor-core GEMM
(lowbit.kernels.engine_linear): made once at weight sync from a LinearWeight's own codes and
scales (the QTensors' bytes stay the source of truth), so that the GEMM's inner loop turns 8
codes into 8 bf16 weights with a few integer instructions and one packed multiply a pair.

    tiles = nvfp4_tiles(weight.data, weight.block_scales, weight.row_scales, weight.in_features)
    tiles.values()             # (.., N, K) float32: the exact NVFP4 values (what the GEMM multiplies)

Layout, per row, K in tiles of 128 columns (K padded with zero codes), rows padded to a multiple
of ROW_PAD with zeros:

- `words` (.., Np, T*16) int32: word t*16 + i holds the 8 codes of columns t*128 + 16 j + i,
  j = 0..7 -- "plane" j of the tile is NVFP4 block j, so each plane has one block scale per
  row. Code j sits in 16-bit lane j % 2 of the word, in slot j // 2 (SLOT_BITS: where its sign
  bit and its three magnitude bits go), chosen so that a slot's code becomes the bf16 bit
  pattern of e2m1 * 2^-126 by one shift and one mask for slots 0-2 (sign at bit 15, magnitude
  at the exponent's low two bits and the mantissa's top bit; the code 0.5 becomes a bf16
  subnormal), a few more for slot 3.
- `scales` (.., Np, T*8) bfloat16: each block's E4M3 scale times 2^119 (exact in bf16: E4M3
  has 4 significant bits, and 448 * 2^119 < bf16's largest). So decoded value times scale is
  e2m1 * e4m3 * 2^-7, exact in bf16 (at most 6 significant bits, 2^-17 .. 21).
- `row_scales` (.., N) float32: the FP32 tensor scale of each row's part times 2^7, applied to
  the float32 accumulator once at the end.

The GEMM so multiplies the exact NVFP4 weight e2m1 * e4m3 * tensor_scale (products exact,
float32 sums), as FP4 tensor cores do: not the weight rounded to bf16 that
LinearWeight.dequantize() gives (a relative 2^-9 apart at most).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowbit.formats.elements import E2M1, decode, device_table

__all__ = ["NVFP4Tiles", "TilesMaker", "nvfp4_tiles", "slot_table", "slot_table_on", "TILE_K", "ROW_PAD",
           "SLOT_BITS", "SCALE_BIAS", "ROW_BIAS"]

TILE_K = 128
ROW_PAD = 128
"""Rows are padded to a multiple of this (the largest tile's rows), so tiles read no masks."""
SLOT_BITS = ((15, (8, 7, 6)), (12, (5, 4, 3)), (9, (2, 1, 0)), (14, (13, 11, 10)))
"""Per slot (0-3) of a 16-bit lane: the sign bit's position and the magnitude bits' (high to
low). Slot s's decode: slots 0-2 `(lane << 3 s) & 0x81C0`; slot 3 `((lane << 1) & 0x8000) |
((lane >> 5) & 0x100) | ((lane >> 4) & 0xC0)`."""
SCALE_BIAS = 2.0 ** 119
ROW_BIAS = 2.0 ** 7


@dataclass
class NVFP4Tiles:
    words: torch.Tensor
    """(.., Np, T*16) int32 (see the module doc)."""
    scales: torch.Tensor
    """(.., Np, T*8) bfloat16: E4M3 block scales times 2^119."""
    row_scales: torch.Tensor
    """(.., N) float32: tensor scales times 2^7."""
    out_features: int
    in_features: int

    @property
    def tiles_k(self) -> int:
        """T: tiles of 128 columns per row."""
        return self.words.shape[-1] // 16

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.scales, self.row_scales))

    @torch.no_grad()
    def copy_(self, other: NVFP4Tiles) -> None:
        """other's tensors into this one's, in place (CUDA graphs reading these stay valid)."""
        if other.words.shape != self.words.shape or other.in_features != self.in_features:
            raise ValueError(f"copy_ needs tiles of one shape (got {tuple(other.words.shape)} for "
                             f"{tuple(self.words.shape)})")
        self.words.copy_(other.words)
        self.scales.copy_(other.scales)
        self.row_scales.copy_(other.row_scales)

    def values(self) -> torch.Tensor:
        """(.., N, K) float32: the weight the GEMM multiplies, decoded from the tiles (for tests:
        it equals the LinearWeight's exact NVFP4 values)."""
        lead = self.words.shape[:-2]
        n_pad, T = self.words.shape[-2], self.tiles_k
        w = self.words.to(torch.int64) & 0xFFFFFFFF
        codes = torch.empty(*lead, n_pad, T, 8, 16, dtype=torch.int64, device=w.device)
        w = w.view(*lead, n_pad, T, 16)
        for j in range(8):
            lane = (w >> (16 * (j % 2))) & 0xFFFF
            sign_bit, mag_bits = SLOT_BITS[j // 2]
            code = ((lane >> sign_bit) & 1) << 3
            for m, bit in zip((2, 1, 0), mag_bits):
                code |= ((lane >> bit) & 1) << m
            codes[..., j, :] = code
        values = decode(codes.view(*lead, n_pad, T * 128), E2M1)
        scale = (self.scales.float() / SCALE_BIAS).repeat_interleave(16, dim=-1)
        values = values * scale
        n, k = self.out_features, self.in_features
        return values[..., :n, :k] * (self.row_scales / ROW_BIAS)[..., None]


TilesMaker = Callable[..., "NVFP4Tiles"]
"""(codes, block_scales, row_scales, in_features, out=None) -> NVFP4Tiles: `nvfp4_tiles`, or a
kernel that writes the same bits (lowbit.kernels.nvfp4_tiles_triton)."""


def slot_table() -> torch.Tensor:
    """(8, 16) int32: for plane j and code c, the bits c sets in its word (SLOT_BITS' slot
    j // 2, in lane j % 2; bit 31 is the int32 sign). The planes' bits are disjoint, so a word
    is the OR of its 8 entries."""
    table = torch.zeros(8, 16, dtype=torch.int64)
    for j in range(8):
        sign_bit, mag_bits = SLOT_BITS[j // 2]
        for c in range(16):
            bits = ((c >> 3) & 1) << sign_bit
            for m, bit in zip((2, 1, 0), mag_bits):
                bits |= ((c >> m) & 1) << bit
            table[j, c] = bits << (16 * (j % 2))
    return torch.where(table >= 2 ** 31, table - 2 ** 32, table).to(torch.int32)


_SLOT_TABLE = slot_table()
_TABLES: dict[torch.device, torch.Tensor] = {}


def slot_table_on(device: torch.device) -> torch.Tensor:
    """slot_table() on `device`, copied once and kept for the process (elements.device_table):
    the reference and the kernel (lowbit.kernels.nvfp4_tiles) read the same copy."""
    return device_table(device, _TABLES, lambda: _SLOT_TABLE)


@torch.no_grad()
def nvfp4_tiles(codes: torch.Tensor, block_scales: torch.Tensor, row_scales: torch.Tensor,
                in_features: int, out: NVFP4Tiles | None = None) -> NVFP4Tiles:
    """A LinearWeight's NVFP4 parts -- codes (.., N, Kp/2) uint8 (low nibble the even column),
    block scales (.., N, Kp/16) float8_e4m3fn, row scales (.., N) float32 -- re-laid as tiles
    on their device: a table lookup a plane, about 35 torch ops whatever the shape, and under
    3 bytes a weight of scratch (lowbit.kernels.nvfp4_tiles_triton writes the same bits in one
    launch). out: tiles of this shape to copy the result into (returned); None: new ones."""
    lead, n = codes.shape[:-2], codes.shape[-2]
    kp = codes.shape[-1] * 2
    T = -(-kp // TILE_K)
    n_pad = -(-n // ROW_PAD) * ROW_PAD
    nib = torch.stack((codes & 15, codes >> 4), dim=-1).view(*lead, n, kp)        # uint8 codes
    nib = F.pad(nib, (0, T * TILE_K - kp, 0, n_pad - n)).view(*lead, n_pad, T, 8, 16)
    table = slot_table_on(codes.device)
    words = torch.zeros(*lead, n_pad, T, 16, dtype=torch.int32, device=codes.device)
    for j in range(8):
        words |= table[j][nib[..., j, :].int()]
    scales = F.pad((block_scales.to(torch.float32) * SCALE_BIAS).to(torch.bfloat16),
                   (0, T * 8 - block_scales.shape[-1], 0, n_pad - n))
    tiles = NVFP4Tiles(words.view(*lead, n_pad, T * 16), scales,
                       row_scales.to(torch.float32) * ROW_BIAS, n, in_features)
    if out is None:
        return tiles
    out.copy_(tiles)
    return out
