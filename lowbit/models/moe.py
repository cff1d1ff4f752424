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
per layer into a layout of rows (`ExpertRows`: each expert's rows together, a quantized
subclass's groups padded to its blocks' length along the tokens), the tokens gathered into it
once, both projections computed in it, and the outputs gathered back once (`gather_rows`,
whose gradients are gathers as well: no row moves by an atomic scatter-add). Each projection (gate|up, down)
is one `torch._grouped_mm` over all experts (cuBLAS's grouped GEMM on Hopper, what torchtitan
trains experts with), with the group sizes computed on the device, so a step needs no host
read-back and can compile and be captured.
Where the grouped GEMM cannot run (a dtype or device it lacks, widths not a multiple of 16
bytes) or a subclass says so (`_can_group`), each expert runs its own GEMM in turn
(`_expert_linear`): the reference the grouped path is tested against. Quantized experts
(lowbit.nn.QuantExperts) subclass `Experts` and override `_expert_linear` (and `_can_group`,
`_row_tile`, `_grouped_linear`), the places an expert's weight meets its input; routing, the
layout, the gathers of tokens and the weighting stay here, written once.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

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


class ExpertRows(NamedTuple):
    """Where each routed slot's row lies in the experts' grouped layout: expert e's rows from
    ends[e - 1] to ends[e], each group starting at a multiple of a row tile (the gaps between
    groups, and the rows past the last, hold no slot). A slot is one (token, choice) pair,
    numbered token * k + choice."""

    source: torch.Tensor
    """(P,) int64: the slot each row holds, -1 where it holds none."""
    slot_row: torch.Tensor
    """(N*k,) int64: each slot's row, -1 for a dropped slot (expert index == E)."""
    ends: torch.Tensor
    """(E,) int32: each expert's group's end row (a multiple of the tile)."""
    counts: torch.Tensor
    """(E,) int64: the slots each expert takes."""

    @property
    def filled(self) -> torch.Tensor:
        """(P,) bool: the rows that hold a slot."""
        return self.source >= 0

    @staticmethod
    def route(top_k_index: torch.Tensor, num_experts: int, tile: int = 1) -> ExpertRows:
        """The layout of top_k_index's (N, k) slots, computed on the device with no host
        read-back (its size depends on the shapes only): one stable sort by expert, so an
        expert's slots keep the tokens' order. tile 1: P = N*k rows, the groups back to back;
        a larger tile: P = N*k + E * (tile - 1), rounded up to a multiple of 16 (16-byte
        strides for FP8 operands with the tokens along K)."""
        flat = top_k_index.reshape(-1)                                   # (R,) expert of each slot
        R, E = flat.shape[0], num_experts
        order = torch.argsort(flat, stable=True)                         # slots sorted by expert
        counts = torch.zeros(E + 1, dtype=torch.long, device=flat.device)
        # the group sizes by a scatter-add on the device (torch.bincount reads its maximum back)
        counts = counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.long))[:E]
        padded = (counts + tile - 1) // tile * tile
        ends, padded_ends = torch.cumsum(counts, 0), torch.cumsum(padded, 0)
        size = R if tile == 1 else (R + E * (tile - 1) + 15) // 16 * 16
        expert = flat[order].long()                                      # (R,) E for dropped
        kept = expert < E
        e = expert.clamp(max=E - 1)
        i = torch.arange(R, device=flat.device)
        row = torch.where(kept, (padded_ends - padded)[e] + i - (ends - counts)[e], size)
        # dropped slots all land on row `size`, one past the layout, cut off
        source = torch.full((size + 1,), -1, dtype=torch.long, device=flat.device)
        source = source.scatter_(0, row, torch.where(kept, order, -1))[:size]
        slot_row = torch.empty_like(order).scatter_(0, order, torch.where(kept, row, -1))
        return ExpertRows(source, slot_row, padded_ends.to(torch.int32), counts)


