"""Activation amax per quantized module, for W4A4 (NVFP4 activations with static global
scales, ModelOpt's quant_algo "NVFP4"): run calibration batches, record max |input| of every
linear, and of every expert's gate/up input (its routed tokens) and down input."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from lowbit.models.moe import Experts

__all__ = ["calibrate_input_amax"]


@torch.no_grad()
def calibrate_input_amax(model, batches: Iterable[torch.Tensor]) -> dict[str, float]:
    """Module name (Hugging Face's, per expert for MoE) -> the largest |input| seen over
    `batches` of token ids (B, T). The model runs in eval mode; nothing in it changes."""
    amax: dict[str, float] = {}

    def note(name: str, x: torch.Tensor) -> None:
        if x.numel():
            amax[name] = max(amax.get(name, 0.0), x.detach().abs().amax().float().item())

    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            hooks.append(module.register_forward_pre_hook(
                lambda m, args, name=name: note(name, args[0])))
        elif isinstance(module, Experts):
            hooks.append(module.register_forward_pre_hook(
                lambda m, args, name=name: _note_experts(m, name, *args, note=note)))
    was_training = model.training
    model.eval()
    try:
        for idx in batches:
            model(idx.to(next(model.parameters()).device))
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    return amax


def _note_experts(experts: Experts, name: str, hidden_states, top_k_index, top_k_weights, note):
    for e in range(experts.num_experts):
        tokens = (top_k_index == e).any(dim=-1)
        x = hidden_states[tokens]                                   # (n, C)
        note(f"{name}.{e}.gate_proj", x)
        note(f"{name}.{e}.up_proj", x)
        if x.shape[0]:
            gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
            note(f"{name}.{e}.down_proj", F.silu(gate) * up)
