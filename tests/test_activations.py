"""lowbit.formats.activations, the rollout engine's per-token activation quantizers: per-token
NVFP4 against the engine's quantizer before it moved here, per-token FP8 against the MXFP8 QDQ,
and RAC's per-token residual against a slow loop, its batch invariance and the paper's
augmented-K GEMM."""

import math

import pytest
import torch
from bits import same_bits

from lowbit import dispatch
from lowbit.formats import QuantSpec, quantize_dequantize
from lowbit.formats.activations import (
    fp8_row_spec, per_token_fp8, per_token_nvfp4, rac_channel_count, rac_residual,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _engine_per_token_nvfp4(x):
    """lowbit.rl.precision._per_token_nvfp4 as it was before it moved to lowbit.formats
    (verbatim, on lowbit.dispatch's quantizer)."""
    xf = x.float()
    finite = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros_like(xf))
    amax = finite.amax(dim=-1, keepdim=True)
    mant, exp = torch.frexp(amax / (448.0 * 6.0))
    exp = torch.where(mant == 0.5, exp - 1, exp)
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp)).clamp(-126, 127)
    up = torch.ldexp(torch.ones_like(amax), -exp)
    spec = QuantSpec.make("nvfp4", (1, 16), tensor_scale=False)
    values = dispatch.quantize_dequantize(xf * up, spec)
    return (values * torch.ldexp(torch.ones_like(amax), exp)).to(x.dtype)


