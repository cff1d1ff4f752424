"""lowbit.kernels.activation_quant (the rollout engine's fused activation pre-pass) against the
references of lowbit.formats.activations composed with the engine's eager prologue, bit for bit:
x_hat, RAC's r_hat, FP8 codes and scales. Runs the kernel on the GPU where there is one, else in
Triton's interpreter on the CPU.

The prologue's RMSNorm takes rsqrt and SiLU takes exp, which Triton and torch compute with
different libraries (and torch sums x^2 in another order): they agree to the last bit only where
those are exact, so the prologue inputs are built that way. RMSNorm rows hold integers whose
squares sum to 64 K (the rsqrt is 1/8 exactly, whatever the order of the sum); SiLU's gates
are 0 or at least 110 (exp(-gate) is 1 or 0, so SiLU is 0 or the gate itself), and the roundings
after the weight and the product still round."""

import math

import pytest
import torch
import torch.nn.functional as F
from bits import same_bits

pytest.importorskip("triton")

from lowbit.formats.activations import (  # noqa: E402
    per_token_fp8, per_token_nvfp4, rac_channel_count, rac_folded, rac_residual, static_nvfp4,
)
from lowbit.kernels import activation_quant as aq  # noqa: E402
from lowbit.kernels.activation_quant import MAX_K, quantize_activations  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# numpy's, under the interpreter: NaN/Inf blocks compute a scale that is then discarded
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-6


def _prologue(x, norm=None, eps=EPS, silu_mul=False):
    """The engine's eager ops before a linear, step by step: each op rounds to x's dtype."""
    if norm is not None:
        x = norm * F.rms_norm(x, (x.shape[-1],), eps=eps)
    if silu_mul:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    return x


def _ties(k, g):
    """Odd integers up to 7 with a 7 in every block of 16: every block takes the same scale,
    so |x - x_hat| takes a handful of values, each many times."""
    row = torch.randint(0, 4, (k,), generator=g) * 2 + 1.0
    row[::16] = 7.0
    return row * torch.where(torch.rand(k, generator=g) < 0.5, -1.0, 1.0)


def _mean_square_64(k, g):
    """k integers whose squares sum to exactly 64 k, in random places with random signs:
    random ones, then four that make up the rest (every integer is a sum of four squares)."""
    while True:
        head = (torch.randn(k - 4, generator=g) * 7).round()
        rest = 64 * k - int((head ** 2).sum())
        if rest >= 0:
            break
    four = next((a, b, c, math.isqrt(rest - a * a - b * b - c * c))
                for a in range(math.isqrt(rest), -1, -1)
                for b in range(math.isqrt(rest - a * a), -1, -1)
                for c in range(math.isqrt(rest - a * a - b * b), -1, -1)
                if math.isqrt(rest - a * a - b * b - c * c) ** 2 == rest - a * a - b * b - c * c)
    row = torch.cat([head, torch.tensor(four, dtype=torch.float32)])
    row = row[torch.randperm(k, generator=g)]
    return row * torch.where(torch.rand(k, generator=g) < 0.5, -1.0, 1.0)


def _operands(prologue, k, dtype, seed):
    """(x, norm) of 6 rows: random (without a prologue: across 16 binades), ties, zeros, NaN
    and Inf, huge, tiny (what each prologue lets through exactly; float16 keeps to its range)."""
    g = torch.Generator().manual_seed(seed)
    half = dtype is torch.float16
    huge, tiny = (2.0 ** 8, 2.0 ** -20) if half else (1e30, 1e-30)
    norm = None
    if prologue == "none":
        x = torch.randn(6, k, generator=g)
        x[0] *= 2.0 ** torch.randint(-12, 5, (k,), generator=g)       # FP8 subnormals, FP4 zeros
        x[1] = _ties(k, g)
        x[2] = 0.0
        x[3, 3], x[3, k - 1] = float("nan"), float("inf")
        x[4] *= huge
        x[5] *= tiny
    elif prologue == "norm":
        x = torch.stack([_mean_square_64(k, g) for _ in range(6)])
        x[1] = 8.0 * torch.where(torch.rand(k, generator=g) < 0.5, -1.0, 1.0)   # all |x| tie
        x[2] = 0.0
        x[3, 3] = float("nan")
        x[4] *= 2.0 ** 40 if not half else 2.0 ** 4          # mean square 64 * 4^j: still exact
        x[5, 5] = float("inf")                               # rsqrt(inf) = 0: NaN and zeros
        norm = (1 + 0.1 * torch.randn(k, generator=g)).to(DEV, dtype)
    else:   # silu_mul: x = [gate | up]
        gate = torch.randint(110, 2000, (6, k), generator=g).float()
        gate[:, ::3] = 0.0
        up = torch.randn(6, k, generator=g)
        gate[1], up[1] = 128.0, _ties(k, g)
        gate[2] = 0.0
        up[3, 3], up[3, k - 1] = float("nan"), float("inf")
        up[4] *= huge / 2000 if half else huge
        up[5] *= tiny
        x = torch.cat([gate, up], dim=-1)
    return x.to(DEV, dtype), norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prologue", ["none", "norm", "silu_mul"])
