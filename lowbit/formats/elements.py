"""Element formats: the number grids a quantized value lives on, and how values round onto them.

Every cast here is written from the format's definition (sign, exponent bits, mantissa bits,
bias, maximum), not copied from a reference implementation, so that the test suite can
compare it against independent ones (torch's float8 dtypes, ml_dtypes' float4_e2m1fn,
torchao).

Minifloats (e2m1, e4m3, e5m2) round in one step: for |x| with binade exponent
e = max(floor(log2|x|), emin) the grid spacing is 2^(e - mbits); |x| / spacing is exact (a
power-of-two scaling of a float32), so rounding that ratio to an integer -- half to even
(`torch.round`), or floor(ratio + u) with u ~ U[0, 1) for stochastic rounding -- rounds x
once, then saturation clamps to the format's largest finite value. Integer grids are the
same with spacing 1.

Codes (what is stored):
- e2m1: sign << 3 | index into {0, 0.5, 1, 1.5, 2, 3, 4, 6} (the NVIDIA/OCP FP4 encoding);
- e4m3 / e5m2: the float8 bit pattern (torch.float8_e4m3fn / float8_e5m2 viewed as uint8);
- intK: two's complement in K bits; ternary: two's complement in 2 bits; binary: 1 = +1, 0 = -1;
- uintK (asymmetric intK, whose blocks carry a zero point z): the unsigned code q, standing for
  the value q - z (the grid values here are the signed q - z; lowbit.formats.quantize adds z);
- seq2 (ParetoQ's 2-bit grid without zero, {-1.5, -0.5, 0.5, 1.5}): code = value + 1.5.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "ElementFormat",
    "E2M1",
    "E4M3",
    "E5M2",
    "E2M1_VALUES",
    "int_format",
    "TERNARY",
    "BINARY",
    "SEQ2",
    "uint_format",
    "round_to_grid",
    "encode",
    "decode",
    "device_table",
    "e8m0_to_float",
    "pack_codes",
    "unpack_codes",
]


@dataclass(frozen=True)
class ElementFormat:
    """A grid of representable element values.

    A minifloat has `ebits` > 0; an integer grid has `ebits` == 0 and values
    -max_value..max_value in steps of 1 (binary excludes 0).
    """

    name: str
    ebits: int          # exponent bits (0 for integer grids)
    mbits: int          # mantissa bits (for integer grids: magnitude bits)
    max_value: float    # largest finite magnitude; everything beyond saturates to it
    code_bits: int      # bits one code takes in storage (packing width)
    has_zero: bool = True

    @property
    def is_float(self) -> bool:
        return self.ebits > 0

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal binade (minifloats only)."""
        return 2 - 2 ** (self.ebits - 1)

    @property
    def emax(self) -> int:
        """Exponent of the largest binade: floor(log2(max_value))."""
        return math.floor(math.log2(self.max_value))


# e2m1: bias 1, no inf/nan, max 1.5 * 2^2 = 6.
E2M1 = ElementFormat("e2m1", ebits=2, mbits=1, max_value=6.0, code_bits=4)
# e4m3 "fn": bias 7, no infinities, S.1111.111 is NaN, so the max is 1.75 * 2^8 = 448.
E4M3 = ElementFormat("e4m3", ebits=4, mbits=3, max_value=448.0, code_bits=8)
# e5m2: bias 15, IEEE-like; the max finite value is 1.75 * 2^15 = 57344.
E5M2 = ElementFormat("e5m2", ebits=5, mbits=2, max_value=57344.0, code_bits=8)
TERNARY = ElementFormat("ternary", ebits=0, mbits=1, max_value=1.0, code_bits=2)
BINARY = ElementFormat("binary", ebits=0, mbits=1, max_value=1.0, code_bits=1, has_zero=False)
# The half-integer grid {-1.5, -0.5, 0.5, 1.5}: four levels, none wasted on a zero or on an
# unpaired -2 (ParetoQ's "SEQ"; with a scale s the values are {+-0.5, +-1.5} * s).
SEQ2 = ElementFormat("seq2", ebits=0, mbits=1, max_value=1.5, code_bits=2, has_zero=False)

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def int_format(bits: int) -> ElementFormat:
    """Symmetric signed integer grid -(2^(K-1)-1)..2^(K-1)-1 (the code -2^(K-1) is unused,
    so the grid is symmetric and a sign flip of the input flips the output exactly)."""
    if not 2 <= bits <= 8:
        raise ValueError(f"int formats take 2..8 bits, got {bits}")
    container = 8 if bits > 4 else (4 if bits > 2 else 2)  # int3 is stored in a nibble
    return ElementFormat(f"int{bits}", ebits=0, mbits=bits - 1,
                         max_value=float(2 ** (bits - 1) - 1), code_bits=container)


