"""prepare / convert: QAT's model transforms, in torchao's shape.

`prepare(model, config)` puts a fake quantizer on the weight of every linear layer and every
3D experts weight (as `torch.nn.utils.parametrize` parametrizations: `module.weight` is
computed as Q(original), so any forward -- lowbit's models, Hugging Face's, inside any
trainer -- trains through it) and returns a report like `lowbit.quantize_`'s. Output head,
routers, embeddings and norms stay in high precision. Under nvfp4, a fused group (a module's
q_proj/k_proj/v_proj, or gate_proj/up_proj, all prepared) shares one per-tensor scale, from
the group's amax at each forward, as TensorRT-LLM and vLLM need of a served checkpoint; an
MoE experts tensor holds all its experts' gate/up under one scale already. Each fake quantizer holds its scales
(a Parameter when learned), zero points, JacQuant's B and the input second moments as
module state, so checkpoints carry them and a resumed run is the same run.

`convert(model)` then replaces every fake-quantized weight by its packed low-bit `QTensor`
(the `PackedWeight` parametrization, which dequantizes on the fly, so the model still runs
and evaluates to exactly what the QAT run evaluated); `packed_weights(model)` returns them by
name for `lowbit.save_qtensors` or an export, and `load_packed(model, path)` puts saved ones
back into a freshly built model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from lowbit import dispatch
from lowbit.formats import QTensor, load_qtensors
from lowbit.formats.quantize import divide, finite_abs
from lowbit.nn import GEMM_KINDS, QuantExperts, QuantLinear, gemm_modules
from lowbit.qat.config import QATConfig
from lowbit.qat.jacquant import b_statistics, fit_b
from lowbit.qat.quantizer import GroupQuantizer, fake_quantize, times_b

__all__ = ["FakeQuantWeight", "PackedWeight", "QATReport", "prepare", "check_model", "convert", "packed_weights",
           "load_packed", "refresh", "refresh_hook", "QATHook", "UpdateScaling", "fake_quantizers",
           "jacquant_metrics", "CodeFlips"]


class FakeQuantWeight(nn.Module):
    """Parametrization weight -> Q(weight), with the config's estimator in backward."""

    def __init__(self, weight: torch.Tensor, config: QATConfig, name: str) -> None:
        super().__init__()
        self.config, self.name = config, name
        self.observer = None  # the input-moment hook's handle (prepare sets it)
        fmt = config.format
        fmt.check_layer(name, weight.shape[-1])
        self.quantizer = GroupQuantizer(fmt, weight.shape)
        self.learn = config.scales_learned
        if fmt.data_scaled:
            scales, zeros = None, None
        else:
            scales, zeros = self.quantizer.init_scales(weight, config.scale_init)
        if scales is not None and self.learn:
            self.scales = nn.Parameter(scales)
            self.scales.no_weight_decay = True  # lowbit.train.build.param_groups reads it
        else:
            self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        if config.estimator == "jacquant":
            jq = config.jacquant
            b_shape = weight.shape if jq.per_element else self.quantizer.scale_shape
            one = self._encoded(torch.ones(b_shape, device=weight.device)).to(getattr(torch, jq.b_dtype))
            self.register_buffer("b", one)                                              # B = 1
            # the shuffled-B control: b is the B used (a permutation of this one, the smoothed fit)
            self.register_buffer("b_unshuffled", one.clone() if jq.shuffle_b else None)
            self.register_buffer("refreshes", torch.zeros((), dtype=torch.int64, device=weight.device))
            # Per element, a channel's moment multiplies both sums of its weight's own ratio and
            # cancels (fit_b); it weighs weights against each other only within a group, so
            # only per-group B keeps moments (2-D linear weights; experts' inputs are routed).
            self.register_buffer("moments", torch.ones(weight.shape[-1], device=weight.device)
                                 if weight.dim() == 2 and jq.weighted and not jq.per_element else None)
            # whether the next training forward records its input moments: only the step
            # before each refit does (refresh_hook sets it), so the steps in between pay nothing
            self.register_buffer("observing", torch.ones((), dtype=torch.bool, device=weight.device))
        else:
            self.b = self.b_unshuffled = self.moments = self.observing = None
        # B on the update (UpdateScaling scales each optimizer step's change; backward is the STE's)
        self.b_on_update = config.estimator == "jacquant" and config.jacquant.b_on == "update"
        self.observing_now = True  # a host-side copy of `observing` (no device sync per forward)
        # nvfp4: the (module, parameter name) of each member of this weight's fused group
        # (itself included), whose amax sets the shared tensor scale; plain references, not
        # submodules (prepare sets it)
        self.group: list[tuple[nn.Module, str]] = []

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # checkpoints written before UpdateScaling held the weights after the last step as
        # "prev": the weights themselves, so it is dropped
        state_dict.pop(prefix + "prev", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.observing is not None:
            self.observing_now = bool(self.observing)

    def set_observing(self, on: bool) -> None:
        if self.observing is not None:
            self.observing.fill_(on)
            self.observing_now = on

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        scales = None if self.scales is None else torch.clamp(self.scales, min=2.0 ** -120)
        if self.b_on_update:   # B acts on the update (UpdateScaling): the STE's backward
            return fake_quantize(weight, scales, self.zeros, None, self.quantizer, "ste",
                                 self.learn, self.group_amax())
        return fake_quantize(weight, scales, self.zeros, self.b, self.quantizer,
                             self.config.estimator, self.learn, self.group_amax())

    @torch.no_grad()
    def scale_update(self, weight: torch.Tensor, before: torch.Tensor) -> None:
        """B on the update: W <- W_before + B * (W - W_before), after an optimizer step changed
        W from `before`."""
        before = before.float()
        weight.copy_(before + times_b(weight.float() - before, self.b_values()))

    def b_values(self) -> torch.Tensor | None:
        """B's values: the buffer itself, or a uint8 B's levels decoded (level / n with n =
        floor(255 / b_max), so that B = 1 is a level: float32, a new tensor)."""
        if self.b is None or self.b.dtype != torch.uint8:
            return self.b
        return self._decoded(self.b)

    def _decoded(self, stored: torch.Tensor) -> torch.Tensor:
        """A B buffer's values in float32 (uint8: its levels decoded)."""
        if stored.dtype != torch.uint8:
            return stored.float()
        return divide(stored.float(), float(self.config.jacquant.uint8_levels_per_unit))

    def _encoded(self, values: torch.Tensor) -> torch.Tensor:
        """Float B values as B is stored, before the cast to its dtype (uint8: the nearest level)."""
        if self.config.jacquant.b_dtype != "uint8":
            return values
        return torch.round(values * self.config.jacquant.uint8_levels_per_unit).clamp_(0, 255)

    @torch.no_grad()
    def group_amax(self) -> torch.Tensor | None:
        """The largest finite |value| over the fused group's weights (None: no group)."""
        if not self.group:
            return None
        amaxes = []
        for module, pname in self.group:
            w = module.parametrizations[pname].original.detach().float()
            amaxes.append(finite_abs(w).amax())
        return torch.stack(amaxes).amax()

    @torch.no_grad()
    def observe(self, x: torch.Tensor) -> None:
        """EMA of the input second moments diag(E[x xᵀ]) (per input channel)."""
        if self.moments is None or not self.observing_now:
            return
        m = x.detach().float().reshape(-1, x.shape[-1]).square().mean(0)
        if int(self.refreshes) == 0:
            self.moments.copy_(m)
        else:
            decay = self.config.jacquant.moment_decay
            self.moments.mul_(decay).add_(m, alpha=1 - decay)

    @torch.no_grad()
    def refresh(self, weight: torch.Tensor, generator: torch.Generator,
                shuffle_generator: torch.Generator | None = None) -> None:
        """Refit B: probes drawn from `generator`; with shuffle_b, the B used is the smoothed
        fit permuted within the tensor by a draw from `shuffle_generator` (its own, so that the
        fit is the unshuffled run's, draw for draw)."""
        jq = self.config.jacquant
        scales = None if self.scales is None else torch.clamp(self.scales.detach(), min=2.0 ** -120)
        fit = torch.clamp(fit_b(weight.detach(), self.quantizer, scales, self.zeros, jq,
                                self.moments, generator), 0.0, jq.b_max)
        smoothed = self.b if self.b_unshuffled is None else self.b_unshuffled
        if int(self.refreshes) == 0:
            smoothed.copy_(self._encoded(fit))
        else:   # in float32 (in place where B is stored so), stored in B's dtype
            smoothed.copy_(self._encoded(self._decoded(smoothed).mul_(jq.ema).add_(fit, alpha=1 - jq.ema)))
        if self.b_unshuffled is not None:
            order = torch.randperm(smoothed.numel(), generator=shuffle_generator, device=smoothed.device)
            self.b.copy_(smoothed.flatten()[order].view_as(smoothed))
        self.refreshes += 1

    @torch.no_grad()
    def codes(self, weight: torch.Tensor) -> torch.Tensor:
        """The integer codes (uint8, shaped like weight) that pack would store for `weight`."""
        return self.pack(weight).unpacked_codes()

    def pack(self, weight: torch.Tensor) -> QTensor:
        scales = None if self.scales is None else torch.clamp(self.scales.detach(), min=2.0 ** -120)
        return self.quantizer.pack(weight.detach(), scales, self.zeros, self.group_amax())

    def extra_repr(self) -> str:
        return f"{self.quantizer.fmt}, estimator={self.config.estimator}, learn_scales={self.learn}"


class PackedWeight(nn.Module):
    """Parametrization that ignores its (empty) original and returns a packed weight's values."""

    def __init__(self, q: QTensor) -> None:
        super().__init__()
        self.register_buffer("codes", q.codes)
        self.register_buffer("scales", q.scales)
        self.register_buffer("tensor_scale", q.tensor_scale)
        self.register_buffer("zeros", q.zeros)
        self.spec, self.shape, self.dtype = q.spec, tuple(q.shape), q.dtype

    @property
    def qtensor(self) -> QTensor:
        return QTensor(self.codes, self.scales, self.tensor_scale, self.spec, self.shape,
                       self.dtype, zeros=self.zeros)

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        return self.qtensor.dequantize(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.spec.format}, block={self.spec.block}, shape={self.shape}"


@dataclass
class QATReport:
    weights: str
    estimator: str
    prepared: list[tuple[str, str, tuple]] = field(default_factory=list)  # (name, kind, shape)
    kept: list[tuple[str, str, str]] = field(default_factory=list)        # (name, kind, why)

    def __str__(self) -> str:
        lines = [f"lowbit.qat.prepare: {self.weights}, estimator {self.estimator}: "
                 f"{len(self.prepared)} weights fake-quantized, {len(self.kept)} modules kept in "
                 "high precision"]
        width = max([len(n) for n, _, _ in self.prepared + self.kept] + [10])
        for name, kind, shape in self.prepared:
            lines.append(f"  quantized  {name.ljust(width)}  {kind:<10} {'x'.join(map(str, shape))}")
        for name, kind, why in self.kept:
            lines.append(f"  kept       {name.ljust(width)}  {kind:<10} {why}")
        return "\n".join(lines)


def _targets(model: nn.Module, module_filter_fn, report: QATReport):
    """(module, parameter name, qualified name, kind) of every weight QAT quantizes (the GEMM
    weights lowbit.nn.gemm_modules finds and module_filter_fn keeps)."""
    for name, module in model.named_modules():
        if parametrize.is_parametrized(module):
            raise ValueError(f"{name} already has a parametrized weight (prepared or converted "
                             "before); prepare a fresh model")
    out = []
    for name, module, kind, why in gemm_modules(model, module_filter_fn):
        if kind not in GEMM_KINDS:
            if not why.startswith("holds"):
                report.kept.append((name, kind, why))
            continue
        if isinstance(module, (QuantLinear, QuantExperts)):
            raise ValueError(f"{name} is a lowbit.quantize_ (recipe) layer; QAT prepares a model in high "
                             "precision (build it without a recipe)")
        if why:
            report.kept.append((name, kind, why))
            continue
        params = ["weight"] if kind == "linear" else ["gate_up_proj", "down_proj"]
        out.extend((module, p, f"{name}.{p}" if name else p, kind) for p in params)
    return out


def check_model(model: nn.Module, config: QATConfig,
                module_filter_fn: Callable[[nn.Module, str], bool] | None = None) -> None:
    """Raise ValueError where prepare(model, config) would: before any work is spent on a model
    (lowbit qat checks a meta-device copy before training its base)."""
    _checked_targets(model, config, module_filter_fn)


def _checked_targets(model, config, module_filter_fn):
    if config.format.grid == "bf16":
        raise ValueError("weights 'bf16' quantize nothing (it names lowbit qat's control run); "
                         "pick a format, e.g. int2:g64")
    report = QATReport(config.weights, config.estimator)
    targets = _targets(model, module_filter_fn, report)
    if not targets:
        raise ValueError("lowbit.qat.prepare found no linear or experts weight to quantize")
    for module, pname, qname, _ in targets:
        config.format.check_layer(qname, getattr(module, pname).shape[-1])
    return report, targets


def prepare(model: nn.Module, config: QATConfig,
            module_filter_fn: Callable[[nn.Module, str], bool] | None = None) -> QATReport:
    """Fake-quantize model's linear and experts weights in place (see the module docstring).

    Everything is checked (formats, group sizes, that nothing is prepared already) before the
    first weight changes, so a refused prepare leaves the model as it was."""
    report, targets = _checked_targets(model, config, module_filter_fn)
    for module, pname, qname, kind in targets:
        weight = getattr(module, pname)
        fq = FakeQuantWeight(weight.detach(), config, qname)
        parametrize.register_parametrization(module, pname, fq)
        if kind == "linear" and fq.moments is not None:
            fq.observer = module.register_forward_pre_hook(_observer(fq))
        report.prepared.append((qname, kind, tuple(weight.shape)))
    if config.format.grid == "nvfp4":
        _share_tensor_scales(targets)
    _unsynced_under_ddp(model)
    return report


def _unsynced_under_ddp(model: nn.Module) -> None:
    """Tell DDP (which broadcasts rank 0's buffers before every forward) to leave out the
    buffers that are the same on every rank by construction: B where no rank-local input
    moments feed its fit (seeded probes of identical weights), as large as the weights per
    element. A per-group weighted B keeps the broadcast: its moments come from each rank's own
    rows."""
    from torch.nn.parallel import DistributedDataParallel

    names = []
    for name, module in model.named_modules():
        if isinstance(module, FakeQuantWeight) and module.b is not None:
            names += [f"{name}.b"] if module.moments is None else []
            names += ([f"{name}.b_unshuffled"] if module.moments is None and module.b_unshuffled
                      is not None else [])
    if names:
        known = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, known + names)


FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _share_tensor_scales(targets) -> None:
    """Link each fused group whose members are all prepared linears of one parent module."""
    prepared = {qname.removesuffix(".weight"): module for module, pname, qname, kind in targets
                if kind == "linear" and pname == "weight"}
    for name in prepared:
        parent, _, leaf = name.rpartition(".")
        for group in FUSED_GROUPS:
            if leaf != group[0]:
                continue
            members = [f"{parent}.{n}" if parent else n for n in group]
            if all(m in prepared for m in members):
                links = [(prepared[m], "weight") for m in members]
                for module, _ in links:
                    module.parametrizations.weight[0].group = links


def _observer(fq: FakeQuantWeight):
    def hook(module, args):
        if module.training and torch.is_grad_enabled():
            fq.observe(args[0])
    return hook


def _parametrized(model: nn.Module, kind: type):
    """(qualified name, module, parameter name, parametrization) of every `kind` parametrization."""
    for name, module in model.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        for pname, plist in module.parametrizations.items():
            for p in plist:
                if isinstance(p, kind):
                    yield (f"{name}.{pname}" if name else pname, module, pname, p)


def fake_quantizers(model: nn.Module) -> list[tuple[str, nn.Module, str, FakeQuantWeight]]:
    """(qualified name, module, parameter name, fake quantizer) of every prepared weight."""
    return list(_parametrized(model, FakeQuantWeight))


