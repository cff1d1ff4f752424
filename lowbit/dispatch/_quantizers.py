"""The quantizers of lowbit.dispatch and the rule that sends each call to the Triton kernels or
to the reference (the rule is the package docstring's). Tests and sweeps that make CPU tensors
take the kernels patch `use_kernels` here: every quantizer below looks it up in this module."""

from __future__ import annotations

import contextlib
import os

import torch

from lowbit import kernels
from lowbit.dispatch import fold_check
from lowbit.formats import quantize_dequantize as reference_quantize_dequantize
from lowbit.formats import quantize_with_spec as reference_quantize
from lowbit.formats.elements import ElementFormat
from lowbit.formats.fold import FoldedOperand, fold_operand
from lowbit.formats.hadamard import random_hadamard
from lowbit.formats.qtensor import QTensor
from lowbit.formats.quantize import check_generator, check_input, check_row_runs
from lowbit.formats.quantize import segment_tensor_scales as reference_segment_tensor_scales
from lowbit.formats.quantize import grid_fake_quantize as reference_grid_fake_quantize
from lowbit.formats.spec import QuantSpec

__all__ = ["quantize", "quantize_with_spec", "quantize_dequantize", "grid_fake_quantize", "rotated_fake_quantize",
           "segment_tensor_scales",
           "quantize_fold", "use_kernels", "force_reference", "reference_forced"]

_force_depth = 0


@contextlib.contextmanager
def force_reference():
    """Inside this block (and with LOWBIT_FORCE_REFERENCE=1 set), use_kernels() is False, so
    every quantizer runs the plain-PyTorch reference."""
    global _force_depth
    _force_depth += 1
    try:
        yield
    finally:
        _force_depth -= 1


def reference_forced() -> bool:
    return _force_depth > 0 or os.environ.get("LOWBIT_FORCE_REFERENCE", "0") not in ("", "0")


def use_kernels(x: torch.Tensor, spec: QuantSpec, codes: bool = True) -> bool:
    """Whether a quantizer runs the Triton kernels on x (see the module doc). codes=False asks
    for fake quantization (values only), which the kernels cover for intK too."""
    return (x.is_cuda and not reference_forced() and kernels.supports(spec, codes)
            and kernels.kernels_available(x))


def quantize(x: torch.Tensor, format: str, *, block: tuple[int, int] | None = None,
             scale_rule: str | None = None, rounding: str = "rne",
             tensor_scale: bool | None = None,
             generator: torch.Generator | None = None) -> QTensor:
    """lowbit.formats.quantize (its arguments and defaults), on the kernels where they apply."""
    spec = QuantSpec.make(format, block, scale_rule, rounding, tensor_scale)
    check_generator(spec, generator)
    return quantize_with_spec(x, spec, generator=generator)


def quantize_with_spec(x: torch.Tensor, spec: QuantSpec,
                       generator: torch.Generator | None = None) -> QTensor:
    """A packed QTensor of x: the fused kernel on CUDA where it covers the spec, else the
    reference. Like the reference, it builds no autograd graph (x is read detached)."""
    check_input(x, spec)   # before use_kernels reads x.is_cuda: quantize(None) is one line too
    x = x.detach()
    if use_kernels(x, spec):
        return kernels.quantize_triton(x, spec, generator=generator)
    return reference_quantize(x, spec, generator)


def quantize_rows(x: torch.Tensor, spec: QuantSpec, rows: list[int]) -> list[QTensor]:
    """x (R, C) in runs of `rows` rows (summing to R): each run's QTensor, as quantize_with_spec
    gives it for that run alone (its own NVFP4 tensor scale). NVFP4 with a tensor scale in
    blocks of 16 on CUDA, several runs: every run in one pass of the kernels
    (kernels.quantize_rows_triton, the same bits); one run, any other spec or device: run by
    run."""
    check_row_runs(x, rows, "quantize_rows")
    check_input(x, spec)
    x = x.detach()
    if len(rows) > 1 and kernels.quantize_rows_takes(spec) and use_kernels(x, spec):
        return kernels.quantize_rows_triton(x, spec, list(rows))
    return [quantize_with_spec(run, spec) for run in x.split(list(rows))]