def uint_format(bits: int) -> ElementFormat:
    """Unsigned K-bit codes 0..2^K-1 of an asymmetric grid (a zero point per block shifts
    them); max_value is the largest code."""
    if not 2 <= bits <= 8:
        raise ValueError(f"int formats take 2..8 bits, got {bits}")
    container = 8 if bits > 4 else (4 if bits > 2 else 2)
    return ElementFormat(f"uint{bits}", ebits=0, mbits=bits, max_value=float(2 ** bits - 1),
                         code_bits=container)


def _grid_steps(mag: torch.Tensor, fmt: ElementFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(spacing, 1 / spacing) of fmt's grid around each float32 magnitude in [0, max_value]:
    spacing = 2^(max(floor(log2 mag), emin) - mbits), both exact powers of two.

    On the bits: a normal float32's exponent field is floor(log2 mag) + 127 exactly (no log2
    rounding); zeros and subnormals give 0, below every format's emin + 127, so the clamp
    takes them to emin as it should; NaN's field (255) gives a finite power of two, and NaN
    stays NaN through the ratio. Every exponent here is a normal float32 one, so the powers of
    two are built on their bits too, and 1 / 2^e is 2^-e: bits (254 << 23) - bits(2^e)."""
    biased = torch.clamp(mag.view(torch.int32) >> 23, min=fmt.emin + 127) - fmt.mbits
    spacing_bits = biased << 23
    return spacing_bits.view(torch.float32), ((254 << 23) - spacing_bits).view(torch.float32)


def round_to_grid(x: torch.Tensor, fmt: ElementFormat, rounding: str = "rne",
                  noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round float32 `x` onto fmt's grid (returned as float32 values, saturated).

    rounding="rne": nearest, ties to the even neighbour (for e2m1: the even code index).
    rounding="stochastic": up with probability (|x| - lower) / (upper - lower); `noise` holds
    the uniform draws u in [0, 1), one per element. NaN stays NaN. Inf saturates here; the
    block-scaling layer is what keeps Inf from becoming finite silently.

    Signs: -0.0 inputs and negative values that round to 0 keep their sign (FP4 code 0b1000),
    as torchao and the hardware converts do. Round-to-nearest works on the signed value (its
    ties to even are symmetric, and x * 2^k keeps the sign of zero); stochastic rounding on
    the magnitude, the sign copied back. The grid's largest value is on the grid, so a
    magnitude clamped to it never rounds to nearest past it.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"round_to_grid takes float32, got {x.dtype}")
    if fmt is BINARY:  # the sign, with 0 going to +1 (NaN stays NaN)
        return torch.where(x < 0, -1.0, torch.where(torch.isnan(x), x, 1.0))
    if fmt is SEQ2:
        # the nearest half-integer of |x|, ties (|x| an integer) away from zero, the sign
        # copied back (0 and -0 go to +0.5 and -0.5): a sign flip of x flips the result exactly
        mag = torch.clamp(torch.floor(x.abs()) + 0.5, max=fmt.max_value)
        return torch.copysign(mag, x)
    saturated = torch.clamp(x, -fmt.max_value, fmt.max_value)  # clamp keeps NaN
    if fmt.is_float:
        spacing, inverse = _grid_steps(saturated.abs(), fmt)
    else:
        spacing = inverse = None                                # spacing 1 everywhere
    if rounding == "rne":
        ratio = saturated if inverse is None else saturated * inverse  # exact: a power of two
        steps = torch.round(ratio)
        return steps if spacing is None else steps * spacing
    if rounding != "stochastic":
        raise ValueError(f"unknown rounding {rounding!r}: use 'rne' or 'stochastic'")
    if noise is None:
        raise ValueError("stochastic rounding needs `noise` (uniform draws in [0, 1))")
    mag = saturated.abs()
    # the float32 sum ratio + u can round up to the next integer (u = 1 - 2^-24 at an on-grid
    # value): one step past the largest value, which saturates
    steps = torch.floor((mag if inverse is None else mag * inverse) + noise)
    out = torch.clamp(steps if spacing is None else steps * spacing, max=fmt.max_value)
    return torch.copysign(out, x)


def device_table(device: torch.device, tables: dict[torch.device, torch.Tensor],
                 make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A constant table on `device`: `make()` copied there on first use and kept in `tables`
    for the process. No copy from the host at every call, which would wait for the GPU's queue
    and stop a CUDA graph's capture; and the same tensor for a captured graph (a weight sync)
    that reads it at every replay."""
    table = tables.get(device)
    if table is None:
        table = tables[device] = make().to(device)
    return table


