"""AdamW's step, optionally with the gradients times the clip's coefficient and each weight's
change times its B (JacQuant's B on the update), on the Triton kernel (lowbit.kernels.optimizer)
or the reference (lowbit.formats.optimizer), by the rule of this package: a CUDA weight takes
the kernel when triton imports and the reference is not forced; a CPU weight, or one the kernel
does not take (not contiguous, say), the reference. The rule is asked once a device and once a
weight, each weight's tensors checked once (the kernel is told so), since a step of a model's
weights runs it for every weight on the host; the optimizer's own tensors (p, m, v, B) are
checked once for the addresses, dtypes, sizes and contiguity they hold and the answer kept
(they keep their storage from step to step; a state tensor reshaped in place to another shape
of the same size is still read as the flat memory it is), the gradients (new tensors each
step) every step."""

from __future__ import annotations

import torch

from lowbit import kernels
from lowbit.dispatch._quantizers import reference_forced
from lowbit.formats.optimizer import B_DTYPES, adamw_step_scalars, adamw_step_

__all__ = ["AdamW", "adamw_step", "new_adamw_state", "lr_tensor", "kernel_runs_on", "kernel_applies", "state_applies",
           "grad_applies"]


def kernel_runs_on(p: torch.Tensor, scalars: tuple[torch.Tensor, ...]) -> bool:
    """The rule for a device, asked once a step for each device the weights are on: p is a CUDA
    tensor, triton imports, the reference is not forced, and the step's scalar vectors (step
    sizes, corrections[, decay]) are on p's device. (A test hands CPU tensors to the kernel
    under Triton's interpreter by patching this.)"""
    return (p.is_cuda and not reference_forced() and kernels.kernels_available(p)
            and all(t.device == p.device for t in scalars))


def kernel_applies(tensors: tuple[torch.Tensor, ...]) -> bool:
    """The rule for one weight (p, g, m, v, b) on a device kernel_runs_on allows (b: p itself
    where there is no B): p, g, m, v float32, b of B_DTYPES, all of p's shape, contiguous, on
    p's device -- everything lowbit.kernels.optimizer.adamw_step_triton checks, so the weights
    it is handed need no second check. It is state_applies for the optimizer's tensors and
    grad_applies for g."""
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
def adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], bs: list[torch.Tensor] | None,
               lr: torch.Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
               levels_per_unit: float | None, grad_coef: torch.Tensor | None = None) -> None:
    """One AdamW step of each float32 param, in place (params, exp_avgs, exp_avg_sqs; steps,
    0-d tensors, +1): lowbit.formats.optimizer's arithmetic, the kernel's weights in one launch a
    B dtype and device, the others one by one on the reference. bs: one B per element, float32 /
    bfloat16, or uint8 levels with levels_per_unit; None: no B. lr: a 0-d float32 tensor on the
    params' device (a new value each step, no host synchronisation). grad_coef: a 0-d float32 on
    that device every gradient is multiplied by first (the clip's coefficient), or None."""
    no_b = bs is None
    bs = params if no_b else bs          # p stands in for B in the rules and the kernel's table
    lists = (params, grads, exp_avgs, exp_avg_sqs, steps, bs)
    if len({len(x) for x in lists}) != 1:
        raise ValueError(f"adamw_step takes one of each per weight (got lists of lengths "
                         f"{[len(x) for x in lists]})")
    torch._foreach_add_(steps, 1)
    step_sizes, corrections, decay = adamw_step_scalars(steps, lr, beta1, beta2, weight_decay)
    decay = decay if weight_decay != 0 else None
    launches: dict[tuple, list[int]] = {}       # the kernel's weights, one launch a (B dtype, device)
    scalars = (step_sizes, corrections, *([] if decay is None else [decay]),
               *([] if grad_coef is None else [grad_coef]))   # one device for all weights
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
            adamw_step_(p, g, m, v, None if no_b else b, step_sizes[i], corrections[i], decay, beta1, beta2,
                        eps, levels_per_unit, grad_coef)
    if launches:
        from lowbit.kernels.optimizer import adamw_step_triton
    for index in launches.values():
        every = len(index) == len(params)   # every weight in order: the scalars as they are, not gathered
        p, g, m, v, b = (lst if every else [lst[i] for i in index]
                         for lst in (params, grads, exp_avgs, exp_avg_sqs, bs))
        adamw_step_triton(p, g, m, v, None if no_b else b,
                          step_sizes if every else step_sizes[index], corrections if every else corrections[index],
                          decay, beta1, beta2, eps, levels_per_unit, checked=True, grad_coef=grad_coef)


