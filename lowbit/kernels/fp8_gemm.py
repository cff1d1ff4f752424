"""The exact MXFP4 GEMM on FP8 tensor cores, on operands folded by lowbit.formats.fold.

Every MXFP4 value is exactly an FP8 E4M3 value times a power of two kept per row (the fold:
lowbit/formats/fold.py derives it), so C = A B^T on MXFP4 operands is a sum, over K-chunks,
of row-scaled FP8 GEMMs on exactly the FP4 values.

The GEMM, C = A B^T (A (M, K), B (N, K), both blocked along K):
- CUDA: torch._scaled_mm(a_fp8, b_fp8.t(), scale_a=(M, 1), scale_b=(1, N)) with row-wise
  float32 scales: A row-major, B column-major, K and N multiples of 16 (zero-padded here;
  zeros add nothing). One chunk: its output dtype directly (bf16 always works; float32 needs
  cuBLAS's row-wise path, SM90 with cuBLAS >= 12.9, else the factors are applied after a
  float32 tensor-wise GEMM). Several chunks: float32 per chunk, summed in float32, then cast.
  The tensor cores' FP8 accumulation is the only rounding before the output cast: FP8 x FP8
  products are exact, the factors are powers of two.
- Elsewhere (the CPU): fp8 values as float32, one float32 matmul per chunk (products exact,
  so the only error is float32 accumulation: |C - C_exact| <= gamma_K * (|A| |B|^T) with
  gamma_K = K*2^-24 / (1 - K*2^-24)), factors applied and chunks summed in float64 (exact
  power-of-two scaling, no overflow of factor products), one rounding to out_dtype.

NVFP4 does not fold: its E4M3 block scales have mantissas, so the products need more bits
than E4M3 has. It stays on the emulated (dequantize + BF16 GEMM) path.

Every MoE expert's GEMM at once (`grouped_fp4_gemm_fp8`), on operands folded as one stacked
tensor, in two layouts:
- along="rows" (fprop, dgrad): A (P, K) holds each expert's rows in turn, group e ending at
  ends[e]; B (E * N, K) stacks the experts' (N, K) operands; C (P, N), row r of group e =
  A[r] B_e^T. Rows past ends[-1] are left unwritten (undefined) on CUDA, zero elsewhere.
  With b_layout="side_by_side" B holds the experts' operands side by side instead, (N, E * K),
  B_e = B[:, e K:(e + 1) K]: the transposed fold of the stacked weights (E * out, in) that the
  forward keeps for dgrad, with one factor per row and expert where it is segmented (segment
  ends K, 2K, ..., as that fold makes them: taken as given, not read back).
- along="k" (wgrad): A (M, P) and B (N, P) hold the tokens along K, group e ending at ends[e];
  C (E, M, N), C_e = A[:, group e] B[:, group e]^T. An operand folded with factors per row and
  segment of K (FoldedOperand.segment_ends: the groups) takes its own factor in each group,
  as each expert's own fold would.
CUDA, one K-chunk per operand, bf16 output and every width a multiple of 16:
torch._scaled_grouped_mm (one grouped FP8 GEMM, row-wise float32 factors per group; along="k"
takes each row's one factor for every group, or its segment's). Otherwise group by group
through fp4_gemm_fp8, the group bounds read back to the host (one sync; on CUDA only for
several chunks, odd widths, a float32 output or another GPU).
"""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F

from lowbit.formats.fold import FoldedOperand, fold_operand
from lowbit.formats.qtensor import QTensor

__all__ = ["fp4_gemm_fp8", "gemm_pieces", "grouped_fp4_gemm_fp8"]


def fp4_gemm_fp8(a: QTensor | FoldedOperand, b: QTensor | FoldedOperand,
                 out_dtype: torch.dtype = torch.bfloat16,
                 use_fast_accum: bool = False, backend: str | None = None) -> torch.Tensor:
    """a.dequantize() @ b.dequantize().T, (M, K) x (N, K) -> (M, N) in out_dtype, on exactly
    the FP4 operands: torch._scaled_mm with row-wise factors on CUDA, an FP32-accumulating
    emulation elsewhere (see the module doc for each one's error). a and b are MXFP4
    QTensors blocked along K, or operands folded before (fold_operand / weight_operands).

    use_fast_accum: lets the FP8 tensor cores accumulate all of K in their reduced precision
        (faster, with more accumulation error: docs/results/kernels.md); scaled_mm only.
    backend: None picks by device; "scaled_mm" or "emulated" forces one (a CPU build of torch
        with torch._scaled_mm can run the former, which is how the CPU tests reach it)."""
    fa = a if isinstance(a, FoldedOperand) else fold_operand(a)
    fb = b if isinstance(b, FoldedOperand) else fold_operand(b)
    if fa.segment_ends is not None or fb.segment_ends is not None:
        raise ValueError("an operand with factors per segment of K is a grouped GEMM's: use "
                         "grouped_fp4_gemm_fp8, or its columns(...) of one segment")
    if fa.shape[1] != fb.shape[1]:
        raise ValueError(f"a is {tuple(fa.shape)} and b is {tuple(fb.shape)}: for a @ b.T both "
                         "need the same K (last dim)")
    if fa.fp8.device != fb.fp8.device:
        raise ValueError(f"a is on {fa.fp8.device} and b on {fb.fp8.device}")
    if backend not in (None, "scaled_mm", "emulated"):
        raise ValueError(f"backend must be None, 'scaled_mm' or 'emulated', got {backend!r}")
    pieces = gemm_pieces(fa, fb)
    if backend == "scaled_mm" or (backend is None and fa.fp8.is_cuda):
        return _gemm_scaled_mm(fa, fb, pieces, out_dtype, use_fast_accum)
    return _gemm_emulated(fa, fb, pieces, out_dtype)