_E2M1_TABLE = torch.tensor(E2M1_VALUES, dtype=torch.float32)
_E2M1_TABLES: dict[torch.device, torch.Tensor] = {}   # E2M1's magnitudes on each device


def _e2m1_table(device: torch.device) -> torch.Tensor:
    return device_table(device, _E2M1_TABLES, lambda: _E2M1_TABLE)


def encode(values: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Codes (uint8) of float32 values that already lie on fmt's grid (see module docstring)."""
    if fmt is E2M1:
        mag = values.abs()
        index = torch.bucketize(mag.contiguous(), _e2m1_table(values.device))  # exact hits: the grid index
        index = torch.where(torch.isnan(mag), torch.zeros_like(index), index)
        negative = torch.signbit(values).to(torch.uint8)
        return (negative << 3) | index.to(torch.uint8)
    if fmt is E4M3:
        return values.to(torch.float8_e4m3fn).view(torch.uint8)
    if fmt is E5M2:
        return values.to(torch.float8_e5m2).view(torch.uint8)
    if fmt is BINARY:
        return (values > 0).to(torch.uint8)
    if fmt is SEQ2:
        return torch.nan_to_num(values + 1.5).to(torch.uint8)
    # integers (ternary too): two's complement in code_bits (int3 uses a 4-bit container)
    ints = torch.nan_to_num(values).to(torch.int16)
    return (ints & ((1 << fmt.code_bits) - 1)).to(torch.uint8)


def decode(codes: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """float32 values of uint8 codes."""
    if fmt is E2M1:
        mag = _e2m1_table(codes.device)[(codes & 0x7).long()]
        return torch.where((codes & 0x8) != 0, -mag, mag)
    if fmt is E4M3:
        return codes.view(torch.float8_e4m3fn).to(torch.float32)
    if fmt is E5M2:
        return codes.view(torch.float8_e5m2).to(torch.float32)
    if fmt is BINARY:
        return codes.to(torch.float32) * 2 - 1
    if fmt is SEQ2:
        return codes.to(torch.float32) - 1.5
    if fmt.name.startswith("uint"):
        return codes.to(torch.float32)
    ints = codes.to(torch.int16)
    top = 1 << (fmt.code_bits - 1)
    ints = torch.where(ints >= top, ints - (1 << fmt.code_bits), ints)
    return ints.to(torch.float32)


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 scale codes (uint8) -> float32 2^(code - 127); 255 is NaN.

    2^-127 is a float32 subnormal and is kept exactly (no flush to 2^-126).
    """
    value = torch.ldexp(torch.ones(codes.shape, dtype=torch.float32, device=codes.device),
                        codes.to(torch.int32) - 127)
    return torch.where(codes == 255, torch.full_like(value, float("nan")), value)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes of `bits` bits (1, 2, 4 or 8) along the last dim, first element in the
    lowest bits (for FP4: the even element in the low nibble, as ModelOpt/compressed-tensors).
    The last dim must be a multiple of 8 // bits."""
    if bits == 8:
        return codes.contiguous()
    per_byte = 8 // bits
    if codes.shape[-1] % per_byte:
        raise ValueError(f"last dim {codes.shape[-1]} is not a multiple of {per_byte}")
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    packed = torch.zeros(grouped.shape[:-1], dtype=torch.uint8, device=codes.device)
    for slot in range(per_byte):
        packed |= grouped[..., slot] << (slot * bits)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_codes: the last dim grows by 8 // bits."""
    if bits == 8:
        return packed
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    slots = [(packed >> (slot * bits)) & mask for slot in range(per_byte)]
    return torch.stack(slots, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)
