"""The pretraining loop: `train(config) -> RunResult`, readable top to bottom.

One optimizer step:
  lr = learning_rate_at(step)                  linear warmup, then cosine down to min_lr
  for each of grad_accum_steps micro-batches:  forward (bf16 autocast on CUDA),
                                               backward of loss / grad_accum_steps
  grad_norm = clip_grad_norm_(grad_clip)
  (FP8-GEMM recipes: if a sync-free operand fold was inexact, redo the above exactly; with
   fold_inexact="adapt" also move the layers that needed it off the FP8 GEMMs; with "round"
   keep the step and log the count)
  if loss and grad_norm are finite: AdamW step; else skip it and log a nonfinite_skip record
Around it: evaluation every eval_every steps, a checkpoint every checkpoint_every steps,
a record in metrics.jsonl every log_every steps, and diagnostics every diag_every steps.

Determinism: the model is initialized from `seed`, the batch of step i is a pure function of
(seed, i), and dropout draws from the torch RNG whose state the checkpoint saves; nothing
else draws from it (evaluation runs in eval mode, diagnostics under fork_rng). So on the CPU,
N steps + resume + N steps gives the same losses, bit for bit, as 2N steps in one go.

Under torchrun the same loop runs in every process, with DDP and each rank's share of the
step's batch; lowbit.train.distributed says exactly what changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from lowbit.kernels.fp8_gemm import deferred_fold_check, watch_chunked_folds
from lowbit.train.checkpoint import (CHECKPOINT_VERSION, checkpoint_path, load_checkpoint,
                                     rng_state, save_checkpoint, set_rng_state, write_text_atomic)
from lowbit.train.config import TrainConfig, changed_fields, resolve_device
from lowbit.train.distributed import Distributed, set_own_cuda_rng_state, setup
from lowbit.train.graphs import accumulate_gradients
from lowbit.train.metrics import MetricsLog

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs, targets: LongTensor (B, T) each
DiagnosticsFn = Callable[[nn.Module, Batch, int], dict]


class TrainingData(Protocol):
    """What the loop needs from a dataset (lowbit.data's, or a stand-in in tests)."""

    vocab_size: int

    def train_batch(self, step: int) -> Batch:
        """All batch_size * grad_accum_steps sequences of optimizer step `step`, (rows, seq_len);
        a pure function of (seed, step), which is what makes resume exact."""

    def eval_batches(self) -> Iterable[Batch]:
        """The validation micro-batches, the same ones on every call."""


class NonFiniteLossError(RuntimeError):
    """Raised after config.max_consecutive_nonfinite optimizer steps in a row had a NaN/Inf
    loss or gradient norm. The last checkpoint on disk is the one from before they began."""

    def __init__(self, message: str, step: int, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    """Optimizer steps completed (skipped non-finite steps included)."""
    tokens_seen: int
    train_losses: list[float]
    """The training loss of every step from the first, as Python floats (NaN/Inf kept)."""
    final_train_loss: float
    """Mean training loss over the last (up to) 10 finite steps: one step's loss is noisy."""
    val_loss: float
    val_ppl: float
    wall_time_s: float
    """Training wall time summed over all sessions of the run (resumes included)."""


def learning_rate_at(step: int, config: TrainConfig) -> float:
    """LR of optimizer step `step` (0-based): linear warmup to config.lr over warmup_steps
    steps, then a cosine from config.lr to lr * min_lr_ratio, reached on the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_steps = config.total_steps - 1 - config.warmup_steps
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - config.warmup_steps) / decay_steps)
    min_lr = config.lr * config.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (config.lr - min_lr)


def train(
    config: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    model: nn.Module | None = None,
    data: TrainingData | None = None,
    diagnostics_fn: DiagnosticsFn | None = None,
) -> RunResult:
    """Train as `config` says, in `<out_dir>/<name>/`, and return the final numbers.

    resume: continue the run folder's checkpoint (refused if the folder has none, or if the
        saved config differs in a field that changes the run).
    overwrite: start over in a run folder that already holds a run (otherwise refused).
    model, data: use these instead of building config.model / config.corpus; the model must
        map (idx, targets) to an output with .loss and .logits, like lowbit.models', and is
        converted in place when config.recipe is not "bf16".
    diagnostics_fn: called as fn(model, first micro-batch, step) every diag_every steps,
        after the update; its dict of numbers is logged as a "diagnostics" record.

    Launched by torchrun, every process calls this: see lowbit.train.distributed.
    """
    process = setup(resolve_device(config.device))
    try:
        if config.batch_size % process.world_size:
            raise ValueError(f"batch_size ({config.batch_size}) must be a multiple of the "
                             f"{process.world_size} processes, which split each micro-batch")
        return _train(config, process, resume, overwrite, model, data, diagnostics_fn)
    finally:
        process.close()


def _train(config: TrainConfig, process: Distributed, resume: bool, overwrite: bool,
           model: nn.Module | None, data: TrainingData | None,
           diagnostics_fn: DiagnosticsFn | None) -> RunResult:
    # Everything that can refuse the run does so before the run folder is touched.
    device, main = process.device, process.is_main
    recipe = _resolve_recipe(config.recipe)
    run_dir = Path(config.out_dir) / config.name
    checkpoint = _check_run_dir(run_dir, config, resume, overwrite)
    if config.cuda_graph:
        _refuse_cuda_graph(config, process, bool(config.n_experts))
    say = tqdm.write if config.progress and main else (lambda message: None)
    if diagnostics_fn is None and config.diagnostics and config.recipe != "bf16":
        diagnostics_fn = _recipe_diagnostics

    # --- build: data, model (seeded init), recipe, optimizer --------------------------------
    _seed_everything(config.seed)
    with process.main_first():  # rank 0 tokenizes and caches the corpus, the others read it
        data = data if data is not None else _build_data(config)
    epochs = _epochs(config, data)
    if main and epochs is not None and epochs > 3:  # printed even without progress output
        print(f"lowbit: warning: this run reads its training split {epochs:.1f} times (more than "
              f"~3 repeats overfits); use a larger corpus or fewer --steps", file=sys.stderr)
    _seed_everything(config.seed)  # so the init does not depend on what building data drew
    model = model if model is not None else _build_model(config, data.vocab_size)
    _apply_recipe(model, recipe, say)
    if config.fold_inexact == "adapt":
        _name_layers(model)
    model.to(device)
    if config.cuda_graph:   # again: a model passed in may be an MoE model
        _refuse_cuda_graph(config, process,
                           getattr(getattr(model, "config", None), "is_moe", False))
    if process.enabled and config.parallel == "fsdp":
        process.shard_model(model)  # before the optimizer takes its (now sharded) parameters
        if diagnostics_fn is not None:
            say("diagnostics are skipped under --parallel fsdp (see lowbit.train.distributed)")
            diagnostics_fn = None
    optimizer = torch.optim.AdamW(_param_groups(model, config.weight_decay), lr=config.lr,
                                  betas=config.betas,
                                  # FSDP's DTensor parameters take the foreach implementation
                                  fused=device.type == "cuda" and not process.fsdp)
    n_params = sum(p.numel() for p in model.parameters())
    process.barrier()  # every rank has checked the run folder before rank 0 changes it
    if main:
        _start_run_dir(run_dir, config, fresh=checkpoint is None)

    start_step, records, losses, wall_before, nonfinite_run = 0, [], [], 0.0, 0
    emulated_layers: list[str] = []   # --fold-inexact adapt: layers moved off the FP8 path
    resumed = checkpoint is not None
    if resumed:
        process.load_state_dicts(model, optimizer, checkpoint["model"], checkpoint["optimizer"])
        set_rng_state(checkpoint["rng"])
        set_own_cuda_rng_state(checkpoint["rng"], process)
        start_step, records = checkpoint["step"], checkpoint["metrics"]
        losses, wall_before = checkpoint["train_losses"], checkpoint["wall_time_s"]
        nonfinite_run = checkpoint["consecutive_nonfinite"]
        emulated_layers = _emulate_layers(model, checkpoint.get("fold_emulated_layers", []))
        del checkpoint  # the weights now live in the model; don't hold a second copy
    # `model` stays the plain module: its state dict is what checkpoints hold.
    forward = torch.compile(process.wrap(model)) if config.compile else process.wrap(model)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16)
                if device.type == "cuda" and config.bf16_autocast else contextlib.nullcontext())
    graphed = None   # --cuda-graph: GraphedGradients, captured at the first step

    max_norm = config.grad_clip if config.grad_clip > 0 else math.inf

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast:
            return forward(x, y).loss

    total = config.total_steps
    accum = config.grad_accum_steps
    last_eval = next((r for r in reversed(records) if r["event"] == "eval"), None)
    last_checkpoint = checkpoint_path(run_dir) if resumed else None
    say(f"{'resuming' if resumed else 'starting'} {run_dir} at step {start_step}/{total}: "
        f"{n_params / 1e6:.2f}M parameters, recipe {config.recipe}, {device}, "
        f"{config.tokens_per_step} tokens/step")

    log = MetricsLog(run_dir, records, start_step, say) if main else _NoLog()
    bar_on_terminal = config.progress and main and sys.stderr.isatty()
    bar = tqdm(total=total, initial=start_step, disable=not bar_on_terminal, unit="step",
               dynamic_ncols=True)
    t_session = time.perf_counter()
    window_time, window_steps = 0.0, 0  # training time since the last train record
    model.train()
    step = start_step  # optimizer steps completed
    try:
        while True:
            fresh = step > start_step or not resumed
            if fresh and (step == total or (config.eval_every and step % config.eval_every == 0)):
                val_loss = evaluate(forward, data.eval_batches(), device, autocast)
                last_eval = {"event": "eval", "step": step, "tokens": step * config.tokens_per_step,
                             "val_loss": val_loss, "val_ppl": _perplexity(val_loss)}
                log.write(last_eval)
                say(f"step {step}: val loss {val_loss:.4f}, ppl {last_eval['val_ppl']:.2f}")
            if step > start_step and (step == total or (
                    config.checkpoint_every and step % config.checkpoint_every == 0)):
                model_state, optimizer_state = process.state_dicts(model, optimizer)  # every rank
            else:
                model_state = None
            if main and model_state is not None:
                wall = wall_before + time.perf_counter() - t_session
                save_checkpoint({
                    "version": CHECKPOINT_VERSION, "step": step, "config": config.to_dict(),
                    "model": model_state, "optimizer": optimizer_state,
                    "rng": rng_state(), "metrics": log.records, "train_losses": losses,
                    "wall_time_s": wall, "consecutive_nonfinite": nonfinite_run,
                    "fold_emulated_layers": emulated_layers,
                }, checkpoint_path(run_dir))
                last_checkpoint = checkpoint_path(run_dir)
                write_loss_plot(run_dir)
            if step == total:
                break

            # --- one optimizer step ---------------------------------------------------------
            t0 = time.perf_counter()
            lr = learning_rate_at(step, config)
            for group in optimizer.param_groups:
                group["lr"] = lr
            inputs, targets = data.train_batch(step)  # (batch_size * accum, T)
            if inputs.shape[0] != config.batch_size * accum:
                raise ValueError(f"the data gave {inputs.shape[0]} sequences for step {step}; "
                                 f"batch_size * grad_accum_steps = {config.batch_size * accum}")
            inputs, targets = process.shard(inputs).to(device), process.shard(targets).to(device)
            micro_batches = list(zip(inputs.chunk(accum), targets.chunk(accum)))

            def gradients() -> tuple[torch.Tensor, float]:
                """Forward and backward of every micro-batch, then clip: (loss, grad norm)."""
                if graphed is not None:   # the graph's gradient buffers stay in place
                    graphed.zero_grad()
                else:
                    optimizer.zero_grad(set_to_none=True)
                step_loss = accumulate_gradients(  # DDP/FSDP sync the last backward only
                    loss_fn, inputs, targets, accum,
                    sync=lambda i: process.sync_gradients(i == accum - 1, model))
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor over the shards' norms
                    grad_norm = grad_norm.full_tensor()
                return step_loss, grad_norm.item()

            # FP8-path recipes fold their operands without host syncs (one K-chunk each) and
            # count on the device what that left inexact; the count is read with the step's
            # loss (one all-reduce, one readback). A nonzero one (on any rank) redoes the
            # step with exact folds from the same RNG state, so the step is the one an
            # all-exact run takes (with --fold-inexact adapt, the layers whose exact folds
            # needed K-chunks then leave the FP8 path), or with --fold-inexact round is
            # logged and kept.
            # With --cuda-graph the same work (one process) is one graph replay.
            rng_before = _step_rng_state(device)
            if config.cuda_graph:
                if graphed is None:   # its warm-up and capture are logged, not step time
                    t_capture = time.perf_counter()
                    graphed = _capture_step(model, forward, inputs, targets, config, max_norm)
                    seconds = time.perf_counter() - t_capture
                    t0 += seconds
                    log.write({"event": "cuda_graph_captured", "step": step + 1,
                               "seconds": seconds})
                    say(f"step {step + 1}: captured the step in a CUDA graph ({seconds:.1f} s)")
                step_loss, grad_norm, count = graphed(inputs, targets)
                loss_value, grad_norm, inexact = torch.stack(
                    [step_loss.double(), grad_norm.double(), count[0].double()]).tolist()
            else:
                with deferred_fold_check(device) as check:
                    step_loss, grad_norm = gradients()
                loss_value, inexact = process.average(
                    torch.stack([step_loss.double(), check.counter[0].double()])).tolist()
            inexact = round(inexact * process.world_size)
            if inexact and config.fold_inexact == "round":
                log.write({"event": "fold_rounded", "step": step + 1, "inexact_values": inexact})
            elif inexact:
                _set_step_rng_state(device, rng_before)
                with watch_chunked_folds() as chunked:
                    step_loss, grad_norm = gradients()
                log.write({"event": "fold_redo", "step": step + 1, "inexact_values": inexact})
                loss_value = process.average(step_loss).item()
                if config.fold_inexact == "adapt":
                    moved = _emulate_layers(model, process.union(list(chunked)))
                    if moved:
                        emulated_layers = sorted(emulated_layers + moved)
                        graphed = None   # the next step is captured with the new recipes
                        log.write({"event": "fold_adapted", "step": step + 1, "layers": moved})
                        say(f"step {step + 1}: {len(moved)} layer(s) need K-chunked FP8 folds; "
                            f"they now multiply on the emulated path: {', '.join(moved)}")
            losses.append(loss_value)
            step += 1
            if math.isfinite(loss_value) and math.isfinite(grad_norm):
                optimizer.step()
                nonfinite_run = 0
            else:
                nonfinite_run += 1
                log.write({"event": "nonfinite_skip", "step": step, "loss": loss_value,
                           "grad_norm": grad_norm, "lr": lr, "in_a_row": nonfinite_run})
                say(f"step {step}: non-finite loss {loss_value} / grad norm {grad_norm}, "
                    f"update skipped ({nonfinite_run} in a row)")
                if nonfinite_run >= config.max_consecutive_nonfinite:
                    raise NonFiniteLossError(_nonfinite_message(config, step, last_checkpoint),
                                             step, last_checkpoint)
            window_time += time.perf_counter() - t0
            window_steps += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", refresh=False)

            if step % config.log_every == 0 or step == total:
                step_time = window_time / window_steps
                record = {"event": "train", "step": step, "loss": loss_value, "lr": lr,
                          "grad_norm": grad_norm, "tokens": step * config.tokens_per_step,
                          "tokens_per_s": config.tokens_per_step / step_time,
                          "step_time_s": step_time}
                log.write(record)
                window_time, window_steps = 0.0, 0
                if config.progress and not bar_on_terminal:
                    say(f"step {step}/{total} | loss {loss_value:.4f} | lr {lr:.2e} | "
                        f"grad norm {grad_norm:.3f} | {record['tokens_per_s']:,.0f} tok/s")
            if diagnostics_fn is not None and step % config.diag_every == 0:
                # fork_rng: a diagnostic that samples (or runs dropout) must not shift the
                # run's random stream, or exact resume would depend on diag_every.
                with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                    values = diagnostics_fn(model, micro_batches[0], step)
                model.train()
                log.write({"event": "diagnostics", "step": step, **values})
    finally:
        bar.close()
        log.close()

    # --- finish: final.json, loss.png -------------------------------------------------------
    finite = [x for x in losses if math.isfinite(x)][-10:]
    result = RunResult(
        run_dir=run_dir, steps=step, tokens_seen=step * config.tokens_per_step,
        train_losses=losses,
        final_train_loss=sum(finite) / len(finite) if finite else math.nan,
        val_loss=last_eval["val_loss"], val_ppl=last_eval["val_ppl"],
        wall_time_s=wall_before + time.perf_counter() - t_session,
    )
    final = {"final_train_loss": result.final_train_loss, "val_loss": result.val_loss,
             "val_ppl": result.val_ppl, "steps": result.steps, "tokens_seen": result.tokens_seen,
             "wall_time_s": result.wall_time_s, "recipe": config.recipe, "device": str(device),
             "n_params": n_params, "epochs": epochs}
    if main:
        write_text_atomic(run_dir / "final.json", json.dumps(final, indent=2) + "\n")
        write_loss_plot(run_dir)
    say(f"done: val loss {result.val_loss:.4f}, ppl {result.val_ppl:.2f}, "
        f"{result.tokens_seen:,} tokens in {result.wall_time_s:.1f} s -> {run_dir}")
    return result


def _name_layers(model: nn.Module) -> None:
    """--fold-inexact adapt: each quantized linear reports its chunked FP8 folds under its name
    in this model, the name _emulate_layers and checkpoints use."""
    from lowbit.nn import QuantLinear

    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            m.layer_name = name


def _emulate_layers(model: nn.Module, names: list[str]) -> list[str]:
    """Move these quantized linears from the FP8 GEMMs to the emulated ones (the same FP4
    operands); returns the names that were on the FP8 path."""
    from lowbit.recipes import Gemm

    moved = []
    for name in names:
        module = model.get_submodule(name)
        if module.linear_recipe is not None and module.linear_recipe.gemm is Gemm.FP8:
            module.linear_recipe = module.linear_recipe.with_gemm(Gemm.EMULATED)
            moved.append(name)
    return moved


def _refuse_cuda_graph(config: TrainConfig, process: Distributed, moe: bool) -> None:
    from lowbit.train.graphs import cuda_graph_refusal

    refusal = cuda_graph_refusal(process.device, moe=moe, world_size=process.world_size)
    if refusal:
        raise ValueError(refusal)


def _capture_step(model: nn.Module, forward, inputs: torch.Tensor, targets: torch.Tensor,
                  config: TrainConfig, max_norm: float):
    """The step's gradients as one CUDA graph (lowbit.train.graphs), built on its first batch."""
    from lowbit.train.graphs import GraphedGradients

    # a captured step must not use autocast's cast cache: it is cleared outside the graph
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False,
                              enabled=config.bf16_autocast and inputs.is_cuda)

    def loss_fn(x, y):
        with autocast:
            return forward(x, y).loss

    return GraphedGradients(model, loss_fn, inputs, targets, accum=config.grad_accum_steps,
                            max_norm=max_norm)


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[Batch], device: torch.device,
             autocast: contextlib.AbstractContextManager | None = None) -> float:
    """Mean next-token cross-entropy over `batches` (no MoE aux loss: it is not a likelihood).

    Runs under fork_rng: a quantized forward may round stochastically, and evaluation must not
    move the training run's random stream (eval_every may change on resume)."""
    autocast = autocast or contextlib.nullcontext()
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for inputs, targets in batches:
            inputs, targets = inputs.to(device), targets.to(device)
            with autocast:
                logits = model(inputs, targets).logits  # (B, T, V)
            total += F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                     ignore_index=-100, reduction="sum").item()
            count += (targets != -100).sum().item()  # -100: no loss wanted (lowbit.models')
    model.train(was_training)
    return total / count


