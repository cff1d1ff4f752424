"""A chosen token's log-probability and each row's entropy over logits (N, V), on the Triton
kernels (lowbit.kernels.logprobs: one read of a row forward, one read and one write backward,
no float32 copy) or the reference (lowbit.formats.logprobs: torch's log-softmax in row chunks),
by this package's rule: CUDA logits take the kernels when triton imports and the reference is
not forced; CPU logits the reference. Both agree to float32 rounding, not bit for bit."""

from __future__ import annotations

import torch

from lowbit import kernels
from lowbit.dispatch._quantizers import reference_forced
from lowbit.formats.logprobs import token_logprobs as reference_token_logprobs

__all__ = ["token_logprobs", "logprob_kernels_for"]


def logprob_kernels_for(logits: torch.Tensor) -> bool:
    """The rule (see the module doc); a test hands CPU logits to the kernels, under Triton's
    interpreter, by patching this."""
    return logits.is_cuda and not reference_forced() and kernels.kernels_available(logits)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature):
        from lowbit.kernels.logprobs import token_logprobs_triton   # triton loads on first use
        logp, entropy, stats = token_logprobs_triton(logits, targets, temperature)
        ctx.save_for_backward(logits, targets, stats, entropy)
        ctx.temperature = temperature
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        from lowbit.kernels.logprobs import token_logprobs_backward_triton
        logits, targets, stats, entropy = ctx.saved_tensors
        zeros = torch.zeros_like(entropy)
        dx = token_logprobs_backward_triton(logits, targets, stats, entropy, ctx.temperature,
                                            zeros if g_logp is None else g_logp,
                                            zeros if g_entropy is None else g_entropy)
        return dx, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                   temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy), each (N,) float32, of softmax(logits / temperature) for logits (N, V)
    and targets (N,) int64 (lowbit.formats.logprobs.token_logprobs), differentiable."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"token_logprobs takes logits (N, V) and targets (N,); got {tuple(logits.shape)} "
                         f"and {tuple(targets.shape)}")
    if not logprob_kernels_for(logits):
        return reference_token_logprobs(logits, targets, temperature)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _TokenLogprobs.apply(logits, targets.long(), float(temperature))
