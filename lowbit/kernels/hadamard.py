"""NVFP4 fake quantization of the random Hadamard transform along a tensor's rows: nvfp4's
wgrad operands, without reading a transposed view.

    v = fake_quantize_rht_rows(t, spec, signs)   # t (N, F), N % 16 == 0 -> v (N, F)
    # == fake_quantize_triton(t.mT, spec, hadamard=signs).mT, bit for bit

The wgrad GEMM dW = dY^T X wants dY and X with 1x16 blocks along N (tokens), each group of 16
tokens rotated by a 16-point random Hadamard transform first. quantize.py's kernel does that
on t.mT, a (F, N) view whose groups run along its strided dim: its tile is read with the
features contiguous while the rotation and the blocks run across them, and the butterflies'
reshapes move the tile through shared memory (H200, 2026-11-30, benchmarks/tune.py nvfp4,
both passes against the time of their bytes at copy speed: 2.3-2.4x on X^T, 2.9-3.1x on the
stochastically rounded dY^T, against 1.2-1.9x for X and dY without the rotation; this kernel
1.6-1.7x on X^T).

Here one program takes G groups of 16 rows and TILE_F columns of t (F contiguous) as 16
separate (G, TILE_F) tensors, one per position j in the group: the butterflies are
elementwise adds between them, a block's amax is the elementwise max of the 16, and every
load and store runs along F. The arithmetic is quantize.py's, step for step (the same helpers:
signs, float32 butterflies at strides 1, 2, 4, 8, times 1/4, rounded to t's dtype; then
`nvfp4_scales` and `dequantized`), and stochastic rounding draws each element's uniform by
its index in t.mT, (f * N + n): the seed contract's, so both kernels give the same bits. The
two-level tensor amax takes a first pass over the rotated values (AMAX_ONLY).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.formats.quantize import check_input
from lowbit.kernels import quantize as kq
from lowbit.kernels import seed_tensor
from lowbit.kernels.launch import cdiv
from lowbit.kernels.quantize import (
    TWO_POW_M24, dequantized, load_float32, nvfp4_scales, to_output, widen,
)

__all__ = ["fake_quantize_rht_rows", "rht_rows_supported"]


@triton.jit
def _rotated_groups(t_ptr, signs_ptr, N, F, stride_n, stride_f, pid_g, pid_f,
                    G: tl.constexpr, TILE_F: tl.constexpr, NATIVE_CAST: tl.constexpr):
    """The program's 16 (G, TILE_F) float32 tensors, position j of each group of 16 rows:
    random_hadamard's values (signs, butterflies, 1/4, rounded to t's dtype), 0 outside t;
    and the groups, the columns and which elements are in t."""
    groups = pid_g * G + tl.arange(0, G)
    cols = pid_f * TILE_F + tl.arange(0, TILE_F)
    mask = (groups[:, None] < N // 16) & (cols[None, :] < F)
    base = (t_ptr + (groups.to(tl.int64) * 16)[:, None] * stride_n
            + cols.to(tl.int64)[None, :] * stride_f)
    xs = ()
    for j in tl.static_range(16):
        xs = xs + (load_float32(base + j * stride_n, mask, NATIVE_CAST) * tl.load(signs_ptr + j),)
    for d in tl.static_range(4):   # butterflies a + b, a - b at stride 2^d
        rotated = ()
        for j in tl.static_range(16):
            if (j >> d) % 2 == 0:
                rotated = rotated + (xs[j] + xs[j + (1 << d)],)
            else:
                rotated = rotated + (xs[j - (1 << d)] - xs[j],)
        xs = rotated
    out = ()
    for j in tl.static_range(16):
        x = xs[j] * 0.25
        if t_ptr.dtype.element_ty != tl.float32:
            x = widen(to_output(x, t_ptr, NATIVE_CAST), NATIVE_CAST)
        out = out + (x,)
    return out, groups, cols, mask


@triton.jit
def _rht_rows_kernel(
    t_ptr, out_ptr, amax_ptr, seed_ptr, signs_ptr,
    N, F, stride_n, stride_f,
    AMAX_ONLY: tl.constexpr, TWO_LEVEL: tl.constexpr, STOCHASTIC: tl.constexpr,
    G: tl.constexpr, TILE_F: tl.constexpr, OUT_LIMIT: tl.constexpr, NATIVE_CAST: tl.constexpr,
):
    # AMAX_ONLY: the max finite |rotated value| (int32 bits) into amax_ptr. Otherwise: out (N, F)
    # contiguous, the fake-quantized rotated values, 1x16 NVFP4 blocks along N (one per group).
    # one grid axis (up to 2^31 - 1 programs), the column tiles of a row band consecutive: the
    # launch order of the (column tiles, row bands) grid this kernel was measured with
    n_tiles_f = tl.cdiv(F, TILE_F)
    pid_f = tl.program_id(0) % n_tiles_f
    pid_g = tl.program_id(0) // n_tiles_f
    xs, groups, cols, mask = _rotated_groups(t_ptr, signs_ptr, N, F, stride_n, stride_f, pid_g,
                                             pid_f, G, TILE_F, NATIVE_CAST)
    amax_bits = tl.zeros((G, TILE_F), dtype=tl.int32)
    for j in tl.static_range(16):
        abits = xs[j].to(tl.int32, bitcast=True) & 0x7FFFFFFF
        if AMAX_ONLY:
            abits = tl.where(abits < 0x7F800000, abits, 0)        # finite values only
        amax_bits = tl.maximum(amax_bits, abits)
    if AMAX_ONLY:
        tl.atomic_max(amax_ptr, tl.max(tl.max(amax_bits, axis=1), axis=0))
    else:
        bad = amax_bits >= 0x7F800000                            # NaN or Inf in the block
        _, recip, elem_scale, _ = nvfp4_scales(amax_bits.to(tl.float32, bitcast=True), bad,
                                                amax_ptr, TWO_LEVEL)
        elem_scale = tl.where(bad, 0x7FC00000,
                              elem_scale.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
        rows0 = groups.to(tl.int64)[:, None] * 16                  # (G, 1): the group's first row
        seed = 0
        if STOCHASTIC:
            seed = tl.load(seed_ptr)
        r = (0, 0, 0, 0)
        for j in tl.static_range(16):
            x = xs[j]
            u = 0.0
            if STOCHASTIC:
                if j % 4 == 0:   # rows j .. j + 3 of each group share one Philox call:
                    # element (n, f) of t is (f, n) of t.mT, seed-contract index f * N + n, and
                    # n = 16 g + j + lane, so the four lanes share the counter (f * N + n) // 4
                    quads = (cols.to(tl.int64)[None, :] * N + rows0 + j) // 4
                    r = tl.philox(seed, (quads & 0xFFFFFFFF).to(tl.uint32),
                                  (quads >> 32).to(tl.uint32), 0, 0)
                u = (r[j % 4] >> 8).to(tl.int32).to(tl.float32) * TWO_POW_M24
            mag = tl.minimum(tl.abs(x * recip), 6.0)
            # E2M1: emin 0, 1 mantissa bit, largest value 6
            value = dequantized(mag, u, x.to(tl.int32, bitcast=True), elem_scale, 0, 1, 6.0,
                                 STOCHASTIC, False, OUT_LIMIT)
            tl.store(out_ptr + (rows0 + j) * F + cols[None, :],
                     to_output(value, out_ptr, NATIVE_CAST), mask=mask)


def rht_rows_supported(t: torch.Tensor, spec) -> bool:
    """Whether fake_quantize_rht_rows takes (t, spec): a 2-D t whose rows come in groups of
    16, NVFP4 with 1x16 blocks (one per rotated group)."""
    return (t.dim() == 2 and t.shape[0] % 16 == 0 and spec.format == "nvfp4"
            and tuple(spec.block) == (1, 16))


def _config(n: int, f: int) -> tuple[int, int, int]:
    """(G groups of 16 rows, TILE_F columns, warps) of one program: 2 x 128 and 4 warps, the
    fastest of the 18 swept (G 1/2/4, TILE_F 128/256/512, 4/8 warps) at 8192x2048 and within
    0.3% of it at 8192x5504 (benchmarks/tune.py nvfp4 --rotated, H200, 2026-11-30; 42.9 and
    104.9 us for both passes against 58.4 and 157.6 us for quantize.py's kernel on the
    transposed view)."""
    return min(2, kq.pow2_at_least(n // 16)), min(128, kq.pow2_at_least(f)), 4


def fake_quantize_rht_rows(t: torch.Tensor, spec, signs: torch.Tensor, seed=None, *,
                           generator: torch.Generator | None = None,
                           config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """t (N, F) -> (N, F) contiguous: each group of 16 rows rotated by the random Hadamard
    transform with `signs` (16 of +-1), then fake-quantized with NVFP4 1x16 blocks along N;
    equal bit for bit to `fake_quantize_triton(t.mT, spec, hadamard=signs).mT` (and so to
    `quantize_dequantize(random_hadamard(t.mT, signs), spec).mT`, the reference). seed as in
    fake_quantize_triton (stochastic specs); config: (G, TILE_F, warps), for benchmarks."""
    check_input(t, spec)
    if not rht_rows_supported(t, spec):
        raise ValueError(f"fake_quantize_rht_rows takes a 2-D t with rows in groups of 16 and "
                         f"NVFP4 1x16 blocks; got shape {tuple(t.shape)}, {spec}")
    kq.require_kernel_tensor(t)
    if signs.shape != (16,):
        raise ValueError(f"signs must hold 16 values (+-1), got shape {tuple(signs.shape)}")
    n, f = t.shape
    stochastic = spec.rounding.value == "stochastic"
    seed_t = (seed_tensor(seed, generator, t.device) if stochastic
              else kq.empty_arg(t.device, torch.int64))
    signs = signs.to(t.device, torch.float32)
    g, tile_f, warps = config or _config(n, f)
    if not all(v > 0 and v & (v - 1) == 0 for v in (g, tile_f, warps)):
        raise ValueError(f"config (groups, columns, warps) must be powers of two, got {config}")
    out = torch.empty(n, f, device=t.device, dtype=t.dtype)
    grid = (cdiv(f, tile_f) * cdiv(n // 16, g),)
    if grid[0] >= 2**31:
        raise ValueError(f"shape {(n, f)} needs {grid[0]} programs, past CUDA's 2^31 - 1; use "
                         "larger tiles (config)")
    two_level = bool(spec.tensor_scale)
    amax = kq.empty_arg(t.device, torch.int32)
    args = dict(STOCHASTIC=stochastic, G=g, TILE_F=tile_f, OUT_LIMIT=kq.OUT_LIMIT[t.dtype],
                NATIVE_CAST=not kq.INTERPRET, TWO_LEVEL=two_level, num_warps=warps)
    with kq.on_device(t):
        if two_level:
            amax = torch.zeros(1, device=t.device, dtype=torch.int32)
            _rht_rows_kernel[grid](t, out, amax, seed_t, signs, n, f, *t.stride(),
                                   AMAX_ONLY=True, **args)
        _rht_rows_kernel[grid](t, out, amax, seed_t, signs, n, f, *t.stride(),
                               AMAX_ONLY=False, **args)
    return out
