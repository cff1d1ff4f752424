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
             takes num_iterations optimizer steps of the clipped GRPO loss (GRPOLoss on a
             GRPOBatch) -- each through lowbit.train.step.TrainStep, the step `lowbit train`
             runs (LR, clipping, skips)
  sync       the trainer's state dict goes to the engine (RolloutEngine.sync: packed by the
             trainer when the engine sits on another GPU, else quantized on arrival; with
             --rollout-activation-scale static, with each linear's input amax calibrated on
             the new weights, as `lowbit export --activations nvfp4` calibrates a checkpoint)
Each piece is a method (`generate`, `score`, `train_on`, `sync`) that a subclass can replace.

Determinism: prompts and sampling noise are pure functions of (seed, step), the engine's
weights a function of the trainer's, so N steps + resume + M steps equals N + M steps.

The run goes through lowbit.train's run loop (lowbit.train.runner: cadence, evaluation,
checkpoints, the final record, progress), to which a GRPOTrainer is the job, and its folder
follows lowbit.train's rules (lowbit.train.run_dir.RunDir): one writer at a time (a
GRPOTrainer holds the folder's lock from its construction until run() ends), a resume
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
from typing import NamedTuple

import torch
from tqdm import tqdm

from lowbit.data.tasks import Problem, get_task
from lowbit.export import calibrate_input_amax
from lowbit.models import build_model, is_model_folder
from lowbit.nn import reuse_weight_operands
from lowbit.rl import grpo
from lowbit.rl.config import RLConfig
from lowbit.rl.engine import Rollout, RolloutEngine
from lowbit.rl.sampling import SamplingParams
from lowbit.rl.trainer_side import (apply_asymmetric_qat, enable_routing_replay, replay_routing,
                                    routing_agreement_counts)
from lowbit.rl.warmstart import greedy_accuracy, policy_config, policy_tokenizer, warm_start
from lowbit.train.build import build_optimizer
from lowbit.train.checkpoint import check_same_data, set_rng_state
from lowbit.train.config import resolve_device
from lowbit.train.distributed import Distributed
from lowbit.train.graphs import split_batch
from lowbit.train.run_dir import RunDir
from lowbit.train.runner import Cadence, RunLoop, Start, StepOutcome
from lowbit.train.step import StepConfig, TrainStep, refuse_compile

__all__ = ["GRPOTrainer", "GRPOLoss", "GRPOBatch", "RLResult", "run_rl", "RLBatch", "RUN_FILES",
           "task_fingerprint", "collapsed", "COLLAPSE_EVALS", "calibration_batches",
           "CALIBRATION_PROBLEMS"]