def gemm_pieces(fa: FoldedOperand, fb: FoldedOperand) -> list[tuple[int, int, int, int]]:
    """(k0, k1, chunk of a, chunk of b) over the union of both operands' chunk boundaries."""
    bounds = sorted(set(fa.bounds) | set(fb.bounds))
    return [(k0, k1, bisect.bisect_right(fa.bounds, k0) - 1, bisect.bisect_right(fb.bounds, k0) - 1)
            for k0, k1 in zip(bounds[:-1], bounds[1:])]


def _with_nan(factor: torch.Tensor, nan_rows: torch.Tensor) -> torch.Tensor:
    """The factor, NaN on rows holding a NaN block: one kernel, no host copy (capturable)."""
    return torch.where(nan_rows, float("nan"), factor)


def _gemm_emulated(fa: FoldedOperand, fb: FoldedOperand, pieces, out_dtype) -> torch.Tensor:
    out = torch.zeros(fa.shape[0], fb.shape[0], dtype=torch.float64, device=fa.fp8.device)
    for k0, k1, ca, cb in pieces:
        acc = fa.fp8[:, k0:k1].to(torch.float32) @ fb.fp8[:, k0:k1].to(torch.float32).T  # (M, N)
        sa = _with_nan(fa.factors[:, ca], fa.nan_rows).to(torch.float64)
        sb = _with_nan(fb.factors[:, cb], fb.nan_rows).to(torch.float64)
        out += acc.to(torch.float64) * sa[:, None] * sb[None, :]
    return out.to(out_dtype)


