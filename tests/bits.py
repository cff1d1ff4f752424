"""Bit-level comparison for the tests: two tensors equal bit for bit."""

import torch


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN compared by position (a NaN's sign and payload are free)."""
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.isnan(), b.isnan()):
        return False
    bits = torch.int32 if a.dtype == torch.float32 else torch.int16
    keep = ~a.isnan()
    return torch.equal(a.view(bits)[keep], b.view(bits)[keep])