RUN_FILES = ("config.json", "metrics.jsonl", "final.json", "rl.png")   # beside checkpoints/
CALIBRATION_PROBLEMS = 32
"""Training problems (prompt and reference solution; the warm start's first draw, never the
held-out set) whose forward through the policy calibrates static activation scales at every
sync (lowbit.export.calibrate_input_amax)."""
MICRO_BATCH_TOKENS = 8_192
"""Without --micro-batch-size, the trainer's passes take as many completions as hold at most
this many tokens, each counted as the longest held-out prompt plus --max-completion-length
(half verl's default ppo_max_token_len_per_gpu): a step of few or short completions runs at
once, and a Qwen3-0.6B-sized policy's 128 GSM8K completions of 128 tokens run in micro-batches
of 32, which fit an H200 where the whole step ran out of memory (2026-12-05). The size chosen
is saved in the checkpoint, and a resumed run keeps it (one saved before it had none and ran
whole steps)."""
NO_SIGNAL_STEPS = 5
"""A run whose first this many steps (all of them, in a shorter run) had equal rewards in every
group says so (one warning):
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
    prompt_ids: torch.Tensor | None  # (B, P) each row's prompt, right-padded to the longest
                                     #   (--share-prompts; None without)


@dataclass
class RLResult:
    run_dir: Path
    steps: int
    final_reward: float
    """Mean reward over the last (up to) 10 steps."""
    eval_accuracy: float | None
    records: list[dict]


class GRPOBatch(NamedTuple):
    """One optimizer step's batch of the GRPO loss (lowbit.train.step's batch: every entry's
    first dimension is the completions)."""

    input_ids: torch.Tensor           # (B, T) prompt + completion, right-padded
    prompt_lengths: torch.Tensor      # (B,)
    completions: torch.Tensor         # (B, Tc)
    mask: torch.Tensor                # (B, Tc) float: 1 for the tokens in the loss
    logp_old: torch.Tensor | None     # (B, Tc) the trainer's log-probs before the update; None:
                                      #   on-policy, the loss's own forward gives them (detached)
    advantages: torch.Tensor          # (B,)
    is_weights: torch.Tensor | None   # (B, Tc) truncated importance weights, or None (on-policy:
                                      #   made by the loss from its log-probs)
    ref_logp: torch.Tensor | None     # (B, Tc) the reference policy's log-probs (beta > 0)
    routed: torch.Tensor | None       # (B, T, layers, k) experts to replay, or None
    loss_tokens: torch.Tensor         # (B,) every row: the step's loss tokens / micro-batches
    rollout_logp: torch.Tensor | None = None    # (B, Tc) the engine's log-probs of the sampled
                                                #   tokens (needed on-policy)
    engine_routed: torch.Tensor | None = None   # (B, T, layers, k) the engine's experts (MoE),
                                                #   for the routing agreement on-policy
    prompt_ids: torch.Tensor | None = None      # (B, P) each row's prompt (--share-prompts)


def completion_logits(model, input_ids: torch.Tensor, prompt_lengths: torch.Tensor,
                      completions: torch.Tensor, prompt_ids: torch.Tensor | None = None,
                      shared_group: int = 0) -> torch.Tensor:
    """(B, Tc, V): the logits that predict each completion token. shared_group G > 0 (with
    prompt_ids, each row's prompt; the rows in groups of G consecutive ones that share it, as
    GRPO samples them): each prompt runs once for its group (Transformer's `prompts`,
    lowbit.models.transformer.SharedPrompts); else each row's prompt + completion runs
    (`logits_at`, the completion positions only)."""
    if shared_group:
        return model(completions, prompts=(prompt_ids[::shared_group],
                                           prompt_lengths[::shared_group])).logits
    positions = grpo.completion_positions(prompt_lengths, completions.shape[1], input_ids.shape[1])
    return model(input_ids, logits_at=positions).logits


def shared_tokens(routed: torch.Tensor | None, prompt_lengths: torch.Tensor, completions: torch.Tensor,
                  prompt_ids: torch.Tensor | None, shared_group: int) -> torch.Tensor | None:
    """routed (B, T, layers, k), recorded at each row's positions (-1: none), in the token order
    completion_logits runs with shared_group G > 0 and the same prompt_lengths, completions
    (B, Tc) and prompt_ids (B, P) (SharedPrompts: the prompts, each from its group's first row,
    then the completions): (1, Gp * P + B * Tc, layers, k), -1 at a prompt's padding and past a
    row's end. routed as it is (None too) when shared_group is 0."""
    if routed is None or not shared_group:
        return routed
    B, T = routed.shape[:2]
    P, Tc, dev = prompt_ids.shape[1], completions.shape[1], routed.device
    first = routed[::shared_group]                                           # (Gp, T, layers, k)
    at = torch.arange(P, device=dev)
    prompts = first[:, at.clamp(max=T - 1)]                                  # (Gp, P, layers, k)
    prompts = prompts.masked_fill((at >= prompt_lengths[::shared_group, None])[:, :, None, None], -1)
    at = prompt_lengths[:, None] + torch.arange(Tc, device=dev)              # (B, Tc)
    completions = routed.gather(1, at.clamp(max=T - 1)[:, :, None, None].expand(-1, -1, *routed.shape[2:]))
    completions = completions.masked_fill((at >= T)[:, :, None, None], -1)
    return torch.cat((prompts.flatten(0, 1), completions.flatten(0, 1)))[None]


