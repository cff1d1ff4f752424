"""The rollout engine's activation quantizers, per token: the references (the definition) that
lowbit.rl.precision applies at every linear's input and lowbit/kernels/activation_quant.py
fuses into one pass.

| function          | what each row (token) of x (N, K) becomes                              |
| ----------------- | ---------------------------------------------------------------------- |
| `per_token_nvfp4` | NVFP4 1x16 under its own power-of-two pre-scale (x_hat, x's dtype)     |
| `static_nvfp4`    | NVFP4 1x16 under one calibrated FP32 scale per layer (a served W4A4's)  |
| `per_token_fp8`   | E4M3 codes and one power-of-two scale (`torch._scaled_mm`'s operands) |
| `rac_residual`    | RAC's quantized residual on the row's own top channels (r_hat, dense) |

Every row is quantized from its own values alone, so a token's numerics do not depend on its
batch-mates: a prefill and a KV-cache decode of the same token, or the same sequence in two
batches, give the same bits (tests/test_activations.py checks a row alone against the row in
a batch). `static_nvfp4` keeps that property: its one FP32 scale is fixed by calibration
before the batch is seen, and its E4M3 block scales are each block's own.

Static scales (a served NVFP4 checkpoint)
-----------------------------------------
A W4A4 NVFP4 checkpoint (ModelOpt's quant_algo "NVFP4", compressed-tensors' nvfp4 with
input_global_scale, as `lowbit export --activations nvfp4` writes) stores per linear one FP32
`input_scale` s = amax / (448 * 6) from the largest |input| seen in calibration; the server
then quantizes every activation with 1x16 E4M3 block scales computed on the fly under it:

    c = e4m3(clamp((amax_block / 6) / s, 2^-6, 448)),  q = e2m1(clamp(x * ((1 / s) / c), -6, 6)),
    x_hat = q * (s * c)

(lowbit.formats.quantize's NVFP4 order with s given; servers multiply by a stored float32
1 / s instead of dividing by s, which can move a block scale by one E4M3 step where the two
quotients round differently -- the reference keeps the order every lowbit kernel is tested
against). Unlike the per-token pre-scale, s is not
adapted to the token: a token smaller than the calibration's largest uses fewer of the E4M3
scale's binades (its block scales sit lower, down to 2^-6, where they lose precision and then
flush), and a token beyond the calibrated range saturates -- its block scale clamps at 448 (as a
served kernel's `cvt.rn.satfinite` to E4M3 does) and its elements at 6 (likewise to E2M1),
so every value is within +-6 * 448 * s, the calibrated amax. NaN and Inf are not saturated:
the block holding one dequantizes to NaN, as everywhere in lowbit.

RAC, per token
--------------
QUADS (arXiv 2607.15810) compensates the activation quantization error on the channels where
it is largest: with r = X - QDQ(X) and S the top-k% input channels by residual magnitude,

    Y = Q(X) Q(W)^T + Q(r_S) Q(W_{:,S})^T

i.e. the quantized residual of the chosen channels appended to the GEMM's reduction
dimension. A GEMM call that picks one S for all its tokens (from |r| summed over them) makes a
token's output depend on which tokens share its batch. Here S is chosen per token, S_n = the
top channels of |r[n]|, so the appended term no longer has one column set; written with a
dense r_hat (N, K) that holds Q(r[n, S_n]) at channels S_n and zeros elsewhere,

    Q(r_S) Q(W_{:,S})^T  ->  r_hat Q(W)^T,      Y = x_hat Q(W)^T + r_hat Q(W)^T

(both products into one accumulator: x_hat + r_hat added first in x's dtype would round). For
a batch of one token the two forms are the same sum (tests/test_activations.py checks the
augmented-K form [x_hat | Q(r_S)] [Q(W) | Q(W)_{:,S}]^T against it), and for any batch each
row equals that row alone. Q(r[n, S_n]) is `per_token_nvfp4` of the compacted row: the chosen
channels' residuals in increasing channel order, its 1x16 blocks running over them in that
order (the last block zero-padded for its amax), as a GEMM with |S| appended columns holds them.

Folded (`rac_folded`, the engine's `rac_fold`): x_hat + r_hat added in float32 and rounded
once to x's dtype, one GEMM operand, Y = fold(x_hat, r_hat) Q(W)^T. The GEMM is then W4A4's
without RAC (no second operand as wide as K, whose products double the GEMM's MMAs); the cost
is one rounding of the compensated activation to x's dtype (bfloat16: a relative 2^-9, the
precision every bf16 activation has; RAC's own remaining error is that of an NVFP4 residual,
larger). Per row, so a row alone still equals the row in a batch.

Choosing S_n over the whole row needs a selection across the row (a radix select in the
kernel). `rac_residual(..., group=G)` chooses it group by group instead: the top
ceil(ratio * G) channels of each G consecutive channels, found within the group. At G = 64
and RAC 25% each group gives 16 channels, exactly one block of the compacted row. What it
costs in the log-prob gap RAC closes: docs/results/rollout.md (`benchmarks/rac_channels.py`).
"""

