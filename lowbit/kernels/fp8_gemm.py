"""Exact MXFP4 GEMMs on FP8 tensor cores: fold the block scales into E4M3 elements.

Hopper has no FP4 tensor cores, but every MXFP4 value is exactly an FP8 E4M3 value times a
power of two that can be kept per row. The folding:

E2M1's nonzero magnitudes are 0.5 = 1.0*2^-1, 1 = 1.0*2^0, 1.5, 2 = 1.0*2^1, 3 = 1.5*2^1,
4 = 1.0*2^2 and 6 = 1.5*2^2: significand 1.0 with exponents -1..2, or 1.5 with exponents 0..2.
E4M3 ("fn", bias 7, max 448) holds exactly
  1.0*2^e for e in [-9, 8]  (normal from 2^-6; 2^-7, 2^-8, 2^-9 are the subnormals 4, 2, 1 * 2^-9)
  1.5*2^e for e in [-8, 8]  (1.5*2^-7 = 6*2^-9 and 1.5*2^-8 = 3*2^-9 are subnormals; 1.5*2^-9
                             is not on the 2^-9 grid; 1.5*2^8 = 384 <= 448).
So an E2M1 value times 2^t is exact in E4M3 for all seven magnitudes iff
  6*2^t <= 384 (t <= 6),  0.5*2^t >= 2^-9 (t >= -8),  1.5*2^t >= 1.5*2^-8 (t >= -8):
t in [-8, 6], 15 shifts (tests/test_fp8_gemm.py enumerates every code and shift). At t = -9
exactly the magnitudes 0.5 and 1.5 stop being exact (0.5*2^-9 is a tie that rounds to 0,
1.5*2^-9 rounds to 2^-8).

A block with E8M0 exponent s holds v*2^s. Folding a row with one factor 2^f stores
v*2^(s-f) in E4M3, exact iff every block's shift s - f is in [-8, 6]. Such an f exists iff the
row's block exponents span at most WINDOW_SPAN = 14 binades (15 consecutive exponents),
counting at the bottom only blocks that hold a nonzero value (an all-zero block is zeros at any
shift; E8M0 gives it the smallest exponent, which must not widen the span) and no NaN. DESIGN.md and
issue 4 say 13 (from "E4M3 holds 1.0 and 1.5 times 2^e for e in [-8, 8]"): safe, but one
short, since E4M3 also holds 1.0*2^-9, which is where a block's 0.5s land at shift -8. A span
of 15 loses the smallest block's 0.5s and 1.5s. lowbit takes f = max(s_max - 6, -126): the largest
block lands on shift 6 (its 6 becomes 384) and the factor is a normal float32 (a tiny row,
s_max < -120, lands lower but stays in the window, since s >= -127). s_max is over every finite
block, live or not: a block whose codes are all zero has the smallest exponent, except a zero
row-segment of a 2D tile, which takes its tile's. So the factor depends on the scales alone,
and all rows of a 2D tile band share it (the fused kernels need no rounded element to find it);
a row with no finite block gets f = 0.

Rows that span more: the reduction dim K is split into chunks, each with its own factor per
row, chosen greedily from the left so each chunk is as long as possible while every row of
the operand spans <= 14 binades inside it (greedy gives the fewest chunks, since a sub-range
of a foldable range is foldable). A GEMM then is a sum of per-chunk row-scaled FP8 GEMMs.
Each operand is folded on its own (a weight is folded once and serves every GEMM); the GEMM
runs over the union of both operands' chunk boundaries, each piece keeping its parent
chunk's factors (still exact: a piece of a foldable chunk folds with the chunk's factor).
fold_report() says how many rows and values one factor per row would lose.

Special values. A NaN block (E8M0 255) folds to E4M3 NaN, so fp8 * factor is NaN exactly where
dequantize() is NaN. In the GEMM a NaN anywhere in a row of A makes that whole output row NaN
(NaN * 0 is NaN), and likewise for the columns from B; fp4_gemm_fp8 makes sure of that by
giving such rows a NaN factor instead of relying on the tensor cores' NaN handling. Values
float32 cannot hold: a block with exponent 126 or 127 can represent |v*2^s| >= 2^128,
which dequantize() saturates to float32's max; the folded form keeps the true value (fp8 *
factor overflows to +-Inf in float32 arithmetic, and is exact in float64).

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
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowbit.formats.elements import E2M1_VALUES, unpack_codes
from lowbit.formats.qtensor import QTensor
from lowbit.formats.spec import ScaleKind

__all__ = ["SHIFT_MIN", "SHIFT_MAX", "WINDOW_SPAN", "ACTIVE", "FoldedOperand", "FoldReport",
           "FoldCheck", "fold", "fold_operand", "fold_report", "weight_operands", "quantize_fold",
           "deferred_fold_check", "active_fold_check", "resolve_check", "fp4_gemm_fp8",
           "watch_chunked_folds", "active_watch", "folding_for"]

SHIFT_MIN, SHIFT_MAX = -8, 6          # E2M1 * 2^t is exact in E4M3 iff SHIFT_MIN <= t <= SHIFT_MAX
WINDOW_SPAN = SHIFT_MAX - SHIFT_MIN   # 14: block exponents one factor can cover (max - min)
_FACTOR_EXP_MIN = -126                # keep factors normal float32 numbers
_NAN_ROW = SHIFT_MAX - SHIFT_MIN + 1  # table row 15: E4M3 NaN for every code
_E4M3_NAN = 0x7F
_NONE_HI, _NONE_LO = -(1 << 20), 1 << 20   # running max / min of a row with no live block yet
_TABLES: dict[torch.device, torch.Tensor] = {}


def _shift_table(device: torch.device) -> torch.Tensor:
    """uint8 (16 * 16,): entry (t - SHIFT_MIN) * 16 + code is the E4M3 bits of E2M1(code) * 2^t;
    row 15 is NaN. Built with torch's own E4M3 cast and checked exact, entry by entry."""
    table = _TABLES.get(device)
    if table is None:
        mags = torch.tensor(E2M1_VALUES, dtype=torch.float64)
        values = torch.cat([mags, -mags])                                   # codes 0..15
        shifts = torch.arange(SHIFT_MIN, SHIFT_MAX + 1, dtype=torch.float64)
        exact = values[None, :] * torch.exp2(shifts)[:, None]               # (15, 16)
        fp8 = exact.to(torch.float32).to(torch.float8_e4m3fn)
        if not torch.equal(fp8.to(torch.float64), exact):
            raise AssertionError("E2M1 * 2^t is not exact in E4M3 for some t in the window")
        nan_row = torch.full((1, 16), _E4M3_NAN, dtype=torch.uint8)
        table = torch.cat([fp8.view(torch.uint8), nan_row]).reshape(-1).to(device)
        _TABLES[device] = table
    return table


