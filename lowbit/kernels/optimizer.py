"""AdamW's step of every weight of a step in one launch, optionally with the gradients times a
clip coefficient and each change times a per-element B.

The same arithmetic as lowbit.formats.optimizer.adamw_step_, operation for operation, the
divisions and the square root rounded as IEEE's (tl.div_rn, tl.sqrt_rn), and compiled with
multiply-add fusion off (`enable_fp_fusion=False`: a fused multiply-add rounds once where the
reference rounds twice, which in m + (g - m)(1 - beta1) is a relative difference of 1e-5 where
the sum cancels): the same bits as the reference. One program takes BLOCK elements of one
weight: it reads p, g, m, v (and B) once and writes p, m and v once (28 bytes a weight, as
fused AdamW's; 30 with a bfloat16 B), its two scalars (step_size, sqrt(1 - beta2^t)), the decay
and the clip's coefficient read from the device, so nothing waits on the host. The gradient is
multiplied by the coefficient in registers, not in memory: a clip folded in saves the clip's
pass over every gradient (read and write), and the gradients keep their unclipped values.

Every weight of a step goes in one launch, as torch's multi-tensor AdamW goes (a launch a
weight spends the host's time on each of a model's tens or hundreds of weights): one program
a block of one weight, every weight's blocks in turn, each program's weight read from a map
made once for the weights' sizes; each weight's five addresses, size and first block are one
row of a small int64 table copied to the device each step (the gradients are new tensors
every step; the rest of the table is kept for the addresses the optimizer's tensors hold).
The copy makes a step that CUDA graphs cannot capture; lowbit's loops keep the optimizer's
step out of their graphs.
"""

from __future__ import annotations

import functools
import itertools

import torch
import triton
import triton.language as tl

from lowbit.formats.optimizer import B_DTYPES
from lowbit.kernels.launch import cdiv
from lowbit.kernels.quantize import on_device

__all__ = ["adamw_step_triton"]

BLOCK = 2048
_B_TYPES = {dtype: code for code, dtype in enumerate(B_DTYPES)}   # B_TYPE: float32 0, bfloat16 1, uint8 2
NO_B = -1                                                            # B_TYPE without B


@triton.jit
def _adamw_step_kernel(table_ptr, block_weight_ptr, step_size_ptr, corr2_ptr, decay_ptr, coef_ptr, c1, beta2,
                       c2, eps, levels, B_TYPE: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_COEF: tl.constexpr,
                       HAS_LEVELS: tl.constexpr, BLOCK: tl.constexpr):
    block = tl.program_id(0)
    weight = tl.load(block_weight_ptr + block)
    row = table_ptr + weight.to(tl.int64) * 7          # p, g, m, v, b addresses; numel; first block
    n = tl.load(row + 5)
    start = (block - tl.load(row + 6)) * BLOCK
    p_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    if B_TYPE == 0:
        b_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    elif B_TYPE == 1:
        b_ptr = tl.load(row + 4).to(tl.pointer_type(tl.bfloat16))
    elif B_TYPE == 2:
        b_ptr = tl.load(row + 4).to(tl.pointer_type(tl.uint8))
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    step_size = tl.load(step_size_ptr + weight)
    corr2 = tl.load(corr2_ptr + weight)
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    if HAS_COEF:
        g = g * tl.load(coef_ptr)
    m = m + (g - m) * c1
    v = v * beta2 + (g * g) * c2
    # IEEE division and square root (Triton's "/" on float32 is an approximate division)
    delta = tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), corr2) + eps) * step_size
    if HAS_DECAY:
        delta = delta + p * tl.load(decay_ptr)
    if B_TYPE >= 0:
        delta = delta * tl.load(b_ptr + offs, mask=mask).to(tl.float32)
    if B_TYPE >= 0 and HAS_LEVELS:
        delta = tl.div_rn(delta, levels)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(p_ptr + offs, p + delta, mask=mask)


@functools.lru_cache(maxsize=8)
def _block_map(device: torch.device, numels: tuple[int, ...]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """For weights of these sizes: each program's weight ((blocks,) int32 on the device, made
    once for a set of sizes, as a model's weights keep theirs) and each weight's first block."""
    counts = [cdiv(n, BLOCK) for n in numels]
    firsts = tuple(itertools.accumulate(counts[:-1], initial=0))
    block_weight = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32),
                                           torch.tensor(counts, dtype=torch.int64))
    return block_weight.to(device), firsts


