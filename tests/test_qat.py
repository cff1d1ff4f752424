"""lowbit.qat: the forward quantizers, the estimators' gradients, JacQuant's fit, prepare ->
convert -> save/load bit for bit, GPTQ against RTN, and `lowbit qat`."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from lowbit.formats import quantize, save_qtensors
from lowbit.qat import (GroupQuantizer, JacQuantConfig, QATConfig, convert, fake_quantize, gptq, jacquant_metrics,
                        load_packed, packed_weights, parse_qat_spec, qat_weight_format, prepare,
                        refresh, refresh_hook)
from lowbit.qat.jacquant import fit_b
from lowbit.qat.layers import scale_updates

FORMATS = ["int2:g32", "int3:g32", "int4:g16", "int4:g16:asym", "int2:g32:asym", "int3:row:asym",
           "int8:g32:asym", "int8:row", "ternary:g32", "ternary:row", "binary:g32", "seq2:g32",
           "seq2:row", "nvfp4", "mxfp4"]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 32)
        self.b = nn.Linear(32, 64)
        self.lm_head = nn.Linear(64, 8)

    def forward(self, x, targets=None):
        return self.lm_head(torch.relu(self.b(torch.relu(self.a(x)))))


@pytest.mark.parametrize("weights", FORMATS)
@pytest.mark.parametrize("estimator", ["ste", "clipped-ste", "jacquant", "jacquant/group/grad", "lsq"])
@pytest.mark.parametrize("scale_init", ["absmax", "mse"])
def test_prepare_train_convert_save_load_is_bit_exact(weights, estimator, scale_init, tmp_path):
    data_scaled = weights in ("nvfp4", "mxfp4")
    if estimator == "lsq" and data_scaled:
        with pytest.raises(ValueError, match="no step size to learn"):
            QATConfig(weights=weights, estimator=estimator)
        return
    if scale_init == "mse" and data_scaled:
        with pytest.raises(ValueError, match="own scale rule"):
            QATConfig(weights=weights, scale_init="mse")
        return
    torch.manual_seed(0)
    net = Net()
    # through the setting string: jacquant's defaults (B per element on the update) and the
    # form with one B per group on the gradient
    config = parse_qat_spec(f"{weights}/{estimator}" + ("/mse" if scale_init == "mse" else ""))
    report = prepare(net, config)
    assert [n for n, _, _ in report.prepared] == ["a.weight", "b.weight"]   # lm_head kept
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    hook = refresh_hook(net, config, seed=0)      # as lowbit.train's loop calls it (jacquant only)
    if hook is not None:
        hook.attach(opt)
    x = torch.randn(8, 64)
    for step in range(1, 4):
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if hook is not None:
            hook(step)
    net.eval()
    expected = net(x)
    assert convert(net) == 2
    assert torch.equal(net(x), expected)
    path = tmp_path / "w.safetensors"
    save_qtensors(path, packed_weights(net))
    fresh = Net()
    fresh.load_state_dict({k: v for k, v in net.state_dict().items() if "parametrizations" not in k},
                          strict=False)
    assert load_packed(fresh, path) == 2
    assert torch.equal(fresh(x), expected)


def test_grid_values_match_the_formats_reference():
    w = torch.randn(16, 64)
    for name in ["int2:g32", "int4:g32:asym", "seq2:g32", "ternary:g32", "binary:g32"]:
        fmt = qat_weight_format(name)
        q = GroupQuantizer(fmt, w.shape)
        scales, zeros = q.init_scales(w)
        # absmax init: the QAT forward is exactly lowbit.formats' quantizer
        ref = quantize(w, fmt.format_name, block=(1, 32)).dequantize()
        assert torch.equal(q.dequantize(w, scales, zeros), ref), name


def test_mse_scales_are_the_best_clipping_ratio_per_group():
    from lowbit.qat.quantizer import MSE_RATIOS

    torch.manual_seed(0)
    w = torch.randn(6, 64)
    w[0, 5] = 12.0                                        # an outlier
    q = GroupQuantizer(qat_weight_format("int3:g32"), w.shape)
    absmax, _ = q.init_scales(w, "absmax")
    mse, _ = q.init_scales(w, "mse")
    groups = w.view(6, 2, 32)
    torch.testing.assert_close(absmax, groups.abs().amax(-1) / 3)   # int3: levels -3..3
    for row in range(6):
        for g in range(2):
            x, s = groups[row, g], absmax[row, g]
            errors = [float(((torch.clamp(torch.round(x / (s * r)), -3, 3) * s * r - x) ** 2).sum())
                      for r in MSE_RATIOS]
            best = MSE_RATIOS[errors.index(min(errors))]
            torch.testing.assert_close(mse[row, g], s * best)
    assert (mse < absmax).any() and (mse <= absmax).all()   # 1.0 is among the ratios


def test_seq2_and_asymmetric_grids():
    x = torch.tensor([[0.0, -0.0, 1.0, -1.0, 1.5, 3.0, -3.0, 0.1]])
    assert quantize(x, "seq2", block=(1, 8)).dequantize().tolist() == [[1, -1, 1, -1, 1, 3, -3, 1]]
    y = torch.tensor([[-1.0, 0.0, 2.0, 0.5] + [0.0] * 4, [float("nan")] + [1.0] * 7])
    q = quantize(y, "int2_asym", block=(1, 8))
    d = q.dequantize()
    assert torch.isnan(d[1]).all()                              # a NaN block stays NaN
    assert d[0, 1] == 0 and d[0, 0] == -1 and d[0, 2] == 2   # 0 is on the grid
    big = torch.tensor([[3e38, -3e38] + [0.0] * 6])
    assert torch.isfinite(quantize(big, "int4_asym", block=(1, 8)).dequantize()).all()


def test_ste_clipped_ste_and_lsq_gradients():
    w = torch.tensor([[0.2, 0.9, 2.5, -3.0] * 8])
    q = GroupQuantizer(qat_weight_format("int3:g32"), w.shape)
    s = torch.full((1, 1), 0.5)
    g = torch.randn_like(w)
    for estimator, expect in [("ste", g), ("clipped-ste", torch.where((w / 0.5).abs() <= 3, g, 0.0))]:
        wv = w.clone().requires_grad_()
        fake_quantize(wv, s, None, None, q, estimator).backward(g)
        assert torch.equal(wv.grad, expect)
    wv, sv = w.clone().requires_grad_(), s.clone().requires_grad_()
    fake_quantize(wv, sv, None, None, q, "lsq", learn=True).backward(g)
    data = w / 0.5
    v = torch.clamp(torch.round(data), -3, 3)
    dq_ds = torch.where(data.abs() <= 3, v - data, v)
    expected = (g * dq_ds).sum() / math.sqrt(32 * 3)           # LSQ: g = 1 / sqrt(N * Qp)
    assert torch.allclose(sv.grad, expected.reshape(1, 1), rtol=1e-5)


def test_dither_full_width_is_clipped_ste_and_b_stays_in_range():
    torch.manual_seed(0)
    w = torch.randn(4, 64)
    q = GroupQuantizer(qat_weight_format("int2:g32"), w.shape)
    s = torch.full((4, 2), 0.4)
    per_elem = JacQuantConfig(estimate="dither", eps=0.5, per_element=True, weighted=False)
    b = fit_b(w, q, s, None, per_elem, None, torch.Generator().manual_seed(0))
    inside = (w / 0.4).abs() < 1 - 1e-6       # the grid -1, 0, 1: range [-s, s]
    outside = (w / 0.4).abs() > 1 + 1e-6
    assert torch.allclose(b[inside], torch.ones(()), atol=1e-5)   # one step between the ends
    assert torch.equal(b[outside], torch.zeros_like(b[outside]))
    net = Net()
    prepare(net, QATConfig(weights="int2:g32", estimator="jacquant",
                           jacquant=JacQuantConfig(eps=0.1, b_max=1.5, per_element=False)))
    refresh(net, 0, 1)
    for m in (net.a, net.b):
        fq = m.parametrizations.weight[0]
        assert fq.b.shape == fq.scales.shape                     # one value per group
        assert fq.b.min() >= 0 and fq.b.max() <= 1.5


def test_probe_recovers_an_identity_and_a_saturated_jacobian():
    # a very fine grid acts as the identity (B = 1); far past saturation B = 0
    w = torch.randn(4, 64) * 0.01
    q = GroupQuantizer(qat_weight_format("int8:g32"), w.shape)
    s = torch.full((4, 2), 1e-3)
    cfg = JacQuantConfig(estimate="probe", eps=2.0, samples=4, weighted=False, per_element=False)
    b = fit_b(w, q, s, None, cfg, None, torch.Generator().manual_seed(0))
    assert torch.allclose(b, torch.ones_like(b), atol=0.05)
    far = torch.full((4, 64), 10.0)
    b = fit_b(far, q, torch.full((4, 2), 1e-3), None, cfg, None, torch.Generator().manual_seed(0))
    assert torch.equal(b, torch.zeros_like(b))


def test_input_moments_weigh_a_groups_weights_and_cancel_per_element():
    torch.manual_seed(0)
    w = torch.randn(4, 64)
    q = GroupQuantizer(qat_weight_format("int2:g32"), w.shape)
    s = torch.full((4, 2), 0.4)
    moments = torch.rand(64) * 10 + 0.01                  # per input channel
    fits = {}
    for per_element in (True, False):
        for weighted in (True, False):
            cfg = JacQuantConfig(estimate="both", eps=0.25, per_element=per_element, weighted=weighted)
            fits[per_element, weighted] = fit_b(w, q, s, None, cfg, moments, torch.Generator().manual_seed(0))
    torch.testing.assert_close(fits[True, True], fits[True, False])      # d_i / d_i
    assert (fits[False, True] - fits[False, False]).abs().max() > 0.05    # a weighted group mean
    # by hand, dither alone over one group: sum_i d_i J_i / sum_i d_i
    cfg = JacQuantConfig(estimate="dither", eps=0.25, per_element=False)
    jac = fit_b(w, q, s, None, JacQuantConfig(estimate="dither", eps=0.25, weighted=False),
                None, torch.Generator())                               # per element, J_i
    by_hand = (jac[0, :32] * moments[:32]).sum() / moments[:32].sum()
    torch.testing.assert_close(fit_b(w, q, s, None, cfg, moments, torch.Generator())[0, 0], by_hand)
    # so only a per-group B keeps (and records) the moments
    for per_element, kept in ((True, False), (False, True)):
        net = Net()
        prepare(net, QATConfig(weights="int2:g32", estimator="jacquant",
                               jacquant=JacQuantConfig(per_element=per_element)))
        assert (net.a.parametrizations.weight[0].moments is not None) == kept


def test_b_is_refit_after_steps_1_1_plus_k_and_only_those_steps_record_moments():
    torch.manual_seed(0)
    net = Net()
    cfg = QATConfig(weights="int2:g32", estimator="jacquant",
                    jacquant=JacQuantConfig(per_element=False, refresh_every=4))
    prepare(net, cfg)
    fq = net.a.parametrizations.weight[0]
    hook = refresh_hook(net, cfg, seed=0)
    hook.attach(torch.optim.SGD(net.parameters(), lr=0.0))
    refits, recorded = [], []
    for step in range(1, 11):
        before = fq.moments.clone()
        net(torch.randn(8, 64) * step)                  # the training step's forward
        recorded.append(not torch.equal(before, fq.moments))
        if hook(step) is not None:
            refits.append(step)
    assert refits == [1, 5, 9] and int(fq.refreshes) == 3
    assert recorded == [s in (1, 5, 9) for s in range(1, 11)]   # only the forward of each refit's step


def test_b_on_the_update_scales_each_step_and_keeps_the_ste_backward():
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    cfg = QATConfig(weights="int2:g32", estimator="jacquant",
                    jacquant=JacQuantConfig(b_on="update", per_element=True, refresh_every=1))
    ste = QATConfig(weights="int2:g32", estimator="ste")
    nets = []
    for config in (cfg, ste):
        torch.manual_seed(1)
        net = Net()
        prepare(net, config)
        nets.append(net)
    upd, plain = nets
    hook = refresh_hook(upd, cfg, seed=0)
    opt = torch.optim.SGD(upd.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"hook.attach\(optimizer\)"):
        hook(1)                                    # unattached, B would silently not act
    hook.attach(opt)
    hook(1)                                        # the first refit: B from the weights
    fq = upd.a.parametrizations.weight[0]
    b = fq.b.clone()
    assert 0 < (b == 0).float().mean() < 1         # some weights get no step, some do
    grads = []
    for net in nets:
        net.lm_head(torch.relu(net.b(torch.relu(net.a(x))))).square().sum().backward()
        grads.append(net.a.parametrizations.weight.original.grad.clone())
    assert torch.equal(grads[0], grads[1])         # the backward is the STE's
    latent = upd.a.parametrizations.weight.original
    before = latent.detach().clone()
    opt.step()                                     # SGD's step, -0.1 * grad, scaled by B
    assert torch.allclose(latent.detach() - before, b * (-0.1 * grads[0]), atol=1e-6)
    assert hook.scaling.before is None             # the copy lived only for the step
    assert not any(k.endswith(".prev") for k in upd.state_dict())   # nothing weight-sized kept


def test_per_group_b_on_the_gradient_under_sgd_scales_each_groups_step():
    # the arm the sceptic asks for beside B on the update: B on the gradient, one per group,
    # under SGD (lowbit qat --optimizer sgd), where each weight's step is -lr * B * dL/dW_hat
    # (AdamW would divide B out again); with momentum 0, the first step shows it
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    cfg = QATConfig(weights="int2:g32", estimator="jacquant",
                    jacquant=JacQuantConfig(b_on="grad", per_element=False, refresh_every=1))
    nets = []
    for config in (cfg, QATConfig(weights="int2:g32", estimator="ste")):
        torch.manual_seed(1)
        net = Net()
        prepare(net, config)
        nets.append(net)
    hook = refresh_hook(nets[0], cfg, seed=0)
    hook(1)                                        # the first refit: B from the weights
    fq = nets[0].a.parametrizations.weight[0]
    b = fq.b.repeat_interleave(32, dim=-1).reshape(32, 64)     # one B per group of 32
    assert fq.b.numel() == 32 * 64 // 32 and 0 < b.min() < b.max()
    steps = []
    for net in nets:
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.0)
        net(x).square().sum().backward()
        latent = net.a.parametrizations.weight.original
        before = latent.detach().clone()
        opt.step()
        steps.append(latent.detach() - before)
    torch.testing.assert_close(steps[0], b * steps[1], atol=1e-6, rtol=1e-5)
    # lowbit qat --optimizer sgd: each run's TrainConfig carries it, and a bad momentum is
    # refused before anything trains
    from lowbit.qat.run import QATJob, run_config
    from lowbit.train.config import TrainConfig
    job = QATJob(configs=[cfg], optimizer="sgd", momentum=0.5)
    run = run_config(TrainConfig(), 0, job, "x")
    assert (run.optimizer, run.momentum, run.compile) == ("sgd", 0.5, False)
    assert run_config(TrainConfig(), 0, QATJob(configs=[cfg], compile=True), "x").compile   # --compile
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\)"):
        QATJob(configs=[cfg], optimizer="sgd", momentum=1.5)


def test_b_on_the_update_keeps_no_copy_of_the_weights_and_bf16_b_halves_b():
    def persistent_bytes(jq):
        torch.manual_seed(1)
        net = Net()
        prepare(net, QATConfig(weights="int2:g32", estimator="jacquant", jacquant=jq))
        return sum(b.numel() * b.element_size() for n, b in net.named_buffers() if n.endswith(".b"))
    weights = (64 * 32 + 32 * 64) * 4                        # a and b, float32
    assert persistent_bytes(JacQuantConfig()) == weights     # B per element, float32
    assert persistent_bytes(JacQuantConfig(b_dtype="bfloat16")) == weights // 2
    assert persistent_bytes(JacQuantConfig(b_dtype="uint8")) == weights // 4
    torch.manual_seed(1)
    net = Net()
    prepare(net, QATConfig(weights="int2:g32", estimator="jacquant"))
    weight_sized = [n for n, b in net.named_buffers() if b.numel() >= 32 * 64]
    assert sorted(weight_sized) == ["a.parametrizations.weight.0.b", "b.parametrizations.weight.0.b"]
    with pytest.raises(ValueError, match="would stop moving"):
        JacQuantConfig(b_dtype="bfloat16", ema=0.9)
    hook = refresh_hook(net, QATConfig(weights="int2:g32", estimator="jacquant"), seed=0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    hook.attach(opt)
    with pytest.raises(ValueError, match="attached to an optimizer already"):
        hook.attach(opt)


def test_bf16_and_uint8_b_are_the_float32_fit_rounded_and_train_alike():
    runs = {}
    for dtype in ("float32", "bfloat16", "uint8"):
        torch.manual_seed(1)
        net = Net()
        cfg = QATConfig(weights="int2:g32", estimator="jacquant",
                        jacquant=JacQuantConfig(refresh_every=2, b_dtype=dtype))
        prepare(net, cfg)
        opt = torch.optim.AdamW(net.parameters(), lr=0.01)
        hook = refresh_hook(net, cfg, seed=0)
        hook.attach(opt)
        fq = net.a.parametrizations.weight[0]
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
        first_b = first_loss = None
        for step in range(1, 9):
            loss = net(x).square().mean()
            first_loss = loss.item() if first_loss is None else first_loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            hook(step)
            first_b = fq.b.clone() if first_b is None else first_b
        assert fq.b.dtype == getattr(torch, dtype)
        runs[dtype] = (first_loss, loss.item(), first_b)
    (first, l32, b32), (_, l16, b16), (_, l8, b8) = runs["float32"], runs["bfloat16"], runs["uint8"]
    assert torch.equal(b16, b32.to(torch.bfloat16))         # the first fit, rounded once
    # uint8: the nearest level k / 127 (b_max 2.0: B = 1 is level 127, 2.0 level 254)
    assert torch.equal(b8, torch.round(b32 * 127).to(torch.uint8))
    assert int(b8.min()) < 127 < int(b8.max()) <= 254      # B spread both ways from 1
    # int2 codes flip on tiny differences, so the curves part after a few steps; all learn
    assert l32 < 0.15 * first and l16 < 0.15 * first and l8 < 0.15 * first


def test_a_uint8_b_decodes_to_its_levels_scales_updates_and_reports_its_values():
    torch.manual_seed(1)
    net = Net()
    cfg = QATConfig(weights="int2:g32", estimator="jacquant", jacquant=JacQuantConfig(b_dtype="uint8"))
    prepare(net, cfg)
    fq = net.a.parametrizations.weight[0]
    assert fq.b.dtype == torch.uint8 and torch.equal(fq.b_values(), torch.ones(fq.b.shape))  # B = 1: level 127
    levels = torch.randint(0, 255, fq.b.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    fq.b.copy_(levels)
    values = levels.float() / 127
    assert torch.equal(fq.b_values(), values)
    latent = net.a.parametrizations.weight.original
    before = latent.detach().clone()
    with torch.no_grad():
        latent.add_(0.01)
    fq.scale_update(latent, before)                          # W_before + B * (W - W_before)
    torch.testing.assert_close(latent.detach(), before + values * 0.01, rtol=0, atol=1e-6)
    # the optimizer's hook takes every such weight at once: times the level, then / 127
    with torch.no_grad():
        latent.copy_(before + 0.01)
    scale_updates([(latent, fq)], [before])
    torch.testing.assert_close(latent.detach(), before + values * 0.01, rtol=0, atol=1e-6)
    stats = jacquant_metrics(net)
    assert stats["b/a.weight/mean"] == pytest.approx(values.mean().item(), rel=1e-6)
    other = net.b.parametrizations.weight[0].b_values()                 # still B = 1
    assert stats["b/mean"] == pytest.approx((values.sum() + other.sum()).item() / (values.numel() + other.numel()))
    for bad, says in ((dict(b_dtype="uint8", b_on="grad"), "acts on the update only"),
                      (dict(b_dtype="uint8", ema=0.9), "uint8 B with --b-ema 0.9 would stop moving")):
        with pytest.raises(ValueError, match=says):
            JacQuantConfig(**bad)
    assert parse_qat_spec("int2:g64/jacquant/u8b").jacquant.b_dtype == "uint8"


def test_a_checkpoint_holding_the_old_weight_copy_still_loads():
    cfg = QATConfig(weights="int2:g32", estimator="jacquant")
    torch.manual_seed(1)
    net = Net()
    prepare(net, cfg)
    state = net.state_dict()
    old = dict(state, **{"a.parametrizations.weight.0.prev": state["a.parametrizations.weight.original"]})
    torch.manual_seed(2)
    fresh = Net()
    prepare(fresh, cfg)
    fresh.load_state_dict(old)                               # strict: "prev" is dropped, not refused
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in state.items())


def test_b_on_the_update_in_multi_tensor_passes_is_the_one_weight_update_bit_for_bit():
    from lowbit.qat.layers import fake_quantizers, scale_updates

    cfg = QATConfig(weights="int2:g32", estimator="jacquant")     # B per element on the update
    nets, befores = [], []
    for _ in range(2):
        torch.manual_seed(1)
        net = Net()
        prepare(net, cfg)
        refresh(net, 0, 1)
        opt = torch.optim.AdamW(net.parameters(), lr=0.05)
        befores.append([fq_w.detach().clone() for fq_w in
                        (m.parametrizations[p].original for _, m, p, _ in fake_quantizers(net))])
        net(torch.randn(8, 64, generator=torch.Generator().manual_seed(2))).square().sum().backward()
        opt.step()
        nets.append(net)
    pairs = [[(m.parametrizations[p].original, fq) for _, m, p, fq in fake_quantizers(net)] for net in nets]
    scale_updates(pairs[0], befores[0])
    for (weight, fq), before in zip(pairs[1], befores[1]):
        fq.scale_update(weight, before)
    for (w0, fq0), (w1, fq1), before in zip(*pairs, befores[0]):
        assert torch.equal(w0, w1)
        assert not torch.equal(fq0.b, torch.ones_like(fq0.b))          # B did something
        assert not torch.equal(w0, before)


class _AnyOptimizerAdamW(torch.optim.AdamW):
    """AdamW as any other optimizer: UpdateScaling's general way (a copy, then three passes)."""


