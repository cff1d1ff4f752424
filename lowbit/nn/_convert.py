"""Putting the quantized modules into a model: the one walk over its GEMMs (`gemm_modules`),
the converter that swaps them in (`convert_to_quantized_training`, what lowbit.quantize_ calls
with a recipe), and the switches for a converted model (`quantization_disabled`,
`reuse_weight_operands`). Public through lowbit.nn."""

from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass, field
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn.utils import parametrize

from lowbit.nn._layers import QuantExperts, QuantLinear, expert_dims, is_experts
from lowbit.ops.gemms import WeightOperandCache
from lowbit.recipes import LinearRecipe, Recipe, get_recipe

__all__ = ["convert_to_quantized_training", "convert", "gemm_modules", "GEMM_KINDS",
           "ConversionReport", "quantization_disabled", "default_module_filter",
           "reuse_weight_operands"]


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
    quantizes: bool = True
    """The recipe quantizes some layer (Recipe.quantizes; bf16's quantizes none)."""
    swapped: list[tuple[str, str, str]] = field(default_factory=list)  # (name, kind, recipe)
    kept: list[tuple[str, str, str]] = field(default_factory=list)     # (name, kind, why)
    not_understood: list[tuple[str, str, str]] = field(default_factory=list)
    """(name, type, what it holds): modules with weights convert knows nothing about (e.g.
    GPT-2's Conv1D), left as they are; a model full of them is not being quantized."""

    @property
    def warning(self) -> str:
        """A line when the recipe quantized nothing, saying why ("" otherwise)."""
        if self.swapped or not self.quantizes:
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
    report = ConversionReport(recipe.name, recipe.quantizes)
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
            expert_dims(module)   # refuse an unsupported experts module before any swap
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
    bf16 autocast). Round-to-nearest weight specs only; others quantize as usual. A hook
    before each forward of `model` takes every weight-only QuantLinear's (QUADS' asymmetric
    QAT) from the cache into the layer (`weight_operand`), the one way a layer compiled by
    torch.compile, where the cache's Python cannot run, gets it (the hook itself always runs
    eagerly); other layers ask the cache at each eager forward (compiled, they quantize at every
    forward). Weights must change only through `optimizer` or in-place ops inside the block; a
    write through .data goes unseen. `model.load_state_dict` drops the layers' operands; after
    another in-place change run `model` before calling a compiled layer on its own (eagerly a
    layer checks its weight's version; compiled it cannot). A copy of `model` made inside the
    block carries none of this. FSDP-sharded models are refused: their gathered weights reuse freed memory, which
    the cache's keys (a weight's storage) cannot tell apart. Yields the cache."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("reuse_weight_operands does not take FSDP-sharded (DTensor) parameters: "
                         "their gathered weights reuse freed memory; quantize per forward instead")
    cache = WeightOperandCache()
    modules = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantExperts))]
    weight_only = [m for m in modules if isinstance(m, QuantLinear)
                   and m.linear_recipe is not None and m.linear_recipe.weight_only]

    def clear() -> None:
        cache.clear()
        for m in weight_only:
            m.weight_operand = None

    @torch.compiler.disable
    def take_operands() -> None:
        for m in weight_only:
            m.weight_operand = _cached_operand(m, cache) if m.quantize else None
            m.weight_operand_version = m.weight._version

    hooks = [optimizer.register_step_pre_hook(lambda *_: clear()),
             model.register_forward_pre_hook(_ModelHook(model, take_operands)),
             model.register_load_state_dict_post_hook(_ModelHook(model, clear))]
    for m in modules:
        m.weight_cache = cache
    try:
        yield cache
    finally:
        for hook in hooks:
            hook.remove()
        for m in modules:
            m.weight_cache = None
        clear()


class _ModelHook:
    """A hook reuse_weight_operands puts on the model: `fn()` when called for that model. A
    copy of the model made inside the block (deepcopy, pickle) carries an inert one instead,
    since `fn` serves the original's layers and cache."""

    def __init__(self, model: nn.Module, fn: Callable[[], None]) -> None:
        self.model, self.fn = model, fn

    def __call__(self, module: nn.Module, *_) -> None:
        if module is self.model:
            self.fn()

    def __reduce__(self):
        return (_InertHook, ())


class _InertHook:
    """What a copied _ModelHook becomes: does nothing."""

    def __call__(self, *_) -> None:
        return None


def _cached_operand(layer: QuantLinear, cache: WeightOperandCache) -> torch.Tensor | None:
    """The layer's quantized forward weight from `cache`, in the dtype its GEMM runs in now
    (autocast's where autocast is on), as an eager forward would take it; None where the cache
    keeps none (a stochastic spec, a CUDA graph's capture)."""
    w, device = layer.weight, layer.weight.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else w.dtype
    return cache.forward_weight(w, dtype, layer.linear_recipe.fprop_w)
