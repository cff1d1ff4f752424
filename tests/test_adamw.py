"""lowbit.dispatch.AdamW (fused AdamW's state and state dict, stepped by lowbit.dispatch.adamw_step)
and the gradient clip's coefficient taken inside its step (lowbit.train.graphs.clip_gradients),
against torch's fused AdamW and torch's clip: the same training to float32 rounding."""

import copy
import math

import pytest
import torch
import torch.nn as nn

from lowbit import dispatch
from lowbit.train.distributed import Distributed
from lowbit.train.graphs import GraphedGradients, clip_gradients
from lowbit.train.step import StepConfig, TrainStep

CPU = torch.device("cpu")


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 5))


def _groups(net: nn.Module) -> list[dict]:
    return [{"params": [p for p in net.parameters() if p.dim() == 2], "weight_decay": 0.1},
            {"params": [p for p in net.parameters() if p.dim() != 2], "weight_decay": 0.0}]


def _loss(net: nn.Module, seed: int) -> torch.Tensor:
    x = torch.randn(16, 12, generator=torch.Generator().manual_seed(seed))
    return net(x).square().mean() * 50


def _steps(net, opt, steps, first=0, max_norm=None, inside=False):
    """`steps` steps, the LR changing; with max_norm, clipped in place or (inside) by the
    coefficient handed to the step. Returns each step's norm."""
    norms = []
    for i in range(first, first + steps):
        for group in opt.param_groups:
            group["lr"] = 0.01 / (i + 1)
        opt.zero_grad(set_to_none=True)
        _loss(net, i).backward()
        coef = torch.ones(()) if inside else None
        if max_norm is not None:
            norms.append(clip_gradients(list(net.parameters()), max_norm, coef))
        if inside:
            opt.grad_coef = coef
        opt.step()
        if inside:
            del opt.grad_coef
    return norms


def _close(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)   # float32 rounding, any torch


def test_lowbit_adamw_trains_as_torchs_fused_adamw_and_their_checkpoints_load_into_each_other():
    mine_net, torch_net = _net(), _net()
    mine = dispatch.AdamW(_groups(mine_net), lr=0.01, betas=(0.9, 0.95))
    theirs = torch.optim.AdamW(_groups(torch_net), lr=0.01, betas=(0.9, 0.95), fused=True)
    _steps(mine_net, mine, 4)
    _steps(torch_net, theirs, 4)
    _close(mine_net, torch_net)
    assert not torch.equal(mine_net[0].weight, _net()[0].weight)
    for p, q in zip(mine_net.parameters(), torch_net.parameters()):
        assert mine.state[p].keys() == theirs.state[q].keys()
        for key in ("step", "exp_avg", "exp_avg_sq"):
            a, b = mine.state[p][key], theirs.state[q][key]
            assert (a.dtype, a.device, a.shape) == (b.dtype, b.device, b.shape), key
        assert mine.state[p]["step"].item() == 4
    # a checkpoint of each loads into the other, and the two go on alike (copies: a loaded
    # state dict's tensors may be the very tensors of the optimizer it came from)
    mine.load_state_dict(copy.deepcopy(theirs.state_dict()))
    mine_net.load_state_dict(torch_net.state_dict())
    back = torch.optim.AdamW(_groups(torch_net), lr=0.01, betas=(0.9, 0.95), fused=True)
    back.load_state_dict(copy.deepcopy(mine.state_dict()))
    _steps(mine_net, mine, 2, first=4)
    _steps(torch_net, back, 2, first=4)
    _close(mine_net, torch_net)
    assert mine.state[next(mine_net.parameters())]["step"].item() == 6


@pytest.mark.parametrize("max_norm", [0.05, math.inf])
def test_the_clips_coefficient_inside_the_step_trains_as_clipping_in_place(max_norm):
    inside_net, place_net = _net(), _net()
    inside = dispatch.AdamW(_groups(inside_net), lr=0.01, betas=(0.9, 0.95))
    place = dispatch.AdamW(_groups(place_net), lr=0.01, betas=(0.9, 0.95))
    inside_norms = _steps(inside_net, inside, 3, max_norm=max_norm, inside=True)
    place_norms = _steps(place_net, place, 3, max_norm=max_norm)
    assert torch.equal(inside_norms[0], place_norms[0])           # one model at step 0: one norm
    torch.testing.assert_close(torch.stack(inside_norms), torch.stack(place_norms), rtol=1e-5, atol=0)
    _close(inside_net, place_net)
    # the gradients kept their unclipped values; torch's clip shrank its own
    unclipped = torch.nn.utils.get_total_norm([p.grad for p in inside_net.parameters()])
    assert torch.equal(unclipped, inside_norms[-1])
    if max_norm < math.inf:
        assert inside_norms[-1] > 10 * max_norm                      # the clip was active
        assert torch.nn.utils.get_total_norm([p.grad for p in place_net.parameters()]) <= max_norm * 1.001


def test_clip_gradients_gives_torchs_norm_and_coefficient_bit_for_bit():
    net = _net()
    _loss(net, 0).backward()
    grads = [p.grad.clone() for p in net.parameters()]
    coef = torch.full((), 7.0)
    norm = clip_gradients(list(net.parameters()), 0.05, coef)
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), grads))   # untouched
    norm_torch = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)          # in place
    assert torch.equal(norm, norm_torch)
    assert torch.equal(coef, torch.clamp(0.05 / (norm_torch + 1e-6), max=1.0)) and coef < 1
    for p, g in zip(net.parameters(), grads):                        # torch's multiply is g * coef
        assert torch.equal(p.grad, g * coef)
    clip_gradients(list(net.parameters()), math.inf, coef)
    assert coef.item() == 1.0


