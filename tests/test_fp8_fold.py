"""quantize_fold_mxfp4 (lowbit.kernels.fp8_fold) equals fold_operand(quantize_with_spec(x, spec))
bit for bit: E4M3 bytes, factors (as bits), K-chunk bounds and NaN rows, for x's operand and,
with square 2D tiles, x^T's. Under TRITON_INTERPRET=1 on the CPU (tests/conftest.py), small
shapes: random values with block exponents spread over +-6 and +-30 binades (the latter
K-chunked), odd shapes, all-zero / NaN / Inf blocks, blocks whose scale clamps at 2^-127 and
2^127, -0, strided inputs, float32 / bfloat16 / float16; stochastic rounding against the fold of
the kernel quantizer's output with the same seed.
"""

import contextlib
import threading

import pytest
import torch
from kernel_paths import kernels_on_cpu

import lowbit.dispatch as dispatch
from lowbit.dispatch.fold_check import ACTIVE, deferred_fold_check, watch_chunked_folds
from lowbit.formats import QuantSpec, quantize_with_spec
from lowbit.formats.fold import NAN_ROW, SHIFT_MAX, SHIFT_MIN, BlockExponents, shift_table
from lowbit.formats.fold import fold_operand
from lowbit.kernels import quantize_triton

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from lowbit.kernels.fp8_fold import (  # noqa: E402
    encode_shifted, quantize_fold_mxfp4, quantize_fold_mxfp4_with_transpose,
)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RULES = ["floor", "rceil"]
BLOCKS = [(1, 32), (32, 32), (16, 16)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def spread(rows, cols, binades, seed=0, tile=(1, 32), dtype=torch.float32):
    """Gaussian values times 2^U{-binades..binades}, one exponent per tile."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    br, bc = tile
    e = torch.randint(-binades, binades + 1, (-(-rows // br), -(-cols // bc)), generator=g)
    mag = torch.exp2(e.double()).repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)
    return (x * mag[:, :cols]).to(dtype)


def assert_same(got, ref):
    assert got.fp8.dtype == torch.float8_e4m3fn and got.fp8.shape == ref.fp8.shape
    assert torch.equal(got.fp8.view(torch.uint8).cpu(), ref.fp8.view(torch.uint8).cpu())
    assert got.factors.dtype == torch.float32
    assert torch.equal(got.factors.view(torch.int32).cpu(), ref.factors.view(torch.int32).cpu())
    assert got.bounds == ref.bounds
    assert torch.equal(got.nan_rows.cpu(), ref.nan_rows.cpu())


def check(x, spec, seed=None):
    """Every output of the kernel against the reference fold (RNE: of the reference quantizer;
    stochastic: of the kernel quantizer with the same seed). Returns x's reference operand."""
    if seed is None:
        q = quantize_with_spec(x.cpu(), spec)
    else:
        q = quantize_triton(x, spec, seed=seed)
    ref = fold_operand(q)
    assert_same(quantize_fold_mxfp4(x, spec, seed=seed), ref)
    if spec.is_2d:
        ref_t = fold_operand(q, transpose=True)
        assert_same(quantize_fold_mxfp4(x, spec, transpose=True, seed=seed), ref_t)
        a, a_t = quantize_fold_mxfp4_with_transpose(x, spec, seed=seed)
        assert_same(a, ref)
        assert_same(a_t, ref_t)
    return ref


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("binades", [6, 30])
def test_random_spread(rule, block, binades):
    spec = QuantSpec.make("mxfp4", block, rule)
    x = spread(67, 200, binades, seed=binades, tile=(block[0], block[1])).to(DEVICE)  # odd rows
    ref = check(x, spec)
    if binades == 30:
        assert len(ref.bounds) > 2       # the case that needs K-chunks is exercised


@pytest.mark.parametrize("block", BLOCKS)
def test_shapes_the_tiles_cover_exactly(block):
    """Shapes that are whole tiles take the kernels' unmasked (EVEN) path."""
    from lowbit.kernels.quantize import default_config

    spec = QuantSpec.make("mxfp4", block, "rceil")
    rows, cols = 64, 256
    tile_r, tile_c, _ = default_config(rows, cols, block)
    assert rows % tile_r == 0 and cols % tile_c == 0
    x = spread(rows, cols, 6, seed=2, tile=block)
    x[3, 40] = float("nan")
    check(x.to(DEVICE), spec)
    check(x.to(DEVICE), QuantSpec.make("mxfp4", block, "rceil", rounding="stochastic"), seed=5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [(1, 32), (16, 16)])
def test_dtypes_odd_shapes(dtype, block):
    # fp16 holds 2^+-14 scaled gaussians without overflow; the spread still reaches 2 chunks
    binades = 6 if dtype is torch.float16 else 20
    for rows, cols in [(1, 1), (5, 33), (17, 50), (33, 97)]:
        x = spread(rows, cols, binades, seed=rows, tile=block, dtype=dtype).to(DEVICE)
        check(x, QuantSpec.make("mxfp4", block, "rceil"))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("block", BLOCKS)
def test_special_blocks(rule, block):
    """All-zero blocks (must not widen a row's span), NaN and Inf blocks, -0, blocks whose
    scale clamps at 2^-127 (float32 subnormals: some round to all-zero codes) and at 2^127."""
    spec = QuantSpec.make("mxfp4", block, rule)
    br, bc = block
    x = spread(64, 160, 6, seed=1, tile=block)
    x[:, 0:bc] = 0.0                                  # an all-zero block column
    x[0:br, bc:2 * bc] = -0.0
    x[5, 2 * bc + 3] = float("nan")
    x[40, 4 * bc + 1] = float("inf")
    x[41, 4 * bc + 2] = -float("inf")
    x[20:20 + br, 3 * bc:4 * bc] *= 2.0**-140         # float32 subnormals, scale clamps at 2^-127
    x[50:50 + br, 2 * bc:3 * bc] = 2.0**-149          # the smallest subnormal: codes round to 0
    x[60:64, 3 * bc:4 * bc] = 3.0e38                  # scale 2^127 (floor) / 2^126 (rceil)
    ref = check(x.to(DEVICE), spec)
    assert bool(ref.nan_rows.any())
    check(torch.zeros(33, 70, device=DEVICE), spec)
    check(torch.full((9, 40), float("nan"), device=DEVICE), spec)


@pytest.mark.parametrize("block", [(1, 32), (32, 32)])
def test_strided_input(block):
    spec = QuantSpec.make("mxfp4", block, "floor")
    base = spread(96, 64, 10, seed=3, tile=block).to(DEVICE)
    check(base.t(), spec)                                   # column-major
    check(base[::2, 5:60], spec)                            # row stride 128, offset


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("block", BLOCKS)
def test_stochastic_matches_kernel_quantizer(rule, block):
    spec = QuantSpec.make("mxfp4", block, rule, rounding="stochastic")
    x = spread(40, 130, 30, seed=7, tile=block).to(DEVICE)
    check(x, spec, seed=1234)
    check(x, spec, seed=2**40 + 17)
    check(x.to(torch.bfloat16), spec, seed=torch.tensor([99], dtype=torch.int64, device=DEVICE))
    a = quantize_fold_mxfp4(x, spec, seed=1)
    b = quantize_fold_mxfp4(x, spec, seed=2)
    assert not torch.equal(a.fp8.view(torch.uint8), b.fp8.view(torch.uint8))   # the seed matters


@contextlib.contextmanager
def no_host_reads():
    """Fail on any read of a tensor's value into Python (a host sync on CUDA)."""
    def fail(*args, **kwargs):
        pytest.fail("a host sync inside a deferred fold")

    with pytest.MonkeyPatch.context() as mp:
        for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
            mp.setattr(torch.Tensor, name, fail)
        yield


def outside_window(q, transpose=False):
    """The nonzero values one factor per row leaves in blocks below the window (the reference
    fold's own rules), and the rows that have none."""
    blocks = BlockExponents(q, transpose)
    f = blocks.factor_exponents([0, blocks.n_blocks])
    over = blocks.live & (blocks.exps - f < SHIFT_MIN)                       # (R, nb)
    nonzero = ((blocks.codes & 0x7) != 0).sum(dim=-1)                       # (R, nb)
    return int((nonzero * over).sum()), ~over.any(dim=1)


@triton.jit
def encode_kernel(values_ptr, shift_ptr, bad_ptr, out_ptr, NATIVE_CAST: tl.constexpr):
    """fp8_fold.encode_shifted on 32 cases (rows: a shift and a NaN flag each) x 16 values."""
    i = tl.arange(0, 32)[:, None] * 16 + tl.arange(0, 16)[None, :]
    r = tl.arange(0, 32)[:, None]
    bits = encode_shifted(tl.load(values_ptr + i), tl.load(shift_ptr + r), tl.load(bad_ptr + r) != 0,
                   1, 16, 32, 16, NATIVE_CAST)
    tl.store(out_ptr + i, bits)


def test_encode_equals_the_shift_table():
    """The kernels' E4M3 encoding (E2M1 value * 2^shift through a float32 -> E4M3 conversion)
    gives the reference fold's table entry for every code and every shift in the window,
    SHIFT_MIN's entry for shifts below it, and E4M3 NaN in NaN blocks."""
    from lowbit.formats.elements import E2M1_VALUES

    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    values = torch.cat([mags, -mags]).expand(32, 16).contiguous()             # codes 0..15
    # every shift in the window, shifts far below it (a row spanning > 14 binades: clamped to
    # SHIFT_MIN), and NaN rows over in-window shifts (the GPU's conversion must give 0x7F)
    window = torch.arange(SHIFT_MIN, SHIFT_MAX + 1)
    below = torch.tensor([SHIFT_MIN - 1, SHIFT_MIN - 2, SHIFT_MIN - 9, -40, -127, -250])
    shifts = torch.cat([window, below, window[:11]]).to(torch.int32)           # 32 rows
    bad = torch.zeros(32, dtype=torch.int32)
    bad[-11:] = 1
    out = torch.empty(32, 16, dtype=torch.uint8, device=DEVICE)
    encode_kernel[(1,)](values.to(DEVICE), shifts.to(DEVICE), bad.to(DEVICE), out,
                        NATIVE_CAST=DEVICE == "cuda")
    table = shift_table(torch.device("cpu")).reshape(16, 16)
    rows = (shifts.clamp(min=SHIFT_MIN) - SHIFT_MIN).long()
    rows[-11:] = NAN_ROW
    assert torch.equal(out.cpu(), table[rows])


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("binades", [6, 30])
def test_deferred_check_folds_in_one_chunk_without_syncs(rule, block, binades):
    """Inside deferred_fold_check() the kernels fold with one factor per row and never read
    anything back: within the window the result is the exact fold; past it, the check's counter
    holds exactly the number of values left inexact, and every other row is still exact."""
    spec = QuantSpec.make("mxfp4", block, rule)
    x = spread(67, 200, binades, seed=binades, tile=block)
    narrow = spread(67, 200, 4, seed=1, tile=block)
    x[:32], x[:, :64] = narrow[:32], narrow[:, :64]   # rows and columns that fold in one chunk
    x = x.to(DEVICE)
    q = quantize_with_spec(x.cpu(), spec)
    with no_host_reads(), deferred_fold_check(x.device) as check:
        outs = [(quantize_fold_mxfp4(x, spec, counter=check.counter), False)]
        if spec.is_2d:
            a, a_t = quantize_fold_mxfp4_with_transpose(x, spec, counter=check.counter)
            outs += [(a, False), (a_t, True)]
    expected = 0
    for got, transpose in outs:
        ref = fold_operand(q, transpose=transpose)
        n_over, exact_rows = outside_window(q, transpose)
        expected += n_over
        assert got.bounds == (0, got.shape[1])
        if n_over == 0:
            assert_same(got, ref)
        else:   # every row with no block outside the window holds exactly the FP4 values
            assert len(ref.bounds) > 2
            rows = exact_rows.to(got.fp8.device)
            values = q.dequantize(torch.float32)
            values = values.t() if transpose else values
            assert 0 < int(rows.sum()) < rows.numel()
            assert torch.equal(got.unfold()[rows].cpu(), values[exact_rows])
            assert torch.equal(got.nan_rows.cpu(), ref.nan_rows.cpu())
    assert (binades == 30) == (expected > 0)
    assert check.inexact_values() == expected


def test_deferred_check_is_per_thread_nests_and_closes(monkeypatch):
    """A check covers its own thread only (another thread's fold stays exact and uncounted); a
    check opened inside another adds its count to the outer one when it closes; a fold handed a
    closed check is exact. (lowbit.dispatch.quantize_fold resolves the check; the kernels run.)"""
    kernels_on_cpu(monkeypatch)

    def quantize_fold_mxfp4(x, spec, check=ACTIVE):
        return dispatch.quantize_fold(x, spec, check=check)[0]

    spec = QuantSpec.make("mxfp4", (1, 32), "rceil")
    x = spread(40, 200, 30, seed=5).to(DEVICE)
    ref = fold_operand(quantize_with_spec(x.cpu(), spec))
    assert len(ref.bounds) > 2
    with deferred_fold_check(x.device) as outer:
        got = []
        worker = threading.Thread(target=lambda: got.append(quantize_fold_mxfp4(x, spec)))
        worker.start()
        worker.join()
        assert_same(got[0], ref)
        assert outer.inexact_values() == 0
        with deferred_fold_check(x.device) as inner:
            quantize_fold_mxfp4(x, spec)
        n = inner.inexact_values()
        assert n > 0 and outer.inexact_values() == n
    assert_same(quantize_fold_mxfp4(x, spec, check=outer), ref)
    assert outer.inexact_values() == n
    with pytest.raises(TypeError, match="check must be"):
        quantize_fold_mxfp4(x, spec, check="deferred")


def test_refuses_what_does_not_fold():
    x = torch.randn(32, 64, device=DEVICE)
    with pytest.raises(ValueError, match="MXFP4"):
        quantize_fold_mxfp4(x, QuantSpec.make("nvfp4", (1, 16)))
    with pytest.raises(ValueError, match="square 2D tiles"):
        quantize_fold_mxfp4(x, QuantSpec.make("mxfp4", (1, 32), "floor"), transpose=True)
    with pytest.raises(ValueError, match="2-D"):
        quantize_fold_mxfp4(x.reshape(2, 16, 64), QuantSpec.make("mxfp4", (1, 32), "floor"))


@pytest.mark.parametrize("dy_block", [(32, 32), (1, 32)])
def test_linear_fp8_kernel_path_equals_reference_path(monkeypatch, dy_block):
    """_QuantLinearFP8 through the fused kernels (quantize_fold's CUDA branch; on the CPU forced
    on the interpreter) gives the same output and gradients, bit for bit, as through the
    reference quantizer and fold_operand: shared 2D operands (W, X, and dY when 2D) and the 1D
    dY case."""
    from dataclasses import replace

    from lowbit.formats.spec import Rounding
    from lowbit.ops import quant_linear
    from lowbit.recipes import get_recipe

    lin = get_recipe("stable-fp4-fp8").linear
    dy = replace(lin.dgrad_dy, rounding=Rounding.RNE, block=dy_block)
    lin = replace(lin, dgrad_dy=dy, wgrad_dy=dy)   # 1D: dY^T gets its own (1, 32) blocks
    g = torch.Generator().manual_seed(3)
    x0 = spread(70, 96, 4, seed=1, tile=(32, 32)).to(DEVICE)
    w0 = torch.randn(40, 96, generator=g).to(DEVICE)
    grad = torch.randn(70, 40, generator=g).to(DEVICE)

    def run():
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = quant_linear(x, w, None, lin)
        y.backward(grad)
        return y.detach(), x.grad, w.grad

    with dispatch.force_reference():
        ref = run()
    kernels_on_cpu(monkeypatch)
    got = run()
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("compiled", [False, True])
def test_linear_fp8_backward_folds_under_the_check_its_forward_saw(monkeypatch, compiled):
    """_QuantLinearFP8 hands its forward's deferred check to its backward (autograd may run the
    backward on another thread): a backward inside the check's block counts what one K-chunk
    leaves inexact; one that runs after the block has closed folds exactly, so its gradients
    equal those of a run with no check at all. The same under torch.compile, where the layer
    is lowbit.ops.compiled's custom ops (one graph, AOTAutograd's backward)."""
    from dataclasses import replace

    from lowbit.formats.spec import Rounding
    from lowbit.ops import quant_linear
    from lowbit.recipes import get_recipe

    lin = get_recipe("stable-fp4-fp8").linear
    dy_spec = replace(lin.dgrad_dy, rounding=Rounding.RNE)
    lin = replace(lin, dgrad_dy=dy_spec, wgrad_dy=dy_spec)
    g = torch.Generator().manual_seed(4)
    x0 = spread(64, 96, 4, seed=2, tile=(32, 32)).to(DEVICE)
    w0 = torch.randn(40, 96, generator=g).to(DEVICE)
    # tokens 0-31 at 2^-20, 32-63 at 2^20 (one scale per 32x32 tile row): dY's rows fold in
    # one chunk, dY^T's rows (wgrad) span 40 binades and cannot
    grad = (torch.randn(64, 40, generator=g) * torch.exp2(torch.tensor([-20.0, 20.0])
                                                          ).repeat_interleave(32)[:, None]
            ).to(DEVICE)
    kernels_on_cpu(monkeypatch)

    def linear(x, w):
        return quant_linear(x, w, None, lin)

    if compiled:
        torch._dynamo.reset()
        linear = torch.compile(linear, backend="aot_eager", fullgraph=True)

    def run(check_forward: bool, check_backward: bool):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with deferred_fold_check(x.device) as check:
            y = linear(x, w) if check_forward else None
            if check_backward:   # on another thread, as autograd runs CUDA backward passes
                worker = threading.Thread(target=y.backward, args=(grad,))
                worker.start()
                worker.join()
        if y is None:
            y = linear(x, w)
        if not check_backward:
            y.backward(grad)
        return check.inexact_values(), x.grad, w.grad

    n_ref, dx_ref, dw_ref = run(False, False)
    n_in, _, _ = run(True, True)
    n_after, dx, dw = run(True, False)
    assert n_ref == 0 and n_in > 0 and n_after == 0
    assert torch.equal(dx, dx_ref) and torch.equal(dw, dw_ref)


def test_column_offsets_past_int32():
    """A transposed view whose column stride times its width passes 2^31 elements (as
    quantize_fold(x.mT, ...) hands the kernels for wgrad): the offsets are 64-bit. The view
    lies in an 11 GB allocation that is never touched but where it is read."""
    if DEVICE != "cpu":
        pytest.skip("the view needs an 11 GB allocation; the CPU's is virtual")
    from lowbit.kernels import fake_quantize_triton
    from lowbit.formats import quantize_dequantize

    rows, cols, stride, offset = 16, 8, 2**29, 2**31
    try:
        base = torch.empty(offset + (cols - 1) * stride + rows + 64, dtype=torch.bfloat16)
    except RuntimeError:
        pytest.skip("no 11 GB of address space here")
    x = base.as_strided((rows, cols), (1, stride), offset)
    values = torch.arange(1, rows * cols + 1, dtype=torch.float32).reshape(rows, cols)
    for c in range(cols):
        x[:, c] = values[:, c]
        if c * stride >= 2**31:        # where a wrapped 32-bit offset would read instead
            wrapped = offset + c * stride - 2**32
            base[wrapped:wrapped + rows] = -1000.0
    spec = QuantSpec.make("mxfp4", (1, 32), "floor")
    dense = x.contiguous()
    assert_same(quantize_fold_mxfp4(x, spec), fold_operand(quantize_with_spec(dense, spec)))
    assert torch.equal(fake_quantize_triton(x, spec), quantize_dequantize(dense, spec))


def test_watch_names_the_layers_whose_exact_folds_need_k_chunks(compiled_quant_linear):
    """Exact folds (no deferred check) that need more than one K-chunk name their layer (the
    `layer` its linear was given) to watch_chunked_folds(), also from a backward on another
    thread, eagerly and under torch.compile (the custom ops carry the name); a layer whose
    operands fold in one chunk is not named, nor is an unnamed one, and nothing is noted
    outside a watch."""
    from lowbit.ops import quant_linear
    from lowbit.recipes import get_recipe

    lin = get_recipe("stable-fp4-fp8").linear
    g = torch.Generator().manual_seed(4)
    x = spread(64, 96, 4, seed=2, tile=(32, 32)).to(DEVICE)
    w_wide, w_plain = (torch.randn(40, 96, generator=g).to(DEVICE) for _ in range(2))
    # tokens 0-31 at 2^-20, 32-63 at 2^20: dY^T's rows (wgrad, along tokens) span 40 binades
    wide = (torch.randn(64, 40, generator=g) * torch.exp2(torch.tensor([-20.0, 20.0])
                                                          ).repeat_interleave(32)[:, None]
            ).to(DEVICE)
    plain = torch.randn(64, 40, generator=g).to(DEVICE)

    def step(w, grad, name, linear=quant_linear):
        w = w.clone().requires_grad_()
        y = linear(x, w, None, lin, name)
        worker = threading.Thread(target=y.backward, args=(grad,))   # as autograd's thread
        worker.start()
        worker.join()

    compiled = compiled_quant_linear
    with watch_chunked_folds() as seen:
        step(w_wide, wide, "wide")
        step(w_plain, plain, "plain")
        step(w_wide, wide, "")              # unnamed: not reported
        step(w_wide, wide, "compiled wide", compiled)
        step(w_plain, plain, "compiled plain", compiled)
    assert seen == {"wide", "compiled wide"}
    with watch_chunked_folds() as quiet:
        pass
    step(w_wide, wide, "wide")              # outside the block: noted nowhere
    step(w_wide, wide, "compiled wide", compiled)
    assert quiet == set()


@pytest.mark.parametrize("kernels_on", [False, True])
def test_transposed_operand_alone_equals_folding_the_transpose(monkeypatch, kernels_on):
    """quantize_fold(x, spec, True, rows=False) makes x^T's operand from a row-major read of x
    (what the compiled backward uses); under RNE with square tiles it is quantize_fold(x.mT),
    bit for bit: odd shapes, 30 binades (K-chunks), NaN and zero tiles, kernels and reference."""
    quantize_fold = dispatch.quantize_fold
    if kernels_on:
        kernels_on_cpu(monkeypatch)
    spec = QuantSpec.make("mxfp4", (32, 32), "rceil")
    x = spread(70, 130, 30, seed=9, tile=(32, 32))
    x[:32, 32:64] = float("nan")
    x[32:64, :32] = 0.0
    x = x.to(DEVICE)
    none, alone = quantize_fold(x, spec, True, None, rows=False)
    ref = quantize_fold(x.mT, spec, check=None)[0]
    assert none is None and len(ref.bounds) > 2
    assert torch.equal(alone.fp8.view(torch.uint8).cpu(), ref.fp8.view(torch.uint8).cpu())
    assert torch.equal(alone.factors.cpu(), ref.factors.cpu()) and alone.bounds == ref.bounds
    assert torch.equal(alone.nan_rows.cpu(), ref.nan_rows.cpu())
    with pytest.raises(ValueError, match="pass transpose_too=True too"):
        quantize_fold(x, spec, False, None, rows=False)


@pytest.mark.parametrize("kernels_on,deferred", [(False, False), (True, False), (True, True)])
def test_compiled_fp8_linear_keeps_the_forwards_transposed_folds_for_the_backward(
        monkeypatch, kernels_on, deferred, compiled_quant_linear):
    """Under torch.compile an FP8 linear's forward op returns X^T's and W^T's folded operands
    (from its one quantization of each square-tile operand, K-chunks and all, padded to fixed
    shapes) and the backward op multiplies them instead of quantizing X and W again: the output
    and both gradients equal the eager layer's bit for bit, with X spanning 30 binades along
    tokens so X^T's exact fold needs K-chunks, N = 72 not a multiple of the 32-row tile; the
    backward folds dY alone; the reference folds, and the kernels (under the interpreter on the
    CPU), exactly and under a deferred fold check (one K-chunk each, the count carried to the
    backward). The ops pass torch.library's opcheck (fake shapes; the schema check for the
    forward)."""
    from lowbit.ops import quant_linear
    from lowbit.ops.compiled import op_key
    from lowbit.recipes import get_recipe

    lin = get_recipe("stable-fp4-fp8").linear
    g = torch.Generator().manual_seed(5)
    x = spread(72, 96, 15, seed=3, tile=(32, 32)).to(DEVICE)
    w = (torch.randn(40, 96, generator=g) / 8).to(DEVICE)
    dy = torch.randn(72, 40, generator=g).to(DEVICE)

    if kernels_on:
        kernels_on_cpu(monkeypatch)

    def run(linear):
        torch.manual_seed(7)   # dY rounds stochastically: the same draws in both runs
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        with (deferred_fold_check(x.device) if deferred
              else contextlib.nullcontext()) as check:
            y = linear(xi, wi, None, lin, "l")
            y.backward(dy)
        return y.detach(), xi.grad, wi.grad, check.counter if deferred else torch.zeros(1)

    eager = run(quant_linear)
    folded = []
    real = dispatch.quantize_fold

    def counting(t, spec, transpose_too=False, check=ACTIVE, rows=True):
        out = real(t, spec, transpose_too, check, rows)
        folded.append((tuple(t.shape), transpose_too, rows, out))
        return out

    monkeypatch.setattr(dispatch, "quantize_fold", counting)
    compiled = run(compiled_quant_linear)
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
    x_t = next(out[1] for shape, t_too, _, out in folded if shape == (72, 96) and t_too)
    if deferred:   # one K-chunk each; the count of what that rounded is the eager one's
        assert len(x_t.bounds) == 2 and compiled[3].item() > 0
    else:
        assert len(x_t.bounds) > 2                # the kept X^T fold has K-chunks
    # forward: X and W with their transposes; backward: dY (rows and transposed) alone
    assert [(shape, t_too, rows) for shape, t_too, rows, _ in folded] == [
        ((72, 96), True, True), ((40, 96), True, True), ((72, 40), True, True)]

    kept = torch.ops.lowbit.quant_linear_fp8(x, w, op_key(lin), "l", True, True, True)
    torch.library.opcheck(torch.ops.lowbit.quant_linear_fp8.default,
                          (x, w, op_key(lin), "l", True, False, True),
                          test_utils=("test_schema", "test_faketensor"))
    # (its schema check compares the fp8 inputs before and after with arithmetic that torch
    # does not have for float8 on the CPU)
    torch.library.opcheck(torch.ops.lowbit.quant_linear_fp8_backward.default,
                          (dy, None, None, kept[1:], op_key(lin), "l", True, True),
                          test_utils=("test_faketensor",))


# ---- x^T with one factor per row and segment of x's rows (a grouped GEMM's wgrad operand) ----

def segmented_input(ends, cols, seed, dtype=torch.bfloat16):
    """Rows in segments ending at `ends` (multiples of 32), each segment's values at its own
    magnitude 2^(+-18 apart), so a column spans ~36 binades over all rows but at most ~8
    within one segment; the zero rows past each segment's tokens (the padded layout's)."""
    x = torch.zeros(ends[-1] + 32, cols, dtype=torch.float64)
    start = 0
    for s, end in enumerate(ends):
        tokens = max(end - start - 7, 0)   # a partial last tile: zero rows, as the layout pads
        x[start:start + tokens] = spread(tokens, cols, 4, seed=seed + s, tile=(32, 32)).double() \
            * 2.0 ** (18 * (s % 3) - 18)
        start = end
    return x.to(dtype)


def per_segment_reference(x, spec, ends):
    """Each segment's rows quantized and folded on their own (x^T's operand): what each
    expert's own fold gives."""
    refs, start = [], 0
    for end in ends:
        refs.append(fold_operand(quantize_with_spec(x[start:end].cpu(), spec), transpose=True)
                    if end > start else None)
        start = end
    return refs


@pytest.mark.parametrize("ends", [[64, 64, 160, 224], [96], [0, 32, 32, 128]])
def test_segmented_transpose_equals_each_segments_own_fold(ends):
    # the factors of every row in every segment, and the E4M3 bytes, are those of the segment
    # folded alone; the rows operand of the same call is the unsegmented one; nothing is read
    # back, and the check counts nothing although every column spans ~36 binades over all rows
    spec = QuantSpec.make("mxfp4", (32, 32), "floor")
    x = segmented_input(ends, 96, seed=len(ends)).to(DEVICE)
    seg = torch.tensor(ends, dtype=torch.int32, device=x.device)
    with no_host_reads(), deferred_fold_check(x.device) as chk:
        got = quantize_fold_mxfp4(x, spec, transpose=True, counter=chk.counter, segment_ends=seg)
        a, a_t = quantize_fold_mxfp4_with_transpose(x, spec, counter=chk.counter, segment_ends=seg)
    assert chk.inexact_values() == 0
    whole = torch.zeros(1, dtype=torch.int64, device=x.device)   # x^T with one factor a row
    quantize_fold_mxfp4(x, spec, transpose=True, path="one_chunk", counter=whole)
    spans = ends != [96]                     # every list but the one-segment one mixes magnitudes
    assert (int(whole.item()) > 0) == spans
    assert_same(a, fold_operand(quantize_with_spec(x.cpu(), spec)))
    for op in (got, a_t):
        assert op.segment_ends is seg and op.bounds == (0, x.shape[0])
        assert op.factors.shape == op.nan_rows.shape == (96, len(ends))
        assert torch.equal(op.fp8.view(torch.uint8), got.fp8.view(torch.uint8))
        start = 0
        for s, (end, ref) in enumerate(zip(ends, per_segment_reference(x, spec, ends))):
            if ref is not None:
                assert ref.bounds == (0, end - start)   # each segment folds in one chunk
                assert torch.equal(op.fp8[:, start:end].view(torch.uint8).cpu(), ref.fp8.view(torch.uint8))
                assert torch.equal(op.factors[:, s].cpu(), ref.factors[:, 0])
                assert torch.equal(op.columns(start, end).unfold().cpu(), ref.unfold())
            start = end
        assert not op.nan_rows.any()
    # the same values as the whole x^T's exact fold, which needs K-chunks
    assert (len(fold_operand(quantize_with_spec(x.cpu(), spec), transpose=True).bounds) > 2) == spans
    assert torch.equal(got.unfold().cpu(), quantize_with_spec(x.cpu(), spec).dequantize(torch.float32).t())


def test_segmented_transpose_nan_and_empty_segments_and_refusals():
    spec = QuantSpec.make("mxfp4", (32, 32), "rceil")
    ends = [32, 32, 128]
    x = segmented_input(ends, 64, seed=3)
    x[40, 5] = float("nan")          # segment 2, column 5's tile (columns 0..31)
    x = x.to(DEVICE)
    seg = torch.tensor(ends, dtype=torch.int64, device=x.device)
    op = quantize_fold_mxfp4(x, spec, transpose=True, segment_ends=seg,
                             counter=torch.zeros(1, dtype=torch.int64, device=x.device))
    nan = op.nan_rows.cpu()
    assert nan[:32, 2].all() and not nan[32:, 2].any() and not nan[:, :2].any()
    assert torch.equal(op.factors[:, 1].cpu(), torch.ones(64))   # the empty segment: factor 1
    ref = per_segment_reference(x, spec, ends)[2]
    assert torch.equal(op.columns(32, 128).nan_rows.cpu(), ref.nan_rows)
    with pytest.raises(ValueError, match="square 2D tiles"):
        quantize_fold_mxfp4(x, QuantSpec.make("mxfp4", (1, 32), "floor"), transpose=True,
                            segment_ends=seg)
    with pytest.raises(ValueError, match="pass transpose=True"):
        quantize_fold_mxfp4(x, spec, segment_ends=seg)
    # an end inside a band of 32 rows would share one factor between two segments: counted as
    # inexact (so a deferred check redoes the work), and without a counter the exact fold
    off = torch.tensor([48, 128], device=x.device)
    counter = torch.zeros(1, dtype=torch.int64, device=x.device)
    quantize_fold_mxfp4(x, spec, transpose=True, segment_ends=off, counter=counter)
    assert counter.item() > 0
    exact = quantize_fold_mxfp4(x, spec, transpose=True, segment_ends=off)
    assert exact.segment_ends is None
    torch.testing.assert_close(exact.unfold().cpu(), op.unfold().cpu(), rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        quantize_fold_mxfp4(x, spec, transpose=True, segment_ends=seg.float())
    with pytest.raises(ValueError, match="cross the end of segment"):
        op.columns(0, 64)
