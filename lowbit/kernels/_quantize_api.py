"""The Python entry points of the quantize kernel (lowbit/kernels/quantize.py): argument checks,
stochastic-rounding seeds, the one launch, and the QTensors and values it returns."""

from __future__ import annotations

import contextlib
import itertools

import torch

from lowbit.formats.qtensor import QTensor
from lowbit.formats.quantize import check_input, check_row_runs
from lowbit.formats.spec import QuantSpec, ScaleKind
from lowbit.kernels._support import supports

__all__ = ["quantize_triton", "quantize_rows_triton", "quantize_rows_takes", "quantize_triton_with_transpose",
           "fake_quantize_triton",
           "fake_quantize_triton_with_transpose", "stochastic_uniforms", "seed_tensor",
           "run_quantize_kernel", "segment_scales_triton"]


def quantize_triton(x: torch.Tensor, spec: QuantSpec, seed=None, *,
                    generator: torch.Generator | None = None) -> QTensor:
    """Quantize x with the fused kernel: a QTensor equal bit for bit to
    `quantize_with_spec(x, spec)` (RNE; stochastic rounding follows the seed contract).

    seed: stochastic rounding only -- an int in [0, 2^63), a one-element int64 tensor (no
    host sync), or None: drawn from `generator` (default: torch's default generator of x's
    device), so torch.manual_seed fixes it.
    """
    return run_quantize_kernel(x, spec, seed, generator, codes=True, values=False, transpose=False)[0]


def quantize_rows_triton(x: torch.Tensor, spec: QuantSpec, rows: list[int]) -> list[QTensor]:
    """x (R, C) in runs of `rows` rows (summing to R), each run its own QTensor, equal bit for
    bit to quantize_triton(run, spec): NVFP4 with a tensor scale (1D blocks), each run under
    the tensor scale of its own rows (segment_scales_triton), in three launches for all the
    runs: the rows' maxima, the runs' scales, the quantize kernel under them. The QTensors'
    codes, block scales and tensor scales are views of one buffer each."""
    check_row_runs(x, rows, "quantize_rows_triton")
    if not quantize_rows_takes(spec):
        raise ValueError(f"quantize_rows_triton quantizes NVFP4 with a tensor scale, blocks of 16, "
                         f"round to nearest; got {spec}")
    check_input(x, spec)
    scales = segment_scales_triton(x, _run_ends(x.device, tuple(rows)), rows=True)   # (R,) float32
    q = run_quantize_kernel(x, spec, None, None, codes=True, values=False, transpose=False,
                            tensor_scales=("rows", scales))[0]
    out, start = [], 0
    for n in rows:
        out.append(QTensor(q.codes[start:start + n], q.scales[start:start + n], scales[start],
                           spec, (n, x.shape[1]), x.dtype))
        start += n
    return out


def quantize_rows_takes(spec: QuantSpec) -> bool:
    """Whether quantize_rows_triton takes `spec`: NVFP4 with a tensor scale, blocks of 16, round
    to nearest."""
    return (spec.format == "nvfp4" and spec.block == (1, 16) and spec.tensor_scale
            and spec.rounding.value == "rne")


_RUN_ENDS: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def _run_ends(device: torch.device, rows: tuple[int, ...]) -> torch.Tensor:
    """The runs' ends but the last, (len(rows) - 1,) int32 on `device`: made once for a set of
    runs (a weight sync quantizes the same shapes every time), so no host-to-device copy, which
    would wait for the GPU's queue, on later calls. Kept for the process, never evicted: a
    weight sync captured in a CUDA graph reads the tensor at every replay (a model has a
    few sets of runs, so the cache stays small)."""
    ends = _RUN_ENDS.get((device, rows))
    if ends is None:
        ends = _RUN_ENDS[(device, rows)] = torch.tensor(list(itertools.accumulate(rows))[:-1],
                                                        dtype=torch.int32, device=device)
    return ends


def quantize_triton_with_transpose(x: torch.Tensor, spec: QuantSpec, seed=None, *,
                                   generator: torch.Generator | None = None) -> tuple[QTensor, QTensor]:
    """(q, q_t) from one pass over x, with q_t == q.t() bit for bit (square 2D tiles only)."""
    q, q_t = run_quantize_kernel(x, spec, seed, generator, codes=True, values=False, transpose=True)
    return q, q_t


