"""How the rollout engine stores a linear layer's weight and multiplies it: the precision modes,
and residual activation compensation (RAC).

| mode          | weight (stored)                          | activation at the linear's input     |
| ------------- | ---------------------------------------- | ------------------------------------ |
| `bf16`        | the compute dtype                        | the compute dtype                    |
| `fp8`         | E4M3, one scale per output channel       | E4M3, one scale per token            |
| `nvfp4-w4a16` | packed NVFP4 (1x16 blocks, tensor scale) | the compute dtype                    |
| `nvfp4`       | packed NVFP4 (1x16 blocks, tensor scale) | NVFP4 1x16, one scale set per token  |

Every quantizer is lowbit.dispatch's (the Triton kernels on CUDA where they cover the spec,
else the reference numerics); this module only says which spec each operand takes.

Weights. NVFP4 weights are the `QTensor` of `nvfp4` with blocks of 16 along in_features and
the FP32 per-tensor scale amax / (448 * 6) -- the spec of the trainer's asymmetric QAT
(`weight_spec()`), so the engine's dequantized weight equals the trainer's fake-quantized one
bit for bit. On Hopper no FP4 GEMM exists, so the engine keeps, beside the packed QTensor, its
dequantized values in the compute dtype and multiplies those ("emulated": the same values an
FP4 tensor-core GEMM multiplies, up to accumulation order). FP8 weights use `mxfp8_e4m3` with
one block spanning the whole row and the truncation-free `rceil` rule: one power-of-two scale
per output channel, nothing clips. (A float32 per-channel scale, as vLLM's, maps the row's
amax to 448 exactly; a power of two maps it into [224, 448]: the same 3-bit relative precision
for every normal value, subnormals one binade apart at most.)

Activations. `nvfp4` quantizes each token's row on its own: a power-of-two pre-scale 2^e per
token puts the row's amax in (1344, 2688], then single-level NVFP4 (E4M3 block scales, no
tensor scale) quantizes it, and 2^-e scales it back (both scalings exact). That is NVFP4's
two-level scaling with a per-token instead of a per-tensor FP32 scale, rounded to a power of
two; it makes every token's numerics independent of its batch-mates, so a prefill and a
KV-cache decode of the same token quantize it identically (a per-tensor amax over a batch
would not). FP8 activations take one `rceil` power-of-two scale per token likewise.

RAC (QUADS, arXiv 2607.15810). With r = X - QDQ(X), pick the top ceil(ratio * K) input
channels S by residual magnitude (sum over the call's tokens of |r|, so one S per GEMM call,
as a GEMM with |S| appended reduction columns needs), in increasing channel order:

    Y = Q(X) Q(W)^T + Q(r_S) Q(W)_{:,S}^T

i.e. the quantized residual of the chosen channels appended along the reduction dimension,
multiplied by the same FP4 weight columns. Q(r_S) is the per-token NVFP4 quantizer on the
compacted (N, |S|) residual (its 1x16 blocks run over the chosen channels in order). Ratio 0
is naive W4A4; ratio 1 compensates every channel (twice the FP4 GEMM's K).
"""

from __future__ import annotations

import math
from enum import Enum

import torch
import torch.nn.functional as F

from lowbit import dispatch
from lowbit.formats import QTensor, QuantSpec

__all__ = ["Precision", "parse_precision", "weight_spec", "quantize_weight",
           "quantize_activation", "rac_channels", "rac_linear", "EngineLinear"]


class Precision(str, Enum):
    BF16 = "bf16"
    FP8 = "fp8"
    NVFP4_W4A16 = "nvfp4-w4a16"
    NVFP4 = "nvfp4"

    @property
    def quantizes_weights(self) -> bool:
        return self is not Precision.BF16

    @property
    def quantizes_activations(self) -> bool:
        return self in (Precision.FP8, Precision.NVFP4)


def parse_precision(value: str | Precision) -> Precision:
    try:
        return Precision(value)
    except ValueError:
        raise ValueError(f"unknown rollout precision {value!r}; use one of "
                         f"{', '.join(p.value for p in Precision)}") from None


