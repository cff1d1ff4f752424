"""The quantized modules: `QuantLinear` (an nn.Linear whose forward runs the recipe's three
quantized GEMMs, lowbit.ops.quant_linear) and `QuantExperts` (the same per expert for MoE expert
weights stored as 3D tensors, grouped where that is the per-expert numerics). Public through
lowbit.nn."""

from __future__ import annotations

import torch
from torch import nn

from lowbit.models.moe import Experts, grouped_mm_supported
from lowbit.ops.gemms import WeightOperandCache, compilable
from lowbit.ops.grouped import grouped_quant_linear, groups_exactly, row_tile
from lowbit.ops.linear import quant_linear
from lowbit.recipes import LinearRecipe

__all__ = ["QuantLinear", "QuantExperts", "is_experts", "expert_dims"]


class QuantLinear(nn.Linear):
    """nn.Linear with quantized GEMMs. With `linear_recipe=None` it is exactly nn.Linear.

    layer_name: the name lowbit.dispatch.fold_check.watch_chunked_folds() reports for this layer;
    "" (the default) is not reported. lowbit.train sets the module names under --fold-inexact
    adapt only: torch.compile reads the name as a constant, so blocks compiled one by one (the
    same code, other names) would each compile again.

    weight_cache / weight_operand: set by lowbit.nn.reuse_weight_operands: the cache of quantized
    forward weights, and this layer's, taken from it as the model's forward began (a weight-only
    recipe's: the one a compiled forward can multiply, lowbit.ops.quant_linear), with the
    weight's version then (eagerly, a weight changed in place since is quantized afresh)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 linear_recipe: LinearRecipe | None = None, device=None, dtype=None,
                 layer_name: str = ""):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.linear_recipe = linear_recipe
        self.quantize = True
        self.layer_name = layer_name
        self.weight_cache: WeightOperandCache | None = None
        self.weight_operand: torch.Tensor | None = None
        self.weight_operand_version = -1

    @classmethod
    def from_linear(cls, linear: nn.Linear, linear_recipe: LinearRecipe | None,
                    layer_name: str = "") -> QuantLinear:
        """A QuantLinear sharing `linear`'s parameters (no copy)."""
        q = cls.__new__(cls)
        nn.Module.__init__(q)
        q.in_features, q.out_features = linear.in_features, linear.out_features
        q.weight = linear.weight
        q.bias = linear.bias
        q.linear_recipe = linear_recipe
        q.quantize = True
        q.layer_name = layer_name
        q.weight_cache = None
        q.weight_operand = None
        q.weight_operand_version = -1
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe = self.linear_recipe if self.quantize else None
        if (torch.compiler.is_compiling() and recipe is not None and recipe.is_quantized
                and not compilable(recipe)):
            return self._forward_eagerly(x)
        operand = self.weight_operand
        if operand is not None and not torch.compiler.is_compiling() and (
                self.weight._version != self.weight_operand_version
                or (operand.is_cuda and torch.cuda.is_current_stream_capturing())):
            # the weight was changed in place since the operand was taken; or a CUDA graph is
            # being captured, whose replays would read a tensor the cache frees
            operand = None
        return quant_linear(x, self.weight, self.bias, recipe, self.layer_name, self.weight_cache,
                            operand)

    def __getstate__(self) -> dict:
        # a copy (deepcopy, pickle) leaves reuse_weight_operands' state behind: it serves the
        # original's weights
        return {**self.__dict__, "weight_cache": None, "weight_operand": None,
                "weight_operand_version": -1}

    # Under torch.compile a recipe whose forward rounds stochastically runs eagerly, the whole
    # layer a graph break (see lowbit.ops.compiled): a break inside this frame would make
    # dynamo compile the frame on its own, again for every recipe, shape and dtype it meets.
    @torch.compiler.disable
    def _forward_eagerly(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.weight, self.bias, self.linear_recipe, self.layer_name)

    def extra_repr(self) -> str:
        recipe = self.linear_recipe.describe() if self.linear_recipe else "high precision"
        return f"{super().extra_repr()}, {recipe}"