def test_the_kernel_is_the_references_bit_for_bit(dtype, prologue):
    for k in (40, 64, 200):
        x, norm = _operands(prologue, k, dtype, seed=k)
        kw = dict(norm=norm, eps=EPS, silu_mul=prologue == "silu_mul")
        inp = _prologue(x, **kw)                                        # (6, K) in dtype
        assert inp.dtype == dtype and not inp[0].isnan().any()
        x_hat = per_token_nvfp4(inp)
        # RAC's radix select with its early stop (on by default for long rows only) on the
        # longest rows, with every step (the default here) on the others, each against the
        # reference (a RAC call is half a second of Triton's interpreter on the CPU)
        select = dict(early_stop=True) if k == 200 else {}
        for ratio in (0.0, 0.25, 1.0):
            got_x, got_r = quantize_activations(x, "nvfp4", ratio, **select, **kw)
            assert same_bits(got_x, x_hat), (k, ratio)
            if ratio == 0:
                assert got_r is None
            else:
                assert same_bits(got_r, rac_residual(inp, x_hat, ratio)), (k, ratio)
        plain, nothing = quantize_activations(x, "none", **kw)     # the prologue alone
        assert same_bits(plain, inp) and nothing is None, k
        codes, scale = quantize_activations(x, "fp8", **kw)
        ref_codes, ref_scale = per_token_fp8(inp)
        assert codes.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
        assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)), k
        assert same_bits(scale, ref_scale), k
    assert not got_x[0].isnan().any() and got_x[3].isnan().any() and (got_r[2] == 0).all()


@pytest.mark.parametrize("dtype,prologue", [(torch.float32, "none"), (torch.bfloat16, "norm"),
                                            (torch.float16, "none")])
def test_static_scales_are_the_references_bit_for_bit(dtype, prologue):
    # a served checkpoint's numerics: one calibrated amax inside the rows' range (the rows past
    # it saturate), one far above it (past float16's range), and 0 (the smallest scale)
    x, norm = _operands(prologue, 40, dtype, seed=3)
    inp = _prologue(x, norm=norm)
    for amax in (0.25, 1e6, 0.0):
        a = torch.tensor([amax], device=DEV)
        x_hat = static_nvfp4(inp, a)
        got_x, got_r = quantize_activations(x, "nvfp4", 0.25, norm=norm, input_amax=a)
        assert same_bits(got_x, x_hat), amax
        assert same_bits(got_r, rac_residual(inp, x_hat, 0.25)), amax
        assert got_x[3].isnan().any() and not got_x[2].isnan().any()    # NaN stays NaN
    with pytest.raises(ValueError, match="input_amax"):
        quantize_activations(x, "fp8", input_amax=a)