def quantize_dequantize(x: torch.Tensor, spec: QuantSpec, generator: torch.Generator | None = None,
                        dtype: torch.dtype | None = None, *,
                        tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The values `spec` represents, in x's shape and `dtype` (default x's): the fused
    fake-quantize kernel on CUDA where it covers the spec, else the reference. tensor_scale:
    the reference's (a given NVFP4 tensor scale, or one per block); the kernel takes one per
    row, (R, 1), or per column, (1, C), of a 2-D x, the reference any other."""
    check_input(x, spec)
    if use_kernels(x, spec, codes=False) and (tensor_scale is None
                                              or kernels.given_scales_axis(x, tensor_scale) is not None):
        return kernels.fake_quantize_triton(x, spec, generator=generator, dtype=dtype,
                                            tensor_scale=tensor_scale)
    return reference_quantize_dequantize(x, spec, generator, dtype, tensor_scale=tensor_scale)


def grid_fake_quantize(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       element: ElementFormat, group: int, inside: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """QAT's fake-quantized weight under given group scales, (Ŵ in w's dtype, the in-range
    mask where `inside`): one fused kernel on CUDA (lowbit/kernels/grid_fake_quant.py) for the
    integer-like grids, else the reference (lowbit.formats.quantize.grid_fake_quantize)."""
    if (w.is_cuda and not reference_forced() and not element.is_float
            and kernels.kernels_available(w)):
        from lowbit.kernels.grid_fake_quant import grid_fake_quantize as kernel
        return kernel(w, scales, zeros, element, group, inside)
    return reference_grid_fake_quantize(w, scales, zeros, element, group, inside)


def segment_tensor_scales(x: torch.Tensor, ends: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """lowbit.formats.quantize.segment_tensor_scales (one NVFP4 tensor scale per segment of x's
    rows, (R, 1)), the rows' maxima in one kernel where the kernels take x for `spec`."""
    if x.dim() == 2 and use_kernels(x, spec, codes=False):
        return kernels.segment_scales_triton(x, ends, rows=True)[:, None]
    return reference_segment_tensor_scales(x, ends)


def rotated_fake_quantize(t: torch.Tensor, spec: QuantSpec | None,
                          signs: torch.Tensor, segment_ends: torch.Tensor | None = None) -> torch.Tensor:
    """t (N, features) rotated along N by random_hadamard with `signs` and fake-quantized with
    blocks along N: (N', features), N' = N padded to 16k. On CUDA, with 1D blocks and N a
    multiple of 16, one fused kernel reads t and writes the values (the same bits): for NVFP4
    1x16 the row-group kernel (lowbit.kernels.hadamard), which reads and writes along
    features; otherwise the quantize kernel on t's transposed view. Elsewhere the reference
    rotation, then the quantizer. segment_ends: t's rows lie in segments (an MoE layer's
    experts, each starting at a multiple of 16) and each segment's rotated rows take their own
    NVFP4 tensor scale (lowbit.formats.quantize.segment_tensor_scales), as each segment rotated
    and quantized alone: on CUDA (1D blocks, N a multiple of 16) one kernel takes the rotated
    maxima of every 16 rows and the fused kernel quantizes the rotation under the segments'
    scales; elsewhere the reference rotation, then the quantizer with those scales."""
    t_t = t.mT                                                     # (features, N), a view
    fused = (spec is not None and not spec.is_2d and t_t.shape[1] % 16 == 0
             and use_kernels(t_t, spec, codes=False))
    segmented = segment_ends is not None and spec is not None and spec.tensor_scale
    if fused and segmented:
        scales = kernels.segment_scales_triton(t_t, segment_ends, hadamard=signs)   # (N,)
        return kernels.fake_quantize_triton(t_t, spec, hadamard=signs, tensor_scale=scales[None, :]).mT
    if fused:
        from lowbit.kernels.hadamard import fake_quantize_rht_rows, rht_rows_supported

        if rht_rows_supported(t, spec):
            return fake_quantize_rht_rows(t, spec, signs)
        return kernels.fake_quantize_triton(t_t, spec, hadamard=signs).mT
    rotated = random_hadamard(t_t, signs)                          # (features, N')
    if segmented:
        scales = reference_segment_tensor_scales(rotated.mT, segment_ends).mT  # (1, N')
        return quantize_dequantize(rotated, spec, tensor_scale=scales).mT
    return (rotated if spec is None else quantize_dequantize(rotated, spec)).mT