@torch.no_grad()
def refresh(model: nn.Module, seed: int, step: int) -> None:
    """Refit every jacquant B (draws from a generator seeded by (seed, step), and the shuffled-B
    control's permutation from one seeded by (seed, refit index): resume-exact)."""
    for index, (_, module, pname, fq) in enumerate(fake_quantizers(model)):
        if fq.b is None:
            continue
        original = module.parametrizations[pname].original
        generator = torch.Generator(device=original.device)
        generator.manual_seed((seed * 1_000_003 + step * 7919 + index) % (2 ** 63))
        shuffle_generator = None
        if fq.b_unshuffled is not None:
            shuffle_generator = torch.Generator(device=original.device)
            shuffle_generator.manual_seed(
                (seed * 1_000_033 + int(fq.refreshes) * 104_729 + index + 2 ** 40) % (2 ** 63))
        fq.refresh(original, generator, shuffle_generator)


def refresh_hook(model: nn.Module, config: QATConfig, seed: int,
                 record_every: int | None = None) -> QATHook | None:
    """The training loop's on_step hook of a QAT run (`QATHook`). With jacquant it refits B
    after steps 1, 1 + K, 1 + 2K, ... and returns B's statistics as a "jacquant" record; with
    B on the update it must also be attached to the optimizer (`QATHook.attach`), which scales
    each step's change by B. With `record_every`, every estimator also returns a "qat" record
    after every that many steps. Each record the hook returns holds the code flips since its
    previous one (code_flips). None: nothing to do (no jacquant, no record_every)."""
    if config.estimator != "jacquant" and record_every is None:
        return None
    return QATHook(model, config, seed, record_every)