@pytest.mark.parametrize("radix_bits", [1, 4, 8])
@pytest.mark.parametrize("early_stop", [True, False])
def test_ties_nan_and_layouts(radix_bits, early_stop):
    # every radix step width selects alike, with the radix select's early stop and without, at
    # every ratio, on both layouts (the layout is the load's, before any selection: each ratio
    # takes one of them, both taken at every width)
    k = 40
    g = torch.Generator().manual_seed(1)
    x = torch.stack([_ties(k, g) for _ in range(4)] + [torch.randn(k, generator=g)])
    x[0, 17] = float("nan")          # NaN residuals are the largest: that block first
    x[1].view(torch.int32)[5] = 0x7FC0ABCD   # a NaN with a payload ties with the other NaNs
    x[3] = 5.0                       # every |r| the same: the lowest channels
    wide = torch.zeros(5, 3 * k, device=DEV)
    wide[:, :k] = x
    strided = torch.zeros(5, 3 * k, device=DEV)[:, ::3]
    strided.copy_(x)
    assert strided.stride() == (3 * k, 3)
    # wide: rows 3K apart; strided: K strided (copied)
    for xs, ratio in ((wide[:, :k], 0.1), (strided, 0.25), (wide[:, :k], 0.5)):
        got_x, got_r = quantize_activations(xs, "nvfp4", ratio, radix_bits=radix_bits,
                                            early_stop=early_stop)
        x_hat = per_token_nvfp4(x.to(DEV))
        assert same_bits(got_x, x_hat) and same_bits(got_r, rac_residual(x.to(DEV), x_hat, ratio))
        count = rac_channel_count(k, ratio)
        assert got_r[0, 16:16 + min(count, 16)].isnan().all()      # the NaN block's first
        assert got_r[1, :min(count, 16)].isnan().all() and not got_r[1, 16:].isnan().any()
        assert ((got_r[3] != 0).nonzero().flatten() < count).all()


def test_a_row_alone_is_the_row_in_a_batch():
    x, _ = _operands("none", 200, torch.bfloat16, seed=2)
    x_hat, r_hat = quantize_activations(x, "nvfp4", 0.25)
    for n in (0, 1, 4):
        alone_x, alone_r = quantize_activations(x[n:n + 1], "nvfp4", 0.25)
        assert torch.equal(alone_x, x_hat[n:n + 1]) and torch.equal(alone_r, r_hat[n:n + 1])