def gather_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, copies: int = 1) -> torch.Tensor:
    """Rows of x repeated `copies` times each (row j as rows j * copies ... j * copies +
    copies - 1), gathered by index: out[i] = that repetition's row index[i], a zero row where
    index[i] < 0. The index takes each repeated row at most once; `inverse` (the repeated
    rows' length) is its inverse: where each went, -1 where nowhere. The gradient is a gather
    too (by `inverse`, then each row's copies summed), not a scatter-add: no atomics, and a
    copy that went nowhere adds nothing."""
    return _GatherRows.apply(x, index, inverse, copies)


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.where((index >= 0)[:, None], x[index.clamp(min=0)], 0)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, inverse, copies):
        ctx.save_for_backward(inverse)
        ctx.copies = copies
        return _take(x, index if copies == 1 else index.div(copies, rounding_mode="floor"))  # -1 stays -1

    @staticmethod
    def backward(ctx, grad):
        inverse, = ctx.saved_tensors
        dx = _take(grad, inverse)
        if ctx.copies > 1:
            dx = dx.view(-1, ctx.copies, dx.shape[-1]).sum(dim=1)
        return dx, None, None, None


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
        to the shared parameter: the per-expert reference's one place an expert's weight
        meets its input (a quantized subclass replaces it, and the grouped path's
        `_grouped_linear`).
        """
        return F.linear(x, weight[expert_idx])

    def _can_group(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Every expert's GEMM may run as one grouped GEMM on these operands (see
        `grouped_mm_supported`); a subclass whose experts' GEMMs are not plain products says
        whether its own grouped path takes them."""
        return grouped_mm_supported(x, weight)

    def _groups(self, x: torch.Tensor) -> bool:
        """Both projections run grouped for input x (or like x: its device and dtype)."""
        return all(self._can_group(x, w) for w in (self.gate_up_proj, self.down_proj))

    def _row_tile(self) -> int:
        """Rows each expert's group of the grouped layout starts at a multiple of (1: no gaps); a
        quantized subclass pads each group to its blocks' length along the tokens."""
        return 1

    def runs_grouped(self, device: torch.device, bf16_autocast: bool) -> bool:
        """A step on `device` (under bf16 autocast, or in the weights' dtype) runs both
        projections grouped, reading nothing back to the host, so it can be captured in a
        CUDA graph; otherwise its experts run one at a time (`_per_expert_linear`). The
        weights must be on `device`."""
        autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if bf16_autocast
                    else contextlib.nullcontext())
        with autocast:
            return self._groups(torch.empty(0, self.hidden_dim, dtype=self.gate_up_proj.dtype, device=device))

    def _grouped_linear(self, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Every expert's GEMM in one grouped GEMM: x (P, in) in the grouped layout (expert e's
        rows from ends[e - 1] to ends[e], int32 on the device) -> (P, out); rows past ends[-1]
        are left unwritten."""
        x, weight = _autocast(x, weight)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=ends)

    def _per_expert_linear(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The reference: one host read-back of the counts, then `_expert_linear` for each
        expert that has rows, on x (R, in) sorted by expert, no gaps (rows past sum(counts):
        zeros out)."""
        pieces, start = [], 0
        for expert_idx, count in enumerate(counts.tolist()):
            if count:
                pieces.append(self._expert_linear(x[start:start + count], weight, expert_idx))
            start += count
        out = torch.cat(pieces) if pieces else x.new_zeros(0, weight.shape[1])
        if start < x.shape[0]:   # rows that hold no slot
            out = torch.cat([out, out.new_zeros(x.shape[0] - start, out.shape[1])])
        return out

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states (N, C), top_k_index (N, k) int, top_k_weights (N, k) -> (N, C).

        As in Hugging Face, an index equal to num_experts marks a dropped slot (expert
        parallelism) and contributes nothing.
        """
        N, k = top_k_index.shape
        grouped = self._groups(hidden_states)
        rows = ExpertRows.route(top_k_index, self.num_experts, self._row_tile() if grouped else 1)
        # each routed (token, choice) slot's input at its row of the layout, zeros in the rows
        # that hold no slot (gaps, dropped slots); cast to the autocast dtype first (the GEMMs
        # cast to it anyway): half the bytes moved, and compiled, cast and gather are one kernel
        x = gather_rows(_autocast(hidden_states), rows.source, rows.slot_row, copies=k)  # (P, C)
        if grouped:
            def project(t, weight):
                return self._grouped_linear(t, weight, rows.ends)
        else:
            def project(t, weight):
                return self._per_expert_linear(t, weight, rows.counts)
        # rows that hold no slot are zeroed: a grouped GEMM leaves rows past its groups
        # unwritten, and nothing they hold may reach the next projection's quantization, nor,
        # as 0 * NaN, the gradient of the first (a quantization spanning tokens, FP8's wgrad
        # folds, would carry a NaN row into every expert's dW)
        gate_up = torch.where(rows.filled[:, None], project(x, self.gate_up_proj), 0.0)
        gate, up = gate_up.chunk(2, dim=-1)                                             # (P, F)
        h = F.silu(gate) * up
        y = gather_rows(project(h, self.down_proj), rows.slot_row, rows.source)        # (N*k, C)
        # each token's k slots weighted (in the GEMMs' dtype) and summed in the hidden states'
        # dtype, in the order of its choices; a dropped slot's row is zero, so neither its
        # output nor its routing weight's gradient sees it
        return (y.view(N, k, -1) * top_k_weights[..., None]).to(hidden_states.dtype).sum(dim=1)

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


def _hopper_or_later(index: int | None) -> bool:
    # torch.compile folds get_device_properties to a constant (no graph break, no guard on a
    # tensor); torch.compiler.assume_constant_result would say the same but imports
    # torch._dynamo (~2 s) into every process that imports the models
    return torch.cuda.get_device_properties(index).major >= 9


def _autocast(*tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The tensors in the autocast dtype where autocast is on (torch._grouped_mm is not on
    its cast lists; F.linear is), as they are where it is off."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        tensors = tuple(t.to(dtype) for t in tensors)
    return tensors if len(tensors) > 1 else tensors[0]


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
