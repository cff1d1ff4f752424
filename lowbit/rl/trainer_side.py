"""What the trainer's policy model changes for RL: asymmetric QAT and routing replay.

Asymmetric QAT (QUADS' trainer side). Every linear and expert weight the engine stores in
NVFP4 is fake-quantized in the trainer's forward with the engine's own spec
(lowbit.rl.precision.weight_spec: 1x16 blocks along in_features, FP32 tensor scale, each
expert on its own), while activations stay in high precision:

    Y = X . QDQ_nvfp4(W)^T        dX = dY . W        dW = dY^T . X   (straight-through)

It is a lowbit recipe (`asymmetric_qat_recipe()`: only fprop's weight operand quantized)
applied with lowbit.quantize_, so it runs the same QuantLinear / QuantExperts and GEMMs as every
other recipe; lm_head and the routers stay high precision, as in the engine. The trainer
therefore sees exactly the weights the engine runs (tests check the bits), and the remaining
engine/trainer mismatch is the activations' quantization, which RAC addresses. (dX uses the
master weight rather than the quantized one: the 1x16 blocks run along in_features, so the
dgrad GEMM, which reduces over out_features, cannot reuse the forward's copy; the difference
is one weight-quantization error in the input gradient, as in 1D-block QAT generally.)

Routing replay (verl's R3). `enable_routing_replay(model)` swaps each MoE router for a
`ReplayRouter` sharing its weight (state-dict keys unchanged). Inside
`replay_routing(model, routed)` the routers take the experts the engine recorded for every
position (-1: choose as usual) and weight them with the trainer's own softmax probabilities,
renormalized over the replayed experts, so the gradient still reaches the router. Each router
also keeps its own top-k choice (`own_index`), for the routing-agreement metric.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.models.moe import TopKRouter
from lowbit.nn import convert_to_quantized_training
from lowbit.recipes import LinearRecipe, Recipe
from lowbit.rl.precision import weight_spec

__all__ = ["asymmetric_qat_recipe", "apply_asymmetric_qat", "ReplayRouter",
           "enable_routing_replay", "replay_routing", "routing_agreement", "routing_agreement_counts"]


def asymmetric_qat_recipe() -> Recipe:
    """NVFP4 weights (the engine's spec) in the forward GEMM only; BF16 activations and
    gradients. QUADS' trainer side (arXiv 2607.15810)."""
    return Recipe("quads-asymmetric-qat", LinearRecipe(fprop_w=weight_spec()),
                  note="NVFP4 1x16 fake-quantized weights in fprop (the rollout engine's), "
                       "high-precision activations, straight-through gradients.")


def apply_asymmetric_qat(model: nn.Module) -> str:
    """Convert `model` in place; returns the first line of lowbit.quantize_'s report."""
    return str(convert_to_quantized_training(model, asymmetric_qat_recipe())).splitlines()[0]


class ReplayRouter(TopKRouter):
    """A TopKRouter that can replay recorded expert choices (see the module doc)."""

    replay_index: torch.Tensor | None = None
    own_index: torch.Tensor | None = None

    @classmethod
    def from_router(cls, router: TopKRouter) -> ReplayRouter:
        r = cls.__new__(cls)
        nn.Module.__init__(r)
        r.num_experts, r.hidden_dim, r.top_k = router.num_experts, router.hidden_dim, router.top_k
        r.weight = router.weight                     # shared, not copied
        r.replay_index = r.own_index = None
        return r

    def forward(self, hidden_states: torch.Tensor):
        router_logits = F.linear(hidden_states, self.weight)                 # (N, E)
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        own_weights, own_index = torch.topk(probs, self.top_k, dim=-1)       # (N, k)
        self.own_index = own_index.detach()
        index = own_index
        if self.replay_index is not None:
            replay = self.replay_index.to(own_index.device)
            if replay.shape != own_index.shape:
                raise ValueError(f"routing replay has {tuple(replay.shape)} experts for "
                                 f"{tuple(own_index.shape)} routed slots")
            recorded = (replay >= 0).all(dim=-1, keepdim=True)               # (N, 1)
            index = torch.where(recorded, replay, own_index)
        weights = probs.gather(-1, index)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return router_logits, weights.to(router_logits.dtype), index


def enable_routing_replay(model: nn.Module) -> int:
    """Swap every TopKRouter of `model` for a ReplayRouter (in place); returns how many."""
    count = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, TopKRouter) and not isinstance(child, ReplayRouter):
                setattr(module, child_name, ReplayRouter.from_router(child))
                count += 1
    return count


def _routers(model: nn.Module) -> list[ReplayRouter]:
    return [m for m in model.modules() if isinstance(m, ReplayRouter)]


@contextlib.contextmanager
def replay_routing(model: nn.Module, routed: torch.Tensor | None):
    """routed (B, T, n_layers, k) from the engine (positions of the model's input, -1 for
    none); None replays nothing. The model's MoE layers must be in order of depth."""
    routers = _routers(model)
    if routed is not None:
        if not routers:
            raise ValueError("routing replay needs enable_routing_replay(model) first")
        if routed.shape[2] != len(routers):
            raise ValueError(f"routing replay has {routed.shape[2]} layers, the model "
                             f"{len(routers)} MoE routers")
        for i, router in enumerate(routers):
            router.replay_index = routed[:, :, i].reshape(-1, routed.shape[-1])
    try:
        yield
    finally:
        for router in routers:
            router.replay_index = None


def routing_agreement(model: nn.Module, routed: torch.Tensor) -> float | None:
    """Fraction of (position, layer) pairs whose trainer top-k set (from the last forward)
    equals the engine's, over the positions the engine recorded; None without MoE routers."""
    counts = routing_agreement_counts(model, routed)
    if counts is None:
        return None
    agree, total = (int(c) for c in counts)
    return agree / total if total else None


def routing_agreement_counts(model: nn.Module, routed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """routing_agreement's (agreeing pairs, recorded pairs) as device scalars, to add up over a
    step's micro-batches and read back once; None without MoE routers."""
    routers = _routers(model)
    if not routers or routers[0].own_index is None:
        return None
    agree, total = 0, 0
    for i, router in enumerate(routers):
        engine = routed[:, :, i].reshape(-1, routed.shape[-1]).to(router.own_index.device)
        valid = (engine >= 0).all(dim=-1)
        same = (torch.sort(engine, -1).values == torch.sort(router.own_index, -1).values).all(-1)
        agree = agree + (same & valid).sum()
        total = total + valid.sum()
    return agree, total