def test_refusals():
    x = torch.zeros(2, 32, device=DEV)
    with pytest.raises(ValueError, match="use the reference"):
        quantize_activations(torch.zeros(1, MAX_K + 1, device=DEV), "nvfp4")
    with pytest.raises(ValueError, match="mode 'nvfp4'"):
        quantize_activations(x, "fp8", 0.25)
    with pytest.raises(ValueError, match="one prologue"):
        quantize_activations(x, "nvfp4", norm=torch.ones(32, device=DEV), silu_mul=True)
    with pytest.raises(ValueError, match="x's dtype"):
        quantize_activations(x, "nvfp4", norm=torch.ones(32, device=DEV, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="mode"):
        quantize_activations(x, "int4")
    with pytest.raises(ValueError, match="2-D"):
        quantize_activations(x[0], "nvfp4")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        quantize_activations(x, "nvfp4", 1.5)
    for warps in (0, 3, 64):
        with pytest.raises(ValueError, match="num_warps must be a power of two from 1 to 32"):
            quantize_activations(x, "nvfp4", 0.25, num_warps=warps)
    for bits in (0, 3, 16):
        with pytest.raises(ValueError, match="radix_bits must be 1, 2, 4 or 8"):
            quantize_activations(x, "nvfp4", 0.25, radix_bits=bits)
    empty_x, empty_r = quantize_activations(x[:0], "nvfp4", 0.5)
    assert empty_x.shape == (0, 32) and empty_r.shape == (0, 32)


@triton.jit
def _threshold_kernel(keys_ptr, out_ptr, K, count, BLOCK_K: tl.constexpr, DIGIT: tl.constexpr):
    # one row's RAC threshold (activation_quant.rac_threshold) a program
    row = tl.program_id(0)
    kk = tl.arange(0, BLOCK_K)
    ok = kk < K
    keys = tl.load(keys_ptr + row * K + kk, mask=ok, other=-1)
    tl.store(out_ptr + row, aq.rac_threshold(keys, ok, count, DIGIT))


def test_the_threshold_search_stops_once_the_chosen_set_is_fixed():
    # RAC's radix select (activation_quant.rac_threshold) stops once exactly `count` keys are
    # >= the threshold so far: on distinct random keys it stops early, with a threshold that
    # exactly the top-count keys reach; where keys tie across the count-th place it runs every
    # step and returns the count-th largest key itself
    g = torch.Generator().manual_seed(7)
    K, count = 100, 25
    keys = (torch.rand(6, K, generator=g) * 3).abs().view(torch.int32)   # |r|-like float bits
    keys[4] = 1234                                                       # all tie
    keys[5, :40] = keys[5].topk(count + 5).values.min()                  # ties across the place
    keys = keys.to(DEV)
    for digit in (4, 8):
        out = torch.empty(6, dtype=torch.int32, device=DEV)
        _threshold_kernel[(6,)](keys, out, K, count, BLOCK_K=128, DIGIT=digit)
        for row in range(6):
            top = keys[row].sort(descending=True).values
            t = int(out[row])
            if top[count - 1] != top[count]:     # the chosen set is fixed: exactly count reach t
                assert int((keys[row] >= t).sum()) == count, (digit, row)
            else:                                # ties: every step, the count-th key itself
                assert t == int(top[count - 1]), (digit, row)
        early = [int(out[r]) != int(keys[r].sort(descending=True).values[count - 1]) for r in range(4)]
        assert any(early), digit   # distinct random keys: the search stopped before the last step


@pytest.mark.parametrize("dtype,prologue", [(torch.bfloat16, "norm"), (torch.float16, "silu_mul"),
                                            (torch.float32, "none")])
def test_rac_folded_is_the_references_bit_for_bit(dtype, prologue):
    # rac_fold: x_hat + r_hat added in float32, rounded once, written as the one output; row-wide
    # and grouped channels (16 a group and not), random rows, ties, zeros, NaN / Inf, huge, tiny
    for k, group, ratio in ((200, 0, 0.25), (256, 64, 0.25), (200, 16, 0.25), (40, 0, 0.01)):
        x, norm = _operands(prologue, k, dtype, seed=k + group + 3)
        kw = dict(norm=norm, eps=EPS, silu_mul=prologue == "silu_mul")
        inp = _prologue(x, **kw)
        x_hat = per_token_nvfp4(inp)
        got, none = quantize_activations(x, "nvfp4", ratio, rac_group=group, rac_fold=True, **kw)
        assert none is None
        want = rac_folded(x_hat, rac_residual(inp, x_hat, ratio, group)) if rac_channel_count(k, ratio) else x_hat
        assert same_bits(got, want), (k, group, ratio)
        alone, _ = quantize_activations(x[2:3], "nvfp4", ratio, rac_group=group, rac_fold=True, **kw)
        assert same_bits(alone, got[2:3])                          # a row is its own
    assert not same_bits(got, x_hat)                               # the residual is in it


@pytest.mark.parametrize("dtype,prologue", [(torch.float32, "none"), (torch.float16, "silu_mul")])
def test_rac_by_group_is_the_references_bit_for_bit(dtype, prologue):
    # RAC's channels chosen group by group (a sort within each group, no radix select): K a
    # multiple of the group, a last partial group, a group as wide as the row, and one wider;
    # random rows, ties, zeros, NaN / Inf, huge and tiny
    # (16 chosen a group, G 64 at 0.25 and G 16 at 1.0, take the path whose blocks are the groups)
    for k, group, ratios in ((200, 64, (0.125, 0.25)), (200, 128, (0.25,)), (64, 64, (0.25,)),
                             (40, 256, (0.25,)), (256, 64, (0.25, 0.2)), (64, 16, (1.0, 0.25))):
        x, norm = _operands(prologue, k, dtype, seed=k + group)
        kw = dict(norm=norm, eps=EPS, silu_mul=prologue == "silu_mul")
        inp = _prologue(x, **kw)
        x_hat = per_token_nvfp4(inp)
        for ratio in ratios:
            got_x, got_r = quantize_activations(x, "nvfp4", ratio, rac_group=group, **kw)
            assert same_bits(got_x, x_hat), (k, group, ratio)
            assert same_bits(got_r, rac_residual(inp, x_hat, ratio, group)), (k, group, ratio)
    # batch-invariant: a row alone against the batch of the last call (group 16, ratio 0.25)
    alone = quantize_activations(x[3:4], "nvfp4", 0.25, rac_group=16, **kw)
    assert same_bits(alone[1], got_r[3:4])
    with pytest.raises(ValueError, match="power of two from 16"):
        quantize_activations(x, "nvfp4", 0.25, rac_group=24)