@dataclass(frozen=True)
class FoldedOperand:
    """One GEMM operand, rows x K, as E4M3 values and one power-of-two factor per row per
    K-chunk: value[r, k] = fp8[r, k] * factors[r, c] for bounds[c] <= k < bounds[c + 1]."""

    fp8: torch.Tensor           # (R, K) float8_e4m3fn, row-major
    factors: torch.Tensor       # (R, n_chunks) float32 powers of two
    bounds: tuple[int, ...]     # chunk boundaries along K: 0 = bounds[0] < ... < bounds[-1] = K
    nan_rows: torch.Tensor      # (R,) bool: the row holds a NaN block

    @property
    def shape(self) -> torch.Size:
        return self.fp8.shape

    def unfold(self) -> torch.Tensor:
        """The represented values, float32 (R, K): fp8 * factor (equal to the QTensor's
        dequantize(torch.float32) wherever float32 can hold the value)."""
        lengths = torch.tensor([b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])],
                               device=self.fp8.device)
        per_column = self.factors.repeat_interleave(lengths, dim=1)          # (R, K)
        return self.fp8.to(torch.float32) * per_column


@dataclass(frozen=True)
class FoldReport:
    """What folding with ONE factor per row (no K-chunks) would do to an operand."""

    rows: int
    rows_over_window: int      # rows whose blocks span more than WINDOW_SPAN binades
    max_span: int              # the largest span of any row: its largest finite block exponent
                               # down to its smallest live one (0 for a row with none live)
    values: int                # nonzero, non-NaN values
    values_inexact: int        # of those, how many one factor per row would round
    values_flushed: int        # of the inexact ones, how many would become zero
    chunks: int                # K-chunks fold_operand() uses instead, so that nothing rounds

    def __str__(self) -> str:
        return (f"{self.rows_over_window}/{self.rows} rows span > {WINDOW_SPAN} binades "
                f"(max {self.max_span}); one factor per row would round {self.values_inexact}/"
                f"{self.values} values ({self.values_flushed} to zero); fold_operand uses "
                f"{self.chunks} K-chunk(s) and keeps all of them exact")


