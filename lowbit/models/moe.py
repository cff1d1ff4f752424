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

The experts' GEMMs run grouped: the routed (token, expert) slots are sorted by expert once
per layer, and each projection (gate|up, down) is one `torch._grouped_mm` over all experts
(cuBLAS's grouped GEMM on Hopper, what torchtitan trains experts with), with the group sizes
computed on the device, so a step needs no host read-back and can compile and be captured.
Where the grouped GEMM cannot run (a dtype or device it lacks, widths not a multiple of 16
bytes) or a subclass says so (`_can_group`), each expert runs its own GEMM in turn
(`_expert_linear`): the reference the grouped path is tested against. Quantized experts
(lowbit.nn.QuantExperts) subclass `Experts` and override `_expert_linear` (and `_can_group`),
the one place an expert's weight meets its input; routing, the gather/scatter of tokens and
the weighting stay here, written once.
"""

from __future__ import annotations

import contextlib

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

    def _can_group(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Every expert's GEMM may run as one grouped GEMM on these operands (see
        `grouped_mm_supported`); a subclass whose experts' GEMMs are not plain products says
        whether its own grouped path takes them."""
        return grouped_mm_supported(x, weight)

    def runs_grouped(self, device: torch.device, bf16_autocast: bool) -> bool:
        """A step on `device` (under bf16 autocast, or in the weights' dtype) runs both
        projections grouped, reading nothing back to the host, so it can be captured in a
        CUDA graph; otherwise its experts run one at a time (`_per_expert_linear`). The
        weights must be on `device`."""
        autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if bf16_autocast
                    else contextlib.nullcontext())
        with autocast:
            return all(self._can_group(torch.empty(0, w.shape[-1], dtype=w.dtype, device=device), w)
                       for w in (self.gate_up_proj, self.down_proj))

    def _experts_linear(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Every expert's GEMM on its rows: x (R, in) sorted by expert, counts (E,) rows each on
        the device (rows past their sum: dropped slots, left out) -> (R, out). One grouped GEMM,
        or each expert's own `_expert_linear` in turn."""
        if self._can_group(x, weight):
            x, weight = _autocast(x, weight)
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
            return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
        return self._per_expert_linear(x, weight, counts)

    def _per_expert_linear(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`_experts_linear` as the reference computes it: one host read-back of the counts,
        then `_expert_linear` for each expert that has rows."""
        pieces, start = [], 0
        for expert_idx, count in enumerate(counts.tolist()):
            if count:
                pieces.append(self._expert_linear(x[start:start + count], weight, expert_idx))
            start += count
        out = torch.cat(pieces) if pieces else x.new_zeros(0, weight.shape[1])
        if start < x.shape[0]:   # dropped slots
            out = torch.cat([out, out.new_zeros(x.shape[0] - start, out.shape[1])])
        return out

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states (N, C), top_k_index (N, k) int, top_k_weights (N, k) -> (N, C).

        As in Hugging Face, an index equal to num_experts marks a dropped slot (expert
        parallelism) and contributes nothing.
        """
        N, k = top_k_index.shape
        flat_index = top_k_index.reshape(-1)  # (N*k,) expert of each routed slot
        # the slots grouped by expert with one stable sort; the group sizes by a scatter-add on
        # the device (torch.bincount would read the maximum back to the host)
        order = torch.argsort(flat_index, stable=True)  # (N*k,)
        token_of_slot = order // k  # (N*k,) which token each sorted slot belongs to
        weight_of_slot = top_k_weights.reshape(-1)[order]  # (N*k,)
        counts = torch.zeros(self.num_experts + 1, dtype=torch.long, device=flat_index.device)
        counts = counts.scatter_add_(0, flat_index.long(), torch.ones_like(flat_index, dtype=torch.long))
        counts = counts[: self.num_experts]
        # dropped slots (sorted last, past every group) take no part, in either direction: a
        # grouped GEMM leaves their rows unwritten
        kept = (flat_index[order] < self.num_experts)[:, None]  # (N*k, 1)
        x = torch.where(kept, hidden_states[token_of_slot], 0.0)  # (N*k, C)
        gate, up = self._experts_linear(x, self.gate_up_proj, counts).chunk(2, dim=-1)  # (N*k, F)
        y = self._experts_linear(F.silu(gate) * up, self.down_proj, counts)  # (N*k, C)
        # masked before the routing weight multiplies it: a dropped row's value (unwritten by
        # a grouped GEMM, maybe NaN) must not reach that weight's gradient either
        y = torch.where(kept, y, 0.0) * weight_of_slot[:, None]
        out = torch.zeros_like(hidden_states)  # (N, C)
        # each token's k slots add in expert order (the sort's)
        return out.index_add_(0, token_of_slot, y.to(out.dtype))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}")


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._grouped_mm can multiply x (R, in) by every expert of weight (E, out, in), under
    autocast too: in bf16 (its only dtype under torch.compile, and on CUDA), on the CPU or on
    a Hopper or later GPU, with in and out a multiple of 16 bytes (its stride rule)."""
    if not hasattr(torch, "_grouped_mm") or x.device != weight.device:
        return False
    dtype = (torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type)
             else x.dtype)
    if weight.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
        return False
    if dtype != torch.bfloat16 or (x.device.type != "cpu" and not (x.is_cuda and _hopper_or_later(x.device.index))):
        return False
    return weight.shape[-1] % 8 == 0 and weight.shape[-2] % 8 == 0       # 16 bytes of bf16


@torch.compiler.assume_constant_result
def _hopper_or_later(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def _autocast(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x and weight in the autocast dtype where autocast is on (torch._grouped_mm is not on
    its cast lists; F.linear is)."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        return x.to(dtype), weight.to(dtype)
    return x, weight


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
