"""What a quantizer does, as a typed, validated spec: format, block layout, scale rule, rounding.

`QuantSpec` is what recipes and kernels pass around; `lowbit.quantize(x, "mxfp4", ...)` builds
one from its keyword arguments. The set of formats is open (a registry); everything else is
an Enum.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from enum import Enum

from lowbit.formats.elements import (
    BINARY, E2M1, E4M3, E5M2, SEQ2, TERNARY, ElementFormat, int_format, uint_format,
)

__all__ = ["ScaleRule", "Rounding", "ScaleKind", "FormatInfo", "FORMATS", "register_format",
           "get_format", "QuantSpec"]


class ScaleRule(str, Enum):
    """How an MX block's power-of-two scale is chosen from the block's amax."""

    FLOOR = "floor"  # OCP MX v1.0: 2^(floor(log2 amax) - emax_elem); the block max may clip
    RCEIL = "rceil"  # 2^ceil(log2(amax / max_elem)): truncation-free, nothing clips (cuBLAS RCEIL)


class Rounding(str, Enum):
    RNE = "rne"                # round to nearest, ties to even
    STOCHASTIC = "stochastic"  # unbiased: up with probability = distance to lower / grid gap


class ScaleKind(str, Enum):
    """How block scales are computed and stored."""

    E4M3 = "e4m3"        # NVFP4: amax/6 cast to float8_e4m3fn, optionally under an FP32 tensor scale
    E8M0 = "e8m0"        # MX: a power of two, stored as its biased exponent (uint8, 255 = NaN)
    ABSMAX = "absmax"    # intK: float32 amax / qmax
    ABSMEAN = "absmean"  # ternary (BitNet b1.58) and binary (XNOR-Net): float32 mean(|x|)
    MINMAX = "minmax"    # asymmetric intK: float32 (max - min) / (2^K - 1) and a uint8 zero point


@dataclass(frozen=True)
class FormatInfo:
    name: str
    element: ElementFormat
    scale_kind: ScaleKind
    default_block: tuple[int, int]
    description: str


FORMATS: dict[str, FormatInfo] = {}


def register_format(info: FormatInfo) -> FormatInfo:
    if info.name in FORMATS:
        raise ValueError(f"format {info.name!r} is already registered")
    FORMATS[info.name] = info
    return info


def get_format(name: str) -> FormatInfo:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; known formats: {', '.join(FORMATS)}") from None


register_format(FormatInfo("nvfp4", E2M1, ScaleKind.E4M3, (1, 16),
                           "FP4 E2M1, E4M3 scale per 16 values, FP32 tensor scale (NVIDIA)"))
register_format(FormatInfo("mxfp4", E2M1, ScaleKind.E8M0, (1, 32),
                           "FP4 E2M1, power-of-two E8M0 scale per 32 values (OCP MX)"))
register_format(FormatInfo("mxfp8_e4m3", E4M3, ScaleKind.E8M0, (1, 32),
                           "FP8 E4M3, E8M0 scale per 32 values (OCP MX)"))
register_format(FormatInfo("mxfp8_e5m2", E5M2, ScaleKind.E8M0, (1, 32),
                           "FP8 E5M2, E8M0 scale per 32 values (OCP MX)"))
for _bits in (2, 3, 4, 8):
    register_format(FormatInfo(f"int{_bits}", int_format(_bits), ScaleKind.ABSMAX, (1, 128),
                               f"symmetric int{_bits}, float32 absmax scale per group"))
for _bits in (2, 3, 4, 8):
    register_format(FormatInfo(f"int{_bits}_asym", uint_format(_bits), ScaleKind.MINMAX, (1, 128),
                               f"asymmetric int{_bits}: codes 0..{2 ** _bits - 1} with a zero point "
                               "and a float32 (max - min) scale per group"))
register_format(FormatInfo("seq2", SEQ2, ScaleKind.ABSMAX, (1, 128),
                           "2-bit grid without zero, {+-0.5, +-1.5} x amax/1.5 per group (ParetoQ SEQ)"))
register_format(FormatInfo("ternary", TERNARY, ScaleKind.ABSMEAN, (1, 128),
                           "{-1, 0, 1} x mean|x| per group (BitNet b1.58)"))
register_format(FormatInfo("binary", BINARY, ScaleKind.ABSMEAN, (1, 128),
                           "{-1, +1} x mean|x| per group (XNOR-Net)"))


@dataclass(frozen=True)
class QuantSpec:
    """A complete description of one quantizer. Build it with `QuantSpec.make(...)`."""

    format: str
    # (1, b): 1D blocks of b along the last dim; (b, b): square 2D tiles over the last two dims.
    block: tuple[int, int]
    # MX formats only (None elsewhere): how the power-of-two scale is chosen.
    scale_rule: ScaleRule | None = None
    rounding: Rounding = Rounding.RNE
    # NVFP4 only: two-level scaling (E4M3 block scales under an FP32 per-tensor scale).
    tensor_scale: bool = False
    info: FormatInfo = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        info = get_format(self.format)
        object.__setattr__(self, "info", info)
        rows, cols = self.block
        if rows < 1 or cols < 1:
            raise ValueError(f"block {self.block} must have positive sizes")
        if rows != 1 and rows != cols:
            raise ValueError(f"block {self.block}: use (1, b) for 1D blocks or (b, b) for square "
                             "2D tiles (only square tiles make quantize(x.T) == quantize(x).T)")
        per_byte = 8 // info.element.code_bits
        if cols % per_byte:
            raise ValueError(f"{self.format} packs {per_byte} codes per byte, so the block size "
                             f"must be a multiple of {per_byte}; got {self.block}")
        if info.scale_kind is ScaleKind.E8M0:
            if self.scale_rule is None:
                raise ValueError(f"{self.format} needs a scale_rule ('floor' or 'rceil')")
        elif self.scale_rule is not None:
            raise ValueError(f"scale_rule applies to MX formats only; {self.format} has "
                             f"{info.scale_kind.value} scales (leave scale_rule unset)")
        if self.rounding is Rounding.STOCHASTIC and info.element is SEQ2:
            raise ValueError(f"stochastic rounding is not defined for {self.format} (a grid "
                             "without zero); use rounding='rne'")
        if self.tensor_scale and info.scale_kind is not ScaleKind.E4M3:
            raise ValueError(f"tensor_scale applies to nvfp4 only, not {self.format}")

    @classmethod
    def make(cls, format: str, block: tuple[int, int] | None = None,
             scale_rule: str | ScaleRule | None = None, rounding: str | Rounding = "rne",
             tensor_scale: bool | None = None) -> QuantSpec:
        """Fill per-format defaults: nvfp4 (1, 16) two-level; MX (1, 32) 'floor'; int (1, 128)."""
        info = get_format(format)
        if block is None:
            block = info.default_block
        elif (not isinstance(block, (tuple, list)) or len(block) != 2
              or not all(isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in block)):
            raise ValueError(f"block must be a pair of integers (1, b) or (b, b), got {block!r}")
        if tensor_scale and info.scale_kind is not ScaleKind.E4M3:
            raise ValueError(f"tensor_scale applies to nvfp4 only; {format} has "
                             f"{info.scale_kind.value} block scales and no tensor scale (leave "
                             f"tensor_scale unset)")
        if scale_rule is None and info.scale_kind is ScaleKind.E8M0:
            scale_rule = ScaleRule.FLOOR
        if tensor_scale is None:
            tensor_scale = info.scale_kind is ScaleKind.E4M3
        return cls(format, (int(block[0]), int(block[1])),
                   parse_enum(ScaleRule, scale_rule, "scale_rule") if scale_rule is not None else None,
                   parse_enum(Rounding, rounding, "rounding"), bool(tensor_scale))

    @property
    def is_2d(self) -> bool:
        return self.block[0] > 1

    def to_dict(self) -> dict:
        return {"format": self.format, "block": list(self.block),
                "scale_rule": self.scale_rule.value if self.scale_rule else None,
                "rounding": self.rounding.value, "tensor_scale": self.tensor_scale}

    @classmethod
    def from_dict(cls, d: dict) -> QuantSpec:
        two_level = d.get("tensor_scale") if get_format(d["format"]).scale_kind is ScaleKind.E4M3 else None
        return cls.make(d["format"], tuple(d["block"]), d.get("scale_rule"),
                        d.get("rounding", "rne"), two_level)


def parse_enum(kind, value, what: str):
    """kind(value), or a ValueError that lists the valid values."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in kind)
        raise ValueError(f"unknown {what} {value!r}; use one of {choices}") from None
