"""AdamW's step with the change times a per-element B, one pass over a weight tensor.

The same arithmetic as lowbit.formats.optimizer.adamw_times_b_, operation for operation, the
divisions and the square root rounded as IEEE's (tl.div_rn, tl.sqrt_rn), and compiled with
multiply-add fusion off (`enable_fp_fusion=False`: a fused multiply-add rounds once where the
reference rounds twice, which in m + (g - m)(1 - beta1) is a relative difference of 1e-5 where
the sum cancels): the same bits as the reference. One program takes BLOCK elements: it reads
p, g, m, v and B once and writes p, m and v once (30 bytes a weight with a bfloat16 B, against
fused AdamW's 28), its three scalars (step_size, sqrt(1 - beta2^t), decay) read from the
device, so nothing waits on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["adamw_times_b_triton"]

BLOCK = 2048


@triton.jit
def _adamw_times_b_kernel(p_ptr, g_ptr, m_ptr, v_ptr, b_ptr, step_size_ptr, corr2_ptr, decay_ptr, n,
                          c1, beta2, c2, eps, levels, HAS_DECAY: tl.constexpr, HAS_LEVELS: tl.constexpr,
                          BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    step_size = tl.load(step_size_ptr)
    corr2 = tl.load(corr2_ptr)
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    m = m + (g - m) * c1
    v = v * beta2 + (g * g) * c2
    # IEEE division and square root (Triton's "/" on float32 is an approximate division)
    delta = tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), corr2) + eps) * step_size
    if HAS_DECAY:
        delta = delta + p * tl.load(decay_ptr)
    delta = delta * tl.load(b_ptr + offs, mask=mask).to(tl.float32)
    if HAS_LEVELS:
        delta = tl.div_rn(delta, levels)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(p_ptr + offs, p + delta, mask=mask)


def adamw_times_b_triton(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, b: torch.Tensor,
                         step_size: torch.Tensor, correction2_sqrt: torch.Tensor, decay: torch.Tensor | None,
                         beta1: float, beta2: float, eps: float, levels_per_unit: float | None) -> None:
    """lowbit.formats.optimizer.adamw_times_b_ in one launch: p, m, v float32 and contiguous, g
    float32, b (float32, bfloat16 or uint8) contiguous and of p's shape, the scalars float32
    0-d tensors on p's device."""
    if not (p.dtype == m.dtype == v.dtype == g.dtype == torch.float32):
        raise ValueError(f"the AdamW kernel takes float32 weights, gradients and moments (got {p.dtype}, "
                         f"{g.dtype}, {m.dtype}, {v.dtype})")
    tensors = (p, g, m, v, b)
    if any(t.shape != p.shape or not t.is_contiguous() for t in tensors):
        raise ValueError("the AdamW kernel takes contiguous tensors of one shape; give it those or "
                         "take the reference (lowbit.formats.optimizer.adamw_times_b_)")
    n = p.numel()
    if n == 0:
        return
    decay_t = step_size if decay is None else decay        # an unused pointer without decay
    _adamw_times_b_kernel[(triton.cdiv(n, BLOCK),)](
        p, g, m, v, b, step_size, correction2_sqrt, decay_t, n, 1 - beta1, beta2, 1 - beta2, eps,
        float(levels_per_unit or 1.0), HAS_DECAY=decay is not None, HAS_LEVELS=levels_per_unit is not None,
        BLOCK=BLOCK, num_warps=8, enable_fp_fusion=False)
