"""The reference quantizer: block scaling (1D and 2D), scale rules, rounding, special values.

This plain-PyTorch code is the definition every kernel is tested against, bit for bit. It
runs on any device, always as written here (lowbit.dispatch is where a CUDA tensor is handed
to the Triton kernels instead); on the CPU it is lowbit's bit-exact emulator.

Layout. A tensor (..., R, C) is padded with zeros to (..., Rp, Cp), multiples of the block,
and viewed as (..., R/br, br, C/bc, bc); 1D blocks are the case br = 1 (no row padding).
Padding only feeds the amax (zeros never raise it) and the stored codes of the last block;
nothing is read past the tensor and dequantize() drops the padding.

Special values. A block that holds a NaN or an Inf gets a NaN scale (E4M3 0x7F, E8M0 255,
float NaN), so the whole block dequantizes to NaN: a non-finite value is never turned into
a finite one silently. The NVFP4 per-tensor scale is taken over the finite values only, so
one Inf does not wipe out the other blocks. An all-zero block dequantizes to zeros.

Where lowbit differs from torchao (the test suite pins these down):
- Inf: torchao keeps an Inf but its block scale becomes huge (2^126 or more), so the other
  values of that block silently become 0; lowbit makes the whole block NaN.
- MX blocks with amax below ~2^-125 (float32's subnormal edge): torchao quantizes with a
  2^-126 scale but decodes with 2^-127 (floor), or skips scaling (rceil, exponent 0); lowbit
  uses the stored 2^-127 for both.
- RCEIL: torchao's CPU path computes ceil(log2(amax/max)) with a float32 log2, which rounds
  down when amax/max is within a few ulps above a power of two, and then the block max clips.
  lowbit rounds the float32 amax/max up to a power of two on its bits (what cuBLAS's RCEIL,
  Transformer Engine and torchao's own Blackwell path do), so `rceil` never clips.
- ternary/binary mean-|x| scales: a block whose magnitudes sum past float32's max (a block
  amax near 1e36 and above) is summed scaled by 2^-64, so its scale stays finite (torchao has
  no such formats; the plain float32 sum overflowed to Inf and the block came back NaN).
- NVFP4 two-level with a tensor amax below 2688 * 2^-120 (~3.5e-33; all-zero tensors
  included): torchao divides by a zero or subnormal tensor scale and gets NaN; lowbit clamps
  the tensor scale at 2^-120.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lowbit.formats.elements import (
    ElementFormat, e8m0_to_float, encode, pack_codes, round_to_grid,
)
from lowbit.formats.qtensor import QTensor, saturate_to
from lowbit.formats.spec import QuantSpec, Rounding, ScaleKind, ScaleRule

__all__ = ["quantize", "quantize_with_spec", "quantize_dequantize", "round_asymmetric", "grid_values",
           "grid_fake_quantize", "blocked", "unblocked", "finite_abs", "divide", "tensor_scale_of",
           "tensor_scale_from_amax",
           "segment_tensor_scales", "segment_scales_from_amax", "check_input", "check_generator",
           "NVFP4_TENSOR_SCALE_MIN"]

E4M3_MIN_NORMAL = 2.0 ** -6   # torchao's clamp for NVFP4 block scales (ModelOpt uses 2^-9)
NVFP4_TENSOR_SCALE_MIN = 2.0 ** -120  # keeps (1/s_t)/block_scale finite (<= 2^126)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def quantize(x: torch.Tensor, format: str, *, block: tuple[int, int] | None = None,
             scale_rule: str | None = None, rounding: str = "rne",
             tensor_scale: bool | None = None,
             generator: torch.Generator | None = None) -> QTensor:
    """Quantize `x` to `format` ("nvfp4", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2", "int2".."int8",
    "int2_asym".."int8_asym", "ternary", "binary", "seq2") and return a packed `QTensor`.

    block: (1, b) blocks along the last dim or (b, b) tiles over the last two dims; defaults
        nvfp4 (1, 16), MX (1, 32), int/ternary/binary (1, 128). Leading dims are batch.
    scale_rule: MX only, "floor" (default, OCP MX v1.0) or "rceil" (truncation-free).
    rounding: "rne" or "stochastic" (draws from `generator`, else torch's default generator).
    tensor_scale: nvfp4 only; True (default) adds the FP32 per-tensor scale amax / (448 * 6).

    A QTensor is storage: quantize builds no autograd graph (x is read detached, so a
    requires_grad x gets no gradient through the codes or the scales), and a meta tensor,
    which holds no values, is refused (ValueError).
    """
    spec = QuantSpec.make(format, block, scale_rule, rounding, tensor_scale)
    check_generator(spec, generator)
    return quantize_with_spec(x, spec, generator=generator)


def quantize_with_spec(x: torch.Tensor, spec: QuantSpec,
                       generator: torch.Generator | None = None) -> QTensor:
    """quantize() with a prebuilt QuantSpec (no autograd graph; meta tensors refused)."""
    check_input(x, spec)
    if x.is_meta:
        raise ValueError(f"quantize needs values, and a meta tensor (shape {tuple(x.shape)}) "
                         f"holds none; quantize the weights once they are loaded")
    # a QTensor is storage: without detach the scales (amax / qmax) would carry a partial graph
    # back to x, a gradient on each block's largest value only
    x = x.detach()
    g = _on_grid(x, spec, generator)
    codes = encode(g.values if g.zeros is None else g.values + g.zeros[..., :, None, :, None],
                   spec.info.element)
    codes = torch.where(g.nonfinite[..., :, None, :, None], torch.zeros_like(codes), codes)
    packed = pack_codes(unblocked(codes, g.pad_rows), spec.info.element.code_bits)  # (..., R, Cp/k)

    kind = spec.info.scale_kind
    scales = g.scales
    if kind is ScaleKind.E4M3:
        scales = torch.where(g.nonfinite, float("nan"), scales).to(torch.float8_e4m3fn)
    elif kind is ScaleKind.E8M0:
        scales = torch.where(g.nonfinite, torch.full_like(scales, 255), scales)
    else:
        scales = torch.where(g.nonfinite, float("nan"), scales)
    zeros = g.zeros
    if zeros is not None:
        zeros = torch.where(g.nonfinite, 0.0, zeros).to(torch.uint8)
    if x.dim() == 1:                                    # blocked() made it one row
        packed, scales = packed.squeeze(0), scales.squeeze(0)
        zeros = None if zeros is None else zeros.squeeze(0)
    return QTensor(packed, scales, g.tensor_scale, spec, tuple(x.shape), x.dtype, zeros=zeros)


def quantize_dequantize(x: torch.Tensor, spec: QuantSpec, generator: torch.Generator | None = None,
                        dtype: torch.dtype | None = None, *,
                        tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """quantize_with_spec(x, spec).dequantize(dtype), bit for bit, without encoding and
    packing codes: the emulated GEMM path ("fake quantization").

    tensor_scale: NVFP4 with a tensor scale only: this FP32 scale (a float32 tensor of one
    element, e.g. a calibrated `tensor_scale_from_amax(amax)`) instead of x's own
    amax / (448 * 6) -- a static scale, as a served checkpoint's `input_scale`. Blocks beyond
    its range saturate: the block scale clamps at 448 and the elements at 6. Or one scale per
    block: a float32 tensor that broadcasts to x's shape and holds one value within each
    block (each block takes the value at its first element), e.g. `segment_tensor_scales`'
    one per row, where runs of rows (an MoE layer's experts) each have their own tensor."""
    if tensor_scale is not None and not (spec.info.scale_kind is ScaleKind.E4M3 and spec.tensor_scale):
        raise ValueError(f"tensor_scale is NVFP4's FP32 tensor scale; spec {spec} has none")
    g = _on_grid(x, spec, generator, tensor_scale)
    kind = spec.info.scale_kind
    if kind is ScaleKind.E4M3:  # the same float32 products QTensor.element_scales() forms
        scale = g.scales if g.tensor_scale is None else g.tensor_scale * g.scales
    elif kind is ScaleKind.E8M0:
        scale = e8m0_to_float(g.scales)
    else:
        scale = g.scales
    scale = torch.where(g.nonfinite, float("nan"), scale)
    grid = g.values
    if not spec.info.element.is_float:   # integer codes have no -0: decode gives +0
        grid = grid + 0.0
    values = unblocked(grid * scale[..., :, None, :, None], g.pad_rows)[..., : x.shape[-1]]
    dtype = x.dtype if dtype is None else dtype
    return saturate_to(values, dtype).reshape(x.shape)


class _OnGrid(NamedTuple):
    values: torch.Tensor        # (..., nR, br, nC, bc) float32 element values on the grid
    scales: torch.Tensor        # (..., nR, nC) stored-form block scales (E4M3 as float32)
    tensor_scale: torch.Tensor | None
    nonfinite: torch.Tensor     # (..., nR, nC) blocks holding NaN/Inf
    pad_rows: int
    zeros: torch.Tensor | None = None  # (..., nR, nC) float32 zero points (asymmetric intK)


def _on_grid(x: torch.Tensor, spec: QuantSpec, generator,
             tensor_scale: torch.Tensor | None = None) -> _OnGrid:
    """Block scales and the scaled, rounded element values: the part quantize and
    quantize_dequantize share (tensor_scale: a given NVFP4 tensor scale, else x's own)."""
    check_input(x, spec)
    element = spec.info.element
    xf = x.to(torch.float32)
    blocks, pad_rows = blocked(xf, spec.block)           # (..., nR, br, nC, bc)
    amax = blocks.abs().amax(dim=(-3, -1))              # (..., nR, nC); NaN propagates
    nonfinite = ~torch.isfinite(amax)

    t_scale = None
    kind = spec.info.scale_kind
    if kind is ScaleKind.MINMAX:
        return _on_asymmetric_grid(blocks, nonfinite, element, spec, generator, pad_rows)
    if kind is ScaleKind.E4M3:
        t_scale = None
        if spec.tensor_scale:
            t_scale = (tensor_scale_of(xf) if tensor_scale is None else
                       _block_tensor_scales(tensor_scale, xf, spec.block))
        scales, recip = _nvfp4_scales(amax, t_scale)
    elif kind is ScaleKind.E8M0:
        scales, recip = _mx_scales(amax, element, spec.scale_rule)
    else:
        scales, recip = _float_scales(xf, blocks, amax, element, kind, spec.block)

    data = blocks * recip[..., :, None, :, None]
    if kind in (ScaleKind.ABSMAX, ScaleKind.ABSMEAN):
        # a float32 scale below ~2^-128 has no finite reciprocal: divide instead (x * inf
        # would turn the block's zeros into NaN and saturate the rest)
        huge = torch.isinf(recip)[..., :, None, :, None]
        if huge.any():
            data = torch.where(huge, blocks / scales[..., :, None, :, None], data)
    # (round_to_grid saturates at the element's largest value; NaN stays NaN)
    noise = None
    if spec.rounding is Rounding.STOCHASTIC:
        noise = torch.rand(data.shape, generator=generator, device=data.device, dtype=torch.float32)
    values = round_to_grid(data, element, spec.rounding.value, noise)
    return _OnGrid(values, scales, t_scale, nonfinite, pad_rows)


def _on_asymmetric_grid(blocks, nonfinite, element, spec, generator, pad_rows) -> _OnGrid:
    """Asymmetric intK: q = clamp(round(x / s) + z, 0, 2^K - 1), value (q - z) * s, with the
    block's range [min(x, 0), max(x, 0)] mapped onto the codes: s = max/qmax - min/qmax (two
    finite terms, so the scale is finite for every finite block) and z = round(-min / s)."""
    qmax = element.max_value
    hi = torch.clamp(blocks.amax(dim=(-3, -1)), min=0.0)
    lo = torch.clamp(blocks.amin(dim=(-3, -1)), max=0.0)
    scales = divide(hi, qmax) - divide(lo, qmax)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    zeros = torch.clamp(torch.round(-lo / safe), 0.0, qmax)
    data = blocks / safe[..., :, None, :, None]
    noise = None
    if spec.rounding is Rounding.STOCHASTIC:
        noise = torch.rand(data.shape, generator=generator, device=data.device, dtype=torch.float32)
    values = round_asymmetric(data, zeros[..., :, None, :, None], qmax, noise)
    return _OnGrid(values, scales, None, nonfinite, pad_rows, zeros)


def round_asymmetric(data: torch.Tensor, zeros: torch.Tensor, qmax: float,
                     noise: torch.Tensor | None = None) -> torch.Tensor:
    """x / s rounded onto the asymmetric grid -z..qmax-z (the values q - z of the codes
    q = clamp(round(x / s) + z, 0, qmax)): nearest, ties to even, or with `noise` stochastic.
    NaN stays NaN; no -0."""
    steps = torch.round(data) if noise is None else torch.floor(data + noise)
    return torch.minimum(torch.maximum(steps, -zeros), qmax - zeros) + 0.0


def grid_values(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                element: ElementFormat, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight under given scales, as QAT's forward takes it (scales learned or searched, not
    each block's own): (v, inside), both float32 / bool shaped like w (..., K). v is the grid
    value of w / s, s one scale per `group` consecutive inputs (scales (..., K / group)):
    round_to_grid's (symmetric, `element`) or, with zeros, round_asymmetric's (q - z); inside
    says whether w / s lies in the grid's range, where clipped STE passes the gradient."""
    data = w.float().view(*w.shape[:-1], w.shape[-1] // group, group) / scales[..., None]
    if zeros is None:
        v, inside = round_to_grid(data, element), data.abs() <= element.max_value
    else:
        z = zeros.float()[..., None]        # stored zero points are uint8: -z must not wrap
        v = round_asymmetric(data, z, element.max_value)
        inside = (data >= -z) & (data <= element.max_value - z)
    return v.reshape(w.shape), inside.reshape(w.shape)


def grid_fake_quantize(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       element: ElementFormat, group: int, inside: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(v * s in w's dtype, grid_values' inside or None): QAT's fake-quantized weight, the
    product in float32 rounded once to w's dtype."""
    v, in_range = grid_values(w, scales, zeros, element, group)
    out = (v.view(*w.shape[:-1], w.shape[-1] // group, group) * scales[..., None]).reshape(w.shape)
    return out.to(w.dtype), (in_range if inside else None)


def tensor_scale_of(xf: torch.Tensor) -> torch.Tensor:
    """NVFP4 per-tensor scale: amax over the finite values / (448 * 6), at least 2^-120."""
    return tensor_scale_from_amax(finite_abs(xf).amax())


def finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN and Inf as 0: what a tensor scale's amax is taken over."""
    return torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))


def divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor rounded once, as IEEE divides, on every device: CUDA divides a tensor by a
    Python number as a product with the number's rounded reciprocal, often a last place off
    the quotient, which moves an NVFP4 tensor scale off the kernels' (they divide as IEEE
    does) and with it many of the values it scales. By a tensor on x's device, CUDA divides;
    made by torch.full, which neither waits on the GPU nor breaks a CUDA graph's capture (a
    tensor copied from the host would do both)."""
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)


def _block_tensor_scales(tensor_scale: torch.Tensor, xf: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A given NVFP4 tensor scale as the blocks take it: () for one element, else each block's
    value at its first element ((..., nR, nC), as the block amaxes)."""
    t = tensor_scale.to(device=xf.device, dtype=torch.float32)
    if t.numel() == 1:
        return t.reshape(())
    try:
        full = t.expand(xf.shape)
    except RuntimeError:
        raise ValueError(f"tensor_scale of shape {tuple(t.shape)} neither has one element nor "
                         f"broadcasts to the tensor's {tuple(xf.shape)}") from None
    return blocked(full, block)[0][..., :, 0, :, 0]


def segment_tensor_scales(x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """NVFP4's FP32 tensor scale of each segment of x's rows, one per row ((R, 1) float32 for
    x (R, C), for quantize_dequantize's tensor_scale): segment e holds rows ends[e - 1] to
    ends[e] (ends (E,) ascending int32, on x's device; the rows past ends[-1] are one more
    segment), and its scale is `tensor_scale_of` those rows alone, as if quantized on their
    own. Computed on the device with no host read-back (a segment's amax by one segmented
    reduction)."""
    return segment_scales_from_amax(finite_abs(x).amax(dim=-1).to(torch.float32), ends)[:, None]


def segment_scales_from_amax(amax: torch.Tensor, ends: torch.Tensor, rows_each: int = 1) -> torch.Tensor:
    """segment_tensor_scales from maxima already taken: amax (n,) float32 the finite |x|'s max
    of each run of `rows_each` rows (the runs lying within segments) -> (n,) the tensor scale of
    the segment each run lies in."""
    first = torch.arange(amax.shape[0], dtype=ends.dtype, device=amax.device) * rows_each
    segment = torch.searchsorted(ends, first, right=True)                       # E: past the end
    # each segment's maximum by a segmented reduction over the runs in order (the segments are
    # contiguous: run i, first row i * rows_each, is in segment e when ends[e - 1] <= i * rows_each
    # < ends[e], so segment e's runs start at ceil(ends[e - 1] / rows_each)), not a scatter whose
    # atomics on E + 1 addresses serialize on the GPU; the last segment holds the runs past
    # ends[-1]. unsafe: no check of the offsets, which would read them to the host
    runs_end = torch.clamp((ends + rows_each - 1) // rows_each, max=amax.shape[0])
    zero = torch.zeros(1, dtype=ends.dtype, device=amax.device)
    offsets = torch.cat([zero, runs_end, zero + amax.shape[0]])
    seg_amax = torch.segment_reduce(amax, "max", offsets=offsets, unsafe=True, initial=0.0)
    return tensor_scale_from_amax(seg_amax)[segment]


def tensor_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's FP32 tensor scale of a tensor whose largest magnitude is amax (float32):
    amax / (448 * 6) rounded once, at least 2^-120 -- a weight's `weight_scale_2`, and from a
    calibrated activation amax the static `input_scale` of a served W4A4 checkpoint."""
    return torch.clamp(divide(amax.to(torch.float32), 448.0 * 6.0), min=NVFP4_TENSOR_SCALE_MIN)


def _nvfp4_scales(amax: torch.Tensor, t_scale: torch.Tensor | None):
    """E4M3 block scales and the float32 factor that maps x onto the E2M1 grid.

    The operation order is torchao's `nvfp4_quantize` (and its MSLK Triton kernel): scales
    in float32, then x * ((1 / s_t) / block_scale) -- a multiply by one rounded reciprocal,
    not a division, so kernels that multiply give the same bits.
    """
    block_scale = divide(amax, 6.0)
    if t_scale is not None:
        block_scale = block_scale / t_scale
    codes = torch.clamp(block_scale, min=E4M3_MIN_NORMAL, max=448.0).to(torch.float8_e4m3fn)
    decoded = codes.to(torch.float32)
    recip = (1.0 / t_scale) / decoded if t_scale is not None else 1.0 / decoded
    return decoded, recip


def _mx_scales(amax: torch.Tensor, element: ElementFormat, rule: ScaleRule):
    """E8M0 exponents (biased, uint8) and the exact power-of-two reciprocal 2^-(code - 127)."""
    if rule is ScaleRule.FLOOR:
        # floor(log2 amax) from frexp (amax = m * 2^e, m in [0.5, 1)): exact, no log2 rounding.
        _, exp = torch.frexp(amax)
        unbiased = exp - 1 - element.emax
    else:
        # Round amax / max_elem (float32) up to a power of two on its bits, as cvt.rp.ue8m0 does:
        # 2^(e-1) when the significand is exactly 0.5, else 2^e.
        descale = divide(amax, element.max_value)
        mant, exp = torch.frexp(descale)
        unbiased = torch.where(mant == 0.5, exp - 1, exp)
        # amax / max underflowing to 0 (amax <= max * 2^-150) takes the smallest scale too
        unbiased = torch.where(descale == 0, torch.full_like(unbiased, -127), unbiased)
    unbiased = torch.where(amax == 0, torch.full_like(unbiased, -127), unbiased)
    unbiased = torch.clamp(unbiased, -127, 127)
    codes = (unbiased + 127).to(torch.uint8)
    recip = torch.ldexp(torch.ones_like(amax), -unbiased)  # exact, also for 2^127
    return codes, recip


def _float_scales(xf, blocks, amax, element, kind, block):
    """float32 scales for int (absmax / qmax) and ternary/binary (mean |x| over real values)."""
    if kind is ScaleKind.ABSMAX:
        scales = divide(amax, element.max_value)
    else:
        # The mean counts only the values of the tensor, not the zero padding of the last block.
        counts = blocked(torch.ones_like(xf), block)[0].sum(dim=(-3, -1))
        # Sum the sorted magnitudes: float addition is not associative, and a fixed order
        # keeps the scale of a tile (and so its bits) the same for x and x.T.
        mags = blocks.abs().transpose(-3, -2).flatten(-2).sort(dim=-1).values  # (..., nR, nC, br * bc)
        scales = mags.sum(dim=-1) / counts
        # The sum of a block of finite values past ~3.4e38 / count overflows float32, though
        # their mean cannot: sum those blocks scaled by 2^-64 (exact for such magnitudes) and
        # scale the mean back. Every other block keeps its bits.
        overflow = torch.isinf(scales) & torch.isfinite(amax)
        if overflow.any():
            rescued = torch.ldexp(torch.ldexp(mags, torch.tensor(-64)).sum(dim=-1) / counts,
                                  torch.tensor(64))
            scales = torch.where(overflow, rescued, scales)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return scales, 1.0 / safe


def blocked(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, int]:
    """(..., R, C) -> zero-padded (..., nR, br, nC, bc) and the number of padded rows.

    A 1-D tensor is one row. 1D blocks (br = 1) pad only the last dim.
    """
    br, bc = block
    if x.dim() == 1:
        x = x.unsqueeze(0)
    rows, cols = x.shape[-2], x.shape[-1]
    pad_rows = (-rows) % br
    pad_cols = (-cols) % bc
    if pad_rows or pad_cols:
        x = torch.nn.functional.pad(x, (0, pad_cols, 0, pad_rows))
    lead = x.shape[:-2]
    return x.reshape(*lead, (rows + pad_rows) // br, br, (cols + pad_cols) // bc, bc), pad_rows


def unblocked(blocks: torch.Tensor, pad_rows: int) -> torch.Tensor:
    """(..., nR, br, nC, bc) -> (..., R, Cp): drops padded rows, keeps the padded columns."""
    lead = blocks.shape[:-4]
    nr, br, nc, bc = blocks.shape[-4:]
    flat = blocks.reshape(*lead, nr * br, nc * bc)
    return flat[..., : nr * br - pad_rows, :] if pad_rows else flat


def check_generator(spec: QuantSpec, generator) -> None:
    """Refuse a generator where nothing draws from it: round-to-nearest is deterministic, so a
    generator passed with it means the caller expected stochastic rounding."""
    if generator is not None and spec.rounding is not Rounding.STOCHASTIC:
        raise ValueError("a generator is drawn from by stochastic rounding only; pass "
                         "rounding='stochastic', or no generator for round-to-nearest")


def check_row_runs(x: torch.Tensor, rows, name: str) -> None:
    """Refuse runs of rows that do not split x: x must be 2-D and `rows` positive counts that
    sum to its rows (quantize_rows and its kernel; `name` says which refused)."""
    if x.dim() != 2 or sum(rows) != x.shape[0] or any(n <= 0 for n in rows):
        raise ValueError(f"{name} takes a 2-D x and runs of rows (each > 0) that sum to its rows; "
                         f"got {tuple(x.shape)} and {list(rows)}")


def check_input(x, spec: QuantSpec) -> None:
    """Refuse what no quantizer takes: not a float32/bfloat16/float16 tensor, an empty or 0-dim
    one, or a 1-D one with 2D tiles (one line that says what to do)."""
    if not isinstance(x, torch.Tensor):
        hint = {"ndarray": "; convert it with torch.from_numpy(x)",
                "list": "; convert it with torch.tensor(x)", "tuple": "; convert it with torch.tensor(x)"}
        raise TypeError(f"quantize takes a torch.Tensor, got {type(x).__name__}"
                        f"{hint.get(type(x).__name__, '')}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"quantize takes float32, bfloat16 or float16 tensors, got {x.dtype}; "
                        "cast it first (x.float())")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"quantize needs a non-empty tensor with at least one dim, got shape "
                         f"{tuple(x.shape)}")
    if spec.is_2d and x.dim() < 2:
        raise ValueError(f"2D blocks {spec.block} need a tensor with at least 2 dims, got shape "
                         f"{tuple(x.shape)}; use block=(1, {spec.block[1]}) for 1-D tensors")