class QATHook:
    """What a QAT run does around each optimizer step (made by `refresh_hook`):

        hook = refresh_hook(model, config, seed)
        hook.attach(optimizer)      # B on the update (JacQuant's default); harmless otherwise
        for step in range(1, steps + 1):
            ...forward, backward, optimizer.step()...
            hook(step)              # refits B after steps 1, 1 + K, ...; a record or None
    """

    def __init__(self, model: nn.Module, config: QATConfig, seed: int, record_every: int | None) -> None:
        self.model, self.seed, self.record_every = model, seed, record_every
        self.jacquant = config.estimator == "jacquant"
        self.every = config.jacquant.refresh_every
        self.scaling = (UpdateScaling(model) if self.jacquant and config.jacquant.b_on == "update"
                        else None)
        self.flips = CodeFlips(model)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Scale `optimizer`'s steps by B, where B acts on the update (UpdateScaling)."""
        if self.scaling is not None:
            self.scaling.attach(optimizer)

    def __call__(self, step: int) -> dict | None:
        if self.scaling is not None and not self.scaling.attached:
            raise RuntimeError("JacQuant with B on the update scales the optimizer's steps: call "
                               "hook.attach(optimizer) once before the first step")
        model = self.model
        refit = self.jacquant and (step - 1) % self.every == 0
        if self.jacquant:
            # refit after steps 1, 1 + K, ...; record input moments only during the step before
            if step % self.every == 0 or self.every == 1:
                _set_observing(model, True)
            if refit:
                refresh(model, self.seed, step)
                if self.every > 1:
                    _set_observing(model, False)
        if not refit and (self.record_every is None or step % self.record_every):
            self.flips.stepped(step)
            return None
        record = {"event": "jacquant", **jacquant_metrics(model)} if refit else {"event": "qat"}
        return {**record, **self.flips.since_last(step)}


