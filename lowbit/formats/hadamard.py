"""The random Hadamard transform of nvfp4's wgrad operands, as a reference.

    r = random_hadamard(t, signs)    # t (rows, N) -> (rows, N'), N' = N padded to 16k

Each group of 16 along the last dim is multiplied by diag(signs) . H16 / 4, a 16x16
orthonormal matrix (H16 the Sylvester Hadamard matrix, `signs` 16 random +-1). Applied to both
operands of the weight-gradient GEMM along its reduction dim (tokens), it cancels in
dW = (dY^T R)(X^T R)^T = dY^T X while spreading outliers across each group of 16 tokens before
they are quantized (arXiv 2509.25149).

The arithmetic is fixed, so the fused Triton kernels (lowbit.kernels.fake_quantize_triton with
`hadamard`, lowbit.kernels.hadamard) do exactly the same operations: t times the signs, a fast
Walsh-Hadamard transform in float32 (butterflies a + b, a - b at strides 1, 2, 4, 8, in that
order), times 1/4, rounded once to t's dtype. The butterflies of bf16 inputs are exact in
float32 unless a group's values span more than about 12 binades (fp16: 9), so this is the
exact product rounded once in practice, and the same bits wherever it is computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["random_hadamard"]


def random_hadamard(t: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """t (rows, N) times the block-diagonal orthonormal diag(signs) . H16 / 4 along N, in t's
    dtype (rows, N'), N' = N padded with zeros to a multiple of 16 (zeros add nothing)."""
    rows, n = t.shape
    pad = (-n) % 16
    if pad:
        t = F.pad(t, (0, pad))
    x = t.to(torch.float32) * signs.to(t.device, torch.float32).repeat((n + pad) // 16)
    for stride in (1, 2, 4, 8):
        y = x.reshape(rows, -1, 2, stride)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        x = torch.stack([a + b, a - b], dim=2).reshape(rows, n + pad)
    return (x * 0.25).to(t.dtype)
