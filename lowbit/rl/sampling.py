"""Sampling the next token: temperature, top-k, top-p, and the log-probability of the sample.

The log-probability the engine reports for a sampled token is log softmax(logits / T) at
that token -- the tempered distribution before top-k / top-p truncation, which is exactly
what the trainer recomputes by teacher forcing (TRL's GRPO divides its logits by the same
temperature), so engine and trainer log-probs are comparable token for token. With top-k or
top-p on, tokens are drawn from the truncated, renormalized distribution.

Draws use the Gumbel-max trick on noise from a seeded torch.Generator: argmax(log p - log E),
E ~ Exp(1), which samples exactly from p and needs no host synchronization.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["SamplingParams", "sample_next", "truncated_logprobs"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """Divides the logits; 0 is greedy decoding (argmax; log-probs then of the untempered logits)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (after
    top-k, of the top-k tokens' renormalized probabilities); 1: off."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0: off."""
    max_new_tokens: int = 64
    """Tokens sampled per prompt at most."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """A completion ends after sampling one of these (the stop token is part of it)."""
    seed: int = 0
    """Seeds the draws: the same prompts, weights and seed give the same completions."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0 (got {self.temperature}); 0 is greedy")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p}); 1 turns it off")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (got {self.top_k!r}); 0 turns it off")
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be a positive integer (got {self.max_new_tokens!r})")


def sample_next(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) -> (tokens (B,) int64, log-probs (B,) float32 of those tokens)."""
    logits = logits.float()
    if params.temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]
    logprobs = torch.log_softmax(logits / params.temperature, dim=-1)   # (B, V)
    keep = truncated_logprobs(logprobs, params)
    noise = torch.rand(keep.shape, generator=generator, device=keep.device,
                       dtype=torch.float32).clamp_(min=1e-20)
    tokens = (keep - torch.log(-torch.log(noise))).argmax(dim=-1)        # Gumbel-max
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def truncated_logprobs(logprobs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The tokens draws may take, as log-weights: top-k, then top-p on the top-k tokens'
    renormalized probabilities (the order and renormalization of transformers' warpers and
    vLLM's sampler); dropped tokens at -inf. The kept values are not renormalized after top-p
    (Gumbel-max draws do not need it), so they are log-probabilities only up to a constant
    per row. logprobs (B, V) are log softmax(logits / T)."""
    keep = logprobs
    if params.top_k and params.top_k < logprobs.shape[-1]:
        kth = torch.topk(keep, params.top_k, dim=-1).values[:, -1:]       # (B, 1)
        keep = keep.masked_fill(keep < kth, -math.inf)
        keep = keep - torch.logsumexp(keep, dim=-1, keepdim=True)        # renormalized over the k
    if params.top_p < 1.0:
        sorted_lp, order = torch.sort(keep, dim=-1, descending=True)
        cumulative = sorted_lp.exp().cumsum(dim=-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop_sorted = (cumulative - sorted_lp.exp()) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        keep = keep.masked_fill(drop, -math.inf)
    return keep
