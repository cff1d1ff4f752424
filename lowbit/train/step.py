"""One optimizer step, as every lowbit job runs it: `lowbit train`, `lowbit bench train`, QAT
and RL.

    step = TrainStep(model, optimizer, StepConfig.of(train_config), process, loss_fn=loss_fn)
    result = step(i, batch)     # the global batch of optimizer step i (0-based)

A batch is a tuple of tensors whose first dimension is the rows (a NamedTuple reads better;
entries may be None): `lowbit train`'s is (inputs, targets), RL's a GRPOBatch of token ids,
old log-probs and advantages. loss_fn(model, micro_batch) gives one micro-batch's scalar loss,
`model` being the model as the step runs it (DDP-wrapped, compiled); the default,
next_token_loss, is the model output's .loss (cross-entropy). QAT's distillation
(lowbit.qat.distill) and GRPO's clipped loss (lowbit.rl.trainer) are other loss functions.

What one call does:
  lr = learning_rate_at(i)                     linear warmup, then cosine down to min_lr
  rows = this process's share of the batch     (lowbit.train.distributed)
  for each of grad_accum_steps micro-batches:  forward (bf16 autocast on CUDA),
                                               backward of loss / grad_accum_steps
  grad_norm = clip_grad_norm_(grad_clip)
  (FP8-GEMM recipes: if a sync-free operand fold was inexact, redo the above exactly, or as
   fold_inexact says: lowbit.train.fold_policy)
  if loss and grad_norm are finite: optimizer step; else skip it (a nonfinite_skip record)
With cuda_graph the forwards, backwards and clip are one CUDA graph replay
(lowbit.train.graphs), captured at the first call; with compile the model runs through
torch.compile. The loss, gradient norm and inexact-fold count come back in one readback.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn

from lowbit import dispatch
from lowbit.config import require
from lowbit.dispatch.fold_check import deferred_fold_check, watch_chunked_folds
from lowbit.train.config import require_optimizer
from lowbit.train.distributed import Distributed
from lowbit.train.fold_policy import FoldPolicy
from lowbit.train.graphs import (GraphedGradients, accumulate_gradients, clip_gradients, cuda_graph_refusal,
                                 map_batch, split_batch)

__all__ = ["TrainStep", "StepConfig", "StepResult", "LossFn", "next_token_loss",
           "learning_rate_at", "refuse_cuda_graph", "refuse_compile"]

LossFn = Callable[[Callable, tuple], torch.Tensor]
"""loss_fn(model, micro_batch) -> one micro-batch's scalar loss; `model` is the step's forward
(the model wrapped and compiled as the step runs it), `micro_batch` a slice of the step's batch
in the batch's own type."""


def next_token_loss(model: Callable, batch: tuple) -> torch.Tensor:
    """The language-modelling loss: the model's own .loss on (inputs, targets) (cross-entropy,
    plus an MoE model's load-balancing term)."""
    inputs, targets = batch
    return model(inputs, targets).loss


@dataclass(frozen=True)
class StepConfig:
    """What the optimizer step needs: the batch, the LR schedule, the optimizer's settings, clipping,
    and how the model runs. `lowbit train` and QAT take it from their TrainConfig
    (StepConfig.of); RL builds its own (a constant LR, its micro-batches)."""

    batch_size: int
    """Rows per micro-batch, over all processes."""
    lr: float
    total_steps: int
    """Optimizer steps the schedule spans (its cosine reaches min_lr on the last)."""
    grad_accum_steps: int = 1
    warmup_steps: int = 0
    min_lr_ratio: float = 1.0
    """The cosine decay ends at lr * min_lr_ratio (1.0: a constant LR after the warmup)."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    optimizer: str = "adamw"
    """adamw or sgd (lowbit.train.config.TrainConfig.optimizer)."""
    momentum: float = 0.9
    """SGD's momentum."""
    grad_clip: float = 1.0
    """Clip the gradient norm to this (0: no clipping)."""
    bf16_autocast: bool = True
    """On CUDA, run the forward under bf16 autocast."""
    compile: bool = False
    cuda_graph: bool = False
    fold_inexact: str = "redo"
    """FP8-GEMM recipes' inexact one-chunk folds: redo, adapt or round (lowbit.train.fold_policy)."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "grad_accum_steps", "total_steps"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1 (got {getattr(self, name)})")
        require(0 <= self.warmup_steps <= self.total_steps,
                f"warmup_steps must be in [0, total_steps] (got {self.warmup_steps})")
        require_optimizer(self.optimizer, self.momentum)

    @classmethod
    def of(cls, config) -> StepConfig:
        """The step settings of a TrainConfig (or any object with these fields' names)."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})


def learning_rate_at(step: int, config: StepConfig) -> float:
    """LR of optimizer step `step` (0-based): linear warmup to config.lr over warmup_steps
    steps, then a cosine from config.lr to lr * min_lr_ratio, reached on the last step.
    (A TrainConfig has the same fields and gives the same schedule.)"""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_steps = config.total_steps - 1 - config.warmup_steps
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - config.warmup_steps) / decay_steps)
    min_lr = config.lr * config.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (config.lr - min_lr)


