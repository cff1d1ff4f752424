"""The log-probability of a chosen token and the entropy of each row of logits: the reference
(torch operations, autograd's backward), which lowbit.kernels.logprobs computes in one read of
each row.

    logp, entropy = token_logprobs(logits, targets, temperature)   # logits (N, V), targets (N,)

Both of softmax(logits / temperature) in float32: logp = log_softmax(z)[target], entropy =
-sum(exp(log_softmax(z)) log_softmax(z)). A float32 copy of a row of Qwen's 151,936 logits is
0.6 MB, and the log-softmax's form keeps several, so rows are taken CHUNK_BYTES at a time, each
chunk recomputed in the backward (activation checkpointing) when autograd records it: the
memory does not grow with the rows, and each row's values do not depend on the chunking.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["token_logprobs", "CHUNK_BYTES"]

CHUNK_BYTES = 1 << 30
"""token_logprobs works on rows whose float32 (rows, V) log-softmax fits in this many bytes at a
time: 128 completions of 128 tokens over Qwen's 151,936-entry vocabulary are 10 GB a float32
copy, of which the unchunked form held several."""


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy), each (N,) float32, of logits (N, V) (any float dtype) over targets (N,)
    int64 at `temperature`; chunk_rows rows at a time (default: as many as CHUNK_BYTES allows)."""
    n, v = logits.shape
    rows = chunk_rows or max(1, CHUNK_BYTES // max(1, 4 * v))
    if rows >= n:
        return _token_logprobs(logits, targets, temperature)
    parts = []
    for i in range(0, n, rows):
        args = (logits[i:i + rows], targets[i:i + rows], temperature)
        if torch.is_grad_enabled() and logits.requires_grad:
            parts.append(checkpoint(_token_logprobs, *args, use_reentrant=False))
        else:
            parts.append(_token_logprobs(*args))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _token_logprobs(logits, targets, temperature):
    logp_all = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)       # (n, V)
    logp = logp_all.gather(-1, targets[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
