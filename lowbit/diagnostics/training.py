"""Training diagnostics for a converted model, on one batch:

(a) forward/backward operand consistency: ||W_fprop - W_dgrad|| / ||W_fprop|| (0 with 2D tiles),
    the same for X (fprop vs wgrad) and dY (dgrad vs wgrad);
(b) gradient bias: cosine similarity and relative error of the recipe's dX (each quantized
    layer's input gradient) and dW against the same model with quantization off, same batch;
(c) the fraction of W, X and dY values clipped by their quantizer.

Run with its own RNG stream (torch.random.fork_rng): calling it never changes the training
run's random draws, so a run with diagnostics resumes exactly like one without.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lowbit.dispatch import quantize_with_spec
from lowbit.nn import QuantExperts, QuantLinear, quantization_disabled
from lowbit.ops.gemms import gemm_operands

__all__ = ["training_diagnostics", "relative_difference", "cosine"]


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    norm = a.norm().item()
    return (a - b).norm().item() / norm if norm > 0 else 0.0


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    denom = (a.norm() * b.norm()).item()
    return (a @ b).item() / denom if denom > 0 else 1.0


def _clipped(t: torch.Tensor, spec) -> float:
    if spec is None:
        return 0.0
    q = quantize_with_spec(t, spec)
    return (t.abs().float() > q.block_max() * (1 + 2**-20)).float().mean().item()


def _forward_backward(model: nn.Module, idx, targets, layers: dict[str, QuantLinear],
                      on_operands=None) -> dict[str, torch.Tensor]:
    """Loss backward, grads left on the params; returns {layer: dx} (its input gradient).

    on_operands(name, x, dy), if given, is called from each layer's backward hook with the
    input that layer saw and its output gradient, which are dropped right after: holding
    every layer's x and dy until the end would double the activation memory of the step."""
    inputs: dict[str, torch.Tensor] = {}
    dx: dict[str, torch.Tensor] = {}
    handles = []
    for name, layer in layers.items():
        def fwd(module, args, output, name=name):
            if on_operands is not None:
                inputs[name] = args[0].detach().reshape(-1, args[0].shape[-1])

        def bwd(module, grad_input, grad_output, name=name):
            if grad_input[0] is not None:
                dx[name] = grad_input[0].detach().reshape(-1, grad_input[0].shape[-1])
            if on_operands is not None and name in inputs:
                dy = grad_output[0].detach().reshape(-1, grad_output[0].shape[-1])
                with torch.no_grad():
                    on_operands(name, inputs.pop(name), dy)

        handles += [layer.register_forward_hook(fwd), layer.register_full_backward_hook(bwd)]
    try:
        model.zero_grad(set_to_none=True)
        out = model(idx, targets)
        loss = out.loss if hasattr(out, "loss") else out[1]
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    return dx


def _operand_stats(stats: dict[str, list[float]], layer: QuantLinear, x: torch.Tensor,
                   dy: torch.Tensor) -> None:
    """Append one layer's operand consistency and clipping to `stats`."""
    r = layer.linear_recipe
    if r is None:
        return
    x, dy = x.to(layer.weight.dtype), dy.to(layer.weight.dtype)
    ops = gemm_operands(x, layer.weight, dy, r)
    stats["w_fwd_bwd_rel_diff"].append(relative_difference(ops["fprop_w"], ops["dgrad_w"]))
    if not r.wgrad_hadamard:  # with RHT the wgrad operands live in a rotated basis
        stats["x_fwd_bwd_rel_diff"].append(relative_difference(ops["fprop_x"], ops["wgrad_x"]))
        stats["dy_dgrad_wgrad_rel_diff"].append(relative_difference(ops["dgrad_dy"], ops["wgrad_dy"]))
    stats["clip_w"].append(_clipped(layer.weight, r.fprop_w))
    stats["clip_x"].append(_clipped(x, r.fprop_x))
    stats["clip_dy"].append(_clipped(dy, r.dgrad_dy))


def training_diagnostics(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """All three diagnostics on one batch; keys `diag/...`. Leaves the parameters' .grad as
    they were. Quantized experts contribute to the dW comparison only."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    quantized_params = {f"{n}.{p}": t for n, m in model.named_modules()
                        if isinstance(m, (QuantLinear, QuantExperts))
                        for p, t in m.named_parameters(recurse=False) if p != "bias"}
    if not quantized_params:
        return {}
    saved_grads = {n: p.grad for n, p in model.named_parameters()}
    devices = [idx.device.index or 0] if idx.device.type == "cuda" else []
    try:
        stats: dict[str, list[float]] = {k: [] for k in (
            "w_fwd_bwd_rel_diff", "x_fwd_bwd_rel_diff", "dy_dgrad_wgrad_rel_diff", "clip_w",
            "clip_x", "clip_dy")}
        with torch.random.fork_rng(devices=devices):
            quant = _forward_backward(model, idx, targets, layers, on_operands=lambda name, x, dy:
                                      _operand_stats(stats, layers[name], x, dy))
            quant_dw = {n: p.grad.detach().clone() for n, p in quantized_params.items() if p.grad is not None}
            with quantization_disabled(model):
                ref = _forward_backward(model, idx, targets, layers)
            ref_dw = {n: p.grad.detach().clone() for n, p in quantized_params.items() if p.grad is not None}
    finally:
        for n, p in model.named_parameters():
            p.grad = saved_grads[n]

    for name in layers:
        if name in quant and name in ref:
            stats.setdefault("dx_cos", []).append(cosine(ref[name], quant[name]))
            stats.setdefault("dx_rel_err", []).append(relative_difference(ref[name], quant[name]))
    for name in quant_dw:
        if name in ref_dw:
            stats.setdefault("dw_cos", []).append(cosine(ref_dw[name], quant_dw[name]))
            stats.setdefault("dw_rel_err", []).append(relative_difference(ref_dw[name], quant_dw[name]))

    out = {}
    for key, values in stats.items():
        if not values:
            continue
        out[f"diag/{key}"] = sum(values) / len(values)
        if key.endswith("_cos"):
            out[f"diag/{key}_min"] = min(values)
        elif key.endswith("_rel_err") or key.endswith("_diff"):
            out[f"diag/{key}_max"] = max(values)
    return {k: v for k, v in out.items() if not math.isnan(v)}
