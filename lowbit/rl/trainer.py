"""The GRPO loop: generate -> score -> loss, then sync the engine, with checkpoints and exact
resume as `lowbit train`'s.

    result = run_rl(RLConfig(rollout="nvfp4", align="quads", steps=300))
    result.run_dir       # runs/rl-tiny-add-nvfp4+quads/: config.json, metrics.jsonl, rl.png, ...

One RL step:
  generate   the engine samples num_generations completions for each of prompts_per_step
             problems (its own weights and precision; sampling seeded by (seed, step))
  score      the task's reward per completion; group-normalized advantages
  loss       the trainer recomputes the sampled tokens' log-probs by teacher forcing (its
             policy in BF16, or with asymmetric QAT), compares them with the engine's (the
             mismatch metrics), weights tokens by truncated importance sampling if asked, and
             takes num_iterations optimizer steps of the clipped GRPO loss -- each through
             lowbit.train.step.TrainStep, the step `lowbit train` runs (LR, clipping, skips)
  sync       the trainer's state dict goes to the engine, which quantizes it on arrival (with
             --rollout-activation-scale static, with each linear's input amax calibrated on
             the new weights, as `lowbit export --activations nvfp4` calibrates a checkpoint)
Each piece is a method (`generate`, `score`, `train_on`, `sync`) that a subclass can replace.

Determinism: prompts and sampling noise are pure functions of (seed, step), the engine's
weights a function of the trainer's, so N steps + resume + M steps equals N + M steps.

The run folder follows lowbit.train's rules (lowbit.train.run_dir.RunDir): one writer at a
time (a GRPOTrainer holds the folder's lock from its construction until run() ends), a resume
reads the problems it started with (their fingerprint is in the checkpoint), a NaN/Inf loss
stops the run at once keeping the last checkpoint (NonFiniteLossError), and Ctrl-C says the
step, the last checkpoint and the --resume command (TrainingInterrupted, exit 130).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from lowbit.data.tasks import Problem, get_task
from lowbit.export import calibrate_input_amax
from lowbit.models import build_model, is_model_folder
from lowbit.rl import grpo
from lowbit.rl.config import RLConfig
from lowbit.rl.engine import Rollout, RolloutEngine
from lowbit.rl.sampling import SamplingParams
from lowbit.rl.trainer_side import (apply_asymmetric_qat, enable_routing_replay, replay_routing,
                                    routing_agreement)
from lowbit.rl.warmstart import greedy_accuracy, policy_config, policy_tokenizer, warm_start
from lowbit.train.build import build_optimizer
from lowbit.train.checkpoint import CHECKPOINT_VERSION, check_same_data, rng_state, set_rng_state
from lowbit.train.config import TrainConfig, resolve_device
from lowbit.train.distributed import Distributed
from lowbit.train.loop import (NonFiniteLossError, TrainingInterrupted, interrupted_message,
                               nonfinite_message)
from lowbit.train.metrics import MetricsLog
from lowbit.train.run_dir import RunDir
from lowbit.train.step import TrainStep

__all__ = ["GRPOTrainer", "GRPOStep", "RLResult", "run_rl", "RLBatch", "RUN_FILES",
           "task_fingerprint", "collapsed", "COLLAPSE_EVALS", "calibration_batches",
           "CALIBRATION_PROBLEMS"]

RUN_FILES = ("config.json", "metrics.jsonl", "final.json", "rl.png")   # beside checkpoints/
CALIBRATION_PROBLEMS = 32
"""Training problems (prompt and reference solution; the warm start's first draw, never the
held-out set) whose forward through the policy calibrates static activation scales at every
sync (lowbit.export.calibrate_input_amax)."""
NO_SIGNAL_STEPS = 5
"""A run whose first this many steps had equal rewards in every group says so (one warning):
every advantage was 0, so the rewards have taught the policy nothing."""


@dataclass
class RLBatch:
    """The trainer's view of one step's rollouts (right-padded rows, see lowbit.rl.grpo)."""

    input_ids: torch.Tensor          # (B, T)
    prompt_lengths: torch.Tensor     # (B,)
    completions: torch.Tensor        # (B, Tc)
    mask: torch.Tensor               # (B, Tc) tokens in the loss
    rollout_logprobs: torch.Tensor   # (B, Tc)
    routed: torch.Tensor | None      # (B, T, layers, k) or None


@dataclass
class RLResult:
    run_dir: Path
    steps: int
    final_reward: float
    """Mean reward over the last (up to) 10 steps."""
    eval_accuracy: float | None
    records: list[dict]


class GRPOStep(TrainStep):
    """TrainStep with GRPO's loss in place of next-token cross-entropy. `targets` packs the
    per-token inputs of the loss, (B, Tc, 6) float32: completion token, loss mask, old
    log-prob, advantage, importance weight, reference log-prob; `prompt_lengths` and `routed`
    are set on the object for the step's batch (one micro-batch)."""

    def __init__(self, model, optimizer, config: TrainConfig, process, loss_config: grpo.LossConfig,
                 temperature: float) -> None:
        super().__init__(model, optimizer, config, process)
        self.loss_config, self.temperature = loss_config, temperature
        self.prompt_lengths: torch.Tensor | None = None
        self.routed: torch.Tensor | None = None
        self.use_is = self.use_ref = False
        self.metrics: dict = {}

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        completions, mask = y[..., 0].long(), y[..., 1]
        logp_old, advantages = y[..., 2], y[:, 0, 3]
        with self.autocast, replay_routing(self.model, self.routed):
            logits = self.forward(x).logits
        logp, _ = grpo.completion_logprobs(logits, self.prompt_lengths, completions, self.temperature)
        loss, self.metrics = grpo.policy_loss(
            logp, logp_old, advantages, mask, self.loss_config,
            ref_logp=y[..., 5] if self.use_ref else None,
            is_weights=y[..., 4] if self.use_is else None)
        return loss


