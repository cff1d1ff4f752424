"""AdamW's step with each weight's change times its B (JacQuant's B on the update), on the
Triton kernel (lowbit.kernels.optimizer) or the reference (lowbit.formats.optimizer), by the
rule of this package: a CUDA weight takes the kernel when triton imports and the reference is
not forced; a CPU weight, or one the kernel does not take (not contiguous, say), the reference.
The rule is asked once a device and once a weight, each weight's tensors checked once (the
kernel is told so), since a step of a model's weights runs it for every weight on the host; the
optimizer's own tensors (p, m, v, B) are checked once for the addresses, dtypes, sizes and
contiguity they hold and the answer kept (they keep their storage from step to step; a state
tensor reshaped in place to another shape of the same size is still read as the flat memory
it is), the gradients (new tensors each step) every step."""

from __future__ import annotations

import torch

from lowbit import kernels
from lowbit.dispatch._quantizers import reference_forced
from lowbit.formats.optimizer import B_DTYPES, adamw_step_scalars, adamw_times_b_

__all__ = ["adamw_step_times_b", "kernel_runs_on", "kernel_applies", "state_applies", "grad_applies"]


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
    second check. It is state_applies for the optimizer's tensors and grad_applies for g."""
    p, g, m, v, b = tensors
    return state_applies((p, m, v, b)) and grad_applies(p, g)


def state_applies(tensors: tuple[torch.Tensor, ...]) -> bool:
    """kernel_applies's rule for a weight's own tensors (p, m, v, b), those that keep their
    storage between steps."""
    p, m, v, b = tensors
    return (p.dtype == m.dtype == v.dtype == torch.float32 and b.dtype in B_DTYPES
            and p.shape == m.shape == v.shape == b.shape and p.device == m.device == v.device == b.device
            and p.is_contiguous() and m.is_contiguous() and v.is_contiguous() and b.is_contiguous())


def grad_applies(p: torch.Tensor, g: torch.Tensor) -> bool:
    """kernel_applies's rule for a weight's gradient: float32, p's shape, contiguous, p's device."""
    return g.dtype == torch.float32 and g.shape == p.shape and g.device == p.device and g.is_contiguous()


_STATE_RULES: dict[tuple, tuple[bool, ...]] = {}   # state_applies a weight, by its state's addresses and layout


def _state_rules(params, exp_avgs, exp_avg_sqs, bs) -> tuple[bool, ...]:
    """state_applies of each weight, kept for the addresses, dtypes, sizes and contiguity the
    state tensors hold (a few sets of them)."""
    key = tuple([x for w in zip(params, exp_avgs, exp_avg_sqs, bs) for t in w
                 for x in (t.data_ptr(), t.dtype, t.numel(), t.is_contiguous())])
    rules = _STATE_RULES.get(key)
    if rules is None:
        if len(_STATE_RULES) >= 8:
            _STATE_RULES.clear()
        rules = _STATE_RULES[key] = tuple(state_applies(w) for w in zip(params, exp_avgs, exp_avg_sqs, bs))
    return rules


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
    rules = None                                 # state_applies of each weight, once a device takes the kernel
    for i, (p, g, m, v, b) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, bs, strict=True)):
        device = p.device
        if device not in devices:
            devices[device] = kernel_runs_on(p, scalars)
        if devices[device] and rules is None:
            rules = _state_rules(params, exp_avgs, exp_avg_sqs, bs)
        if devices[device] and rules[i] and grad_applies(p, g):
            launches.setdefault((b.dtype, device), []).append(i)
        else:   # the reference takes the weight's own 0-d scalars, indexed only here (off the kernel's path)
            adamw_times_b_(p, g, m, v, b, step_sizes[i], corrections[i], decay, beta1, beta2, eps,
                           levels_per_unit)
    if launches:
        from lowbit.kernels.optimizer import adamw_times_b_triton
    for index in launches.values():
        every = len(index) == len(params)   # every weight in order: the scalars as they are, not gathered
        adamw_times_b_triton(*(lst if every else [lst[i] for i in index]
                               for lst in (params, grads, exp_avgs, exp_avg_sqs, bs)),
                             step_sizes if every else step_sizes[index], corrections if every else corrections[index],
                             decay, beta1, beta2, eps, levels_per_unit, checked=True)
