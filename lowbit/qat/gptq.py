"""Post-training baselines on QAT's quantizers: round-to-nearest and GPTQ.

RTN is a prepared model evaluated as it is: every weight rounded to the nearest grid point
under the scales `prepare` derived from it. GPTQ (Frantar et al. 2022) rounds each weight
matrix one input column at a time and moves the error of each column onto the columns not yet
rounded, through the inverse of the layer's input Hessian H = 2 XᵀX / n, so that the layer's
output on calibration inputs changes least. lowbit's version:
- the group scales are those of `prepare` (fixed up front, "static groups"), so the result is
  a point of the same grid a QAT run starts from and `convert` packs it as is;
- every H comes from one pass of the calibration batches through the model in high precision
  (the original paper feeds each layer the outputs of the already quantized ones);
- dampening 1% of H's mean diagonal, lazy updates in blocks of 128 columns; columns that never
  see an input are zeroed.
It covers the grid formats (intK, ternary, binary, seq2) of linear layers; experts weights and
nvfp4/mxfp4 (whose scales follow the weights) keep RTN.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from lowbit.formats.quantize import grid_values
from lowbit.qat.layers import fake_quantizers

__all__ = ["gptq"]


@torch.no_grad()
def gptq(model: nn.Module, batches: Iterable, device: torch.device, damp: float = 0.01,
         block: int = 128) -> int:
    """Apply GPTQ to a prepared model in place (its original weights become GPTQ's grid
    points); `batches` yields (inputs, targets) calibration batches. Returns how many
    weights it rounded (the rest stay RTN)."""
    targets = [(name, module, fq) for name, module, pname, fq in fake_quantizers(model)
               if isinstance(module, nn.Linear) and pname == "weight"
               and not fq.quantizer.fmt.data_scaled]
    if not targets:
        return 0
    hessians = {name: torch.zeros(m.in_features, m.in_features, device=device) for name, m, _ in targets}
    counts = dict.fromkeys(hessians, 0)
    hooks = []
    for name, module, _ in targets:
        def hook(mod, args, name=name):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            hessians[name] += x.T @ x
            counts[name] += x.shape[0]
        hooks.append(module.register_forward_pre_hook(hook))
    was_training = model.training
    model.eval()
    try:
        with _weights_in_high_precision(targets):
            for inputs, targets_ in batches:
                model(inputs.to(device), targets_.to(device))
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    for name, module, fq in targets:
        h = 2 * hessians[name] / max(counts[name], 1)
        original = module.parametrizations.weight.original
        original.copy_(_gptq_matrix(original.float(), h, fq, damp, block).to(original.dtype))
    return len(targets)


class _weights_in_high_precision:
    """Run the prepared linear layers on their original weights (the calibration pass)."""

    def __init__(self, targets) -> None:
        self.targets = targets

    def __enter__(self):
        self.hooks = []
        for _, module, _ in self.targets:
            self.hooks.append(module.register_forward_hook(_original_output))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()


def _original_output(module: nn.Linear, args, output):
    return nn.functional.linear(args[0], module.parametrizations.weight.original.to(args[0].dtype),
                                module.bias)


def _gptq_matrix(w: torch.Tensor, h: torch.Tensor, fq, damp: float, block: int) -> torch.Tensor:
    quantizer = fq.quantizer
    w = w.clone()
    n_in = w.shape[1]
    dead = torch.diag(h) == 0
    h = h.clone()
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(n_in, device=h.device)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    scales = torch.clamp(fq.scales.detach().float(), min=2.0 ** -120)
    zeros = fq.zeros
    group = quantizer.group
    q_out = torch.zeros_like(w)
    for i1 in range(0, n_in, block):
        i2 = min(i1 + block, n_in)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = col // group
            s = scales[:, g]
            z = None if zeros is None else zeros[:, g]
            v, _ = grid_values(w1[:, i, None], s[:, None], None if z is None else z[:, None],
                               quantizer.element, 1)
            q = v[:, 0] * s
            q_out[:, col] = q
            err = (w1[:, i] - q) / hinv1[i, i]
            w1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return q_out
