"""Element casts, enumerated code by code against independent implementations:
torch's float8 dtypes (E4M3, E5M2) and ml_dtypes' float4_e2m1fn (FP4)."""

import ml_dtypes
import numpy as np
import pytest
import torch

from lowbit.formats.elements import (
    BINARY, E2M1, E4M3, E5M2, TERNARY, decode, e8m0_to_float, encode, int_format, pack_codes,
    round_to_grid, unpack_codes,
)


def all_e2m1_codes():
    return torch.arange(16, dtype=torch.uint8)


def test_every_fp4_code_decodes_like_ml_dtypes():
    ours = decode(all_e2m1_codes(), E2M1).numpy()
    theirs = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    # ml_dtypes' float4_e2m1fn bit layout is sign<<3 | exponent<<1 | mantissa: the same codes
    np.testing.assert_array_equal(ours, theirs)
    assert np.signbit(ours[8]) and ours[8] == 0  # code 0b1000 is -0.0


def test_every_fp4_value_encodes_back_to_its_code():
    codes = all_e2m1_codes()
    assert torch.equal(encode(decode(codes, E2M1), E2M1), codes)


def test_fp4_rounding_matches_ml_dtypes_on_dense_sweep():
    # every float32 in a dense sweep over the FP4 range, including all ties and their neighbours
    base = torch.linspace(-7, 7, 200_001)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat([base, ties, -ties, torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1)])
    ours = round_to_grid(x, E2M1)
    theirs = torch.from_numpy(x.numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
    # ml_dtypes saturates finite values beyond 6 too (float4_e2m1fn has no inf)
    assert torch.equal(ours, theirs)


def test_fp4_ties_go_to_even_code():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert round_to_grid(ties, E2M1).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


@pytest.mark.parametrize("fmt, dtype", [(E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)])
def test_every_fp8_code_decodes_like_torch(fmt, dtype):
    codes = torch.arange(256, dtype=torch.uint8)
    ours = decode(codes, fmt)
    theirs = codes.view(dtype).to(torch.float32)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt, dtype", [(E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)])
def test_every_finite_fp8_value_and_its_midpoints_round_like_torch(fmt, dtype):
    values = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32)
    values = torch.unique(values[torch.isfinite(values)])
    mids = (values[1:] + values[:-1]) / 2  # exact ties (float32 holds them exactly)
    x = torch.cat([values, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1),
                   torch.randn(100_000) * fmt.max_value / 8])
    x = x[x.abs() <= fmt.max_value]  # torch's cast does not saturate beyond max in all versions
    ours = round_to_grid(x, fmt)
    theirs = x.to(dtype).to(torch.float32)
    assert torch.equal(ours, theirs)
    assert torch.equal(encode(ours, fmt), theirs.to(dtype).view(torch.uint8))


def test_fp8_saturates_and_keeps_nan():
    x = torch.tensor([1e6, -1e6, 464.0, 465.0, float("nan")])
    out = round_to_grid(x, E4M3)
    assert out[:4].tolist() == [448.0, -448.0, 448.0, 448.0] and torch.isnan(out[4])


def test_stochastic_rounding_hits_only_neighbours_and_is_unbiased():
    x = torch.full((200_000,), 2.3)  # neighbours 2 and 3 on the FP4 grid
    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(1))
    out = round_to_grid(x, E2M1, "stochastic", noise)
    assert set(out.unique().tolist()) == {2.0, 3.0}
    # P(3) = 0.3; standard error of the mean = sqrt(.3*.7/n)
    assert abs(out.mean().item() - 2.3) < 4 * (0.21 / 200_000) ** 0.5


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_int_grids_roundtrip_every_code(bits):
    fmt = int_format(bits)
    q = torch.arange(-fmt.max_value, fmt.max_value + 1)
    assert torch.equal(decode(encode(q, fmt), fmt), q)
    assert torch.equal(round_to_grid(q + 0.5, fmt), torch.clamp(torch.round(q + 0.5), max=fmt.max_value))


def test_ternary_and_binary():
    x = torch.tensor([-3.0, -0.6, -0.4, 0.0, 0.4, 0.6, 3.0])
    assert round_to_grid(x, TERNARY).tolist() == [-1, -1, -0.0, 0, 0, 1, 1]
    assert round_to_grid(x, BINARY).tolist() == [-1, -1, -1, 1, 1, 1, 1]
    assert torch.equal(decode(encode(round_to_grid(x, BINARY), BINARY), BINARY), round_to_grid(x, BINARY))


def test_e8m0_decodes_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    vals = e8m0_to_float(codes)
    assert torch.isnan(vals[255])
    expected = torch.tensor([2.0 ** (c - 127) for c in range(255)], dtype=torch.float64).float()
    assert torch.equal(vals[:255], expected)  # 2^-127 kept as a float32 subnormal
    assert torch.equal(vals[:255], codes[:255].view(torch.float8_e8m0fnu).float())


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_unpack_roundtrip_low_bits_first(bits):
    codes = torch.randint(0, 2**bits, (3, 5, 16), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, 5, 16 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)
    if bits == 4:  # ModelOpt / compressed-tensors: even element in the low nibble
        assert torch.equal(packed & 0xF, codes[..., 0::2])