class UpdateScaling:
    """JacQuant's B on the update: each optimizer step's change of a prepared weight scaled by
    its B, W <- W_before + B * (W - W_before). `attach(optimizer)` registers two of the
    optimizer's step hooks.

    Under torch.optim.AdamW, float32 weights with one B per element (the default) take the step
    with B inside it (lowbit.dispatch.adamw_step: one Triton launch for all on CUDA,
    lowbit.formats.optimizer's reference elsewhere): before the optimizer's step the
    hook takes their gradients away, so AdamW steps only the other parameters, and after it
    steps these on AdamW's own state and learning rate, then gives the gradients back. No copy
    of the weights: B read once (2 or 4 bytes a weight) over AdamW's own traffic.

    Any other weight (another optimizer, B per group, DTensor shards), and every weight in a
    step given a closure or a GradScaler's scaled gradients, goes the general way:
    before the step a copy of it (W_before); after it, the scaling (`scale_updates`), which
    frees the copy. The copy lives while the optimizer steps, when the activations are gone,
    so it raises a run's peak only where the optimizer step's own memory (weights, gradients,
    the copy) is above the forward and backward's.

    Inside AdamW's step, another step pre-hook registered after `attach` sees the fused weights
    without their gradients (held back), and a post-hook registered before it sees them not yet
    stepped: clip or log gradients before `optimizer.step()`, as lowbit's training loop does."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.pairs: list[tuple[torch.Tensor, FakeQuantWeight]] = []      # the general way
        self.fused: list[tuple[torch.Tensor, FakeQuantWeight]] = []   # stepped inside AdamW's step
        self.before: tuple[list, list[torch.Tensor]] | None = None   # (pairs, their copies) during a step
        self.grads: list[torch.Tensor | None] = []
        self.inside = False      # this step: the fused weights stepped here (False: the general way)
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr: dict[torch.device, torch.Tensor] = {}   # a 0-d float32 per device, refilled each step
        self.attached = False

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        if self.attached:
            raise ValueError("this QAT hook is attached to an optimizer already; attach it once "
                             "(a second pair of step hooks would scale each step twice)")
        # each prepared weight (as the optimizer holds it: after any sharding) and its fake
        # quantizer, found once, not every step
        pairs = [(module.parametrizations[pname].original, fq)
                 for _, module, pname, fq in fake_quantizers(self.model)]
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if missing := [fq.name for w, fq in pairs if id(w) not in stepped]:
            raise ValueError(f"the optimizer does not step the prepared weight(s) {missing[:3]}; "
                             "build it on the model after lowbit.qat.prepare")
        self.fused = [(w, fq) for w, fq in pairs if _steps_inside_adamw(optimizer, w, fq)]
        fused = {id(w) for w, _ in self.fused}
        self.pairs = [(w, fq) for w, fq in pairs if id(w) not in fused]
        self.optimizer = optimizer
        optimizer.register_step_pre_hook(self._before_step)
        optimizer.register_step_post_hook(self._after_step)
        self.attached = True

    @torch.no_grad()
    def _before_step(self, optimizer, args, kwargs) -> None:
        # B inside AdamW's step, unless this step's gradients are not final here: a closure
        # recomputes them inside the step, and a GradScaler hands fused AdamW scaled gradients
        # with its found-inf flag to unscale and skip inside the step; those steps (and the
        # weights of any other optimizer) go the general way, whose copy takes every weight
        closure = _step_closure(args, kwargs)
        scaled = getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None
        self.inside = bool(self.fused) and closure is None and not scaled
        general = self.pairs if self.inside else self.pairs + self.fused
        if self.inside:   # the fused weights' gradients held back, so AdamW's own step skips them
            self.grads = [w.grad for w, _ in self.fused]
            for w, _ in self.fused:
                w.grad = None
        # a copy of every other weight in one multi-tensor pass (x * 1.0 is x, bit for bit)
        self.before = (general, torch._foreach_mul([w for w, _ in general], 1.0) if general else [])

    @torch.no_grad()
    def _after_step(self, optimizer, args, kwargs) -> None:
        (general, before), self.before = self.before, None
        scale_updates(general, before)
        if self.inside:
            grads, self.grads = self.grads, []
            for (w, _), grad in zip(self.fused, grads, strict=True):
                w.grad = grad
            self._fused_step(grads)

    def _fused_step(self, grads: list[torch.Tensor | None]) -> None:
        """AdamW's step of the fused weights with B inside it, one call per (param group, B's
        storage, device), each weight under its group as the optimizer holds it now (a
        load_state_dict after attach replaces the groups); weights without a gradient are
        skipped, as AdamW skips them."""
        group_of = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}
        batches: dict[tuple, list] = {}
        for (w, fq), grad in zip(self.fused, grads, strict=True):
            if grad is None:
                continue
            group = group_of[id(w)]
            batches.setdefault((id(group), fq.b.dtype == torch.uint8, w.device), []).append((w, grad, fq, group))
        state = self.optimizer.state
        for (_, uint8, device), items in batches.items():
            group = items[0][3]
            for w, *_ in items:
                if not state[w]:
                    state[w].update(dispatch.new_adamw_state(w, group))
            beta1, beta2 = group["betas"]
            lr = dispatch.lr_tensor(group["lr"], self.lr, device)   # no host synchronisation
            levels = items[0][2].config.jacquant.uint8_levels_per_unit if uint8 else None
            dispatch.adamw_step(
                [w for w, *_ in items], [g for _, g, *_ in items], [state[w]["exp_avg"] for w, *_ in items],
                [state[w]["exp_avg_sq"] for w, *_ in items], [state[w]["step"] for w, *_ in items],
                [fq.b for _, _, fq, _ in items], lr, float(beta1), float(beta2), float(group["eps"]),
                float(group["weight_decay"]), None if levels is None else float(levels),
                grad_coef=getattr(self.optimizer, "grad_coef", None))


def _step_closure(args: tuple, kwargs: dict):
    """The closure a step was given, from a step pre-hook's (args, kwargs): torch passes the
    step's positional arguments with the optimizer itself first, args = (optimizer, closure?)."""
    return args[1] if len(args) > 1 else kwargs.get("closure")


