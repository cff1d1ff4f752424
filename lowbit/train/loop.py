"""Training: `train(config) -> RunResult`, readable top to bottom.

A run: build the data, the model (seeded), the recipe's quantized layers and the optimizer
(lowbit.train.build); resume from the run folder's checkpoint if asked (lowbit.train.run_dir);
then hand the run to the run loop (lowbit.train.runner, which `lowbit rl` uses too): until the
last step, evaluate every eval_every steps (validation loss), checkpoint every
checkpoint_every steps, run one optimizer step (lowbit.train.step.TrainStep, which `lowbit
bench train` times too), log a record every log_every steps and the diagnostics every
diag_every steps; at the end write final.json and loss.png.

Determinism: the model is initialized from `seed`, the batch of step i is a pure function of
(seed, i), and dropout draws from the torch RNG whose state the checkpoint saves; nothing
else draws from it (evaluation runs in eval mode, diagnostics under fork_rng). So on the CPU,
N steps + resume + N steps gives the same losses, bit for bit, as 2N steps in one go.

Under torchrun the same loop runs in every process, with DDP and each rank's share of the
step's batch; lowbit.train.distributed says exactly what changes.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from lowbit.formats.weight_format import parse_weight_format
from lowbit.recipes import quantizes
from lowbit.train.build import (Batch, TrainingData, apply_recipe, build_data, build_model,
                                build_optimizer, context_warning, epochs, resolve_recipe,
                                seed_everything)
from lowbit.train.checkpoint import check_same_data, set_rng_state
from lowbit.train.config import TrainConfig, resolve_device
from lowbit.train.distributed import Distributed, set_own_cuda_rng_state, setup
from lowbit.train.fold_policy import FoldPolicy
from lowbit.train.job_record import JobRecord
from lowbit.train.run_dir import RunDir
from lowbit.train.runner import Cadence, RunLoop, Start, StepOutcome
from lowbit.train.step import (LossFn, StepConfig, StepResult, TrainStep, learning_rate_at,
                               next_token_loss, refuse_compile, refuse_cuda_graph)

__all__ = ["train", "RunResult", "TrainingData", "evaluate", "learning_rate_at",
           "data_fingerprint", "describe_numerics"]

DiagnosticsFn = Callable[[nn.Module, Batch, int], dict]
StepHook = Callable[[int], "dict | None"]


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


def train(
    config: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    model: nn.Module | None = None,
    data: TrainingData | None = None,
    diagnostics_fn: DiagnosticsFn | None = None,
    on_step: StepHook | None = None,
    on_optimizer: Callable[[torch.optim.Optimizer], None] | None = None,
    loss_fn: LossFn = next_token_loss,
    job: JobRecord | None = None,
) -> RunResult:
    """Train as `config` says, in `<out_dir>/<name>/`, and return the final numbers.

    resume: continue the run folder's checkpoint (refused if the folder has none, if the
        saved config or job record differs in a field that changes the run, or if the run
        started from other weights).
    overwrite: start over in a run folder that already holds a run (otherwise refused).
    model, data: use these instead of building config.model / config.corpus; the model must
        map (idx, targets) to an output with .loss and .logits, like lowbit.models', and is
        converted in place when config.recipe quantizes (lowbit.recipes.quantizes).
    diagnostics_fn: called as fn(model, first micro-batch, step) every diag_every steps,
        after the update; its dict of numbers is logged as a "diagnostics" record.
    on_step: called as fn(step) after every optimizer step (step = steps completed), on every
        rank; a dict it returns is logged as a record (its "event" key names it). QAT refits
        JacQuant's B here. It must draw randomness only from its own seeded generators. A
        returned "stop": True (the same on every rank) ends the run after this step, evaluated
        and checkpointed as its last; the LR schedule stays the one config.max_steps draws.
    on_optimizer: called once with the run's optimizer, once it is built and any checkpoint's
        state is in it, before the first step: a QAT run's hook attaches to it here
        (lowbit.qat.QATHook.attach).
    loss_fn: the training loss, fn(model, (inputs, targets)) (lowbit.train.step.LossFn),
        instead of the model output's .loss; QAT's --distill passes one. Evaluation stays
        cross-entropy.
    job: what made the run (lowbit.train.job_record.JobRecord: `lowbit qat`'s settings, the
        weights it started from), written to the run folder as job.json and into every
        checkpoint; None: JobRecord(), a training run.

    Launched by torchrun, every process calls this: see lowbit.train.distributed.
    """
    process = setup(resolve_device(config.device))
    try:
        if config.batch_size % process.world_size:
            raise ValueError(f"batch_size ({config.batch_size}) must be a multiple of the "
                             f"{process.world_size} processes, which split each micro-batch")
        # the run folder's lock (RunDir.lock) is held from its check to the end of the run
        with RunDir(Path(config.out_dir) / config.name, config.keep_checkpoints) as run_dir:
            training = _TrainJob(config, job or JobRecord(), process, run_dir, resume, overwrite,
                                 model, data, diagnostics_fn, loss_fn)
            training.on_step = on_step
            if on_optimizer is not None:
                on_optimizer(training.optimizer)
            result = training.run()
        # Every rank has finished (rank 0 has written final.json and the plot) before any
        # process group is torn down: a gloo rank that destroys its group while the other
        # still works could abort ("terminate called without an active exception", about one
        # two-process CPU run in 35). After an error the ranks are not in step, so no barrier.
        process.barrier()
        return result
    finally:
        process.close()


class _TrainJob:
    """One train() call: built (and resumed) by __init__, trained by run() through the run
    loop (lowbit.train.runner), to which it is the job."""

    def __init__(self, config: TrainConfig, job: JobRecord, process: Distributed, run_dir: RunDir,
                 resume: bool, overwrite: bool, model: nn.Module | None, data: TrainingData | None,
                 diagnostics_fn: DiagnosticsFn | None, loss_fn: LossFn = next_token_loss) -> None:
        # Everything that can refuse the run does so before the run folder is touched.
        self.config, self.job_record, self.process = config, job, process
        device, main = process.device, process.is_main
        recipe = resolve_recipe(config.recipe)
        self.run_dir = run_dir
        warn = (lambda message: print(message, file=sys.stderr)) if main else (lambda message: None)
        checkpoint = run_dir.check(config, resume, overwrite, warn=warn, lock=main, job=job)
        if config.cuda_graph:   # the device and processes; the model's experts once it is built
            refuse_cuda_graph(process)
        if config.compile:
            refuse_compile(device)
        self.say = say = tqdm.write if config.progress and main else (lambda message: None)
        if diagnostics_fn is None and config.diagnostics and quantizes(config.recipe):
            diagnostics_fn = _recipe_diagnostics

        seed_everything(config.seed)
        with process.main_first():  # rank 0 tokenizes and caches the corpus, the others read it
            self.data = data = data if data is not None else build_data(config)
        self.data_fingerprint = data_fingerprint(data)
        if checkpoint is not None:
            check_same_data(checkpoint.get("data_fingerprint"), self.data_fingerprint,
                            self.run_dir.path)
        self.epochs = epochs(config, data)
        if main and self.epochs is not None and self.epochs > 3:  # printed even without progress
            print(f"lowbit: warning: this run reads its training split {self.epochs:.1f} times "
                  f"(more than ~3 repeats overfits); use a larger corpus or fewer --steps",
                  file=sys.stderr)
        if main and model is None and context_warning(config):
            print(context_warning(config), file=sys.stderr)
        seed_everything(config.seed)  # so the init does not depend on what building data drew
        self.model = model = model if model is not None else build_model(config, data.vocab_size)
        if recipe is not None:
            say(apply_recipe(model, recipe))
        fold = FoldPolicy(config.fold_inexact, model)
        model.to(device)
        if config.cuda_graph:   # an MoE model's experts, as the recipe made them, on the device
            refuse_cuda_graph(process, model, config.bf16_autocast)
        if process.enabled and config.parallel == "fsdp":
            process.shard_model(model)  # before the optimizer takes its (now sharded) parameters
            if diagnostics_fn is not None:
                say("diagnostics are skipped under --parallel fsdp (see lowbit.train.distributed)")
                diagnostics_fn = None
        self.diagnostics_fn = diagnostics_fn
        step_config = StepConfig.of(config)
        self.optimizer = build_optimizer(model, step_config, device, sharded=process.fsdp)
        self.n_params = sum(p.numel() for p in model.parameters())
        process.barrier()  # every rank has checked the run folder before rank 0 changes it
        if main:
            removed = self.run_dir.start(config, fresh=checkpoint is None, job=job)
            if removed:
                say(f"removed {len(removed)} temporary file(s) ({sum(n for _, n in removed):,} "
                    f"bytes) left by an interrupted write in {self.run_dir.path}")

        self.start = Start.of(checkpoint)
        self.losses: list[float] = []
        nonfinite_run = 0
        if checkpoint is not None:
            process.load_state_dicts(model, self.optimizer, checkpoint["model"],
                                     checkpoint["optimizer"])
            set_rng_state(checkpoint["rng"])
            set_own_cuda_rng_state(checkpoint["rng"], process)
            self.losses = checkpoint["train_losses"]
            nonfinite_run = checkpoint["consecutive_nonfinite"]
            fold.restore(checkpoint.get("fold_emulated_layers", []))
            del checkpoint  # the weights now live in the model; don't hold a second copy
        self.step_fn = TrainStep(model, self.optimizer, step_config, process, fold, loss_fn)
        self.step_fn.nonfinite_run = nonfinite_run
        self.on_step: StepHook | None = None
        self.last_result: StepResult | None = None
        self.last_eval = next((r for r in reversed(self.start.records) if r["event"] == "eval"),
                              None)

    def run(self) -> RunResult:
        config = self.config
        cadence = Cadence(
            config.total_steps, config.eval_every, config.checkpoint_every, config.log_every,
            config.max_consecutive_nonfinite,
            after_step_every=config.diag_every if self.diagnostics_fn is not None else 0,
            eval_cost_steps=config.eval_batches / 3,
            seconds_this_call=(None if config.stop_after_minutes is None
                               else config.stop_after_minutes * 60))
        self.model.train()
        return RunLoop(self, self.run_dir, config, cadence, self.start, progress=config.progress,
                       is_main=self.process.is_main).run()

    # ---- the job the run loop drives (lowbit.train.runner.Job) ---------------------------

    def describe(self) -> str:
        numerics = describe_numerics(self.config, self.job_record)
        return (f"{self.n_params / 1e6:.2f}M parameters, {numerics}, {self.process.device}, "
                f"{self.config.tokens_per_step} tokens/step")

    def step(self, step: int) -> StepOutcome:
        result = self.step_fn(step, self.data.train_batch(step))
        self.last_result = result
        self.losses.append(result.loss)
        events = list(result.records)
        stop = False
        if self.on_step is not None:
            record = dict(self.on_step(step + 1) or {})
            stop = bool(record.pop("stop", False))
            if record:
                events.append({"event": "hook", "step": step + 1, **record})
        return StepOutcome(events, result.messages, self.step_fn.nonfinite_run, stop,
                           result.capture_s, {"loss": f"{result.loss:.4f}", "lr": f"{result.lr:.2e}"})

    def train_record(self, step: int, outcome: StepOutcome, step_time_s: float) -> dict:
        result, config = self.last_result, self.config
        return {"loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                "tokens": step * config.tokens_per_step,
                "tokens_per_s": config.tokens_per_step / step_time_s, "step_time_s": step_time_s}

    def train_line(self, record: dict, total: int) -> str:
        return (f"step {record['step']}/{total} | loss {record['loss']:.4f} | lr "
                f"{record['lr']:.2e} | grad norm {record['grad_norm']:.3f} | "
                f"{record['tokens_per_s']:,.0f} tok/s")

    def evaluate(self, step: int, records: list[dict]) -> tuple[dict, str]:
        val_loss = evaluate(self.step_fn.forward, self.data.eval_batches(), self.process.device,
                            self.step_fn.autocast)
        self.last_eval = {"tokens": step * self.config.tokens_per_step, "val_loss": val_loss,
                          "val_ppl": _perplexity(val_loss)}
        return self.last_eval, f"step {step}: val loss {val_loss:.4f}, ppl {self.last_eval['val_ppl']:.2f}"

    def after_step(self, step: int) -> dict:
        # fork_rng: a diagnostic that samples (or runs dropout) must not shift the run's
        # random stream, or exact resume would depend on diag_every.
        device = self.process.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            values = self.diagnostics_fn(self.model, self.last_result.first_micro_batch, step)
        self.model.train()
        return values

    def state(self) -> dict | None:
        model_state, optimizer_state = self.process.state_dicts(self.model, self.optimizer)
        if not self.process.is_main:   # every rank takes part in gathering; rank 0 writes
            return None
        return {"model": model_state, "optimizer": optimizer_state,
                "data_fingerprint": self.data_fingerprint, "job": self.job_record.to_dict(),
                "consecutive_nonfinite": self.step_fn.nonfinite_run,
                "train_losses": self.losses,
                "fold_emulated_layers": self.step_fn.fold.emulated_layers}

    def finish(self, step: int, records: list[dict], wall_time_s: float) -> tuple[RunResult, dict, str]:
        config, last_eval = self.config, self.last_eval
        finite = [x for x in self.losses if math.isfinite(x)][-10:]
        result = RunResult(
            run_dir=self.run_dir.path, steps=step, tokens_seen=step * config.tokens_per_step,
            train_losses=self.losses,
            final_train_loss=sum(finite) / len(finite) if finite else math.nan,
            val_loss=last_eval["val_loss"], val_ppl=last_eval["val_ppl"], wall_time_s=wall_time_s)
        final = {"final_train_loss": result.final_train_loss, "val_loss": result.val_loss,
                 "val_ppl": result.val_ppl, "steps": result.steps,
                 "tokens_seen": result.tokens_seen, "wall_time_s": result.wall_time_s,
                 "recipe": config.recipe, "device": str(self.process.device),
                 "n_params": self.n_params, "epochs": self.epochs}
        return result, final, (f"done: val loss {result.val_loss:.4f}, ppl {result.val_ppl:.2f}, "
                                f"{result.tokens_seen:,} tokens in {result.wall_time_s:.1f} s -> "
                                f"{self.run_dir.path}")

    draw = None   # RunDir.plot's own figure: loss.png


def describe_numerics(config: TrainConfig, job: JobRecord) -> str:
    """The start line's word on the numerics: the recipe, or a QAT run's weights and estimator
    (its recipe is bf16: QAT fake-quantizes the weights itself)."""
    if job.qat:   # the weights as they train: a block left to its default named (int8 -> int8:g128)
        try:
            weights = str(parse_weight_format(job.qat.get("weights"), check_block=False))
        except ValueError:   # a record from other code: as written
            weights = job.qat.get("weights")
        return f"QAT {weights} with {job.qat.get('estimator')}"
    return f"recipe {config.recipe}"


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


def data_fingerprint(data) -> str | None:
    """The data's `fingerprint` (a hash of its tokens, which checkpoints store so that a resume
    on other data is refused), or None for data that has none."""
    fingerprint = getattr(data, "fingerprint", None)
    return fingerprint if isinstance(fingerprint, str) else None


def _recipe_diagnostics(model: nn.Module, batch: Batch, step: int) -> dict:
    """Operand consistency, gradient bias against BF16 and clipping (lowbit.diagnostics)."""
    from lowbit.diagnostics.training import training_diagnostics

    return training_diagnostics(model, *batch)


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf  # exp overflows a float past ~709