class _NoLog:
    """The metrics log of ranks other than 0, which write nothing."""

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _recipe_diagnostics(model: nn.Module, batch: Batch, step: int) -> dict:
    """Operand consistency, gradient bias against BF16 and clipping (lowbit.diagnostics)."""
    from lowbit.diagnostics.training import training_diagnostics

    return training_diagnostics(model, *batch)


def write_loss_plot(run_dir: Path) -> None:
    from lowbit.train.plot import plot_runs  # matplotlib is imported only when plotting

    plot_runs([run_dir], run_dir / "loss.png")


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only. Norm gains and biases are 1-D: pulling them toward 0
    fights the scale and offset they exist to learn. Embedding rows get gradient only when
    their token occurs, so decay would shrink rare tokens' rows between occurrences (a tied
    output head shares the embedding's Parameter and is treated the same)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def _produced_files(run_dir: Path) -> list[Path]:
    names = ("config.json", "metrics.jsonl", "final.json", "loss.png")
    return [*(run_dir / n for n in names), checkpoint_path(run_dir),
            *run_dir.glob("events.out.tfevents.*")]


def _check_run_dir(run_dir: Path, config: TrainConfig, resume: bool,
                   overwrite: bool) -> dict | None:
    """Refuse what cannot be done in `run_dir`; return the checkpoint to resume from, or None."""
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other; pick one")
    ckpt = checkpoint_path(run_dir)
    if not resume:
        if not overwrite and any(p.exists() for p in _produced_files(run_dir)):
            raise ValueError(f"{run_dir} already holds a run; pass --resume to continue it, "
                             f"--overwrite to start over, or choose another --run-name")
        return None
    if not ckpt.is_file():
        raise ValueError(f"cannot resume: {run_dir} has no checkpoint ({ckpt}); "
                         f"start the run without --resume")
    checkpoint = load_checkpoint(ckpt)
    changes = changed_fields(checkpoint["config"], config)
    if changes:
        raise ValueError(f"cannot resume {run_dir}: the config differs from the checkpoint's in "
                         f"{'; '.join(changes)}; use the saved values (see "
                         f"{run_dir / 'config.json'}) or start a new run with --run-name")
    return checkpoint


