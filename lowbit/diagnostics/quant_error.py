"""How much a quantizer changes a tensor: the numbers `lowbit inspect` prints."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from lowbit.formats import QTensor

__all__ = ["QuantError", "quantization_error", "sqnr_db"]


@dataclass
class QuantError:
    sqnr_db: float        # 10 log10(sum x^2 / sum (x - x_hat)^2); inf when exact
    rel_error: float      # ||x - x_hat|| / ||x||
    clipped: float        # fraction of values beyond the largest magnitude their block can hold
    flushed: float        # fraction of the non-zero values that came back as zero
    nonfinite: int        # NaN/Inf values in x (left out of the other numbers)
    nbytes: int           # packed size: codes + scales + tensor scale
    bf16_nbytes: int      # the same tensor in bf16
    nan: int = 0          # of the non-finite values of x, how many are NaN (the rest: +-Inf)
    made_nonfinite: int = 0  # finite values of x that came back NaN (a NaN/Inf shares their block)
    numel: int = 0        # values in x

    @property
    def measured(self) -> int:
        """Values the error numbers are over: finite in x and in its quantization."""
        return self.numel - self.nonfinite - self.made_nonfinite

    def note(self) -> str:
        """Names the non-finite values the numbers leave out ("" when there are none)."""
        if not self.nonfinite and not self.made_nonfinite:
            return ""
        parts = []
        if self.nonfinite:
            kinds = [f"{n:,} {k}" for n, k in ((self.nan, "NaN"), (self.nonfinite - self.nan, "Inf")) if n]
            parts.append(f"input has {' and '.join(kinds)} of {self.numel:,} values")
        if self.made_nonfinite:
            parts.append(f"{self.made_nonfinite:,} finite values share a block with them and "
                         f"became NaN")
        if self.measured == 0:
            return "; ".join(parts) + ": nothing finite to measure"
        return "; ".join(parts) + f": numbers over the other {self.measured:,}"

    def as_dict(self) -> dict:
        return asdict(self)


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB, accumulated in float64."""
    x, x_hat = x.double(), x_hat.double()
    signal = x.pow(2).sum().item()
    noise = (x - x_hat).pow(2).sum().item()
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


def quantization_error(x: torch.Tensor, q: QTensor) -> QuantError:
    """Compare x with its quantization q over the values finite in both. NaN/Inf inputs, and
    the finite values that a NaN/Inf block-mate turned into NaN, are counted, not measured;
    with nothing left to measure, SQNR and the relative error are NaN (never a perfect score)."""
    x_hat = q.dequantize(torch.float32)
    xf = x.float()
    finite = torch.isfinite(xf)
    made_nonfinite = finite & ~torch.isfinite(x_hat)
    both = finite & ~made_nonfinite
    xs, hs = xf[both].double(), x_hat[both].double()
    n = xs.numel()
    norm = xs.norm().item()
    if n == 0:
        sqnr, rel = math.nan, math.nan
    else:
        sqnr = sqnr_db(xs, hs)
        rel = (xs - hs).norm().item() / norm if norm > 0 else (0.0 if (hs == 0).all() else math.inf)
    # A float32 ulp over the block max (x * (1/scale) rounding up) is not clipping.
    clipped = (xf.abs() > q.block_max() * (1 + 2**-20))[both].sum().item() / max(n, 1)
    nonzero = xs != 0
    flushed = ((hs == 0) & nonzero).sum().item() / max(nonzero.sum().item(), 1)
    return QuantError(sqnr, rel, clipped, flushed, int((~finite).sum().item()),
                      q.nbytes, x.numel() * 2, nan=int(torch.isnan(xf).sum().item()),
                      made_nonfinite=int(made_nonfinite.sum().item()), numel=x.numel())
