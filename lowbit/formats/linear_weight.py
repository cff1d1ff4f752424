"""LinearWeight: a linear layer's weight as an inference GEMM reads it -- dense, FP8 or packed
NVFP4 -- for one projection, several fused along out_features, or a stack of experts.

    w = LinearWeight.from_qtensors([q_q, q_k, q_v], dtype=torch.bfloat16)   # q|k|v, NVFP4
    w.dequantize()              # (N, K) in bf16: each part's QTensor.dequantize(), bit for bit
    experts = LinearWeight.stack([w_0, w_1, ...])                          # (E, N, K)

The codes and scales are the QTensors' own bytes, concatenated; nothing is re-encoded:

| format  | data                                  | block_scales                  | row_scales     |
| ------- | ------------------------------------- | ----------------------------- | -------------- |
| `dense` | (.., N, K) in the compute dtype       | --                            | --             |
| `fp8`   | (.., N, K) uint8, E4M3 bits           | --                            | (.., N) fp32, 2^e |
| `nvfp4` | (.., N, Kp/2) uint8, two E2M1 a byte  | (.., N, Kp/16) float8_e4m3fn  | (.., N) fp32   |

Kp is K padded to a whole number of 16-blocks (the QTensor's own padding). An NVFP4 part's
FP32 tensor scale becomes the row scale of each of its rows, so parts quantized on their own
(q, k and v each with its own tensor scale, as the trainer fake-quantizes them) share one
GEMM; an FP8 row's scale is its E8M0 block scale (one block spans the row) as a float.

Values, in float32 and then rounded once to the compute dtype, in QTensor.dequantize's order:
nvfp4 `e2m1(code) * (row_scale * e4m3(block_scale))`, fp8 `e4m3(code) * row_scale`.

What a GEMM on the weight multiplies (`reference_values`): dense and FP8, the dequantized
values (FP8's are exact in the compute dtype); NVFP4, its exact values in float32 -- an NVFP4
GEMM multiplies e2m1 * e4m3 * tensor_scale with exact products and float32 sums, as FP4 tensor
cores do (lowbit.kernels.engine_linear, on the tiles made by `tiles()`), not the weight rounded
to the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from lowbit.formats.elements import E2M1, E4M3, decode, e8m0_to_float, unpack_codes
from lowbit.formats.nvfp4_tiles import NVFP4Tiles, TilesMaker, nvfp4_tiles
from lowbit.formats.qtensor import QTensor, saturate_to
from lowbit.formats.spec import ScaleKind

__all__ = ["LinearWeight", "WeightStorage"]


class WeightStorage(str, Enum):
    DENSE = "dense"
    FP8 = "fp8"
    NVFP4 = "nvfp4"


@dataclass
class LinearWeight:
    format: WeightStorage
    data: torch.Tensor
    """dense: the values; fp8: E4M3 bits; nvfp4: packed E2M1 codes (see the module doc)."""
    block_scales: torch.Tensor | None
    """nvfp4: (.., N, Kp/16) float8_e4m3fn; None otherwise."""
    row_scales: torch.Tensor | None
    """fp8, nvfp4: (.., N) float32; None for dense."""
    in_features: int
    dtype: torch.dtype
    """The compute dtype: what dequantize() and a GEMM on this weight give."""
    _saturates: bool | None = field(init=False, default=None, repr=False)
    _values: torch.Tensor | None = field(init=False, default=None, repr=False)
    _tiles: NVFP4Tiles | None = field(init=False, default=None, repr=False)
    _make_tiles: TilesMaker | None = field(init=False, default=None, repr=False)

    @property
    def may_saturate(self) -> bool:
        """Some value may reach the compute dtype's largest finite value, where dequantize()
        saturates (False when every row scale times the format's largest element is below it,
        so a kernel may skip the clamp). Read from the device on first use; `settle` reads it
        for many weights at once."""
        if self._saturates is None:
            LinearWeight.settle([self])
        return self._saturates

    @property
    def settled(self) -> bool:
        """Whether may_saturate is known (read from the device) already."""
        return self._saturates is not None

    @staticmethod
    def settle(weights: list[LinearWeight], maxima: list[float] | None = None) -> None:
        """Fix may_saturate for every weight not yet settled, with one read from each device
        for all of them (a weight sync makes hundreds of weights; one read each would stall
        the GPU's queue as many times). maxima: `row_scale_maxima(weights)` read already (a
        captured weight sync computes it in its graph): every weight's flag is set from it,
        settled or not."""
        if maxima is not None:
            scaled = [w for w in weights if w.has_row_scales]
            if len(scaled) != len(maxima):
                raise ValueError(f"{len(maxima)} maxima for {len(scaled)} weights with row scales")
            for w in weights:
                w._saturates = False
            for w, top in zip(scaled, maxima):
                w._saturates = w._saturates_at(top)
            return
        todo: dict[torch.device, list[LinearWeight]] = {}
        for w in weights:
            if w._saturates is not None:
                continue
            if not w.has_row_scales:
                w._saturates = False
            else:
                todo.setdefault(w.row_scales.device, []).append(w)
        for group in todo.values():
            for w, top in zip(group, LinearWeight.row_scale_maxima(group).tolist()):
                w._saturates = w._saturates_at(top)

    @staticmethod
    def row_scale_maxima(weights: list[LinearWeight]) -> torch.Tensor | None:
        """(n,) float32: the largest |row scale| of each weight that has row scales, in order,
        on their device (one device); None where none has. What `settle` reads."""
        scaled = [w.row_scales.abs().max().float() for w in weights if w.has_row_scales]
        return torch.stack(scaled) if scaled else None

    def forget_saturation(self) -> None:
        """may_saturate is read from the device again on next use (or by `settle`): what this
        object knew of its tensors no longer holds (a weight sync captured in a CUDA graph:
        its copy_ calls were recorded, not run)."""
        self._saturates = None

    @property
    def has_row_scales(self) -> bool:
        return self.row_scales is not None and self.row_scales.numel() > 0

    def _saturates_at(self, top: float) -> bool:
        # the largest value, row scale times the format's largest element, reaches the
        # compute dtype's largest finite one (NaN: True)
        element_max = 448.0 * 6.0 if self.format is WeightStorage.NVFP4 else 448.0
        return not top * element_max < torch.finfo(self.dtype).max

    # ---- building ------------------------------------------------------------------------

    @classmethod
    def dense(cls, weight: torch.Tensor) -> LinearWeight:
        """A weight kept in its own dtype (the bf16 mode)."""
        return cls(WeightStorage.DENSE, weight, None, None, weight.shape[-1], weight.dtype)

    @classmethod
    def from_qtensors(cls, parts: list[QTensor], dtype: torch.dtype) -> LinearWeight:
        """Parts (N_i, K) of one format (NVFP4 1x16 with a tensor scale, or FP8 with one E8M0
        block per row), fused along N in order."""
        first = parts[0]
        k = first.shape[-1]
        if any(len(p.shape) != 2 or p.shape[-1] != k for p in parts):
            raise ValueError("fused parts need 2-D shapes with the same in_features")
        kind, block = first.spec.info.scale_kind, first.spec.block
        rows = [p.shape[0] for p in parts]
        if first.format == "nvfp4" and block == (1, 16) and first.tensor_scale is not None:
            row_scales = torch.cat([p.tensor_scale.float().reshape(1).expand(n)
                                    for p, n in zip(parts, rows)])
            return cls(WeightStorage.NVFP4, torch.cat([p.codes for p in parts]),
                       torch.cat([p.scales for p in parts]), row_scales, k, dtype)
        if first.format == "mxfp8_e4m3" and kind is ScaleKind.E8M0 and block == (1, k):
            row_scales = torch.cat([e8m0_to_float(p.scales).reshape(-1) for p in parts])
            return cls(WeightStorage.FP8, torch.cat([p.codes for p in parts]), None, row_scales,
                       k, dtype)
        raise ValueError(f"LinearWeight holds NVFP4 1x16 (with a tensor scale) or FP8 row-scaled "
                         f"weights; got {first.format} with blocks {block}")

    @classmethod
    def stack(cls, experts: list[LinearWeight]) -> LinearWeight:
        """Experts of one shape and format stacked along a new leading dim: (E, N, ...)."""
        first = experts[0]
        if any(e.format is not first.format or e.data.shape != first.data.shape for e in experts):
            raise ValueError("stacked experts need one format and shape")

        def stacked(name):
            parts = [getattr(e, name) for e in experts]
            return None if parts[0] is None else torch.stack(parts)
        return cls(first.format, stacked("data"), stacked("block_scales"), stacked("row_scales"),
                   first.in_features, first.dtype)

    # ---- reading -------------------------------------------------------------------------

    @property
    def out_features(self) -> int:
        return self.data.shape[-2]

    @property
    def n_experts(self) -> int | None:
        """E for a stack of experts, None for one weight."""
        return self.data.shape[0] if self.data.dim() == 3 else None

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes a GEMM reads: data, block scales and row scales."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.block_scales, self.row_scales)
                   if t is not None)

    def expert(self, e: int) -> LinearWeight:
        """Expert e of a stack (views)."""
        def pick(t):
            return None if t is None else t[e]
        return LinearWeight(self.format, self.data[e], pick(self.block_scales),
                            pick(self.row_scales), self.in_features, self.dtype)

    @torch.no_grad()
    def copy_(self, other: LinearWeight) -> None:
        """Take other's stored weight into this one's tensors, in place (the same format, shapes
        and dtype): what was built on this weight -- a CUDA graph reading its pointers -- stays
        valid. What was made from it -- reference_values(), tiles() -- is refreshed in place too.
        may_saturate becomes other's, read from the device on next use (or by `settle`, for many
        weights at once) where other's is not known: a kernel that took the flag as a constant
        is the caller's to compare (a weight sync copies hundreds of weights, and reading each
        one's flag here would stall the device's queue as many times)."""
        if (other.format is not self.format or other.data.shape != self.data.shape
                or other.dtype != self.dtype):
            raise ValueError(f"copy_ needs the same format, shape and dtype (got "
                             f"{other.format.value} {tuple(other.data.shape)} {other.dtype} for "
                             f"{self.format.value} {tuple(self.data.shape)} {self.dtype})")
        for mine, theirs in ((self.data, other.data), (self.block_scales, other.block_scales),
                             (self.row_scales, other.row_scales)):
            if mine is not None:
                mine.copy_(theirs)
        self._saturates = other._saturates
        if self._values is not None:   # other's, where it made them already
            self._values.copy_(other._values if other._values is not None else other._gemm_values())
        if self._tiles is not None:   # re-laid from the new bytes, into the same tensors
            self._make_tiles(self.data, self.block_scales, self.row_scales, self.in_features,
                             out=self._tiles)

    def reference_values(self) -> torch.Tensor:
        """What a GEMM on this weight multiplies (the module doc): dequantize(), or for NVFP4
        its exact values in float32 (e2m1 * e4m3, exact, times the tensor scale: one rounding,
        as the kernel's); kept after the first call, as the operand of a reference
        GEMM that runs many times on one weight (a kernel that reads the stored form never
        asks for it, so no dequantized copy is made there)."""
        if self._values is None:
            self._values = self._gemm_values()
        return self._values

    @property
    def made_forms(self) -> tuple[bool, bool]:
        """Which forms made from the stored weight on first use exist: (tiles(),
        reference_values()). A copy_ refreshes those that exist, so a captured weight sync
        made before one of them existed would not refresh it."""
        return self._tiles is not None, self._values is not None

    def _gemm_values(self) -> torch.Tensor:
        if self.format is not WeightStorage.NVFP4:
            return self.dequantize()
        # e2m1 * e4m3 is exact in float32; times the tensor scale, rounded once
        elements, blocks = self._nvfp4_parts(self.block_scales.to(torch.float32))
        return (elements * blocks) * self.row_scales[..., None]

    def _nvfp4_parts(self, block_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the E2M1 element values, the given per-block scales spread over their 16 columns),
        both (.., N, K) float32."""
        k = self.in_features
        codes = unpack_codes(self.data, E2M1.code_bits)[..., :k]
        return decode(codes, E2M1), block_scales.repeat_interleave(16, dim=-1)[..., :k]

    def tiles(self, make: TilesMaker = nvfp4_tiles) -> NVFP4Tiles:
        """An NVFP4 weight re-laid for the tensor-core GEMM (lowbit.formats.nvfp4_tiles), made
        on the first call by `make` -- the reference, or a kernel that writes the same bits
        (lowbit.kernels.nvfp4_tiles_triton, which the GEMM's kernel passes) -- and re-laid in
        place at each copy_ (a weight sync) by that first call's `make`: a later call's `make`
        is not used (the bits are the same whichever made them)."""
        if self.format is not WeightStorage.NVFP4:
            raise ValueError(f"tiles() re-lays NVFP4 weights (this one is {self.format.value})")
        if self._tiles is None:
            self._tiles = make(self.data, self.block_scales, self.row_scales, self.in_features)
            self._make_tiles = make
        return self._tiles

    def flatten(self) -> tuple[list[torch.Tensor | None], tuple[str, int, bool]]:
        """The weight as six tensors (data, block scales, row scales, and its NVFP4 tiles'
        words, scales and row scales, None where there are none) and three constants (format,
        in_features, may_saturate): how it crosses the boundary of a custom operator
        (lowbit.kernels.engine_ops), whose arguments are tensors and plain values.
        `unflatten` makes it again with what was made from it on first use (its saturation,
        its tiles), so nothing is read or made a second time."""
        t = self._tiles
        tiles = [None] * 3 if t is None else [t.words, t.scales, t.row_scales]
        return ([self.data, self.block_scales, self.row_scales, *tiles],
                (self.format.value, self.in_features, self.may_saturate))

    @classmethod
    def unflatten(cls, tensors: list[torch.Tensor | None], constants: tuple[str, int, bool],
                  dtype: torch.dtype) -> LinearWeight:
        """flatten's inverse: the same tensors (not copies) in a new LinearWeight."""
        data, block_scales, row_scales, words, tile_scales, tile_row_scales = tensors
        storage, in_features, saturates = constants
        weight = cls(WeightStorage(storage), data, block_scales, row_scales, in_features, dtype)
        weight._saturates = saturates
        if words is not None:
            weight._tiles = NVFP4Tiles(words, tile_scales, tile_row_scales, data.shape[-2], in_features)
        return weight

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """(.., N, K) in `dtype` (default the compute dtype), rounded once from float32 (see the
        module doc); dense weights come back as they are (cast if asked)."""
        dtype = dtype or self.dtype
        if self.format is WeightStorage.DENSE:
            return self.data.to(dtype)
        if self.format is WeightStorage.FP8:
            values = decode(self.data, E4M3) * self.row_scales[..., None]
            return saturate_to(values, dtype)
        # QTensor.element_scales's order: tensor scale times block scale, then the element
        elements, scale = self._nvfp4_parts(self.row_scales[..., None] * self.block_scales.to(torch.float32))
        return saturate_to(elements * scale, dtype)
