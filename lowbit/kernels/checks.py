"""What the kernels are checked with: adversarial inputs, bitwise comparisons with the
reference, and an independent NumPy implementation of the stochastic-rounding seed contract.

Shared by tests/test_kernels.py (CPU, Triton's interpreter, small shapes) and
`lowbit bench kernels --check` (the same checks on a GPU, large shapes), so both check the
same things. Plain PyTorch and NumPy: nothing here imports triton.
"""

from __future__ import annotations

import numpy as np
import torch

from lowbit.formats.elements import E2M1, E4M3, decode, round_to_grid
from lowbit.formats.quantize import blocked
from lowbit.formats.spec import QuantSpec

__all__ = ["assert_bits_equal", "assert_same_qtensor", "adversarial", "nvfp4_order_cases",
           "philox4x32_10", "contract_uniforms"]

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_bits_equal(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Same dtype, shape and bits (so -0.0 != 0.0); NaN exactly where ref has NaN (any payload)."""
    ours, ref = ours.cpu(), ref.cpu()
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, (ours.dtype, ours.shape, ref.dtype, ref.shape)
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(ours), nan), "NaN in different places"
    mismatch = (ours.view(_INT_VIEW[ours.dtype]) != ref.view(_INT_VIEW[ref.dtype])) & ~nan
    assert not mismatch.any(), (f"{int(mismatch.sum())} values differ, e.g. "
                                f"{ours[mismatch][:4].tolist()} vs {ref[mismatch][:4].tolist()}")


def assert_same_qtensor(q, r) -> None:
    """Kernel QTensor q equals reference QTensor r: spec, shape, dtype, codes, scales, tensor
    scale and dequantized values, bit for bit."""
    assert q.spec == r.spec and q.shape == r.shape and q.dtype == r.dtype
    assert q.codes.dtype == torch.uint8 and q.scales.dtype == r.scales.dtype
    assert q.codes.shape == r.codes.shape and q.scales.shape == r.scales.shape
    mismatch = q.codes.cpu() != r.codes.cpu()
    assert not mismatch.any(), f"{int(mismatch.sum())} code bytes differ"
    mismatch = q.scales.cpu().view(torch.uint8) != r.scales.cpu().view(torch.uint8)
    assert not mismatch.any(), f"{int(mismatch.sum())} scales differ"
    if r.tensor_scale is None:
        assert q.tensor_scale is None
    else:
        assert q.tensor_scale.shape == r.tensor_scale.shape
        assert torch.equal(q.tensor_scale.cpu(), r.tensor_scale.cpu()), "tensor scales differ"
    assert_bits_equal(q.dequantize(), r.dequantize())


def adversarial(rows: int, cols: int, spec: QuantSpec, seed: int = 0) -> torch.Tensor:
    """(rows, cols) float32 built to hit the rounding edges of `spec`.

    Every block (tile) gets a power-of-two scale 2^k and values on, halfway between (ties)
    and one float32 ulp either side of the element grid, times 2^k; its amax is
    max_elem * 2^k, just past it, just below it, or a power of two. Then special blocks:
    zero, huge (3e38), tiny, float32 subnormals, amaxes where rceil's amax / max_elem
    underflows (3 * 2^-149), is the subnormal 2^-127 or 1.5 * 2^-127, an amax of 2^-127,
    all -0.0; and one NaN, +Inf and -Inf. For two-level
    NVFP4 the tensor amax is 2688 * 2^4, so s_t = 16 and the ties stay exact.
    """
    g = torch.Generator().manual_seed(seed)
    element = spec.info.element
    max_elem = element.max_value
    grid = decode(torch.arange(2 ** element.code_bits, dtype=torch.uint8), element)
    grid = torch.unique(grid[torch.isfinite(grid)].abs())
    points = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
    near = torch.cat([points, torch.nextafter(points, torch.tensor(1e30)),
                      torch.nextafter(points, torch.tensor(-1.0)).clamp(min=0)])
    br, bc = spec.block
    shape = blocked(torch.zeros(rows, cols), spec.block)[0].shape          # (nR, br, nC, bc)
    n_r, _, n_c, _ = shape
    signs = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    x = near[torch.randint(len(near), shape, generator=g)].clamp(max=max_elem) * signs
    if spec.format == "nvfp4":   # keep most block scales 2^k / s_t inside E4M3's [2^-6, 448]
        exps = torch.randint(-8, 10, (n_r, 1, n_c, 1), generator=g)
    else:
        exps = torch.randint(-40, 40, (n_r, 1, n_c, 1), generator=g)
    amax_kinds = torch.tensor([max_elem, max_elem * (1 + 2**-22), 4.0, 3.0, max_elem * (1 - 2**-20)])
    x[:, :1, :, :1] = amax_kinds[torch.randint(len(amax_kinds), (n_r, 1, n_c, 1), generator=g)]
    x = x * torch.exp2(exps.float())
    flat = x.reshape(n_r * br, n_c * bc)[:rows, :cols].clone()
    specials = [torch.zeros(br, bc), torch.full((br, bc), 3.0e38), torch.full((br, bc), -1e-30),
                torch.linspace(-1, 1, br * bc).reshape(br, bc) * 1e-39,
                torch.full((br, bc), 3 * 2.0**-149), torch.full((br, bc), 2.0**-127),
                torch.full((br, bc), max_elem * 2.0**-127),          # amax / max_elem = 2^-127
                torch.full((br, bc), max_elem * 1.5 * 2.0**-127),    # ... a subnormal non-power
                torch.full((br, bc), -0.0)]
    for j, block in enumerate(specials):
        r0, c0 = (j % n_r) * br, (j // n_r % n_c) * bc
        flat[r0:r0 + br, c0:c0 + bc] = block[: rows - r0, : cols - c0]
    if spec.format == "nvfp4" and spec.tensor_scale:
        flat[-1, -1] = 2688.0 * 2.0**4
    for value in (float("nan"), float("inf"), -float("inf")):
        flat[torch.randint(rows, (1,), generator=g), torch.randint(cols, (1,), generator=g)] = value
    return flat


def _nvfp4_rows(x, t, block_scale_of, recip_of):
    """E2M1 values and E4M3 block scales of (rows, 16) x under one order of the NVFP4 ops."""
    amax = x.abs().amax(dim=1)
    scale = block_scale_of(amax, t).clamp(2.0**-6, 448.0).to(torch.float8_e4m3fn).float()
    data = (x * recip_of(t, scale)[:, None]).clamp(-6.0, 6.0)
    return round_to_grid(data, E2M1), scale


def nvfp4_order_cases(n_candidates: int = 8192, limit: int = 64, seed: int = 0):
    """Two-level NVFP4 (1, 16) rows whose codes or block scales change when any step of the
    reference's operation order changes. Returns x (rows, 16) float32 -- its last row holds
    the tensor amax -- and, per alternative order, how many of its rows that order changes:
    - "amax*(1/6)": the block scale as amax times a rounded 1/6 instead of amax / 6;
    - "*(1/s_t)":   the block scale times a rounded 1/s_t instead of divided by s_t;
    - "1/(s_t*s)":  the element factor 1 / (s_t * s) instead of (1 / s_t) / s.
    A kernel that matches the reference on these rows follows its order (on random inputs
    such slips change about one value in 10^4..10^5).
    """
    g = torch.Generator().manual_seed(seed)
    t_amax = torch.tensor(1000.0) * (1 + torch.rand((), generator=g))
    t = torch.clamp(t_amax / 2688.0, min=2.0**-120)
    # block amaxes whose (amax / 6) / s_t is within a few ulps of an E4M3 tie, so a one-ulp
    # slip in the block scale's operations flips its rounding
    e4m3 = decode(torch.arange(128, dtype=torch.uint8), E4M3)
    e4m3 = e4m3[(e4m3 >= 2.0**-6) & (e4m3 <= 448.0)]
    e4m3_ties = (e4m3[1:] + e4m3[:-1]) / 2
    tie = e4m3_ties[torch.randint(len(e4m3_ties), (n_candidates,), generator=g)]
    amax_nudge = torch.randint(-3, 4, (n_candidates,), generator=g).float() * 2.0**-23
    amax_b = torch.minimum(tie * t * 6.0 * (1 + amax_nudge), t_amax)
    scale = ((amax_b / 6.0) / t).clamp(2.0**-6, 448.0).to(torch.float8_e4m3fn).float()
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 3.0, 4.0])
    cand = ties[torch.randint(len(ties), (n_candidates, 15), generator=g)] * (t * scale)[:, None]
    nudge = torch.randint(-2, 3, (n_candidates, 15), generator=g).float() * 2.0**-23
    signs = torch.where(torch.rand(n_candidates, 15, generator=g) < 0.5, -1.0, 1.0)
    cand = torch.minimum(cand * (1 + nudge), amax_b[:, None]) * signs
    x = torch.cat([amax_b[:, None], cand], dim=1)

    reference = _nvfp4_rows(x, t, lambda a, t: (a / 6.0) / t, lambda t, s: (1.0 / t) / s)
    alternatives = {
        "amax*(1/6)": _nvfp4_rows(x, t, lambda a, t: (a * torch.tensor(1 / 6.0)) / t,
                                  lambda t, s: (1.0 / t) / s),
        "*(1/s_t)": _nvfp4_rows(x, t, lambda a, t: (a / 6.0) * (1.0 / t), lambda t, s: (1.0 / t) / s),
        "1/(s_t*s)": _nvfp4_rows(x, t, lambda a, t: (a / 6.0) / t, lambda t, s: 1.0 / (t * s)),
    }
    changed = {name: ((q != reference[0]).any(dim=1) | (s != reference[1]))
               for name, (q, s) in alternatives.items()}
    keep = torch.zeros(n_candidates, dtype=torch.bool)
    for rows in changed.values():   # up to limit // 3 rows that each alternative changes
        keep |= rows & (rows.cumsum(0) <= limit // 3)
    tensor_amax_row = torch.zeros(1, 16)
    tensor_amax_row[0, 0] = t_amax
    counts = {name: int((rows & keep).sum()) for name, rows in changed.items()}
    return torch.cat([x[keep], tensor_amax_row]), counts


MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter, key):
    """Philox4x32-10 (Salmon et al. 2011, Random123) in NumPy: four 32-bit counter words and
    two key words (uint64 arrays holding 32-bit values) -> four 32-bit output words."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) for k in key)
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & MASK32,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & MASK32)
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & MASK32, (k1 + np.uint64(0xBB67AE85)) & MASK32
    return c0, c1, c2, c3


def contract_uniforms(shape, seed: int) -> torch.Tensor:
    """The seed contract, independently of the kernels: element i (row-major in `shape`)
    uses word i % 4 of Philox4x32-10(key = (seed mod 2^32, seed >> 32),
    counter = (i // 4 mod 2^32, i // 4 >> 32, 0, 0)), and u = (word >> 8) * 2^-24."""
    i = np.arange(int(np.prod(shape)), dtype=np.uint64)
    quad = i // np.uint64(4)
    words = philox4x32_10((quad & MASK32, quad >> np.uint64(32), 0 * quad, 0 * quad),
                          (np.uint64(seed) & MASK32, np.uint64(seed) >> np.uint64(32)))
    word = np.choose((i % np.uint64(4)).astype(np.int64), words)
    u = (word >> np.uint64(8)).astype(np.float64) * 2.0**-24
    return torch.from_numpy(u.astype(np.float32)).reshape(tuple(shape))
