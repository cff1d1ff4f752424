"""GRPO's math, in TRL's vocabulary: advantages, teacher-forced log-probs, the clipped policy
loss, importance-sampling correction for the engine/trainer mismatch, and its metrics.

Layout. A batch holds B = prompts * num_generations rows, each prompt's generations adjacent.
The trainer's input is right-padded: row b is its prompt (p_b tokens), its completion, then
padding, so every row starts at position 0; completion token j of row b is predicted by the
logits at position p_b + j - 1. Per-token tensors are (B, Tc), Tc the longest completion, with
`mask` (B, Tc) True on real completion tokens.

    advantages = group_advantages(rewards, num_generations, scale_rewards)        # (B,)
    positions = completion_positions(prompt_lengths, Tc, T)                       # (B, Tc)
    logits = model(input_ids, logits_at=positions).logits                        # (B, Tc, V)
    logp, entropy = completion_logprobs(logits, completions, temperature)         # (B, Tc)
    w, is_metrics = importance_weights(logp_old, logp_rollout, mask, "token", "truncate", 3.0)
    loss, metrics = policy_loss(logp, logp_old, advantages, mask, config, is_weights=w)

Loss types (TRL's GRPOTrainer): per-token loss -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)
(+ beta * k3 KL to a reference), r = exp(logp - logp_old), reduced as
- "grpo": mean over each sequence's tokens, then over sequences (the GRPO paper);
- "dr_grpo": sum over all tokens / (B * max_completion_length) (Dr. GRPO, no length bias);
- "dapo": sum over all tokens / number of tokens in the batch (DAPO's token-level mean).

Metrics are 0-d tensors left on the device: a step of micro-batches reads them back once, after
the last (lowbit.rl.trainer.reduce_metrics), since on a GPU every read, and every boolean-mask
index (its length is a count on the device), waits for the launch queue to drain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowbit import dispatch

__all__ = ["LossConfig", "group_advantages", "completion_positions", "completion_logprobs",
           "importance_weights", "policy_loss", "mismatch_metrics", "LOSS_TYPES", "SCALE_REWARDS",
           "IS_LEVELS", "IS_MODES"]

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
IS_LEVELS = ("none", "token", "sequence")
IS_MODES = ("truncate", "mask")


@dataclass(frozen=True)
class LossConfig:
    loss_type: str = "dapo"
    epsilon: float = 0.2
    """Lower clip: the ratio is kept >= 1 - epsilon where the advantage is negative."""
    epsilon_high: float = 0.28
    """Upper clip (DAPO's clip-higher): the ratio is kept <= 1 + epsilon_high where A > 0."""
    beta: float = 0.0
    """Weight of the k3 KL to the reference policy; 0: no reference model."""
    max_completion_length: int = 64
    """dr_grpo's normalizer."""

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; use one of {', '.join(LOSS_TYPES)}")
        if not (self.epsilon > 0 and self.epsilon_high > 0):
            raise ValueError("epsilon and epsilon_high must be > 0 (e.g. 0.2 and 0.28)")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0 (got {self.beta}); 0 turns the KL term off")


def group_advantages(rewards: torch.Tensor, num_generations: int,
                     scale_rewards: str = "group") -> torch.Tensor:
    """rewards (B,) -> advantages (B,): reward minus its group's mean, divided by the group's
    std ("group"), the whole batch's ("batch"), or not ("none"); std is the unbiased one
    (torch.std), + 1e-4 as in TRL."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; use one of {', '.join(SCALE_REWARDS)}")
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards is not a multiple of num_generations={num_generations}")
    grouped = rewards.float().view(-1, num_generations)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    if scale_rewards == "group":
        std = grouped.std(dim=1, keepdim=True).expand_as(grouped).reshape(-1) if num_generations > 1 \
            else torch.zeros_like(advantages)
        advantages = advantages / (std + 1e-4)
    elif scale_rewards == "batch":
        std = rewards.float().std() if rewards.numel() > 1 else rewards.new_zeros(())
        advantages = advantages / (std + 1e-4)
    return advantages


def completion_positions(prompt_lengths: torch.Tensor, completion_width: int, seq_len: int) -> torch.Tensor:
    """(B, Tc) int64: the input position whose logits predict each completion token, p_b + j - 1
    for token j of row b (clamped to the input's seq_len: past a row's end it is padding, which
    the loss masks). The model computes logits there only (lowbit.models.Transformer's
    `logits_at`): a prompt's own positions need none."""
    positions = prompt_lengths[:, None].long() - 1 + torch.arange(completion_width, device=prompt_lengths.device)
    return positions.clamp(max=seq_len - 1)


def completion_logprobs(logits: torch.Tensor, completions: torch.Tensor,
                        temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, Tc, V) that predict the completions (the model's at completion_positions),
    completions (B, Tc) -> (log-probs (B, Tc) float32 of the completion tokens, entropies
    (B, Tc) of those positions' distributions), both of softmax(logits / temperature), on
    lowbit.dispatch.token_logprobs (a GPU's kernels read each row once)."""
    B, Tc = completions.shape
    if logits.shape[:2] != (B, Tc):
        raise ValueError(f"completion_logprobs takes the logits at the completions' positions, "
                         f"{(B, Tc)} (completion_positions); got {tuple(logits.shape)}")
    logp, entropy = dispatch.token_logprobs(logits.reshape(B * Tc, -1), completions.reshape(-1), temperature)
    return logp.view(B, Tc), entropy.view(B, Tc)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def _masked_min_max(x: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's min and max over the positions of the boolean m, exactly (NaN if one is NaN), as
    device scalars; inf and -inf where m holds none."""
    if x.numel() == 0:
        return x.new_full((), math.inf), x.new_full((), -math.inf)
    return torch.where(m, x, math.inf).amin(), torch.where(m, x, -math.inf).amax()


def importance_weights(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                       level: str = "token", mode: str = "truncate",
                       cap: float = 3.0) -> tuple[torch.Tensor | None, dict]:
    """Truncated importance sampling for generating with one policy (the engine's numerics)
    and training another (the trainer's): w = pi_train_old / pi_rollout per token ("token") or
    per sequence (the product over its tokens, "sequence"), then capped at `cap` ("truncate",
    TIS) or zeroed above it ("mask"), as TRL's vllm_importance_sampling_* and verl's
    rollout_is. Returns (weights (B, Tc) or None for level "none", metrics; a ratio min and max
    of 1 where mask holds no tokens)."""
    if level not in IS_LEVELS or mode not in IS_MODES:
        raise ValueError(f"importance sampling: level in {IS_LEVELS}, mode in {IS_MODES}")
    if not cap > 0:
        raise ValueError(f"the importance-sampling cap must be > 0 (got {cap})")
    log_ratio = (logp_old - logp_rollout).detach() * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(mask)
    ratio = torch.exp(log_ratio.clamp(max=80.0))
    m = mask.bool()
    (low, high), some = _masked_min_max(ratio, m), m.any()
    metrics = {"sampling/importance_sampling_ratio/min": torch.where(some, low, 1.0),
               "sampling/importance_sampling_ratio/mean": _masked_mean(ratio, mask),
               "sampling/importance_sampling_ratio/max": torch.where(some, high, 1.0),
               "sampling/importance_sampling_ratio/capped_frac": _masked_mean((ratio > cap).float(), mask)}
    if level == "none":
        return None, metrics
    weights = ratio.clamp(max=cap) if mode == "truncate" else ratio.masked_fill(ratio > cap, 0.0)
    return weights * mask, metrics


def mismatch_metrics(logp_rollout: torch.Tensor, logp_train: torch.Tensor,
                     mask: torch.Tensor) -> dict:
    """How far the engine's log-probs are from the trainer's on the sampled tokens: mean and
    max |log pi_rollout - log pi_train| (TRL's sampling_logp_difference), and the k3
    estimate of KL(pi_rollout || pi_train), exp(d) - d - 1 with d = log pi_train - log pi_rollout,
    averaged over tokens (an unbiased, non-negative estimator under rollout samples). Each is
    NaN where mask holds no tokens (nothing measured, as the mean of nothing is)."""
    m = mask.bool()
    d = (logp_train - logp_rollout).detach()
    k3 = torch.expm1(d.clamp(max=80.0)) - d   # expm1: no cancellation for small d
    gap, tokens = d.abs(), m.sum()
    gap_max = torch.where(tokens > 0, _masked_min_max(gap, m)[1], math.nan)
    return {"sampling/sampling_logp_difference/mean": torch.where(m, gap, 0.0).sum() / tokens,
            "sampling/sampling_logp_difference/max": gap_max,
            "sampling/kl_k3": torch.where(m, k3, 0.0).sum() / tokens}


def policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, config: LossConfig, *, ref_logp: torch.Tensor | None = None,
                is_weights: torch.Tensor | None = None,
                tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The GRPO loss (module doc) and its metrics: kl (if beta > 0), clip_ratio/low_mean,
    clip_ratio/high_mean, clip_ratio/region_mean (TRL's names). tokens: what dapo's token mean
    divides by (default: this batch's loss tokens); a micro-batch of a step passes the step's
    count over its number of micro-batches, so that their mean loss is the step's."""
    maskf = mask.float()
    ratio = torch.exp(logp - logp_old.detach())
    a = advantages[:, None]
    clipped = torch.clamp(ratio, 1 - config.epsilon, 1 + config.epsilon_high)
    per_token = -torch.min(ratio * a, clipped * a)
    metrics: dict = {}
    if config.beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs the reference policy's log-probs (ref_logp)")
        d = ref_logp.detach() - logp
        kl = torch.expm1(d) - d
        per_token = per_token + config.beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), maskf)
    if is_weights is not None:
        per_token = per_token * is_weights
    if config.loss_type == "grpo":
        loss = ((per_token * maskf).sum(1) / maskf.sum(1).clamp(min=1)).mean()
    elif config.loss_type == "dr_grpo":
        loss = (per_token * maskf).sum() / (maskf.shape[0] * config.max_completion_length)
    else:
        loss = (per_token * maskf).sum() / (maskf.sum().clamp(min=1) if tokens is None else tokens)
    with torch.no_grad():
        low = ((ratio < 1 - config.epsilon) & (a < 0)).float()
        high = ((ratio > 1 + config.epsilon_high) & (a > 0)).float()
        metrics["clip_ratio/low_mean"] = _masked_mean(low, maskf)
        metrics["clip_ratio/high_mean"] = _masked_mean(high, maskf)
        metrics["clip_ratio/region_mean"] = _masked_mean(torch.maximum(low, high), maskf)
    return loss, metrics
