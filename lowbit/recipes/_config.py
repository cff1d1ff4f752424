"""The typed recipe configs: `LinearRecipe` (each operand's quantizer in a linear layer's three
GEMMs, and where the GEMMs run, `Gemm`) and `Recipe` (a named default with per-module
overrides)."""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field, replace
from enum import Enum

from lowbit.formats import QuantSpec
from lowbit.formats.spec import ScaleKind, parse_enum

__all__ = ["Gemm", "LinearRecipe", "Recipe", "with_linear", "GEMMS", "OPERANDS"]


class Gemm(str, Enum):
    """Where a quantized GEMM runs."""

    EMULATED = "emulated"  # dequantize, then a GEMM in the compute dtype (any device, any format)
    FP8 = "fp8"            # MXFP4 operands folded into FP8 E4M3 + power-of-two row factors,
                           # multiplied exactly on FP8 tensor cores (lowbit.kernels.fp8_gemm)


GEMMS = ("fprop", "dgrad", "wgrad")
OPERANDS = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")


def _foldable(spec: QuantSpec | None) -> bool:
    return (spec is not None and spec.info.scale_kind is ScaleKind.E8M0
            and spec.info.element.name == "e2m1")


@dataclass(frozen=True)
class LinearRecipe:
    """Per-operand quantizers of one linear layer; None keeps that operand in high precision.

    Each spec quantizes along its GEMM's reduction dim. When an operand's two uses have the
    same 2D spec, it is quantized once and the transpose of that one copy is used in the
    second GEMM (2D tiles make that exact), so forward and backward see the same values.
    """

    fprop_x: QuantSpec | None = None   # X (tokens, in), blocks along in
    fprop_w: QuantSpec | None = None   # W (out, in), blocks along in
    dgrad_dy: QuantSpec | None = None  # dY (tokens, out), blocks along out
    dgrad_w: QuantSpec | None = None   # W as (in, out), blocks along out
    wgrad_dy: QuantSpec | None = None  # dY as (out, tokens), blocks along tokens
    wgrad_x: QuantSpec | None = None   # X as (in, tokens), blocks along tokens
    # Random Hadamard transform (16x16, random signs) on both wgrad operands along tokens.
    wgrad_hadamard: bool = False
    # Where the GEMMs run; Gemm.FP8 needs every operand in MXFP4 (E8M0 scales fold exactly).
    gemm: Gemm = Gemm.EMULATED
    # Gemm.FP8 only: the GEMMs ("fprop", "dgrad", "wgrad") whose FP8 tensor cores accumulate
    # all of K in their reduced precision (torch._scaled_mm's use_fast_accum) instead of
    # promoting partial sums to float32; faster, with more accumulation error (measured in
    # docs/results/kernels.md). Transformer Engine's FP8 recipes do this in fprop only.
    fast_accum: tuple[str, ...] = ()
    # The recipe as one string, from which from_key() rebuilds it: what torch.library custom
    # ops (lowbit.ops.compiled), which take no Python objects, are given. A plain attribute,
    # so torch.compile reads it as a constant of the graph.
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gemm", parse_enum(Gemm, self.gemm, "gemm"))
        fast = self.fast_accum or ()
        fast = (fast,) if isinstance(fast, str) else tuple(fast)
        unknown = sorted(set(fast) - set(GEMMS))
        if unknown:
            raise ValueError(f"fast_accum names GEMMs, {', '.join(map(repr, GEMMS))}; got "
                             f"{', '.join(map(repr, unknown))}")
        if fast and self.gemm is not Gemm.FP8:
            raise ValueError("fast_accum sets how FP8 tensor cores accumulate, so it needs "
                             "gemm='fp8'; the emulated GEMMs accumulate in float32")
        object.__setattr__(self, "fast_accum", tuple(g for g in GEMMS if g in fast))
        if self.gemm is Gemm.FP8:
            bad = [n for n in OPERANDS if not _foldable(getattr(self, n))]
            if bad or self.wgrad_hadamard:
                raise ValueError(
                    "gemm='fp8' multiplies MXFP4 operands exactly on FP8 tensor cores, so every "
                    f"operand must be MXFP4 (E2M1, E8M0 scales) and no Hadamard transform; "
                    f"{', '.join(bad) or 'wgrad_hadamard'} is not: use gemm='emulated'")
        if self.wgrad_hadamard:
            for name in ("wgrad_dy", "wgrad_x"):
                spec = getattr(self, name)
                if spec is not None and spec.is_2d:
                    raise ValueError(f"wgrad_hadamard mixes values along tokens, so {name} must "
                                     f"use 1D blocks, not {spec.block}")
        object.__setattr__(self, "key", json.dumps(self.to_dict(), sort_keys=True,
                                                   separators=(",", ":")))

    def to_dict(self) -> dict:
        """JSON-ready fields (specs as QuantSpec.to_dict, None for a high-precision operand)."""
        out = {name: (None if getattr(self, name) is None else getattr(self, name).to_dict())
               for name in OPERANDS}
        out.update(wgrad_hadamard=self.wgrad_hadamard, gemm=self.gemm.value,
                   fast_accum=list(self.fast_accum))
        return out

    @classmethod
    def from_dict(cls, fields: dict) -> LinearRecipe:
        specs = {name: None if fields.get(name) is None else QuantSpec.from_dict(fields[name])
                 for name in OPERANDS}
        return cls(**specs, wgrad_hadamard=fields.get("wgrad_hadamard", False),
                   gemm=fields.get("gemm", "emulated"),
                   fast_accum=tuple(fields.get("fast_accum", ())))

    @classmethod
    def from_key(cls, key: str) -> LinearRecipe:
        """The recipe whose `key` this is."""
        return cls.from_dict(json.loads(key))

    def with_gemm(self, gemm: Gemm | str) -> LinearRecipe:
        """The same operands on other GEMMs (fast_accum kept on FP8 GEMMs, dropped elsewhere)."""
        gemm = parse_enum(Gemm, gemm, "gemm")
        return replace(self, gemm=gemm, fast_accum=self.fast_accum if gemm is Gemm.FP8 else ())

    @property
    def is_quantized(self) -> bool:
        return any(getattr(self, n) is not None for n in OPERANDS)

    @property
    def weight_only(self) -> bool:
        """Only the forward's W is quantized, on emulated GEMMs (QUADS' asymmetric QAT): every
        other operand, and so the whole backward, in high precision."""
        return (self.gemm is Gemm.EMULATED and self.fprop_w is not None and not self.wgrad_hadamard
                and all(getattr(self, n) is None for n in OPERANDS if n != "fprop_w"))

    def describe(self) -> str:
        def one(spec):
            if spec is None:
                return "hp"
            rule = f"/{spec.scale_rule.value}" if spec.scale_rule else ""
            sr = "/sr" if spec.rounding.value == "stochastic" else ""
            return f"{spec.format}[{spec.block[0]}x{spec.block[1]}{rule}{sr}]"
        return (f"fprop X:{one(self.fprop_x)} W:{one(self.fprop_w)} | dgrad dY:{one(self.dgrad_dy)} "
                f"W:{one(self.dgrad_w)} | wgrad dY:{one(self.wgrad_dy)} X:{one(self.wgrad_x)}"
                + (" +RHT" if self.wgrad_hadamard else "")
                + (" on FP8 tensor cores" if self.gemm is Gemm.FP8 else "")
                + (f" (fast accumulation: {', '.join(self.fast_accum)})" if self.fast_accum
                   else ""))


