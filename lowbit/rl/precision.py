"""How the rollout engine stores a linear layer's weight and quantizes its input: the precision
modes, and residual activation compensation (RAC). The definitions; the engine's weights
(lowbit.rl.engine.weights) and the kernels (lowbit.dispatch.inference) apply them.

| mode          | weight (stored)                          | activation at the linear's input     |
| ------------- | ---------------------------------------- | ------------------------------------ |
| `bf16`        | the compute dtype                        | the compute dtype                    |
| `fp8`         | E4M3, one scale per output channel       | E4M3, one scale per token            |
| `nvfp4-w4a16` | packed NVFP4 (1x16 blocks, tensor scale) | the compute dtype                    |
| `nvfp4`       | packed NVFP4 (1x16 blocks, tensor scale) | NVFP4 1x16, one scale set per token  |

Weights. NVFP4 weights are the `QTensor` of `nvfp4` with blocks of 16 along in_features and
the FP32 per-tensor scale amax / (448 * 6) -- the spec of the trainer's asymmetric QAT
(`weight_spec()`), so the engine's dequantized weight equals the trainer's fake-quantized one
bit for bit. The engine keeps them packed (lowbit.formats.LinearWeight) and its GEMM kernel
dequantizes in registers, forming exactly those values (on Hopper no FP4 tensor core exists;
the products run on BF16 tensor cores, exact there). FP8 weights use `mxfp8_e4m3` with one
block spanning the whole row and the truncation-free `rceil` rule: one power-of-two scale per
output channel, nothing clips. (A float32 per-channel scale, as vLLM's, maps the row's amax to
448 exactly; a power of two maps it into [224, 448]: the same 3-bit relative precision for
every normal value, subnormals one binade apart at most.)

Activations (lowbit.formats.activations). `nvfp4` quantizes each token's row on its own: a
power-of-two pre-scale 2^e per token puts the row's amax in (1344, 2688], then single-level
NVFP4 (E4M3 block scales, no tensor scale) quantizes it, and 2^-e scales it back (both
scalings exact). That is NVFP4's two-level scaling with a per-token instead of a per-tensor
FP32 scale, rounded to a power of two; it makes every token's numerics independent of its
batch-mates, so a prefill and a KV-cache decode of the same token quantize it identically (a
per-tensor amax over a batch would not). FP8 activations take one `rceil` power-of-two scale
per token likewise (the row-wise scale torch._scaled_mm takes).

Activation scale (`nvfp4` only; ActivationScale, the engine's `activation_scale`):

| activation scale | FP32 scale of a linear's input                | E4M3 block scales (1x16) |
| ---------------- | --------------------------------------------- | ------------------------ |
| `per-token`      | 2^e per token from the token's amax (above)   | dynamic, from the block  |
| `static`         | one per layer, calibrated amax / (448 * 6)    | dynamic, from the block  |

`static` is what a served NVFP4 W4A4 checkpoint runs (ModelOpt's `input_scale`,
compressed-tensors' `input_global_scale`; `lowbit export --activations nvfp4` writes one from
lowbit.export.calibrate_input_amax): the engine takes the same amax (`load_state_dict(...,
input_amax=)`, refreshed at every weight sync) and the same formula
(lowbit.formats.quantize.tensor_scale_from_amax), then lowbit.formats.activations.static_nvfp4.
It is harsher than `per-token`: a token far below the calibrated amax gets low, coarse block
scales, and one beyond it saturates (block scale at 448, elements at 6: within +-amax). A
token's numerics still do not depend on its batch-mates (the scale is fixed before the batch).
Projections that share an input take one scale, the largest of theirs (q|k|v, gate|up, as vLLM
takes the max of fused parts' input scales), and an MoE layer one per GEMM for all its experts
(the max over experts, as vLLM's FlashInfer NVFP4 MoE backends share one input global scale).

RAC (QUADS, arXiv 2607.15810), per token. With r = X - QDQ(X), the paper appends the quantized
residual of the top-k% channels S by residual magnitude to the GEMM's reduction dimension:

    Y = Q(X) Q(W)^T + Q(r_S) Q(W)_{:,S}^T

lowbit chooses S per token (the top ceil(ratio * K) channels of that token's |r|, ties to the
lower channel), which writes the second term as r_hat Q(W)^T with r_hat dense (the quantized
residual on the token's own channels, zeros elsewhere): the same sum for one token, and for a
batch every token's output is what it would be alone. (Choosing one S per GEMM call from |r|
summed over the call's tokens, as a GEMM with |S| extra columns would, made a sequence's
log-probs depend on its batch-mates.) The GEMM reads each weight tile once
for both terms. Ratio 0 is naive W4A4; ratio 1 compensates every channel.

With a channel group G (`rac_group`, `lowbit rl --rac-group`) a token's S is the top
ceil(ratio * G) channels of each G consecutive channels instead of the row's top: still per
token, with no selection across the row. At G = 64 it kept 96-98% of the row-wide choice's
gain on one 7.8M model (three seeds), and took 21-29% off the activation pass at widths
1024-4096 on one H100, while at 14336 with 128-256 rows it was slower than the row-wide choice
(docs/results/rollout.md); 0, the default, is the paper's row-wide choice.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from enum import Enum

import torch

from lowbit import dispatch
from lowbit.dispatch import inference
from lowbit.formats import QTensor, QuantSpec
from lowbit.formats.activations import check_rac_group, fp8_row_spec, per_token_nvfp4, static_nvfp4
from lowbit.formats.linear_weight import LinearWeight

__all__ = ["Precision", "ActivationScale", "RolloutMode", "weight_spec", "stored_weight_spec",
           "quantize_weight", "quantize_weight_rows", "quantize_activation", "rac_linear"]


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


class ActivationScale(str, Enum):
    """How `nvfp4` scales a linear's input (the module doc's second table)."""
    PER_TOKEN = "per-token"
    STATIC = "static"


# how RolloutMode's refusals name each setting: the engine's keywords, or `lowbit rl`'s flags
ENGINE_NAMES = {"precision": "precision", "rac_ratio": "rac_ratio", "rac_group": "rac_group", "rac_fold": "rac_fold",
                "activation_scale": "activation scale", "packed_gemm": "packed_gemm"}


@dataclass(frozen=True)
class RolloutMode:
    """A rollout precision with the settings that apply to it, checked together in one place:
    RAC and a static activation scale need `nvfp4` (they act on its W4A4 activations), RAC's
    channel group a RAC ratio, the packed GEMM an NVFP4 mode. Both the engine
    (lowbit.rl.engine.EngineConfig) and `lowbit rl` (lowbit.rl.RLConfig, its refusals naming
    the flags) build one; `names` maps each field to how a refusal writes it. The engine's
    lower-level builders (EngineLinear, a static input amax) check the same rules through it,
    for callers without an EngineConfig."""

    precision: Precision
    rac_ratio: float = 0.0
    activation_scale: ActivationScale = ActivationScale.PER_TOKEN
    packed_gemm: bool = False
    rac_group: int = 0
    """0: RAC chooses each token's channels over the whole row (the paper's); G: within each
    group of G consecutive channels (lowbit.formats.activations.rac_residual)."""
    rac_fold: bool = False
    """RAC's residual added into the quantized activation, one GEMM operand rounded once to the
    compute dtype (lowbit.formats.activations.rac_folded), instead of a second operand."""

    @classmethod
    def make(cls, precision, rac_ratio=0.0, activation_scale="per-token", packed_gemm=False,
             rac_group=0, names: dict[str, str] = ENGINE_NAMES, rac_fold=False) -> RolloutMode:
        """Each value checked alone and against the others; one-line ValueErrors."""
        p, r, a, pg, rg = (names[k] for k in ("precision", "rac_ratio", "activation_scale",
                                              "packed_gemm", "rac_group"))
        for kind, value, name in ((Precision, precision, p), (ActivationScale, activation_scale, a)):
            if value not in {m.value for m in kind}:
                raise ValueError(f"unknown {name} {value!r}; use one of {', '.join(m.value for m in kind)}")
        precision, activation_scale = Precision(precision), ActivationScale(activation_scale)
        if isinstance(rac_ratio, bool) or not (isinstance(rac_ratio, numbers.Real) and 0.0 <= rac_ratio <= 1.0):
            raise ValueError(f"{r} must be in [0, 1] (got {rac_ratio}); e.g. 0.25 compensates a "
                             "quarter of the input channels")
        if rac_ratio and precision is not Precision.NVFP4:
            raise ValueError(f"{r} compensates NVFP4 activations: use {p} nvfp4 (RAC needs it; got "
                             f"{precision.value})")
        check_rac_group(rac_group, rg)
        if rac_group and not rac_ratio:
            raise ValueError(f"{rg} groups RAC's channels: give a {r} above 0 "
                             f"(got {rac_ratio})")
        if not isinstance(rac_fold, bool):
            raise ValueError(f"{names['rac_fold']} is True or False (got {rac_fold!r})")
        if rac_fold and not rac_ratio:
            raise ValueError(f"{names['rac_fold']} adds RAC's residual into the activation: give a {r} "
                             f"above 0 (got {rac_ratio})")
        if activation_scale is ActivationScale.STATIC and precision is not Precision.NVFP4:
            raise ValueError(f"{a} static scales NVFP4 activations as a served W4A4 checkpoint "
                             f"does: use {p} nvfp4 (got {precision.value})")
        if packed_gemm and precision not in (Precision.NVFP4, Precision.NVFP4_W4A16):
            raise ValueError(f"{pg} multiplies packed NVFP4 weights, so it needs {p} nvfp4 or "
                             f"nvfp4-w4a16 (got {precision.value}: bf16 weights are dense, FP8 "
                             f"runs torch._scaled_mm)")
        return cls(precision, float(rac_ratio), activation_scale, bool(packed_gemm), rac_group, rac_fold)


_NVFP4_WEIGHT = QuantSpec.make("nvfp4", (1, 16))                       # + FP32 tensor scale


def weight_spec() -> QuantSpec:
    """The NVFP4 weight quantizer the engine stores and the trainer's asymmetric QAT
    fake-quantizes with (1x16 blocks along in_features, FP32 tensor scale)."""
    return _NVFP4_WEIGHT


def stored_weight_spec(precision: Precision, in_features: int) -> QuantSpec | None:
    """The spec a mode stores a linear weight of `in_features` columns in (None for bf16)."""
    if precision is Precision.BF16:
        return None
    return fp8_row_spec(in_features) if precision is Precision.FP8 else _NVFP4_WEIGHT


def quantize_weight(weight: torch.Tensor, precision: Precision) -> QTensor | None:
    """The packed weight of a quantizing mode (None for bf16). weight (out, in)."""
    spec = stored_weight_spec(precision, weight.shape[-1])
    return None if spec is None else dispatch.quantize_with_spec(weight, spec)


def quantize_weight_rows(weights: torch.Tensor, rows: list[int], precision: Precision) -> list[QTensor] | None:
    """quantize_weight of each run of `rows` rows of `weights` (R, in) -- projections fused
    along their outputs, an MoE layer's experts -- each run its own weight (its own NVFP4 tensor
    scale), the same bits as quantize_weight of that run alone; NVFP4 on CUDA in one pass for
    all the runs (lowbit.dispatch.quantize_rows). None for bf16."""
    spec = stored_weight_spec(precision, weights.shape[-1])
    return None if spec is None else dispatch.quantize_rows(weights, spec, rows)


def quantize_activation(x: torch.Tensor, precision: Precision,
                        input_amax: torch.Tensor | None = None) -> torch.Tensor:
    """What a linear's input x (N, K) becomes under `precision` (a QDQ in x's dtype); for
    nvfp4 with input_amax (the layer's calibrated amax, float32) under its static scale."""
    if input_amax is not None and precision is not Precision.NVFP4:
        raise ValueError(f"a static activation scale is nvfp4's (got {precision.value})")
    if precision is Precision.NVFP4:
        return per_token_nvfp4(x) if input_amax is None else static_nvfp4(x, input_amax)
    if precision is Precision.FP8:
        return dispatch.quantize_dequantize(x, fp8_row_spec(x.shape[-1]))
    return x


def rac_linear(x: torch.Tensor, weight_values: torch.Tensor, ratio: float) -> torch.Tensor:
    """The reference W4A4 GEMM with RAC: Y = Q(X) W^T + r_hat W^T with W = weight_values
    (out, K), the engine's dequantized FP4 weight, Q the per-token NVFP4 quantizer and r_hat
    RAC's per-token compensated residual; x (N, K) -> (N, out)."""
    # the engine's own reference path: both products in one sum, rounded once
    x_hat, r_hat = inference.quantize_activations(x, "nvfp4", ratio, use_kernels=False)
    return inference.linear(x_hat, LinearWeight.dense(weight_values), x2=r_hat, use_kernels=False)
