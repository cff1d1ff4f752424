"""The rollout engine's per-token activation quantizers in one pass: a linear's input, after an
optional RMSNorm or SiLU(gate) * up prologue, to NVFP4 (x_hat, and RAC's residual r_hat) or to
FP8 (codes and a row-wise scale), bit for bit the references of lowbit.formats.activations.

    x_hat, r_hat = quantize_activations(x, "nvfp4", 0.25, norm=ln_weight)   # RAC on 25% channels
    codes, scale = quantize_activations(h, "fp8", silu_mul=True)            # h = [gate | up]
    x_in, _ = quantize_activations(x, "none", norm=ln_weight)     # the prologue alone (W4A16)
    x_hat, _ = quantize_activations(x, "nvfp4", input_amax=amax)  # a static scale (served W4A4)

One program owns one row (token), the whole row in registers (BLOCK_K = next_power_of_2(K),
K <= 16384): it reads the row once, runs the prologue, quantizes and writes the outputs. Every
step is the reference's float32 operation in the reference's order; fp fusion is off (no
product is folded into an add), divisions are `div_rn`, and casts to bfloat16 round on the bits
under Triton's interpreter (lowbit/kernels/quantize.py's widen / to_output).

The prologue
------------
The rounding of lowbit/kernels/engine_linear.py's prologues, i.e. the engine's eager ops:
`norm * F.rms_norm(x, eps)` rounds to x's dtype after the normalization and after the weight;
`F.silu(gate) * up` after SiLU and after the product. RMSNorm's 1 / sqrt(mean(x^2) + eps) is
`rsqrt` of a float32 sum in the kernel's order and SiLU's exp is Triton's: torch sums in its
own order and takes rsqrt and exp from its own libraries, so the prologue is guaranteed to
agree with the eager ops to the last bit only where those are exact (tests/test_activation_
quant.py builds such inputs). On CUDA they agreed on random rows too; under the interpreter
(NumPy against torch's CPU kernels) float32 rsqrt and exp differ in the last bit, which the
rounding to bfloat16 mostly hides.

Per-token NVFP4 (x_hat)
-----------------------
The row's finite amax gives the pre-scale exponent e = ceil(log2(amax / 2688)) on the float32
bits of amax / 2688, as the reference's frexp does (an underflow to 0 gives e = 0, a subnormal
quotient -126); then single-level NVFP4 on x * 2^-e in 1x16 blocks (lowbit/kernels/quantize.py's
nvfp4_scales and dequantized) and the values times 2^e, rounded to x's dtype.

Static NVFP4 (x_hat, input_amax given)
--------------------------------------
No pre-scale: two-level NVFP4 of the row under the FP32 scale s = max(amax / 2688, 2^-120)
of the layer's calibrated amax (lowbit/kernels/quantize.py's nvfp4_scales with the tensor amax
read from input_amax, the reference's tensor_scale_from_amax in the same float32 operations),
each block's E4M3 scale from the block; the values q * (s * c) saturate at the output dtype's
max as the reference's do. A block beyond the calibrated range saturates (block scale at 448,
elements at 6); a NaN or Inf block is NaN. RAC's residual is then as below, per token.

RAC: choosing each row's channels without a sort
------------------------------------------------
r = x - x_hat (x_hat rounded to x's dtype first, as the reference subtracts it). The key of a
channel is the int32 bit pattern of |r|, which orders like the magnitude; every NaN becomes
0x7FFFFFFF, above Inf's 0x7F800000, so NaNs are the largest and equal among themselves.

- Threshold: T, the c-th largest key, is the largest t with count(key >= t) >= c. It is found
  RADIX_BITS bits at a time from the top (a radix select: 8 steps of 4 bits): a histogram of
  the next digit over the keys that share the bits chosen so far gives count(key >= T | d) for
  every digit d at once, and the largest d where that is >= c is kept. A step is one histogram
  of the row in registers, where one bit a step took 31 counts, each a reduction over the row.
  Once exactly c keys reach T's bits so far (zeros below), the search stops: those c keys are
  the chosen ones whatever the later bits, so T may end below the c-th largest key, a
  threshold exactly the chosen keys reach. Where keys tie across the c-th place it cannot stop,
  and T is the c-th largest key.
- Ties: every key > T is chosen (at most c of them), and of the keys == T the first
  c - count(key > T) by channel index, their inclusive cumsum giving the order: a stable
  descending sort's choice, ties to the lower channel.
- Compaction: a chosen channel's place in the compacted row is the number of chosen channels
  before it, the running count of keys > T plus that of the chosen ties (one cumsum carries
  both, 16 bits apart), so its 1x16 block is that rank // 16, a non-decreasing block id along
  the row (the other channels take the id of the next chosen one and the value 0).

RAC: the compacted row's blocks without compacting it
-----------------------------------------------------
The pre-scale of the compacted row is its finite amax over the chosen channels, a masked max.
Each block's amax is a segmented max over runs of equal block id, taken in place: pack
(id << 32) | |r * 2^-e| bits into an int64. Since ids never decrease along the row, a running
max of the packed values from the left stays in the current run (a larger id wins outright, and
none larger has been seen) and gives the max of the run's elements up to here; a running max
of ((n_blocks - id) << 32) | bits from the right gives it from here to the run's end. The
larger of the two low halves is the block's amax on every element of the block, so each chosen
channel is quantized in place and r_hat is written where it lies, zero elsewhere: no scratch
memory, no barrier, no scatter. (The zero padding of a last partial block never raises its
amax.)

With channels chosen group by group (rac_group G), every full group keeps exactly its count;
where that count is 16 (G = 64 at RAC 25%, the engine's setting) the compacted row's block g
is group g's chosen channels (a last partial group keeps at most 16, its own block), so each
block's amax is a plain max over the group's lanes (the others are 0) and neither the running
count nor the two scans are needed.

FP8
---
One `rceil` E8M0 scale per row (2^ceil(log2(amax / 448)) on the bits, lowbit/kernels/
quantize.py's e8m0_exponent), the elements rounded onto E4M3 (RNE, saturating at 448) and
written as their bit patterns into a uint8 view of the float8_e4m3fn output (no float8
conversion or store, which the interpreter may not have). A row holding NaN or Inf gets codes
0 and a NaN scale, as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.formats.activations import check_rac_group, rac_channel_count
from lowbit.kernels import quantize as kq
from lowbit.kernels.quantize import (
    dequantized, e8m0_exponent, nvfp4_scales, pow2_wide, round_value, to_output, widen,
)

__all__ = ["quantize_activations", "activation_kernel", "rac_threshold", "MAX_K"]

MAX_K = 16384
"""The longest row one program holds in registers; longer rows take the reference."""

RADIX_BITS = 4
"""Bits of RAC's threshold found per histogram step (1, 2, 4 or 8: 32, 16, 8 or 4 steps). 4:
the fastest of 2, 4 and 8 at every K (1024-4096) and row count (1, 128, 256) timed on one H200
(2026-12-05, benchmarks/tune.py activation): 8 steps of 16 bins beat 4 of 256 by 10-15%."""

EARLY_STOP_MIN_K = 8192
"""Rows at least this long stop RAC's radix select early by default (`early_stop=None`). Timed
on one H100 (2026-12-05, benchmarks/tune.py activation, docs/results/rollout.md) at K = 1024,
2048, 3072, 4096 and 14336 only: with the stop the pass was slower at every K up to 4096 in 11
of 12 shapes (the steps it saves are few there), and at K = 14336 25% faster with 256 rows, 3%
with 128 and 2% slower with one. 8192 lies between the two, untimed."""

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NONE, _RMS_NORM, _SILU_MUL = 0, 1, 2
_NVFP4, _FP8, _PLAIN = 0, 1, 2
_F32_MAX = tl.constexpr(kq.OUT_LIMIT[torch.float32])
_E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)


@triton.jit
def _rounded(v, like_ptr, NATIVE_CAST: tl.constexpr):
    """float32 v rounded to the dtype of like_ptr's elements (to nearest even) and back."""
    if like_ptr.dtype.element_ty == tl.float32:
        return v
    else:
        return widen(to_output(v, like_ptr, NATIVE_CAST), NATIVE_CAST)


