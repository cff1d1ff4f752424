"""Quantized modules and the converter that swaps them into any nn.Module.

    report = lowbit.quantize_(model, "stable-fp4")  # in place; prints what it swapped and kept
    print(report)

(`lowbit.quantize_` with a recipe calls `convert_to_quantized_training` here; with a QATConfig,
lowbit.qat.prepare. Both walk the model with `gemm_modules`.)

`QuantLinear` is an nn.Linear whose forward runs the recipe's three quantized GEMMs
(lowbit.ops.quant_linear); `QuantExperts` does the same per expert for MoE expert weights
stored as 3D tensors (lowbit's models and Hugging Face Qwen3-MoE in transformers 5.x).
Both keep their parameters in high precision (the master weights); quantization happens in
each GEMM. `quantization_disabled(model)` turns it off temporarily (to compare against BF16
on the same weights); `reuse_weight_operands(model, optimizer)` quantizes each forward weight once
between optimizer steps (the RL trainer's log-prob passes and micro-batches).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass, field
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn.utils import parametrize

from lowbit.models.moe import Experts, grouped_mm_supported
from lowbit.ops.gemms import WeightOperandCache, compilable
from lowbit.ops.grouped import groups_exactly, grouped_quant_linear
from lowbit.ops.linear import quant_linear
from lowbit.recipes import LinearRecipe, Recipe, get_recipe

__all__ = ["QuantLinear", "QuantExperts", "convert_to_quantized_training", "convert", "gemm_modules",
           "GEMM_KINDS", "ConversionReport", "quantization_disabled",
           "default_module_filter", "is_experts", "reuse_weight_operands"]


class QuantLinear(nn.Linear):
    """nn.Linear with quantized GEMMs. With `linear_recipe=None` it is exactly nn.Linear.

    layer_name: the name lowbit.dispatch.fold_check.watch_chunked_folds() reports for this layer;
    "" (the default) is not reported. lowbit.train sets the module names under --fold-inexact
    adapt only: torch.compile reads the name as a constant, so blocks compiled one by one (the
    same code, other names) would each compile again."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 linear_recipe: LinearRecipe | None = None, device=None, dtype=None,
                 layer_name: str = ""):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.linear_recipe = linear_recipe
        self.quantize = True
        self.layer_name = layer_name
        self.weight_cache: WeightOperandCache | None = None

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
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe = self.linear_recipe if self.quantize else None
        if (torch.compiler.is_compiling() and recipe is not None and recipe.is_quantized
                and not compilable(recipe)):
            return self._forward_eagerly(x)
        return quant_linear(x, self.weight, self.bias, recipe, self.layer_name, self.weight_cache)

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

    Routing, token gather/scatter and weighting are lowbit.models.moe.Experts' (the semantics
    of Hugging Face's Qwen3MoeExperts); only `_expert_linear` changes. Each expert's weight
    matrix is quantized on its own (NVFP4: its own tensor scale, as per-expert ModelOpt scales).
    """

    def __init__(self, source: nn.Module, linear_recipe: LinearRecipe | None):
        nn.Module.__init__(self)
        self.num_experts, self.hidden_dim, self.intermediate_dim = _expert_dims(source)
        self.gate_up_proj = source.gate_up_proj   # (E, 2F, C), shared, not copied
        self.down_proj = source.down_proj         # (E, C, F)
        self.linear_recipe = linear_recipe
        self.quantize = True
        self.weight_cache: WeightOperandCache | None = None

    def _expert_linear(self, x: torch.Tensor, weight: torch.Tensor, expert_idx: int) -> torch.Tensor:
        return quant_linear(x, weight[expert_idx], None, self.linear_recipe if self.quantize else None,
                            cache=self.weight_cache)

    def _active_recipe(self) -> LinearRecipe | None:
        recipe = self.linear_recipe if self.quantize else None
        return recipe if recipe is not None and recipe.is_quantized else None

    def _can_group(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        # unquantized: plain products (Experts' grouped GEMM); a recipe whose quantization of
        # the stacked experts is each expert's own: one grouped quantized GEMM, emulated or on
        # FP8 tensor cores (lowbit.ops.grouped); any other (tensor scales on X or dY): expert by
        # expert
        recipe = self._active_recipe()
        return grouped_mm_supported(x, weight) and (recipe is None
                                                    or groups_exactly(recipe, tuple(weight.shape)))

    def _experts_linear(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        recipe = self._active_recipe()
        if recipe is None:
            return super()._experts_linear(x, weight, counts)
        if self._can_group(x, weight):
            return grouped_quant_linear(x, weight, counts, recipe, self.weight_cache)
        return self._per_expert_linear(x, weight, counts)

    def extra_repr(self) -> str:
        recipe = self.linear_recipe.describe() if self.linear_recipe else "high precision"
        return f"{super().extra_repr()}, {recipe}"


def _expert_dims(module: nn.Module) -> tuple[int, int, int]:
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


def default_module_filter(module: nn.Module, name: str) -> bool:
    """Convert every linear and experts module except the output head and MoE routers."""
    last = name.rsplit(".", 1)[-1]
    return last not in ("lm_head", "gate", "router", "score")


GEMM_KINDS = ("linear", "experts")


def gemm_modules(model: nn.Module, module_filter_fn: Callable[[nn.Module, str], bool] | None = None
                 ) -> Iterator[tuple[str, nn.Module, str, str]]:
    """The one walk over a model that both ways of quantizing its weights take (`convert`'s
    module swap and lowbit.qat.prepare's fake quantization): (name, module, kind, why_kept) for

    - every module holding a GEMM's weight: kind "linear" (nn.Linear) or "experts" (3D expert
      weights, `is_experts`), why_kept "" where module_filter_fn (default
      `default_module_filter`) takes it, else why not; its submodules are not visited;
    - every other module that holds weights: embeddings and norms ("not a GEMM"), routers
      ("routing stays in high precision"), and modules lowbit knows nothing about (GPT-2's
      Conv1D, say: why_kept "holds NAME SHAPE, ..."), kind their type name or "router"."""
    keep = module_filter_fn or default_module_filter
    inside: list[str] = []   # the GEMM modules met so far: their submodules are theirs
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        kind = "linear" if isinstance(module, nn.Linear) else "experts" if is_experts(module) else ""
        if kind:
            inside.append(name)
            why = "" if keep(module, name) else (
                "module_filter_fn" if module_filter_fn else
                "default filter: output head and routers stay high precision")
            yield name, module, kind, why
        elif isinstance(module, nn.Embedding) or "norm" in type(module).__name__.lower():
            yield name, module, type(module).__name__, "not a GEMM"
        elif name.rsplit(".", 1)[-1] in ("gate", "router") and hasattr(module, "weight"):
            yield name, module, "router", "routing stays in high precision"
        elif any(p.dim() >= 2 for p in module.parameters(recurse=False)):
            held = ", ".join(f"{n} {tuple(p.shape)}" for n, p in
                             module.named_parameters(recurse=False))
            yield name, module, type(module).__name__, f"holds {held}"


@dataclass
class ConversionReport:
    recipe: str
    swapped: list[tuple[str, str, str]] = field(default_factory=list)  # (name, kind, recipe)
    kept: list[tuple[str, str, str]] = field(default_factory=list)     # (name, kind, why)
    not_understood: list[tuple[str, str, str]] = field(default_factory=list)
    """(name, type, what it holds): modules with weights convert knows nothing about (e.g.
    GPT-2's Conv1D), left as they are; a model full of them is not being quantized."""

    @property
    def warning(self) -> str:
        """A line when the recipe quantized nothing, saying why ("" otherwise)."""
        if self.swapped or self.recipe == "bf16":
            return ""
        why = ("; its weights are in modules lowbit does not convert: "
               + ", ".join(sorted({t for _, t, _ in self.not_understood}))
               if self.not_understood else "")
        return (f"recipe {self.recipe!r} quantized no module of this model ({len(self.kept)} "
                f"kept in high precision{why}); training it is training bf16")

    def __str__(self) -> str:
        lines = [f"lowbit.quantize_: recipe {self.recipe!r}: {len(self.swapped)} modules quantized, "
                 f"{len(self.kept)} kept in high precision"
                 + (f", {len(self.not_understood)} not understood" if self.not_understood else "")]
        if self.warning:
            lines.append(f"  warning: {self.warning}")
        rows = self.swapped + self.kept + self.not_understood
        width = max([len(n) for n, _, _ in rows] + [10])
        for name, kind, what in self.swapped:
            lines.append(f"  quantized  {name.ljust(width)}  {kind:<10} {what}")
        for name, kind, why in self.kept:
            lines.append(f"  kept       {name.ljust(width)}  {kind:<10} {why}")
        for name, kind, what in self.not_understood:
            lines.append(f"  unknown    {name.ljust(width)}  {kind:<10} {what}; not converted "
                         f"(lowbit converts nn.Linear and 3D experts)")
        return "\n".join(lines)


def convert(model: nn.Module, recipe: str | Recipe,
            module_filter_fn: Callable[[nn.Module, str], bool] | None = None) -> ConversionReport:
    """Deprecated name of `convert_to_quantized_training` (lowbit.quantize_ is the front door;
    lowbit.qat.convert is QAT's other step, packing trained weights)."""
    warnings.warn("lowbit.convert is now lowbit.quantize_(model, recipe) (or "
                  "lowbit.nn.convert_to_quantized_training); the old name will go",
                  DeprecationWarning, stacklevel=2)
    return convert_to_quantized_training(model, recipe, module_filter_fn)


def convert_to_quantized_training(model: nn.Module, recipe: str | Recipe,
                                  module_filter_fn: Callable[[nn.Module, str], bool] | None = None
                                  ) -> ConversionReport:
    """Swap model's nn.Linear and 3D-experts modules for quantized ones, in place.

    module_filter_fn(module, fully_qualified_name) -> bool picks the modules to convert
    (torchao's signature); the default, `default_module_filter`, skips lm_head and routers.
    The recipe then decides per module (e.g. first/last blocks or q/k projections). Embeddings,
    norms and routers hold no GEMM a recipe quantizes and are reported as kept; other modules
    holding weights (e.g. GPT-2's Conv1D) as not understood. A recipe that quantizes nothing
    warns (UserWarning) and says so in the report.

    All or nothing: every module is checked (and every swap planned) before the first swap, so
    a model that cannot be converted (e.g. already converted, or prepared for QAT by
    lowbit.qat.prepare, whose trainable weights a swap would drop) is left as it was.
    """
    recipe = get_recipe(recipe)
    names = [name for name, _ in model.named_modules()]
    block_ids = [int(m.group(1)) for n in names for m in [re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", n)] if m]
    n_blocks = max(block_ids) + 1 if block_ids else None
    report = ConversionReport(recipe.name)
    plan: list[tuple[str, nn.Module, str, LinearRecipe]] = []

    for name, module, kind, why in gemm_modules(model, module_filter_fn):
        if kind not in GEMM_KINDS:
            (report.not_understood if why.startswith("holds") else report.kept).append(
                (name, kind, why))
            continue
        if isinstance(module, (QuantLinear, QuantExperts)):
            raise ValueError(f"{name} is already converted; convert a fresh model (or reload it); "
                             f"nothing was changed")
        if why:
            report.kept.append((name, kind, why))
            continue
        linear_recipe = recipe.linear_for(name, n_blocks)
        if linear_recipe is None:
            why = ("recipe: bf16" if recipe.linear is None else
                   f"recipe keeps the first/last {recipe.keep_first_last_blocks} blocks in high "
                   f"precision" if recipe.keep_first_last_blocks and recipe.linear_for(name) else
                   "recipe keeps it in high precision")
            report.kept.append((name, kind, why))
            continue
        if kind == "experts":
            _expert_dims(module)   # refuse an unsupported experts module before any swap
        _refuse_parametrized(module, name)
        plan.append((name, module, kind, linear_recipe))

    for name, module, kind, linear_recipe in plan:
        new = (QuantLinear.from_linear(module, linear_recipe) if kind == "linear"
               else QuantExperts(module, linear_recipe))
        _set_submodule(model, name, new)
        report.swapped.append((name, kind, linear_recipe.describe()))
    if report.warning:
        warnings.warn(f"lowbit.quantize_: {report.warning}", UserWarning, stacklevel=2)
    return report


def _refuse_parametrized(module: nn.Module, name: str) -> None:
    """A weight computed by a parametrization (torch.nn.utils.parametrize) is not the module's
    parameter: the swap would keep the computed tensor and drop what it is computed from (a
    QAT-prepared model's trainable latent weights and scales; a QAT-converted one's packed
    codes). Refused, before any swap."""
    if not parametrize.is_parametrized(module):
        return
    # lowbit.qat.convert leaves an empty placeholder as the original of a packed weight
    if any(plist.original.numel() for plist in module.parametrizations.values()):
        raise ValueError(f"{name} is prepared for QAT (lowbit.qat.prepare): its weight is "
                         f"computed from trainable weights that lowbit.quantize_ would drop; "
                         f"finish QAT with lowbit.qat.convert first (which packs them), or convert "
                         f"a fresh model; nothing was changed")
    raise ValueError(f"{name} holds packed weights (lowbit.qat.convert), which lowbit.quantize_ "
                     f"would drop; the model already runs on them (save them with "
                     f"lowbit.save_qtensors), or convert a fresh model; nothing was changed")


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


@contextlib.contextmanager
def quantization_disabled(model: nn.Module):
    """Run `model` with every QuantLinear/QuantExperts in high precision, same weights."""
    modules = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantExperts))]
    previous = [m.quantize for m in modules]
    try:
        for m in modules:
            m.quantize = False
        yield model
    finally:
        for m, p in zip(modules, previous):
            m.quantize = p