def test_a_train_step_hands_lowbits_adamw_the_clips_coefficient():
    config = StepConfig(batch_size=4, lr=0.01, total_steps=3, grad_clip=0.05, weight_decay=0.1)

    def loss_fn(model, batch):
        return (model(batch[0]) - batch[1]).square().mean() * 50

    batch = (torch.randn(4, 12, generator=torch.Generator().manual_seed(3)), torch.randn(4, 5))
    runs = []
    for kind in ("lowbit", "torch"):
        net = _net()
        opt = (dispatch.AdamW(_groups(net), lr=0.01, betas=config.betas) if kind == "lowbit" else
               torch.optim.AdamW(_groups(net), lr=0.01, betas=config.betas, fused=True))
        step = TrainStep(net, opt, config, Distributed(device=CPU), loss_fn=loss_fn)
        results = [step(i, batch) for i in range(3)]
        runs.append((net, opt, step, results))
    (net, opt, step, results), (torch_net, _, torch_step, torch_results) = runs
    assert step.grad_coef is not None and torch_step.grad_coef is None
    assert not hasattr(opt, "grad_coef")                             # handed for the step only
    assert results[0].grad_norm == torch_results[0].grad_norm > 0.5  # clipped: the norm is 10x max
    assert step.grad_coef.item() < 1
    _close(net, torch_net)


def test_graphed_gradients_write_the_coefficient_and_leave_the_gradients():
    # GraphedGradients' CPU form (its body at each call), as --cuda-graph runs it
    net = _net()
    batch = (torch.randn(4, 12), torch.randn(4, 5))
    coef = torch.ones(())

    def loss_fn(b):
        return (net(b[0]) - b[1]).square().mean() * 50

    graphed = GraphedGradients(net, loss_fn, batch, max_norm=0.05, grad_coef=coef)
    _, norm, _ = graphed(batch)
    grads = [p.grad.clone() for p in net.parameters()]
    assert torch.equal(torch.nn.utils.get_total_norm(grads), norm)     # not multiplied
    assert torch.equal(coef, torch.clamp(0.05 / (norm + 1e-6), max=1.0)) and coef < 1


def test_lowbit_adamw_refuses_what_it_does_not_step():
    net = _net()
    with pytest.raises(ValueError, match="betas as numbers"):
        dispatch.AdamW(net.parameters(), betas=(torch.tensor(0.9), 0.95))
    opt = dispatch.AdamW(net.parameters())
    _loss(net, 0).backward()
    opt.grad_scale = torch.ones(())
    with pytest.raises(ValueError, match="no GradScaler"):
        opt.step()
    del opt.grad_scale
    opt = dispatch.AdamW(_groups(net))
    opt.param_groups[1]["amsgrad"] = True                           # the second group's
    with pytest.raises(ValueError, match="no amsgrad"):
        opt.step()
    assert not opt.state                                            # nothing stepped, not even group 0


def test_lowbit_adamw_copies_pickles_takes_a_tensor_lr_and_loads_a_non_fused_checkpoint():
    net = _net()
    opt = dispatch.AdamW(_groups(net), lr=torch.tensor([0.01]))     # one element, 1-D: torch takes it
    _steps(net, opt, 1)
    for other in (copy.deepcopy(opt), _unpickled(opt)):
        other.step()                                                # its learning rate made anew
    # a checkpoint of torch's non-fused AdamW (the CPU's, FSDP's): the groups become fused and
    # the step counts float32 on their weights' devices, as fused AdamW keeps them
    plain_net = _net()
    plain = torch.optim.AdamW(_groups(plain_net), lr=0.01, betas=(0.9, 0.95), foreach=False)
    _steps(plain_net, plain, 2)
    mine = dispatch.AdamW(_groups(plain_net), lr=0.01, betas=(0.9, 0.95))
    mine.load_state_dict(copy.deepcopy(plain.state_dict()))
    assert all(g["fused"] for g in mine.param_groups)
    step = mine.state[next(plain_net.parameters())]["step"]
    assert step.dtype == torch.float32 and step.item() == 2
    _steps(plain_net, mine, 1, first=2)
    assert mine.state[next(plain_net.parameters())]["step"].item() == 3


def _unpickled(opt):
    """What unpickling makes of opt: a new object given opt's pickled state."""
    other = type(opt).__new__(type(opt))
    other.__setstate__(opt.__getstate__())
    return other


@pytest.mark.gpu
def test_lowbit_adamw_on_cuda_takes_the_kernel_and_trains_as_torchs_fused_adamw(monkeypatch):
    import lowbit.kernels.optimizer as kernel

    calls, real = [], kernel.adamw_step_triton
    monkeypatch.setattr(kernel, "adamw_step_triton", lambda *a, **k: (calls.append(len(a[0])), real(*a, **k)))
    mine_net, torch_net = _net().cuda(), _net().cuda()
    mine = dispatch.AdamW(_groups(mine_net), lr=0.01, betas=(0.9, 0.95))
    theirs = torch.optim.AdamW(_groups(torch_net), lr=0.01, betas=(0.9, 0.95), fused=True)
    for i in range(3):
        for net, opt, inside in ((mine_net, mine, True), (torch_net, theirs, False)):
            for group in opt.param_groups:
                group["lr"] = 0.01 / (i + 1)
            opt.zero_grad(set_to_none=True)
            net(torch.randn(16, 12, generator=torch.Generator().manual_seed(i)).cuda()).square().mean().backward()
            coef = torch.ones((), device="cuda") if inside else None
            clip_gradients(list(net.parameters()), 0.01, coef)
            opt.grad_coef = coef
            opt.step()
            del opt.grad_coef
    assert calls == [2, 2] * 3                      # one launch a param group, every step
    _close(mine_net, torch_net)