def _b_on_update_runs(b_dtype: str, device: str, steps: int = 5):
    """The same JacQuant (B on the update) run under torch's AdamW (B inside the step,
    lowbit.dispatch.adamw_step) and under an AdamW subclass (the general way): both models, both
    optimizers, after `steps` steps with the learning rate changing and B refit in between."""
    cfg = QATConfig(weights="int2:g32", estimator="jacquant",
                    jacquant=JacQuantConfig(refresh_every=2, b_dtype=b_dtype))
    out = []
    for kind in (torch.optim.AdamW, _AnyOptimizerAdamW):
        torch.manual_seed(1)
        net = Net().to(device)
        prepare(net, cfg)
        hook = refresh_hook(net, cfg, seed=0)
        decay = [p for n, p in net.named_parameters() if p.dim() == 2]
        rest = [p for n, p in net.named_parameters() if p.dim() != 2]
        opt = kind([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                   lr=0.02, betas=(0.9, 0.95), fused=device == "cuda")
        hook.attach(opt)
        gen = torch.Generator().manual_seed(2)
        for step in range(1, steps + 1):
            for group in opt.param_groups:
                group["lr"] = 0.02 / step
            net(torch.randn(8, 64, generator=gen).to(device)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            hook(step)
        out.append((net, opt, hook))
    return out


@pytest.mark.parametrize("b_dtype", ["float32", "bfloat16", "uint8"])
def test_b_inside_adamws_step_is_the_copy_and_scale_way(b_dtype, monkeypatch):
    """UpdateScaling under torch.optim.AdamW takes the prepared weights' step itself, B inside
    it (no copy of the weights; each step's calls counted, so a step that silently goes the
    general way fails here); it trains as the general way does to float32 rounding, on
    AdamW's own state, and a checkpoint of one loads into the other."""
    import lowbit.dispatch.optimizer as dispatch_optimizer
    calls, real = [], dispatch_optimizer.adamw_step_
    monkeypatch.setattr(dispatch_optimizer, "adamw_step_", lambda *a: (calls.append(a[0].shape), real(*a)))
    (fused_net, fused_opt, fused_hook), (net, opt, hook) = _b_on_update_runs(b_dtype, "cpu")
    assert calls == [(32, 64), (64, 32)] * 5                    # a and b, each of five steps
    assert fused_hook.scaling.inside and not hook.scaling.inside
    assert len(fused_hook.scaling.fused) == 2 and not fused_hook.scaling.pairs       # a and b
    assert not hook.scaling.fused and len(hook.scaling.pairs) == 2
    for (name, p), q in zip(fused_net.named_parameters(), net.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(fused_opt.state[p][key], opt.state[q][key], rtol=1e-5, atol=1e-7)
    assert fused_hook.scaling.before is None and fused_hook.scaling.grads == []
    b = fused_net.a.parametrizations.weight[0].b
    assert b.float().std() > 0                       # refit: B varies across the weights
    # the option `around` (--no-b-in-adamw): torch's AdamW, the general way, its flag spelled back
    from lowbit.qat.cli_args import config_flags
    around = parse_qat_spec("int2:g32/jacquant/around")
    assert around.jacquant.b_in_adamw is False and "--no-b-in-adamw" in config_flags(around)
    plain = Net()
    prepare(plain, around)
    plain_hook = refresh_hook(plain, around, seed=0)
    plain_hook.attach(torch.optim.AdamW(plain.parameters()))
    assert not plain_hook.scaling.fused and len(plain_hook.scaling.pairs) == 2
    # the fused weights' state is AdamW's own: it loads into the general way's optimizer
    opt.load_state_dict(fused_opt.state_dict())
    assert all(torch.equal(opt.state[q]["exp_avg"], fused_opt.state[p]["exp_avg"])
               for p, q in zip(fused_net.parameters(), net.parameters()))


def test_b_inside_adamws_step_equals_b_times_adamws_change():
    """One step against its formula: p + B * (AdamW's own change of p), weight decay included."""
    from lowbit.dispatch import adamw_step

    torch.manual_seed(0)
    p = torch.randn(3, 40)
    g, b = torch.randn(3, 40), torch.rand(3, 40) * 2
    ref = p.clone().requires_grad_()
    ref.grad = g.clone()
    adamw = torch.optim.AdamW([ref], lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.3)
    adamw.step()
    m, v, step = torch.zeros_like(p), torch.zeros_like(p), torch.tensor(0.0)
    out = p.clone()
    adamw_step([out], [g], [m], [v], [step], [b], torch.tensor(0.01), 0.8, 0.9, 1e-6, 0.3, None)
    torch.testing.assert_close(out, p + b * (ref.detach() - p), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, adamw.state[ref]["exp_avg"])
    torch.testing.assert_close(v, adamw.state[ref]["exp_avg_sq"])
    assert step.item() == 1
    # a uint8 B: its level over the levels per unit
    out8 = p.clone()
    level = torch.randint(0, 255, (3, 40), dtype=torch.uint8)
    adamw_step([out8], [g], [torch.zeros_like(p)], [torch.zeros_like(p)], [torch.tensor(0.0)],
                       [level], torch.tensor(0.01), 0.8, 0.9, 1e-6, 0.3, 127.0)
    torch.testing.assert_close(out8, p + level.float() / 127 * (ref.detach() - p), rtol=1e-6, atol=1e-7)



def _jacquant_net():
    """Net prepared for JacQuant (B per weight on the update), B refit once."""
    torch.manual_seed(1)
    net = Net()
    cfg = QATConfig(weights="int2:g32", estimator="jacquant")
    prepare(net, cfg)
    refresh(net, 0, 1)
    return net, cfg


def _loss(net, seed=2):
    return net(torch.randn(8, 64, generator=torch.Generator().manual_seed(seed))).square().mean()


def test_b_inside_adamw_follows_the_groups_and_skips_weights_without_gradients():
    net, cfg = _jacquant_net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    hook = refresh_hook(net, cfg, seed=0)
    hook.attach(opt)
    a, b = net.a.parametrizations.weight.original, net.b.parametrizations.weight.original
    _loss(net).backward()
    opt.step()
    assert hook.scaling.inside                                   # this step was inside AdamW's
    # load_state_dict after attach replaces the groups: a learning rate of 0 there stops every weight
    opt.load_state_dict(opt.state_dict())
    for group in opt.param_groups:
        group["lr"] = 0.0
    before = [p.detach().clone() for p in net.parameters()]
    opt.zero_grad()
    _loss(net, 3).backward()
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
    # a weight without a gradient is left alone (state and all), as AdamW leaves it
    for group in opt.param_groups:
        group["lr"] = 0.01
    opt.zero_grad()
    _loss(net, 4).backward()
    a.grad = None
    a_before, b_before, a_steps = a.detach().clone(), b.detach().clone(), opt.state[a]["step"].clone()
    opt.step()
    assert torch.equal(a, a_before) and torch.equal(opt.state[a]["step"], a_steps)
    assert not torch.equal(b, b_before)


def test_a_closure_or_a_grad_scaler_step_goes_the_general_way():
    """A closure recomputes the gradients inside the step and a GradScaler hands fused AdamW
    scaled gradients to unscale and skip inside it: such a step is the general way's, bit for
    bit, and a scaler's skipped step leaves every weight as it was."""
    results = []
    for kind in (torch.optim.AdamW, _AnyOptimizerAdamW):
        net, cfg = _jacquant_net()
        opt = kind(net.parameters(), lr=0.01)
        refresh_hook(net, cfg, seed=0).attach(opt)

        def closure():
            opt.zero_grad()
            loss = _loss(net)
            loss.backward()
            return loss
        opt.step(closure)
        results.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*results))
    net, cfg = _jacquant_net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, fused=True)
    refresh_hook(net, cfg, seed=0).attach(opt)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(net)).backward()
    net.a.parametrizations.weight.original.grad[0, 0] = float("inf")   # an overflow: the step is skipped
    before = [p.detach().clone() for p in net.parameters()]
    scaler.step(opt)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))