class GRPOLoss:
    """GRPO's clipped policy loss as the step's loss function (lowbit.train.step.LossFn):
    loss_fn(model, GRPOBatch). `policy` is the plain module whose routers replay the batch's
    experts; each call's metrics (clip ratios, KL, ...: means over its loss tokens) are
    appended to .metrics with that token count, all left on the device, for the caller, which
    empties it and reads them back once for the step (`reduce_metrics`).

    On-policy (batch.logp_old None: one optimizer step per rollout batch, num_iterations 1)
    the policy before the update is the one this forward runs, so its log-probs, detached,
    are the old ones (as TRL takes them): the importance weights (`importance`: level, mode,
    cap of grpo.importance_weights), the engine/trainer mismatch, the entropy and the routing
    agreement are then measured here, per micro-batch, and no separate no-grad pass is run."""

    def __init__(self, policy: torch.nn.Module, config: grpo.LossConfig, temperature: float,
                 importance: tuple[str, str, float] = ("none", "truncate", 3.0),
                 shared_group: int = 0) -> None:
        """shared_group: G > 0 runs each group of G rows' prompt once (completion_logits)."""
        self.policy, self.config, self.temperature = policy, config, temperature
        self.importance, self.shared_group = importance, shared_group
        self.metrics: list[tuple[dict, torch.Tensor]] = []

    def __call__(self, model, batch: GRPOBatch) -> torch.Tensor:
        rows = (batch.input_ids, batch.prompt_lengths, batch.completions, batch.prompt_ids, self.shared_group)
        with replay_routing(self.policy, shared_tokens(batch.routed, *rows[1:])):
            logits = completion_logits(model, *rows)   # (B, Tc, V)
        logp, entropy = grpo.completion_logprobs(logits, batch.completions, self.temperature)
        logp_old, is_weights, measured = batch.logp_old, batch.is_weights, {}
        if logp_old is None:
            if batch.rollout_logp is None:
                raise ValueError("an on-policy GRPOBatch (logp_old None) needs rollout_logp, the "
                                 "engine's log-probs, for its importance weights and mismatch")
            logp_old = logp.detach()
            is_weights, measured = measure_old_policy(logp_old, entropy, batch.rollout_logp,
                                                      batch.mask, self.importance)
            if batch.engine_routed is not None:
                counts = routing_agreement_counts(self.policy, shared_tokens(batch.engine_routed, *rows[1:]))
                if counts is not None:
                    measured["routing/agreeing_pairs"], measured["routing/recorded_pairs"] = counts
        loss, metrics = grpo.policy_loss(logp, logp_old, batch.advantages, batch.mask,
                                         self.config, ref_logp=batch.ref_logp,
                                         is_weights=is_weights, tokens=batch.loss_tokens[0])
        self.metrics.append(({**measured, **metrics}, batch.mask.sum()))
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
        solutions = [len(self.tokenizer.encode(p.solution)) for p in self.eval_set]
        cut = sum(n > c.max_completion_length for n in solutions)
        if cut:
            self.warn(f"lowbit: warning: --max-completion-length {c.max_completion_length} is shorter "
                      f"than {cut} of the {len(solutions)} held-out problems' reference solutions "
                      f"(up to {max(solutions)} tokens): completions that long are cut before their "
                      f"answer; raise it to at least {max(solutions)}")
        if c.routing_replay and not self.model_config.is_moe:
            raise ValueError("--routing-replay needs an MoE policy")
        if c.compile:   # before the warm start, which may take minutes
            refuse_compile(self.device)

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
        if c.compile:   # one graph for every layer and every sequence length, the policy's passes
            self.policy.compile_layers(dynamic=True)
            if self.reference is not None:
                self.reference.compile_layers(dynamic=True)

        # a constant LR; the step's completions in micro-batches of micro_batch_size
        if c.micro_batch_size is not None:
            micro = c.micro_batch_size
        elif checkpoint is not None:   # the size the run chose at its start (none: whole steps)
            micro = checkpoint.get("micro_batch_size", c.batch_size)
        else:
            longest = max(len(self.tokenizer.encode(p.prompt)) for p in self.eval_set)
            micro = auto_micro_batch(c.batch_size, longest + c.max_completion_length,
                                     group=c.num_generations if c.share_prompts else 1)
        self.micro_batch_size = micro
        step_config = StepConfig(batch_size=micro, grad_accum_steps=c.batch_size // micro, lr=c.lr,
                                 total_steps=c.steps * c.num_iterations,
                                 weight_decay=c.weight_decay, grad_clip=c.grad_clip)
        self.optimizer = build_optimizer(self.policy, step_config, self.device)
        self.loss_fn = GRPOLoss(self.policy, grpo.LossConfig(
            c.loss_type, c.epsilon, c.epsilon_high, c.beta, c.max_completion_length),
            c.temperature, (c.importance_sampling, c.is_mode, c.is_cap),
            shared_group=c.num_generations if c.share_prompts else 0)
        self.step_fn = TrainStep(self.policy, self.optimizer, step_config,
                                 Distributed(device=self.device), loss_fn=self.loss_fn)

        self.engine = RolloutEngine(self.model_config, c.rollout, c.rac_ratio, engine_device,
                                    max_batch_size=max(c.batch_size, min(c.eval_problems, 256)),
                                    compile_decode=c.compile_decode, packed_gemm=c.packed_gemm,
                                    activation_scale=c.rollout_activation_scale,
                                    rac_group=c.rac_group, rac_fold=c.rac_fold)
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
        # the third (--eval-w4a16): the trainer's weights with NVFP4 weights, bf16 activations
        self.evaluator_w4a16 = None
        if c.eval_w4a16:
            self.evaluator_w4a16 = (self.engine if c.rollout == "nvfp4-w4a16" else
                                    RolloutEngine(self.model_config, "nvfp4-w4a16", device=engine_device,
                                                  max_batch_size=min(c.eval_problems, 256)))
        self.start = Start.of(checkpoint)
        if checkpoint is not None:
            self.policy.load_state_dict(checkpoint["model"])
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            if self.reference is not None:
                self.reference.load_state_dict(checkpoint["reference"])
            set_rng_state(checkpoint["rng"])
        self.no_signal = 0   # how many of the run's first steps, in a row, had no signal
        self.last_record: dict = {}
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
        rows = [prompt + completion for prompt, completion in zip(rollout.prompts, rollout.completion_lists())]
        ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.int64)   # made here, copied once
        for b, row in enumerate(rows):
            ids[b, :len(row)] = torch.tensor(row)
        ids, prompt_ids = ids.to(dev), None
        G = self.loss_fn.shared_group
        if G:   # each row's prompt, for the shared passes
            if any(rollout.prompts[b] != rollout.prompts[b - b % G] for b in range(len(rows))):
                raise RuntimeError(f"--share-prompts: the rollout's rows are not in groups of {G} "
                                   f"that share a prompt")
            prompt_ids = torch.zeros(len(rows), max(map(len, rollout.prompts)), dtype=torch.int64)
            for b, prompt in enumerate(rollout.prompts):
                prompt_ids[b, :len(prompt)] = torch.tensor(prompt)
            prompt_ids = prompt_ids.to(dev)
        lengths = torch.tensor([len(p) for p in rollout.prompts], device=dev)
        T = ids.shape[1]
        routed = None
        if rollout.routed_experts is not None:
            routed = rollout.routed_experts[:, :T].to(dev)
        return RLBatch(ids, lengths, completions, mask, rollout.logprobs.to(dev), routed, prompt_ids)

    def train_on(self, step: int, batch: RLBatch, rewards: torch.Tensor) -> dict | None:
        """num_iterations optimizer steps on the step's rollouts: their metrics, or None when
        one was skipped for a NaN/Inf loss or gradient norm (the run stops there). With one
        iteration (on-policy) the old log-probs come from the update's own forward (GRPOLoss);
        with more, from a no-grad pass first (`old_logprobs`), as every iteration needs them.
        The metrics stay on the device until the last micro-batch is done, then come back in
        one read (`reduce_metrics`): on a GPU each read waits for the queue to drain."""
        c, fn = self.config, self.step_fn
        advantages = grpo.group_advantages(rewards, c.num_generations, c.scale_rewards).to(self.device)
        replayed = batch.routed if c.routing_replay else None
        mask = batch.mask.float()
        on_policy = c.num_iterations == 1
        measured: dict = {}   # the no-grad pass's, over the whole step
        logp_old, entropy, ref_logp = self.old_logprobs(batch, replayed, measured, policy=not on_policy)
        weights = None
        if not on_policy:
            weights, old_policy = measure_old_policy(logp_old, entropy, batch.rollout_logprobs, mask,
                                                     self.loss_fn.importance)
            measured.update(old_policy)
        # dapo's token mean divides each micro-batch's sum by the step's count / micro-batches
        tokens = mask.sum().clamp(min=1) / fn.config.grad_accum_steps
        step_batch = GRPOBatch(batch.input_ids, batch.prompt_lengths, batch.completions, mask,
                               logp_old, advantages, weights, ref_logp, replayed,
                               tokens.expand(mask.shape[0]), batch.rollout_logprobs,
                               batch.routed if on_policy else None, batch.prompt_ids)
        losses, grad_norms = [], []
        for i in range(c.num_iterations):
            self.loss_fn.metrics = []
            result = fn(step * c.num_iterations + i, step_batch)
            if result.skipped:   # the update was not applied; a NaN policy loss does not heal
                return None
            losses.append(result.loss), grad_norms.append(result.grad_norm)
            for message in result.messages:
                self.say(message)
        # the no-grad pass's measurements and the last iteration's micro-batches'
        metrics = reduce_metrics([(measured, mask.sum()), *self.loss_fn.metrics])
        metrics.update(loss=sum(losses) / len(losses), grad_norm=grad_norms[-1], lr=result.lr)
        return metrics

    @torch.no_grad()
    def old_logprobs(self, batch: RLBatch, replayed: torch.Tensor | None, metrics: dict,
                     policy: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                   torch.Tensor | None]:
        """The sampled tokens' log-probs and entropies under the policy before the update
        (None, None without `policy`), and the reference policy's log-probs (None without
        one), each (B, Tc), in passes of micro_batch_size completions; the routing agreement's
        pair counts into metrics (MoE, with `policy`; `reduce_metrics` divides them), left on
        the device."""
        c = self.config
        if not policy and self.reference is None:
            return None, None, None
        logp, entropy, ref_logp, agreement = [], [], [], [0, 0]
        # the step's micro-batches, as TrainStep splits its batch (lowbit.train.graphs)
        parts = split_batch((batch.input_ids, batch.prompt_lengths, batch.completions, batch.routed,
                             replayed, batch.prompt_ids), self.step_fn.config.grad_accum_steps)
        for input_ids, prompt_lengths, completions, routed, replay, prompt_ids in parts:
            rows = (input_ids, prompt_lengths, completions, prompt_ids, self.loss_fn.shared_group)
            if policy:
                with self.step_fn.autocast, replay_routing(self.policy, shared_tokens(replay, *rows[1:])):
                    logits = completion_logits(self.policy, *rows)
                lp, ent = grpo.completion_logprobs(logits, completions, c.temperature)
                logp.append(lp), entropy.append(ent)
                if routed is not None:
                    counts = routing_agreement_counts(self.policy, shared_tokens(routed, *rows[1:]))
                    agreement = None if counts is None else [a + b for a, b in zip(agreement, counts)]
            if self.reference is not None:   # under the policy's autocast: at the start, the same log-probs
                with self.step_fn.autocast:
                    ref_logits = completion_logits(self.reference, *rows)
                ref_logp.append(grpo.completion_logprobs(ref_logits, completions, c.temperature)[0])
        if policy and batch.routed is not None:   # no MoE routers: 0 of 0 pairs, agreement None
            metrics["routing/agreeing_pairs"], metrics["routing/recorded_pairs"] = agreement or (0, 0)
        ref = torch.cat(ref_logp) if ref_logp else None
        if not policy:
            return None, None, ref
        return torch.cat(logp), torch.cat(entropy), ref

    def sync(self) -> None:
        """The trainer's weights to the engine (RolloutEngine.sync: packed where the trainer holds
        them when the engine sits on another GPU, moving 0.5625 bytes a parameter for NVFP4
        instead of 2); for static activation scales, with the amax of every linear's input over
        the calibration problems, through the policy as the trainer runs it (a served
        checkpoint's input_scale is calibrated for its own weights, so this is redone at every
        sync)."""
        input_amax = None
        if self.calibration is not None:
            with self.step_fn.autocast:
                input_amax = calibrate_input_amax(self.policy, self.calibration)
        self.engine.sync(self.policy.state_dict(), input_amax=input_amax)

    # ---- evaluation -----------------------------------------------------------------------

    def accuracies(self) -> dict[str, float]:
        """Greedy accuracy on the held-out set by the evaluators: `eval/accuracy`, the run's
        own rollout engine (its precision: what the policy scores as deployed),
        `eval/accuracy_bf16`, the trainer's weights through a bf16 engine (what the RL did to
        the policy, comparable across rollout precisions), and with eval_w4a16
        `eval/accuracy_w4a16`, the same weights with NVFP4 weights and bf16 activations."""
        scores = {"eval/accuracy": self._accuracy(self.engine)}
        for key, engine in (("eval/accuracy_bf16", self.evaluator),
                            ("eval/accuracy_w4a16", self.evaluator_w4a16)):
            if engine is self.engine:
                scores[key] = scores["eval/accuracy"]
            elif engine is not None:
                engine.sync(self.policy.state_dict())
                scores[key] = self._accuracy(engine)
        return scores

    def _accuracy(self, engine: RolloutEngine) -> float:
        return greedy_accuracy(engine, self.task, self.tokenizer, self.eval_set,
                               self.config.max_completion_length, self.stop_ids)

    # ---- the job the run loop drives (lowbit.train.runner.Job) ---------------------------

    def run(self) -> RLResult:
        c = self.config
        cadence = Cadence(c.steps, c.eval_every, c.checkpoint_every, c.log_every, max_nonfinite=1,
                          steps_this_call=c.max_steps_per_session,
                          seconds_this_call=(None if c.stop_after_minutes is None
                                             else 60 * c.stop_after_minutes))
        try:
            return RunLoop(self, self.folder, c, cadence, self.start, progress=c.progress).run()
        finally:
            self.folder.release()

    def describe(self) -> str:
        c = self.config
        micro = ("" if self.micro_batch_size == c.batch_size else
                 f" in micro-batches of {self.micro_batch_size}")
        return (f"{sum(p.numel() for p in self.policy.parameters()) / 1e6:.2f}M parameters, task "
                f"{self.task.name}, rollouts {c.setting}, {c.batch_size} completions/step{micro}")

    def step(self, step: int) -> StepOutcome:
        outcome = self.one_step(step)
        record = self.last_record
        if record.get("frac_reward_zero_std") == 1.0 and self.no_signal == step:
            self.no_signal += 1   # steps 1..step+1 all without signal (a resume starts past them)
        if step + 1 == min(NO_SIGNAL_STEPS, self.config.steps) and self.no_signal == step + 1:
            # a Hugging Face policy has no warm start to lengthen
            warm = "" if is_model_folder(self.config.model) else "more --warmstart-steps, "
            self.warn(f"lowbit: warning: no learning signal: every group's rewards are "
                      f"equal in each of the first {step + 1} steps (frac_reward_zero_std "
                      f"1.0), so every advantage is 0 and the rewards teach nothing; try "
                      f"{warm}an easier --task-size, a higher --temperature or a larger "
                      f"--num-generations")
        return outcome

    def _drain(self) -> None:
        """Wait for the work queued on the trainer's and the engine's GPUs, so that each phase's
        time/... holds its own GPU work: the optimizer's step is queued after train_on's last
        read of the device, and a sync that reads the device (an NVFP4 engine's saturation
        flags) would otherwise wait for it and count it."""
        for device in {self.device, self.engine.device}:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    def one_step(self, step: int) -> StepOutcome:
        """Generate, score, train on and sync for RL step `step` (0-based); its record's
        numbers in self.last_record."""
        t0 = time.perf_counter()
        problems, rollout = self.generate(step)
        t1 = time.perf_counter()
        rewards = self.score(problems, rollout)
        batch = self.batch(rollout)
        t2 = time.perf_counter()
        with reuse_weight_operands(self.policy, self.optimizer):   # QAT's weights: once an update
            metrics = self.train_on(step, batch, rewards)
        if metrics is None:
            self.last_record = {}
            return StepOutcome(nonfinite_in_a_row=1)
        self._drain()
        t3 = time.perf_counter()
        self.sync()
        self._drain()
        t4 = time.perf_counter()
        lengths = rollout.lengths.float()
        group_std = rewards.view(-1, self.config.num_generations).std(dim=1)
        self.last_record = record = {
            "reward": float(rewards.mean()), "reward_std": float(group_std.mean()),
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
        return StepOutcome(postfix={
            "reward": f"{record['reward']:.3f}",
            "gap": f"{record.get('sampling/sampling_logp_difference/mean', 0):.4f}"})

    def train_record(self, step: int, outcome: StepOutcome, step_time_s: float) -> dict:
        return self.last_record

    def train_line(self, record: dict, total: int) -> str:
        gap = record.get("sampling/sampling_logp_difference/mean", float("nan"))
        return (f"step {record['step']}/{total} | reward {record['reward']:.3f} | "
                f"len {record['completions/mean_length']:.1f} | gap {gap:.4f} | "
                f"{record['rollout/tokens_per_s']:,.0f} rollout tok/s")

    def evaluate(self, step: int, records: list[dict]) -> tuple[dict, str]:
        """The held-out accuracies (accuracies()) and, after step 0, the collapse flag."""
        scores = self.accuracies()
        if step > 0:
            earlier = [r["eval/accuracy_bf16"] for r in records
                       if r["event"] == "eval" and "eval/accuracy_bf16" in r]
            scores["eval/collapsed"] = float(collapsed(earlier + [scores["eval/accuracy_bf16"]]))
            if scores["eval/collapsed"] and not any(
                    r.get("eval/collapsed") for r in records if r["event"] == "eval"):
                self.warn(f"lowbit: warning: the policy collapsed at step {step}: held-out "
                          f"accuracy (trainer's weights in bf16) below half its peak in "
                          f"each of the last {COLLAPSE_EVALS} evaluations")
        return scores, (f"step {step}: held-out accuracy {scores['eval/accuracy']:.3f} "
                        f"(the trainer's weights in bf16: {scores['eval/accuracy_bf16']:.3f})")

    def after_step(self, step: int) -> None:
        return None

    def state(self) -> dict:
        c = self.config
        state = {"model": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "data_fingerprint": self.data_fingerprint, "consecutive_nonfinite": 0,
                 "micro_batch_size": self.micro_batch_size,
                 # what `lowbit export` needs to build the policy without RL's code
                 "model_config": dataclasses.asdict(self.model_config),
                 "tokenizer_dir": c.model if is_model_folder(c.model) else None}
        if self.reference is not None:
            state["reference"] = self.reference.state_dict()
        return state

    def draw(self) -> None:
        """rl.png."""
        from lowbit.rl.plot import plot_rl_runs

        plot_rl_runs([self.run_dir], self.run_dir / "rl.png")

    def finish(self, step: int, records: list[dict], wall_time_s: float) -> tuple[RLResult, dict, str]:
        train = [r for r in records if r["event"] == "train"]
        evals = [r for r in records if r["event"] == "eval"]
        last = train[-10:]
        final_reward = sum(r["reward"] for r in last) / len(last) if last else math.nan
        accuracy = evals[-1]["eval/accuracy"] if evals else None
        summary = {"steps": step, "final_reward": final_reward, "eval_accuracy": accuracy,
                   "setting": self.config.setting, "device": str(self.device),
                   "wall_time_s": wall_time_s}
        for key in ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                    "sampling/kl_k3"):
            values = [r[key] for r in train if key in r]
            if values:
                summary[key] = sum(values) / len(values)
        line = (f"{'done' if step >= self.config.steps else 'stopped'}: step {step}/"
                f"{self.config.steps}, reward {final_reward:.3f} (last 10 steps), held-out "
                f"accuracy {accuracy if accuracy is None else round(accuracy, 3)} -> {self.run_dir}")
        return RLResult(self.run_dir, step, final_reward, accuracy, records), summary, line


