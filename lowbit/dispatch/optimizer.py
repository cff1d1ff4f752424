"""AdamW's step with each weight's change times its B (JacQuant's B on the update), on the
Triton kernel (lowbit.kernels.optimizer) or the reference (lowbit.formats.optimizer), by the
rule of this package: a CUDA weight takes the kernel when triton imports and the reference is
not forced; a CPU weight, or one the kernel does not take (not contiguous, say), the reference.
The rule is asked once a device and once a weight, each weight's tensors checked once (the
kernel is told so), since a step of a model's weights runs it for every weight on the host."""

from __future__ import annotations

import torch

from lowbit import kernels
from lowbit.dispatch._quantizers import reference_forced
from lowbit.formats.optimizer import B_DTYPES, adamw_step_scalars, adamw_times_b_

__all__ = ["adamw_step_times_b", "kernel_runs_on", "kernel_applies"]


def kernel_runs_on(p: torch.Tensor, scalars: tuple[torch.Tensor, ...]) -> bool:
    """The rule for a device, asked once a step for each device the weights are on: p is a CUDA
    tensor, triton imports, the reference is not forced, and the step's scalar vectors (step
    sizes, corrections[, decay]) are on p's device. (A test hands CPU tensors to the kernel
    under Triton's interpreter by patching this.)"""
    return (p.is_cuda and not reference_forced() and kernels.kernels_available(p)
            and all(t.device == p.device for t in scalars))


def kernel_applies(tensors: tuple[torch.Tensor, ...]) -> bool:
    """The rule for one weight (p, g, m, v, b) on a device kernel_runs_on allows: p, g, m, v
    float32, b of B_DTYPES, all of p's shape, contiguous, on p's device -- everything
    lowbit.kernels.optimizer.adamw_times_b_triton checks, so the weights it is handed need no
    second check."""
    p, g, m, v, b = tensors
    return (p.dtype == g.dtype == m.dtype == v.dtype == torch.float32 and b.dtype in B_DTYPES
            and p.shape == g.shape == m.shape == v.shape == b.shape
            and p.device == g.device == m.device == v.device == b.device
            and p.is_contiguous() and g.is_contiguous() and m.is_contiguous() and v.is_contiguous()
            and b.is_contiguous())


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
    devices: dict[torch.device, bool] = {}      # kernel_runs_on's answer, asked once a device
    for i, (p, g, m, v, b) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, bs, strict=True)):
        device = p.device
        if device not in devices:
            devices[device] = kernel_runs_on(p, scalars)
        if devices[device] and kernel_applies((p, g, m, v, b)):
            launches.setdefault((b.dtype, device), []).append(i)
        else:   # the reference takes the weight's own 0-d scalars, indexed only here (off the kernel's path)
            adamw_times_b_(p, g, m, v, b, step_sizes[i], corrections[i], decay, beta1, beta2, eps,
                           levels_per_unit)
    if launches:
        from lowbit.kernels.optimizer import adamw_times_b_triton
    for index in launches.values():
        adamw_times_b_triton(*([lst[i] for i in index] for lst in (params, grads, exp_avgs, exp_avg_sqs, bs)),
                             step_sizes[index], corrections[index], decay, beta1, beta2, eps, levels_per_unit,
                             checked=True)