def test_a_checkpoint_moves_between_the_two_ways_and_trains_on():
    """The state B inside AdamW leaves is AdamW's own: loaded into the general way (and back),
    three more steps each agree to float32 rounding."""
    runs = []
    for first, then in ((torch.optim.AdamW, _AnyOptimizerAdamW), (_AnyOptimizerAdamW, torch.optim.AdamW)):
        net, cfg = _jacquant_net()
        opt = first(net.parameters(), lr=0.01, weight_decay=0.1)
        hook = refresh_hook(net, cfg, seed=0)
        hook.attach(opt)
        for step in range(3):
            opt.zero_grad()
            _loss(net, step).backward()
            opt.step()
        assert hook.scaling.inside == (first is torch.optim.AdamW)
        moved = then(net.parameters(), lr=0.01, weight_decay=0.1)
        moved.load_state_dict(opt.state_dict())
        hook = refresh_hook(net, cfg, seed=0)
        hook.attach(moved)
        for step in range(3, 6):
            moved.zero_grad()
            _loss(net, step).backward()
            moved.step()
        assert hook.scaling.inside == (then is torch.optim.AdamW)
        runs.append([p.detach().clone() for p in net.parameters()])
        assert all(moved.state[p]["step"].item() == 6 for p in net.parameters())
    for p, q in zip(*runs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)