# ---- folding -------------------------------------------------------------------------------

class _Blocks:
    """An operand's unpacked codes and per-block exponents, rows x K, blocks of b along K."""

    def __init__(self, q: QTensor, transpose: bool):
        _check_foldable(q)
        rows, cols = q.shape
        codes = unpack_codes(q.codes, 4)[:, :cols]                   # (R, C) uint8
        scales = q.scales                                            # (R, C/b) or (R/b, C/b)
        b = q.spec.block[1]
        if transpose:
            if not q.spec.is_2d:
                raise ValueError(
                    "transpose=True needs square 2D tiles (the transposed operand then has the "
                    f"same blocks); this QTensor has 1D blocks {q.spec.block}: quantize the "
                    "transposed tensor instead")
            codes, scales, rows, cols = codes.t(), scales.t(), cols, rows
        if q.spec.is_2d:
            scales = scales.repeat_interleave(b, dim=0)[:rows]          # one row of scales per row
        n_blocks = -(-cols // b)
        self.rows, self.k, self.b, self.n_blocks = rows, cols, b, n_blocks
        codes = F.pad(codes, (0, n_blocks * b - cols))                   # zeros: nothing to fold
        self.codes = codes.reshape(rows, n_blocks, b)                   # (R, nb, b)
        self.nan = scales == 255                                        # (R, nb)
        self.exps = scales.to(torch.int32) - 127
        self.live = ((self.codes & 0x7) != 0).any(dim=-1) & ~self.nan   # a nonzero, finite value

    def hi_lo(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, nb) each: the exponents that set a row's top (every finite block, live or not)
        and its bottom (live blocks only), _NONE_HI / _NONE_LO elsewhere."""
        return (torch.where(self.nan, _NONE_HI, self.exps),
                torch.where(self.live, self.exps, _NONE_LO))

    def chunk_bounds(self) -> list[int]:
        """Fewest K-chunks (in blocks) in which every row spans <= WINDOW_SPAN binades: greedy
        from the left. One host sync per chunk."""
        hi, lo = self.hi_lo()
        bounds = [0]
        while bounds[-1] < self.n_blocks:
            start = bounds[-1]
            span = (torch.cummax(hi[:, start:], dim=1).values
                    - torch.cummin(lo[:, start:], dim=1).values)        # (R, nb - start)
            too_wide = (span > WINDOW_SPAN).any(dim=0)
            positions = torch.arange(self.n_blocks - start, device=span.device)
            # block `start` alone always fits, so the first too-wide position is >= 1
            first = torch.where(too_wide, positions, self.n_blocks - start).min()
            bounds.append(start + int(first))
        return bounds

    def factor_exponents(self, block_bounds: list[int]) -> torch.Tensor:
        """(R, n_chunks) int32: f = max(s_max - SHIFT_MAX, -126) over each chunk's finite
        blocks (0 where a row has none)."""
        hi, _ = self.hi_lo()
        out = []
        for a, b in zip(block_bounds[:-1], block_bounds[1:]):
            top = hi[:, a:b].amax(dim=1)
            out.append(torch.where(top > _NONE_HI,
                                   torch.clamp(top - SHIFT_MAX, min=_FACTOR_EXP_MIN), 0))
        return torch.stack(out, dim=1)

    def plan(self, block_bounds: list[int]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """The fold of these K-chunks (in blocks): (each block's row of the shift table,
        (s - f) - SHIFT_MIN or the NaN row, (R, nb) uint8; factors 2^f (R, n_chunks) float32;
        chunk bounds along K). Callers guarantee every live block's shift is in the window."""
        f = self.factor_exponents(block_bounds)
        lengths = torch.tensor([b - a for a, b in zip(block_bounds[:-1], block_bounds[1:])],
                               device=self.exps.device)
        shift = self.exps - f.repeat_interleave(lengths, dim=1)              # (R, nb)
        row = torch.where(self.live, shift - SHIFT_MIN, -SHIFT_MIN)           # zeros: any row
        row = torch.where(self.nan, _NAN_ROW, row).to(torch.uint8)
        factors = ((f + 127) << 23).view(torch.float32)     # 2^f from its bits: f in [-126, 121]
        bounds = tuple(min(u * self.b, self.k) for u in block_bounds)
        return row, factors, bounds

    def fold(self, block_bounds: list[int]) -> FoldedOperand:
        """E2M1(code) * 2^(s - f) as E4M3 by table lookup (exact inside the window)."""
        rows, factors, bounds = self.plan(block_bounds)
        index = (rows << 4)[:, :, None] | self.codes                         # (R, nb, b), < 256
        bits = _shift_table(self.codes.device)[index.to(torch.int32)]
        fp8 = bits.reshape(self.rows, -1)[:, : self.k].view(torch.float8_e4m3fn)
        return FoldedOperand(fp8.contiguous(), factors, bounds, self.nan.any(dim=1))


def _check_foldable(q: QTensor) -> None:
    if not isinstance(q, QTensor):
        raise TypeError(f"expected a QTensor, got {type(q).__name__}")
    info = q.spec.info
    if info.scale_kind is not ScaleKind.E8M0 or info.element.name != "e2m1":
        why = (" (NVFP4's E4M3 block scales have mantissas, so their products with E2M1 need "
               "more bits than E4M3 has: NVFP4 stays on the emulated path)"
               if q.format == "nvfp4" else "")
        raise ValueError(f"only MXFP4 (E2M1 elements, E8M0 scales) folds into FP8 exactly; "
                         f"got {q.format}{why}")
    if len(q.shape) != 2:
        raise ValueError(f"folding takes a 2-D QTensor (rows, K), got shape {tuple(q.shape)}; "
                         "fold each matrix of a batch (e.g. each expert) separately")


def fold_operand(q: QTensor, transpose: bool = False) -> FoldedOperand:
    """Fold an MXFP4 QTensor (R, K), blocked along K, into a FoldedOperand, exact for every
    value: K is split into as few chunks as needed (usually one).

    transpose=True folds q^T (K becomes the rows' dim): the dgrad operand of a weight or the
    wgrad operand of X / dY from the same 2D-tile QTensor (square tiles only), without
    requantizing.

    Choosing the chunks reads back one number per chunk (a host sync on CUDA): the chunk
    count decides the GEMM's shapes."""
    blocks = _Blocks(q, transpose)
    return blocks.fold(blocks.chunk_bounds())


def fold(q: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 (R, C) float8_e4m3fn, row_factor (R, 1) float32) with
    fp8.float() * row_factor == q.dequantize(torch.float32), bit for bit (NaN where it is NaN;
    see the module doc for values beyond float32's range).

    Raises ValueError if a row's nonzero blocks span more than WINDOW_SPAN binades: one factor
    cannot hold them exactly. fold_operand() splits K into chunks instead; fold_report() counts
    what one factor per row would lose."""
    blocks = _Blocks(q, transpose=False)
    hi, lo = blocks.hi_lo()
    span = (hi.amax(dim=1) - lo.amin(dim=1)).clamp(min=0)
    over = int((span > WINDOW_SPAN).sum())
    if over:
        raise ValueError(
            f"{over} of {blocks.rows} rows have nonzero blocks whose exponents span more than "
            f"{WINDOW_SPAN} binades (max {int(span.max())}), so one power-of-two factor per row "
            f"cannot hold them in E4M3 exactly: {fold_report(q)}. Use fold_operand(q), which "
            "splits K into chunks with their own factors")
    folded = blocks.fold([0, blocks.n_blocks])
    return folded.fp8, folded.factors


def fold_report(q: QTensor, transpose: bool = False) -> FoldReport:
    """Count the rows and values that folding with one factor per row (the largest block at
    shift 6) would round or flush to zero, and the K-chunks fold_operand() uses instead."""
    blocks = _Blocks(q, transpose)
    hi, lo = blocks.hi_lo()
    span = (hi.amax(dim=1) - lo.amin(dim=1)).clamp(min=0)                  # (R,)
    f = blocks.factor_exponents([0, blocks.n_blocks])                       # (R, 1)
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=hi.device)
    values = mags[(blocks.codes & 0x7).long()]                              # (R, nb, b)
    exact = values * torch.exp2((blocks.exps - f).to(torch.float64))[:, :, None]
    stored = exact.to(torch.float32).to(torch.float8_e4m3fn).to(torch.float64)
    counted = (values != 0) & ~blocks.nan[:, :, None]
    inexact = counted & (stored != exact)
    return FoldReport(rows=blocks.rows, rows_over_window=int((span > WINDOW_SPAN).sum()),
                      max_span=int(span.max()), values=int(counted.sum()),
                      values_inexact=int(inexact.sum()),
                      values_flushed=int((inexact & (stored == 0)).sum()),
                      chunks=len(blocks.chunk_bounds()) - 1)


def weight_operands(w: QTensor) -> tuple[FoldedOperand, FoldedOperand]:
    """(fprop, dgrad) operands of a weight W (out, in) quantized once with square 2D tiles:
    fprop Y = X W^T takes rows = out, K = in; dgrad dX = dY W = dY (W^T)^T takes rows = in,
    K = out. Both come from the same FP4 values (W^T of a 2D-tile QTensor is exact)."""
    return fold_operand(w), fold_operand(w, transpose=True)


class FoldCheck:
    """The device-side count of values that folds under deferred_fold_check() could not keep
    exact (nonzero values in a block below its row's window: the row spans more than
    WINDOW_SPAN binades). Nonzero means the work done under the check used inexact operands and
    is to be redone outside it (lowbit.train redoes the step). int64, so a step's count cannot
    wrap."""

    def __init__(self, device: torch.device):
        self.device = _canonical(device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.open = True   # once its block has closed, folds handed this check fold exactly
        # opened inside a CUDA graph capture: the graph zeroes and fills this counter at each
        # replay, so the folds it records count here (lowbit.ops.compiled checks this)
        self.captured = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def inexact_values(self) -> int:
        """The count so far (reads it back: one host sync on CUDA)."""
        return int(self.counter.item())


# The check in force, per thread: a fold on another thread (an evaluation, a rollout) stays
# exact. Autograd runs CUDA backward passes on its own threads, so _QuantLinearFP8 takes the
# check when its forward runs and hands it to its backward explicitly (ctx); a backward that
# runs after the check's block has closed folds exactly.
_LOCAL = threading.local()
ACTIVE = "active"   # quantize_fold(check=ACTIVE): the calling thread's check, if any


def _canonical(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@contextlib.contextmanager
def deferred_fold_check(device) -> Iterator[FoldCheck]:
    """Fold without host syncs inside this block (on this thread, for tensors on `device`).

    The fused kernels fold every operand with one factor per row (one K-chunk) and count, on
    the device, the values that this leaves inexact, instead of reading a count back per
    operand and re-folding in K-chunks. Check `inexact_values()` once afterwards (e.g. with the
    step's loss) and redo the work outside the block if it is nonzero: then every GEMM is
    exact, as outside the block. The reference path (CPU) is always exact and never counts.
    A check opened inside another one on the same device adds its count to the outer one's
    when it closes (a device op, no sync)."""
    outer = getattr(_LOCAL, "check", None)
    _LOCAL.check = check = FoldCheck(device)
    try:
        yield check
    finally:
        _LOCAL.check = outer
        check.open = False
        if outer is not None and outer.device == check.device:
            outer.counter += check.counter


def active_fold_check(device: torch.device) -> FoldCheck | None:
    """The deferred_fold_check() in force on this thread for tensors on `device`, if any."""
    return _for_device(getattr(_LOCAL, "check", None), device)


def _for_device(check: FoldCheck | None, device) -> FoldCheck | None:
    return (check if check is not None and check.open and check.device == _canonical(device)
            else None)


def resolve_check(check, device) -> FoldCheck | None:
    """`check` as quantize_fold takes it (ACTIVE, a FoldCheck or None) -> the FoldCheck that
    applies to a tensor on `device`, or None (fold exactly, with a readback)."""
    if check is ACTIVE:
        return active_fold_check(device)
    if check is not None and not isinstance(check, FoldCheck):
        raise TypeError(f"check must be fp8_gemm.ACTIVE, a FoldCheck from deferred_fold_check() "
                        f"or None, got {type(check).__name__}")
    return _for_device(check, device)


def quantize_fold(x: torch.Tensor, spec, transpose_too: bool = False, check=ACTIVE,
                  rows: bool = True) -> tuple[FoldedOperand | None, FoldedOperand | None]:
    """Quantize a 2-D x (rows, K) to MXFP4 with `spec` and fold it: (x's operand, x^T's
    operand or None). x^T's comes from the same FP4 values (square 2D tiles only).
    rows=False (with transpose_too) makes x^T's alone, from one row-major read of x: (None,
    x^T's operand), the same bits as quantize_fold(x.mT) under round-to-nearest.

    CUDA tensors take the fused Triton kernels (lowbit.kernels.fp8_fold, two passes over x and
    no QTensor); elsewhere, or under force_reference(), the reference quantizer and
    fold_operand. Both give the same bits (the kernels' contract, checked in CI under the
    Triton interpreter and on the GPU by benchmarks/bench_fp8_fold.py), except under a
    deferred fold check (`check`: ACTIVE = this thread's, or a FoldCheck, or None), where the
    kernels fold in one K-chunk and a row that needs more is counted in the check instead."""
    from lowbit.formats.quantize import quantize_with_spec
    from lowbit.kernels import use_kernels

    if not (rows or transpose_too):
        raise ValueError("quantize_fold with rows=False makes x^T's operand alone: pass "
                         "transpose_too=True too")
    if use_kernels(x, spec):
        from lowbit.kernels.fp8_fold import quantize_fold_mxfp4, quantize_fold_mxfp4_with_transpose

        if transpose_too and not rows:
            out = None, quantize_fold_mxfp4(x, spec, transpose=True, check=check)
        elif transpose_too:
            out = quantize_fold_mxfp4_with_transpose(x, spec, check=check)
        else:
            out = quantize_fold_mxfp4(x, spec, check=check), None
    else:
        q = quantize_with_spec(x, spec)
        out = (fold_operand(q) if rows else None,
               fold_operand(q, transpose=True) if transpose_too else None)
    _note_chunks(out)
    return out


# ---- which layers need K-chunks --------------------------------------------------------------

@contextlib.contextmanager
def watch_chunked_folds() -> Iterator[set]:
    """Inside this block (on this thread, and in the backward passes of the forwards it ran),
    every fold that needed more than one K-chunk adds its layer to the yielded set: the `layer`
    that `folding_for` names (lowbit's FP8 linear passes its `layer` name; under --fold-inexact
    adapt lowbit.train names each QuantLinear by its module name), eagerly and under
    torch.compile alike. lowbit.train watches a redone step this way to move such layers off
    the FP8 path (--fold-inexact adapt)."""
    outer = getattr(_LOCAL, "watch", None)
    _LOCAL.watch = seen = set()
    try:
        yield seen
    finally:
        _LOCAL.watch = outer
        if outer is not None:
            outer |= seen


def active_watch() -> set | None:
    """The watch_chunked_folds() set in force on this thread, if any."""
    return getattr(_LOCAL, "watch", None)


@contextlib.contextmanager
def folding_for(layer, watch: set | None) -> Iterator[None]:
    """The folds inside this block belong to `layer`, and a chunked one is noted in `watch`
    (the set of a watch_chunked_folds() block, carried to another thread if need be). An
    unnamed layer ("" or None) is not noted."""
    before = getattr(_LOCAL, "folding", None)
    _LOCAL.folding = (layer, watch) if watch is not None and layer else None
    try:
        yield
    finally:
        _LOCAL.folding = before


def _note_chunks(folded) -> None:
    folding = getattr(_LOCAL, "folding", None)
    if folding is not None and any(f is not None and len(f.bounds) > 2 for f in folded):
        folding[1].add(folding[0])


# ---- the GEMM ------------------------------------------------------------------------------

def fp4_gemm_fp8(a: QTensor | FoldedOperand, b: QTensor | FoldedOperand,
                 out_dtype: torch.dtype = torch.bfloat16,
                 use_fast_accum: bool = False) -> torch.Tensor:
    """a.dequantize() @ b.dequantize().T, (M, K) x (N, K) -> (M, N) in out_dtype, on exactly
    the FP4 operands: torch._scaled_mm with row-wise factors on CUDA, an FP32-accumulating
    emulation elsewhere (see the module doc for each one's error). a and b are MXFP4
    QTensors blocked along K, or operands folded before (fold_operand / weight_operands).

    use_fast_accum: CUDA only; lets the FP8 tensor cores accumulate all of K in their reduced
    precision (faster; about 10x the error in issue 4's H200 probe)."""
    fa = a if isinstance(a, FoldedOperand) else fold_operand(a)
    fb = b if isinstance(b, FoldedOperand) else fold_operand(b)
    if fa.shape[1] != fb.shape[1]:
        raise ValueError(f"a is {tuple(fa.shape)} and b is {tuple(fb.shape)}: for a @ b.T both "
                         "need the same K (last dim)")
    if fa.fp8.device != fb.fp8.device:
        raise ValueError(f"a is on {fa.fp8.device} and b on {fb.fp8.device}")
    pieces = _pieces(fa, fb)
    if fa.fp8.is_cuda:
        return _gemm_scaled_mm(fa, fb, pieces, out_dtype, use_fast_accum)
    return _gemm_emulated(fa, fb, pieces, out_dtype)


def _pieces(fa: FoldedOperand, fb: FoldedOperand) -> list[tuple[int, int, int, int]]:
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
