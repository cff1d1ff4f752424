"""AdamW's step with each change times B: the Triton kernel (lowbit.kernels.optimizer) against
its reference (lowbit.formats.optimizer), bit for bit under Triton's interpreter, and the
dispatch rule that picks between them."""

import pytest
import torch

from lowbit import dispatch
from lowbit.formats.optimizer import adamw_step_scalars, adamw_step_
from lowbit.kernels import interpret_mode


def _case(shape, b_dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    p, grad = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    m, v = torch.randn(shape, generator=g) * 0.1, torch.rand(shape, generator=g) * 0.01
    if grad.numel() >= 12:
        grad.view(-1)[:7] = 0.0                                     # zero gradients
        grad.view(-1)[7:9] = torch.tensor([3e30, 1e-30])             # huge and tiny
        p.view(-1)[9] = -5e25
    if b_dtype == torch.uint8:
        b = torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)
    else:
        b = (torch.rand(shape, generator=g) * 2).to(b_dtype)
        b.view(-1)[:3] = 0.0                                        # B = 0: the weight parked
    return [t.to(device) for t in (p, grad, m, v, b)]


def _scalars(device, weight_decay, t=3):
    steps = [torch.tensor(float(t), device=device)]
    sizes, corr, decay = adamw_step_scalars(steps, torch.tensor(0.003, device=device), 0.9, 0.95, weight_decay)
    return sizes[0], corr[0], (decay if weight_decay else None)


def _sizes(scalars, n):
    """One weight's (step_size, correction) as the kernel's (n,) vectors of n weights."""
    return scalars[0].expand(n).contiguous(), scalars[1].expand(n).contiguous(), scalars[2]


@pytest.mark.parametrize("shape", [(3, 700), (1, 1), (64, 64), (5,)])
@pytest.mark.parametrize("b_dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_kernel_is_the_reference_bit_for_bit(shape, b_dtype, weight_decay):
    if not interpret_mode():
        pytest.skip("runs the kernel on CPU tensors, which it takes under Triton's interpreter only "
                    "(TRITON_INTERPRET=1, which tests/conftest.py sets on a machine without a GPU)")
    from lowbit.kernels.optimizer import adamw_step_triton

    levels = 127.0 if b_dtype == torch.uint8 else None
    ref, ker = _case(shape, b_dtype), _case(shape, b_dtype)
    ker[1].view(-1)[-1] = ref[1].view(-1)[-1] = float("nan")          # a NaN gradient
    scalars = _scalars("cpu", weight_decay)
    adamw_step_(*ref, *scalars, 0.9, 0.95, 1e-8, levels)
    adamw_step_triton(*([t] for t in ker), *_sizes(scalars, 1), 0.9, 0.95, 1e-8, levels)
    for name, a, b in zip(("p", "g", "m", "v", "b"), ref, ker):
        assert torch.equal(a.isnan(), b.isnan()), name
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), name
    assert ref[0].view(-1)[-1].isnan() and ref[0].view(-1)[:-1].isfinite().all()   # the NaN stays its own
    if ref[0].numel() == 1:
        return
    if b_dtype != torch.uint8 and ref[0].numel() >= 12:
        assert torch.equal(ref[0].view(-1)[:3], _case(shape, b_dtype)[0].view(-1)[:3])  # B = 0: p kept
    assert not torch.equal(ref[0][ref[0].isfinite()], _case(shape, b_dtype)[0][ref[0].isfinite()])


def test_one_launch_steps_weights_of_every_size_each_under_its_own_scalars():
    if not interpret_mode():
        pytest.skip("runs the kernel on CPU tensors: Triton's interpreter only")
    _one_launch_of_many_weights("cpu")


@pytest.mark.gpu
def test_one_launch_of_many_weights_on_cuda_is_the_reference_bit_for_bit():
    _one_launch_of_many_weights("cuda")