@dataclass(frozen=True)
class Recipe:
    """A named training recipe: a default LinearRecipe plus per-module overrides.

    overrides: (glob pattern on the module name, LinearRecipe or None), first match wins; None
    keeps that module in high precision. keep_first_last_blocks: that many transformer blocks
    at each end stay in high precision (modules named `...layers.<i>....`).
    """

    name: str
    linear: LinearRecipe | None
    overrides: tuple[tuple[str, LinearRecipe | None], ...] = ()
    keep_first_last_blocks: int = 0
    note: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.keep_first_last_blocks < 0:
            raise ValueError("keep_first_last_blocks must be >= 0")

    @property
    def quantizes(self) -> bool:
        """Whether any layer is quantized (bf16's recipe quantizes none: the model trains as
        built, and nothing recipe-specific -- conversion, diagnostics -- applies)."""
        return self.linear is not None and (
            self.linear.is_quantized
            or any(lin is not None and lin.is_quantized for _, lin in self.overrides))

    def linear_for(self, module_name: str, n_blocks: int | None = None) -> LinearRecipe | None:
        """The LinearRecipe for a module (None: leave it in high precision)."""
        if self.linear is None:
            return None
        keep = self.keep_first_last_blocks
        if keep and n_blocks:
            match = re.search(r"(?:^|\.)layers\.(\d+)\.", module_name)
            if match and (int(match.group(1)) < keep or int(match.group(1)) >= n_blocks - keep):
                return None
        for pattern, linear in self.overrides:
            if fnmatch.fnmatch(module_name, pattern):
                return linear
        return self.linear


def with_linear(recipe: Recipe, **changes) -> Recipe:
    """A copy of `recipe` whose default LinearRecipe has some fields changed."""
    return replace(recipe, linear=replace(recipe.linear, **changes))