def _pad_rows_cols(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a float8 matrix to (rows, cols) (through uint8: E4M3 0x00 is +0)."""
    if t.shape == (rows, cols):
        return t.contiguous()
    bits = F.pad(t.view(torch.uint8), (0, cols - t.shape[1], 0, rows - t.shape[0]))
    return bits.view(torch.float8_e4m3fn)


_ROWWISE_DTYPE_OK: dict[tuple[str, torch.dtype], bool] = {}


def _scaled_mm_rowwise(a8, b8, sa, sb, out_dtype, use_fast_accum) -> torch.Tensor:
    """a8 (M, K) @ b8 (N, K)^T * sa[:, None] * sb[None, :] through torch._scaled_mm, K and N
    zero-padded to multiples of 16 (its requirement; a row-major, b column-major)."""
    m, k = a8.shape
    n = b8.shape[0]
    kp, np_ = -(-k // 16) * 16, -(-n // 16) * 16
    a8 = _pad_rows_cols(a8, m, kp)
    b8 = _pad_rows_cols(b8, np_, kp)
    if np_ != n:
        sb = F.pad(sb, (0, np_ - n), value=1.0)
    key = (str(a8.device), out_dtype)
    if _ROWWISE_DTYPE_OK.get(key, True):
        try:
            out = torch._scaled_mm(a8, b8.t(), scale_a=sa[:, None].contiguous(),
                                   scale_b=sb[None, :].contiguous(), out_dtype=out_dtype,
                                   use_fast_accum=use_fast_accum)
            _ROWWISE_DTYPE_OK[key] = True
            return out[:, :n]
        except RuntimeError:
            if out_dtype == torch.bfloat16:   # the one output every row-wise backend supports
                raise
            _ROWWISE_DTYPE_OK[key] = False   # e.g. float32 out on the CUTLASS row-wise path
    one = torch.ones((), dtype=torch.float32, device=a8.device)
    acc = torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                           use_fast_accum=use_fast_accum)
    return (acc * sa[:, None] * sb[None, :])[:, :n].to(out_dtype)


def _gemm_scaled_mm(fa: FoldedOperand, fb: FoldedOperand, pieces, out_dtype,
                    use_fast_accum) -> torch.Tensor:
    if len(pieces) == 1:
        sa = _with_nan(fa.factors[:, 0], fa.nan_rows)
        sb = _with_nan(fb.factors[:, 0], fb.nan_rows)
        return _scaled_mm_rowwise(fa.fp8, fb.fp8, sa, sb, out_dtype, use_fast_accum)
    out = torch.zeros(fa.shape[0], fb.shape[0], dtype=torch.float32, device=fa.fp8.device)
    for k0, k1, ca, cb in pieces:
        sa = _with_nan(fa.factors[:, ca], fa.nan_rows)
        sb = _with_nan(fb.factors[:, cb], fb.nan_rows)
        out += _scaled_mm_rowwise(fa.fp8[:, k0:k1], fb.fp8[:, k0:k1], sa, sb, torch.float32,
                                  use_fast_accum)
    return out.to(out_dtype)



def grouped_fp4_gemm_fp8(a: FoldedOperand, b: FoldedOperand, ends: torch.Tensor, along: str,
                         out_dtype: torch.dtype = torch.bfloat16, use_fast_accum: bool = False,
                         backend: str | None = None, b_layout: str = "stacked") -> torch.Tensor:
    """Every expert's A_e B_e^T on folded MXFP4 operands (see the module doc for the
    layouts): along="rows" -> (P, N), along="k" -> (E, M, N), in out_dtype. ends: (E,) int32,
    each group's end along the grouped dim (non-decreasing; the last at most its length).
    b_layout (along="rows"): "stacked", B stacks the experts' (N, K) operands as (E * N, K);
    "side_by_side", (N, E * K), segmented (one factor per row and expert: the grouped GEMM) or
    not (group by group, where each expert's NaN rows are its own).

    backend: None picks (see the module doc); "scaled_grouped_mm" forces the grouped GEMM
    (CUDA, one chunk per operand), "loop" the group-by-group GEMMs (fp4_gemm_fp8 on each)."""
    if along not in ("rows", "k"):
        raise ValueError(f"along must be 'rows' or 'k', got {along!r}")
    if b_layout not in ("stacked", "side_by_side") or (along == "k" and b_layout != "stacked"):
        raise ValueError(f"b_layout must be 'stacked', or 'side_by_side' with along='rows'; got "
                         f"{b_layout!r} with along={along!r}")
    if backend not in (None, "scaled_grouped_mm", "loop"):
        raise ValueError(f"backend must be None, 'scaled_grouped_mm' or 'loop', got {backend!r}")
    experts = ends.shape[0]
    side_by_side = b_layout == "side_by_side"
    if (b.shape[1] != a.shape[1] * (experts if side_by_side else 1)
            or (along == "rows" and not side_by_side and b.shape[0] % max(experts, 1))):
        raise ValueError(f"a is {tuple(a.shape)} and b is {tuple(b.shape)} for {experts} groups "
                         f"along {along}: both need the same K, and along='rows' b stacks "
                         "the groups' equal row blocks (side by side: their K-blocks)")
    if side_by_side and b.segment_ends is not None and b.segment_ends.shape[0] != experts:
        raise ValueError(f"b has factors for {b.segment_ends.shape[0]} segments of its columns; "
                         f"side by side it takes one per group ({experts})")
    for name, op in (("a", a), ("b", b)):
        if side_by_side and op is b:
            continue   # its segments are the experts' column blocks, checked above
        # the same tensor as the GEMM's ends (as lowbit.ops.grouped passes it), else compared
        if op.segment_ends is not None and (along == "rows" or op.segment_ends.shape != ends.shape or (
                op.segment_ends is not ends and not torch.equal(op.segment_ends.to(ends), ends))):
            raise ValueError(f"{name} has factors per segment of K ({op.segment_ends.shape[0]} "
                             f"segments): it takes along='k' with those segments as the groups, "
                             f"got along={along!r} and {experts} groups ending elsewhere")
    if backend is None:
        backend = ("scaled_grouped_mm" if _grouped_mm_fits(a, b, experts, along, out_dtype, side_by_side)
                   else "loop")
    if backend == "scaled_grouped_mm":
        return _gemm_scaled_grouped(a, b, ends, along, use_fast_accum, side_by_side)
    return _gemm_groups(a, b, ends, along, out_dtype, use_fast_accum, side_by_side)


def _grouped_mm_fits(a: FoldedOperand, b: FoldedOperand, experts: int, along: str,
                     out_dtype: torch.dtype, side_by_side: bool = False) -> bool:
    """torch._scaled_grouped_mm takes these operands as they are: a CUDA GPU it has kernels for
    (Hopper, Blackwell datacenter), one chunk each, a bf16 output (its only one) and widths a
    multiple of 16 (its stride rule)."""
    n = b.shape[0] if along == "k" or side_by_side else b.shape[0] // experts
    widths = (a.shape[1], n) + ((a.shape[0],) if along == "k" else ())
    if side_by_side and b.segment_ends is None:
        return False   # one NaN flag per row would span every expert: group by group instead
    return (a.fp8.is_cuda and hasattr(torch, "_scaled_grouped_mm") and experts > 0
            and torch.cuda.get_device_capability(a.fp8.device) in ((9, 0), (10, 0))
            and len(a.bounds) == len(b.bounds) == 2 and out_dtype == torch.bfloat16
            and all(w % 16 == 0 for w in widths))


def _gemm_scaled_grouped(a: FoldedOperand, b: FoldedOperand, ends: torch.Tensor, along: str,
                         use_fast_accum: bool, side_by_side: bool = False) -> torch.Tensor:
    if len(a.bounds) != 2 or len(b.bounds) != 2:
        raise ValueError("the grouped FP8 GEMM takes operands folded in one K-chunk; these have "
                         f"{len(a.bounds) - 1} and {len(b.bounds) - 1}: use backend='loop'")
    experts = ends.shape[0]
    if along == "rows":
        sa = _with_nan(a.factors[:, 0], a.nan_rows)
        if side_by_side:
            if b.segment_ends is None:
                raise ValueError("side by side, the grouped FP8 GEMM takes a B segmented by expert "
                                 "(a factor and NaN flag per row and expert): use backend='loop'")
            # B (N, E * K): expert e's B_e^T (K, N) column-major is the view of its column
            # block (leading dimension E * K); the factors per row and expert, expert-major
            n, k = b.shape[0], a.shape[1]
            b_t = b.fp8.view(n, experts, k).permute(1, 2, 0)
            sb = _with_nan(b.factors, b.nan_rows).t()
        else:
            # A (P, K) row-major, B_e^T (K, N) column-major: the stacked rows seen as (E, K, N)
            n, k = b.shape[0] // experts, b.shape[1]
            b_t = b.fp8.view(experts, n, k).transpose(-2, -1)
            sb = _with_nan(b.factors[:, 0], b.nan_rows).view(experts, n)
        return torch._scaled_grouped_mm(a.fp8, b_t, sa.contiguous(), sb.contiguous(), offs=ends,
                                        out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum)
    # groups along K: the scales are per group and row, group-major: a segmented operand's
    # factor of each row in each group, else each row's one factor for every group. A group
    # with no tokens gives zeros, whatever the GEMM leaves there.
    out = torch._scaled_grouped_mm(a.fp8, b.fp8.t(), _per_group(a, experts),
                                   _per_group(b, experts), offs=ends,
                                   out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum)
    empty = torch.diff(ends, prepend=ends.new_zeros(1)) == 0
    return out.masked_fill(empty[:, None, None], 0)


def _per_group(op: FoldedOperand, experts: int) -> torch.Tensor:
    """An along="k" operand's row scales for every group, group-major ((E * R,) float32)."""
    if op.segment_ends is not None:
        return _with_nan(op.factors, op.nan_rows).t().reshape(-1).contiguous()
    return _with_nan(op.factors[:, 0], op.nan_rows).repeat(experts)


def _gemm_groups(a: FoldedOperand, b: FoldedOperand, ends: torch.Tensor, along: str,
                 out_dtype: torch.dtype, use_fast_accum: bool, side_by_side: bool = False) -> torch.Tensor:
    experts = ends.shape[0]
    bounds = [0, *ends.tolist()]                                  # one host read
    backend = None if a.fp8.is_cuda else "emulated"
    if along == "rows":
        n, k = (b.shape[0], a.shape[1]) if side_by_side else (b.shape[0] // max(experts, 1), None)
        out = torch.zeros(a.shape[0], n, dtype=out_dtype, device=a.fp8.device)
        for e in range(experts):
            if bounds[e + 1] > bounds[e]:
                b_e = b.group(e, e * k, (e + 1) * k) if side_by_side else b.rows(e * n, (e + 1) * n)
                out[bounds[e]:bounds[e + 1]] = fp4_gemm_fp8(
                    a.rows(bounds[e], bounds[e + 1]), b_e, out_dtype, use_fast_accum, backend)
        return out
    out = torch.zeros(experts, a.shape[0], b.shape[0], dtype=out_dtype, device=a.fp8.device)
    for e in range(experts):
        if bounds[e + 1] > bounds[e]:
            out[e] = fp4_gemm_fp8(a.group(e, bounds[e], bounds[e + 1]),
                                  b.group(e, bounds[e], bounds[e + 1]), out_dtype, use_fast_accum,
                                  backend)
    return out