def new_adamw_state(p: torch.Tensor, group: dict) -> dict:
    """The state torch.optim.AdamW gives a parameter at its first step: a step count (a 0-d
    tensor on the parameter's device when the optimizer is fused (float32) or capturable (the
    default float dtype), else on the CPU in the default float dtype) and zero moments shaped
    like it, so a checkpoint of either way of stepping loads into the other."""
    default = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    if group.get("fused") or group.get("capturable"):   # fused: float32; capturable alone: the default
        step = torch.zeros((), dtype=torch.float32 if group.get("fused") else default, device=p.device)
    else:
        step = torch.tensor(0.0, dtype=default)
    return {"step": step, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW (fused: its param groups, state and state dict are fused AdamW's, so a
    checkpoint of either loads into the other; one of torch's non-fused AdamW loads too, its
    step counts moved to their weights' devices) whose step is `adamw_step`: every float32
    weight of a param group and device in one launch of lowbit's kernel on CUDA, the reference
    elsewhere (in the weight's own dtype). The same update to float32 rounding (the order of a
    few operations differs).

    The gradient clip's coefficient may be handed to the step, as torch's GradScaler hands a
    fused optimizer its scale: set `optimizer.grad_coef` (a 0-d float32 on the weights' device)
    before `step()` and delete it after; the step multiplies each gradient by it in registers,
    so no pass multiplies the gradients in memory (lowbit.train.graphs.clip_gradients computes
    it; the stored gradients keep their unclipped values). Without it, the gradients as they
    are. amsgrad, maximize, a differentiable step, tensor betas, sparse gradients and a
    GradScaler's scaled gradients are refused, before any weight is stepped: build
    torch.optim.AdamW for those."""

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        if any(torch.is_tensor(b) for b in betas):
            raise ValueError("lowbit.dispatch.AdamW takes betas as numbers; build torch.optim.AdamW for tensors")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:   # a non-fused AdamW's groups and CPU step counts, as fused's
            group["fused"] = True
            for p in group["params"]:
                state = self.state.get(p)
                if state and torch.is_tensor(state.get("step")) and (
                        state["step"].device != p.device or state["step"].dtype != torch.float32):
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            raise ValueError("lowbit.dispatch.AdamW takes unscaled gradients (no GradScaler); build "
                             "torch.optim.AdamW(fused=True) to step a GradScaler's")
        for group in self.param_groups:   # every refusal before anything is stepped
            if group["amsgrad"] or group["maximize"] or group["differentiable"]:
                raise ValueError("lowbit.dispatch.AdamW has no amsgrad, maximize or differentiable step; "
                                 "build torch.optim.AdamW for those")
            if any(p.grad is not None and p.grad.is_sparse for p in group["params"]):
                raise ValueError("lowbit.dispatch.AdamW takes dense gradients")
        coef = getattr(self, "grad_coef", None)
        for group in self.param_groups:
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_device.setdefault(p.device, []).append(p)
                    if not self.state[p]:
                        self.state[p].update(new_adamw_state(p, group))
            beta1, beta2 = group["betas"]
            for device, params in by_device.items():
                state = [self.state[p] for p in params]
                adamw_step(params, [p.grad for p in params], [s["exp_avg"] for s in state],
                           [s["exp_avg_sq"] for s in state], [s["step"] for s in state], None,
                           self._lr_tensor(group["lr"], device), float(beta1), float(beta2),
                           float(group["eps"]), float(group["weight_decay"]), None,
                           grad_coef=None if coef is None else coef.to(device, non_blocking=True))
        return loss

    def _lr_tensor(self, lr: float | torch.Tensor, device: torch.device) -> torch.Tensor:
        """lr_tensor into this optimizer's tensors, made on first use (a copied or unpickled
        optimizer has none yet)."""
        return lr_tensor(lr, self.__dict__.setdefault("_lr", {}), device)


def lr_tensor(lr: float | torch.Tensor, kept: dict[torch.device, torch.Tensor], device: torch.device) -> torch.Tensor:
    """A param group's learning rate (a number, or a one-element tensor) in a 0-d float32 on
    `device`, for adamw_step: kept[device], made there on first use and refilled each call -- a
    fill (one launch with the value as its argument) or a copy, no host synchronisation."""
    if device not in kept:
        kept[device] = torch.zeros((), dtype=torch.float32, device=device)
    out = kept[device]
    return out.copy_(lr.reshape(()), non_blocking=True) if torch.is_tensor(lr) else out.fill_(float(lr))
