"""The Triton quantize kernels against the reference, bit for bit.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before
triton is imported), on small shapes; with one, the same tests run on CUDA. Every kernel's
codes, scales, tensor scale and dequantized values must equal the reference's (bitwise;
NaN where the reference has NaN) on random, adversarial, odd-shaped, 3D, non-contiguous and
bf16/fp16/fp32 inputs. Stochastic rounding is checked twice: exactly, by feeding the
reference the seed contract's uniforms (an independent NumPy Philox4x32-10), and
statistically, like the reference's own test.
"""

import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set; run with "
                    "TRITON_INTERPRET=1 in the environment", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton`, and stay set
pytest.importorskip("triton")

import lowbit  # noqa: E402
from lowbit.formats import QuantSpec, ScaleRule, quantize_dequantize, quantize_with_spec  # noqa: E402
from lowbit.formats.elements import decode  # noqa: E402
from lowbit.formats.quantize import blocked  # noqa: E402
from lowbit.dispatch import force_reference, reference_forced, use_kernels  # noqa: E402
from lowbit.kernels import (  # noqa: E402
    fake_quantize_triton, fake_quantize_triton_with_transpose, kernels_available,
    quantize_triton, quantize_triton_with_transpose, run_quantize_kernel, stochastic_uniforms,
    supports,
)
from lowbit.kernels.checks import (  # noqa: E402
    adversarial, assert_bits_equal, assert_same_qtensor, contract_uniforms, nvfp4_order_cases,
    philox4x32_10,
)
from lowbit.kernels.quantize import TileConfig  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
# the interpreter (NumPy) warns where a dequantized value overflows float32 before it saturates
# (and, for int blocks whose scale has no finite reciprocal, that x * inf is NaN before the
# kernel replaces it by x / scale)
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MX_SPECS = [QuantSpec.make(fmt, block, rule)
            for fmt in ("mxfp4", "mxfp8_e4m3", "mxfp8_e5m2") for rule in ("floor", "rceil")
            for block in ((1, 32), (16, 16), (32, 32))]
NV_SPECS = [QuantSpec.make("nvfp4", block, tensor_scale=two_level)
            for two_level in (True, False) for block in ((1, 16), (16, 16))]
SPECS = MX_SPECS + NV_SPECS


def spec_id(spec):
    level = "" if spec.scale_rule else ("-2level" if spec.tensor_scale else "-1level")
    rule = f"-{spec.scale_rule.value}" if spec.scale_rule else ""
    return f"{spec.format}{rule}{level}-{spec.block[0]}x{spec.block[1]}-{spec.rounding.value}"


def with_rounding(spec, rounding):
    return QuantSpec.make(spec.format, spec.block, spec.scale_rule, rounding, spec.tensor_scale)


def reference(x, spec):
    with force_reference():
        return quantize_with_spec(x.cpu(), spec)


def check(x, spec, seed=None):
    """quantize_triton and fake_quantize_triton against the reference on x."""
    r = reference(x, spec)
    assert_same_qtensor(quantize_triton(x, spec, seed), r)
    assert_bits_equal(fake_quantize_triton(x, spec, seed), r.dequantize())


def spread(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g).float())
    return x.to(DEVICE)


# ---- bit-exactness with the reference ----------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_random_inputs_match_the_reference(spec, dtype):
    check(spread((2, 48, 80), seed=1).to(dtype), spec)


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_adversarial_inputs_match_the_reference(spec):
    x = adversarial(64, 96, spec, seed=2).to(DEVICE)
    check(x, spec)
    check(x.to(torch.bfloat16), spec)


@pytest.mark.parametrize("spec", [MX_SPECS[3], MX_SPECS[7], NV_SPECS[0], NV_SPECS[1], NV_SPECS[3]],
                         ids=spec_id)
def test_all_zero_and_tiny_tensors(spec):
    """An all-zero tensor (NVFP4: tensor scale clamped at 2^-120, zeros out) and tensors whose
    amax is far below float32's normal range."""
    for x in (torch.zeros(20, 48), torch.full((20, 48), -0.0), spread((20, 48), seed=13) * 1e-36,
              spread((20, 48), seed=14) * 1e-41):
        check(x.to(DEVICE), spec)
    assert torch.equal(fake_quantize_triton(torch.zeros(20, 48, device=DEVICE), spec).cpu(),
                       torch.zeros(20, 48))


def test_nvfp4_follows_the_reference_operation_order():
    x, changed = nvfp4_order_cases(seed=0)
    assert min(changed.values()) > 0, changed   # each alternative order would fail here
    check(x.to(DEVICE), NV_SPECS[0])


ODD_SHAPE_SPECS = [s for s in SPECS if s.block[1] in (16, 32) and s.block[0] in (1, 32)] + [NV_SPECS[1]]


@pytest.mark.parametrize("spec, shape", [
    (spec, shape) for spec in ODD_SHAPE_SPECS
    for shape in [(1, 1), (5,), (3, 17), (2, 3, 33), (33, 47)]
    if not (spec.is_2d and len(shape) < 2)                  # 2D tiles need 2 dims
], ids=lambda v: spec_id(v) if isinstance(v, QuantSpec) else str(v))
def test_shapes_not_divisible_by_the_block(spec, shape):
    check(spread(shape, seed=3), spec)


@pytest.mark.parametrize("spec", [MX_SPECS[1], MX_SPECS[5], NV_SPECS[0], NV_SPECS[1]], ids=spec_id)
def test_non_contiguous_inputs(spec):
    base = spread((64, 96), seed=4)
    big = torch.full((80, 112), 1e30, device=DEVICE)   # huge values around a view: never read
    big[:64, :96] = base
    for view in (base.t(), base[:, ::2], base.reshape(8, 8, 96).permute(1, 0, 2), big[:64, :96]):
        assert not view.is_contiguous()
        check(view, spec)


@pytest.mark.parametrize("spec", [MX_SPECS[5], MX_SPECS[9], NV_SPECS[0]], ids=spec_id)
def test_fake_quantize_output_dtype_is_quantize_dequantizes(spec):
    x = spread((40, 64), seed=15)
    for in_dtype, out_dtype in [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                (torch.float32, torch.float16), (torch.bfloat16, None)]:
        with force_reference():
            ref = quantize_dequantize(x.to(in_dtype).cpu(), spec, dtype=out_dtype)
        assert_bits_equal(fake_quantize_triton(x.to(in_dtype), spec, dtype=out_dtype), ref)


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_nan_and_inf_blocks(spec):
    x = spread((64, 96), seed=5)
    x[0, 3], x[40, 40], x[63, 95] = float("nan"), float("inf"), -float("inf")  # 3 blocks
    q = quantize_triton(x, spec)
    assert_same_qtensor(q, reference(x, spec))
    nan_code = 0x7F if spec.format == "nvfp4" else 255
    assert (q.scales.view(torch.uint8) == nan_code).sum() == 3
    assert torch.isnan(fake_quantize_triton(x, spec)).sum() == 3 * spec.block[0] * spec.block[1]


@pytest.mark.parametrize("spec", [s for s in SPECS if s.is_2d], ids=spec_id)
@pytest.mark.parametrize("rounding", ["rne", "stochastic"])
def test_transposed_outputs_from_the_same_pass(spec, rounding):
    spec = with_rounding(spec, rounding)
    x = spread((2, 40, 45), seed=6).to(torch.bfloat16)
    q, q_t = quantize_triton_with_transpose(x, spec, seed=11)
    ref_t = q.t()
    assert torch.equal(q_t.codes, ref_t.codes) and torch.equal(q_t.scales.view(torch.uint8),
                                                                ref_t.scales.view(torch.uint8))
    assert q_t.shape == ref_t.shape and torch.equal(q_t.dequantize(), ref_t.dequantize())
    v, v_t = fake_quantize_triton_with_transpose(x, spec, seed=11)
    assert torch.equal(v, q.dequantize()) and torch.equal(v_t, v.mT.contiguous())
    if rounding == "rne":  # and both equal the reference of x^T
        assert_same_qtensor(q_t, reference(x.mT, spec))


# ---- stochastic rounding -------------------------------------------------------------------

def test_numpy_philox_is_random123s():
    zero = philox4x32_10((0, 0, 0, 0), (0, 0))
    assert [int(w) for w in zero] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = philox4x32_10((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2)
    assert [int(w) for w in ones] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


SR_SPECS = [with_rounding(s, "stochastic") for s in
            (MX_SPECS[1], MX_SPECS[5], MX_SPECS[10], MX_SPECS[15], NV_SPECS[0], NV_SPECS[1], NV_SPECS[3])]


def reference_with_uniforms(x, spec, u, monkeypatch):
    """The reference quantizer with stochastic rounding drawing the given uniforms."""
    def rand(size, *args, **kwargs):  # the reference's one draw, in its blocked layout
        noise = blocked(u, spec.block)[0]
        assert tuple(size) == tuple(noise.shape)
        return noise

    with monkeypatch.context() as patch:
        patch.setattr(torch, "rand", rand)
        return reference(x, spec)


@pytest.mark.parametrize("shape", [(3, 8, 64), (40, 70), (5,)], ids=str)  # C % 4 == 0 and != 0
@pytest.mark.parametrize("seed", [0, 2**40 + 12345, 2**63 - 1])
def test_kernel_uniforms_are_the_seed_contracts(shape, seed):
    ours = stochastic_uniforms(shape, seed, device=DEVICE).cpu()
    assert torch.equal(ours, contract_uniforms(shape, seed))
    assert 0 <= ours.min() and ours.max() < 1


@pytest.mark.parametrize("spec", SR_SPECS, ids=spec_id)
@pytest.mark.parametrize("shape", [(2, 32, 64), (40, 70)], ids=str)
def test_stochastic_rounding_is_the_reference_with_the_contract_uniforms(spec, shape, monkeypatch):
    seed = 2**40 + 12345
    x = spread(shape, seed=7)
    r = reference_with_uniforms(x, spec, contract_uniforms(shape, seed), monkeypatch)
    assert_same_qtensor(quantize_triton(x, spec, seed=seed), r)
    assert_bits_equal(fake_quantize_triton(x, spec, seed=seed), r.dequantize())


@pytest.mark.parametrize("spec", [SR_SPECS[i] for i in (0, 2, 3, 6)], ids=spec_id)
def test_stochastic_rounding_saturates_at_the_largest_value(spec, monkeypatch):
    """floor(ratio + u) at the largest value with u = 1 - 2^-24 rounds the float32 sum up to
    the next integer: one step past the format's max, which must saturate (as the reference's
    clamp does), not overflow into the sign bit or the NaN code."""
    seed, index = 39075, 3      # found by search: element 3's uniform is 1 - 2^-24
    u = contract_uniforms((1, 32), seed)
    assert u[0, index] == 1 - 2.0**-24
    x = torch.full((1, 32), 0.01)
    x[0, index] = spec.info.element.max_value * 2.0**3   # the block amax, a power-of-two scale
    x = x.to(DEVICE)
    q = quantize_triton(x, spec, seed=seed)
    r = reference_with_uniforms(x, spec, u, monkeypatch)
    assert_same_qtensor(q, r)
    assert_bits_equal(fake_quantize_triton(x, spec, seed=seed), r.dequantize())
    assert q.dequantize()[0, index] == x[0, index]


@pytest.mark.parametrize("spec", SR_SPECS[:3] + SR_SPECS[4:5], ids=spec_id)
def test_stochastic_rounding_bits_do_not_depend_on_the_launch_config(spec):
    x = spread((48, 96), seed=8)
    br, bc = spec.block
    configs = [None, TileConfig(max(br, 8), bc, 1), TileConfig(max(br, 32), 256, 4)]
    outs = [run_quantize_kernel(x, spec, 5, None, codes=True, values=True, transpose=False, config=c)
            for c in configs]
    for codes, values in outs[1:]:
        assert torch.equal(codes.codes, outs[0][0].codes) and torch.equal(values, outs[0][1])


def grid_neighbours(x, q):
    """The representable values just below and just above each x (float64)."""
    element = q.spec.info.element
    grid = decode(torch.arange(2 ** element.code_bits, dtype=torch.uint8), element).double()
    grid = torch.unique(grid[torch.isfinite(grid)]).float()
    candidates = (grid * q.element_scales()[..., None]).double()
    xd = x.double()[..., None]
    lo = torch.where(candidates <= xd, candidates, -torch.inf).amax(-1)
    hi = torch.where(candidates >= xd, candidates, torch.inf).amin(-1)
    return lo, hi


@pytest.mark.parametrize("spec", SR_SPECS[:4] + SR_SPECS[4:6], ids=spec_id)
def test_stochastic_rounding_unbiased_neighbours_and_seeded(spec):
    """The reference's statistical test, on the kernel. The draws are rows (2D: tiles) of one
    launch: identical blocks have identical scales and independent uniforms (for two-level
    NVFP4 the same tensor scale too)."""
    n = 256
    br = spec.block[0]
    shape = (br, br) if br > 1 else (4, 64)                           # one tile, or 4 rows
    g = torch.Generator().manual_seed(9)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-3, 3, shape, generator=g).float())
    stacked = x.repeat(n, 1).to(DEVICE)                               # (n * rows, cols)
    big = TileConfig(64, shape[1], 4)
    _, draws = run_quantize_kernel(stacked, spec, 3, None, codes=True, values=True, transpose=False, config=big)
    draws = draws.cpu().double().reshape(n, *x.shape)
    q = reference(x, with_rounding(spec, "rne"))
    inside = x.abs() <= q.block_max()
    # NVFP4's rounded block scale and MX floor can clip a block's largest values
    assert inside.float().mean() > 0.95 and (inside.all() or spec.scale_rule is not ScaleRule.RCEIL)
    lo, hi = grid_neighbours(x, q)
    xs, lo, hi, draws = x[inside].double(), lo[inside], hi[inside], draws[:, inside]
    assert ((draws == lo) | (draws == hi)).all()
    p = ((xs - lo) / (hi - lo)).nan_to_num(0.0)
    stderr = (hi - lo) * (p * (1 - p) / n).sqrt()
    # within 5 standard errors, plus two draws' worth for the rare events (p n ~ 1) of
    # values far below their block's largest, where the normal approximation is poor
    assert ((draws.mean(0) - xs).abs() <= 5 * stderr + 2 * (hi - lo) / n + 1e-9 * xs.abs()).all()
    a = quantize_triton(x.to(DEVICE), spec, seed=3)
    b = quantize_triton(x.to(DEVICE), spec, seed=3)
    c = quantize_triton(x.to(DEVICE), spec, seed=4)
    assert torch.equal(a.codes, b.codes) and not torch.equal(a.codes, c.codes)


def test_default_seed_comes_from_torchs_generator():
    spec = SR_SPECS[0]
    x = spread((16, 64), seed=10)
    torch.manual_seed(123)
    a = quantize_triton(x, spec)
    torch.manual_seed(123)
    b = quantize_triton(x, spec)
    c = quantize_triton(x, spec)
    g = torch.Generator(device=DEVICE).manual_seed(123)
    d = quantize_triton(x, spec, generator=g)
    e = quantize_triton(x, spec, seed=torch.tensor([2**50], device=DEVICE))
    f = quantize_triton(x, spec, seed=2**50)
    assert torch.equal(a.codes, b.codes) and not torch.equal(b.codes, c.codes)
    assert torch.equal(d.codes, a.codes)
    assert torch.equal(e.codes, f.codes)


# ---- intK fake quantization (values only: int codes stay the reference's) ---------------------

INT_SPECS = [QuantSpec.make(f"int{k}", block) for k in (2, 4, 8)
             for block in ((1, 128), (1, 32), (16, 16))]


def check_values(x, spec, seed=None, u=None, monkeypatch=None):
    """fake_quantize_triton against the reference's quantize(...).dequantize(), bitwise (with
    stochastic rounding, the reference drawing the seed contract's uniforms u)."""
    r = (reference(x, spec) if u is None else reference_with_uniforms(x, spec, u, monkeypatch))
    assert_bits_equal(fake_quantize_triton(x, spec, seed), r.dequantize())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", INT_SPECS, ids=spec_id)
def test_int_fake_quantize_matches_the_reference(spec, dtype):
    """Random values over +-12 binades, rounding ties and their float32 neighbours at
    power-of-two block scales, huge / tiny / all-zero / -0 blocks, NaN and Inf, an odd shape
    and a non-contiguous view."""
    check_values(spread((2, 48, 200), seed=1).to(dtype), spec)
    x = adversarial(64, 256, spec, seed=2)
    x[3, 7], x[40, 130], x[63, 255] = float("nan"), float("inf"), -float("inf")
    check_values(x.to(DEVICE).to(dtype), spec)
    check_values(spread((37, 45), seed=3).to(dtype), spec)
    check_values(spread((96, 64), seed=4).t().to(dtype), spec)


def test_int_fake_quantize_nan_blocks_have_the_references_nan_bits():
    """A block holding an Inf dequantizes to NaN; integer codes carry no sign there, so every
    element is a positive NaN, as the reference gives (not the sign of x, nor the host CPU's
    default NaN, which is negative). (The payload is the platform's: a GPU's canonical NaN.)"""
    spec = QuantSpec.make("int8", (1, 32))
    x = torch.linspace(-1, 1, 32).reshape(1, 32)
    x[0, 31] = float("inf")
    got = fake_quantize_triton(x.to(DEVICE), spec).cpu()
    ref = reference(x, spec).dequantize()
    assert torch.isnan(got).all() and torch.isnan(ref).all()
    assert (got.view(torch.int32) > 0).all() and (ref.view(torch.int32) > 0).all()


@pytest.mark.parametrize("spec", [s for s in INT_SPECS if s.is_2d], ids=spec_id)
def test_int_fake_quantize_transposed_from_the_same_pass(spec):
    x = spread((40, 45), seed=6).to(torch.bfloat16)
    v, v_t = fake_quantize_triton_with_transpose(x, spec)
    assert_bits_equal(v, reference(x, spec).dequantize())
    assert torch.equal(v_t, v.mT.contiguous())


@pytest.mark.parametrize("spec", [INT_SPECS[0], INT_SPECS[4], INT_SPECS[8]], ids=spec_id)
def test_int_stochastic_rounding_is_the_reference_with_the_contract_uniforms(spec, monkeypatch):
    spec = with_rounding(spec, "stochastic")
    seed, shape = 2**40 + 7, (40, 160)
    x = spread(shape, seed=8)
    check_values(x, spec, seed, contract_uniforms(shape, seed), monkeypatch)


def test_int_quantize_dispatch():
    """intK takes the kernels for fake quantization only; a QTensor of int codes is the
    reference's, and asking the kernels for one says so."""
    spec = QuantSpec.make("int4")
    x = torch.randn(4, 256, device=DEVICE)
    assert supports(spec, codes=False) and not supports(spec)
    assert use_kernels(x, spec, codes=False) == ON_GPU and not use_kernels(x, spec)
    assert not supports(QuantSpec.make("ternary"), codes=False)
    with pytest.raises(NotImplementedError, match="write no int codes"):
        quantize_triton(x, spec)


# ---- dispatch ------------------------------------------------------------------------------

def test_dispatch_switches(monkeypatch):
    spec = MX_SPECS[1]
    x = torch.randn(4, 32, device=DEVICE)
    assert kernels_available(x)
    assert use_kernels(x, spec) == ON_GPU      # CPU tensors always take the reference
    assert not use_kernels(x.cpu(), spec)
    assert not reference_forced()
    with force_reference():
        assert reference_forced() and not use_kernels(x, spec)
    assert not reference_forced()
    monkeypatch.setenv("LOWBIT_FORCE_REFERENCE", "1")
    assert reference_forced() and not use_kernels(x, spec)
    assert supports(spec) and supports(NV_SPECS[0])
    assert not supports(QuantSpec.make("int4")) and not supports(QuantSpec.make("mxfp4", (1, 48)))


def test_kernel_errors_say_what_to_do():
    x = torch.randn(4, 32, device=DEVICE)
    with pytest.raises(NotImplementedError, match="use the reference"):
        quantize_triton(x, QuantSpec.make("int4"))
    with pytest.raises(ValueError, match="square 2D tiles"):
        quantize_triton_with_transpose(x, MX_SPECS[0])
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        quantize_triton(x.to(torch.int32), MX_SPECS[0])
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\^63\)"):
        quantize_triton(x, SR_SPECS[0], seed=-1)


def test_lowbit_quantize_is_unchanged_on_the_cpu():
    """Importing the kernels does not reroute the reference (the oracle) on CPU tensors."""
    x = spread((8, 64), seed=12).cpu()
    q = lowbit.quantize(x, "mxfp4", scale_rule="rceil")
    assert torch.equal(q.codes, reference(x, q.spec).codes)


# ---- the random Hadamard transform fused into fake quantization ----------------------------

HADAMARD_SPECS = [QuantSpec.make("nvfp4", (1, 16), tensor_scale=True),
                  QuantSpec.make("nvfp4", (1, 16), tensor_scale=False),
                  QuantSpec.make("mxfp4", (1, 32), "floor")]


def hadamard_inputs(dtype):
    """16 random signs and x (N=64, features=37) on DEVICE: values over 2^+-12, an all-zero
    group, a group holding 1e30 and 1e-30 (float32: butterflies that round), a NaN, an Inf."""
    g = torch.Generator().manual_seed(5)
    signs = torch.randint(0, 2, (16,), generator=g) * 2 - 1
    x = spread((64, 37), seed=3)                                    # (N, features)
    x[0:16, 3] = 0.0
    x[16, 5], x[17, 5] = 1e30, 1e-30
    x[40, 7] = float("nan")
    x[50, 8] = float("inf")
    return signs, x.to(dtype)


def rotated_reference(t, spec, signs):
    from lowbit.ops import random_hadamard

    with force_reference():
        return quantize_dequantize(random_hadamard(t.cpu(), signs.cpu()), spec)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", HADAMARD_SPECS, ids=spec_id)
def test_fused_hadamard_is_the_rotation_then_the_quantizer(spec, dtype):
    """fake_quantize_triton(t, spec, hadamard=signs) == quantize_dequantize(random_hadamard(t,
    signs), spec) bit for bit: t a transposed view (as the wgrad operands dY^T, X^T), odd row
    count, values spread over 2^+-12, a group holding 1e30 and 1e-30 (float32: butterflies that
    round), a NaN, an Inf and an all-zero group."""
    signs, x = hadamard_inputs(dtype)
    t = x.mT                                                        # (37, 64), strides (1, 37)
    got = fake_quantize_triton(t, spec, hadamard=signs)
    assert got.shape == (37, 64) and got.dtype == dtype
    assert_bits_equal(got, rotated_reference(t, spec, signs).to(dtype))


@pytest.mark.parametrize("spec", [with_rounding(HADAMARD_SPECS[0], "stochastic"),
                                  with_rounding(HADAMARD_SPECS[2], "stochastic")], ids=spec_id)
def test_fused_hadamard_stochastic_rounding_is_the_seed_contracts(spec):
    """With stochastic rounding the fused kernel draws what the quantize kernel draws for the
    rotated tensor materialized first (the seed contract indexes the logical shape)."""
    from lowbit.ops import random_hadamard

    signs = torch.tensor([1, -1] * 8)
    t = spread((32, 80), seed=4).to(torch.bfloat16)
    got = fake_quantize_triton(t, spec, seed=99, hadamard=signs)
    assert_bits_equal(got, fake_quantize_triton(random_hadamard(t, signs), spec, seed=99))


def test_fused_hadamard_refuses_what_it_does_not_cover():
    signs = torch.ones(16)
    with pytest.raises(ValueError, match="multiple of 16"):
        fake_quantize_triton(torch.randn(4, 40, device=DEVICE), HADAMARD_SPECS[0], hadamard=signs)
    with pytest.raises(ValueError, match="1D blocks"):
        fake_quantize_triton(torch.randn(32, 32, device=DEVICE), QuantSpec.make("nvfp4", (16, 16)),
                             hadamard=signs)
    with pytest.raises(ValueError, match="16 signs"):
        fake_quantize_triton(torch.randn(4, 32, device=DEVICE), HADAMARD_SPECS[0],
                             hadamard=torch.ones(8))


# ---- the same along rows: the row-group kernel nvfp4's layers use (lowbit.kernels.hadamard) --

RHT_ROWS_SPECS = HADAMARD_SPECS[:2] + [with_rounding(HADAMARD_SPECS[0], "stochastic")]


# every dtype with the default and a wide launch config; the narrowest config (one row of 16
# a program: many programs, slow in Triton's interpreter) in bfloat16 alone
RHT_ROWS_RUNS = [(d, c) for d in DTYPES for c in (None, (4, 64, 2))] + [(torch.bfloat16, (1, 16, 1))]


@pytest.mark.parametrize("dtype,config", RHT_ROWS_RUNS, ids=str)
@pytest.mark.parametrize("spec", RHT_ROWS_SPECS, ids=spec_id)
def test_rht_rows_is_the_fused_kernel_on_the_transposed_view(spec, dtype, config):
    """fake_quantize_rht_rows(t, spec, signs) == fake_quantize_triton(t.mT, spec,
    hadamard=signs).mT bit for bit (so, through the test above, == the reference), with
    stochastic rounding the same draws (the seed contract indexes t.mT): ragged F (37, not a
    multiple of the tile), values over 2^+-12, a group holding 1e30 and 1e-30, a NaN, an Inf,
    an all-zero group; any tile and warps; the output (N, F) contiguous."""
    from lowbit.kernels.hadamard import fake_quantize_rht_rows

    signs, x = hadamard_inputs(dtype)
    got = fake_quantize_rht_rows(x, spec, signs, seed=7, config=config)
    assert got.shape == (64, 37) and got.dtype == dtype and got.is_contiguous()
    want = fake_quantize_triton(x.mT, spec, seed=7, hadamard=signs).mT
    assert_bits_equal(got, want)
    assert got.isnan().any() and got.isnan().sum() == want.isnan().sum()
    if spec.rounding.value == "rne":
        assert_bits_equal(got.cpu(), rotated_reference(x.mT, spec, signs).to(dtype).mT)


def test_rht_rows_reads_any_strides_and_huge_and_tiny_groups():
    """A column-major t (a transposed copy's view) and a row slice with a stride gap give the
    contiguous copy's bits; groups at float32's extremes (2^120, subnormal 2^-140) too."""
    from lowbit.kernels.hadamard import fake_quantize_rht_rows

    spec = HADAMARD_SPECS[0]
    signs = torch.tensor([1, -1, -1, 1] * 4)
    x = spread((32, 48), seed=9)
    x[:16, :8] *= 2.0**120
    x[16:, 40:] *= 2.0**-140
    x = x.to(DEVICE)
    want = fake_quantize_rht_rows(x, spec, signs)
    assert_bits_equal(fake_quantize_rht_rows(x.t().contiguous().t(), spec, signs), want)
    wide = torch.zeros(32, 96, device=DEVICE)
    wide[:, ::2] = x
    assert_bits_equal(fake_quantize_rht_rows(wide[:, ::2], spec, signs), want)
    assert_bits_equal(want.cpu(), rotated_reference(x.mT, spec, signs).mT)


@pytest.mark.parametrize("two_level", [True, False])
def test_rotated_bf16_subnormals_and_partly_filled_programs(two_level):
    """bf16 groups near float32's smallest normal (rotated values that are bf16 subnormals,
    rounded and widened back exactly), and 3 groups of 16 rows on programs of 2: both fused
    kernels equal the reference."""
    from lowbit.kernels.hadamard import fake_quantize_rht_rows
    from lowbit.ops import random_hadamard

    spec = QuantSpec.make("nvfp4", (1, 16), tensor_scale=two_level)
    g = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (16,), generator=g) * 2 - 1
    x = (torch.randn(48, 11, generator=g) * torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
    with force_reference():
        want = quantize_dequantize(random_hadamard(x.mT, signs), spec).mT
    x = x.to(DEVICE)
    assert_bits_equal(fake_quantize_rht_rows(x, spec, signs, config=(2, 16, 1)).cpu(), want)
    assert_bits_equal(fake_quantize_triton(x.mT, spec, hadamard=signs).mT.cpu(), want)


def test_rht_rows_refuses_what_it_does_not_cover():
    from lowbit.kernels.hadamard import fake_quantize_rht_rows, rht_rows_supported

    spec = HADAMARD_SPECS[0]
    with pytest.raises(ValueError, match="groups of 16"):
        fake_quantize_rht_rows(torch.randn(40, 8, device=DEVICE), spec, torch.ones(16))
    with pytest.raises(ValueError, match="NVFP4 1x16"):
        fake_quantize_rht_rows(torch.randn(32, 8, device=DEVICE), HADAMARD_SPECS[2],
                               torch.ones(16))
    with pytest.raises(ValueError, match="16 values"):
        fake_quantize_rht_rows(torch.randn(32, 8, device=DEVICE), spec, torch.ones(8))
    with pytest.raises(ValueError, match="must be powers of two"):
        fake_quantize_rht_rows(torch.randn(32, 8, device=DEVICE), spec, torch.ones(16),
                               config=(3, 16, 4))
    assert rht_rows_supported(torch.randn(32, 8), spec)
    assert not rht_rows_supported(torch.randn(2, 32, 8), spec)


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lowbit.kernels.quantize import rotate16  # noqa: E402


@triton.jit
def _rotate_kernel(x_ptr, signs_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr,
                   NATIVE_CAST: tl.constexpr):
    """rotate16 alone on an (R, C) tensor."""
    rows = tl.arange(0, R)[:, None]
    cols = tl.arange(0, C)
    x = tl.load(x_ptr + rows * C + cols[None, :]).to(tl.float32)
    tl.store(out_ptr + rows * C + cols[None, :],
             rotate16(x, x_ptr, signs_ptr, cols, R, C, NATIVE_CAST))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_rotation_is_random_hadamard_bit_for_bit(dtype):
    """The kernel's transform alone (before any quantizer could hide a last-bit difference)
    equals random_hadamard's bits, on float32 groups whose values span 2^-30..1, where float32
    butterflies round and any other order of the additions gives other bits."""
    from lowbit.ops import random_hadamard

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(16, 64, generator=g)
         * torch.exp2(torch.randint(-30, 1, (16, 64), generator=g).float())).to(dtype)
    signs = torch.randint(0, 2, (16,), generator=g) * 2 - 1
    out = torch.empty(16, 64, dtype=torch.float32, device=DEVICE)
    _rotate_kernel[(1,)](x.to(DEVICE), signs.float().to(DEVICE), out, 16, 64,
                         NATIVE_CAST=ON_GPU)
    assert_bits_equal(out.cpu(), random_hadamard(x, signs).float())


def test_nvfp4_layer_fused_hadamard_equals_rotation_then_kernel(monkeypatch):
    """nvfp4's wgrad operands through the fused row-group kernel give the layer the same
    gradients, bit for bit, as the rotation followed by the quantize kernel (kernels forced on the
    interpreter, or on the GPU; the same draws from torch's generator either way)."""
    import lowbit.dispatch as dispatch
    from kernel_paths import kernels_on_cpu
    from lowbit.formats import random_hadamard
    from lowbit.ops import quant_linear
    from lowbit.recipes import get_recipe

    import lowbit.kernels.hadamard as hadamard

    kernels_on_cpu(monkeypatch)
    fused_calls = []
    fake_quantize = hadamard.fake_quantize_rht_rows

    def spy(t, spec, signs, *args, **kwargs):
        fused_calls.append(True)
        return fake_quantize(t, spec, signs, *args, **kwargs)

    monkeypatch.setattr(hadamard, "fake_quantize_rht_rows", spy)
    r = get_recipe("nvfp4").linear
    g = torch.Generator().manual_seed(3)
    x0, w0 = torch.randn(48, 64, generator=g), torch.randn(32, 64, generator=g)
    dy = torch.randn(48, 32, generator=g)
    x0, w0, dy = x0.to(DEVICE), w0.to(DEVICE), dy.to(DEVICE)

    def grads():
        torch.manual_seed(11)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        quant_linear(x, w, None, r).backward(dy)
        return x.grad, w.grad

    fused = grads()
    assert len(fused_calls) == 2                  # dY^T and X^T, each through the fused kernel
    calls = []
    unfused = dispatch.rotated_fake_quantize

    def rotate_then_quantize(t, spec, signs, segment_ends=None):
        assert segment_ends is None                # a dense layer: one tensor
        calls.append(1)
        # contiguous, as the fused kernel writes it: on the GPU the wgrad GEMM's bits depend
        # on its operands' layout (cuBLAS picks its kernel by it), not only their values
        return dispatch.quantize_dequantize(random_hadamard(t.mT, signs), spec).mT.contiguous()

    monkeypatch.setattr(dispatch, "rotated_fake_quantize", rotate_then_quantize)
    plain = grads()
    assert calls and unfused is not rotate_then_quantize
    assert_bits_equal(fused[0], plain[0])
    assert_bits_equal(fused[1], plain[1])


@pytest.mark.parametrize("ends", [[16, 16, 48, 64, 96], [0], [100], [7, 7, 33, 250], [0, 0, 3, 97], [],
                                  list(range(0, 100, 3))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_scales_on_the_kernels_are_the_references_bits(ends, dtype):
    # each segment's NVFP4 tensor scale, of its rows (any end) or of its runs of 16 columns
    # (rotated or not), against the reference's segmented reduction over the same maxima;
    # empty segments, ends past the tensor, no end (one segment), 34 segments, an all-zero
    # segment, huge and tiny ones, NaN, Inf, a non-contiguous view; segments across the
    # kernel's blocks of runs
    from bits import expert_segments

    from lowbit.formats import random_hadamard
    from lowbit.formats.quantize import segment_scales_from_amax, segment_tensor_scales
    from lowbit.kernels import segment_scales_triton
    x, _ = expert_segments(5, huge=1e30, tiny=1e-30)
    x = torch.cat([x] * 8).to(DEVICE, dtype)                      # (800, 40)
    e = torch.tensor(ends, dtype=torch.int32, device=DEVICE).reshape(-1) * 8
    got = segment_scales_triton(x, e, rows=True)
    assert got.shape == (800,) and got.dtype == torch.float32
    assert torch.equal(got, segment_tensor_scales(x, e)[:, 0])
    signs = torch.tensor([1, -1, -1, 1] * 4, dtype=torch.float32, device=DEVICE)
    for t, hadamard in ((x.mT[:32], None), (x.mT[:32], signs)):    # (32, 800) views, runs of 16 columns
        g = segment_scales_triton(t, e, hadamard=hadamard)
        v = t if hadamard is None else random_hadamard(t, signs)
        maxima = torch.where(v.isfinite(), v.abs(), 0).float().view(32, 800 // 16, 16).amax(dim=(0, 2))
        assert torch.equal(g, segment_scales_from_amax(maxima, e.long(), 16).repeat_interleave(16))
    with pytest.raises(ValueError, match="a 1-D int32/int64 tensor"):
        segment_scales_triton(x, e.float(), rows=True)


@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_under_given_tensor_scales_per_row_or_column_is_the_reference(block, dtype):
    # an MoE layer's experts' segments, each under its own FP32 tensor scale: one per row (X,
    # dY), one per column (their transposes, the tokens along the blocks; non-contiguous), the
    # scales of lowbit.formats.quantize.segment_tensor_scales; odd widths, huge and tiny
    # segments, an all-zero one, NaN and Inf
    from bits import expert_segments

    from lowbit.formats.quantize import segment_tensor_scales
    x, ends = expert_segments(3, huge=1e4, tiny=1e-9)
    x = x.to(DEVICE, dtype)
    spec = QuantSpec.make("nvfp4", block)
    scales = segment_tensor_scales(x, ends.to(DEVICE))
    for t, s in ((x, scales), (x.mT, scales.mT)):
        got = fake_quantize_triton(t, spec, tensor_scale=s)
        want = quantize_dequantize(t, spec, tensor_scale=s)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match=r"\(R, 1\) or \(1, C\)"):
        fake_quantize_triton(x, spec, tensor_scale=torch.ones(3, 1))
    # the maxima the scales come from, in one kernel: each row's (any width), each 16 columns'
    from lowbit.formats import random_hadamard
    from lowbit.kernels import group_amax_triton
    finite = torch.where(x.isfinite(), x.abs(), 0).float()
    for t in (x, x.mT):
        assert torch.equal(group_amax_triton(t, rows=True), torch.where(t.isfinite(), t.abs(), 0).float().amax(1))
    assert torch.equal(group_amax_triton(x.mT[:, :96]), finite[:96].view(6, 16, 40).amax(dim=(1, 2)))
    signs = torch.tensor([1, -1] * 8, dtype=torch.float32, device=DEVICE)
    rotated = random_hadamard(x.mT[:, :96], signs).float()
    assert torch.equal(group_amax_triton(x.mT[:, :96], signs),
                       torch.where(rotated.isfinite(), rotated.abs(), 0).view(40, 6, 16).amax(dim=(0, 2)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_quantize_rows_on_the_kernels_is_each_runs_own_quantize(dtype, layout, monkeypatch):
    # runs of rows each under its own NVFP4 tensor scale, in one pass (a weight sync's fused
    # projections, an MoE layer's experts): each run's QTensor the bits of quantizing the run
    # alone, by the kernel and by the reference; a huge run with an Inf, an all-zero run, a tiny
    # run with a NaN, a run of one row, 40 columns (a padded block), a strided view
    from bits import expert_segments

    from lowbit import dispatch
    from lowbit.formats import quantize_with_spec
    from lowbit.kernels import quantize_rows_triton, quantize_triton
    x, _ = expert_segments(7, huge=1e4 if dtype == torch.float16 else 1e30, tiny=1e-9)
    x = x.to(DEVICE, dtype)
    if layout == "strided":
        x = torch.stack([x, -x], dim=-1).flatten(-2)[:, ::2]             # (100, 40), column stride 2
        assert not x.is_contiguous()
    spec = QuantSpec.make("nvfp4", (1, 16))
    runs = [16, 32, 16, 32, 3, 1]
    got = quantize_rows_triton(x, spec, runs)
    start = 0
    for n, q in zip(runs, got):
        part = x[start:start + n]
        for want in (quantize_triton(part, spec), quantize_with_spec(part, spec)):
            assert q.shape == want.shape == (n, 40)
            assert torch.equal(q.codes, want.codes), (start, n)
            assert torch.equal(q.scales.view(torch.uint8), want.scales.view(torch.uint8)), (start, n)
            assert torch.equal(q.tensor_scale.reshape(()), want.tensor_scale.reshape(())), (start, n)
        start += n
    assert got[2].codes.eq(0).all() and got[1].tensor_scale > 1e3 * got[0].tensor_scale   # runs apart
    # dispatch's rule: the kernels take the runs in one pass where they apply (patched in for
    # CPU tensors, which otherwise take the reference run by run: the same bits)
    monkeypatch.setattr("lowbit.dispatch._quantizers.use_kernels", lambda *a, **k: True)
    calls = []
    monkeypatch.setattr("lowbit.kernels.quantize_rows_triton",
                        lambda *a: (calls.append(a[2]), quantize_rows_triton(*a))[1])
    for q, want in zip(dispatch.quantize_rows(x, spec, runs), got):
        assert torch.equal(q.codes, want.codes) and torch.equal(q.tensor_scale, want.tensor_scale)
    assert calls == [runs]
    with pytest.raises(ValueError, match="runs of rows"):
        quantize_rows_triton(x, spec, [50, 49])
    with pytest.raises(ValueError, match="^quantize_rows takes a 2-D x"):   # dispatch's, the same rule
        dispatch.quantize_rows(x, spec, [50, 49])
    with pytest.raises(ValueError, match="NVFP4 with a tensor scale"):
        quantize_rows_triton(x, QuantSpec.make("mxfp4", (1, 32), scale_rule="floor"), [100])


def test_the_maxima_kernel_zeroes_the_segments_buffer_and_leaves_the_tiles_to_reduce():
    # segment_scales_triton's launches: the maxima kernel zeroes the segment maxima's buffer
    # (whatever it held) and, for rows, hands its tiles' maxima unreduced to the segment-max
    # kernel, which reduces them: the bits of the maxima reduced first
    from lowbit.kernels import quantize as kq
    x = torch.randn(70, 300, generator=torch.Generator().manual_seed(3)).to(DEVICE)   # 3 column tiles a row
    seg = torch.full((5,), 0x7F000000, dtype=torch.int32, device=DEVICE)               # garbage
    tiles = kq.group_amax(x, rows_max=True, zero=seg, reduce=False)
    assert torch.equal(seg, torch.zeros_like(seg)) and tiles.shape == (3, 70) and tiles.dtype == torch.int32
    assert torch.equal(tiles.amax(dim=0).view(torch.float32), kq.group_amax(x, rows_max=True))
    ends = torch.tensor([10, 10, 40, 69], dtype=torch.int32, device=DEVICE)
    reduced = kq.segment_scales(kq.group_amax(x, rows_max=True), ends, 1, 1)
    assert torch.equal(kq.segment_scales(tiles, ends, 1, 1, seg=seg), reduced)
    with pytest.raises(ValueError, match="int32 buffer of at most 4096"):
        kq.group_amax(x, rows_max=True, zero=torch.zeros(5, device=DEVICE))