def _one_launch_of_many_weights(device):
    """The multi-weight launch: weights from one element to several blocks (and an empty one),
    each at its own step count, each its reference's bits; every weight's tensors are
    neighbouring slices of one buffer, so a block that stepped past its weight's end would
    change the next weight's first elements."""
    from lowbit.kernels import optimizer as kernel

    shapes = [(1,), (3, 700), (0, 4), (2 * kernel.BLOCK + 5,), (7, 9)]
    ref = [_case(s, torch.bfloat16, seed=i, device=device) for i, s in enumerate(shapes)]
    sizes_ = [torch.Size(s).numel() for s in shapes]
    ker = []                                         # the same values, as slices of one buffer each
    for j in range(5):
        flat = torch.cat([c[j].reshape(-1) for c in ref])
        ker.append([v.view(s) for v, s in zip(flat.split(sizes_), shapes)])
    steps = [torch.tensor(float(t), device=device) for t in (1, 3, 2, 7, 5)]
    sizes, corr, decay = adamw_step_scalars(steps, torch.tensor(0.003, device=device), 0.9, 0.95, 0.1)
    kernel.adamw_step_triton(*ker, sizes, corr, decay, 0.9, 0.95, 1e-8, None)
    for i, case in enumerate(ref):
        adamw_step_(*case, sizes[i], corr[i], decay, 0.9, 0.95, 1e-8, None)
        for name, x, y in zip(("p", "g", "m", "v", "b"), case, (ker[j][i] for j in range(5))):
            assert torch.equal(x, y), (shapes[i], name)
    assert not torch.equal(ref[3][0], _case(shapes[3], torch.bfloat16, seed=3, device=device)[0])  # past 2 blocks
    with pytest.raises(ValueError, match="contiguous"):            # the scalars a view of one
        kernel.adamw_step_triton(*ker, sizes[:1].expand(5), corr, decay, 0.9, 0.95, 1e-8, None)


def test_the_kernel_refuses_what_it_does_not_take_and_dispatch_takes_the_reference_for_it():
    if not interpret_mode():
        pytest.skip("runs the kernel on CPU tensors: Triton's interpreter only")
    from lowbit.kernels.optimizer import adamw_step_triton

    p, g, m, v, b = _case((8, 6), torch.float32)
    sizes = _sizes(_scalars("cpu", 0.1), 1)
    with pytest.raises(ValueError, match="contiguous tensors of one shape"):
        adamw_step_triton([p.t()], [g.t()], [m.t()], [v.t()], [b.t()], *sizes, 0.9, 0.95, 1e-8, None)
    with pytest.raises(ValueError, match="float32"):
        adamw_step_triton([p.double()], [g], [m], [v], [b], *sizes, 0.9, 0.95, 1e-8, None)
    with pytest.raises(ValueError, match="one B dtype"):
        adamw_step_triton([p, p.clone()], [g, g], [m, m.clone()], [v, v.clone()], [b, b.bfloat16()],
                             *_sizes(_scalars("cpu", 0.1), 2), 0.9, 0.95, 1e-8, None)
    with pytest.raises(ValueError, match="one float32 step size and correction a weight"):
        adamw_step_triton([p], [g], [m], [v], [b], *_sizes(_scalars("cpu", 0.1), 2), 0.9, 0.95, 1e-8, None)


def test_dispatch_steps_cpu_weights_on_the_reference_and_counts_the_step():
    p, g, m, v, b = _case((4, 33), torch.bfloat16)
    want = [t.clone() for t in (p, g, m, v, b)]
    step = torch.tensor(2.0)
    dispatch.adamw_step([p.t()], [g.t()], [m.t()], [v.t()], [step], [b.t()], torch.tensor(0.003),
                                0.9, 0.95, 1e-8, 0.1, None)          # non-contiguous views, in place
    adamw_step_(*want, *_scalars("cpu", 0.1, t=3), 0.9, 0.95, 1e-8, None)
    assert step.item() == 3
    for a, w in zip((p, m, v), (want[0], want[2], want[3])):
        assert torch.equal(a, w)


