"""The reference fold of MXFP4 operands into FP8 E4M3 elements and power-of-two row factors.

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
shift; E8M0 gives it the smallest exponent, which must not widen the span) and no NaN. (The
design notes say 13, from "E4M3 holds 1.0 and 1.5 times 2^e for e in [-8, 8]": safe, but one
short, since E4M3 also holds 1.0*2^-9, which is where a block's 0.5s land at shift -8.) A span
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

The GEMM on these operands is lowbit.kernels.fp8_gemm.fp4_gemm_fp8; the fused Triton
kernels that quantize and fold in two passes are lowbit.kernels.fp8_fold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowbit.formats.elements import E2M1_VALUES, device_table, unpack_codes
from lowbit.formats.qtensor import QTensor
from lowbit.formats.spec import ScaleKind

__all__ = ["SHIFT_MIN", "SHIFT_MAX", "WINDOW_SPAN", "FACTOR_EXP_MIN", "NAN_ROW", "NONE_HI",
           "NONE_LO", "FoldedOperand", "FoldReport", "BlockExponents", "check_foldable",
           "shift_table", "factor_exponent", "power_of_two", "fold", "fold_operand", "fold_report",
           "weight_operands"]

SHIFT_MIN, SHIFT_MAX = -8, 6          # E2M1 * 2^t is exact in E4M3 iff SHIFT_MIN <= t <= SHIFT_MAX
WINDOW_SPAN = SHIFT_MAX - SHIFT_MIN   # 14: block exponents one factor can cover (max - min)
FACTOR_EXP_MIN = -126                 # keep factors normal float32 numbers
NAN_ROW = SHIFT_MAX - SHIFT_MIN + 1   # table row 15: E4M3 NaN for every code
E4M3_NAN = 0x7F                       # E4M3 'fn' NaN (S.1111.111, either sign)
NONE_HI, NONE_LO = -(1 << 20), 1 << 20   # running max / min of a row with no live block yet
_TABLES: dict[torch.device, torch.Tensor] = {}


def factor_exponent(top: torch.Tensor) -> torch.Tensor:
    """f = max(s_max - SHIFT_MAX, -126) of rows whose largest finite block exponent is `top`
    (int32), 0 where a row has none (top == NONE_HI)."""
    return torch.where(top > NONE_HI, torch.clamp(top - SHIFT_MAX, min=FACTOR_EXP_MIN), 0)


def power_of_two(f: torch.Tensor) -> torch.Tensor:
    """2^f as float32 from its bits (int32 f in [-126, 127])."""
    return ((f + 127) << 23).view(torch.float32)


def shift_table(device: torch.device) -> torch.Tensor:
    """uint8 (16 * 16,): entry (t - SHIFT_MIN) * 16 + code is the E4M3 bits of E2M1(code) * 2^t;
    row 15 is NaN. Built with torch's own E4M3 cast and checked exact, entry by entry."""
    return device_table(device, _TABLES, _shift_table)


def _shift_table() -> torch.Tensor:
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    values = torch.cat([mags, -mags])                                   # codes 0..15
    shifts = torch.arange(SHIFT_MIN, SHIFT_MAX + 1, dtype=torch.float64)
    exact = values[None, :] * torch.exp2(shifts)[:, None]               # (15, 16)
    fp8 = exact.to(torch.float32).to(torch.float8_e4m3fn)
    if not torch.equal(fp8.to(torch.float64), exact):
        raise AssertionError("E2M1 * 2^t is not exact in E4M3 for some t in the window")
    nan_row = torch.full((1, 16), E4M3_NAN, dtype=torch.uint8)
    return torch.cat([fp8.view(torch.uint8), nan_row]).reshape(-1)