def fake_quantize_triton(x: torch.Tensor, spec: QuantSpec, seed=None, *,
                         generator: torch.Generator | None = None,
                         dtype: torch.dtype | None = None,
                         hadamard: torch.Tensor | None = None,
                         tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize-dequantize in one pass: equal bit for bit to
    `quantize_dequantize(x, spec, dtype=dtype)` (= `quantize_with_spec(x, spec).dequantize(dtype)`),
    in x's shape and `dtype` (default x's).

    hadamard: 16 signs (+-1): fake-quantize the random Hadamard transform of x's last dim
    instead, `quantize_dequantize(random_hadamard(x, signs), spec)` (lowbit.formats), fused:
    the transform runs in registers (also in the two-level tensor amax's pass), nothing is
    written between. 1D blocks, x 2-D, its last dim a multiple of 16.
    tensor_scale: NVFP4 with a tensor scale, x 2-D (R, C): given FP32 tensor scales, (R, 1)
    one per row or (1, C) one per column, the reference's `quantize_dequantize(x, spec,
    tensor_scale=...)` (an MoE layer's experts' segments: lowbit.formats.quantize.segment_tensor_scales)."""
    scales = None
    if tensor_scale is not None:
        axis = given_scales_axis(x, tensor_scale)
        if axis is None:
            raise ValueError(f"given tensor scales are (R, 1) or (1, C) for a 2-D x (R, C); got "
                             f"{tuple(tensor_scale.shape)} for {tuple(x.shape)}")
        scales = (axis, tensor_scale.to(x.device, torch.float32).reshape(-1))
    if hadamard is not None:
        if spec.is_2d or x.dim() != 2 or x.shape[-1] % 16:
            raise ValueError(f"the fused Hadamard transform takes a 2-D x whose last dim is a "
                             f"multiple of 16 and 1D blocks; got shape {tuple(x.shape)}, "
                             f"block {spec.block}")
        if hadamard.shape != (16,):
            raise ValueError(f"hadamard must hold 16 signs, got shape {tuple(hadamard.shape)}")
        hadamard = hadamard.to(x.device, torch.float32)
    return run_quantize_kernel(x, spec, seed, generator, codes=False, values=True, transpose=False,
                out_dtype=dtype, hadamard=hadamard, tensor_scales=scales)[0]


def given_scales_axis(x: torch.Tensor, tensor_scale: torch.Tensor) -> str | None:
    """How fake_quantize_triton takes given tensor scales for x: "rows" ((R, 1) for a 2-D x
    (R, C)), "cols" ((1, C)), or None (any other shape: the reference's)."""
    if x.dim() != 2 or tensor_scale.dim() != 2:
        return None
    if tensor_scale.shape == (x.shape[0], 1):
        return "rows"
    return "cols" if tensor_scale.shape == (1, x.shape[1]) else None


def group_amax_triton(x: torch.Tensor, hadamard: torch.Tensor | None = None,
                      rows: bool = False) -> torch.Tensor:
    """(C // 16,) float32: the finite |x|'s max over each group of 16 columns of x (R, C) (C a
    multiple of 16), of its random Hadamard transform with the 16 signs `hadamard` if given:
    the maxima fake_quantize_triton(x, spec, hadamard=...) sees, for tensor scales per
    segment of columns; rows: (R,) each row's max (no rotation), for scales per segment of
    rows (lowbit.formats.quantize.segment_scales_from_amax). One launch, no atomics."""
    from lowbit.kernels import quantize as kq

    kq.require_kernel_tensor(x)
    signs = None if hadamard is None else hadamard.to(x.device, torch.float32)
    return kq.group_amax(x, signs, rows_max=rows)


def segment_scales_triton(x: torch.Tensor, ends: torch.Tensor, hadamard: torch.Tensor | None = None,
                          rows: bool = False) -> torch.Tensor:
    """One NVFP4 tensor scale per segment, as each of an MoE layer's experts quantized alone:
    rows: x (R, C)'s rows lie in segments ending at `ends` ((E,) ascending int, on x's device)
    and the result is (R,) float32, each row its segment's scale (for fake_quantize_triton's
    tensor_scale (R, 1)); else x's columns do, in runs of 16 (C a multiple of 16; with the
    random Hadamard transform of each 16 under the signs `hadamard` if given), and the result
    is (C,), each column its segment's (for tensor_scale (1, C)). The maxima (group_amax_triton),
    then each segment's maximum and each row's scale, every launch over blocks in parallel: the
    bits of lowbit.formats.quantize.segment_scales_from_amax over those maxima."""
    from lowbit.kernels import quantize as kq

    kq.require_kernel_tensor(x)
    signs = None if hadamard is None else hadamard.to(x.device, torch.float32)
    # the maxima kernel zeroes the segments' buffer; a row's maxima over its few column tiles
    # are reduced by the segment-max kernel (no launch of their own), a column group's over its
    # many row tiles by one reduction
    seg = (torch.empty(ends.numel() + 1, device=x.device, dtype=torch.int32)
           if ends.numel() + 1 <= kq.ZEROED_MAX else None)
    maxima = kq.group_amax(x, signs, rows_max=rows, zero=seg, reduce=not rows)
    return kq.segment_scales(maxima, ends, rows_each=1 if rows else 16, repeat=1 if rows else 16, seg=seg)


def fake_quantize_triton_with_transpose(x: torch.Tensor, spec: QuantSpec, seed=None, *,
                                        generator: torch.Generator | None = None,
                                        dtype: torch.dtype | None = None):
    """(x_hat, x_hat_t): the fake-quantized x and its transpose (last two dims, contiguous),
    written from the same registers (square 2D tiles only)."""
    x_hat, x_hat_t = run_quantize_kernel(x, spec, seed, generator, codes=False, values=True, transpose=True,
                          out_dtype=dtype)
    return x_hat, x_hat_t


def stochastic_uniforms(shape, seed, device="cuda") -> torch.Tensor:
    """The uniforms in [0, 1) that stochastic rounding with `seed` gives each element of a
    tensor of `shape` (float32, that shape): element i rounds up iff floor(ratio_i + u_i)
    does. Computed by the kernels' own code, to reproduce or audit a draw."""
    from lowbit.kernels import quantize as kq

    shape = tuple(shape)
    cols = shape[-1]
    rows = 1
    for d in shape[:-1]:
        rows *= d
    device = torch.device(device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        u = kq.uniforms(rows, cols, seed_tensor(seed, None, device))
    return u.reshape(shape)


def seed_tensor(seed, generator, device) -> torch.Tensor:
    """A stochastic-rounding seed as the kernels take it, a one-element int64 tensor on
    `device`: `seed` as given (int or tensor), or one drawn from `generator` (default: torch's
    default generator of `device`) when it is None."""
    if isinstance(seed, torch.Tensor):
        if seed.numel() != 1 or seed.dtype != torch.int64:
            raise ValueError(f"a tensor seed must hold one int64, got {seed.dtype} {tuple(seed.shape)}")
        return seed.reshape(1).to(device)
    if seed is None:
        gen_device = generator.device if generator is not None else device
        return torch.randint(0, 2**62, (1,), generator=generator, device=gen_device).to(device)
    seed = int(seed)
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2^63), got {seed}")
    return torch.tensor([seed], dtype=torch.int64, device=device)


def run_quantize_kernel(x, spec, seed, generator, *, codes, values, transpose, out_dtype=None,
                        config=None, hadamard=None, tensor_scales=None) -> list:
    """The one launch every entry point above makes: [QTensor (codes), its transpose's
    (codes and transpose), the values (values), their transpose's (values and transpose)], in
    that order, of what is asked for. config: a kernels.quantize.TileConfig (tests and
    tuning sweeps try others than the default)."""
    from lowbit.kernels import quantize as kq

    check_input(x, spec)
    if not supports(spec, codes):
        why = (" as a QTensor (they write no int codes; fake_quantize_triton covers it)"
               if supports(spec, codes=False) else "")
        raise NotImplementedError(f"the Triton kernels do not cover {spec}{why}; use the "
                                  "reference (lowbit.formats.quantize_with_spec)")
    kq.require_kernel_tensor(x)
    if transpose and not spec.is_2d:
        raise ValueError(f"a transposed output from the same pass needs square 2D tiles, got "
                         f"block {spec.block}: 1D blocks of x^T are a different quantization")
    shape = tuple(x.shape)
    if spec.is_2d:
        x3 = x.reshape(-1, shape[-2], shape[-1])        # (B, R, C), a view where possible
    else:
        x3 = x.reshape(1, -1, shape[-1])                # 1D blocks: all rows are alike
    stochastic = spec.rounding.value == "stochastic"
    seed_t = seed_tensor(seed, generator, x.device) if stochastic else None
    if out_dtype is not None and out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"fake quantization writes float32, bfloat16 or float16, not {out_dtype}")
    with kq.on_device(x):
        out = kq.launch(x3, spec, seed=seed_t, codes=codes, values=values, transpose=transpose,
                        out_dtype=out_dtype, config=config, hadamard=hadamard, tensor_scales=tensor_scales)
    tensor_scale = out.get("tensor_scale")

    def qtensor(codes_, scales_, shape_):
        codes_ = codes_.reshape(*shape_[:-1], codes_.shape[-1])
        if spec.is_2d:
            scales_ = scales_.reshape(*shape_[:-2], *scales_.shape[-2:])
        else:
            scales_ = scales_.reshape(*shape_[:-1], scales_.shape[-1])
        if spec.info.scale_kind is ScaleKind.E4M3:
            scales_ = scales_.view(torch.float8_e4m3fn)
        return QTensor(codes_, scales_, tensor_scale, spec, shape_, x.dtype)

    results = []
    if codes:
        results.append(qtensor(out["codes"], out["scales"], shape))
        if transpose:
            shape_t = (*shape[:-2], shape[-1], shape[-2])
            results.append(qtensor(out["codes_t"], out["scales_t"], shape_t))
    if values:
        results.append(out["values"].reshape(shape))
        if transpose:
            results.append(out["values_t"].reshape(*shape[:-2], shape[-1], shape[-2]))
    return results