# NVFP4: 1x16 blocks along the reduction dim, E4M3 block scales.
_NVFP4_WEIGHT = QuantSpec.make("nvfp4", (1, 16))                       # + FP32 tensor scale
_NVFP4_ROW = QuantSpec.make("nvfp4", (1, 16), tensor_scale=False)     # under a per-token 2^e
_NVFP4_ROW_AMAX = 448.0 * 6.0   # the largest magnitude single-level NVFP4 represents


def _fp8_spec(k: int) -> QuantSpec:
    """One E8M0 (power-of-two, rceil) scale per row of k values, E4M3 elements."""
    return QuantSpec.make("mxfp8_e4m3", (1, k), "rceil")


def weight_spec() -> QuantSpec:
    """The NVFP4 weight quantizer the engine stores and the trainer's asymmetric QAT
    fake-quantizes with (1x16 blocks along in_features, FP32 tensor scale)."""
    return _NVFP4_WEIGHT


def quantize_weight(weight: torch.Tensor, precision: Precision) -> QTensor | None:
    """The packed weight of a quantizing mode (None for bf16). weight (out, in)."""
    if precision is Precision.BF16:
        return None
    if precision is Precision.FP8:
        return dispatch.quantize_with_spec(weight, _fp8_spec(weight.shape[-1]))
    return dispatch.quantize_with_spec(weight, _NVFP4_WEIGHT)


def _per_token_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """QDQ of each row of x (N, K) with its own power-of-two pre-scale (see the module doc)."""
    xf = x.float()
    finite = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros_like(xf))
    amax = finite.amax(dim=-1, keepdim=True)                       # (N, 1)
    # 2^e with amax / 2^e in (1344, 2688]: e = ceil(log2(amax / 2688)) on the float bits
    mant, exp = torch.frexp(amax / _NVFP4_ROW_AMAX)
    exp = torch.where(mant == 0.5, exp - 1, exp)
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp)).clamp(-126, 127)
    up = torch.ldexp(torch.ones_like(amax), -exp)                  # 2^-e, exact
    values = dispatch.quantize_dequantize(xf * up, _NVFP4_ROW)
    return (values * torch.ldexp(torch.ones_like(amax), exp)).to(x.dtype)


def quantize_activation(x: torch.Tensor, precision: Precision) -> torch.Tensor:
    """What a linear's input x (N, K) becomes under `precision` (a QDQ in x's dtype)."""
    if precision is Precision.NVFP4:
        return _per_token_nvfp4(x)
    if precision is Precision.FP8:
        return dispatch.quantize_dequantize(x, _fp8_spec(x.shape[-1]))
    return x


def rac_channels(residual: torch.Tensor, ratio: float) -> torch.Tensor:
    """The ceil(ratio * K) input channels with the largest residual magnitude (sum over tokens
    of |r|), in increasing order; residual (N, K). Ties go to the lower channel (a stable sort)."""
    k_total = residual.shape[-1]
    count = min(k_total, math.ceil(ratio * k_total - 1e-9))
    score = residual.float().abs().sum(dim=0)                       # (K,)
    order = torch.sort(score, descending=True, stable=True).indices
    return torch.sort(order[:count]).values


def rac_linear(x: torch.Tensor, weight_values: torch.Tensor, ratio: float) -> torch.Tensor:
    """Y = Q(X) W^T + Q(r_S) W_{:,S}^T with W = weight_values (out, K), the engine's dequantized
    FP4 weight, and Q the per-token NVFP4 activation quantizer; x (N, K) -> (N, out)."""
    xq = _per_token_nvfp4(x)
    y = F.linear(xq, weight_values)
    if ratio <= 0:
        return y
    residual = x.float() - xq.float()                                # (N, K)
    channels = rac_channels(residual, ratio)                         # (|S|,)
    r_s = _per_token_nvfp4(residual[:, channels]).to(x.dtype)        # (N, |S|)
    return y + F.linear(r_s, weight_values[:, channels])