from __future__ import annotations

import math

import torch

from lowbit.formats.elements import e8m0_to_float
from lowbit.formats.quantize import divide, finite_abs, quantize_dequantize, quantize_with_spec, tensor_scale_from_amax
from lowbit.formats.spec import QuantSpec

__all__ = ["per_token_nvfp4", "static_nvfp4", "per_token_fp8", "fp8_values", "fp8_row_spec", "rac_channel_count",
           "rac_residual", "rac_residual_on", "rac_folded", "top_channels", "rac_group_channels", "check_rac_group",
           "NVFP4_ROW", "NVFP4_ROW_AMAX", "NVFP4_STATIC"]

NVFP4_ROW = QuantSpec.make("nvfp4", (1, 16), tensor_scale=False)
"""Single-level NVFP4: 1x16 blocks, E4M3 block scales, no tensor scale (the per-token
power-of-two pre-scale stands in for it)."""

NVFP4_ROW_AMAX = 448.0 * 6.0
"""The largest magnitude single-level NVFP4 represents (E4M3's max times E2M1's)."""

NVFP4_STATIC = QuantSpec.make("nvfp4", (1, 16), tensor_scale=True)
"""Two-level NVFP4 along each row, whose FP32 tensor scale `static_nvfp4` gives from a
calibrated amax (not from the values at hand)."""


def fp8_row_spec(k: int) -> QuantSpec:
    """One E8M0 (power-of-two, rceil) scale per row of k values, E4M3 elements."""
    return QuantSpec.make("mxfp8_e4m3", (1, k), "rceil")


def per_token_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """QDQ of each row of x (..., K) under its own power-of-two pre-scale, in x's dtype.

    A power-of-two pre-scale 2^e per row puts the row's finite amax in (1344, 2688], then
    single-level NVFP4 (E4M3 block scales, no tensor scale) quantizes it, and 2^-e scales it
    back. That is NVFP4's two-level scaling with a per-token instead of a per-tensor FP32
    scale, rounded to a power of two: then both scalings are exact, so every value is exactly
    an E2M1 element times an E4M3 block scale times 2^e, with no rounding beyond NVFP4's own
    (a float32 factor amax / 2688 would round x * (1 / s) and the product back). Per token
    because a per-tensor amax over a batch would make every token's numerics depend on its
    batch-mates (a prefill and a KV-cache decode of the same token would quantize it
    differently).

    e = ceil(log2(amax / 2688)) is taken on the float32 bits of amax / 2688 (frexp: exact, no
    log2 rounding) and clamped to [-126, 127]; an all-zero row takes e = 0 and gives zeros
    (as does a row whose amax / 2688 underflows to 0). NaN and Inf are not in the amax; the
    block holding one dequantizes to NaN.
    """
    xf = x.float()
    amax = finite_abs(xf).amax(dim=-1, keepdim=True)               # (..., 1)
    # 2^e with amax / 2^e in (1344, 2688]: e = ceil(log2(amax / 2688)) on the float bits
    mant, exp = torch.frexp(divide(amax, NVFP4_ROW_AMAX))
    exp = torch.where(mant == 0.5, exp - 1, exp)
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp)).clamp(-126, 127)
    up = torch.ldexp(torch.ones_like(amax), -exp)                  # 2^-e, exact
    values = quantize_dequantize(xf * up, NVFP4_ROW)
    return (values * torch.ldexp(torch.ones_like(amax), exp)).to(x.dtype)