def _steps_inside_adamw(optimizer: torch.optim.Optimizer, w: torch.Tensor, fq: FakeQuantWeight) -> bool:
    """Whether UpdateScaling takes this weight's step itself (lowbit.dispatch.adamw_step): asked for
    (JacQuantConfig.b_in_adamw, the default), AdamW as
    lowbit builds it (no amsgrad, maximize or differentiable step, betas numbers; on CUDA fused
    or capturable, so its step counts live on the device), a plain float32 weight (not a DTensor shard), one B
    per element."""
    if type(optimizer) not in (torch.optim.AdamW, dispatch.AdamW) or not fq.config.jacquant.b_in_adamw:
        return False
    group = next(g for g in optimizer.param_groups if any(p is w for p in g["params"]))
    plain = type(w) in (torch.Tensor, nn.Parameter) and w.dtype == torch.float32
    counts_on_device = w.device.type == "cpu" or group.get("fused") or group.get("capturable")
    return bool(plain and counts_on_device and fq.b is not None and fq.b.shape == w.shape
                and not group["amsgrad"] and not group["maximize"] and not group.get("differentiable")
                and not any(torch.is_tensor(beta) for beta in group["betas"]))


class CodeFlips:
    """The fraction of quantized weights whose integer code changed since the last call, over
    all of a model's fake-quantized weights and per weight: what learning moves across the
    rounding boundaries (STE's codes flip freely; a B near 0 parks a weight's code).

    The codes it compares against are held here, on the weights' device, packed as lowbit
    stores them (`FakeQuantWeight.pack`: a quarter of a byte a weight at int2, with its group
    scales), one layer unpacked at a time when they are compared; not in the checkpoint: a
    resumed run takes them anew at its first step, and its first record after the resume
    leaves code_flips out."""

    def __init__(self, model: nn.Module) -> None:
        self.weights = [(name, module.parametrizations[pname].original, fq)
                        for name, module, pname, fq in fake_quantizers(model)]
        self.previous = self._codes()   # the codes at step 0 of a fresh run
        self.first_step: int | None = None

    @torch.no_grad()
    def _codes(self) -> list[QTensor]:
        return [fq.pack(weight) for _, weight, fq in self.weights]

    def stepped(self, step: int) -> None:
        """Called at each step the hook records nothing: a first step past 1 is a resumed run,
        whose codes at hook creation were the source model's, not its checkpoint's."""
        if self.first_step is None:
            self.first_step = step
            if step != 1:
                self.previous = self._codes()

    def since_last(self, step: int) -> dict[str, float]:
        """{"qat/code_flips": fraction changed, "qat/layer/<name>/code_flips": ...}; empty on a
        resumed run's first record."""
        resumed_here = self.first_step is None and step != 1
        self.first_step = step if self.first_step is None else self.first_step
        codes = self._codes()
        previous, self.previous = self.previous, codes
        if resumed_here:
            return {}
        out: dict[str, float] = {}
        changed = total = 0
        for (name, _, _), now, before in zip(self.weights, codes, previous):
            now_codes = now.unpacked_codes()
            # .to: a model moved after the hook was made
            n = int((now_codes != before.unpacked_codes().to(now_codes.device)).sum())
            out[f"qat/layer/{name}/code_flips"] = n / now_codes.numel()
            changed, total = changed + n, total + now_codes.numel()
        return {"qat/code_flips": changed / max(total, 1), **out}