class QuantExperts(Experts):
    """MoE experts (3D weights) whose per-expert GEMMs are quantized like a QuantLinear's.

    Routing, the rows' layout, the token gathers and the weighting are lowbit.models.moe.Experts'
    (the semantics of Hugging Face's Qwen3MoeExperts); what changes is where an expert's weight
    meets its input: `_expert_linear` (the per-expert reference), `_grouped_linear` (every
    expert at once, lowbit.ops.grouped), `_can_group` and `_row_tile` (its padding). Each expert's weight
    matrix is quantized on its own (NVFP4: its own tensor scale, as per-expert ModelOpt scales).

    layer_name: as QuantLinear's, for the grouped FP8 path's folds, which are reported as
    "<layer_name>.gate_up_proj" and "<layer_name>.down_proj"; "" (the default) is not reported.
    """

    def __init__(self, source: nn.Module, linear_recipe: LinearRecipe | None):
        nn.Module.__init__(self)
        self.num_experts, self.hidden_dim, self.intermediate_dim = expert_dims(source)
        self.gate_up_proj = source.gate_up_proj   # (E, 2F, C), shared, not copied
        self.down_proj = source.down_proj         # (E, C, F)
        self.linear_recipe = linear_recipe
        self.quantize = True
        self.layer_name = ""
        self.weight_cache: WeightOperandCache | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "weight_cache": None}   # as QuantLinear's

    def _expert_linear(self, x: torch.Tensor, weight: torch.Tensor, expert_idx: int) -> torch.Tensor:
        return quant_linear(x, weight[expert_idx], None, self.linear_recipe if self.quantize else None,
                            cache=self.weight_cache)

    def _active_recipe(self) -> LinearRecipe | None:
        recipe = self.linear_recipe if self.quantize else None
        return recipe if recipe is not None and recipe.is_quantized else None

    def _can_group(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        # unquantized: plain products (Experts' grouped GEMM); a recipe whose quantization of
        # the stacked experts is each expert's own (every emulated one; FP8 where the tiles
        # allow): one grouped quantized GEMM (lowbit.ops.grouped); any other: expert by expert
        recipe = self._active_recipe()
        return grouped_mm_supported(x, weight) and (recipe is None
                                                    or groups_exactly(recipe, tuple(weight.shape)))

    def _row_tile(self) -> int:
        # each expert's rows padded to the longest block or tile along the tokens, so no block
        # holds two experts' rows (lowbit.ops.grouped)
        recipe = self._active_recipe()
        return 1 if recipe is None else row_tile(recipe)

    def _grouped_linear(self, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        recipe = self._active_recipe()
        if recipe is None:
            return super()._grouped_linear(x, weight, ends)
        which = "gate_up_proj" if weight is self.gate_up_proj else "down_proj"
        layer = f"{self.layer_name}.{which}" if self.layer_name else ""
        return grouped_quant_linear(x, weight, ends, recipe, self.weight_cache, layer)

    def extra_repr(self) -> str:
        recipe = self.linear_recipe.describe() if self.linear_recipe else "high precision"
        return f"{super().extra_repr()}, {recipe}"


def expert_dims(module: nn.Module) -> tuple[int, int, int]:
    """(experts, hidden, intermediate) of a SwiGLU experts module in Qwen3-MoE's layout; a
    ValueError, one line, for another layout or activation."""
    e, two_f, c = module.gate_up_proj.shape
    if module.down_proj.shape != (e, c, two_f // 2):
        raise ValueError(f"experts module has gate_up_proj {tuple(module.gate_up_proj.shape)} and "
                         f"down_proj {tuple(module.down_proj.shape)}; expected (E, 2F, C) and (E, C, F)")
    act = getattr(module, "act_fn", None)
    probe = torch.linspace(-6, 6, 97)
    if act is not None and not torch.allclose(act(probe), torch.nn.functional.silu(probe)):
        raise ValueError(f"experts module uses activation {type(act).__name__}; QuantExperts "
                         "implements SwiGLU (SiLU) experts only")
    return e, c, two_f // 2


def is_experts(module: nn.Module) -> bool:
    """Fused 3D expert weights in Hugging Face's Qwen3-MoE layout (or lowbit's, the same)."""
    weight = getattr(module, "gate_up_proj", None)
    return (isinstance(weight, nn.Parameter) and weight.dim() == 3
            and isinstance(getattr(module, "down_proj", None), nn.Parameter))
