"""Mixture-of-experts MLP with Hugging Face Qwen3-MoE's layout (transformers 5.x).

A layer's `mlp` is a `SparseMoeBlock` holding
- `gate`: a `TopKRouter` with `weight` (E, C); softmax over all experts, keep the top k,
  renormalize the k weights to sum to 1 (Qwen3-MoE's norm_topk_prob=True, Mixtral);
- `experts`: an `Experts` module with two fused 3D parameters,
  `gate_up_proj` (E, 2F, C) (gate rows first, then up rows) and `down_proj` (E, C, F),
  and `forward(hidden_states, top_k_index, top_k_weights)`, the signature and semantics of
  `transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts.forward`.
So `state_dict()` keys and shapes are Hugging Face's: one converter serves both models, and
Hugging Face expert weights load into `Experts` unchanged.

Quantized experts (lowbit.nn.QuantExperts) subclass `Experts` and override only
`_expert_linear`, the one place an expert's weight meets its input; routing, the
gather/scatter of tokens and the weighting stay here, written once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TopKRouter(nn.Module):
    """Linear router: logits = x W^T, probabilities = softmax in fp32, top-k, renormalized
    (unless norm_topk=False)."""

    def __init__(self, num_experts: int, hidden_dim: int, top_k: int, norm_topk: bool = True):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.top_k = top_k
        self.norm_topk = norm_topk
        # A Parameter rather than an nn.Linear, as in Hugging Face: module swaps that quantize
        # every nn.Linear leave the router alone, and routing decisions stay in high precision.
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_dim))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden_states (N, C) -> router_logits (N, E), top_k_weights (N, k), top_k_index (N, k)."""
        router_logits = F.linear(hidden_states, self.weight)  # (N, E)
        # Softmax in fp32: under bf16 the probabilities of near-tied experts round to equal
        # values and top-k picks among them arbitrarily.
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)  # (N, E)
        top_k_weights, top_k_index = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        if self.norm_topk:
            top_k_weights = top_k_weights / top_k_weights.sum(dim=-1, keepdim=True)
        return router_logits, top_k_weights.to(router_logits.dtype), top_k_index


class Experts(nn.Module):
    """E SwiGLU experts stored as 3D tensors; each token's output is the weighted sum of its
    top-k experts' outputs."""

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_dim, hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, intermediate_dim))

    def _expert_linear(self, x: torch.Tensor, weight: torch.Tensor, expert_idx: int) -> torch.Tensor:
        """One expert's GEMM: x (n, in) @ weight[expert_idx]^T -> (n, out).

        weight is the whole 3D parameter, gate_up_proj (E, 2F, C) or down_proj (E, C, F), so an
        override can quantize per expert (or once for all experts) and still return gradients
        to the shared parameter. This is the only method a quantized subclass must replace.
        """
        return F.linear(x, weight[expert_idx])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states (N, C), top_k_index (N, k) int, top_k_weights (N, k) -> (N, C).

        As in Hugging Face, an index equal to num_experts marks a dropped slot (expert
        parallelism) and contributes nothing.
        """
        N, k = top_k_index.shape
        out = torch.zeros_like(hidden_states)  # (N, C)
        flat_index = top_k_index.reshape(-1)  # (N*k,) expert of each routed slot
        # Group the slots by expert with one stable sort, then walk the groups: one host sync
        # (the counts) instead of one nonzero() per expert.
        order = torch.argsort(flat_index, stable=True)  # (N*k,)
        token_of_slot = order // k  # (N*k,) which token each sorted slot belongs to
        weight_of_slot = top_k_weights.reshape(-1)[order]  # (N*k,)
        counts = torch.bincount(flat_index, minlength=self.num_experts + 1)[: self.num_experts].tolist()
        start = 0
        for expert_idx, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of_slot[start:start + count]  # (n,)
            x = hidden_states[tokens]  # (n, C)
            gate, up = self._expert_linear(x, self.gate_up_proj, expert_idx).chunk(2, dim=-1)  # (n, F) each
            y = self._expert_linear(F.silu(gate) * up, self.down_proj, expert_idx)  # (n, C)
            y = y * weight_of_slot[start:start + count, None]
            # A token reaches each expert at most once (top-k indices are distinct), so the
            # index_add_ writes never collide within one expert.
            out.index_add_(0, tokens, y.to(out.dtype))
            start += count
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}")


def load_balancing_loss(router_logits: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, E * sum_e f_e * P_e (arXiv 2101.03961, eq. 4-6).

    router_logits (N, E); top_k_index (N, k). f_e is the fraction of the N*k routed slots that
    went to expert e (no gradient), P_e the mean router probability of expert e. It is 1 when
    routing is uniform and E when every token goes to one expert. Hugging Face's
    `load_balancing_loss_func` divides the slot counts by N instead of N*k, so for one layer
    it equals k times this; lowbit's form keeps the coefficient's meaning independent of k.
    """
    E = router_logits.shape[-1]
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)  # (N, E)
    slots = F.one_hot(top_k_index.reshape(-1), num_classes=E).float()  # (N*k, E)
    tokens_per_expert = slots.mean(dim=0)  # (E,) f_e, sums to 1
    prob_per_expert = probs.mean(dim=0)  # (E,) P_e, sums to 1
    return E * torch.sum(tokens_per_expert * prob_per_expert)


class SparseMoeBlock(nn.Module):
    """Route each token to its top-k experts; returns the output and the load-balancing loss."""

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, top_k: int,
                 norm_topk: bool = True):
        super().__init__()
        self.gate = TopKRouter(num_experts, hidden_dim, top_k, norm_topk)
        self.experts = Experts(num_experts, hidden_dim, intermediate_dim)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states (B, T, C) -> output (B, T, C), aux_loss (scalar)."""
        B, T, C = hidden_states.shape
        x = hidden_states.reshape(B * T, C)  # (N, C)
        router_logits, top_k_weights, top_k_index = self.gate(x)  # (N, E), (N, k), (N, k)
        out = self.experts(x, top_k_index, top_k_weights)  # (N, C)
        return out.view(B, T, C), load_balancing_loss(router_logits, top_k_index)