@triton.jit
def _row_input(x_row, norm_ptr, kk, ok, K, eps, PROLOGUE: tl.constexpr, NATIVE_CAST: tl.constexpr):
    """The quantizer's input row (BLOCK_K,) float32, values of x's dtype, 0 past K: x, or the
    prologue's output, rounded where the eager ops (and engine_linear's prologues) round."""
    if PROLOGUE == 2:   # x holds [gate | up], K columns each: F.silu(gate) * up, two roundings
        g = widen(tl.load(x_row + kk, mask=ok, other=0.0), NATIVE_CAST)
        u = widen(tl.load(x_row + K + kk, mask=ok, other=0.0), NATIVE_CAST)
        s = _rounded(tl.math.div_rn(g, 1.0 + tl.exp(-g)), x_row, NATIVE_CAST)
        v = _rounded(s * u, x_row, NATIVE_CAST)
    else:
        v = widen(tl.load(x_row + kk, mask=ok, other=0.0), NATIVE_CAST)
    if PROLOGUE == 1:   # weight * rms_norm(x): rounded after the norm and after the weight
        mean_square = tl.math.div_rn(tl.sum(v * v, axis=0), K.to(tl.float32))
        rstd = tl.rsqrt(mean_square + eps)
        w = widen(tl.load(norm_ptr + kk, mask=ok, other=0.0), NATIVE_CAST)
        v = _rounded(_rounded(v * rstd, x_row, NATIVE_CAST) * w, x_row, NATIVE_CAST)
    return v