COLLAPSE_EVALS = 3
"""Evaluations in a row below half the running peak that flag a collapse."""


def auto_micro_batch(batch_size: int, tokens_per_completion: int, budget: int | None = None,
                     group: int = 1) -> int:
    """The largest divisor of batch_size, a multiple of `group` (whole groups: --share-prompts),
    whose completions hold at most `budget` tokens (MICRO_BATCH_TOKENS by default;
    tokens_per_completion each), at least one group: the micro-batch when none is given."""
    budget = MICRO_BATCH_TOKENS if budget is None else budget
    fits = max(group, budget // max(1, tokens_per_completion))
    return max(d for d in range(group, min(batch_size, fits) + 1, group) if batch_size % d == 0)


def collapsed(accuracies: list[float], evals: int = COLLAPSE_EVALS) -> bool:
    """The policy has collapsed: the last `evals` held-out accuracies (the common bf16
    evaluator's, oldest first) are each below half the peak reached before them (a peak of 0
    never collapses)."""
    if len(accuracies) <= evals:
        return False
    peak = max(accuracies[:-evals])
    return peak > 0 and all(a < peak / 2 for a in accuracies[-evals:])


def measure_old_policy(logp_old: torch.Tensor, entropy: torch.Tensor, rollout_logp: torch.Tensor,
                       mask: torch.Tensor, importance: tuple[str, str, float]) -> tuple[torch.Tensor | None, dict]:
    """What the policy before the update says of the engine's samples, over the loss tokens of
    `mask`: the truncated importance weights (grpo.importance_weights with `importance`: level,
    mode, cap) and the metrics -- the engine/trainer mismatch (grpo.mismatch_metrics), the mean
    entropy and the importance-sampling ratios -- as 0-d tensors on the device."""
    metrics = grpo.mismatch_metrics(rollout_logp, logp_old, mask)
    metrics["entropy"] = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)
    weights, is_metrics = grpo.importance_weights(logp_old, rollout_logp, mask, *importance)
    metrics.update(is_metrics)
    return weights, metrics