@functools.lru_cache(maxsize=8)
def _state_table(state_ptrs: tuple[int, ...], numels: tuple[int, ...], firsts: tuple[int, ...]) -> torch.Tensor:
    """The (weights, 7) int64 host table of each weight's p, g, m, v, b addresses, size and first
    block, the gradients' column zero (written each step): state_ptrs p, m, v, b a weight."""
    table = torch.zeros(len(numels), 7, dtype=torch.int64)
    state = torch.tensor(state_ptrs, dtype=torch.int64).view(-1, 4)
    table[:, 0], table[:, 2:5] = state[:, 0], state[:, 1:]
    table[:, 5], table[:, 6] = torch.tensor(numels, dtype=torch.int64), torch.tensor(firsts, dtype=torch.int64)
    return table


def adamw_step_triton(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                      exp_avg_sqs: list[torch.Tensor], bs: list[torch.Tensor] | None, step_sizes: torch.Tensor,
                      corrections2_sqrt: torch.Tensor, decay: torch.Tensor | None, beta1: float, beta2: float,
                      eps: float, levels_per_unit: float | None, checked: bool = False,
                      grad_coef: torch.Tensor | None = None) -> None:
    """lowbit.formats.optimizer.adamw_step_ of every weight in one launch: each p, g, m, v
    float32 and contiguous, its b (float32, bfloat16 or uint8; one dtype for all) contiguous and
    of p's shape, or bs None (no B), all on one device; step_sizes and corrections2_sqrt (n,)
    float32, one per weight, decay and grad_coef 0-d float32 (or None), on that device.
    checked: the caller has checked each weight's tensors so
    (lowbit.dispatch.optimizer.kernel_applies), so they are not checked again here (host time a
    weight, every step); the rest still is."""
    weights = list(zip(params, grads, exp_avgs, exp_avg_sqs, params if bs is None else bs, strict=True))
    if not weights:
        return
    device = params[0].device
    b_dtype = None if bs is None else bs[0].dtype
    for p, g, m, v, b in ([] if checked else weights):
        if not (p.dtype == m.dtype == v.dtype == g.dtype == torch.float32):
            raise ValueError(f"the AdamW kernel takes float32 weights, gradients and moments (got {p.dtype}, "
                             f"{g.dtype}, {m.dtype}, {v.dtype})")
        if any(t.shape != p.shape or not t.is_contiguous() or t.device != device for t in (p, g, m, v, b)):
            raise ValueError("the AdamW kernel takes contiguous tensors of one shape on one device; give it "
                             "those or take the reference (lowbit.formats.optimizer.adamw_step_)")
        if bs is not None and (b.dtype != b_dtype or b_dtype not in _B_TYPES):
            raise ValueError(f"the AdamW kernel takes one B dtype of {list(_B_TYPES)} a launch (got {b.dtype})")
    for s in (step_sizes, corrections2_sqrt):
        if s.shape != (len(weights),) or s.dtype != torch.float32 or s.device != device or not s.is_contiguous():
            raise ValueError(f"the AdamW kernel takes one float32 step size and correction a weight on "
                             f"{device}, contiguous (got {tuple(s.shape)} {s.dtype} on {s.device})")
    for name, t in (("decay", decay), ("gradient coefficient", grad_coef)):
        if t is not None and (t.shape != () or t.dtype != torch.float32 or t.device != device):
            raise ValueError(f"the AdamW kernel takes the {name} as a 0-d float32 on {device} (got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device})")
    numels = tuple([p.numel() for p in params])
    block_weight, firsts = _block_map(device, numels)
    if not block_weight.numel():
        return
    # the addresses as they are now: the state's (p, m, v, b), sizes and first blocks kept for the
    # addresses they hold, the gradients' written each step; the table copied without waiting on
    # the GPU (a pageable source is staged at once, so the host copy may go). Without B, p's
    # address stands in B's column, never read.
    table = _state_table(tuple([t.data_ptr() for w in weights for t in w[:1] + w[2:]]), numels, firsts).clone()
    table[:, 1] = torch.tensor([g.data_ptr() for g in grads], dtype=torch.int64)
    table = table.to(device, non_blocking=True)
    # an unused pointer stands in for an absent decay or coefficient
    decay_t = step_sizes if decay is None else decay
    coef_t = step_sizes if grad_coef is None else grad_coef
    with on_device(params[0]):
        _adamw_step_kernel[(block_weight.numel(),)](
            table, block_weight, step_sizes, corrections2_sqrt, decay_t, coef_t, 1 - beta1, beta2, 1 - beta2,
            eps, float(levels_per_unit or 1.0), B_TYPE=NO_B if bs is None else _B_TYPES[b_dtype],
            HAS_DECAY=decay is not None, HAS_COEF=grad_coef is not None,
            HAS_LEVELS=levels_per_unit is not None, BLOCK=BLOCK, num_warps=8, enable_fp_fusion=False)