@triton.jit
def _prescale(v, live):
    """(2^-e, 2^e) of per_token_nvfp4 for the row v's live lanes: e = ceil(log2(amax / 2688))
    of their finite amax, on the bits of the float32 quotient (frexp's exponent, one less
    when the significand is exactly 0.5), 0 when the quotient is 0, clamped to [-126, 127]."""
    abits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    amax_bits = tl.max(tl.where(live & (abits < 0x7F800000), abits, 0), axis=0)
    d = tl.math.div_rn(amax_bits.to(tl.float32, bitcast=True), 2688.0)
    d_bits = d.to(tl.int32, bitcast=True)
    biased = d_bits >> 23
    e = tl.where(biased == 0, -126, biased - 126 - ((d_bits & 0x7FFFFF) == 0).to(tl.int32))
    e = tl.where(d_bits == 0, 0, e)
    e = tl.minimum(tl.maximum(e, -126), 127)
    return pow2_wide(-e), pow2_wide(e)


@triton.jit
def _nvfp4_values(xs, block_amax_bits, down, like_ptr):
    """Single-level NVFP4 of the pre-scaled row xs given each element's block amax (int32 bits,
    NaN/Inf at or above 0x7F800000), times down = 2^e: float32, NaN in NaN/Inf blocks."""
    bad = block_amax_bits >= 0x7F800000
    _, recip, elem_scale, _ = nvfp4_scales(block_amax_bits.to(tl.float32, bitcast=True), bad,
                                           like_ptr, False)
    elem_scale = tl.where(bad, 0x7FC00000,
                          elem_scale.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    mag = tl.minimum(tl.abs(xs * recip), 6.0)
    value = dequantized(mag, 0.0, xs.to(tl.int32, bitcast=True), elem_scale, 0, 1, 6.0,
                        False, False, _F32_MAX)
    return value * down


@triton.jit
def _static_nvfp4_values(v, block_amax_bits, amax_ptr, OUT_LIMIT: tl.constexpr):
    """Two-level NVFP4 of the row v given each element's block amax (int32 bits, NaN/Inf at or
    above 0x7F800000) under the tensor scale of the calibrated amax at amax_ptr (int32 bits):
    float32, saturated at OUT_LIMIT, NaN in NaN/Inf blocks."""
    bad = block_amax_bits >= 0x7F800000
    _, recip, elem_scale, _ = nvfp4_scales(block_amax_bits.to(tl.float32, bitcast=True), bad,
                                           amax_ptr, True)
    elem_scale = tl.where(bad, 0x7FC00000,
                          elem_scale.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    mag = tl.minimum(tl.abs(v * recip), 6.0)      # beyond the calibrated range: saturates at 6
    return dequantized(mag, 0.0, v.to(tl.int32, bitcast=True), elem_scale, 0, 1, 6.0,
                       False, False, OUT_LIMIT)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def rac_threshold(keys, ok, count, DIGIT: tl.constexpr, EARLY: tl.constexpr = True):
    """A threshold T that exactly the row's `count` largest keys reach, or where keys tie across
    the count-th place the count-th largest key itself (int32 >= 0 on the ok lanes), DIGIT bits
    at a time from the top: each step histograms the next digit of the keys that share the bits
    chosen so far, then keeps the largest digit d with count(key >= T | d) >= count.

    Once exactly `count` keys are >= T | d (the count-th and the next largest keys differ in
    the bits chosen so far), the steps left cannot change which keys are chosen: they stop,
    and T keeps zeros below, a threshold that exactly the chosen keys reach (`_rac_channels`
    then takes every key >= T, ties included, as it would have with all steps). EARLY=False
    runs every step (the same channels; benchmarks/tune.py activation times both)."""
    BINS: tl.constexpr = 1 << DIGIT
    bins = tl.arange(0, BINS)
    threshold = tl.full((), 0, tl.int32)
    above = tl.full((), 0, tl.int32)         # keys above every key that shares T's chosen bits
    done = tl.full((), 0, tl.int32)          # 1: exactly count keys are >= threshold
    for i in tl.static_range(32 // DIGIT):
        if done == 0:
            shift = 32 - DIGIT * (i + 1)
            if i == 0:
                match = ok
            else:
                match = ok & ((keys >> (shift + DIGIT)) == (threshold >> (shift + DIGIT)))
            h = tl.histogram((keys >> shift) & (BINS - 1), BINS, mask=match)
            at_least = above + tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h   # count(key >= T | d)
            d = tl.max(tl.where(at_least >= count, bins, 0), axis=0)
            above += tl.sum(tl.where(bins > d, h, 0), axis=0)
            threshold = threshold | (d << shift)
            # count(key >= T | d) == count for the chosen d exactly when some digit's is
            # (the counts fall as d rises, and d is the largest digit whose count >= count)
            if EARLY:
                done = tl.max(tl.where(at_least == count, 1, 0), axis=0)
    return threshold


@triton.jit
def _rac_channels(r, ok, count, BLOCK_K: tl.constexpr, DIGIT: tl.constexpr, EARLY: tl.constexpr):
    """The chosen mask of the c = count channels with the largest |r| (NaN largest, ties to the
    lower channel) and each lane's block in the compacted row (see the module doc)."""
    keys = r.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    keys = tl.where(keys > 0x7F800000, 0x7FFFFFFF, keys)            # every NaN alike
    keys = tl.where(ok, keys, -1)                                    # padding: below all
    threshold = rac_threshold(keys, ok, count, DIGIT, EARLY)
    above = keys > threshold
    ties = keys == threshold
    room = count - tl.sum(above.to(tl.int32), axis=0)
    # one scan for two running counts: channels above (low 16 bits; at most 16384) and ties
    running = tl.cumsum(above.to(tl.int32) | (ties.to(tl.int32) << 16), axis=0)
    chosen = above | (ties & ((running >> 16) <= room))
    rank = (running & 0xFFFF) + tl.minimum(running >> 16, room) - chosen.to(tl.int32)
    block = rank // 16                                               # exclusive rank // 16
    return chosen, block


@triton.jit
def _rac_group_chosen(r, ok, K, count, count_last, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """The chosen mask of RAC's channels group by group (rac_group_channels): the top `count`
    |r| of each GROUP consecutive lanes, `count_last` in a last group of fewer than GROUP real
    lanes (NaN largest, ties to the lower channel). Each group sorts its keys (int32 |r| bits)
    for its count-th largest, the cut; it keeps every key above the cut and, of the keys equal
    to it, the first ones along the group up to its count: no selection spans the row, and
    every full group keeps exactly `count`."""
    NG: tl.constexpr = BLOCK_K // GROUP
    keys = r.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    keys = tl.where(keys > 0x7F800000, 0x7FFFFFFF, keys)            # every NaN alike
    keys = tl.reshape(tl.where(ok, keys, -1), (NG, GROUP))          # padding: below all
    lane = tl.arange(0, GROUP)
    ordered = tl.sort(keys, dim=1, descending=True)
    length = K - tl.arange(0, NG) * GROUP                            # real lanes of each group
    take = tl.where(length >= GROUP, count, tl.where(length > 0, count_last, 0))
    cut = tl.sum(tl.where(lane[None, :] == take[:, None] - 1, ordered, 0), axis=1)
    above = keys > cut[:, None]
    ties = keys == cut[:, None]
    room = take - tl.sum(above.to(tl.int32), axis=1)
    chosen = above | (ties & (tl.cumsum(ties.to(tl.int32), axis=1) <= room[:, None]))
    chosen = chosen & (take > 0)[:, None]                            # a group that takes none
    return tl.reshape(chosen, (BLOCK_K,)) & ok


@triton.jit
def _group_amax(bits, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """Each lane's max of bits (int32 >= 0) over its GROUP consecutive lanes."""
    NG: tl.constexpr = BLOCK_K // GROUP
    most = tl.max(tl.reshape(bits, (NG, GROUP)), axis=1)
    return tl.reshape(tl.broadcast_to(most[:, None], (NG, GROUP)), (BLOCK_K,))


@triton.jit
def _segment_amax(bits, block, BLOCK_K: tl.constexpr):
    """Each lane's max of bits (int32 >= 0) over the lanes of its block id (non-decreasing
    along the row): a running max of (id, bits) from the left and of (-id, bits) from the
    right, packed in int64 (see the module doc)."""
    low = bits.to(tl.int64)
    left = tl.associative_scan((block.to(tl.int64) << 32) | low, 0, _max_combine)
    n_blocks = BLOCK_K // 16 + 1
    right = tl.associative_scan(((n_blocks - block).to(tl.int64) << 32) | low, 0, _max_combine,
                                reverse=True)
    return tl.maximum(left & 0x7FFFFFFF, right & 0x7FFFFFFF).to(tl.int32)


@triton.jit
def activation_kernel(x_ptr, norm_ptr, xhat_ptr, rhat_ptr, codes_ptr, scale_ptr, amax_ptr,
                       K, stride_xm, count, count_last, eps,
                       MODE: tl.constexpr, RAC: tl.constexpr, PROLOGUE: tl.constexpr,
                       BLOCK_K: tl.constexpr, NATIVE_CAST: tl.constexpr, DIGIT: tl.constexpr,
                       STATIC: tl.constexpr, OUT_LIMIT: tl.constexpr, EARLY: tl.constexpr,
                       GROUP: tl.constexpr, GROUP_IS_BLOCK: tl.constexpr, FOLD: tl.constexpr):
    # x: (M, K) or (M, 2K) rows of stride stride_xm; outputs (M, K) contiguous, scale (M, 1)
    row = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    ok = kk < K
    v = _row_input(x_ptr + row * stride_xm, norm_ptr, kk, ok, K, eps, PROLOGUE, NATIVE_CAST)
    bits = v.to(tl.int32, bitcast=True)
    out = row * K + kk

    if MODE == 2:
        # ---- the prologue's output as it is (the W4A16 GEMM's input) ---------------------------
        tl.store(xhat_ptr + out, to_output(v, xhat_ptr, NATIVE_CAST), mask=ok)
    elif MODE == 0:
        # ---- x_hat: NVFP4, blocks of 16 consecutive channels, per token or static -------------
        if STATIC:
            xs = v
        else:
            up, down = _prescale(v, ok)
            xs = v * up
        xs_abs = xs.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        block_amax = tl.max(tl.reshape(xs_abs, (BLOCK_K // 16, 16)), axis=1)
        block_amax = tl.reshape(tl.broadcast_to(block_amax[:, None], (BLOCK_K // 16, 16)),
                                (BLOCK_K,))
        if STATIC:
            x_hat = to_output(_static_nvfp4_values(xs, block_amax, amax_ptr, OUT_LIMIT), xhat_ptr,
                              NATIVE_CAST)
        else:
            x_hat = to_output(_nvfp4_values(xs, block_amax, down, xhat_ptr), xhat_ptr, NATIVE_CAST)
        if not FOLD:   # folded, x_hat goes out with RAC's residual added
            tl.store(xhat_ptr + out, x_hat, mask=ok)
        if RAC:
            # ---- r_hat: per-token NVFP4 of the row's top-count residuals, compacted ------------
            r = v - widen(x_hat, NATIVE_CAST)
            if GROUP == 0:
                chosen, block = _rac_channels(r, ok, count, BLOCK_K, DIGIT, EARLY)
            else:
                chosen = _rac_group_chosen(r, ok, K, count, count_last, BLOCK_K, GROUP)
            r = tl.where(chosen, r, 0.0)
            up_r, down_r = _prescale(r, chosen)
            rs = r * up_r
            rs_bits = rs.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            if GROUP_IS_BLOCK:   # 16 chosen a group: the compacted row's block g is group g
                rs_amax = _group_amax(rs_bits, BLOCK_K, GROUP)
            else:
                if GROUP != 0:   # a chosen channel's block: its exclusive rank // 16
                    block = (tl.cumsum(chosen.to(tl.int32), axis=0) - chosen.to(tl.int32)) // 16
                rs_amax = _segment_amax(rs_bits, block, BLOCK_K)
            r_hat = to_output(_nvfp4_values(rs, rs_amax, down_r, rhat_ptr), rhat_ptr, NATIVE_CAST)
            if FOLD:   # x_hat + r_hat in float32, rounded once (rac_folded)
                folded = widen(x_hat, NATIVE_CAST) + widen(tl.where(chosen, r_hat, 0.0), NATIVE_CAST)
                tl.store(xhat_ptr + out, to_output(folded, xhat_ptr, NATIVE_CAST), mask=ok)
            else:
                tl.store(rhat_ptr + out, tl.where(chosen, r_hat, 0.0), mask=ok)
    else:
        # ---- FP8: one rceil power-of-two scale per row, E4M3 codes -------------------------------
        amax_bits = tl.max(bits & 0x7FFFFFFF, axis=0)                  # NaN/Inf: >= 0x7F800000
        bad = amax_bits >= 0x7F800000
        exponent = e8m0_exponent(amax_bits, 8, 448.0, True)
        mag = tl.minimum(tl.abs(v * pow2_wide(-exponent)), 448.0)
        value = round_value(mag, 0.0, -6, 3, 448.0, False)            # on the E4M3 grid, >= 0
        vb = value.to(tl.int32, bitcast=True)
        code = tl.where(value >= _E4M3_MIN_NORMAL, (((vb >> 23) - 120) << 3) | ((vb >> 20) & 7),
                        (value * 512.0).to(tl.int32))                  # subnormals: value / 2^-9
        code = tl.where(bad, 0, code | ((bits >> 24) & 0x80))
        tl.store(codes_ptr + out, code.to(tl.uint8), mask=ok)
        scale = pow2_wide(exponent).to(tl.int32, bitcast=True)
        scale = tl.where(bad, 0x7FC00000, scale).to(tl.float32, bitcast=True)   # NaN: bad row
        tl.store(scale_ptr + row, scale)


def _num_warps(block_k: int, rac: bool) -> int:
    """Warps per row (program). With RAC, 8 up to K = 8192: on one H200 (2026-12-05,
    `benchmarks/tune.py activation --rows 1,128,256`) the fastest or within 9% of it at K =
    1024, 2048, 3072 and 4096 for 1, 128 and 256 rows (at K = 2048 and 128 rows 11.8 us against
    4 warps' 15.3). Without, 4 up to K = 2048 (1.6-2.2 us, every count within 0.1 us); 16 at
    K = 14336."""
    if block_k > 8192:
        return 16
    return 8 if rac or block_k > 2048 else 4


def quantize_activations(x: torch.Tensor, mode: str, rac_ratio: float = 0.0, *,
                         norm: torch.Tensor | None = None, eps: float = 1e-6,
                         silu_mul: bool = False, input_amax: torch.Tensor | None = None,
                         num_warps: int | None = None, radix_bits: int = RADIX_BITS,
                         early_stop: bool | None = None, rac_group: int = 0, rac_fold: bool = False):
    """Quantize each row of a linear's input in one pass, bit for bit as the references of
    lowbit.formats.activations on the prologue's output.

    x: (M, K) float32 / bfloat16 / float16, any row stride (unit stride along K, else it is
        copied); with silu_mul (M, 2K), [gate | up].
    mode: "nvfp4" -> (x_hat, r_hat): x_hat = per_token_nvfp4(input) (M, K) in x's dtype;
        r_hat = rac_residual(input, x_hat, rac_ratio) (M, K), or None when rac_ratio is 0.
        "fp8" -> (codes, scale) = per_token_fp8(input): (M, K) float8_e4m3fn, (M, 1) float32.
        "none" -> (input, None): the prologue's output in x's dtype, unquantized.
        With input_amax (float32, one element: the layer's calibrated amax), x_hat is
        static_nvfp4(input, input_amax) instead, a served checkpoint's static scale.
    rac_ratio: RAC's channel fraction in [0, 1] (nvfp4 only).
    rac_group: 0 chooses RAC's channels over the whole row (a radix select); G (a power of two,
        16 to 16384) the top of each G consecutive channels (rac_residual's `group`; a sort
        within each group).
    rac_fold: with RAC, (rac_folded(x_hat, r_hat), None): the residual added into x_hat, one
        GEMM operand (lowbit.formats.activations, "folded").
    norm: (K,) in x's dtype: the input is the engine's RMSNorm `norm * rms_norm(x, eps)`.
    silu_mul: the input is F.silu(gate) * up.
    num_warps: warps per row instead of the default's; radix_bits: RAC's threshold bits per
        radix step (1, 2, 4 or 8); early_stop: False runs every radix step even once the
        chosen channels are fixed, True stops there, None (the default) stops for rows of at
        least EARLY_STOP_MIN_K; benchmarks/tune.py activation sweeps all three (the same bits
        at any setting).
    The prologues round where the engine's eager ops do (see the module doc for how close
    RMSNorm's rsqrt and SiLU's exp come to torch's)."""
    if mode not in ("nvfp4", "fp8", "none"):
        raise ValueError(f"mode must be 'nvfp4', 'fp8' or 'none', got {mode!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError("quantize_activations takes a 2-D float32, bfloat16 or float16 tensor, "
                         f"got {getattr(x, 'dtype', type(x).__name__)} "
                         f"{tuple(getattr(x, 'shape', ()))}")
    if norm is not None and silu_mul:
        raise ValueError("quantize_activations takes one prologue: norm or silu_mul, not both")
    M, cols = x.shape
    if silu_mul and cols % 2:
        raise ValueError(f"silu_mul reads [gate | up]: x needs an even number of columns, "
                         f"got {cols}")
    K = cols // 2 if silu_mul else cols
    if not 1 <= K <= MAX_K:
        raise ValueError(f"quantize_activations holds rows of 1..{MAX_K} values in registers, got "
                         f"K={K}; use the reference (lowbit.formats.activations)")
    count = rac_channel_count(K, rac_ratio)
    check_rac_group(rac_group)
    group = rac_group if rac_group < K and count else 0   # a group holding the row is the row
    group_count = rac_channel_count(group, rac_ratio) if group else 0
    last_count = rac_channel_count(K % group, rac_ratio) if group and K % group else group_count
    if count and mode != "nvfp4":
        raise ValueError("RAC compensates NVFP4 activations: rac_ratio needs mode 'nvfp4'")
    fold = bool(rac_fold) and count > 0   # a ratio of no channel at this K: x_hat as it is
    if norm is not None and (norm.shape != (K,) or norm.dtype != x.dtype
                             or norm.device != x.device):
        raise ValueError(f"norm must be ({K},) in x's dtype and device ({x.dtype}, {x.device}), "
                         f"got {tuple(norm.shape)} {norm.dtype} {norm.device}")
    if input_amax is not None and (mode != "nvfp4" or input_amax.numel() != 1
                                   or input_amax.dtype != torch.float32
                                   or input_amax.device != x.device):
        raise ValueError(f"input_amax is a static NVFP4 scale's calibrated amax: one float32 on "
                         f"x's device, with mode 'nvfp4' (got mode {mode!r}, shape "
                         f"{tuple(input_amax.shape)}, {input_amax.dtype}, {input_amax.device})")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two from 1 to 32, got {num_warps!r}")
    if radix_bits not in (1, 2, 4, 8):
        raise ValueError(f"radix_bits must be 1, 2, 4 or 8, got {radix_bits!r}")
    kq.require_kernel_tensor(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    dev = x.device
    if mode in ("nvfp4", "none"):
        x_hat = torch.empty(M, K, dtype=x.dtype, device=dev)
        r_hat = torch.empty(M, K, dtype=x.dtype, device=dev) if count and not fold else None
        outputs = (x_hat, r_hat)
        buffers = dict(xhat_ptr=x_hat, rhat_ptr=x_hat if r_hat is None else r_hat,
                       codes_ptr=kq.empty_arg(dev, torch.uint8),
                       scale_ptr=kq.empty_arg(dev, torch.float32))
    else:
        codes = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=dev)
        scale = torch.empty(M, 1, dtype=torch.float32, device=dev)
        outputs = (codes, scale)
        buffers = dict(xhat_ptr=kq.empty_arg(dev, x.dtype), rhat_ptr=kq.empty_arg(dev, x.dtype),
                       codes_ptr=codes.view(torch.uint8), scale_ptr=scale)
    if M == 0:
        return outputs
    block_k = max(16, triton.next_power_of_2(K))
    early = K >= EARLY_STOP_MIN_K if early_stop is None else bool(early_stop)
    prologue = _RMS_NORM if norm is not None else _SILU_MUL if silu_mul else _NONE
    # the amax as int32 bits, as nvfp4_scales reads a tensor amax (no copy: a CUDA graph that
    # captured this call reads the tensor a weight sync refreshes in place)
    amax_bits = (kq.empty_arg(dev, torch.int32) if input_amax is None else
                 input_amax.reshape(1).view(torch.int32))
    with kq.on_device(x):
        activation_kernel[(M,)](
            x, norm if norm is not None else x, **buffers, amax_ptr=amax_bits, K=K,
            stride_xm=x.stride(0), count=group_count if group else count, count_last=last_count, eps=eps,
            MODE={"nvfp4": _NVFP4, "fp8": _FP8, "none": _PLAIN}[mode], RAC=count > 0,
            PROLOGUE=prologue, BLOCK_K=block_k, NATIVE_CAST=not kq.INTERPRET, DIGIT=radix_bits,
            STATIC=input_amax is not None, OUT_LIMIT=kq.OUT_LIMIT[x.dtype], EARLY=early, GROUP=group,
            GROUP_IS_BLOCK=group > 0 and group_count == 16, FOLD=fold,
            num_warps=_num_warps(block_k, count > 0) if num_warps is None else num_warps,
            enable_fp_fusion=False)   # no product folded into an add: the reference's roundings
    return outputs