def quantize_fold(x: torch.Tensor, spec: QuantSpec, transpose_too: bool = False,
                  check=fold_check.ACTIVE, rows: bool = True,
                  segment_ends: torch.Tensor | None = None
                  ) -> tuple[FoldedOperand | None, FoldedOperand | None]:
    """Quantize a 2-D x (rows, K) to MXFP4 with `spec` and fold it: (x's operand, x^T's
    operand or None). x^T's comes from the same FP4 values (square 2D tiles only).
    rows=False (with transpose_too) makes x^T's alone, from one row-major read of x: (None,
    x^T's operand), the same bits as quantize_fold(x.mT) under round-to-nearest.

    CUDA tensors take the fused Triton kernels (lowbit.kernels.fp8_fold, two passes over x and
    no QTensor); elsewhere, or under force_reference(), the reference quantizer and
    fold_operand. Both give the same bits (the kernels' contract, checked in CI under the
    Triton interpreter and on the GPU by the GPU tests), except under a deferred fold check
    (`check`: fold_check.ACTIVE = this thread's, or a FoldCheck, or None), where the kernels
    fold in one K-chunk and a row that needs more is counted in the check instead. A fold
    that needed K-chunks is noted for the watch in force (fold_check.folding_for), and the
    fold observer in force (fold_check.observe_folds) is told the fold's layer, operand and
    inexact count.

    segment_ends (with transpose_too, square tiles): x's rows are the tokens of a grouped GEMM's
    groups ending there (multiples of the tile's rows), and the kernels fold x^T with one factor
    per row and group (lowbit.kernels.fp8_fold.quantize_fold_mxfp4), as each group's own fold
    would; the reference, exact anyway, folds x^T as a whole in K-chunks."""
    if not (rows or transpose_too):
        raise ValueError("quantize_fold with rows=False makes x^T's operand alone: pass "
                         "transpose_too=True too")
    observation = fold_check.fold_observation()
    own = None   # this fold's inexact count, for an observer
    if use_kernels(x, spec):
        from lowbit.kernels.fp8_fold import quantize_fold_mxfp4, quantize_fold_mxfp4_with_transpose

        resolved = fold_check.resolve_check(check, x.device)
        counter = resolved.counter if resolved is not None else None
        if observation is not None and counter is not None:
            counter = own = torch.zeros_like(counter)   # added to the check's below
        if transpose_too and not rows:
            out = None, quantize_fold_mxfp4(x, spec, transpose=True, counter=counter,
                                            segment_ends=segment_ends)
        elif transpose_too:
            out = quantize_fold_mxfp4_with_transpose(x, spec, counter=counter,
                                                     segment_ends=segment_ends)
        else:
            out = quantize_fold_mxfp4(x, spec, counter=counter), None
        if own is not None:
            resolved.counter += own
    else:
        fold_check.resolve_check(check, x.device)        # refuses a check of the wrong type
        q = reference_quantize(x, spec)
        out = (fold_operand(q) if rows else None,
               fold_operand(q, transpose=True) if transpose_too else None)
    fold_check.note_chunks(out)
    if observation is not None:   # an exact fold (no check, or the reference) leaves none
        observer, layer, operand = observation
        observer(layer, operand,
                 own if own is not None else torch.zeros(1, dtype=torch.int64, device=x.device))
    return out