@dataclass(frozen=True)
class FoldedOperand:
    """One GEMM operand, rows x K, as E4M3 values and one power-of-two factor per row per
    K-chunk: value[r, k] = fp8[r, k] * factors[r, c] for bounds[c] <= k < bounds[c + 1].

    Segmented (segment_ends set; made by the fused kernels for a grouped GEMM whose groups
    split K, lowbit.kernels.fp8_fold): one chunk (bounds (0, K)) but one factor per row and
    segment, factors (R, S), segment s spanning [segment_ends[s - 1], segment_ends[s]) (the
    first from 0; columns past the last end take the last segment's), an (S,) int tensor on the
    device; nan_rows is then (R, S), per segment."""

    fp8: torch.Tensor           # (R, K) float8_e4m3fn, row-major
    factors: torch.Tensor       # (R, n_chunks) float32 powers of two; segmented: (R, S)
    bounds: tuple[int, ...]     # chunk boundaries along K: 0 = bounds[0] < ... < bounds[-1] = K
    nan_rows: torch.Tensor      # (R,) bool: the row holds a NaN block; segmented: (R, S)
    segment_ends: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.fp8.shape

    def _segment_of_columns(self) -> torch.Tensor:
        """Segmented: each column's segment, (K,) int64 (no host read)."""
        k = torch.arange(self.fp8.shape[1], device=self.fp8.device)
        return torch.searchsorted(self.segment_ends.to(torch.int64), k, right=True).clamp_(
            max=self.segment_ends.shape[0] - 1)

    def unfold(self) -> torch.Tensor:
        """The represented values, float32 (R, K): fp8 * factor (equal to the QTensor's
        dequantize(torch.float32) wherever float32 can hold the value)."""
        if self.segment_ends is not None:
            return self.fp8.to(torch.float32) * self.factors[:, self._segment_of_columns()]
        lengths = torch.tensor([b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])],
                               device=self.fp8.device)
        per_column = self.factors.repeat_interleave(lengths, dim=1)          # (R, K)
        return self.fp8.to(torch.float32) * per_column

    def rows(self, start: int, stop: int) -> FoldedOperand:
        """Rows start:stop, the same values (views; one expert's rows of a stacked operand)."""
        return FoldedOperand(self.fp8[start:stop], self.factors[start:stop], self.bounds,
                             self.nan_rows[start:stop], self.segment_ends)

    def group(self, index: int, start: int, stop: int) -> FoldedOperand:
        """Group `index` of a grouped GEMM, K-columns start:stop (its bounds, read by the
        caller): a segmented operand's segment `index` with its factors and NaN rows (no read
        of segment_ends), else `columns(start, stop)`."""
        if self.segment_ends is None:
            return self.columns(start, stop)
        return FoldedOperand(self.fp8[:, start:stop], self.factors[:, index:index + 1],
                             (0, stop - start), self.nan_rows[:, index])

    def columns(self, start: int, stop: int) -> FoldedOperand:
        """K-columns start:stop (start < stop), the same values: the chunks that meet them,
        their bounds cut to the slice (one expert's tokens of a wgrad operand), and the slice's
        own NaN rows (a NaN block folds to E4M3 NaN, so a row of the slice holding one is a
        NaN row of its GEMM; a NaN elsewhere in the row does not reach it, as a fold of the
        slice alone would have it). Segmented: the slice must lie in one segment (it reads
        segment_ends back), and it is an ordinary one-chunk operand with that segment's
        factors and NaN rows."""
        if self.segment_ends is not None:
            ends = self.segment_ends.tolist()
            s = min(sum(e <= start for e in ends), len(ends) - 1)
            if s < len(ends) - 1 and stop > ends[s]:
                raise ValueError(f"columns {start}:{stop} cross the end of segment {s} ({ends[s]})")
            return self.group(s, start, stop)
        inside = [c for c in range(len(self.bounds) - 1)
                  if self.bounds[c] < stop and self.bounds[c + 1] > start]
        bounds = tuple([0] + [self.bounds[c + 1] - start for c in inside[:-1]] + [stop - start])
        fp8 = self.fp8[:, start:stop]
        nan_rows = ((fp8.view(torch.uint8) & 0x7F) == 0x7F).any(dim=1)    # E4M3 NaN: S.1111.111
        return FoldedOperand(fp8, self.factors[:, inside], bounds, nan_rows)


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

class BlockExponents:
    """An operand's unpacked codes and per-block exponents, rows x K, blocks of b along K."""

    def __init__(self, q: QTensor, transpose: bool):
        check_foldable(q)
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
        and its bottom (live blocks only), NONE_HI / NONE_LO elsewhere."""
        return (torch.where(self.nan, NONE_HI, self.exps),
                torch.where(self.live, self.exps, NONE_LO))

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
        return torch.stack([factor_exponent(hi[:, a:b].amax(dim=1))
                            for a, b in zip(block_bounds[:-1], block_bounds[1:])], dim=1)

    def plan(self, block_bounds: list[int]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """The fold of these K-chunks (in blocks): (each block's row of the shift table,
        (s - f) - SHIFT_MIN or the NaN row, (R, nb) uint8; factors 2^f (R, n_chunks) float32;
        chunk bounds along K). Callers guarantee every live block's shift is in the window."""
        f = self.factor_exponents(block_bounds)
        lengths = torch.tensor([b - a for a, b in zip(block_bounds[:-1], block_bounds[1:])],
                               device=self.exps.device)
        shift = self.exps - f.repeat_interleave(lengths, dim=1)              # (R, nb)
        row = torch.where(self.live, shift - SHIFT_MIN, -SHIFT_MIN)           # zeros: any row
        row = torch.where(self.nan, NAN_ROW, row).to(torch.uint8)
        factors = power_of_two(f)                           # f in [-126, 121]
        bounds = tuple(min(u * self.b, self.k) for u in block_bounds)
        return row, factors, bounds

    def fold(self, block_bounds: list[int]) -> FoldedOperand:
        """E2M1(code) * 2^(s - f) as E4M3 by table lookup (exact inside the window)."""
        rows, factors, bounds = self.plan(block_bounds)
        index = (rows << 4)[:, :, None] | self.codes                         # (R, nb, b), < 256
        bits = shift_table(self.codes.device)[index.to(torch.int32)]
        fp8 = bits.reshape(self.rows, -1)[:, : self.k].view(torch.float8_e4m3fn)
        return FoldedOperand(fp8.contiguous(), factors, bounds, self.nan.any(dim=1))


def check_foldable(q: QTensor) -> None:
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
    blocks = BlockExponents(q, transpose)
    return blocks.fold(blocks.chunk_bounds())


def fold(q: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 (R, C) float8_e4m3fn, row_factor (R, 1) float32) with
    fp8.float() * row_factor == q.dequantize(torch.float32), bit for bit (NaN where it is NaN;
    see the module doc for values beyond float32's range).

    Raises ValueError if a row's nonzero blocks span more than WINDOW_SPAN binades: one factor
    cannot hold them exactly. fold_operand() splits K into chunks instead; fold_report() counts
    what one factor per row would lose."""
    blocks = BlockExponents(q, transpose=False)
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
    blocks = BlockExponents(q, transpose)
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