class GRPOTrainer:
    def __init__(self, config: RLConfig, *, resume: bool = False, overwrite: bool = False) -> None:
        self.config = c = config
        self.run_dir = Path(c.out_dir) / c.name
        self.folder = RunDir(self.run_dir, files=RUN_FILES)
        self.warn = lambda message: print(message, file=sys.stderr)
        try:
            self._build(self._check_run_dir(resume, overwrite))   # holds the folder's lock
        except BaseException:
            self.folder.release()   # a trainer that could not be built holds no folder
            raise

    def _build(self, checkpoint: dict | None) -> None:
        c = self.config
        self.device = resolve_device(c.device)
        engine_device = resolve_device(c.engine_device) if c.engine_device else self.device
        self.say = tqdm.write if c.progress else (lambda message: None)
        options = {} if c.task_size is None else (
            {"numbers": c.task_size} if c.task == "countdown" else {"digits": c.task_size})
        if c.task == "gsm8k":
            options = {"data_dir": c.data_dir}
        try:
            self.task = get_task(c.task, **options)
        except ValueError as e:   # the task's own words name its option; say the flag too
            raise ValueError(f"--task {c.task} --task-size {c.task_size}: {e}") from None
        self.eval_set = self.task.eval_problems(c.eval_problems)
        self.exclude = {p.prompt for p in self.eval_set}
        self.data_fingerprint = task_fingerprint(self.task, self.eval_set, c)
        if checkpoint is not None:   # e.g. --task gsm8k --data-dir OTHER
            check_same_data(checkpoint.get("data_fingerprint"), self.data_fingerprint,
                            self.run_dir)
        self.model_config = policy_config(c, self.task)
        self.tokenizer, self.stop_ids = policy_tokenizer(c)
        if c.routing_replay and not self.model_config.is_moe:
            raise ValueError("--routing-replay needs an MoE policy")

        # the policy: warm start, then the trainer-side alignment
        state = warm_start(c, self.task, self.model_config, str(self.device), self.say)
        self.policy = build_model(self.model_config)
        self.policy.load_state_dict(state)
        self.reference = None
        if c.beta > 0:
            self.reference = copy.deepcopy(self.policy).to(self.device).eval().requires_grad_(False)
        if c.align in ("qat", "quads"):
            self.say(apply_asymmetric_qat(self.policy))
        if c.routing_replay:
            enable_routing_replay(self.policy)
        elif self.model_config.is_moe:
            enable_routing_replay(self.policy)   # records own choices for routing agreement; replays nothing
        self.policy.to(self.device)

        self.train_config = TrainConfig(
            model=c.model, tokenizer="model" if is_model_folder(c.model) else "bytes", recipe="bf16", batch_size=c.batch_size, seq_len=1, lr=c.lr,
            max_steps=c.steps * c.num_iterations, warmup_steps=0, min_lr_ratio=1.0,
            weight_decay=c.weight_decay, grad_clip=c.grad_clip, seed=c.seed,
            device=str(self.device), progress=c.progress)
        self.optimizer = build_optimizer(self.policy, self.train_config, self.device)
        loss_config = grpo.LossConfig(c.loss_type, c.epsilon, c.epsilon_high, c.beta,
                                      c.max_completion_length)
        self.step_fn = GRPOStep(self.policy, self.optimizer, self.train_config,
                                Distributed(device=self.device), loss_config, c.temperature)
        self.step_fn.use_is = c.importance_sampling != "none"
        self.step_fn.use_ref = self.reference is not None

        self.engine = RolloutEngine(self.model_config, c.rollout, c.rac_ratio, engine_device,
                                    max_batch_size=max(c.batch_size, min(c.eval_problems, 256)),
                                    compile_decode=c.compile_decode, packed_gemm=c.packed_gemm,
                                    activation_scale=c.rollout_activation_scale)
        self.calibration = None
        if c.rollout_activation_scale == "static":
            self.calibration = calibration_batches(
                [self.tokenizer.encode(p.prompt + p.solution)
                 for p in self.task.problems(c.seed, -1, CALIBRATION_PROBLEMS, self.exclude)])
        # the common evaluator: the trainer's weights through a bf16 engine, the same for every
        # run of a comparison whatever its rollouts (a bf16 run's own engine is one already)
        self.evaluator = (self.engine if c.rollout == "bf16" else
                          RolloutEngine(self.model_config, "bf16", device=engine_device,
                                        max_batch_size=min(c.eval_problems, 256)))
        self.start_step, self.records, self.wall_before = 0, [], 0.0
        if checkpoint is not None:
            self.policy.load_state_dict(checkpoint["model"])
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            if self.reference is not None:
                self.reference.load_state_dict(checkpoint["reference"])
            set_rng_state(checkpoint["rng"])
            self.start_step, self.records = checkpoint["step"], checkpoint["metrics"]
            self.wall_before = checkpoint["wall_time_s"]
        self.resumed = checkpoint is not None
        self.last_checkpoint_step = self.start_step if self.resumed else None
        self.sync()
        for path, size in self.folder.start(c, fresh=checkpoint is None):
            self.warn(f"lowbit: removed {path} ({size:,} bytes), left by a write that was killed")

    # ---- the run folder -------------------------------------------------------------------

    def _check_run_dir(self, resume: bool, overwrite: bool) -> dict | None:
        """lowbit.train's run-folder rules: refuse a taken folder or a changed config, resume
        from the newest checkpoint that verifies (saying which it skipped)."""
        return self.folder.check(self.config, resume, overwrite, warn=self.warn)

    # ---- the four pieces ------------------------------------------------------------------

    def sampling(self, step: int) -> SamplingParams:
        c = self.config
        return SamplingParams(c.temperature, c.top_p, c.top_k, c.max_completion_length,
                              self.stop_ids, seed=c.seed * 1_000_003 + step)

    def generate(self, step: int) -> tuple[list[Problem], Rollout]:
        c = self.config
        problems = self.task.problems(c.seed, step, c.prompts_per_step, self.exclude)
        problems = [p for p in problems for _ in range(c.num_generations)]   # groups adjacent
        prompts = [self.tokenizer.encode(p.prompt) for p in problems]
        return problems, self.engine.generate(prompts, self.sampling(step))

    def score(self, problems: list[Problem], rollout: Rollout) -> torch.Tensor:
        texts = [self.tokenizer.decode(ids) for ids in rollout.completion_lists()]
        return torch.tensor([self.task.reward(p, t) for p, t in zip(problems, texts)])

    def batch(self, rollout: Rollout) -> RLBatch:
        dev = self.device
        completions, mask = rollout.completions.to(dev), rollout.completion_mask.to(dev)
        if self.config.mask_truncated_completions:
            mask = mask & rollout.stopped.to(dev)[:, None]
        lengths = torch.tensor([len(p) for p in rollout.prompts], device=dev)
        total = lengths + rollout.completion_mask.sum(1).to(dev)
        T = int(total.max())
        ids = torch.zeros(len(rollout.prompts), T, dtype=torch.int64, device=dev)
        for b, (prompt, completion) in enumerate(zip(rollout.prompts, rollout.completion_lists())):
            row = prompt + completion
            ids[b, :len(row)] = torch.tensor(row, device=dev)
        routed = None
        if rollout.routed_experts is not None:
            routed = rollout.routed_experts[:, :T].to(dev)
        return RLBatch(ids, lengths, completions, mask, rollout.logprobs.to(dev), routed)

    def train_on(self, step: int, batch: RLBatch, rewards: torch.Tensor) -> dict:
        c, fn = self.config, self.step_fn
        metrics: dict = {}
        advantages = grpo.group_advantages(rewards, c.num_generations, c.scale_rewards).to(self.device)
        replayed = batch.routed if c.routing_replay else None
        with torch.no_grad():
            with fn.autocast, replay_routing(self.policy, replayed):
                logits = self.policy(batch.input_ids).logits
            logp_old, entropy = grpo.completion_logprobs(logits, batch.prompt_lengths,
                                                         batch.completions, c.temperature)
            if batch.routed is not None:
                metrics["routing/agreement"] = routing_agreement(self.policy, batch.routed)
            ref_logp = torch.zeros_like(logp_old)
            if self.reference is not None:
                ref_logits = self.reference(batch.input_ids).logits
                ref_logp, _ = grpo.completion_logprobs(ref_logits, batch.prompt_lengths,
                                                       batch.completions, c.temperature)
        metrics.update(grpo.mismatch_metrics(batch.rollout_logprobs, logp_old, batch.mask))
        weights, is_metrics = grpo.importance_weights(logp_old, batch.rollout_logprobs,
                                                      batch.mask.float(), c.importance_sampling,
                                                      c.is_mode, c.is_cap)
        metrics.update(is_metrics)
        metrics["entropy"] = float((entropy * batch.mask).sum() / batch.mask.sum().clamp(min=1))
        weights = weights if weights is not None else torch.ones_like(logp_old)
        packed = torch.stack([batch.completions.float(), batch.mask.float(), logp_old,
                              advantages[:, None].expand_as(logp_old), weights, ref_logp], dim=-1)
        fn.prompt_lengths, fn.routed = batch.prompt_lengths, replayed
        losses, grad_norms = [], []
        for i in range(c.num_iterations):
            result = fn(step * c.num_iterations + i, batch.input_ids, packed)
            if result.skipped:   # the update was not applied; a NaN policy loss does not heal
                raise NonFiniteLossError(nonfinite_message(step + 1, 1, self.last_checkpoint),
                                         step + 1, self.last_checkpoint)
            losses.append(result.loss), grad_norms.append(result.grad_norm)
            for message in result.messages:
                self.say(message)
        metrics.update({k: v for k, v in fn.metrics.items() if k != "nonfinite_loss"})
        metrics.update(loss=sum(losses) / len(losses), grad_norm=grad_norms[-1], lr=result.lr)
        return metrics

    def sync(self) -> None:
        """The trainer's weights to the engine (the engine copies and quantizes them); for
        static activation scales, with the amax of every linear's input over the calibration
        problems, through the policy as the trainer runs it (a served checkpoint's input_scale
        is calibrated for its own weights, so this is redone at every sync)."""
        input_amax = None
        if self.calibration is not None:
            with self.step_fn.autocast:
                input_amax = calibrate_input_amax(self.policy, self.calibration)
        self.engine.load_state_dict(self.policy.state_dict(), input_amax=input_amax)

    # ---- evaluation -----------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out set by the two evaluators: `eval/accuracy`, the run's
        own rollout engine (its precision: what the policy scores as deployed), and
        `eval/accuracy_bf16`, the trainer's weights through a bf16 engine (what the RL did to
        the policy, comparable across rollout precisions)."""
        own = greedy_accuracy(self.engine, self.task, self.tokenizer, self.eval_set,
                              self.config.max_completion_length, self.stop_ids)
        if self.evaluator is self.engine:
            return {"eval/accuracy": own, "eval/accuracy_bf16": own}
        self.evaluator.load_state_dict(self.policy.state_dict())
        common = greedy_accuracy(self.evaluator, self.task, self.tokenizer, self.eval_set,
                                 self.config.max_completion_length, self.stop_ids)
        return {"eval/accuracy": own, "eval/accuracy_bf16": common}

    # ---- the loop -------------------------------------------------------------------------

    def run(self) -> RLResult:
        c = self.config
        log = MetricsLog(self.run_dir, self.records, self.start_step, self.say)
        on_terminal = c.progress and sys.stderr.isatty()
        bar = tqdm(total=c.steps, initial=self.start_step, disable=not on_terminal, unit="step",
                   dynamic_ncols=True)
        self.say(f"{'resuming' if self.resumed else 'starting'} {self.run_dir} at step "
                 f"{self.start_step}/{c.steps}: {sum(p.numel() for p in self.policy.parameters()) / 1e6:.2f}M "
                 f"parameters, task {self.task.name}, rollouts {c.setting}, "
                 f"{c.batch_size} completions/step")
        t_session, step = time.perf_counter(), self.start_step
        end = c.steps if c.max_steps_per_session is None else min(c.steps, step + c.max_steps_per_session)
        no_signal = 0   # how many of the run's first steps, in a row, had no signal
        try:
            if step == 0 and c.eval_every:
                log.write({"event": "eval", "step": 0, **self.evaluate()})
            while step < end:
                record = self.one_step(step)
                step += 1
                record["step"] = step
                if record["frac_reward_zero_std"] == 1.0 and no_signal == step - 1:
                    no_signal += 1   # steps 1..step all without signal (a resume starts past them)
                if step == NO_SIGNAL_STEPS and no_signal == step:
                    self.warn(f"lowbit: warning: no learning signal: every group's rewards are "
                              f"equal in each of the first {step} steps (frac_reward_zero_std "
                              f"1.0), so every advantage is 0 and the rewards teach nothing; try "
                              f"more --warmstart-steps, an easier --task-size, a higher "
                              f"--temperature or a larger --num-generations")
                if step % c.log_every == 0 or step == c.steps:
                    log.write(record)
                if (c.eval_every and step % c.eval_every == 0) or step == c.steps:
                    scores = self.evaluate()
                    scores["eval/collapsed"] = float(collapsed(
                        [r["eval/accuracy_bf16"] for r in log.records
                         if r["event"] == "eval" and "eval/accuracy_bf16" in r]
                        + [scores["eval/accuracy_bf16"]]))
                    if scores["eval/collapsed"] and not any(
                            r.get("eval/collapsed") for r in log.records if r["event"] == "eval"):
                        self.warn(f"lowbit: warning: the policy collapsed at step {step}: held-out "
                                  f"accuracy (trainer's weights in bf16) below half its peak in "
                                  f"each of the last {COLLAPSE_EVALS} evaluations")
                    log.write({"event": "eval", "step": step, **scores})
                    self.say(f"step {step}: held-out accuracy {scores['eval/accuracy']:.3f} "
                             f"(the trainer's weights in bf16: {scores['eval/accuracy_bf16']:.3f})")
                if (c.checkpoint_every and step % c.checkpoint_every == 0) or step in (c.steps, end):
                    self.checkpoint(step, log, t_session)
                bar.update(1)
                bar.set_postfix(reward=f"{record['reward']:.3f}",
                                gap=f"{record.get('sampling/sampling_logp_difference/mean', 0):.4f}",
                                refresh=False)
                if not on_terminal and c.progress:
                    self.say(_line(record, c.steps))
            return self.finish(step, log.records, t_session)
        except KeyboardInterrupt:
            raise TrainingInterrupted(interrupted_message(step, self.last_checkpoint_step,
                                                          self.last_checkpoint)) from None
        finally:
            bar.close()
            log.close()
            self.folder.release()

    def one_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        problems, rollout = self.generate(step)
        t1 = time.perf_counter()
        rewards = self.score(problems, rollout)
        batch = self.batch(rollout)
        t2 = time.perf_counter()
        metrics = self.train_on(step, batch, rewards)
        t3 = time.perf_counter()
        self.sync()
        t4 = time.perf_counter()
        lengths = rollout.lengths.float()
        group_std = rewards.view(-1, self.config.num_generations).std(dim=1)
        return {"event": "train", "reward": float(rewards.mean()),
                "reward_std": float(group_std.mean()),
                # TRL's name: groups whose rewards are all equal give zero advantages, no signal
                "frac_reward_zero_std": float(torch.isclose(
                    group_std, torch.zeros_like(group_std)).float().mean()),
                "accuracy": float((rewards >= 1).float().mean()),
                "completions/mean_length": float(lengths.mean()),
                "completions/max_length": float(lengths.max()),
                "completions/clipped_ratio": float((~rollout.stopped).float().mean()),
                **metrics,
                "rollout/tokens_per_s": rollout.generated_tokens / max(t1 - t0, 1e-9),
                "time/generate_s": t1 - t0, "time/score_s": t2 - t1, "time/train_s": t3 - t2,
                "time/sync_s": t4 - t3}

    @property
    def last_checkpoint(self) -> Path | None:
        """The run's newest checkpoint file, None before the first."""
        return self.folder.checkpoint if self.last_checkpoint_step is not None else None

    def checkpoint(self, step: int, log: MetricsLog, t_session: float) -> None:
        state = {"version": CHECKPOINT_VERSION, "step": step, "config": self.config.to_dict(),
                 "model": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "rng": rng_state(), "metrics": log.records,
                 "wall_time_s": self.wall_before + time.perf_counter() - t_session,
                 "data_fingerprint": self.data_fingerprint,
                 # what `lowbit export` needs to build the policy without RL's code
                 "model_config": dataclasses.asdict(self.model_config),
                 "tokenizer_dir": self.config.model if is_model_folder(self.config.model) else None}
        if self.reference is not None:
            state["reference"] = self.reference.state_dict()
        self.folder.save_checkpoint(state)
        self.last_checkpoint_step = step
        self.plot(force=False)

    def plot(self, force: bool) -> None:
        """rl.png, redrawn at a checkpoint at most once a minute (RunDir.plot), and at the end."""
        from lowbit.rl.plot import plot_rl_runs

        self.folder.plot(force, draw=lambda: plot_rl_runs([self.run_dir], self.run_dir / "rl.png"))

    def finish(self, step: int, records: list[dict], t_session: float) -> RLResult:
        train = [r for r in records if r["event"] == "train"]
        evals = [r for r in records if r["event"] == "eval"]
        last = train[-10:]
        final_reward = sum(r["reward"] for r in last) / len(last) if last else math.nan
        accuracy = evals[-1]["eval/accuracy"] if evals else None
        summary = {"steps": step, "final_reward": final_reward, "eval_accuracy": accuracy,
                   "setting": self.config.setting, "device": str(self.device),
                   "wall_time_s": self.wall_before + time.perf_counter() - t_session}
        for key in ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                    "sampling/kl_k3"):
            values = [r[key] for r in train if key in r]
            if values:
                summary[key] = sum(values) / len(values)
        if step >= self.config.steps:   # a session stopped by max_steps_per_session is not the end
            self.folder.write_final(summary)
        self.plot(force=True)
        self.say(f"{'done' if step >= self.config.steps else 'stopped'}: step {step}/{self.config.steps}, reward {final_reward:.3f} (last 10 steps), "
                 f"held-out accuracy {accuracy if accuracy is None else round(accuracy, 3)} -> {self.run_dir}")
        return RLResult(self.run_dir, step, final_reward, accuracy, records)


