"""Training diagnostics for a converted model, on one batch:

(a) forward/backward operand consistency: ||W_fprop - W_dgrad|| / ||W_fprop|| (0 with 2D tiles),
    the same for X (fprop vs wgrad) and dY (dgrad vs wgrad);
(b) gradient bias: cosine similarity and relative error of the recipe's dX (each quantized
    layer's input gradient) and dW against the same model with quantization off, same batch;
(c) the fraction of W, X and dY values clipped by their quantizer, and the fraction of their
    nonzero values that the GEMM operand holds as zero (flushed: below half a grid step of
    their block under round-to-nearest; rounded down to 0 in this draw under stochastic
    rounding), for X and W in fprop, dY in dgrad and in wgrad.

Means over the quantized layers (keys `diag/<stat>`); with per_layer=True also every layer's
own value (`diag/layer/<module name>/<stat>`), to tell which layers and operands lose what.

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

__all__ = ["training_diagnostics", "per_layer_training_diagnostics", "quantized_weights",
           "relative_difference", "cosine", "flushed"]


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


def flushed(original: torch.Tensor, quantized: torch.Tensor) -> float:
    """The fraction of original's nonzero values that quantized holds as 0 (same shape)."""
    nonzero = original != 0
    n = int(nonzero.sum())
    return ((quantized == 0) & nonzero).sum().item() / n if n else 0.0


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
                   dy: torch.Tensor, name: str, per_layer: dict | None) -> None:
    """Append one layer's operand consistency, clipping and flushing to `stats` (and, if
    per_layer is a dict, put them in per_layer[name])."""
    r = layer.linear_recipe
    if r is None:
        return
    x, dy = x.to(layer.weight.dtype), dy.to(layer.weight.dtype)
    ops = gemm_operands(x, layer.weight, dy, r)
    own = {"w_fwd_bwd_rel_diff": relative_difference(ops["fprop_w"], ops["dgrad_w"])}
    if not r.wgrad_hadamard:  # with RHT the wgrad operands live in a rotated basis
        own["x_fwd_bwd_rel_diff"] = relative_difference(ops["fprop_x"], ops["wgrad_x"])
        own["dy_dgrad_wgrad_rel_diff"] = relative_difference(ops["dgrad_dy"], ops["wgrad_dy"])
    own["clip_w"] = _clipped(layer.weight, r.fprop_w)
    own["clip_x"] = _clipped(x, r.fprop_x)
    own["clip_dy"] = _clipped(dy, r.dgrad_dy)
    own["flush_x"] = flushed(x, ops["fprop_x"]) if r.fprop_x is not None else 0.0
    own["flush_w"] = flushed(layer.weight, ops["fprop_w"]) if r.fprop_w is not None else 0.0
    own["flush_dy"] = flushed(dy, ops["dgrad_dy"]) if r.dgrad_dy is not None else 0.0
    if not r.wgrad_hadamard:
        own["flush_dy_wgrad"] = flushed(dy, ops["wgrad_dy"]) if r.wgrad_dy is not None else 0.0
    for key, value in own.items():
        stats.setdefault(key, []).append(value)
    if per_layer is not None:
        per_layer.setdefault(name, {}).update(own)


def quantized_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every quantized layer's weight by parameter name (QuantLinear's and QuantExperts' own
    parameters, biases left out)."""
    return {f"{n}.{p}": t for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantExperts))
            for p, t in m.named_parameters(recurse=False) if p != "bias"}


def per_layer_training_diagnostics(model: nn.Module, batch, step: int) -> dict[str, float]:
    """training_diagnostics with per_layer=True, as a diagnostics_fn of lowbit.train.train."""
    return training_diagnostics(model, *batch, per_layer=True)


def training_diagnostics(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor,
                         per_layer: bool = False) -> dict[str, float]:
    """All three diagnostics on one batch; keys `diag/...` (see the module doc). Leaves the
    parameters' .grad as they were. Quantized experts contribute to the dW comparison only."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    quantized_params = quantized_weights(model)
    if not quantized_params:
        return {}
    saved_grads = {n: p.grad for n, p in model.named_parameters()}
    devices = [idx.device.index or 0] if idx.device.type == "cuda" else []
    try:
        stats: dict[str, list[float]] = {}
        layer_stats: dict[str, dict[str, float]] | None = {} if per_layer else None
        with torch.random.fork_rng(devices=devices):
            quant = _forward_backward(model, idx, targets, layers, on_operands=lambda name, x, dy:
                                      _operand_stats(stats, layers[name], x, dy, name, layer_stats))
            quant_dw = {n: p.grad.detach().clone() for n, p in quantized_params.items() if p.grad is not None}
            with quantization_disabled(model):
                ref = _forward_backward(model, idx, targets, layers)
            ref_dw = {n: p.grad.detach().clone() for n, p in quantized_params.items() if p.grad is not None}
    finally:
        for n, p in model.named_parameters():
            p.grad = saved_grads[n]

    def add(layer: str, key: str, value: float) -> None:
        stats.setdefault(key, []).append(value)
        if layer_stats is not None:
            layer_stats.setdefault(layer, {})[key] = value

    for name in layers:
        if name in quant and name in ref:
            add(name, "dx_cos", cosine(ref[name], quant[name]))
            add(name, "dx_rel_err", relative_difference(ref[name], quant[name]))
    for name in quant_dw:
        if name in ref_dw:
            layer = name.rsplit(".", 1)[0]   # "<module>.weight" -> the module's name
            add(layer, "dw_cos", cosine(ref_dw[name], quant_dw[name]))
            add(layer, "dw_rel_err", relative_difference(ref_dw[name], quant_dw[name]))

    out = {}
    for key, values in stats.items():
        if not values:
            continue
        out[f"diag/{key}"] = sum(values) / len(values)
        if key.endswith("_cos"):
            out[f"diag/{key}_min"] = min(values)
        elif key.endswith("_rel_err") or key.endswith("_diff"):
            out[f"diag/{key}_max"] = max(values)
    for layer, values in (layer_stats or {}).items():
        out.update({f"diag/layer/{layer}/{key}": value for key, value in values.items()})
    return {k: v for k, v in out.items() if not math.isnan(v)}
