"""AdamW's step, optionally with the gradient times a clip coefficient and the change times a
per-element factor B: the reference.

JacQuant's B on the update (lowbit.qat) scales each optimizer step's change of a weight,
W <- W + B * (AdamW's change of W); the gradient clip's coefficient c (min(1, max_norm / (norm +
1e-6)), as torch.nn.utils.clip_grad_norm_ computes it) may be taken here instead of a pass that
multiplies every gradient in memory. Inside AdamW's step, per weight tensor, in float32:

    g <- g c                                          # with a coefficient; the stored g unchanged
    m <- m + (g - m) (1 - beta1)                      # torch's lerp for a weight below 0.5
    v <- v beta2 + g^2 (1 - beta2)
    delta = m / (sqrt(v) / sqrt(1 - beta2^t) + eps) * step_size  (+ p * decay; sqrt rounded once)
    p <- p + delta * B                                # without B: p + delta; a uint8 B: delta * level / levels per unit

with step_size = -lr / (1 - beta1^t) and decay = -lr * weight_decay (AdamW's decoupled decay),
t the weight's step count after this step's increment (`adamw_step_scalars`). Each line is
separate float32 operations in this order, never fused multiply-adds, so that the Triton kernel
(lowbit.kernels.optimizer) gives the same bits under Triton's interpreter. Against
torch.optim.AdamW followed by W_before + B (W - W_before) it agrees to float32 rounding, not bit
for bit (the order of a few operations differs).
"""

from __future__ import annotations

import torch

from lowbit.formats.quantize import divide

__all__ = ["adamw_step_scalars", "adamw_step_", "B_DTYPES"]

B_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)
"""The storages of B adamw_step_ takes (uint8: levels, with levels_per_unit)."""


def adamw_step_scalars(steps: list[torch.Tensor], lr: torch.Tensor, beta1: float, beta2: float,
                       weight_decay: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per weight, from its step count t (a 0-d tensor, already incremented for this step; all
    on one device): step_size = -lr / (1 - beta1^t) and sqrt(1 - beta2^t), computed in float64
    for all the weights at once and rounded to float32 once, two (n,) vectors (a few launches
    however many weights; weight i's are element i); and decay = -lr * weight_decay (0-d float32,
    on lr's device). No host synchronisation: lr is a 0-d tensor."""
    t = torch.stack(steps).double()                      # the corrections in float64, as AdamW's
    step_sizes = -(lr.double().to(t.device) / (1 - torch.pow(beta1, t)))
    corrections = torch.sqrt(1 - torch.pow(beta2, t))
    return step_sizes.float(), corrections.float(), lr.float() * (-weight_decay)


@torch.no_grad()
def adamw_step_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, b: torch.Tensor | None,
                step_size: torch.Tensor, correction2_sqrt: torch.Tensor, decay: torch.Tensor | None,
                beta1: float, beta2: float, eps: float, levels_per_unit: float | None,
                grad_coef: torch.Tensor | None = None) -> None:
    """One weight's AdamW step (the module doc), in place on p, m and v (float32, one shape); b
    that shape (float32, bfloat16, or uint8 levels with levels_per_unit) or None; the scalars
    from adamw_step_scalars; decay None for no weight decay; grad_coef a 0-d float32 the
    gradient is multiplied by first (the clip's coefficient), or None."""
    if grad_coef is not None:
        g = g * grad_coef.to(g.device)
    m.copy_(m + (g - m) * (1 - beta1))
    v.copy_(v * beta2 + (g * g) * (1 - beta2))
    # sqrt correctly rounded (through float64, exact for a float32 input): torch's float32 sqrt
    # on the CPU may be a last-place off, the kernel's (and CUDA's) is IEEE's
    root = torch.sqrt(v.double()).float()
    delta = m / (root / correction2_sqrt.to(v.device) + eps) * step_size.to(v.device)
    if decay is not None:
        delta = delta + p * decay.to(p.device)
    if b is not None:
        delta = delta * b.float()
    if b is not None and levels_per_unit is not None:
        delta = divide(delta, float(levels_per_unit))            # as IEEE divides, on CUDA too
    p.copy_(p + delta)