def _start_run_dir(run_dir: Path, config: TrainConfig, fresh: bool) -> None:
    if fresh:  # what an overwritten run left behind; nothing else in the folder is touched
        for path in _produced_files(run_dir):
            path.unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / "config.json", json.dumps(config.to_dict(), indent=2) + "\n")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds the CUDA generators too


def _resolve_recipe(name: str):
    """The recipe object for `name`, or None for "bf16" (train the model as built)."""
    if name == "bf16":
        return None
    try:
        from lowbit.nn import convert  # noqa: F401  (checked here, used in _apply_recipe)
        from lowbit.recipes import get_recipe
    except ImportError as e:
        raise ValueError(f"recipe {name!r} needs lowbit.recipes and lowbit.nn, which cannot be "
                         f"imported ({e}); use --recipe bf16") from None
    return get_recipe(name)


def _apply_recipe(model: nn.Module, recipe, say) -> None:
    """The one seam between the loop and quantized training: swap the model's layers for the
    recipe's quantized ones, in place. The loop itself never knows which formats are in play.
    Stochastic rounding draws from torch's default generators, which checkpoints save, so
    resume stays exact under quantized recipes too."""
    if recipe is None:
        return
    from lowbit.nn import convert

    say(str(convert(model, recipe)).splitlines()[0])