@pytest.mark.gpu
@pytest.mark.parametrize("b_dtype", ["float32", "bfloat16", "uint8"])
def test_b_inside_fused_adamws_step_on_cuda_is_the_copy_and_scale_way(b_dtype, monkeypatch):
    """On CUDA: torch's fused AdamW for the other parameters, the Triton kernel with B for the
    prepared weights (counted), against the general way around the same fused AdamW."""
    import lowbit.kernels.optimizer as kernel
    calls, real = [], kernel.adamw_step_triton
    monkeypatch.setattr(kernel, "adamw_step_triton", lambda *a, **k: (calls.append(len(a[0])), real(*a, **k)))
    (fused_net, fused_opt, fused_hook), (net, opt, _) = _b_on_update_runs(b_dtype, "cuda")
    assert calls == [2] * 5                                     # one launch for both weights, five steps
    assert len(fused_hook.scaling.fused) == 2
    for (name, p), q in zip(fused_net.named_parameters(), net.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
        assert fused_opt.state[p]["step"].device.type == "cuda"


def test_ddp_leaves_out_only_the_buffers_every_rank_holds_alike():
    expected = {
        JacQuantConfig(): ["b"],                                  # per element: B from the weights
        JacQuantConfig(per_element=False): None,                  # weighted per group: rank-local moments
        JacQuantConfig(per_element=False, weighted=False): ["b"],
        JacQuantConfig(per_element=False, b_on="grad"): None,     # nothing large to leave out
    }
    for jq, kinds in expected.items():
        net = Net()
        prepare(net, QATConfig(weights="int2:g32", estimator="jacquant", jacquant=jq))
        ignored = getattr(net, "_ddp_params_and_buffers_to_ignore", None)
        assert ignored == (None if kinds is None else
                           [f"{m}.parametrizations.weight.0.{k}" for m in "ab" for k in kinds])
        buffers = dict(net.named_buffers())
        assert all(name in buffers for name in ignored or [])


def test_qat_spec_is_one_spelling_and_its_flags_rebuild_the_config():
    from lowbit.cli import build_parser
    from lowbit.qat.cli_args import config_flags, job_from_args

    spec = parse_qat_spec("int2:g64/jacquant/k50/eps0.25/dither/elem/upd/mse")
    jq = spec.jacquant
    assert (jq.refresh_every, jq.eps, jq.estimate, jq.per_element, jq.b_on) == (50, 0.25, "dither", True, "update")
    assert spec.scale_init == "mse" and parse_qat_spec("int2:g64/lsq/learned").learn_scales
    assert parse_qat_spec("int2:g64/ste/kd").distill == 1.0
    assert parse_qat_spec("int2:g64/ste/kd0.5").distill == 0.5
    assert parse_qat_spec("int2:g64/jacquant").jacquant == JacQuantConfig()   # elem/upd: the defaults
    per_group_grad = parse_qat_spec("int2:g64/jacquant/group/grad").jacquant
    assert (per_group_grad.per_element, per_group_grad.b_on) == (False, "grad")
    for text in ("int2:g64/jacquant/k50/eps0.25/dither/elem/upd/mse", "ternary:g64/ste",
                 "int2:g64/jacquant/group/grad", "int2:g64/jacquant/group",
                 "seq2:g32/jacquant/both/learned", "int2:g64/ste/kd0.5", "ternary:g64/jacquant/kd",
                 "int2:g64/jacquant/around/bf16b"):
        config = parse_qat_spec(text)
        args = build_parser().parse_args(["qat", *config_flags(config)])
        assert job_from_args(args).configs == [config], text
    for bad, says in (("int2", "WEIGHTS/ESTIMATOR"), ("int2:g64/ste/fast", "unknown option 'fast'"),
                      ("int2:g64/magic", "unknown estimator"), ("int2:g64/jacquant/kx", "unknown option 'kx'"),
                      ("int2:g64/ste/kd2", "--distill must be in"), ("int2:g64/ste/kdx", "unknown option 'kdx'")):
        with pytest.raises(ValueError, match=says):
            parse_qat_spec(bad)


def test_estimators_converge_on_a_toy_regression():
    torch.manual_seed(0)
    target = torch.randn(16, 64)
    x = torch.randn(256, 64)
    y = x @ target.T
    for estimator, b_on in [("ste", "grad"), ("clipped-ste", "grad"), ("lsq", "grad"),
                            ("jacquant", "grad"), ("jacquant", "update")]:
        layer = nn.Linear(64, 16, bias=False)
        with torch.no_grad():
            layer.weight.copy_(target + 0.3 * torch.randn_like(target))
        config = QATConfig(weights="int4:g32", estimator=estimator,
                           jacquant=JacQuantConfig(refresh_every=1, b_on=b_on))
        prepare(layer, config)
        hook = refresh_hook(layer, config, seed=0)
        opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
        if hook is not None:
            hook.attach(opt)
        first = None
        for step in range(1, 61):
            loss = (layer(x) - y).square().mean()
            first = first if first is not None else loss.item()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if hook is not None:
                hook(step)
        assert loss.item() < 0.5 * first, (estimator, b_on)


def test_gptq_lowers_the_layer_output_error_against_rtn():
    import copy
    torch.manual_seed(0)
    base = Net()
    x = torch.randn(512, 64) @ torch.randn(64, 64)
    rtn = copy.deepcopy(base)
    prepare(rtn, QATConfig(weights="int2:g32", estimator="ste"))
    g = copy.deepcopy(rtn)
    assert gptq(g, [(x, torch.zeros(1))], torch.device("cpu")) == 2
    ref = base.a(x)
    err_rtn = (rtn.a(x) - ref).square().mean()
    err_gptq = (g.a(x) - ref).square().mean()
    assert err_gptq < 0.8 * err_rtn


def test_prepare_refuses_before_changing_anything():
    net = Net()
    with pytest.raises(ValueError, match="does not divide"):
        prepare(net, QATConfig(weights="int2:g48", estimator="ste"))
    assert not hasattr(net.a, "parametrizations")
    for bad in ["int5", "int2:g7", "ternary:asym", "nvfp4:g32", "foo"]:
        with pytest.raises(ValueError):
            qat_weight_format(bad)


def test_distillation_kl_against_its_formula():
    from lowbit.qat import distillation_kl

    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 11, generator=g) * 3, torch.randn(2, 5, 11, generator=g) * 3
    targets = torch.randint(0, 11, (2, 5), generator=g)
    targets[0, 1] = targets[1, 4] = -100
    for temperature in (1.0, 2.0):
        total, n = 0.0, 0
        for b in range(2):
            for t in range(5):
                if targets[b, t] == -100:
                    continue
                p = torch.softmax(teacher[b, t].double() / temperature, -1)
                q = torch.softmax(student[b, t].double() / temperature, -1)
                total += float((p * (p.log() - q.log())).sum())
                n += 1
        expected = total / n * temperature ** 2
        got = distillation_kl(student, teacher, targets, temperature)
        assert got.dtype == torch.float32 and abs(got.item() - expected) < 1e-5 * max(1, expected)
    assert distillation_kl(student, student.clone(), targets).abs().item() < 1e-6
    # bf16 logits are matched in float32; a batch with no targets contributes 0 (and a graph)
    assert abs(distillation_kl(student.bfloat16(), teacher.bfloat16(), targets).item()
               - distillation_kl(student.bfloat16().float(), teacher.bfloat16().float(), targets).item()) < 1e-6
    empty = distillation_kl(student.requires_grad_(), teacher, torch.full((2, 5), -100))
    assert empty.item() == 0 and empty.requires_grad


