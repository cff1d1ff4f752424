"""QAT's fake-quantized weight in one pass: Ŵ = round(W / s) * s under given group scales
(learned, searched or initialized: not each block's own), bit for bit as the reference,
lowbit.formats.quantize.grid_fake_quantize.

    out, inside = grid_fake_quantize(w, scales, zeros, element, group, inside=True)

One program takes BLOCK consecutive elements of w viewed as (R, K): each element's scale (and
zero point) is scales[r, k // group]. The steps are the reference's, in its order:
- data = w / s in float32, an IEEE division (`div_rn`; `/` lowers to an approximate one).
- Symmetric grids (intK, ternary): clamp to [-qmax, qmax], then round to nearest, ties to
  even, as (x + 1.5 * 2^23) - 1.5 * 2^23 (exact for |x| < 2^22; qmax <= 127 here), with the
  sign of a zero result copied from x (torch.round(-0.3) is -0.0). NaN stays NaN; an Inf
  saturates to ±qmax, as round_to_grid does.
- Asymmetric (zeros given): rounded the same way, then clamped to [-z, qmax - z], + 0.0
  (no -0.0); NaN stays NaN.
- binary: the sign, 0 to +1; seq2: floor(|x|) + 0.5 clamped to 1.5, x's sign copied.
- out = v * s in float32, rounded once to w's dtype; inside = x in the grid's range (NaN: no).
Everything is elementwise, so shapes of any K and group (group divides K), all-zero groups and
non-finite values need nothing special.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.formats.elements import BINARY, SEQ2, ElementFormat
from lowbit.kernels import interpret_mode
from lowbit.kernels.launch import cdiv
from lowbit.kernels.quantize import to_output, widen

__all__ = ["grid_fake_quantize", "BLOCK"]

BLOCK = 1024
_SYMMETRIC, _ASYMMETRIC, _BINARY, _SEQ2 = 0, 1, 2, 3
_RNE_SHIFT = tl.constexpr(12582912.0)   # 1.5 * 2^23


@triton.jit
def _rne(x):
    """x rounded to the nearest integer, ties to even, for |x| < 2^22 (NaN stays NaN); a zero
    result has x's sign."""
    r = (x + _RNE_SHIFT) - _RNE_SHIFT
    sign = x.to(tl.int32, bitcast=True) & -2147483648          # 0x80000000
    return tl.where(r == 0.0, sign.to(tl.float32, bitcast=True), r)


@triton.jit   # QMAX constexpr: under torch.compile a float argument comes as float64
def _grid_kernel(w_ptr, s_ptr, z_ptr, out_ptr, inside_ptr, N, K, G, QMAX: tl.constexpr,
                 GROUP: tl.constexpr, GRID: tl.constexpr, INSIDE: tl.constexpr,
                 BLOCK: tl.constexpr, NATIVE_CAST: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    w = widen(tl.load(w_ptr + offs, mask=ok, other=0.0), NATIVE_CAST)
    g = (offs // K) * G + (offs % K) // GROUP
    s = tl.load(s_ptr + g, mask=ok, other=1.0)
    x = tl.math.div_rn(w, s)
    nan = x != x
    if GRID == 0:       # symmetric: clamp (NaN kept below), then round
        v = _rne(tl.minimum(tl.maximum(x, -QMAX), QMAX))
        inside = tl.abs(x) <= QMAX
    elif GRID == 1:     # asymmetric: round, then clamp to the codes' range
        z = tl.load(z_ptr + g, mask=ok, other=0.0)
        v = tl.minimum(tl.maximum(_rne(x), -z), QMAX - z) + 0.0
        inside = (x >= -z) & (x <= QMAX - z)
    elif GRID == 2:     # binary: the sign, 0 to +1
        v = tl.where(x < 0.0, -1.0, 1.0)
        inside = tl.abs(x) <= QMAX
    else:               # seq2: the nearest half-integer, ties away from zero, the sign copied
        mag = tl.minimum(tl.floor(tl.abs(x)) + 0.5, 1.5)
        v = tl.where(x.to(tl.int32, bitcast=True) < 0, -mag, mag)
        inside = tl.abs(x) <= QMAX
    v = tl.where(nan, x, v)
    tl.store(out_ptr + offs, to_output(v * s, out_ptr, NATIVE_CAST), mask=ok)
    if INSIDE:
        tl.store(inside_ptr + offs, inside & ~nan, mask=ok)


def grid_fake_quantize(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       element: ElementFormat, group: int, inside: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """lowbit.formats.quantize.grid_fake_quantize on the kernel: (Ŵ in w's dtype, inside or
    None). w (..., K) float32 / bfloat16 / float16, any layout (copied to contiguous);
    scales (..., K // group) float32, zeros likewise or None (asymmetric)."""
    if element.is_float:
        raise ValueError(f"grid_fake_quantize takes integer-like grids, not {element.name}")
    K = w.shape[-1]
    if K % group:
        raise ValueError(f"the group ({group}) must divide the rows' length ({K})")
    grid = (_ASYMMETRIC if zeros is not None else _BINARY if element is BINARY
            else _SEQ2 if element is SEQ2 else _SYMMETRIC)
    wc = w.contiguous()
    s = scales.float().contiguous()
    z = zeros.float().contiguous() if zeros is not None else s
    out = torch.empty_like(wc)
    # bool written by the kernel (a view of int8 as bool does not lower under torch.compile)
    mask = torch.empty(wc.shape, dtype=torch.bool, device=w.device) if inside else out
    n = wc.numel()
    if n:
        _grid_kernel[(cdiv(n, BLOCK),)](
            wc, s, z, out, mask, n, K, K // group, float(element.max_value),
            GROUP=group, GRID=grid, INSIDE=inside, BLOCK=BLOCK, NATIVE_CAST=not interpret_mode())
    return out, (mask if inside else None)
