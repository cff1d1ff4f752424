"""The log-probability of a chosen token and the entropy of each row of logits, in one read of
the row and no float32 copy of it: RL's per-token log-probs over a vocabulary of 150k
(lowbit.rl.grpo.completion_logprobs), forward and backward.

    logp, entropy, stats = token_logprobs_triton(logits, targets, temperature)   # logits (N, V)
    dlogits = token_logprobs_backward_triton(logits, targets, stats, entropy, temperature, g_logp, g_entropy)

Forward, per row, z = logits / temperature in float32 (an IEEE division, as torch's on the CPU;
torch on CUDA multiplies by the temperature's reciprocal, which can differ by one bit): an
online max m, s = sum(exp(z - m)) and w = sum(exp(z - m) (z - m)) over blocks of the row
(each block's terms moved to the running max), then logp = (z[target] - m) - log(s) and
entropy = log(s) - w / s (-sum(p log p), log p = z - m - log(s)): every term about the row's
max, as the reference's log-softmax takes it, so logits far from 0 (a row offset by 20,000)
lose nothing to cancellation. Backward, per element (log p = (z - m) - log(s) from the saved
m and log(s), H the entropy):
    dz = g_logp (1[target] - p) - g_entropy p (log p + H),   dlogits = dz / temperature,
written in the logits' dtype: one read of the row and one write. The reference is
lowbit.formats.logprobs (log_softmax in float32, then gather, exp, multiply, sum); the two
agree to float32 rounding (the sums run in another order), not bit for bit. A row with a NaN,
or a +inf logit, gives NaN, as the reference's log_softmax does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.kernels.quantize import on_device

__all__ = ["token_logprobs_triton", "token_logprobs_backward_triton"]

BLOCK = 2048


@triton.jit
def _token_logprobs_kernel(x_ptr, target_ptr, logp_ptr, ent_ptr, shift_ptr, log_s_ptr, V, stride_row, t,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_row
    offs = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), dtype=tl.float32)
    w = tl.zeros((), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        valid = cols < V
        z = tl.math.div_rn(tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32), t)
        m_new = tl.maximum(m, tl.max(z, axis=0))   # a NaN reaches s through exp, wherever max puts it
        rescale = tl.exp(m - m_new)
        d = z - m_new
        e = tl.where(valid, tl.exp(d), 0.0)
        # w = sum(e (z - m)) about the running max: moved to m_new, sum(e' (z - m_new)) =
        # rescale (w + (m - m_new) s) (no term yet: none)
        w = tl.where(s > 0, rescale * (w + (m - m_new) * s), 0.0) + tl.sum(tl.where(valid, e * d, 0.0), axis=0)
        s = s * rescale + tl.sum(e, axis=0)
        m = m_new
    log_s = tl.log(s)
    target = tl.load(target_ptr + row).to(tl.int64)
    z_t = tl.math.div_rn(tl.load(base + target).to(tl.float32), t)
    tl.store(logp_ptr + row, (z_t - m) - log_s)
    tl.store(ent_ptr + row, log_s - w / s)
    tl.store(shift_ptr + row, m)
    tl.store(log_s_ptr + row, log_s)


@triton.jit
def _token_logprobs_backward_kernel(x_ptr, dx_ptr, target_ptr, shift_ptr, log_s_ptr, ent_ptr, g_logp_ptr,
                                    g_ent_ptr, V, stride_row, stride_dx, t, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_row
    out = dx_ptr + row * stride_dx
    shift = tl.load(shift_ptr + row)
    log_s = tl.load(log_s_ptr + row)
    entropy = tl.load(ent_ptr + row)
    g_logp = tl.load(g_logp_ptr + row)
    g_ent = tl.load(g_ent_ptr + row)
    target = tl.load(target_ptr + row).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        cols = start + offs
        valid = cols < V
        z = tl.math.div_rn(tl.load(base + cols, mask=valid, other=0.0).to(tl.float32), t)
        logp = (z - shift) - log_s
        p = tl.exp(logp)
        dz = g_logp * (tl.where(cols == target, 1.0, 0.0) - p) - g_ent * p * (logp + entropy)
        tl.store(out + cols, tl.math.div_rn(dz, t).to(dx_ptr.dtype.element_ty), mask=valid)


def _check(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2 or targets.shape != logits.shape[:1] or logits.stride(-1) != 1:
        raise ValueError(f"token_logprobs takes logits (N, V) with unit stride along V and targets (N,); "
                         f"got {tuple(logits.shape)} strides {logits.stride()} and {tuple(targets.shape)}")


def token_logprobs_triton(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """(logp, entropy, stats), each (N,) float32 but stats, of logits (N, V) (any float dtype,
    unit stride along V) over targets (N,) int64 (see the module doc); stats (2, N) float32,
    each row's max of z and log(sum(exp(z - max))), for the backward. The targets must lie in
    [0, V): the kernel does not check them (a sampled token's id always does)."""
    _check(logits, targets)
    n, v = logits.shape
    logp, entropy = (torch.empty(n, device=logits.device, dtype=torch.float32) for _ in range(2))
    stats = torch.empty(2, n, device=logits.device, dtype=torch.float32)
    if n:
        with on_device(logits):
            _token_logprobs_kernel[(n,)](logits, targets, logp, entropy, stats[0], stats[1], v, logits.stride(0),
                                         float(temperature or 1.0), BLOCK=min(BLOCK, triton.next_power_of_2(v)),
                                         num_warps=8)
    return logp, entropy, stats


def token_logprobs_backward_triton(logits: torch.Tensor, targets: torch.Tensor, stats: torch.Tensor,
                                   entropy: torch.Tensor, temperature: float, g_logp: torch.Tensor,
                                   g_entropy: torch.Tensor) -> torch.Tensor:
    """d loss / d logits (N, V) in the logits' dtype, from the forward's stats and entropy and
    the gradients of logp and entropy, each (N,) float32."""
    _check(logits, targets)
    n, v = logits.shape
    dx = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if n:
        with on_device(logits):
            _token_logprobs_backward_kernel[(n,)](
                logits, dx, targets, stats[0], stats[1], entropy, g_logp.float().contiguous(),
                g_entropy.float().contiguous(), v, logits.stride(0), dx.stride(0), float(temperature or 1.0),
                BLOCK=min(BLOCK, triton.next_power_of_2(v)), num_warps=8)
    return dx