@torch.no_grad()
def scale_updates(pairs: list[tuple[torch.Tensor, FakeQuantWeight]], before: list[torch.Tensor]) -> None:
    """FakeQuantWeight.scale_update for every (latent weight, its fake quantizer) pair after an
    optimizer step, `before` holding each weight as it was before the step. The float32 weights
    with one B per element (the default) take three multi-tensor passes over all of them at
    once, W -= W_before; W *= B; W += W_before: the float32 operations of scale_update in its
    order, so the same bits in a few launches instead of several per weight; a uint8 B per
    element the same way, times its level, then divided by the levels per unit (no decoded copy
    of B; within a float32 rounding of scale_update's product). The others go one at a time."""
    per_element = [i for i, (w, fq) in enumerate(pairs) if w.dtype == torch.float32 and fq.b.shape == w.shape]
    for group in ([i for i in per_element if pairs[i][1].b.dtype != torch.uint8],
                  [i for i in per_element if pairs[i][1].b.dtype == torch.uint8]):
        if not group:
            continue
        weights, befores = [pairs[i][0] for i in group], [before[i] for i in group]
        torch._foreach_sub_(weights, befores)
        torch._foreach_mul_(weights, [pairs[i][1].b for i in group])
        if pairs[group[0]][1].b.dtype == torch.uint8:
            torch._foreach_div_(weights, [float(pairs[i][1].config.jacquant.uint8_levels_per_unit)
                                          for i in group])
        torch._foreach_add_(weights, befores)
    for i in sorted(set(range(len(pairs))) - set(per_element)):
        pairs[i][1].scale_update(pairs[i][0], before[i])


