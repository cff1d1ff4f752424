"""The training loop: `train(config) -> RunResult`, readable top to bottom.

A run: build the data, the model (seeded), the recipe's quantized layers and the optimizer
(lowbit.train.build); resume from the run folder's checkpoint if asked (lowbit.train.run_dir);
then, until the last step, evaluate every eval_every steps, checkpoint every checkpoint_every
steps, run one optimizer step (lowbit.train.step.TrainStep, which `lowbit bench train` times
too), log a record every log_every steps and the diagnostics every diag_every steps; at the
end write final.json and loss.png.

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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from lowbit.train.build import (Batch, TrainingData, apply_recipe, build_data, build_model,
                                build_optimizer, context_warning, epochs, resolve_recipe,
                                seed_everything)
from lowbit.train.checkpoint import (CHECKPOINT_VERSION, check_same_data, check_same_start,
                                     rng_state, set_rng_state)
from lowbit.train.config import TrainConfig, resolve_device
from lowbit.train.distributed import Distributed, set_own_cuda_rng_state, setup
from lowbit.train.fold_policy import FoldPolicy
from lowbit.train.metrics import MetricsLog
from lowbit.train.run_dir import RunDir
from lowbit.train.step import Objective, TrainStep, learning_rate_at, refuse_cuda_graph

__all__ = ["train", "RunResult", "NonFiniteLossError", "TrainingInterrupted", "TrainingData",
           "evaluate", "learning_rate_at", "data_fingerprint", "nonfinite_message",
           "interrupted_message", "describe_numerics"]

DiagnosticsFn = Callable[[nn.Module, Batch, int], dict]
StepHook = Callable[[int], "dict | None"]


class NonFiniteLossError(RuntimeError):
    """Raised after config.max_consecutive_nonfinite optimizer steps in a row had a NaN/Inf
    loss or gradient norm. The last checkpoint on disk is the one from before they began.
    The message says what happened (nonfinite_message); each command adds what to try, in
    flags it has."""

    def __init__(self, message: str, step: int, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run; the message says the step, the last checkpoint and how to resume."""


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
    objective: Objective | None = None,
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
    on_step: called as fn(step) after every optimizer step (step = steps completed), on every
        rank; a dict it returns is logged as a record (its "event" key names it). QAT refits
        JacQuant's B here. It must draw randomness only from its own seeded generators. A
        returned "stop": True (the same on every rank) ends the run after this step, evaluated
        and checkpointed as its last; the LR schedule stays the one config.max_steps draws.
    objective: the training loss, fn(output, inputs, targets) (lowbit.train.step.Objective),
        instead of output.loss; QAT's --distill passes one. Evaluation stays cross-entropy.

    Launched by torchrun, every process calls this: see lowbit.train.distributed.
    """
    process = setup(resolve_device(config.device))
    try:
        if config.batch_size % process.world_size:
            raise ValueError(f"batch_size ({config.batch_size}) must be a multiple of the "
                             f"{process.world_size} processes, which split each micro-batch")
        # the run folder's lock (RunDir.lock) is held from its check to the end of the run
        with RunDir(Path(config.out_dir) / config.name, config.keep_checkpoints) as run_dir:
            run = _Run(config, process, run_dir, resume, overwrite, model, data, diagnostics_fn,
                       objective)
            run.on_step = on_step
            result = run.loop()
        # Every rank has finished (rank 0 has written final.json and the plot) before any
        # process group is torn down: a gloo rank that destroys its group while the other
        # still works could abort ("terminate called without an active exception", about one
        # two-process CPU run in 35). After an error the ranks are not in step, so no barrier.
        process.barrier()
        return result
    finally:
        process.close()


class _Run:
    """One train() call: built (and resumed) by __init__, trained by loop()."""

    def __init__(self, config: TrainConfig, process: Distributed, run_dir: RunDir, resume: bool,
                 overwrite: bool, model: nn.Module | None, data: TrainingData | None,
                 diagnostics_fn: DiagnosticsFn | None, objective: Objective | None = None) -> None:
        # Everything that can refuse the run does so before the run folder is touched.
        self.config, self.process = config, process
        device, main = process.device, process.is_main
        recipe = resolve_recipe(config.recipe)
        self.run_dir = run_dir
        warn = (lambda message: print(message, file=sys.stderr)) if main else (lambda message: None)
        checkpoint = run_dir.check(config, resume, overwrite, warn=warn, lock=main)
        if checkpoint is not None:
            saved = checkpoint["config"]
            check_same_start(saved.get("init_fingerprint"), config.init_fingerprint, run_dir.path,
                             saved.get("init_from"))
        if config.cuda_graph:
            refuse_cuda_graph(process, moe=bool(config.n_experts))
        self.say = say = tqdm.write if config.progress and main else (lambda message: None)
        self.tell = tqdm.write if main else (lambda message: None)
        """The run's start and done lines, which print with progress off too."""
        if diagnostics_fn is None and config.diagnostics and config.recipe != "bf16":
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
        if config.cuda_graph:   # again: a model passed in may be an MoE model
            refuse_cuda_graph(process, getattr(getattr(model, "config", None), "is_moe", False))
        if process.enabled and config.parallel == "fsdp":
            process.shard_model(model)  # before the optimizer takes its (now sharded) parameters
            if diagnostics_fn is not None:
                say("diagnostics are skipped under --parallel fsdp (see lowbit.train.distributed)")
                diagnostics_fn = None
        self.diagnostics_fn = diagnostics_fn
        self.optimizer = build_optimizer(model, config, device, sharded=process.fsdp)
        self.n_params = sum(p.numel() for p in model.parameters())
        process.barrier()  # every rank has checked the run folder before rank 0 changes it
        if main:
            removed = self.run_dir.start(config, fresh=checkpoint is None)
            if removed:
                say(f"removed {len(removed)} temporary file(s) ({sum(n for _, n in removed):,} "
                    f"bytes) left by an interrupted write in {self.run_dir.path}")

        self.start_step, self.records, self.losses, self.wall_before = 0, [], [], 0.0
        self.resumed = checkpoint is not None
        nonfinite_run = 0
        if self.resumed:
            process.load_state_dicts(model, self.optimizer, checkpoint["model"],
                                     checkpoint["optimizer"])
            set_rng_state(checkpoint["rng"])
            set_own_cuda_rng_state(checkpoint["rng"], process)
            self.start_step, self.records = checkpoint["step"], checkpoint["metrics"]
            self.losses, self.wall_before = checkpoint["train_losses"], checkpoint["wall_time_s"]
            nonfinite_run = checkpoint["consecutive_nonfinite"]
            fold.restore(checkpoint.get("fold_emulated_layers", []))
            del checkpoint  # the weights now live in the model; don't hold a second copy
        self.step_fn = TrainStep(model, self.optimizer, config, process, fold, objective)
        self.step_fn.nonfinite_run = nonfinite_run
        self.last_checkpoint = self.run_dir.checkpoint if self.resumed else None
        self.on_step: StepHook | None = None
        self.last_checkpoint_step = self.start_step if self.resumed else None

    def loop(self) -> RunResult:
        config, process, step_fn, main, say = (self.config, self.process, self.step_fn,
                                               self.process.is_main, self.say)
        total, start = config.total_steps, self.start_step
        last_eval = next((r for r in reversed(self.records) if r["event"] == "eval"), None)
        self.tell(f"{'resuming' if self.resumed else 'starting'} {self.run_dir.path} at step "
            f"{start}/{total}: {self.n_params / 1e6:.2f}M parameters, {describe_numerics(config)}, "
            f"{process.device}, {config.tokens_per_step} tokens/step")
        log = MetricsLog(self.run_dir.path, self.records, start, say) if main else _NoLog()
        bar_on_terminal = config.progress and main and sys.stderr.isatty()
        bar = tqdm(total=total, initial=start, disable=not bar_on_terminal, unit="step",
                   dynamic_ncols=True)
        t_session = time.perf_counter()
        window = [0.0, 0]  # training time and steps since the last train record
        clock = _Clock(config, start)
        self.model.train()
        step = start  # optimizer steps completed
        try:
            while True:
                if (step > start or not self.resumed) and _due(step, total, config.eval_every):
                    with clock.timing("eval"):
                        last_eval = self._evaluate(step, log)
                if step > start and _due(step, total, config.checkpoint_every):
                    with clock.timing("checkpoint"):
                        self._checkpoint(step, log, t_session)
                if step == total:
                    break
                t0 = time.perf_counter()
                result = step_fn(step, *self.data.train_batch(step))
                step += 1
                clock.stepped(step, time.perf_counter() - t0 - result.capture_s, say)
                for record in result.records:
                    log.write(record)
                for message in result.messages:
                    say(message)
                self.losses.append(result.loss)
                if self.on_step is not None:
                    record = dict(self.on_step(step) or {})
                    stop = bool(record.pop("stop", False))
                    if record:
                        log.write({"event": "hook", "step": step, **record})
                    if stop and step < total:
                        say(f"step {step}: the step hook ended the run")
                        total = step   # evaluated and checkpointed as the last step, then done
                if step_fn.nonfinite_run >= config.max_consecutive_nonfinite:
                    raise NonFiniteLossError(
                        nonfinite_message(step, config.max_consecutive_nonfinite,
                                          self.last_checkpoint), step, self.last_checkpoint)
                window[0] += time.perf_counter() - t0 - result.capture_s
                window[1] += 1
                bar.update(1)
                bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{result.lr:.2e}", refresh=False)
                if step % config.log_every == 0 or step == total:
                    self._log_train(step, result, window, log, bar_on_terminal)
                if self.diagnostics_fn is not None and step % config.diag_every == 0:
                    with clock.timing("diagnostics"):
                        self._diagnose(step, result, log)
        except KeyboardInterrupt:
            raise TrainingInterrupted(interrupted_message(step, self.last_checkpoint_step,
                                                          self.last_checkpoint)) from None
        finally:
            bar.close()
            log.close()
        return self._finish(step, last_eval, t_session)

    def _evaluate(self, step: int, log) -> dict:
        val_loss = evaluate(self.step_fn.forward, self.data.eval_batches(), self.process.device,
                            self.step_fn.autocast)
        record = {"event": "eval", "step": step, "tokens": step * self.config.tokens_per_step,
                  "val_loss": val_loss, "val_ppl": _perplexity(val_loss)}
        log.write(record)
        self.say(f"step {step}: val loss {val_loss:.4f}, ppl {record['val_ppl']:.2f}")
        return record

    def _checkpoint(self, step: int, log, t_session: float) -> None:
        model_state, optimizer_state = self.process.state_dicts(self.model, self.optimizer)
        if not self.process.is_main:   # every rank takes part in gathering; rank 0 writes
            return
        self.run_dir.save_checkpoint({
            "version": CHECKPOINT_VERSION, "step": step, "config": self.config.to_dict(),
            "model": model_state, "optimizer": optimizer_state, "rng": rng_state(),
            "metrics": log.records, "train_losses": self.losses,
            "wall_time_s": self.wall_before + time.perf_counter() - t_session,
            "consecutive_nonfinite": self.step_fn.nonfinite_run,
            "fold_emulated_layers": self.step_fn.fold.emulated_layers,
            "data_fingerprint": self.data_fingerprint,
        })
        self.last_checkpoint, self.last_checkpoint_step = self.run_dir.checkpoint, step
        self.run_dir.plot()   # at most once a minute; always at the end

    def _log_train(self, step: int, result, window: list, log, bar_on_terminal: bool) -> None:
        config = self.config
        step_time = window[0] / window[1]
        record = {"event": "train", "step": step, "loss": result.loss, "lr": result.lr,
                  "grad_norm": result.grad_norm, "tokens": step * config.tokens_per_step,
                  "tokens_per_s": config.tokens_per_step / step_time, "step_time_s": step_time}
        log.write(record)
        window[:] = [0.0, 0]
        if config.progress and not bar_on_terminal:
            self.say(f"step {step}/{config.total_steps} | loss {result.loss:.4f} | lr "
                     f"{result.lr:.2e} | grad norm {result.grad_norm:.3f} | "
                     f"{record['tokens_per_s']:,.0f} tok/s")

    def _diagnose(self, step: int, result, log) -> None:
        # fork_rng: a diagnostic that samples (or runs dropout) must not shift the run's
        # random stream, or exact resume would depend on diag_every.
        device = self.process.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            values = self.diagnostics_fn(self.model, result.first_micro_batch, step)
        self.model.train()
        log.write({"event": "diagnostics", "step": step, **values})

    def _finish(self, step: int, last_eval: dict, t_session: float) -> RunResult:
        config = self.config
        finite = [x for x in self.losses if math.isfinite(x)][-10:]
        result = RunResult(
            run_dir=self.run_dir.path, steps=step, tokens_seen=step * config.tokens_per_step,
            train_losses=self.losses,
            final_train_loss=sum(finite) / len(finite) if finite else math.nan,
            val_loss=last_eval["val_loss"], val_ppl=last_eval["val_ppl"],
            wall_time_s=self.wall_before + time.perf_counter() - t_session,
        )
        if self.process.is_main:
            self.run_dir.write_final({
                "final_train_loss": result.final_train_loss, "val_loss": result.val_loss,
                "val_ppl": result.val_ppl, "steps": result.steps,
                "tokens_seen": result.tokens_seen, "wall_time_s": result.wall_time_s,
                "recipe": config.recipe, "device": str(self.process.device),
                "n_params": self.n_params, "epochs": self.epochs})
            self.run_dir.plot(force=True)
        self.tell(f"done: val loss {result.val_loss:.4f}, ppl {result.val_ppl:.2f}, "
                 f"{result.tokens_seen:,} tokens in {result.wall_time_s:.1f} s -> "
                 f"{self.run_dir.path}")
        return result