def test_distillation_is_the_step_loss_and_leaves_the_teacher_alone():
    """TrainStep with a Distillation loss function: a student identical to its teacher has loss 0 at
    alpha 1 and (1 - alpha) * CE at alpha < 1; gradients reach the student only."""
    import copy

    from lowbit.models import ModelConfig, Transformer
    from lowbit.qat import Distillation
    from lowbit.train.build import build_optimizer
    from lowbit.train.config import TrainConfig
    from lowbit.train.distributed import Distributed
    from lowbit.train.step import StepConfig, TrainStep

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=2, max_seq_len=16))
    x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        ce = model(x, y).loss.item()
    config = StepConfig.of(TrainConfig(batch_size=2, seq_len=8, lr=1e-3, warmup_steps=1,
                                       max_steps=2, device="cpu"))
    for alpha, expected in ((1.0, 0.0), (0.25, 0.75 * ce)):
        student, teacher = copy.deepcopy(model), copy.deepcopy(model)
        step = TrainStep(student, build_optimizer(student, config, torch.device("cpu")), config,
                         Distributed(device=torch.device("cpu")), loss_fn=Distillation(teacher, alpha))
        result = step(0, (x, y))
        assert abs(result.loss - expected) < 1e-5, (alpha, result.loss, expected)
        assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
        assert all(torch.equal(a, b) for a, b in zip(teacher.state_dict().values(), model.state_dict().values()))
        assert alpha == 1 or any(not torch.equal(a, b) for a, b in
                                 zip(student.state_dict().values(), model.state_dict().values()))
    with pytest.raises(ValueError, match="0 < alpha <= 1"):
        Distillation(model, 0.0)