def static_nvfp4(x: torch.Tensor, input_amax: torch.Tensor) -> torch.Tensor:
    """QDQ of each row of x (..., K) as a served NVFP4 checkpoint quantizes a linear's input
    (see the module doc), in x's dtype: 1x16 blocks, E4M3 block scales computed from the
    block, under the one FP32 scale s = tensor_scale_from_amax(input_amax) -- input_amax (a
    float32 tensor of one element) the layer's calibrated largest |input|, s its checkpoint's
    `input_scale`. Values beyond the calibrated range saturate at +-6 * 448 * s; a block holding
    NaN or Inf is NaN."""
    if input_amax.numel() != 1:
        raise ValueError(f"static_nvfp4 takes one calibrated amax per layer, got shape "
                         f"{tuple(input_amax.shape)}")
    return quantize_dequantize(x, NVFP4_STATIC, tensor_scale=tensor_scale_from_amax(input_amax))


def per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) of x (N, K): E4M3 codes (N, K) float8_e4m3fn and one power-of-two scale
    per row (N, 1) float32, the operand and row-wise scale `torch._scaled_mm` takes.

    codes * scale (in float32) is `quantize_dequantize(x, fp8_row_spec(K), dtype=float32)` bit
    for bit; saturated to x's dtype, the FP8 activation QDQ the engine emulates. The scale is
    rceil's 2^ceil(log2(amax / 448)), so nothing clips (a zero row takes 2^-127, a float32
    subnormal). A row holding NaN or Inf gets codes 0 and a NaN scale: all of it is NaN."""
    if x.dim() != 2:
        raise ValueError(f"per_token_fp8 takes (N, K) rows, got shape {tuple(x.shape)}")
    q = quantize_with_spec(x, fp8_row_spec(x.shape[-1]))
    return q.codes.view(torch.float8_e4m3fn), e8m0_to_float(q.scales)


def fp8_values(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of per_token_fp8's (codes, scale) in `dtype`: E4M3 times a power of two,
    formed in float32 (exact) and rounded once."""
    return (codes.to(torch.float32) * scale).to(dtype)


