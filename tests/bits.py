"""Bit-level comparison for the tests: two tensors equal bit for bit; and rows in segments,
as an MoE layer's experts' tokens lie in the grouped layout."""

import torch


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN compared by position (a NaN's sign and payload are free)."""
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.isnan(), b.isnan()):
        return False
    bits = torch.int32 if a.dtype == torch.float32 else torch.int16
    keep = ~a.isnan()
    return torch.equal(a.view(bits)[keep], b.view(bits)[keep])


def expert_segments(seed: int, huge: float, tiny: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x (100, 40) float32, ends (5,) int32): rows in segments ending at `ends` (an empty one,
    a huge one, an all-zero one, a tiny one, rows past the last end), NaN and Inf in two rows."""
    g = torch.Generator().manual_seed(seed)
    ends = torch.tensor([16, 16, 48, 64, 96], dtype=torch.int32)
    x = torch.randn(100, 40, generator=g)
    x[16:48] *= huge
    x[48:64] = 0.0
    x[64:96] *= tiny
    x[70, 5], x[20, 33] = float("nan"), float("inf")
    return x, ends
