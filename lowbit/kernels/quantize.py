"""Fused Triton quantize kernels: MXFP4 / MXFP8 (E8M0 scales, floor or rceil) and NVFP4
(E4M3 block scales, single- or two-level), and for fake quantization also intK (float32
absmax scales), 1D (1, b) blocks and square (b, b) tiles, RNE or stochastic rounding, all
bit-exact to lowbit.formats.quantize (the reference and the oracle).

One program loads a tile of TILE_R x TILE_C input values once and, from registers: takes each
block's amax, derives its scale, scales, rounds, encodes, packs two FP4 codes per byte and
stores the codes and scales (`quantize`), and/or the dequantized values in the input dtype
(`fake quantize`); with 2D tiles it can also store the transposed codes / values from the
same registers (the tile's scale is the same for x and x^T, so nothing is requantized).

How the bits match the reference (every step is the reference's operation, in its order):
- amax on the bits: |x| as int32 (the sign bit cleared) orders like the float, and any
  NaN/Inf has bits >= 0x7F800000, so one integer max gives both the amax and the "block is
  not finite" flag, independent of how a float max treats NaN.
- Divisions are `tl.math.div_rn` (IEEE round-to-nearest; `/` on fp32 lowers to an
  approximate division on NVIDIA GPUs). There are no float adds that fp-fusion could fold
  into an FMA with a rounded product: every product that feeds an add below is exact.
- MX floor: floor(log2 amax) is the biased exponent field - 127; amax == 0 and float32
  subnormal amaxes clamp to code 0 (2^-127), as the reference's frexp + clamp do.
- MX rceil: d = amax / max_elem (rounded once), then rounded up to a power of two on its bits
  (the exponent, plus one when the mantissa is non-zero; subnormal d handled on its mantissa).
  When d underflows to 0 while amax > 0 (amax <= max_elem * 2^-150), the block takes the
  smallest scale, code 0 (2^-127), as in the reference.
- NVFP4: s = (amax / 6) [/ s_t], clamped to [2^-6, 448], rounded to E4M3 (RNE); the element
  factor is (1 / s_t) / s -- a multiply by one rounded reciprocal, as the reference does.
  The tensor scale s_t = max(amax_finite / 2688, 2^-120) needs the whole tensor's amax: a
  first kernel reduces the finite |x| bits of every tile into one int32 with atomic_max,
  then the quantize kernel reads it. Two-level NVFP4 therefore reads x twice.
- Element rounding (E2M1, E4M3, E5M2) is the reference's round_to_grid: mag = min(|x| *
  factor, max_elem), binade b = max(floor(log2 mag), emin), ratio = mag * 2^(mbits - b)
  (exact), steps = RNE(ratio) -- ratio + 2^23 rounds to an integer, ties to even, and its
  low mantissa bits are that integer -- or floor(ratio + u) (the sum is >= 0, so a
  truncating conversion). The code is steps + ((b - emin) << mbits), one formula for all
  three formats that also covers their subnormals and the carry into the next binade.
- intK (values only): scale = amax / qmax, x * (1 / scale) (or x / scale where the
  reciprocal overflows, a block of float32 subnormals), rounded by the same round_to_grid
  with emin = mbits (spacing 1 everywhere), times the scale; a rounded zero is +0, as
  integer codes decode.
- The random Hadamard transform (nvfp4's wgrad operands), when asked for: each group of 16
  along C times its signs, float32 butterflies a + b, a - b at strides 1, 2, 4, 8, times 1/4,
  rounded to x's dtype: lowbit.ops.linear.random_hadamard's arithmetic in its order, in
  registers before the amax (and in the two-level tensor amax's pass too).
- Casts: bfloat16 -> float32 is exact, float32 -> bfloat16 / float16 round to nearest even:
  natively on the GPU; in Triton's interpreter, which truncates to bfloat16 and mangles
  bfloat16 subnormals, both are done on the bits.

Stochastic rounding seed contract. Element i -- its row-major index in x's logical shape
(leading dims included, padding excluded; the same index whatever the tile, grid, block
layout or memory strides) -- uses the uniform u_i = (r >> 8) * 2^-24 in [0, 1) (24 random
bits, the law of torch.rand), where r is word (i mod 4) of Philox4x32-10 (Random123, Triton's
`tl.philox`) with key (seed mod 2^32, seed >> 32) and counter (i // 4 mod 2^32, i // 4 >> 32,
0, 0). One Philox call serves four consecutive elements. `tl.rand` is not used: it maps to
[0, 1] and can return 1.0, which would round an on-grid value up by a whole step.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

from lowbit.kernels.launch import cdiv

__all__ = ["INTERPRET", "TileConfig", "default_config", "launch", "uniforms", "pow2_at_least",
           "amax_config", "sm_count", "tensor_amax_kernel", "group_amax", "to_output"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

_F32_MAX = 3.4028234663852886e38
OUT_LIMIT = {torch.float32: _F32_MAX, torch.bfloat16: 3.3895313892515355e38,
              torch.float16: 65504.0}

# element formats: (emin, mbits, emax, max value, largest finite code, sign bit)
_ELEMENTS = {
    "e2m1": (0, 1, 2, 6.0, 0x7, 3),
    "e4m3": (-6, 3, 8, 448.0, 0x7E, 7),
    "e5m2": (-14, 2, 15, 57344.0, 0x7B, 7),
}
# intK (fake quantization only): a grid of step 1 up to 2^(K-1) - 1 is the minifloat grid whose
# smallest binade starts at 2^MBITS, past every value, so _round_to_grid's spacing is 1
# everywhere. (Codes and sign bit are unused: the kernels write no int codes.)
_ELEMENTS.update({f"int{k}": (k - 1, k - 1, 0, float(2 ** (k - 1) - 1), 0, 0)
                  for k in range(2, 9)})
SCALE_NVFP4, SCALE_FLOOR, SCALE_RCEIL, SCALE_ABSMAX = 0, 1, 2, 3
TENSOR_SCALE_MIN = tl.constexpr(2.0**-120)   # the reference's NVFP4_TENSOR_SCALE_MIN
E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)      # NVFP4 block scales clamp here (as torchao)
TWO_POW_M24 = tl.constexpr(2.0**-24)
SIGN_MASK = tl.constexpr(-2147483648)        # 0x80000000 as an int32


@triton.jit
def pow2(e):
    """2^e as float32 for int32 e in [-126, 127], built on the bits (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2_wide(e):
    """2^e for e in [-127, 127]: 2^-127 is the float32 subnormal 0x00400000."""
    return tl.where(e == -127, 0x00400000, (e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_grid(mag, u, EMIN: tl.constexpr, MBITS: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Round magnitudes (float32 in [0, max]) onto a minifloat grid: (steps, bexp) with the
    value steps * 2^(bexp - 127 - MBITS), bexp the biased exponent of the binade (>= emin)."""
    bexp = tl.maximum(mag.to(tl.int32, bitcast=True) >> 23, EMIN + 127)
    to_ratio = ((MBITS + 254 - bexp) << 23).to(tl.float32, bitcast=True)  # 2^(MBITS - b), exact
    if STOCHASTIC:
        steps = (mag * to_ratio + u).to(tl.int32)      # floor (the sum is >= 0) of one rounding
    else:
        # the exact ratio + 2^23 rounds to an integer, ties to even, held in the low bits
        steps = (mag * to_ratio + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    return steps, bexp


@triton.jit
def e8m0_exponent(amax_bits, EMAX: tl.constexpr, MAXV: tl.constexpr, RCEIL: tl.constexpr):
    """A block's E8M0 scale exponent, unbiased, in [-127, 127], from its amax's bits (int32,
    the sign cleared): floor, 2^(floor(log2 amax) - emax_elem); or rceil, amax / max_elem
    rounded up to a power of two on its bits. (Meaningless for NaN/Inf amaxes: callers flag
    those blocks.)"""
    if RCEIL:
        d_bits = tl.math.div_rn(amax_bits.to(tl.float32, bitcast=True), MAXV).to(
            tl.int32, bitcast=True)
        d_exp = d_bits >> 23
        d_man = d_bits & 0x7FFFFF
        unbiased = tl.where(d_exp > 0, d_exp - 127 + (d_man != 0).to(tl.int32),
                            -127 + (d_man > 0x400000).to(tl.int32))
        unbiased = tl.where(d_bits == 0, -127, unbiased)           # amax / max underflowed
    else:
        unbiased = (amax_bits >> 23) - 127 - EMAX
    return tl.minimum(tl.maximum(unbiased, -127), 127)


@triton.jit
def round_value(mag, u, EMIN: tl.constexpr, MBITS: tl.constexpr, MAXV: tl.constexpr,
                 STOCHASTIC: tl.constexpr):
    """_round_to_grid's result as a float32 value (exact: a point of the grid). RNE takes
    fewer integer operations: mag + K - K with K = 2^(b + 23 - MBITS), b mag's binade (>=
    emin), rounds mag to the grid's spacing in that binade, ties to even, since the float add's
    ulp at K is that spacing and K is an even multiple of it (the sum's last bit is the code's);
    a carry into the next binade lands on its first point; subtracting K is exact."""
    if STOCHASTIC:
        steps, bexp = _round_to_grid(mag, u, EMIN, MBITS, True)
        return tl.minimum(steps.to(tl.float32) * pow2(bexp - 127 - MBITS), MAXV)
    else:
        k = (tl.maximum(mag.to(tl.int32, bitcast=True) & 0x7F800000, (EMIN + 127) << 23)
             + ((23 - MBITS) << 23)).to(tl.float32, bitcast=True)
        return (mag + k) - k


@triton.jit
def block_max(t, TR: tl.constexpr, TC: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """(TR, TC) -> (TR/BR, TC/BC): max over each block."""
    if BR == 1:
        return tl.max(tl.reshape(t, (TR, TC // BC, BC)), axis=2)
    else:
        return tl.max(tl.max(tl.reshape(t, (TR // BR, BR, TC // BC, BC)), axis=3), axis=1)


@triton.jit
def expand_blocks(t, TR: tl.constexpr, TC: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """(TR/BR, TC/BC) -> (TR, TC): each block's value on each of its elements."""
    if BR == 1:
        return tl.reshape(tl.broadcast_to(t[:, :, None], (TR, TC // BC, BC)), (TR, TC))
    else:
        full = tl.broadcast_to(t[:, None, :, None], (TR // BR, BR, TC // BC, BC))
        return tl.reshape(full, (TR, TC))


@triton.jit
def _pack_fp4(codes, TR: tl.constexpr, TC: tl.constexpr):
    """(TR, TC) int32 codes -> (TR, TC/2) uint8, the even element in the low nibble."""
    even, odd = tl.split(tl.reshape(codes, (TR, TC // 2, 2)))
    return (even | (odd << 4)).to(tl.uint8)


@triton.jit
def philox_uniforms(seed, first, C, rows, col0, TR: tl.constexpr, TC: tl.constexpr,
              GROUP4: tl.constexpr):
    """The seed contract's u_i for the tile's elements, i = first + rows * C + col0 + j."""
    if GROUP4:  # C % 4 == 0 and col0 % 4 == 0: four neighbours in a row share one counter
        row_start = first + rows.to(tl.int64)[:, None] * C + col0
        quads = row_start // 4 + tl.arange(0, TC // 4)[None, :]
        r0, r1, r2, r3 = tl.philox(seed, (quads & 0xFFFFFFFF).to(tl.uint32),
                                   (quads >> 32).to(tl.uint32), 0, 0)
        bits = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (TR, TC))
    else:
        index = first + rows.to(tl.int64)[:, None] * C + col0 + tl.arange(0, TC)[None, :]
        quads = index // 4
        lane = index % 4
        r0, r1, r2, r3 = tl.philox(seed, (quads & 0xFFFFFFFF).to(tl.uint32),
                                   (quads >> 32).to(tl.uint32), 0, 0)
        bits = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
    return (bits >> 8).to(tl.int32).to(tl.float32) * TWO_POW_M24


@triton.jit
def load_float32(ptrs, mask, NATIVE_CAST: tl.constexpr):
    """Load as float32, masked elements 0 (mask None: every element is loaded), widened by
    widen (exactly, also bfloat16 subnormals in the interpreter)."""
    if mask is None:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return widen(x, NATIVE_CAST)


@triton.jit
def widen(v, NATIVE_CAST: tl.constexpr):
    """A bfloat16 / float16 / float32 tensor as float32, exactly. The interpreter flushes
    bfloat16 subnormals, so there bfloat16 widens on the bits (the top half of a float32)."""
    if NATIVE_CAST or v.dtype != tl.bfloat16:
        return v.to(tl.float32)
    else:
        return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def to_output(v, out_ptr, NATIVE_CAST: tl.constexpr):
    """Cast float32 to the output dtype, rounding to nearest even."""
    if NATIVE_CAST or out_ptr.dtype.element_ty != tl.bfloat16:
        return v.to(out_ptr.dtype.element_ty)
    else:  # the interpreter truncates float32 -> bfloat16: round to nearest even on the bits
        bits = v.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(v != v, 0x7FC0, rounded)
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def nvfp4_scales(amax, bad, amax_ptr, TWO_LEVEL: tl.constexpr):
    """NVFP4 block scales from the blocks' amaxes (float32) and NaN/Inf flags: (E4M3 scale
    code, the factor elements are multiplied by, the dequantize scale, the tensor scale (0.0
    for one level)). s = (amax / 6) [/ s_t] clamped to [2^-6, 448] and rounded to E4M3; the
    factor is (1 / s_t) / s, the dequantize scale s_t * s (the reference's orders); the tensor
    scale max(amax_finite / 2688, 2^-120) from the finite amax (int32 bits) at amax_ptr."""
    t_scale = 0.0
    if TWO_LEVEL:
        t_amax = tl.load(amax_ptr).to(tl.float32, bitcast=True)
        t_scale = tl.math.div_rn(t_amax, 2688.0)                       # amax / (448 * 6)
        t_scale = tl.where(t_scale < TENSOR_SCALE_MIN, TENSOR_SCALE_MIN, t_scale)
    scale_code, recip, elem_scale = nvfp4_scales_under(amax, bad, t_scale, TWO_LEVEL)
    return scale_code, recip, elem_scale, t_scale


@triton.jit
def nvfp4_scales_under(amax, bad, t_scale, TWO_LEVEL: tl.constexpr):
    """nvfp4_scales' first three under a given tensor scale t_scale (a scalar, or one per block
    row or column that broadcasts against amax)."""
    block_scale = tl.math.div_rn(amax, 6.0)
    if TWO_LEVEL:
        block_scale = tl.math.div_rn(block_scale, t_scale)
    block_scale = tl.where(block_scale < E4M3_MIN_NORMAL, E4M3_MIN_NORMAL, block_scale)
    block_scale = tl.where(block_scale > 448.0, 448.0, block_scale)
    steps, bexp = _round_to_grid(block_scale, 0.0, -6, 3, False)       # E4M3, RNE
    scale_code = steps + ((bexp - 121) << 3)
    decoded = steps.to(tl.float32) * pow2(bexp - 130)
    if TWO_LEVEL:
        recip = tl.math.div_rn(tl.math.div_rn(1.0, t_scale), decoded)
        elem_scale = t_scale * decoded                                 # dequantize's order
    else:
        recip = tl.math.div_rn(1.0, decoded)
        elem_scale = decoded
    return tl.where(bad, 0x7F, scale_code), recip, elem_scale          # 0x7F: E4M3 NaN


@triton.jit
def dequantized(mag, u, bits, elem_scale, EMIN: tl.constexpr, MBITS: tl.constexpr,
                 MAXV: tl.constexpr, STOCHASTIC: tl.constexpr, INT_CODES: tl.constexpr,
                 OUT_LIMIT: tl.constexpr):
    """Fake quantization's float32 values: mag (|x| times its block's factor, saturated)
    rounded onto the grid, times elem_scale (per element; NaN in NaN/Inf blocks), saturated
    at the output dtype's max, with the sign of x's bits."""
    value = round_value(mag, u, EMIN, MBITS, MAXV, STOCHASTIC)
    # a NaN here (NaN or Inf input, so a NaN block) would lend its own sign bit to the
    # output (a host CPU's default NaN is negative): the block's NaN scale makes it NaN
    value = tl.where(value != value, 0.0, value)
    sign = bits & SIGN_MASK
    if INT_CODES:   # integer codes have no -0 (the reference decodes +0)
        sign = tl.where(value == 0, 0, sign)
    # decode * scale, saturated at the output dtype's max (NaN blocks stay NaN), then the
    # sign on the bits (Triton's unary minus is 0 - x, which loses -0.0)
    value = tl.minimum(value * elem_scale, OUT_LIMIT, propagate_nan=tl.PropagateNan.ALL)
    return (value.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def rotate16(x, x_ptr, signs_ptr, cols, TILE_R: tl.constexpr, TILE_C: tl.constexpr,
              NATIVE_CAST: tl.constexpr):
    """The random Hadamard transform of each group of 16 columns (lowbit.ops.linear.
    random_hadamard, step for step): x times the group's signs, a fast Walsh-Hadamard
    transform in float32 (butterflies a + b, a - b at strides 1, 2, 4, 8, in that order),
    times 1/4, rounded to x's dtype (the operand the quantizer then sees)."""
    x = x * tl.load(signs_ptr + (cols % 16))[None, :]
    for d in tl.static_range(4):   # stride 2^d
        y = tl.permute(tl.reshape(x, (TILE_R, TILE_C // (2 << d), 2, 1 << d)), (0, 1, 3, 2))
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (TILE_R, TILE_C))
    x = x * 0.25
    if x_ptr.dtype.element_ty != tl.float32:
        x = widen(to_output(x, x_ptr, NATIVE_CAST), NATIVE_CAST)
    return x


@triton.jit
def group_amax_kernel(x_ptr, out_ptr, signs_ptr, zero_ptr, n_zero, R, C, stride_r, stride_c, n_groups,
                      TILE_R: tl.constexpr, TILE_C: tl.constexpr, NATIVE_CAST: tl.constexpr,
                      HADAMARD: tl.constexpr, ROWS: tl.constexpr, ZERO_PAD: tl.constexpr):
    """The finite |x|'s max (int32 bits) of each (row tile, group of 16 columns) of x (R, C),
    C a multiple of 16, into out (cdiv(R, TILE_R), n_groups): with HADAMARD, of the random
    Hadamard transform of each group (rotate16), as the quantize kernel sees it. ROWS: instead
    each row's max over each column tile, into out (cdiv(C, TILE_C), R) (any C). No atomics:
    the caller reduces over the tiles (and the groups or rows into segments). The grid's first
    axis runs along the longer count (rows with ROWS, the column tiles without): CUDA caps the
    others at 65535. ZERO_PAD > 0: the first program also zeroes zero_ptr's n_zero int32 (<=
    ZERO_PAD; the segment maxima's buffer, which segment_max_kernel, launched after, fills with
    atomics), so it needs no launch of its own."""
    if ZERO_PAD > 0:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            z = tl.arange(0, ZERO_PAD)
            tl.store(zero_ptr + z, tl.zeros((ZERO_PAD,), dtype=tl.int32), mask=z < n_zero)
    if ROWS:
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
    else:
        pid_c = tl.program_id(0)
        pid_r = tl.program_id(1)
    rows = pid_r * TILE_R + tl.arange(0, TILE_R)
    cols = pid_c * TILE_C + tl.arange(0, TILE_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_r + cols.to(tl.int64)[None, :] * stride_c
    x = load_float32(ptrs, mask, NATIVE_CAST)
    if HADAMARD:
        x = rotate16(x, x_ptr, signs_ptr, cols, TILE_R, TILE_C, NATIVE_CAST)
    abits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    abits = tl.where(abits < 0x7F800000, abits, 0)
    if ROWS:
        tl.store(out_ptr + pid_c * R + rows, tl.max(abits, axis=1), mask=rows < R)
    else:
        group_max = tl.max(tl.max(tl.reshape(abits, (TILE_R, TILE_C // 16, 16)), axis=2), axis=0)
        groups = pid_c * (TILE_C // 16) + tl.arange(0, TILE_C // 16)
        tl.store(out_ptr + pid_r * n_groups + groups, group_max, mask=groups < n_groups)


ZEROED_MAX = 4096
"""The most int32 entries group_amax's first program zeroes (`zero`: a segment maxima's buffer)."""


def group_amax(x: torch.Tensor, signs: torch.Tensor | None = None, rows_max: bool = False,
               zero: torch.Tensor | None = None, reduce: bool = True) -> torch.Tensor:
    """(C // 16,) float32: the finite |x|'s max over each group of 16 columns of x (R, C), all
    rows (of its random Hadamard transform with `signs`, (16,) float32, if given); C a
    multiple of 16, any strides. rows_max: (R,) each row's max instead (any C, no rotation).
    An NVFP4 tensor scale per segment is the max of its groups' or rows'
    (lowbit.formats.quantize.segment_scales_from_amax; `segment_scales` from these maxima).
    zero: a contiguous int32 buffer (at most ZEROED_MAX entries) the same launch zeroes (segment_scales's).
    reduce=False: the tiles' maxima as they are, (tiles, n) int32 bits, for segment_scales to
    reduce (no launch of their own)."""
    rows, cols = x.shape
    if rows_max and signs is not None:
        raise ValueError("group_amax rotates groups of columns, not rows: rows_max takes no signs")
    if cols % 16 and not rows_max:
        raise ValueError(f"group_amax takes columns in groups of 16; got {cols}")
    tile_r, tile_c = (16, 128) if rows_max else (32, 64)
    n_groups, n_tiles_r, n_tiles_c = cols // 16, cdiv(rows, tile_r), cdiv(cols, tile_c)
    out = torch.empty(*((n_tiles_c, rows) if rows_max else (n_tiles_r, n_groups)), device=x.device,
                      dtype=torch.int32)
    grid = (n_tiles_r, n_tiles_c) if rows_max else (n_tiles_c, n_tiles_r)
    if grid[1] > 65535:
        raise ValueError(f"group_amax of a {tuple(x.shape)} tensor needs a grid {grid} past CUDA's 65535")
    if zero is not None and (zero.dtype != torch.int32 or not zero.is_contiguous() or zero.numel() > ZEROED_MAX
                             or zero.device != x.device):
        raise ValueError(f"group_amax zeroes a contiguous int32 buffer of at most {ZEROED_MAX} on {x.device}; got "
                         f"{zero.numel()} {zero.dtype} on {zero.device}")
    zero_pad = 0 if zero is None or not zero.numel() else max(16, triton.next_power_of_2(zero.numel()))
    with on_device(x):
        group_amax_kernel[grid](
            x, out, empty_arg(x.device, torch.float32) if signs is None else signs,
            out if zero is None else zero, 0 if zero is None else zero.numel(), rows, cols,
            *x.stride(), n_groups, TILE_R=tile_r, TILE_C=tile_c, NATIVE_CAST=not INTERPRET,
            HADAMARD=signs is not None, ROWS=rows_max, ZERO_PAD=zero_pad, num_warps=4)
    return out.amax(dim=0).view(torch.float32) if reduce else out


@triton.jit
def _segment_of(runs, ends_ptr, n_ends, rows_each, E_PAD: tl.constexpr):
    """The segment of each run (BLOCK,): how many ends lie at or before its first row, i.e.
    how many segments end before it (run i is in segment e when ceil(ends[e - 1] / rows_each)
    <= i < ceil(ends[e] / rows_each); segment n_ends holds the runs past the last end)."""
    e = tl.arange(0, E_PAD)
    ends = tl.load(ends_ptr + e, mask=e < n_ends, other=0).to(tl.int64)
    stops = tl.where(e < n_ends, (ends + rows_each - 1) // rows_each, 2**62)
    return tl.sum((stops[None, :] <= runs.to(tl.int64)[:, None]).to(tl.int32), axis=1)


@triton.jit
def segment_max_kernel(amax_ptr, ends_ptr, seg_ptr, n, n_tiles, n_ends, rows_each,
                       BLOCK: tl.constexpr, E_PAD: tl.constexpr):
    """Each segment's maximum into seg_ptr ((n_ends + 1,) int32, zeroed before), from amax_ptr
    (n_tiles, n) int32, the float32 bits of the finite maxima of n runs of `rows_each` rows in
    each of n_tiles tiles (reduced over the tiles here): one program a block of runs, one
    atomic max a segment it meets (a max: the same bits in any order)."""
    runs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.zeros((BLOCK,), dtype=tl.int32)
    for t in range(n_tiles):
        bits = tl.maximum(bits, tl.load(amax_ptr + t * n + runs, mask=runs < n, other=0))
    segment = _segment_of(runs, ends_ptr, n_ends, rows_each, E_PAD)
    e = tl.arange(0, E_PAD)
    seg_max = tl.max(tl.where(segment[:, None] == e[None, :], bits[:, None], 0), axis=0)   # (E_PAD,)
    tl.atomic_max(seg_ptr + e, seg_max, mask=(e <= n_ends) & (seg_max > 0))


@triton.jit
def segment_scales_kernel(seg_ptr, ends_ptr, out_ptr, n, n_ends, rows_each,
                          BLOCK: tl.constexpr, E_PAD: tl.constexpr, REPEAT: tl.constexpr):
    """Each run's segment's NVFP4 tensor scale, max(amax / 2688, 2^-120) (an IEEE division),
    from segment_max_kernel's maxima, written to the run's REPEAT entries of out_ptr
    (n * REPEAT,) float32."""
    runs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    segment = _segment_of(runs, ends_ptr, n_ends, rows_each, E_PAD)
    amax = tl.load(seg_ptr + segment, mask=runs < n, other=0).to(tl.float32, bitcast=True)
    scale = tl.maximum(tl.math.div_rn(amax, 2688.0), TENSOR_SCALE_MIN)
    if REPEAT == 1:
        tl.store(out_ptr + runs, scale, mask=runs < n)
    else:
        offs = runs[:, None] * REPEAT + tl.arange(0, REPEAT)[None, :]
        tl.store(out_ptr + offs, tl.zeros((BLOCK, REPEAT), dtype=tl.float32) + scale[:, None],
                 mask=runs[:, None] < n)


def segment_scales(maxima: torch.Tensor, ends: torch.Tensor, rows_each: int, repeat: int,
                   seg: torch.Tensor | None = None) -> torch.Tensor:
    """(n * repeat,) float32: the NVFP4 tensor scale of the segment each of n runs lies in,
    each written `repeat` times, from the runs' maxima (n,) (group_amax's, as float32, or the
    int32 bits of them; or (tiles, n) int32 bits, group_amax's with reduce=False, reduced here)
    and the segments' ends ((E,) ascending int32 / int64, E >= 0, on the same device): two
    launches after a zeroed (E + 1,) buffer, every block of runs in parallel (no program walks
    a whole segment), no host read-back. seg: that buffer, (E + 1,) int32, zeroed already
    (group_amax's `zero`), else one is zeroed here. The reference:
    lowbit.formats.quantize.segment_scales_from_amax(maxima, ends, rows_each)
    .repeat_interleave(repeat)."""
    if ends.dim() != 1 or ends.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"segment_scales takes ends as a 1-D int32/int64 tensor, "
                         f"not {ends.dtype} of shape {tuple(ends.shape)}")
    E = ends.numel()
    n, n_tiles = maxima.shape[-1], (maxima.shape[0] if maxima.dim() == 2 else 1)
    bits = maxima.contiguous().view(torch.int32)
    if seg is None:
        seg = torch.zeros(E + 1, device=maxima.device, dtype=torch.int32)
    elif seg.shape != (E + 1,) or seg.dtype != torch.int32:
        raise ValueError(f"segment_scales's buffer is ({E + 1},) int32; got {tuple(seg.shape)} {seg.dtype}")
    out = torch.empty(n * repeat, device=maxima.device, dtype=torch.float32)
    if n == 0:
        return out
    e_pad = max(16, triton.next_power_of_2(E + 1))
    block = max(16, min(256, 16384 // e_pad))
    ends = ends.contiguous()
    grid = (cdiv(n, block),)
    with on_device(maxima):
        segment_max_kernel[grid](bits, ends, seg, n, n_tiles, E, rows_each, BLOCK=block, E_PAD=e_pad,
                                 num_warps=4)
        segment_scales_kernel[grid](seg, ends, out, n, E, rows_each, BLOCK=block, E_PAD=e_pad,
                                    REPEAT=repeat, num_warps=4)
    return out


@triton.jit
def tensor_amax_kernel(x_ptr, amax_ptr, signs_ptr, R, C, stride_b, stride_r, stride_c,
                        n_tiles_c, n_tiles_r, n_tiles, ITERS: tl.constexpr, TILE_R: tl.constexpr,
                        TILE_C: tl.constexpr, NATIVE_CAST: tl.constexpr, HADAMARD: tl.constexpr):
    """Max of the finite |x| (as int32 bits) into amax_ptr (int32, zeroed by the caller): two-level
    NVFP4's first pass. x (B, R, C) with strides (stride_b, stride_r, stride_c), cut into tiles
    of TILE_R x TILE_C (n_tiles_c along C, n_tiles_r along R, n_tiles in all, batch included);
    with HADAMARD, of the random Hadamard transform of each group of 16 along C with the 16
    signs at signs_ptr (rotate16). Each program folds ITERS consecutive tiles, then does one
    atomic_max, so the atomics do not queue up; the grid is cdiv(n_tiles, ITERS) programs.
    (ITERS is a constexpr: Triton's interpreter cannot loop over a runtime bound.) NATIVE_CAST:
    False under the interpreter (`not INTERPRET`). launch() sizes it by amax_config; it is
    public for the tuning sweeps (benchmarks/tune.py amax, nvfp4 --amax)."""
    acc = tl.zeros((TILE_R, TILE_C), dtype=tl.int32)
    for i in range(ITERS):
        tile = tl.program_id(0) * ITERS + i
        pid_c = tile % n_tiles_c
        pid_r = (tile // n_tiles_c) % n_tiles_r
        batch = (tile // (n_tiles_c * n_tiles_r)).to(tl.int64)
        rows = pid_r * TILE_R + tl.arange(0, TILE_R)
        cols = pid_c * TILE_C + tl.arange(0, TILE_C)
        row_end = tl.where(tile < n_tiles, R, 0)                   # past the last tile: none
        mask = (rows[:, None] < row_end) & (cols[None, :] < C)
        ptrs = (x_ptr + batch * stride_b + rows.to(tl.int64)[:, None] * stride_r
                + cols.to(tl.int64)[None, :] * stride_c)
        x = load_float32(ptrs, mask, NATIVE_CAST)
        if HADAMARD:
            x = rotate16(x, x_ptr, signs_ptr, cols, TILE_R, TILE_C, NATIVE_CAST)
        abits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        acc = tl.maximum(acc, tl.where(abits < 0x7F800000, abits, 0))
    tl.atomic_max(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _quantize_kernel(
    x_ptr, codes_ptr, scales_ptr, codes_t_ptr, scales_t_ptr, out_ptr, out_t_ptr,
    amax_ptr, tensor_scale_ptr, seed_ptr, signs_ptr,
    R, C, stride_b, stride_r, stride_c, codes_cols, codes_t_cols, n_scale_rows, n_scale_cols,
    EMIN: tl.constexpr, MBITS: tl.constexpr, EMAX: tl.constexpr, MAXV: tl.constexpr,
    MAX_CODE: tl.constexpr, SIGN_BIT: tl.constexpr,
    SCALE_KIND: tl.constexpr, TWO_LEVEL: tl.constexpr, STOCHASTIC: tl.constexpr,
    GROUP4: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    TILE_R: tl.constexpr, TILE_C: tl.constexpr,
    WRITE_CODES: tl.constexpr, WRITE_VALUES: tl.constexpr, TRANSPOSE: tl.constexpr,
    OUT_LIMIT: tl.constexpr, NATIVE_CAST: tl.constexpr, HADAMARD: tl.constexpr,
    GIVEN_SCALE: tl.constexpr = 0,
):
    # x: (B, R, C) with strides; codes: (B, R, codes_cols) uint8; 1D scales: (B*R, n_scale_cols),
    # 2D scales: (B, n_scale_rows, n_scale_cols); out: (B, R, C); transposed: (B, C, ...).
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    rows = pid_r * TILE_R + tl.arange(0, TILE_R)
    cols = pid_c * TILE_C + tl.arange(0, TILE_C)
    in_bounds = (rows[:, None] < R) & (cols[None, :] < C)
    ptrs = (x_ptr + batch * stride_b + rows.to(tl.int64)[:, None] * stride_r
            + cols.to(tl.int64)[None, :] * stride_c)
    x = load_float32(ptrs, in_bounds, NATIVE_CAST)                   # (TR, TC), padding = 0
    if HADAMARD:  # quantize the rotated operand (C is a multiple of 16: no group is padded)
        x = rotate16(x, x_ptr, signs_ptr, cols, TILE_R, TILE_C, NATIVE_CAST)
    bits = x.to(tl.int32, bitcast=True)

    # ---- one scale per block, from the amax on the bits ------------------------------------
    amax_bits = block_max(bits & 0x7FFFFFFF, TILE_R, TILE_C, BR, BC)  # (TR/BR, TC/BC)
    bad = amax_bits >= 0x7F800000                                      # NaN or Inf in the block
    amax = amax_bits.to(tl.float32, bitcast=True)
    if SCALE_KIND == 0 and GIVEN_SCALE == 1:  # NVFP4 under given tensor scales, one per row
        first = pid_r * TILE_R + tl.arange(0, TILE_R // BR) * BR          # each block's first row
        t_rows = tl.load(amax_ptr + batch * R + first, mask=first < R, other=1.0)
        scale_code, recip, elem_scale = nvfp4_scales_under(amax, bad, t_rows[:, None], True)
    elif SCALE_KIND == 0 and GIVEN_SCALE == 2:  # ... one per column
        first = pid_c * TILE_C + tl.arange(0, TILE_C // BC) * BC          # each block's first column
        t_cols = tl.load(amax_ptr + first, mask=first < C, other=1.0)
        scale_code, recip, elem_scale = nvfp4_scales_under(amax, bad, t_cols[None, :], True)
    elif SCALE_KIND == 0:  # NVFP4: E4M3 block scale, optionally under the FP32 tensor scale
        scale_code, recip, elem_scale, t_scale = nvfp4_scales(amax, bad, amax_ptr, TWO_LEVEL)
        if TWO_LEVEL and (pid_c == 0) & (pid_r == 0) & (batch == 0):
            tl.store(tensor_scale_ptr, t_scale)
    elif SCALE_KIND == 3:  # intK: float32 amax / qmax, applied as x * (1 / scale)
        scale = tl.math.div_rn(amax, MAXV)
        recip = tl.math.div_rn(1.0, tl.where(scale > 0, scale, 1.0))   # 0 and NaN: 1
        elem_scale = scale
        scale_code = scale                                 # (unused: no int codes)
    else:  # MX: E8M0 power-of-two scale
        unbiased = e8m0_exponent(amax_bits, EMAX, MAXV, SCALE_KIND == 2)
        scale_code = tl.where(bad, 255, unbiased + 127)
        recip = pow2_wide(-unbiased)
        elem_scale = pow2_wide(unbiased)
    elem_scale = tl.where(bad, 0x7FC00000,                             # NaN: the block dequantizes
                          elem_scale.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)

    # ---- elements: scale, round, encode --------------------------------------------------------
    u = 0.0
    if STOCHASTIC:
        u = philox_uniforms(tl.load(seed_ptr), batch * R * C, C, rows, pid_c * TILE_C,
                      TILE_R, TILE_C, GROUP4)
    # |x| / scale, saturated (NaN lanes, only in NaN blocks, are overwritten below)
    scaled = x * expand_blocks(recip, TILE_R, TILE_C, BR, BC)
    if SCALE_KIND == 3:   # a scale below ~2^-128 has no finite reciprocal: divide, as the reference
        no_recip = expand_blocks((recip == float("inf")).to(tl.int32), TILE_R, TILE_C, BR, BC)
        scaled = tl.where(no_recip != 0,
                          tl.math.div_rn(x, expand_blocks(scale, TILE_R, TILE_C, BR, BC)), scaled)
    mag = tl.minimum(tl.abs(scaled), MAXV)

    if WRITE_CODES:
        steps, bexp = _round_to_grid(mag, u, EMIN, MBITS, STOCHASTIC)
        codes = steps + ((bexp - (EMIN + 127)) << MBITS)   # also subnormals and the carry
        if STOCHASTIC:  # floor(ratio + u) can step past the largest value: saturate
            codes = tl.minimum(codes, MAX_CODE)
        sign = (bits >> (31 - SIGN_BIT)) & (1 << SIGN_BIT)   # copysign: -0.0 too
        keep = expand_blocks(tl.where(bad, 0, 0xFF), TILE_R, TILE_C, BR, BC)
        codes = (codes | sign) & keep                       # a NaN/Inf block has codes 0
        row_off = (batch * R + rows.to(tl.int64))[:, None] * codes_cols
        if MBITS == 1:  # FP4: two codes per byte
            packed_cols = pid_c * (TILE_C // 2) + tl.arange(0, TILE_C // 2)
            tl.store(codes_ptr + row_off + packed_cols[None, :], _pack_fp4(codes, TILE_R, TILE_C),
                     mask=(rows[:, None] < R) & (packed_cols[None, :] < codes_cols))
        else:
            tl.store(codes_ptr + row_off + cols[None, :], codes.to(tl.uint8),
                     mask=(rows[:, None] < R) & (cols[None, :] < codes_cols))
        scale_cols = pid_c * (TILE_C // BC) + tl.arange(0, TILE_C // BC)
        if BR == 1:
            s_off = (batch * R + rows.to(tl.int64))[:, None] * n_scale_cols + scale_cols[None, :]
            s_mask = (rows[:, None] < R) & (scale_cols[None, :] < n_scale_cols)
        else:
            scale_rows = pid_r * (TILE_R // BR) + tl.arange(0, TILE_R // BR)
            s_off = ((batch * n_scale_rows + scale_rows)[:, None] * n_scale_cols
                     + scale_cols[None, :])
            s_mask = (scale_rows[:, None] < n_scale_rows) & (scale_cols[None, :] < n_scale_cols)
        tl.store(scales_ptr + s_off, scale_code.to(tl.uint8), mask=s_mask)
        if TRANSPOSE:  # (B, C, Rp) codes and (B, n_scale_cols, n_scale_rows) scales
            codes_tr = tl.trans(codes)                                 # (TC, TR)
            row_off_t = (batch * C + cols.to(tl.int64))[:, None] * codes_t_cols
            if MBITS == 1:
                packed_rows = pid_r * (TILE_R // 2) + tl.arange(0, TILE_R // 2)
                tl.store(codes_t_ptr + row_off_t + packed_rows[None, :],
                         _pack_fp4(codes_tr, TILE_C, TILE_R),
                         mask=(cols[:, None] < C) & (packed_rows[None, :] < codes_t_cols))
            else:
                tl.store(codes_t_ptr + row_off_t + rows[None, :], codes_tr.to(tl.uint8),
                         mask=(cols[:, None] < C) & (rows[None, :] < codes_t_cols))
            st_off = ((batch * n_scale_cols + scale_cols)[:, None] * n_scale_rows
                      + scale_rows[None, :])
            tl.store(scales_t_ptr + st_off, tl.trans(scale_code).to(tl.uint8),
                     mask=tl.trans(s_mask))

    if WRITE_VALUES:  # fake quantize: the dequantized values, in the output dtype
        value = dequantized(mag, u, bits, expand_blocks(elem_scale, TILE_R, TILE_C, BR, BC), EMIN,
                             MBITS, MAXV, STOCHASTIC, SCALE_KIND == 3, OUT_LIMIT)
        out = to_output(value, out_ptr, NATIVE_CAST)
        out_off = (batch * R + rows.to(tl.int64))[:, None] * C + cols[None, :]
        tl.store(out_ptr + out_off, out, mask=in_bounds)
        if TRANSPOSE:
            out_t_off = (batch * C + cols.to(tl.int64))[:, None] * R + rows[None, :]
            tl.store(out_t_ptr + out_t_off, tl.trans(out), mask=tl.trans(in_bounds))


@triton.jit
def _uniforms_kernel(out_ptr, seed_ptr, R, C, GROUP4: tl.constexpr,
                     TILE_R: tl.constexpr, TILE_C: tl.constexpr):
    """The seed contract's u_i of a (R, C) tensor, as the quantize kernel draws them."""
    rows = tl.program_id(1) * TILE_R + tl.arange(0, TILE_R)
    cols = tl.program_id(0) * TILE_C + tl.arange(0, TILE_C)
    u = philox_uniforms(tl.load(seed_ptr), 0, C, rows, tl.program_id(0) * TILE_C, TILE_R, TILE_C, GROUP4)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], u,
             mask=(rows[:, None] < R) & (cols[None, :] < C))


# ---- host side ---------------------------------------------------------------------------

class TileConfig(tuple):
    """(tile_rows, tile_cols, num_warps) of one program."""

    def __new__(cls, tile_rows: int, tile_cols: int, num_warps: int):
        return super().__new__(cls, (tile_rows, tile_cols, num_warps))


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): tile sides are powers of two."""
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=4096)
def default_config(rows: int, cols: int, block: tuple[int, int]) -> TileConfig:
    """Tiles of about 4096 elements (8 KiB of bf16): whole blocks, 128 columns, clipped to a
    small tensor so the interpreter and tiny shapes do not compute on padding."""
    br, bc = block
    tile_cols = max(bc, min(128, pow2_at_least(cols)))
    tile_rows = max(br, min(4096 // tile_cols, pow2_at_least(rows)))
    tile_rows = max(tile_rows, 2)  # FP4 transposed packing needs pairs of rows
    return TileConfig(tile_rows, tile_cols, 4 if tile_rows * tile_cols <= 4096 else 8)


def amax_config(rows: int, cols: int, batch: int, cfg: TileConfig, hadamard: bool,
                 sm_count: int) -> tuple[int, int, int, int]:
    """(tile_rows, tile_cols, num_warps, tiles per program) of the two-level tensor-amax pass.
    Without the Hadamard transform: one 64x256 tile (32 KiB of bf16) per program and 8 warps,
    so enough bytes are in flight to read at copy speed (benchmarks/tune.py amax on an H200,
    2026-11-30: 84-109% of a copy's bandwidth on the 1B shapes and 16384x8192, against 32-70%
    for the quantize tile with up to 64 tiles a program). With it: the quantize tile, several
    per program (the best of the few configs swept; the rotation's registers bound the tile)."""
    if hadamard:
        n_tiles = cdiv(cols, cfg[1]) * cdiv(rows, cfg[0]) * batch
        return cfg[0], cfg[1], cfg[2], pow2_at_least(cdiv(n_tiles, 4 * sm_count))
    tile_cols = min(256, pow2_at_least(cols))
    return min(16384 // tile_cols, pow2_at_least(rows)), tile_cols, 8, 1


@functools.lru_cache(maxsize=64)
def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device (a grid's size is set from it); 64 for the
    CPU, where the interpreter runs a small grid."""
    if device.type != "cuda":
        return 64   # the interpreter: a small grid
    return torch.cuda.get_device_properties(device).multi_processor_count


def require_kernel_tensor(x: torch.Tensor) -> None:
    """Refuse a tensor the Triton kernels cannot take: they need CUDA, or the interpreter."""
    if not (x.is_cuda or INTERPRET):
        raise RuntimeError("the Triton kernels need a CUDA tensor, or TRITON_INTERPRET=1 set "
                           "before triton is first imported (CPU interpreter, for tests)")


def on_device(x: torch.Tensor):
    """The context to launch on x's device (Triton launches on the current CUDA device)."""
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


_EMPTY: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}   # kept for the process (CUDA graphs hold them)


def empty_arg(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A zero-size tensor for the pointer arguments a launch does not use (never written)."""
    key = (device, dtype)
    t = _EMPTY.get(key)
    if t is None:
        t = _EMPTY[key] = torch.empty(0, device=device, dtype=dtype)
    return t


@functools.lru_cache(maxsize=256)
def _launch_constants(spec) -> dict:
    """The kernel's constexprs that depend on the spec alone (spec attribute lookups and enum
    comparisons cost more than the small launches they configure)."""
    from lowbit.formats.spec import ScaleKind, ScaleRule

    element = spec.info.element
    emin, mbits, emax, maxv, max_code, sign_bit = _ELEMENTS[element.name]
    if spec.info.scale_kind is ScaleKind.E4M3:
        scale_kind = SCALE_NVFP4
    elif spec.info.scale_kind is ScaleKind.ABSMAX:
        scale_kind = SCALE_ABSMAX
    else:
        scale_kind = SCALE_FLOOR if spec.scale_rule is ScaleRule.FLOOR else SCALE_RCEIL
    return dict(EMIN=emin, MBITS=mbits, EMAX=emax, MAXV=maxv, MAX_CODE=max_code,
                SIGN_BIT=sign_bit, SCALE_KIND=scale_kind, TWO_LEVEL=bool(spec.tensor_scale),
                STOCHASTIC=spec.rounding.value == "stochastic", BR=spec.block[0],
                BC=spec.block[1], PER_BYTE=8 // element.code_bits)


def launch(x3: torch.Tensor, spec, *, seed: torch.Tensor | None, codes: bool, values: bool,
           transpose: bool, out_dtype: torch.dtype | None = None,
           config: TileConfig | None = None, hadamard: torch.Tensor | None = None,
           tensor_scales: tuple[str, torch.Tensor] | None = None):
    """Run the kernels on x3 (B, R, C) (any strides). Returns a dict with the outputs:
    codes (B, R, Cp/per_byte) uint8, scales (uint8 codes), tensor_scale (0-dim float32),
    values (B, R, C) in out_dtype (default x's); with transpose, codes_t / scales_t / values_t
    of x^T. hadamard: (16,) float32 signs: quantize the random Hadamard transform of each
    group of 16 along C instead of x (C a multiple of 16). tensor_scales: NVFP4 under given
    FP32 tensor scales, ("rows", (B * R,)) one per row or ("cols", (C,)) one per column, float32
    (each block takes its first row's or column's; codes under "rows" only); no tensor_scale is
    returned."""
    batch, rows, cols = x3.shape
    const = _launch_constants(spec)
    br, bc, per_byte = const["BR"], const["BC"], const["PER_BYTE"]
    two_level, stochastic = const["TWO_LEVEL"], const["STOCHASTIC"]
    cfg = config or default_config(rows, cols, spec.block)
    tile_r, tile_c, num_warps = cfg
    if tile_c % bc or tile_r % br or (transpose and tile_r % 2):
        raise ValueError(f"tile {cfg} does not hold whole {spec.block} blocks")
    if hadamard is not None and (cols % 16 or tile_c % 16):
        raise ValueError(f"the fused Hadamard transform needs C and the tile's columns to be "
                         f"multiples of 16, got C={cols}, tile {cfg}")

    dev = x3.device
    padded_cols = -(-cols // bc) * bc
    padded_rows = -(-rows // br) * br
    n_scale_rows = padded_rows // br
    n_scale_cols = padded_cols // bc
    u8 = torch.uint8
    out = {}
    empty = empty_arg(dev, u8)
    code_buf = scale_buf = code_t_buf = scale_t_buf = empty
    out_dtype = out_dtype or x3.dtype
    val_buf = val_t_buf = empty_arg(dev, out_dtype)
    if codes:
        code_buf = torch.empty(batch, rows, padded_cols // per_byte, device=dev, dtype=u8)
        scale_buf = torch.empty(batch, rows if br == 1 else n_scale_rows, n_scale_cols,
                                device=dev, dtype=u8)
        out.update(codes=code_buf, scales=scale_buf)
        if transpose:
            code_t_buf = torch.empty(batch, cols, padded_rows // per_byte, device=dev, dtype=u8)
            scale_t_buf = torch.empty(batch, n_scale_cols, n_scale_rows, device=dev, dtype=u8)
            out.update(codes_t=code_t_buf, scales_t=scale_t_buf)
    if values:
        val_buf = torch.empty(batch, rows, cols, device=dev, dtype=out_dtype)
        out["values"] = val_buf
        if transpose:
            val_t_buf = torch.empty(batch, cols, rows, device=dev, dtype=out_dtype)
            out["values_t"] = val_t_buf

    grid = (cdiv(cols, tile_c), cdiv(rows, tile_r), batch)
    if grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"shape {tuple(x3.shape)} needs a grid {grid} past CUDA's 65535 limit "
                         "on grid dims 1 and 2; use larger tiles")
    amax_buf = tensor_scale = empty
    signs = empty if hadamard is None else hadamard
    given = 0
    if tensor_scales is not None:
        axis, amax_buf = tensor_scales
        given = {"rows": 1, "cols": 2}.get(axis, 0)
        if (not given or (codes and given != 1) or not two_level or amax_buf.dtype != torch.float32
                or amax_buf.numel() != (batch * rows if given == 1 else cols)):
            raise ValueError(f"given tensor scales are NVFP4's, float32, one per row or column ('rows' or "
                             f"'cols'; codes under 'rows' only); got {axis!r}, {amax_buf.numel()} "
                             f"{amax_buf.dtype} for a {tuple(x3.shape)} tensor, codes={codes}")
        amax_buf = amax_buf.contiguous()
    elif two_level:
        amax_buf = torch.zeros(1, device=dev, dtype=torch.int32)
        tensor_scale = torch.empty((), device=dev, dtype=torch.float32)
        a_rows, a_cols, a_warps, iters = amax_config(rows, cols, batch, cfg, hadamard is not None,
                                                      sm_count(dev))
        n_tiles_c, n_tiles_r = cdiv(cols, a_cols), cdiv(rows, a_rows)
        n_tiles = n_tiles_c * n_tiles_r * batch
        tensor_amax_kernel[(cdiv(n_tiles, iters),)](
            x3, amax_buf, signs, rows, cols, *x3.stride(), n_tiles_c, n_tiles_r, n_tiles,
            ITERS=iters, TILE_R=a_rows, TILE_C=a_cols, NATIVE_CAST=not INTERPRET,
            HADAMARD=hadamard is not None, num_warps=a_warps)
        out["tensor_scale"] = tensor_scale
    if stochastic and seed is None:
        raise ValueError("stochastic rounding needs a seed")
    _quantize_kernel[grid](
        x3, code_buf, scale_buf, code_t_buf, scale_t_buf, val_buf, val_t_buf,
        amax_buf, tensor_scale, seed if stochastic else empty, signs,
        rows, cols, *x3.stride(), padded_cols // per_byte, padded_rows // per_byte,
        n_scale_rows, n_scale_cols,
        EMIN=const["EMIN"], MBITS=const["MBITS"], EMAX=const["EMAX"], MAXV=const["MAXV"],
        MAX_CODE=const["MAX_CODE"], SIGN_BIT=const["SIGN_BIT"], SCALE_KIND=const["SCALE_KIND"],
        TWO_LEVEL=two_level, STOCHASTIC=stochastic,
        GROUP4=(cols % 4 == 0 and tile_c % 4 == 0), BR=br, BC=bc, TILE_R=tile_r, TILE_C=tile_c,
        WRITE_CODES=codes, WRITE_VALUES=values, TRANSPOSE=transpose,
        OUT_LIMIT=OUT_LIMIT[out_dtype], NATIVE_CAST=not INTERPRET,
        HADAMARD=hadamard is not None, GIVEN_SCALE=given, num_warps=num_warps,
    )
    return out


def uniforms(rows: int, cols: int, seed: torch.Tensor,
             config: TileConfig | None = None) -> torch.Tensor:
    """(rows, cols) float32: the uniform each element of a (rows, cols) tensor draws."""
    tile_r, tile_c, num_warps = config or default_config(rows, cols, (1, 4))
    out = torch.empty(rows, cols, device=seed.device, dtype=torch.float32)
    grid = (cdiv(cols, tile_c), cdiv(rows, tile_r))
    _uniforms_kernel[grid](out, seed, rows, cols, GROUP4=(cols % 4 == 0 and tile_c % 4 == 0),
                           TILE_R=tile_r, TILE_C=tile_c, num_warps=num_warps)
    return out