@pytest.mark.gpu
@pytest.mark.parametrize("b_dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_the_kernel_on_cuda_is_the_reference_bit_for_bit(b_dtype, monkeypatch):
    import lowbit.kernels.optimizer as kernel
    real = kernel.adamw_step_triton
    # compiled with multiply-add fusion off, IEEE divisions and square root: the reference's
    # bits (with fusion on, 13 of 264,967 elements once differed by up to 1.6e-5 relative)
    levels = 127.0 if b_dtype == torch.uint8 else None
    ref, ker = _case((257, 1031), b_dtype, device="cuda"), _case((257, 1031), b_dtype, device="cuda")
    scalars = _scalars("cuda", 0.1)
    adamw_step_(*ref, *scalars, 0.9, 0.95, 1e-8, levels)
    steps = [torch.tensor(2.0, device="cuda")]
    calls = []
    monkeypatch.setattr(kernel, "adamw_step_triton", lambda *a, **k: (calls.append(1), real(*a, **k)))
    dispatch.adamw_step([ker[0]], [ker[1]], [ker[2]], [ker[3]], steps, [ker[4]],
                                torch.tensor(0.003, device="cuda"), 0.9, 0.95, 1e-8, 0.1, levels)
    assert calls == [1]
    for name, a, b in zip(("p", "g", "m", "v"), ref[:4], ker[:4]):
        assert torch.equal(a, b), (name, (a - b).abs().max().item())


def test_dispatch_hands_a_weight_to_the_kernel_when_the_rule_says_so(monkeypatch):
    # the dispatch -> kernel branch, with CPU tensors under Triton's interpreter: the same bits
    # as the reference, the step counted once
    if not interpret_mode():
        pytest.skip("runs the kernel on CPU tensors: Triton's interpreter only")
    import lowbit.kernels.optimizer as kernel
    calls, real = [], kernel.adamw_step_triton
    monkeypatch.setattr(kernel, "adamw_step_triton", lambda *a, **k: (calls.append(len(a[0])), real(*a, **k)))
    monkeypatch.setattr("lowbit.dispatch.optimizer.kernel_runs_on", lambda p, scalars: True)
    monkeypatch.setattr("lowbit.dispatch.optimizer.state_applies", lambda tensors: tensors[3].dtype != torch.float32)
    monkeypatch.setattr("lowbit.dispatch.optimizer._STATE_RULES", {})   # no answer kept from another test
    # three uint8 weights (one launch), a bfloat16 one (another) and a float32 one the rule
    # sends to the reference
    dtypes = [torch.uint8, torch.bfloat16, torch.uint8, torch.float32, torch.uint8]
    got = [_case((5, 30 + i), d, seed=i) for i, d in enumerate(dtypes)]
    want = [_case((5, 30 + i), d, seed=i) for i, d in enumerate(dtypes)]
    steps = [torch.tensor(2.0 + i) for i in range(5)]
    dispatch.adamw_step(*([c[j] for c in got] for j in range(4)), steps, [c[4] for c in got],
                                torch.tensor(0.003), 0.9, 0.95, 1e-8, 0.1, 127.0)
    for i, case in enumerate(want):                      # the call's levels divide every B's change
        adamw_step_(*case, *_scalars("cpu", 0.1, t=3 + i), 0.9, 0.95, 1e-8, 127.0)
    assert sorted(calls) == [1, 3] and [s.item() for s in steps] == [3, 4, 5, 6, 7]
    for a, w in zip(got, want):
        for x, y in zip(a, w):
            assert torch.equal(x, y)
    p, _, m, v, b = got[0]
    # a second step with new gradients (the table's column written each step), a bfloat16 B
    # swapped for a float32 one (new addresses: the rule asked again, the weight to the reference)
    got, want = [list(c) for c in got], [list(c) for c in want]
    for c, w in zip(got, want):
        c[1] = torch.randn_like(c[1])
        w[1] = c[1].clone()
    got[2][2] = got[2][2].clone()   # a kernel weight's moment moved: its row of the table rebuilt
    got[1][4], want[1][4] = got[1][4].float(), want[1][4].float()
    calls.clear()
    dispatch.adamw_step(*([c[j] for c in got] for j in range(4)), steps, [c[4] for c in got],
                                torch.tensor(0.003), 0.9, 0.95, 1e-8, 0.1, 127.0)
    for i, case in enumerate(want):
        adamw_step_(*case, *_scalars("cpu", 0.1, t=4 + i), 0.9, 0.95, 1e-8, 127.0)
    assert calls == [3]
    for a, w in zip(got, want):
        for x, y in zip(a, w):
            assert torch.equal(x, y)
    with pytest.raises(ValueError, match="one of each per weight"):
        dispatch.adamw_step([p], [], [m], [v], [steps[0]], [b], torch.tensor(0.003),
                                    0.9, 0.95, 1e-8, 0.1, 127.0)


def test_the_rule_for_a_weight_refuses_what_the_kernel_would():
    # kernel_applies checks everything adamw_step_triton checks of a weight, since the
    # weights it passes are not checked again: each defect alone sends the weight away
    from lowbit.dispatch.optimizer import kernel_applies
    p, g, m, v, b = _case((6, 40), torch.bfloat16)
    assert kernel_applies((p, g, m, v, b))
    assert kernel_applies((p, g, m, v, b.to(torch.uint8))) and kernel_applies((p, g, m, v, b.float()))
    for i, bad in [(0, p.double()), (1, g.half()), (2, m.double()), (3, v.half()), (4, b.to(torch.int8)),
                   (1, g[:, :39]), (4, b[:5]), (0, p.t().contiguous().t()), (2, m.t().contiguous().t()),
                   (4, b.t().contiguous().t()), (1, torch.empty(6, 80)[:, ::2].copy_(g))]:
        tensors = [p, g, m, v, b]
        tensors[i] = bad
        assert not kernel_applies(tuple(tensors)), (i, bad.dtype, tuple(bad.shape), bad.stride())


def _no_b_case(shape, seed=0, device="cpu"):
    p, g, m, v, _ = _case(shape, torch.float32, seed, device)
    return [p, g, m, v]


@pytest.mark.parametrize("shape", [(3, 700), (1, 1), (5,)])
@pytest.mark.parametrize("coef", [None, 0.37, 0.0])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_kernel_without_b_and_with_the_clips_coefficient_is_the_reference_bit_for_bit(shape, coef, weight_decay):
    # plain AdamW (no B) and the gradient clip's coefficient taken inside the step: the
    # reference's bits, the stored gradient left as it was (the coefficient applies in registers)
    if not interpret_mode():
        pytest.skip("runs the kernel on CPU tensors, which it takes under Triton's interpreter only "
                    "(TRITON_INTERPRET=1, which tests/conftest.py sets on a machine without a GPU)")
    from lowbit.kernels.optimizer import adamw_step_triton

    ref, ker = _no_b_case(shape), _no_b_case(shape)
    ker[1].view(-1)[-1] = ref[1].view(-1)[-1] = float("nan")          # a NaN gradient
    grad_before = ker[1].clone()
    scalars = _scalars("cpu", weight_decay)
    c = None if coef is None else torch.tensor(coef)
    adamw_step_(*ref, None, *scalars, 0.9, 0.95, 1e-8, None, c)
    adamw_step_triton(*([t] for t in ker), None, *_sizes(scalars, 1), 0.9, 0.95, 1e-8, None, grad_coef=c)
    for name, a, b in zip(("p", "g", "m", "v"), ref, ker):
        assert torch.equal(a.isnan(), b.isnan()), name
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), name
    assert torch.equal(torch.nan_to_num(ker[1]), torch.nan_to_num(grad_before))
    # the coefficient is the clip's multiply: the same bits as clipping the gradient first
    clipped = _no_b_case(shape)
    clipped[1].view(-1)[-1] = float("nan")
    if c is not None:
        clipped[1].mul_(c)
    adamw_step_(*clipped, None, *scalars, 0.9, 0.95, 1e-8, None)
    for a, b in zip(ref, clipped):
        if a is not ref[1]:
            assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_plain_adamw_agrees_with_torchs_to_float32_rounding(weight_decay):
    # an independent implementation: torch.optim.AdamW, three steps on a clipped gradient
    torch.manual_seed(0)
    p = torch.randn(40, 33)
    mine, theirs = p.clone(), torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([theirs], lr=0.003, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay,
                            foreach=False)
    m, v, step = torch.zeros_like(p), torch.zeros_like(p), torch.tensor(0.0)
    for _ in range(3):
        g = torch.randn_like(p)
        coef = torch.tensor(0.25)
        theirs.grad = g * coef
        opt.step()
        dispatch.adamw_step([mine], [g], [m], [v], [step], None, torch.tensor(0.003), 0.9, 0.95, 1e-8,
                            weight_decay, None, grad_coef=coef)
    assert step.item() == 3 and not torch.equal(mine, p)
    torch.testing.assert_close(mine, theirs.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(m, opt.state[theirs]["exp_avg"], rtol=1e-5, atol=1e-8)   # lerp cancels
    torch.testing.assert_close(v, opt.state[theirs]["exp_avg_sq"], rtol=1e-5, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("coef", [None, 0.37])
def test_the_kernel_without_b_on_cuda_is_the_reference_bit_for_bit(coef):
    ref, ker = _no_b_case((257, 1031), device="cuda"), _no_b_case((257, 1031), device="cuda")
    c = None if coef is None else torch.tensor(coef, device="cuda")
    adamw_step_(*ref, None, *_scalars("cuda", 0.1), 0.9, 0.95, 1e-8, None, c)
    dispatch.adamw_step([ker[0]], [ker[1]], [ker[2]], [ker[3]], [torch.tensor(2.0, device="cuda")], None,
                        torch.tensor(0.003, device="cuda"), 0.9, 0.95, 1e-8, 0.1, None, grad_coef=c)
    for name, a, b in zip(("p", "g", "m", "v"), ref, ker):
        assert torch.equal(a, b), (name, (a - b).abs().max().item())