def refuse_compile(device: torch.device) -> None:
    """Raise the one-line reason (ValueError) why --compile cannot run on `device`, if there is
    one, before a run builds anything: torch.compile writes C++ for the CPU, which needs a
    working C++ compiler (the one torch's inductor finds: CXX, else g++ or clang++), and Triton
    kernels for a GPU."""
    if device.type == "cpu":
        from torch._inductor import cpp_builder
        try:
            cpp_builder.get_cpp_compiler()
        except Exception:   # inductor's InvalidCxxCompiler, or a compiler that fails to run
            raise ValueError("--compile on the CPU needs a C++ compiler (torch.compile writes C++ "
                             "there) and found none that works: install g++ or set CXX to one, "
                             "or drop --compile") from None
    elif device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ValueError("--compile on a GPU needs Triton (torch.compile writes Triton kernels): "
                         "pip install triton, or drop --compile")


def refuse_cuda_graph(process: Distributed, model: nn.Module | None = None,
                      bf16_autocast: bool = True) -> None:
    """Raise the one-line reason (ValueError) why --cuda-graph cannot run here, if there is one
    (with `model`, on the device with its recipe applied: its MoE experts' too)."""
    refusal = cuda_graph_refusal(process.device, world_size=process.world_size, model=model,
                                 bf16_autocast=bf16_autocast)
    if refusal:
        raise ValueError(refusal)


@dataclass
class StepResult:
    loss: float
    """The step's mean loss over its micro-batches (averaged over the processes)."""
    grad_norm: float
    """The gradient norm before clipping."""
    lr: float
    skipped: bool
    """The loss or gradient norm was NaN/Inf, so the update was not applied."""
    capture_s: float = 0.0
    """Seconds spent warming up and capturing the CUDA graph in this call (not step time)."""
    records: list[dict] = field(default_factory=list)
    """Events for the metrics log: cuda_graph_captured, fold_rounded, fold_redo, fold_adapted,
    nonfinite_skip (each with "event" and "step")."""
    messages: list[str] = field(default_factory=list)
    """What to tell the user about them."""
    first_micro_batch: tuple | None = None
    """This process's first micro-batch of the step, on the device (for diagnostics)."""