class _Clock:
    """The run's expected duration, said once after its first few steps: their time a step
    (the first, which warms up caches and kernels, left out) and that of the evaluations,
    checkpoints and diagnostics timed so far, times how many of each are left."""

    PROBE = 5   # steps timed before the estimate

    def __init__(self, config: TrainConfig, start: int) -> None:
        self.config, self.start = config, start
        self.step_times: list[float] = []
        self.spent: dict[str, list[float]] = {"eval": [], "checkpoint": [], "diagnostics": []}

    @contextlib.contextmanager
    def timing(self, what: str):
        t = time.perf_counter()
        yield
        self.spent[what].append(time.perf_counter() - t)

    def stepped(self, step: int, seconds: float, say) -> None:
        self.step_times.append(seconds)
        left = self.config.total_steps - step
        if len(self.step_times) != self.PROBE or left <= 0:
            return
        per_step = sum(self.step_times[1:]) / (self.PROBE - 1)
        c = self.config
        counts = {"eval": _count(step, c.total_steps, c.eval_every),
                  "checkpoint": _count(step, c.total_steps, c.checkpoint_every),
                  "diagnostics": (left // c.diag_every if self.config.diagnostics
                                  and c.recipe != "bf16" else 0)}
        # an event not timed yet (the first checkpoint, the first diagnostics) is guessed as
        # a few steps' time
        guess = {"eval": per_step * c.eval_batches / 3, "checkpoint": 1.0,
                 "diagnostics": 3 * per_step}
        extra = sum(n * (sum(self.spent[k]) / len(self.spent[k]) if self.spent[k] else guess[k])
                    for k, n in counts.items())
        eta = left * per_step + extra
        say(f"about {_duration(eta)} to go ({per_step:.2f} s a step for {left} steps"
            f"{f', {_duration(extra)} of evaluations, checkpoints and diagnostics' if extra >= 1 else ''})")


