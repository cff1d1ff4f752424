"""JacQuant's B on the update, inside AdamW's step: p <- p + B * (AdamW's change of p).

`UpdateScaling` (lowbit.qat.layers) scales each optimizer step's change of a prepared weight by
its B. Around any optimizer that takes a copy of the weights before the step and three passes
after it (W -= W_before; W *= B; W += W_before): about 44 bytes a weight a step on top of
AdamW's own 28. For torch.optim.AdamW over float32 weights with one B per element, this module
is the step itself, AdamW's arithmetic with the change multiplied by B before it is added:

    m <- beta1 m + (1 - beta1) g;   v <- beta2 v + (1 - beta2) g^2
    delta = -lr wd p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    p <- p + B * delta              (B as stored; a uint8 B's level divided by its levels per unit)

in multi-tensor (`torch._foreach_*`) operations over all the weights, on the optimizer's own
state (exp_avg, exp_avg_sq, step: a checkpoint moves between this and torch's AdamW either
way). On CUDA the function runs under torch.compile, which fuses the chain into a few
multi-tensor kernels instead of a pass per operation (at best p, g, m, v and B read once and p,
m, v written once: 2 bytes a weight over AdamW's own 28 with a bfloat16 B); its cost against
STE's step is measured with `lowbit bench train --interleave` (docs/results/jacquant.md).
Eagerly (the CPU) it is the reference: the same arithmetic, one pass per operation.
Against torch's fused AdamW followed by the three passes it agrees to float32 rounding (the
order of a few operations differs), not bit for bit.
"""

from __future__ import annotations

import torch

__all__ = ["adamw_step_times_b", "step_function", "new_adamw_state"]


def adamw_step_times_b(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                       exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], bs: list[torch.Tensor],
                       lr: torch.Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
                       levels_per_unit: float | None) -> None:
    """One AdamW step of each float32 param, its change multiplied by its B (the module doc),
    in place: params, exp_avgs, exp_avg_sqs, and steps (0-d tensors, +1). bs: one B per element,
    all float32 / bfloat16 B, or all uint8 levels with levels_per_unit (B = level / levels).
    lr: a 0-d float32 tensor (on the params' device or the CPU), so a new learning rate is a
    new value, not a new compiled function."""
    torch._foreach_add_(steps, 1)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    # bias corrections per weight, from its own step count (as AdamW keeps one per parameter)
    correction1 = torch._foreach_pow(beta1, steps)
    torch._foreach_neg_(correction1)
    torch._foreach_add_(correction1, 1)                   # 1 - beta1^t
    correction2 = torch._foreach_pow(beta2, steps)
    torch._foreach_neg_(correction2)
    torch._foreach_add_(correction2, 1)
    torch._foreach_sqrt_(correction2)                     # sqrt(1 - beta2^t)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, correction2)
    torch._foreach_add_(denom, eps)
    step_sizes = torch._foreach_div(correction1, lr)
    torch._foreach_reciprocal_(step_sizes)                # lr / (1 - beta1^t)
    torch._foreach_neg_(step_sizes)
    delta = torch._foreach_div(exp_avgs, denom)
    torch._foreach_mul_(delta, step_sizes)
    if weight_decay != 0:
        decay = torch._foreach_mul(params, -weight_decay)
        torch._foreach_mul_(decay, lr)
        torch._foreach_add_(delta, decay)
    torch._foreach_mul_(delta, bs)
    if levels_per_unit is not None:
        torch._foreach_div_(delta, float(levels_per_unit))
    torch._foreach_add_(params, delta)


_COMPILED = None


def step_function(device: torch.device):
    """adamw_step_times_b as it runs on `device`: under torch.compile on CUDA (where Triton
    builds its kernels), eagerly elsewhere (a C++ toolchain is not assumed on the CPU)."""
    global _COMPILED
    if device.type != "cuda":
        return adamw_step_times_b
    if _COMPILED is None:
        _COMPILED = torch.compile(adamw_step_times_b, fullgraph=True, dynamic=False)
    return _COMPILED


def new_adamw_state(p: torch.Tensor, group: dict) -> dict:
    """The state torch.optim.AdamW gives a parameter at its first step: a step count (a 0-d
    tensor, on the parameter's device when the optimizer is fused or capturable) and zero
    moments shaped like it, so a checkpoint of either step loads into the other."""
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    on_device = group.get("fused") or group.get("capturable")
    step = (torch.zeros((), dtype=dtype, device=p.device) if on_device else torch.tensor(0.0, dtype=dtype))
    return {"step": step, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