class TrainStep:
    """The optimizer step of a run. It owns how the model is run (wrapped for DDP, compiled,
    under autocast, captured), the step's fold policy and its count of non-finite steps in a
    row; the caller owns the data, the schedule's position and everything around the step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: StepConfig,
                 process: Distributed | None = None, fold_policy: FoldPolicy | None = None,
                 loss_fn: LossFn = next_token_loss) -> None:
        """process: this process's place under torchrun (lowbit.train.distributed); None: one
        process, on the device of the model's parameters."""
        if process is None:
            process = Distributed(device=next(model.parameters()).device)
        self.model, self.optimizer, self.config, self.process = model, optimizer, config, process
        self.loss_fn = loss_fn
        self.device = process.device
        self.fold = fold_policy if fold_policy is not None else FoldPolicy(config.fold_inexact, model)
        # `model` stays the plain module: its state dict is what checkpoints hold.
        wrapped = process.wrap(model)
        self.forward = torch.compile(wrapped) if config.compile else wrapped
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16)
                         if self.device.type == "cuda" and config.bf16_autocast
                         else contextlib.nullcontext())
        self.max_norm = config.grad_clip if config.grad_clip > 0 else math.inf
        # lowbit's AdamW takes the clip's coefficient inside its step (no pass over the gradients)
        self.grad_coef = (torch.ones((), dtype=torch.float32, device=self.device)
                          if isinstance(optimizer, dispatch.AdamW) else None)
        self.graphed: GraphedGradients | None = None   # --cuda-graph: captured at the first call
        self.nonfinite_run = 0
        """Optimizer steps in a row whose loss or gradient norm was not finite."""

    def loss(self, batch: tuple) -> torch.Tensor:
        """One micro-batch's loss, as the step computes it."""
        with self.autocast:
            return self.loss_fn(self.forward, batch)

    def __call__(self, step: int, batch: tuple) -> StepResult:
        """Optimizer step `step` (0-based) on its global batch (batch_size * grad_accum_steps
        rows)."""
        config, process, device = self.config, self.process, self.device
        accum = config.grad_accum_steps
        rows = next(t for t in batch if t is not None).shape[0]
        if rows != config.batch_size * accum:
            raise ValueError(f"the data gave {rows} sequences for step {step}; "
                             f"batch_size * grad_accum_steps = {config.batch_size * accum}")
        lr = learning_rate_at(step, config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = map_batch(lambda t: process.shard(t).to(device), batch)
        result = StepResult(0.0, 0.0, lr, False, first_micro_batch=split_batch(batch, accum)[0])

        # FP8-path recipes fold their operands without host syncs (one K-chunk each) and count
        # on the device what that left inexact; the count is read with the step's loss (one
        # all-reduce, one readback). A nonzero one (on any rank) is handled by the fold policy.
        rng_before = self._rng_state()
        if config.cuda_graph:
            if self.graphed is None:
                t = time.perf_counter()
                self.graphed = self._capture(batch)
                result.capture_s = time.perf_counter() - t
                result.records.append({"event": "cuda_graph_captured", "step": step + 1,
                                       "seconds": result.capture_s})
                result.messages.append(f"step {step + 1}: captured the step in a CUDA graph "
                                       f"({result.capture_s:.1f} s)")
            step_loss, grad_norm, count = self.graphed(batch)
            loss, grad_norm, inexact = torch.stack(
                [step_loss.double(), grad_norm.double(), count[0].double()]).tolist()
        else:
            with deferred_fold_check(device) as check:
                step_loss, grad_norm = self._gradients(batch)
            loss, inexact = process.average(
                torch.stack([step_loss.double(), check.counter[0].double()])).tolist()
        inexact = round(inexact * process.world_size)
        if inexact and not self.fold.redoes:
            result.records.append({"event": "fold_rounded", "step": step + 1,
                                   "inexact_values": inexact})
        elif inexact:
            self._set_rng_state(rng_before)
            with watch_chunked_folds() as chunked:
                step_loss, grad_norm = self._gradients(batch)
            result.records.append({"event": "fold_redo", "step": step + 1,
                                   "inexact_values": inexact})
            loss = process.average(step_loss).item()
            if self.fold.watches:
                moved = self.fold.adapt(process.union(list(chunked)))
                if moved:
                    self.graphed = None   # the next step is captured with the new recipes
                    result.records.append({"event": "fold_adapted", "step": step + 1,
                                           "layers": moved})
                    result.messages.append(
                        f"step {step + 1}: {len(moved)} layer(s) need K-chunked FP8 folds; they "
                        f"now multiply on the emulated path: {', '.join(moved)}")
        result.loss, result.grad_norm = loss, grad_norm
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self._optimizer_step()
            self.nonfinite_run = 0
        else:
            self.nonfinite_run += 1
            result.skipped = True
            result.records.append({"event": "nonfinite_skip", "step": step + 1, "loss": loss,
                                   "grad_norm": grad_norm, "lr": lr,
                                   "in_a_row": self.nonfinite_run})
            result.messages.append(f"step {step + 1}: non-finite loss {loss} / grad norm "
                                   f"{grad_norm}, update skipped ({self.nonfinite_run} in a row)")
        return result

    def _gradients(self, batch: tuple) -> tuple[torch.Tensor, float]:
        """Forward and backward of every micro-batch, then clip: (loss, grad norm)."""
        accum, process = self.config.grad_accum_steps, self.process
        if self.graphed is not None:   # the graph's gradient buffers stay in place
            self.graphed.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        step_loss = accumulate_gradients(  # DDP/FSDP sync the last backward only
            self.loss, batch, accum,
            sync=lambda i: process.sync_gradients(i == accum - 1, self.model))
        grad_norm = clip_gradients(list(self.model.parameters()), self.max_norm, self.grad_coef)
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor over the shards' norms
            grad_norm = grad_norm.full_tensor()
        return step_loss, grad_norm.item()

    def _optimizer_step(self) -> None:
        """The optimizer's step, handed the clip's coefficient where it takes it (as GradScaler
        hands a fused optimizer its scale: set for the step, deleted after)."""
        if self.grad_coef is None:
            self.optimizer.step()
            return
        self.optimizer.grad_coef = self.grad_coef
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.grad_coef

    def _capture(self, batch: tuple) -> GraphedGradients:
        """The step's gradients as one CUDA graph (lowbit.train.graphs), built on its first batch."""
        # a captured step must not use autocast's cast cache: it is cleared outside the graph
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False,
                                  enabled=self.config.bf16_autocast and self.device.type == "cuda")

        def loss_fn(micro_batch):
            with autocast:
                return self.loss_fn(self.forward, micro_batch)

        return GraphedGradients(self.model, loss_fn, batch, accum=self.config.grad_accum_steps,
                                max_norm=self.max_norm, grad_coef=self.grad_coef)

    def _rng_state(self) -> tuple:
        """What a training step draws from: torch's CPU generator and the device's. (Not
        checkpoint.rng_state(): that takes every GPU's state, touching every GPU from every
        rank, and Python's and NumPy's generators, which a step does not draw from.)"""
        return (torch.get_rng_state(),
                torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)

    def _set_rng_state(self, state: tuple) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)