def _count(step: int, total: int, every: int) -> int:
    """How many of the steps after `step`, up to total, are due (see _due)."""
    return sum(_due(s, total, every) for s in range(step + 1, total + 1))


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def describe_numerics(config: TrainConfig) -> str:
    """The start line's word on the numerics: the recipe, or a QAT run's weights and estimator
    (its recipe is bf16: QAT fake-quantizes the weights itself)."""
    if config.qat:
        return f"QAT {config.qat.get('weights')} with {config.qat.get('estimator')}"
    return f"recipe {config.recipe}"


def _due(step: int, total: int, every: int) -> bool:
    """At the last step, and every `every` steps (0: only at the last)."""
    return step == total or (every > 0 and step % every == 0)


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


def nonfinite_message(step: int, in_a_row: int, checkpoint: Path | None) -> str:
    """What a job stopped by a NaN/Inf loss says (every lowbit job: train, QAT, RL); the
    command adds what to try."""
    kept = (f"the last checkpoint, {checkpoint}, is from before and intact" if checkpoint
            else "no checkpoint had been written yet")
    steps = f" for {in_a_row} steps in a row" if in_a_row > 1 else ""
    return f"stopped at step {step}: the loss or gradient norm was NaN/Inf{steps}; {kept}."


def interrupted_message(step: int, checkpoint_step: int | None, checkpoint: Path | None) -> str:
    """What a job stopped by Ctrl-C says after `lowbit: interrupted ` (every lowbit job)."""
    if checkpoint_step is None:
        return (f"at step {step}, before the first checkpoint; nothing to resume: start "
                f"again with --overwrite (or a smaller --checkpoint-every)")
    return (f"at step {step}; the last checkpoint is step {checkpoint_step} "
            f"({checkpoint}): run the same command with --resume to continue")