def _set_observing(model: nn.Module, on: bool) -> None:
    for _, _, _, fq in fake_quantizers(model):
        fq.set_observing(on)


def jacquant_metrics(model: nn.Module) -> dict[str, float]:
    """B's statistics, per layer and over all layers ("b/mean", "b/<layer>/near_zero", ...):
    each a mean over a layer's B, so the model's are the layers' weighted by their sizes (no
    copy of every B at once)."""
    out: dict[str, float] = {}
    totals: dict[str, float] = {}
    count = 0
    for name, _, _, fq in fake_quantizers(model):
        if fq.b is None:
            continue
        stats = b_statistics(fq.b_values(), fq.config.jacquant.b_max)
        for key, value in stats.items():
            out[f"b/{name}/{key}"] = value
            totals[key] = totals.get(key, 0.0) + value * fq.b.numel()
        count += fq.b.numel()
    for key, value in totals.items():
        out[f"b/{key}"] = value / count
    return out


@torch.no_grad()
def convert(model: nn.Module) -> int:
    """Replace every fake-quantized weight by its packed QTensor, in place; returns how many.
    The model's outputs stay exactly those of the prepared model (eval mode)."""
    targets = fake_quantizers(model)
    if not targets and next(_parametrized(model, PackedWeight), None) is not None:
        raise ValueError("lowbit.qat.convert: the model is already converted (its weights are "
                         "packed); use it as it is, or save them with "
                         "lowbit.save_qtensors(path, packed_weights(model))")
    if not targets:
        raise ValueError("lowbit.qat.convert: the model has no fake-quantized weight; "
                         "run lowbit.qat.prepare (and train) first")
    packed = [(module, pname, fq.pack(module.parametrizations[pname].original))
              for _, module, pname, fq in targets]
    for _, _, _, fq in targets:
        if fq.observer is not None:
            fq.observer.remove()
    for module, pname, q in packed:
        _set_packed(module, pname, q)
    return len(packed)


def _set_packed(module: nn.Module, pname: str, q: QTensor) -> None:
    if parametrize.is_parametrized(module, pname):
        parametrize.remove_parametrizations(module, pname, leave_parametrized=False)
    placeholder = nn.Parameter(torch.empty(0, device=q.device, dtype=q.dtype), requires_grad=False)
    delattr(module, pname)
    module.register_parameter(pname, placeholder)
    parametrize.register_parametrization(module, pname, PackedWeight(q), unsafe=True)


def packed_weights(model: nn.Module) -> dict[str, QTensor]:
    """The packed weights of a converted model, by parameter name (e.g. 'layers.0.attn.q_proj.weight')."""
    return {name: p.qtensor for name, _, _, p in _parametrized(model, PackedWeight)}


def load_packed(model: nn.Module, path: str | os.PathLike, device: str | torch.device = "cpu") -> int:
    """Put the packed weights save_qtensors wrote (from packed_weights) into a freshly built
    model of the same architecture; returns how many."""
    tensors = load_qtensors(path, device)
    for name, q in tensors.items():
        module_name, _, pname = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        current = getattr(module, pname, None)
        if current is None or tuple(current.shape) != tuple(q.shape):
            raise ValueError(f"{path}: {name} has shape {tuple(q.shape)}, the model's is "
                             f"{None if current is None else tuple(current.shape)}")
        _set_packed(module, pname, q)
    return len(tensors)

