"""A training step's gradients replayed from one CUDA graph (`lowbit train --cuda-graph`,
`lowbit bench train --cuda-graph`).

Eager, a quantized step launches several kernels per linear layer from Python, and on a ~1B
model the GPU then waits on the host (the step times with and without this are in
docs/results/README.md). GraphedGradients captures the forward and backward of every
micro-batch of a step and the gradient clip once, and replays them: one launch per step. The
optimizer step stays eager (fused AdamW is a few launches), so the learning rate stays a plain
float and a step whose loss is not finite is skipped as before.

What the capture needs, and how it is kept:
- static tensors: the step's batch is copied into buffers of its shapes; the gradients are
  the tensors the captured backward allocated (from the graph's pool), which every replay
  writes afresh; a caller that replaced a parameter's .grad (a diagnostic's own backward)
  gets it pointed back before each replay;
- no host syncs inside: the FP8 folds run under a deferred fold check captured with the
  graph, whose count (zeroed by each replay) comes back with the loss and gradient norm;
- randomness (dropout, stochastic rounding's seeds) draws from the CUDA generator, which
  PyTorch advances on every replay as eager kernels would advance it; the warm-up runs
  and the capture run under fork_rng, so building the graph draws nothing;
- autocast without its cast cache (the cache is cleared outside the graph).
A torch.compile'd model (default mode) is captured the same way: the warm-up runs compile
it, and the capture records the compiled kernels and lowbit's custom ops; its folds' count goes
to the check opened inside the capture, which this class reads (torch.compile's own graph mode,
"reduce-overhead", is refused: see lowbit.ops.compiled). Compiled, the step has fewer and
fused kernels; captured, none of its host work (dynamo's guards, the ops' Python) is left in
the step.
It cannot hold: work that reads values back to the host (MoE experts run one at a time,
whose token counts are read back: experts_refusal says which; on the grouped GEMM they read
nothing back), or DDP's and FSDP's collectives (one process only here). On the CPU nothing is
captured and each call runs the same body (its gradients new tensors each time), so the
bookkeeping around the graph is tested without a GPU.

Memory: the graph keeps its forward and backward working set reserved between replays, and a
step redone eagerly (an inexact FP8 fold under fold_inexact "redo" or "adapt"), an
evaluation or a diagnostic allocates its own beside it; a model that only just fits eagerly
may not fit then.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn

from lowbit.dispatch.fold_check import deferred_fold_check
from lowbit.models.moe import Experts

__all__ = ["GraphedGradients", "accumulate_gradients", "clip_gradients", "cuda_graph_refusal", "experts_refusal",
           "map_batch", "split_batch"]


def map_batch(fn, batch: tuple) -> tuple:
    """fn applied to every tensor of a step's batch (a tuple or NamedTuple of tensors sharing
    their first dimension, the rows; None entries stay None), in the batch's own type."""
    return _like(batch, [None if t is None else fn(t) for t in batch])


def split_batch(batch: tuple, parts: int) -> list[tuple]:
    """A step's batch as `parts` micro-batches of consecutive rows (torch.chunk's split)."""
    chunks = [[None] * parts if t is None else t.chunk(parts) for t in batch]
    return [_like(batch, [c[i] for c in chunks]) for i in range(parts)]


def _like(batch: tuple, items: list) -> tuple:
    """`items` as a batch of batch's type (a NamedTuple's fields by position)."""
    return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)


def accumulate_gradients(loss_fn, batch: tuple, accum: int, sync=None) -> torch.Tensor:
    """Forward and backward of each of the step's `accum` micro-batches (the batch's rows
    split in order), gradients accumulated in .grad; returns the step's mean loss, a device
    scalar (no readback). loss_fn(micro_batch) -> scalar. sync(i), if given, is the context
    micro-batch i runs in (DDP's no_sync until the last backward); a captured step passes none."""
    device = next(t for t in batch if t is not None).device
    step_loss = torch.zeros((), device=device)
    for i, micro_batch in enumerate(split_batch(batch, accum)):
        with sync(i) if sync is not None else contextlib.nullcontext():
            loss = loss_fn(micro_batch) / accum   # mean over the step's tokens
            loss.backward()
        step_loss += loss.detach()
    return step_loss


def cuda_graph_refusal(device: torch.device, *, world_size: int = 1, model: nn.Module | None = None,
                       bf16_autocast: bool = True) -> str | None:
    """Why a step on this setup cannot be captured (a message naming the flag to change), or
    None when it can. With `model` (on `device`, its recipe applied): also an MoE layer whose
    experts would run one at a time, reading their token counts back to the host."""
    if device.type != "cuda":
        return f"--cuda-graph captures the step on a CUDA GPU; this run is on {device}"
    if world_size > 1:
        return (f"--cuda-graph runs one process; under torchrun ({world_size} processes) DDP's "
                "and FSDP's collectives are not captured: drop --cuda-graph")
    return None if model is None else experts_refusal(model, device, bf16_autocast)


def experts_refusal(model: nn.Module, device: torch.device, bf16_autocast: bool) -> str | None:
    """Why `model`'s MoE experts keep a step on `device` from being captured: the first expert
    layer that would run expert by expert (lowbit.models.moe.Experts.runs_grouped), whose token
    counts are read back to the host; None when every one runs grouped (or there is none)."""
    for name, module in model.named_modules():
        if isinstance(module, Experts) and not module.runs_grouped(device, bf16_autocast):
            return (f"--cuda-graph needs MoE experts on the grouped GEMM, which reads nothing "
                    f"back to the host; {name} would run expert by expert (the grouped GEMM "
                    f"takes bf16 autocast on a Hopper or later GPU, expert widths a multiple of "
                    f"8 (on FP8 GEMMs 16, and the weight tile's side; FP8 recipes with no "
                    f"tensor scale or Hadamard transform on the tokens' operands)): drop --cuda-graph")
    return None


