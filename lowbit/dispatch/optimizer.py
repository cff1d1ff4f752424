"""AdamW's step with each weight's change times its B (JacQuant's B on the update), on the
Triton kernel (lowbit.kernels.optimizer) or the reference (lowbit.formats.optimizer), by the
rule of this package: a CUDA weight takes the kernel when triton imports and the reference is
not forced; a CPU weight, or one the kernel does not take (not contiguous), the reference."""

from __future__ import annotations

import torch

from lowbit import kernels
from lowbit.dispatch._quantizers import reference_forced
from lowbit.formats.optimizer import adamw_step_scalars, adamw_times_b_

__all__ = ["adamw_step_times_b", "kernel_applies"]


def kernel_applies(tensors: tuple[torch.Tensor, ...]) -> bool:
    """The rule for one weight's step (p, g, m, v, b, and the step's scalars: the step sizes' and
    corrections' vectors[, decay]): all on
    one CUDA device, p, g, m, v, b contiguous and g float32, triton importable, the reference
    not forced. (A test hands CPU tensors to the kernel under Triton's interpreter by patching
    this.)"""
    p = tensors[0]
    return (p.is_cuda and not reference_forced() and kernels.kernels_available(p)
            and all(t.device == p.device for t in tensors) and tensors[1].dtype == torch.float32
            and all(t.is_contiguous() for t in tensors[:5]))


@torch.no_grad()
def adamw_step_times_b(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                       exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], bs: list[torch.Tensor],
                       lr: torch.Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
                       levels_per_unit: float | None) -> None:
    """One AdamW step of each float32 param with its change times its B, in place (params,
    exp_avgs, exp_avg_sqs; steps, 0-d tensors, +1): lowbit.formats.optimizer's arithmetic, the
    kernel's weights in one launch a B dtype and device, the others one by one on the reference.
    bs: one B per element, float32 / bfloat16, or uint8 levels with levels_per_unit. lr: a 0-d
    float32 tensor on the params' device (a new value each step, no host synchronisation)."""
    lists = (params, grads, exp_avgs, exp_avg_sqs, steps, bs)
    if len({len(x) for x in lists}) != 1:
        raise ValueError(f"adamw_step_times_b takes one of each per weight (got lists of lengths "
                         f"{[len(x) for x in lists]})")
    torch._foreach_add_(steps, 1)
    step_sizes, corrections, decay = adamw_step_scalars(steps, lr, beta1, beta2, weight_decay)
    decay = decay if weight_decay != 0 else None
    launches: dict[tuple, list[int]] = {}       # the kernel's weights, one launch a (B dtype, device)
    scalars = (step_sizes, corrections, *([] if decay is None else [decay]))   # one device for all weights
    for i, (p, g, m, v, b) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, bs, strict=True)):
        if kernel_applies((p, g, m, v, b, *scalars)):
            launches.setdefault((b.dtype, p.device), []).append(i)
        else:   # the reference takes the weight's own 0-d scalars, indexed only here (off the kernel's path)
            adamw_times_b_(p, g, m, v, b, step_sizes[i], corrections[i], decay, beta1, beta2, eps,
                           levels_per_unit)
    if launches:
        from lowbit.kernels.optimizer import adamw_times_b_triton
    for index in launches.values():
        adamw_times_b_triton(*([lst[i] for i in index] for lst in (params, grads, exp_avgs, exp_avg_sqs, bs)),
                             step_sizes[index], corrections[index], decay, beta1, beta2, eps, levels_per_unit)