def rac_channel_count(k: int, ratio: float) -> int:
    """How many of k input channels RAC compensates: ceil(ratio * k), at most k (the 1e-9
    keeps ratio * k from rounding up past an exact integer, e.g. 0.3 * 10)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"rac ratio must be in [0, 1], got {ratio}")
    return min(k, math.ceil(ratio * k - 1e-9))


def rac_residual(x: torch.Tensor, x_hat: torch.Tensor, ratio: float, group: int = 0) -> torch.Tensor:
    """RAC's quantized residual per token, dense: r_hat (..., K) in x's dtype (see the module
    doc), with Y = x_hat Q(W)^T + r_hat Q(W)^T the compensated GEMM.

    Each row n on its own: r = x[n] - x_hat[n] in float32; S_n = the
    c = rac_channel_count(K, ratio) channels with the largest |r| (ties to the lower channel;
    NaN counts as the largest, as a descending torch.sort has it); the compacted row
    r[S_n] (c values in increasing channel order) goes through `per_token_nvfp4`, and its
    values land back on their channels; every other channel is 0. ratio 0 gives all zeros.
    x_hat is the quantized x (`per_token_nvfp4(x)`), in x's dtype.

    group > 0 (a power of two, at least 16) chooses S_n group by group instead
    (`rac_group_channels`): the top rac_channel_count(G, ratio) channels of each G consecutive
    channels, the last group of K % G its own count; the compaction and quantization are the
    same. group 0 is the row-wide choice above (as is any group >= K)."""
    if x.shape != x_hat.shape:
        raise ValueError(f"x {tuple(x.shape)} and x_hat {tuple(x_hat.shape)} differ in shape")
    k = x.shape[-1]
    count = rac_channel_count(k, ratio)
    check_rac_group(group)
    if count == 0 or x.numel() == 0:
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    r = (x.float() - x_hat.float()).reshape(-1, k)                 # (N, K)
    channels = (top_channels(r.abs(), count) if group == 0 or group >= k else
                rac_group_channels(r.abs(), group, ratio))
    return rac_residual_on(x, x_hat, channels)                     # (N, c), increasing


def rac_folded(x_hat: torch.Tensor, r_hat: torch.Tensor) -> torch.Tensor:
    """RAC's compensated activation as one GEMM operand: x_hat + r_hat added in float32 and
    rounded once to x_hat's dtype (the module doc's "folded")."""
    if x_hat.shape != r_hat.shape or x_hat.dtype != r_hat.dtype:
        raise ValueError(f"x_hat {tuple(x_hat.shape)} {x_hat.dtype} and r_hat {tuple(r_hat.shape)} "
                         f"{r_hat.dtype} differ")
    return (x_hat.float() + r_hat.float()).to(x_hat.dtype)


def check_rac_group(group, name: str = "RAC's channel group") -> None:
    """RAC's channel group: 0 (the whole row) or a power of two from 16 to 16384; the refusal
    names it `name` (a flag, for lowbit rl's)."""
    if isinstance(group, bool) or not isinstance(group, int) or (
            group != 0 and not (16 <= group <= 16384 and group & (group - 1) == 0)):
        raise ValueError(f"{name} must be 0 (RAC's channels chosen over the whole row) or a power "
                         f"of two from 16 to 16384, e.g. 64 (got {group!r})")


def rac_group_channels(scores: torch.Tensor, group: int, ratio: float) -> torch.Tensor:
    """RAC's channels chosen group by group: per row of scores (N, K), the top
    rac_channel_count(G, ratio) channels of each group of G = `group` consecutive channels
    from the left (a last group of K % G channels: rac_channel_count(K % G, ratio) of them),
    ties to the lower channel and NaN the largest as `top_channels`; (N, c) in increasing
    order. A kernel finds them within each group, with no selection over the whole row."""
    n, k = scores.shape
    padded = -(-k // group) * group
    grouped = torch.full((n, padded), -math.inf, dtype=scores.dtype, device=scores.device)
    grouped[:, :k] = scores                      # padding never chosen: count_last <= K % G
    grouped = grouped.reshape(n, padded // group, group)
    full = top_channels(grouped, rac_channel_count(group, ratio))            # (N, groups, c_G)
    full = full + torch.arange(0, padded, group, device=scores.device)[:, None]
    if k % group == 0:
        return full.reshape(n, -1)
    last = top_channels(grouped[:, -1], rac_channel_count(k % group, ratio)) + (padded - group)
    return torch.cat([full[:, :-1].reshape(n, -1), last], dim=-1)


def top_channels(scores: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` channels with the largest scores along the last dimension, in increasing
    channel order: ties to the lower channel, NaN the largest (a stable descending sort's
    choice). RAC's choice of channels, per row (rac_residual) or from any score."""
    top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :count]
    return torch.sort(top, dim=-1).values


def rac_residual_on(x: torch.Tensor, x_hat: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """RAC's quantized residual on given channels, dense: r_hat (..., K) in x's dtype.
    channels: (c,) int64, one set for every row (a static choice), or (N, c) a set per row
    (rac_residual's), each in increasing order. Per row: the compacted r[channels] goes through
    `per_token_nvfp4` and lands back on its channels; every other channel is 0."""
    k = x.shape[-1]
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device).reshape(-1, k)
    if channels.shape[-1] == 0 or x.numel() == 0:
        return out.reshape(x.shape)
    r = (x.float() - x_hat.float()).reshape(-1, k)                 # (N, K)
    index = channels.expand(r.shape[0], -1) if channels.dim() == 1 else channels
    r_hat = per_token_nvfp4(torch.gather(r, -1, index)).to(x.dtype)      # (N, c)
    return out.scatter_(-1, index, r_hat).reshape(x.shape)