def _lowbit(*args, **kw):
    return subprocess.run([sys.executable, "-m", "lowbit", *args], capture_output=True, text=True, **kw)


def test_lowbit_qat_runs_and_compares(tmp_path, capsys, corpus_env):
    """`lowbit qat --compare` in this process (docs/reliability.md's table holds its bad flags,
    rerun by tests/test_robustness.py)."""
    from lowbit.cli import main

    assert main(["qat", "--compare", "ste,jacquant", "--seeds", "0,1", "--steps", "4",
                 "--base-steps", "6", "--eval-every", "2", "--refresh-every", "2",
                 "--out-dir", str(tmp_path), "--no-progress", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    # int2 on the default absmax scales: the better choice is named, progress bars or not
    assert "lowbit: note: int2:g32 with absmax scales (the default)" in err
    for method in ("bf16", "rtn", "gptq", "ste", "jacquant"):
        assert f"| {method} |" in out
    (folder,) = tmp_path.glob("qat-*/qat.png")
    # named by the setting: another format, comparison or set of seeds keeps this one
    assert folder.parent.name.endswith("-int2-g32-ste+jacquant-s0-1-summary"), folder
    # the paired-seed statistics of `lowbit train --compare`, on the QAT runs' own curves
    assert "| arm | gap vs ste: mean ± sd |" in out and (folder.parent / "seeds" / "seeds.png").is_file()
    stats = json.loads((folder.parent / "seeds" / "summary.json").read_text())
    (arm,) = stats["arms"]
    assert (arm["arm"], arm["seeds"], stats["step"]) == ("jacquant", [0, 1], 4)
    final = {Path(r["run"]).name: r["val_loss"]
             for r in json.loads((folder.parent / "summary.json").read_text())["runs"]}
    assert {row["run"]: row["value"] for row in stats["rows"]} == pytest.approx(final) and len(final) == 4
    # B's statistics: a record at each refit (steps 1 and 3 of 4 with --refresh-every 2)
    run = next(tmp_path.glob("qat-*-jacquant-s0"))
    b_records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                 if '"jacquant"' in line]
    assert [r["step"] for r in b_records] == [1, 3]
    for r in b_records:
        assert 0 <= r["b/mean"] <= 2 and 0 <= r["b/near_zero"] <= 1            # b_max 2
        assert {"b/model.layers.0.self_attn.q_proj.weight/mean", "b/near_max"} <= set(r)
    # --distill: the same base (cached), the run labelled and its config recording it
    assert main(["qat", "--estimator", "ste", "--distill", "0.5", "--distill-temperature", "2",
                 "--steps", "2", "--base-steps", "6", "--eval-every", "2", "--no-baselines",
                 "--out-dir", str(tmp_path), "--no-progress", "--device", "cpu"]) == 0
    assert "| ste+kd0.5 |" in capsys.readouterr().out
    (run,) = tmp_path.glob("qat-*-ste+kd0.5")
    qat = json.loads((run / "job.json").read_text())["qat"]
    assert (qat["distill"], qat["distill_temperature"]) == (0.5, 2.0)
    # --stop-after-minutes: the first run stops at its first step's end, checkpointed, the second
    # never starts, no table; the same command with --resume (no limit) finishes both
    limited = ["qat", "--compare", "ste,jacquant", "--steps", "3", "--base-steps", "6", "--eval-every",
               "1", "--no-baselines", "--run-name", "lim", "--out-dir", str(tmp_path),
               "--no-progress", "--device", "cpu"]
    assert main([*limited, "--stop-after-minutes", "1e-9"]) == 0
    out = capsys.readouterr().out
    assert "stopped after 1e-09 minutes (--stop-after-minutes)" in out
    assert "lim-int2-g32-ste stopped at step 1, checkpointed" in out
    assert "| ste |" not in out and not list(tmp_path.glob("lim-*summary"))
    assert (tmp_path / "lim-int2-g32-ste" / "checkpoints").is_dir()
    assert not (tmp_path / "lim-int2-g32-ste" / "final.json").exists()
    assert not (tmp_path / "lim-int2-g32-jacquant").exists()
    assert main([*limited, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "| ste |" in out and "| jacquant |" in out and "stopped" not in out
    assert json.loads((tmp_path / "lim-int2-g32-jacquant" / "final.json").read_text())["steps"] == 3


def test_nvfp4_fused_groups_share_a_tensor_scale_as_the_export_quantizes_them():
    from lowbit.export import quantize_group, weight_groups
    from lowbit.formats import QuantSpec
    from lowbit.models import ModelConfig, build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig.preset("tiny", n_layers=1, vocab_size=64))
    groups = weight_groups(model)            # (name, weight) of q/k/v, o, gate/up, down
    spec = QuantSpec.make("nvfp4")
    expected = {f"{name}.weight": q for group in groups
                for (name, _), q in zip(group, quantize_group([w for _, w in group], spec))}
    x = torch.randint(0, 64, (2, 16))
    prepare(model, QATConfig(weights="nvfp4", estimator="ste"))
    model.eval()
    before = model(x).logits
    convert(model)
    assert torch.equal(model(x).logits, before)
    packed = packed_weights(model)
    assert set(packed) == set(expected)
    for name, q in packed.items():            # bit for bit the group-quantized weights
        assert torch.equal(q.codes, expected[name].codes), name
        assert torch.equal(q.scales.view(torch.uint8), expected[name].scales.view(torch.uint8)), name
        assert torch.equal(q.tensor_scale, expected[name].tensor_scale), name
    scales = {n: float(q.tensor_scale) for n, q in packed.items()}
    attn = "model.layers.0.self_attn"
    assert scales[f"{attn}.q_proj.weight"] == scales[f"{attn}.k_proj.weight"] == scales[f"{attn}.v_proj.weight"]
    assert len(set(scales.values())) == 4      # q/k/v, o, gate/up, down: one each


def test_a_qat_runs_start_line_names_the_block_a_bare_weight_format_means():
    """`--weights int8` trains int8:g128 (the grammar's default block), where `lowbit export`'s
    int8 is per row: the run's start line says which it trains."""
    from lowbit.train import TrainConfig
    from lowbit.train.job_record import JobRecord
    from lowbit.train.loop import describe_numerics

    config = TrainConfig()
    for given, said in (("int8", "QAT int8:g128 with ste"), ("int2:g64:asym", "QAT int2:g64:asym with ste"),
                        ("nvfp4", "QAT nvfp4 with ste"), ("INT4:ROW", "QAT int4:row with ste")):
        job = JobRecord(kind="qat", qat={"weights": given, "estimator": "ste"})
        assert describe_numerics(config, job) == said


@pytest.mark.gpu
def test_lowbit_qat_compiled_trains_as_eager_on_cuda(tmp_path, capsys, corpus_env):
    """`lowbit qat --compile`: each run's step and evaluations under torch.compile, JacQuant's
    refits eager; the curves equal the eager runs' to the compiler's rounding."""
    from lowbit.cli import main

    losses = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        assert main(["qat", "--compare", "ste,jacquant", "--steps", "6", "--base-steps", "6",
                     "--eval-every", "3", "--refresh-every", "2", "--no-baselines", "--run-name", name,
                     "--out-dir", str(tmp_path), "--no-progress", "--device", "cuda", *extra]) == 0
        capsys.readouterr()
        for arm in ("ste", "jacquant"):
            run = tmp_path / f"{name}-int2-g32-{arm}"
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            losses[name, arm] = [r["val_loss"] for r in records if "val_loss" in r]
            assert json.loads((run / "config.json").read_text())["compile"] == (name == "compiled")
    for arm in ("ste", "jacquant"):
        assert len(losses["compiled", arm]) == 3                 # steps 0, 3 and 6
        assert losses["compiled", arm] == pytest.approx(losses["eager", arm], rel=2e-3)