def _rows(k, dtype, seed=0):
    """Random rows and adversarial ones: scaled by 2^-20 and 2^20, all zero, NaN and Inf, a
    denormal-scale row (float32/bfloat16), and a row of ties (a 7 in every block of 16)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, k, generator=g)
    x[1] *= 2.0 ** -20
    x[2] *= 2.0 ** 20 if dtype is not torch.float16 else 2.0 ** 8
    x[3] = 0.0
    x[4, 3], x[4, k - 1] = float("nan"), float("inf")
    x[5, 0] = float("-inf")
    x[6] *= 1e-38 if dtype is not torch.float16 else 1e-6
    x[7] = torch.randint(0, 4, (k,), generator=g) * 2 + 1.0
    x[7, ::16] = 7.0
    x[7] *= torch.where(torch.rand(k, generator=g) < 0.5, -1.0, 1.0)
    x[8] *= 1e30 if dtype is not torch.float16 else 1e4
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [7, 40, 64, 200])
def test_per_token_nvfp4_is_the_engines_quantizer(dtype, k):
    x = _rows(k, dtype)
    out = per_token_nvfp4(x)
    assert out.dtype == dtype and same_bits(out, _engine_per_token_nvfp4(x))
    assert torch.equal(out[3], torch.zeros(k, dtype=dtype))              # zero row: zeros
    assert out[4, :16].isnan().all() and out[4, k - 1].isnan()           # NaN / Inf blocks: NaN
    assert not out[0].isnan().any()
    wide = torch.randn(5, 2 * k).to(dtype)
    strided = wide[:, ::2]                                               # not contiguous
    assert same_bits(per_token_nvfp4(strided), _engine_per_token_nvfp4(strided.contiguous()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_token_fp8_is_the_mxfp8_row_qdq(dtype):
    for k in (40, 200):
        x = _rows(k, dtype)
        codes, scale = per_token_fp8(x)
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == (9, k)
        assert scale.dtype == torch.float32 and scale.shape == (9, 1)
        spec = fp8_row_spec(k)
        assert spec == QuantSpec.make("mxfp8_e4m3", (1, k), "rceil")
        # codes * scale in float32 is the QDQ; in x's dtype, the engine's FP8 activations
        assert same_bits(codes.float() * scale, quantize_dequantize(x, spec, dtype=torch.float32))
        assert same_bits((codes.float() * scale).to(dtype), quantize_dequantize(x, spec))
        finite = ~scale.isnan()
        mant, _ = torch.frexp(scale[finite])
        assert (mant == 0.5).all()                                      # powers of two
        assert scale[4].isnan() and scale[5].isnan()                    # NaN / Inf rows
        assert torch.equal(codes[4].view(torch.uint8), torch.zeros(k, dtype=torch.uint8))
        assert torch.equal(codes[3].float(), torch.zeros(k))


def test_rac_channel_count():
    assert [rac_channel_count(40, r) for r in (0.0, 0.125, 0.25, 0.3, 1.0)] == [0, 5, 10, 12, 40]
    assert rac_channel_count(10, 0.3) == 3          # 0.3 * 10 is 3.0000000000000004
    assert rac_channel_count(7, 0.01) == 1
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        rac_channel_count(16, 1.5)


def _slow_rac_residual(x, x_hat, ratio):
    """rac_residual one row at a time, from its definition."""
    k = x.shape[-1]
    count = min(k, math.ceil(ratio * k - 1e-9))
    out = torch.zeros(x.shape, dtype=x.dtype)
    for n in range(x.shape[0]):
        r = x[n].float() - x_hat[n].float()
        order = torch.sort(r.abs(), descending=True, stable=True).indices.tolist()
        channels = sorted(order[:count])
        if not channels:
            continue
        q = per_token_nvfp4(r[channels][None, :])[0].to(x.dtype)
        for j, c in enumerate(channels):
            out[n, c] = q[j]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [40, 64, 200])
def test_rac_residual_is_its_definition(dtype, k):
    x = _rows(k, dtype, seed=k)
    x_hat = per_token_nvfp4(x)
    for ratio in (0.0, 0.1, 0.25, 0.5, 1.0):
        got = rac_residual(x, x_hat, ratio)
        assert got.dtype == dtype and same_bits(got, _slow_rac_residual(x, x_hat, ratio))
        count = rac_channel_count(k, ratio)
        assert ((got != 0) | got.isnan()).sum(-1).le(count).all()      # at most c channels
    assert torch.equal(rac_residual(x, x_hat, 0.0), torch.zeros_like(x))
    # ratio 1: the compacted row is the whole residual
    r = x.float() - x_hat.float()
    assert same_bits(rac_residual(x, x_hat, 1.0), per_token_nvfp4(r).to(dtype))
    assert rac_residual(x, x_hat, 0.25)[4].isnan().any()               # NaN residuals come first


def test_rac_residual_ties_go_to_the_lower_channel():
    # x_hat = 0, so r = x: |r| takes three values, each many times
    x = torch.tensor([[3.0, -1.0, 2.0, -3.0, 1.0, 2.0, 3.0, -2.0, 1.0, 3.0]])
    got = rac_residual(x, torch.zeros_like(x), 0.3)                      # 3 channels
    assert (got[0] != 0).nonzero().flatten().tolist() == [0, 3, 6]      # the first three 3s
    got = rac_residual(x, torch.zeros_like(x), 0.5)                      # 5: four 3s, one 2
    assert (got[0] != 0).nonzero().flatten().tolist() == [0, 2, 3, 6, 9]
    nan = x.clone()
    nan[0, 8] = float("nan")
    got = rac_residual(nan, torch.zeros_like(x), 0.2)                    # NaN, then the first 3
    assert got[0, 8].isnan() and got[0, 0].isnan()                       # one block: NaN
    assert (got[0, [1, 2, 3, 4, 5, 6, 7, 9]] == 0).all()
    for k in (40, 200):                                                 # a tie-heavy row
        x = _rows(k, torch.float32)[7:8]
        x_hat = per_token_nvfp4(x)
        assert (x.float() - x_hat.float()).abs().unique().numel() <= 8
        for ratio in (0.1, 0.25, 0.5):
            assert same_bits(rac_residual(x, x_hat, ratio), _slow_rac_residual(x, x_hat, ratio))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_alone_is_the_row_in_a_batch(dtype):
    x = _rows(200, dtype, seed=3)
    x_hat, r_hat = per_token_nvfp4(x), rac_residual(x, per_token_nvfp4(x), 0.25)
    codes, scale = per_token_fp8(x)
    for n in range(x.shape[0]):
        alone = x[n:n + 1]
        assert same_bits(per_token_nvfp4(alone), x_hat[n:n + 1])
        assert same_bits(rac_residual(alone, per_token_nvfp4(alone), 0.25), r_hat[n:n + 1])
        c, s = per_token_fp8(alone)
        assert torch.equal(c.view(torch.uint8), codes[n:n + 1].view(torch.uint8))
        assert same_bits(s, scale[n:n + 1])


@pytest.mark.parametrize("k,ratio", [(64, 0.25), (200, 0.125), (40, 1.0)])
def test_one_token_is_the_papers_augmented_gemm(k, ratio):
    # Y = Q(X) Q(W)^T + Q(r_S) Q(W)_{:,S}^T, the residual appended along the reduction dim,
    # against x_hat Q(W)^T + r_hat Q(W)^T. float64 holds every product and sum exactly.
    g = torch.Generator().manual_seed(k)
    x = torch.randn(1, k, generator=g)
    w = quantize_dequantize(torch.randn(48, k, generator=g), QuantSpec.make("nvfp4", (1, 16)))
    x_hat = per_token_nvfp4(x)
    r_hat = rac_residual(x, x_hat, ratio)
    r = x - x_hat
    count = rac_channel_count(k, ratio)
    s = torch.sort(torch.sort(r[0].abs(), descending=True, stable=True).indices[:count]).values
    augmented_x = torch.cat([x_hat, per_token_nvfp4(r[:, s])], dim=-1).double()   # (1, K + |S|)
    augmented_w = torch.cat([w, w[:, s]], dim=-1).double()                         # (N, K + |S|)
    paper = augmented_x @ augmented_w.T
    ours = x_hat.double() @ w.double().T + r_hat.double() @ w.double().T
    assert torch.equal(paper, ours)
    assert not torch.equal(ours, x_hat.double() @ w.double().T)        # RAC changed something


def test_rac_residual_on_a_static_channel_set():
    # one channel set for every row: each row's compacted residual on it, quantized per token,
    # zeros elsewhere; the per-row sets of rac_residual give rac_residual itself
    from lowbit.formats.activations import per_token_nvfp4, rac_residual, rac_residual_on
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 48, generator=g)
    x_hat = per_token_nvfp4(x)
    channels = torch.tensor([1, 5, 6, 20, 33, 47])
    got = rac_residual_on(x, x_hat, channels)
    r = x - x_hat
    assert torch.equal(got[:, channels], per_token_nvfp4(r[:, channels]))
    rest = torch.ones(48, dtype=torch.bool)
    rest[channels] = False
    assert (got[:, rest] == 0).all()
    top = torch.sort(r.abs(), dim=-1, descending=True, stable=True).indices[:, :12]
    per_row = torch.sort(top, dim=-1).values
    assert torch.equal(rac_residual_on(x, x_hat, per_row), rac_residual(x, x_hat, 0.25))
    assert (rac_residual_on(x, x_hat, channels[:0]) == 0).all()


def _slow_group_channels(scores_row, group, ratio):
    """Group by group from the left, each its own stable descending sort: the definition."""
    k, chosen = scores_row.numel(), []
    for start in range(0, k, group):
        part = scores_row[start:start + group]
        order = torch.sort(part, descending=True, stable=True).indices.tolist()
        chosen += [start + i for i in order[:rac_channel_count(part.numel(), ratio)]]
    return sorted(chosen)


@pytest.mark.parametrize("k,group", [(64, 16), (200, 64), (320, 128), (48, 64), (64, 64)])
def test_rac_residual_by_group_is_its_definition(k, group):
    # each group's top ceil(ratio * G) |r| (a last group of k % G its own count), ties to the
    # lower channel, NaN first; then the row's compaction and quantization as for the whole row
    from lowbit.formats.activations import rac_group_channels, rac_residual_on
    x = _rows(k, torch.float32, seed=k)
    x_hat = per_token_nvfp4(x)
    r = (x - x_hat).abs()
    for ratio in (0.1, 0.25, 0.5, 1.0):
        got = rac_group_channels(r, group, ratio)
        for n in range(x.shape[0]):
            assert got[n].tolist() == _slow_group_channels(r[n], group, ratio), (n, ratio)
        assert same_bits(rac_residual(x, x_hat, ratio, group), rac_residual_on(x, x_hat, got))
    if group >= k:   # one group holding the row: the row-wide choice
        assert same_bits(rac_residual(x, x_hat, 0.25, group), rac_residual(x, x_hat, 0.25))
    else:            # a real difference from the row-wide choice somewhere
        assert not same_bits(rac_residual(x, x_hat, 0.25, group), rac_residual(x, x_hat, 0.25))
    for bad in (8, 48, -64, 32768, True, 64.0):
        with pytest.raises(ValueError, match="power of two from 16"):
            rac_residual(x, x_hat, 0.25, bad)
