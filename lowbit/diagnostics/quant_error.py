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
    """Compare x with its quantization q (over x's finite values)."""
    x_hat = q.dequantize(torch.float32)
    xf = x.float()
    finite = torch.isfinite(xf)
    xs, hs = xf[finite].double(), x_hat[finite].double()
    norm = xs.norm().item()
    rel = (xs - hs).norm().item() / norm if norm > 0 else 0.0
    n = max(xs.numel(), 1)
    # A float32 ulp over the block max (x * (1/scale) rounding up) is not clipping.
    clipped = (xf.abs() > q.block_max() * (1 + 2**-20))[finite].sum().item() / n
    nonzero = xs != 0
    flushed = ((hs == 0) & nonzero).sum().item() / max(nonzero.sum().item(), 1)
    return QuantError(sqnr_db(xs, hs), rel, clipped, flushed, int((~finite).sum().item()),
                      q.nbytes, x.numel() * 2)