def clip_gradients(params, max_norm: float, coef: torch.Tensor | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_: the gradients' total 2-norm before clipping (returned) and
    the coefficient min(1, max_norm / (norm + 1e-6)), the gradients multiplied by it in place;
    or, given `coef` (a 0-d float32 an optimizer takes inside its step: lowbit.dispatch.AdamW's
    grad_coef), the coefficient written into it and the gradients left as they are. The same
    norm and coefficient either way (torch's get_total_norm and its clamp), no host
    synchronisation."""
    if coef is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    coef.copy_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


class GraphedGradients:
    """`grads(batch) -> (loss, grad_norm, inexact)`, all device scalars: the mean loss over
    the step's micro-batches, the gradient norm before clipping (gradients clipped to
    `max_norm` in place, or the clip's coefficient written into `grad_coef`: clip_gradients),
    and the count of values the sync-free FP8 folds left inexact
    (nonzero: redo the step's gradients eagerly with exact folds). batch: the whole step's, on
    the device (see map_batch); its rows split into `accum` micro-batches."""

    def __init__(self, model: nn.Module, loss_fn, batch: tuple, *, accum: int = 1,
                 max_norm: float = math.inf, warmup: int = 2, grad_coef: torch.Tensor | None = None):
        """loss_fn(micro_batch) -> the scalar loss of one micro-batch; any autocast goes inside
        it, with cache_enabled=False. `batch` (a first step's) shapes the buffers and warms the
        kernels up (Triton compiles, cuBLAS picks) in `warmup` eager runs (at least 2: the
        exact folds' kernels, then the sync-free ones); every later step must have the same
        shapes."""
        device = next(t for t in batch if t is not None).device
        params = [p for p in model.parameters() if p.requires_grad]
        self.batch = map_batch(torch.clone, batch)
        self.accum, self.max_norm, self.device, self.grad_coef = accum, max_norm, device, grad_coef
        self._loss_fn = loss_fn
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.graph = None
        cuda = device.type == "cuda"
        with self._on_device(), torch.random.fork_rng(devices=[device] if cuda else []):
            if not cuda:   # nothing to capture: each call runs the body (tests of the rest)
                self._warm_up(params, warmup)
                return
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self._warm_up(params, warmup)
            torch.cuda.current_stream(device).wait_stream(side)
            # the capture allocates from its own pool: give it the warm-up's freed memory
            self._drop_grads()
            torch.cuda.empty_cache()
            self.graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(self.graph, stream=torch.cuda.Stream(device)):
                    self.loss, self.grad_norm, self.inexact = self._body()
            except RuntimeError as e:
                raise ValueError(
                    "--cuda-graph could not capture this model's step: something in it reads a "
                    "value back to the host or changes shape with the data (MoE routing, say); "
                    f"drop --cuda-graph ({type(e).__name__}: {str(e)[:300]})") from e

    def __call__(self, batch: tuple):
        if _shapes(batch) != _shapes(self.batch):
            raise ValueError(f"a CUDA-graphed step takes batches of {_shapes(self.batch)}, the "
                             f"shapes it was captured with; got {_shapes(batch)}")
        with self._on_device():
            for buffer, t in zip(self.batch, batch):
                if buffer is not None:
                    buffer.copy_(t)
            self._point_grads()
            if self.graph is None:
                return self._body()
            self.graph.replay()
        return self.loss, self.grad_norm, self.inexact

    def zero_grad(self) -> None:
        """Zero the gradient buffers in place (an eager redo accumulates into the same ones)."""
        self._point_grads()
        torch._foreach_zero_([g for g in self.grads if g is not None])

    def _on_device(self):
        """The inputs' GPU as the current device: capture streams and replays are per device."""
        return (torch.cuda.device(self.device) if self.device.type == "cuda"
                else contextlib.nullcontext())

    def _warm_up(self, params: list[torch.Tensor], runs: int) -> None:
        for p in params:
            p.grad = None
        self._micro_batches()                 # creates every used parameter's .grad
        # A parameter the loss does not use keeps .grad None, as eager (AdamW skips it); the
        # captured backward could never give it one.
        self.params = [p for p in params if p.grad is not None]
        self.grads = [p.grad for p in self.params]
        for _ in range(max(runs - 1, 1)):
            self._body()

    def _drop_grads(self) -> None:
        """No gradient held, by the parameters or here: the backward's new ones do not sit
        beside the old (two sets of a large model's gradients)."""
        for p in self.params:
            p.grad = None
        self.grads = []

    def _point_grads(self) -> None:
        for p, g in zip(self.params, self.grads):
            if p.grad is not g:
                p.grad = g

    def _micro_batches(self) -> torch.Tensor:
        return accumulate_gradients(self._loss_fn, self.batch, self.accum)

    def _body(self):
        # The backward assigns each gradient afresh, as eager after zero_grad(set_to_none=True):
        # no zeroing pass and no adding into a zeroed buffer (docs/results/history.md).
        # Inside the capture these tensors come from the graph's pool, and every replay
        # writes them again: they are the step's gradient buffers from then on.
        self._drop_grads()
        with deferred_fold_check(self.device) as check:
            step_loss = self._micro_batches()
        self.grads = [p.grad for p in self.params]
        grad_norm = clip_gradients(self.params, self.max_norm, self.grad_coef)
        return step_loss, grad_norm, check.counter


def _shapes(batch: tuple) -> list:
    return [None if t is None else tuple(t.shape) for t in batch]