@contextlib.contextmanager
def reuse_weight_operands(model: nn.Module, optimizer: torch.optim.Optimizer):
    """Inside, each QuantLinear and QuantExperts of `model` quantizes its forward weight once
    between two steps of `optimizer` instead of once per forward (lowbit.ops.gemms.
    WeightOperandCache, emptied by a hook as each optimizer step begins): the same values, fewer
    launches, one quantized copy of each weight held between steps (2 bytes a parameter under
    bf16 autocast). Eager forwards with round-to-nearest weight specs only; others quantize as
    usual. Weights must change only through `optimizer` or in-place ops inside the block
    (load_state_dict); a write through .data goes unseen. FSDP-sharded models are refused:
    their gathered weights reuse freed memory, which the cache's keys (a weight's storage)
    cannot tell apart. Yields the cache."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("reuse_weight_operands does not take FSDP-sharded (DTensor) parameters: "
                         "their gathered weights reuse freed memory; quantize per forward instead")
    cache = WeightOperandCache()
    modules = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantExperts))]
    hook = optimizer.register_step_pre_hook(lambda *_: cache.clear())
    for m in modules:
        m.weight_cache = cache
    try:
        yield cache
    finally:
        hook.remove()
        for m in modules:
            m.weight_cache = None
        cache.clear()
