"""A weight format as people write it: `int2:g64`, `int4:row:asym`, `ternary`, `nvfp4`,
`mxfp4:rceil`, `nvfp4:16x16`: one grammar for every command that names one (`lowbit qat
--weights`, `lowbit export --format`, `lowbit inspect --formats`, QAT's setting strings).

    FORMAT  = NAME (":" OPTION)*
    NAME    = a lowbit.formats format: int2 | int3 | int4 | int8 | ternary | binary | seq2 |
              nvfp4 | mxfp4 | mxfp8_e4m3 | mxfp8_e5m2 (int4_asym is int4:asym), or bf16 (none)
    OPTION  = gG      one scale per G consecutive inputs of a row (blocks of 1 x G)
            | row     one scale per output row (blocks of 1 x in_features)
            | RxC     blocks of R x C (R = 1, or square 2D tiles such as 16x16)
            | asym    intK: codes 0..2^K-1 and a zero point per block
            | floor | rceil   MX formats' E8M0 scale rule (default floor)
            | single  nvfp4 without its FP32 tensor scale
            | sr      stochastic rounding

Left out, the block is the format's own (int, ternary, binary, seq2: 1 x 128; nvfp4 1 x 16;
MX 1 x 32). `parse_weight_format` reads every option; each command then keeps what it supports
(`WeightFormat.refuse`, one line naming the option and what to write instead): QAT trains
1 x G or row blocks, an export writes the layouts servers read, inspect takes everything.
`str()` writes the canonical form back, which parses to the same format.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from lowbit.formats.spec import FORMATS, QuantSpec

__all__ = ["WeightFormat", "parse_weight_format", "names_block"]

_TILE = re.compile(r"^(\d+)x(\d+)$")
_GROUP = re.compile(r"^g(\d+)$")


@dataclass(frozen=True)
class WeightFormat:
    name: str                               # a lowbit.formats format without "_asym", or "bf16"
    block: tuple[int, int] | None = None    # None: the format's own (filled in); with row: None
    row: bool = False                       # one scale per output row
    asym: bool = False                      # intK only: codes 0..2^K-1 and a zero point
    scale_rule: str | None = None           # MX formats: "floor" (None) or "rceil"
    tensor_scale: bool = True               # nvfp4: False drops the FP32 tensor scale
    stochastic: bool = False                # stochastic rounding

    def __post_init__(self) -> None:
        if self.row or self.name == "bf16":
            object.__setattr__(self, "block", None)
        elif self.block is None:
            object.__setattr__(self, "block", FORMATS[self.format_name].default_block)

    @property
    def grid(self) -> str:
        """The value grid: "int" for intK, else the name ("ternary", "nvfp4", "bf16", ...)."""
        return "int" if self.is_int else self.name

    @property
    def is_int(self) -> bool:
        return self.name.startswith("int")

    @property
    def bits(self) -> int | None:
        """intK's K; None for the other grids."""
        return int(self.name[3:]) if self.is_int else None

    @property
    def data_scaled(self) -> bool:
        """nvfp4 / MX: block scales come from the weight at every quantization (E4M3 or E8M0
        scales, nothing a QAT run could learn)."""
        return self.name == "nvfp4" or self.name.startswith("mx")

    @property
    def format_name(self) -> str:
        """The lowbit.formats format of the quantized weights ("int4_asym", "nvfp4", ...)."""
        return self.name + ("_asym" if self.asym else "")

    @property
    def group(self) -> int | None:
        """Inputs per scale of 1D blocks; None for one scale per row (and for 2D tiles)."""
        if self.block is None:
            return None
        return self.block[1] if self.block[0] == 1 else None

    def spec(self, in_features: int | None = None) -> QuantSpec:
        """The QuantSpec of a weight with `in_features` inputs (needed for `row` only)."""
        if self.name == "bf16":
            raise ValueError("bf16 is no quantization and has no QuantSpec")
        if self.row and in_features is None:
            raise ValueError(f"{self}: `row` blocks need the weight's in_features")
        block = (1, in_features) if self.row else self.block
        return QuantSpec.make(self.format_name, block=block, scale_rule=self.scale_rule,
                              rounding="stochastic" if self.stochastic else "rne",
                              tensor_scale=None if self.tensor_scale else False)

    def check_layer(self, name: str, in_features: int) -> None:
        """A ValueError naming the layer if its inputs do not fill whole blocks."""
        if self.name == "bf16":
            return
        size = self.spec(in_features).block[1]
        if in_features % size:
            if self.data_scaled:
                raise ValueError(f"{self.name}'s blocks of {size} do not divide {name}'s "
                                 f"{in_features} inputs; leave it out (module_filter_fn)")
            raise ValueError(f"group size {size} does not divide {name}'s {in_features} "
                             f"inputs; pick a divisor (e.g. g{math.gcd(in_features, size)}) "
                             "or `row`")

    def options(self) -> list[str]:
        """The options `str` writes: the block always for the formats whose scales a job may
        group (intK, ternary, binary, seq2), only a block not the format's own for nvfp4 and
        MX; then the others given."""
        out = []
        if self.row:
            out.append("row")
        elif self.block is not None and (not self.data_scaled or self.block != FORMATS[
                self.format_name].default_block):
            r, c = self.block
            out.append(f"g{c}" if r == 1 else f"{r}x{c}")
        out += (["asym"] if self.asym else []) + ([self.scale_rule] if self.scale_rule else [])
        out += (["single"] if not self.tensor_scale else []) + (["sr"] if self.stochastic else [])
        return out

    def refuse(self, what: str, allowed: set[str], hint: str) -> None:
        """Refuse (ValueError, one line) the options outside `allowed` ("group" for gG and
        row, "tile" for RxC, "asym", "scale_rule", "single", "sr"): `what` names the command,
        `hint` says what to write instead."""
        kinds = {"row": "group", "asym": "asym", "floor": "scale_rule", "rceil": "scale_rule",
                 "single": "single", "sr": "sr"}
        for option in self.options():
            kind = kinds.get(option, "group" if option.startswith("g") else "tile")
            if kind not in allowed:
                raise ValueError(f"{what} takes no `{option}` ({self}); {hint}")

    def __str__(self) -> str:
        return ":".join([self.name, *self.options()])