def reduce_metrics(parts: list[tuple[dict, torch.Tensor | float]]) -> dict:
    """Measurements over loss tokens, each (metrics, its loss-token count) -- a step's
    micro-batches, and the whole step's no-grad pass -- as the step's: `/min` and `/max` keys
    their min and max (over the parts with tokens), the routing pair counts summed into
    `routing/agreement`, every other key its per-token mean; a key one part measured is
    returned as it is. A NaN of a part without loss tokens is nothing measured (as
    grpo.mismatch_metrics gives it), left out as a missing key is. Values and counts may be
    0-d device tensors: they are read back first, all of them in one transfer (on a GPU every
    read is a sync that drains the launch queue, so a read per micro-batch would stall each
    one), as float64: float32 values and integer counts come back exact, the numbers float()
    of each gave."""
    tensors = [v for m, n in parts for v in (*m.values(), n) if isinstance(v, torch.Tensor)]
    read = iter(torch.stack([t.double() for t in tensors]).tolist() if tensors else [])
    host = lambda v: next(read) if isinstance(v, torch.Tensor) else v   # in the order gathered
    parts = [({k: host(v) for k, v in m.items()}, host(n)) for m, n in parts]
    out: dict = {}
    keys = dict.fromkeys(k for m, _ in parts for k in m)
    for k in keys:
        having = [(m[k], n) for m, n in parts if k in m and (n > 0 or not _is_nan(m[k]))]
        if not having:
            continue
        if k.endswith(("/min", "/max")):
            values = [v for v, n in having if n > 0] or [v for v, _ in having]
            out[k] = min(values) if k.endswith("/min") else max(values)
        elif k.startswith("routing/") and k.endswith("_pairs"):
            out[k] = sum(v for v, _ in having)
        elif len(having) == 1:
            out[k] = having[0][0]
        else:
            total = sum(n for _, n in having)
            out[k] = (sum(v * n for v, n in having) / total if total else
                      sum(v for v, _ in having) / len(having))
    if "routing/recorded_pairs" in out:
        agree, recorded = out.pop("routing/agreeing_pairs"), out.pop("routing/recorded_pairs")
        out["routing/agreement"] = agree / recorded if recorded else None
    return out


def _is_nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


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