class EngineLinear:
    """One linear layer of the engine: its weight as `precision` stores it, and its GEMM.

    weight (out, in) arrives in any dtype and device; it is copied to the engine's device and
    compute dtype, then quantized there. The engine keeps only what this object holds: the
    packed QTensor (quantizing modes) and the values its GEMM multiplies.

    `EngineLinear.fused([w_q, w_k, w_v], ...)` holds several weights that read the same input
    as one GEMM (q|k|v, gate|up): each part is quantized on its own (its own NVFP4 tensor scale,
    as the trainer fake-quantizes each projection) and their dequantized values are stacked
    along out_features, so the fused GEMM's columns are the separate GEMMs' outputs exactly
    (up to accumulation order). The activation side needs nothing more: the per-token FP8 and
    NVFP4 quantizers see the same x for every part, and RAC picks its channels from x alone.

    A bias (Qwen2's q/k/v, attention_bias, mlp_bias) stays in the compute dtype and is added
    to the GEMM's output, as servers do and as the trainer's high-precision bias is."""

    def __init__(self, weight: torch.Tensor, precision: Precision, rac_ratio: float,
                 device: torch.device, dtype: torch.dtype, bias: torch.Tensor | None = None) -> None:
        self._build([weight], precision, rac_ratio, device, dtype, None if bias is None else [bias])

    @classmethod
    def fused(cls, weights: list[torch.Tensor], precision: Precision, rac_ratio: float,
              device: torch.device, dtype: torch.dtype,
              biases: list[torch.Tensor] | None = None) -> "EngineLinear":
        """One GEMM for several weights (out_i, in) of the same in_features; its output is the
        parts' outputs side by side, in order (split it with `split_sizes`). biases: one
        (out_i,) per part, or None."""
        self = cls.__new__(cls)
        self._build(list(weights), precision, rac_ratio, device, dtype, biases)
        return self

    def _build(self, weights: list[torch.Tensor], precision: Precision, rac_ratio: float,
               device: torch.device, dtype: torch.dtype, biases: list[torch.Tensor] | None) -> None:
        if rac_ratio and precision is not Precision.NVFP4:
            raise ValueError("RAC compensates NVFP4 activations: rac_ratio needs precision nvfp4")
        if len({w.shape[-1] for w in weights}) != 1:
            raise ValueError(f"fused weights need the same in_features (got shapes "
                             f"{[tuple(w.shape) for w in weights]})")
        if biases is not None and [tuple(b.shape) for b in biases] != [(w.shape[0],) for w in weights]:
            raise ValueError(f"biases of shapes {[tuple(b.shape) for b in biases]} do not match "
                             f"weights of shapes {[tuple(w.shape) for w in weights]}")
        self.bias = (None if biases is None else
                     torch.cat([b.detach().to(device=device, dtype=dtype) for b in biases]))
        """(out,) added to the output in the compute dtype, or None."""
        self.precision, self.rac_ratio = precision, rac_ratio
        packed, values = [], []
        for weight in weights:
            w = weight.detach().to(device=device, dtype=dtype, copy=True)   # (out, in), our own copy
            q = quantize_weight(w, precision)
            if q is not None:
                packed.append(q)
            values.append(w if q is None else q.dequantize(dtype))
        self.packed: tuple[QTensor, ...] = tuple(packed)
        """One packed weight per part (quantizing modes; empty for bf16)."""
        self.values = values[0] if len(values) == 1 else torch.cat(values)
        """(out, in) what the GEMM multiplies: the parts' dequantized weights stacked."""
        self.split_sizes = tuple(v.shape[0] for v in values)
        self.out_features, self.in_features = self.values.shape

    def part(self, i: int) -> torch.Tensor:
        """The values of part i (a view of `values`)."""
        start = sum(self.split_sizes[:i])
        return self.values[start:start + self.split_sizes[i]]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.precision is Precision.NVFP4:
            y = rac_linear(x2, self.values, self.rac_ratio)
        else:
            y = F.linear(quantize_activation(x2, self.precision), self.values)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weight (packed for quantizing modes)."""
        if self.packed:
            return sum(q.nbytes for q in self.packed)
        return self.values.numel() * self.values.element_size()