COLLAPSE_EVALS = 3
"""Evaluations in a row below half the running peak that flag a collapse."""


def collapsed(accuracies: list[float], evals: int = COLLAPSE_EVALS) -> bool:
    """The policy has collapsed: the last `evals` held-out accuracies (the common bf16
    evaluator's, oldest first) are each below half the peak reached before them (a peak of 0
    never collapses)."""
    if len(accuracies) <= evals:
        return False
    peak = max(accuracies[:-evals])
    return peak > 0 and all(a < peak / 2 for a in accuracies[-evals:])


def _line(record: dict, total: int) -> str:
    gap = record.get("sampling/sampling_logp_difference/mean", float("nan"))
    return (f"step {record['step']}/{total} | reward {record['reward']:.3f} | "
            f"len {record['completions/mean_length']:.1f} | gap {gap:.4f} | "
            f"{record['rollout/tokens_per_s']:,.0f} rollout tok/s")


def calibration_batches(sequences: list[list[int]]) -> list[torch.Tensor]:
    """Token-id sequences as (B, T) batches of equal-length rows, shortest first: no padding,
    so only the sequences' own tokens reach the calibrated amax."""
    by_length: dict[int, list[list[int]]] = {}
    for seq in sequences:
        by_length.setdefault(len(seq), []).append(seq)
    return [torch.tensor(rows) for _, rows in sorted(by_length.items())]


def task_fingerprint(task, eval_set: list[Problem], config: RLConfig) -> str:
    """SHA-256 of the problems a run reads: its held-out set and its first step's draw (for
    gsm8k, what --data-dir holds; for the generated tasks, a function of the config). A
    checkpoint stores it, so that a resume on other problems is refused."""
    problems = eval_set + task.problems(config.seed, 0, config.prompts_per_step, None)
    return hashlib.sha256(repr([(p.prompt, p.answer) for p in problems]).encode()).hexdigest()


def run_rl(config: RLConfig, *, resume: bool = False, overwrite: bool = False) -> RLResult:
    """Run (or resume) the GRPO run `config` describes; see the module doc."""
    return GRPOTrainer(config, resume=resume, overwrite=overwrite).run()