def names_block(text: str) -> bool:
    """Whether a format's text gives its block (gG, row or RxC): a job whose default block is
    not the format's own (an int8 export: one scale per row) applies it only where not."""
    options = [p.strip() for p in str(text).strip().lower().split(":")[1:]]
    return any(o == "row" or _GROUP.match(o) or _TILE.match(o) for o in options)


def parse_weight_format(text: str, where: str = "", check_block: bool = True) -> WeightFormat:
    """'int2:g64' -> WeightFormat('int2', (1, 64)); see the module docstring. A malformed
    format is a ValueError with one line that says what to write; `where` names the flag in it
    (" in --formats"). check_block False leaves a block the format cannot take (int2:g33) to
    the caller, whose own rule may say more."""
    parts = [p.strip() for p in str(text).strip().lower().split(":")]
    name, options = parts[0], parts[1:]
    asym = name.endswith("_asym") and name in FORMATS
    if asym:
        name = name[: -len("_asym")]
    if name != "bf16" and name not in FORMATS:
        known = ", ".join(n for n in FORMATS if not n.endswith("_asym"))
        raise ValueError(f"unknown format {text!r}{where}; use one of {known} (options gG, row, "
                         f"RxC, asym, floor, rceil, single, sr), e.g. int2:g64")
    if name == "bf16" and options:
        raise ValueError("bf16 is no quantization and takes no options; write plain bf16")
    fields: dict = {}
    for option in options:
        group, tile = _GROUP.match(option), _TILE.match(option)
        if option == "row" or group or tile:
            if "block" in fields or fields.get("row"):
                raise ValueError(f"{text!r} names its blocks twice; give one of gG, row or RxC")
            if option == "row":
                fields["row"] = True
            else:
                size = (1, int(group[1])) if group else (int(tile[1]), int(tile[2]))
                if min(size) < 1:
                    raise ValueError(f"block {option!r} in {text!r} is empty; use a positive size")
                fields["block"] = size
        elif option == "asym":
            if not name.startswith("int"):
                raise ValueError(f"{text!r}: `asym` applies to intK only")
            asym = True
        elif option in ("floor", "rceil"):
            if not name.startswith("mx"):
                raise ValueError(f"{text!r}: `{option}` is a scale_rule, and scale_rule "
                                 f"applies to MX formats only; leave it out for {name}")
            fields["scale_rule"] = None if option == "floor" else option
        elif option == "single":
            if name != "nvfp4":
                raise ValueError(f"{text!r}{where}: tensor_scale applies to nvfp4 only (`single` "
                                 f"drops NVFP4's tensor scale); leave it out for {name}")
            fields["tensor_scale"] = False
        elif option == "sr":
            fields["stochastic"] = True
        else:
            raise ValueError(f"unknown option {option!r} in {text!r}{where}; use gG (e.g. g64), row, "
                             f"RxC (e.g. 16x16), asym, floor, rceil, single or sr")
    fmt = WeightFormat(name, asym=asym, **fields)
    if check_block and name != "bf16" and not fmt.row:
        try:
            fmt.spec()   # a block the format cannot take (e.g. 16x32): refused here
        except ValueError as e:
            raise ValueError(f"weight format {text!r}{where}: {e}") from None
    return fmt