def _build_data(config: TrainConfig) -> TrainingData:
    from lowbit.data import load_dataset

    dataset = load_dataset(config.corpus, tokenizer=config.tokenizer,
                           vocab_size=config.bpe_vocab_size, data_dir=config.data_dir,
                           max_bytes=config.corpus_max_bytes)
    return _CorpusData(dataset, config)


def _epochs(config: TrainConfig, data) -> float | None:
    """How many times the run reads its training split (None if the data cannot say)."""
    per_epoch = getattr(data, "tokens_per_epoch", None)
    return config.total_steps * config.tokens_per_step / per_epoch if per_epoch else None


class _CorpusData:
    """lowbit.data's TokenDataset as the loop's TrainingData: the train split's batches by
    step, the first eval_batches micro-batches of the val split for evaluation."""

    def __init__(self, dataset, config: TrainConfig) -> None:
        self.dataset, self.config = dataset, config
        self.vocab_size = dataset.vocab_size
        self.tokens_per_epoch = dataset.tokens_per_epoch
        # Draw one window from each split now, so a seq_len longer than a split is refused
        # before the run folder exists, not at the first evaluation.
        dataset.get_batch(0, 1, config.seq_len, config.seed)
        next(iter(dataset.eval_batches("val", 1, config.seq_len, max_batches=1)))

    def train_batch(self, step: int) -> Batch:
        c = self.config
        return self.dataset.get_batch(step, c.batch_size * c.grad_accum_steps, c.seq_len, c.seed)

    def eval_batches(self) -> Iterable[Batch]:
        c = self.config
        return self.dataset.eval_batches("val", c.batch_size, c.seq_len, max_batches=c.eval_batches)


def _build_model(config: TrainConfig, vocab_size: int) -> nn.Module:
    from lowbit.models import ModelConfig, build_model

    overrides = {name: getattr(config, name) for name in ("n_layers", "n_experts", "dropout")
                 if getattr(config, name) is not None}
    if config.dim is not None:
        overrides.update(dim=config.dim, n_heads=max(1, config.dim // 64), ffn_dim=None)
    model_config = ModelConfig.preset(config.model, vocab_size=vocab_size, **overrides)
    if model_config.max_seq_len < config.seq_len:
        model_config = dataclasses.replace(model_config, max_seq_len=config.seq_len)
    return build_model(model_config)


def _step_rng_state(device: torch.device) -> tuple:
    """What a training step draws from: torch's CPU generator and the device's. (Not
    checkpoint.rng_state(): that takes every GPU's state, touching every GPU from every rank,
    and Python's and NumPy's generators, which a step does not draw from.)"""
    return (torch.get_rng_state(),
            torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_step_rng_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf  # exp overflows a float past ~709


def _nonfinite_message(config: TrainConfig, step: int, checkpoint: Path | None) -> str:
    kept = (f"the last checkpoint, {checkpoint}, is from before and intact" if checkpoint
            else "no checkpoint had been written yet")
    return (f"stopped at step {step}: the loss or gradient norm was NaN/Inf for "
            f"{config.max_consecutive_nonfinite} steps in a row; {kept}. Try a lower --lr, "
            f"a longer --warmup-steps, or --grad-clip")
