"""RLConfig: everything that defines a GRPO run, validated where it is built (TRL's names
where TRL has one); a field `lowbit rl` sets declares its flag (lowbit.config.flag)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from lowbit.config import RunConfig, check_stop_after_minutes, flag, require, stop_after_minutes_field
from lowbit.rl.grpo import IS_LEVELS, IS_MODES, LOSS_TYPES, SCALE_REWARDS
from lowbit.rl.precision import Precision, RolloutMode

__all__ = ["RLConfig", "ALIGNMENTS", "FREE_ON_RESUME", "MODEL_FOLDER_LR"]

MODEL_FOLDER_LR = 1e-6
"""lowbit rl's learning rate for a Hugging Face policy when --lr is not given (TRL's GRPOConfig
default), not the 3e-4 the small presets, warm-started from scratch, take."""

ALIGNMENTS = ("none", "qat", "quads")
DEFAULT_RAC_RATIO = 0.25
# RolloutMode's refusals, in `lowbit rl`'s words
FLAG_NAMES = {"precision": "--rollout", "rac_ratio": "--rac-ratio", "rac_group": "--rac-group",
              "rac_fold": "--rac-fold", "activation_scale": "--rollout-activation-scale",
              "packed_gemm": "--packed-gemm"}
# observation and placement only: a resumed run may change them
FREE_ON_RESUME = frozenset({"eval_every", "eval_w4a16", "log_every", "checkpoint_every",
                            "progress", "out_dir", "run_name", "data_dir", "max_steps_per_session",
                            "stop_after_minutes"})
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+@-]*$")


@dataclass
class RLConfig(RunConfig):
    FREE_ON_RESUME = FREE_ON_RESUME

    # --- policy ----------------------------------------------------------------------------
    model: str = field(default="tiny", metadata=flag(
        "--model", "policy: a preset of lowbit.models, or PATH of a Hugging Face model folder (its "
        "weights and tokenizer; no warm start) (default: %(default)s)"))
    """lowbit.models preset of the policy (byte tokenizer: vocab 256), or the path of a Hugging
    Face model folder (Llama, Qwen2, Qwen3, Qwen3-MoE): the policy is its weights, prompts
    and completions go through its tokenizer.json, and there is no warm start."""
    n_layers: int | None = field(default=None, metadata=flag(
        "--n-layers", "override the preset's depth"))
    """Override the preset's depth."""
    dim: int | None = field(default=None, metadata=flag("--dim", "override the preset's width"))
    """Override the preset's width (64-dim heads)."""
    n_experts: int = field(default=0, metadata=flag(
        "--n-experts", "MoE policy with this many experts (top-2); 0: dense"))
    """Experts per MoE layer (top-2); 0: dense."""
    warmstart_steps: int | None = field(default=None, metadata=flag(
        "--warmstart-steps", "supervised steps before RL, cached (default: 150; none for a Hugging "
        "Face --model PATH)"))
    """Supervised steps on the task's reference solutions (lowbit.train) before RL, cached in
    <out_dir>/warmstart/; 0 starts RL from random weights. None: 150 for a preset, 0 for a
    Hugging Face folder (the only choice there: it starts RL from its own weights)."""
    warmstart_lr: float = field(default=3e-3, metadata=flag(
        "--warmstart-lr", "peak learning rate of the warm start (default: %(default)s)"))
    warmstart_seed: int | None = field(default=None, metadata=flag(
        "--warmstart-seed", "seed of the warm start (default: --seed)"))
    """Seed of the warm start's initialization and data; None: the run's seed. Runs that
    differ only in their RL seed share one warm start when this is set."""
    warmstart_target: float | None = field(default=None, metadata=flag(
        "--warmstart-target", "stop the warm start once the bf16 engine's greedy accuracy on 256 "
        "validation problems reaches this (e.g. 0.3; default: train all --warmstart-steps)"))
    """Stop the warm start once the bf16 engine's greedy accuracy on a validation set (the
    VALIDATION_PROBLEMS problems after the held-out set, left out of its training data, as the
    held-out set is) reaches this fraction, checked every 1/40 of warmstart_steps; None: train
    all warmstart_steps. The start RL gets is then about the same on any device."""

    # --- task ------------------------------------------------------------------------------
    task: str = field(default="add", metadata=flag(
        "--task", "add, add-worked, mul, countdown or gsm8k (default: %(default)s)"))
    """lowbit.data.tasks: add, add-worked, mul, countdown, gsm8k."""
    task_size: int | None = field(default=1, metadata=flag(
        "--task-size", "digits (add, add-worked, mul) or numbers (countdown) (default: %(default)s)"))
    """Digits (add, add-worked, mul) or numbers (countdown); None: the task's default (2 digits, 3 numbers)."""
    data_dir: str | None = field(default=None, metadata=flag("--data-dir", "folder holding gsm8k/"))
    """Folder holding gsm8k/ (default: lowbit.data's)."""

    # --- rollouts --------------------------------------------------------------------------
    rollout: str = field(default="nvfp4", metadata=flag(
        "--rollout", f"engine precision: {', '.join(p.value for p in Precision)} (default: %(default)s)"))
    """Engine precision: bf16, fp8, nvfp4-w4a16, nvfp4."""
    align: str = field(default="quads", metadata=flag(
        "--align", f"trainer/engine alignment: {', '.join(ALIGNMENTS)} (default: %(default)s)"))
    """none; qat: asymmetric QAT in the trainer (NVFP4 weights, BF16 activations); quads: qat
    plus RAC in the engine."""
    rac_ratio: float | None = field(default=None, metadata=flag(
        "--rac-ratio", "fraction of input channels RAC compensates "
        "(default: 0.25 under quads, else 0)"))
    """Fraction of input channels RAC compensates; None: 0.25 under quads, else 0."""
    rac_group: int = field(default=0, metadata=flag(
        "--rac-group", "with RAC (--align quads or --rac-ratio > 0): choose each token's channels "
        "within each group of G input channels (a power of two from 16, e.g. 64; no selection "
        "across the row: a shorter activation pass at widths 1024-4096 on one H100, a longer one "
        "at 14336 with many rows); 0: over the whole row, as in the paper (default: %(default)s)",
        metavar="G"))
    """0: RAC chooses a token's channels over the whole row; G: the top of each G consecutive
    channels (lowbit.rl.precision)."""
    rac_fold: bool = field(default=False, metadata=flag(
        "--rac-fold", "with RAC: add its quantized residual into the quantized activation, one GEMM "
        "operand rounded once to the compute dtype, instead of multiplying it as a second operand "
        "into the same sums (which doubles the GEMM's tensor-core work)", action="store_true"))
    """RAC's residual folded into the activation (lowbit.formats.activations.rac_folded)."""
    num_generations: int = field(default=8, metadata=flag(
        "--num-generations", "completions per prompt (default: %(default)s)"))
    prompts_per_step: int = field(default=8, metadata=flag(
        "--prompts-per-step", "prompts per step (default: %(default)s)"))
    max_completion_length: int = field(default=8, metadata=flag(
        "--max-completion-length", "new tokens per completion at most (default: %(default)s)"))
    temperature: float = field(default=1.0, metadata=flag(
        "--temperature", "sampling temperature (default: %(default)s)"))
    top_p: float = field(default=1.0, metadata=flag(
        "--top-p", "nucleus sampling (default: %(default)s)"))
    top_k: int = field(default=0, metadata=flag(
        "--top-k", "top-k sampling, 0: off (default: %(default)s)"))

    # --- loss ------------------------------------------------------------------------------
    loss_type: str = field(default="dapo", metadata=flag(
        "--loss-type", f"{', '.join(LOSS_TYPES)} (default: %(default)s)"))
    epsilon: float = field(default=0.2, metadata=flag(
        "--epsilon", "lower PPO clip (default: %(default)s)"))
    epsilon_high: float = field(default=0.28, metadata=flag(
        "--epsilon-high", "upper PPO clip (default: %(default)s)"))
    beta: float = field(default=0.0, metadata=flag(
        "--beta", "weight of the k3 KL to the warm-start policy (default: %(default)s)"))
    scale_rewards: str = field(default="group", metadata=flag(
        "--scale-rewards", f"{', '.join(SCALE_REWARDS)} (default: %(default)s)"))
    mask_truncated_completions: bool = field(default=False, metadata=flag(
        "--mask-truncated-completions", "leave completions that hit --max-completion-length out of "
        "the loss", action="store_true"))
    num_iterations: int = field(default=1, metadata=flag(
        "--num-iterations", "optimizer steps per batch of rollouts (default: %(default)s)"))
    """Optimizer steps on each batch of rollouts (PPO epochs; the ratio departs from 1 after the first)."""
    micro_batch_size: int | None = field(default=None, metadata=flag(
        "--micro-batch-size", "completions per forward and backward pass of the trainer (default: "
        "as many as hold 8,192 tokens, prompt and completion)", metavar="N"))
    """Completions per trainer pass (verl's micro batch): each optimizer step accumulates its
    gradient over micro-batches of this many, and the no-grad log-prob passes (the reference
    model's, and the old policy's with more than one iteration) run in chunks of as many, so a
    large model's step fits in memory; None: the largest divisor of the step's completions
    whose micro-batch holds at most lowbit.rl.trainer.MICRO_BATCH_TOKENS tokens
    (each counted as the longest held-out prompt plus max_completion_length), which is the
    whole step for small ones. It must divide prompts_per_step * num_generations. The loss is
    the same mean (each loss type's normalizer is the whole step's), to float rounding."""
    importance_sampling: str = field(default="none", metadata=flag(
        "--is", f"mismatch correction: {', '.join(IS_LEVELS)} (default: %(default)s)"))
    """Correction for the engine/trainer mismatch: none, token, sequence."""
    is_mode: str = field(default="truncate", metadata=flag(
        "--is-mode", f"{', '.join(IS_MODES)} (default: %(default)s)"))
    is_cap: float = field(default=3.0, metadata=flag(
        "--is-cap", "importance-weight cap C (default: %(default)s)"))
    routing_replay: bool = field(default=False, metadata=flag(
        "--routing-replay", "MoE: the trainer replays the engine's expert choices",
        action="store_true"))
    """MoE: the trainer replays the engine's expert choices (verl's R3)."""
    compile_decode: bool = field(default=False, metadata=flag(
        "--compile-decode", "compile the rollout engine's decode step (torch.compile; dense "
        "policies): a minute of compiling per batch size, faster decode after",
        action="store_true"))
    """Compile the engine's decode step (torch.compile, once per batch size; dense policies)."""
    compile: bool = field(default=False, metadata=flag(
        "--compile", "the trainer's decoder layers through torch.compile, one graph for every "
        "layer and sequence length: the first step compiles one layer (forward and backward)",
        action="store_true"))
    """Run each of the trainer's decoder layers (the policy's and the reference's) through
    torch.compile (Transformer.compile_layers, dynamic shapes); the engine's decode has its
    own, --compile-decode."""
    share_prompts: bool = field(default=False, metadata=flag(
        "--share-prompts", "the trainer runs each prompt once for its --num-generations "
        "completions (their attention reads its keys), not once a completion: the same "
        "log-probs with a prompt's share of the work divided by the group",
        action="store_true"))
    """The trainer's passes run each prompt once a group (lowbit.models.transformer.SharedPrompts,
    lowbit.rl.trainer.completion_logits); False: each completion's row, prompt included."""
    rollout_activation_scale: str = field(default="per-token", metadata=flag(
        "--rollout-activation-scale", "NVFP4 rollouts' activation scale: per-token (a power-of-two "
        "scale per token) or static (a served NVFP4 checkpoint's: one calibrated FP32 scale per "
        "linear, recalibrated at each weight sync) (default: %(default)s)"))
    """NVFP4 rollouts' activation scale (RolloutEngine's activation_scale): per-token, a
    power-of-two pre-scale from each token's amax; static, a served NVFP4 checkpoint's one FP32
    input scale per linear, calibrated on the policy at every weight sync, with dynamic 1x16
    E4M3 block scales under it."""
    packed_gemm: bool = field(default=False, metadata=flag(
        "--packed-gemm", "NVFP4 rollouts: multiply the packed weights on the tiled NVFP4 kernel "
        "(faster than bf16 at 8-32 rows on an H200, slower at 1 and 128; 0.4x its memory) instead "
        "of a dequantized bf16 copy", action="store_true"))
    """NVFP4 rollouts multiply the packed weights on the tiled kernel (exact NVFP4 values,
    0.37-0.47x bf16's GPU memory), not a dequantized bf16 copy (RolloutEngine's packed_gemm)."""

    # --- optimizer -------------------------------------------------------------------------
    lr: float = field(default=3e-4, metadata=flag(
        "--lr", "AdamW learning rate, constant (default: %(default)s for a preset policy; "
        "1e-6, TRL's GRPO default, for a --model PATH one)"))
    """AdamW's learning rate, constant. `lowbit rl --model PATH` without --lr takes
    MODEL_FOLDER_LR: a trained model is updated gently, as TRL's GRPOTrainer does by default."""
    weight_decay: float = 0.0
    grad_clip: float = 1.0

    # --- run -------------------------------------------------------------------------------
    steps: int = field(default=40, metadata=flag("--steps", "RL steps (default: %(default)s)"))
    eval_every: int = field(default=10, metadata=flag(
        "--eval-every", "held-out accuracy every N steps (default: %(default)s)"))
    eval_problems: int = field(default=30, metadata=flag(
        "--eval-problems", "size of the held-out set (default: %(default)s)"))
    eval_w4a16: bool = field(default=False, metadata=flag(
        "--eval-w4a16", "also score the trainer's weights with NVFP4 weights and bf16 activations "
        "(eval/accuracy_w4a16: asymmetric QAT's own numerics); --compare turns it on for every "
        "run when a setting trains with QAT", action="store_true"))
    """A third evaluator at every evaluation: the trainer's weights through an nvfp4-w4a16 engine,
    the numerics asymmetric QAT trains under (NVFP4 weights, bf16 activations). The bf16
    evaluator reads a QAT run's latent weights, which its trainer never multiplies; this one
    scores the policy that run trains, and every other run's weights as NVFP4 would store them."""
    log_every: int = 1
    checkpoint_every: int = field(default=20, metadata=flag(
        "--checkpoint-every", "checkpoint every N steps (default: %(default)s)"))
    max_steps_per_session: int | None = None
    """Stop after this many steps of this invocation (a later --resume continues the run); None: run to the end."""
    stop_after_minutes: float | None = stop_after_minutes_field()
    """Stop this call M minutes after the command started (the warm start included), at the
    end of its step, checkpointed, so that a later --resume continues the run. None: no limit."""
    seed: int = field(default=0, metadata=flag(
        "--seed", "seed of prompts, sampling and (unless --warmstart-seed) the warm start (default: "
        "%(default)s)"))
    device: str = field(default="auto", metadata=flag(
        "--device", "trainer device: auto, cpu, cuda, cuda:N (default: %(default)s)"))
    engine_device: str | None = field(default=None, metadata=flag(
        "--engine-device", "rollout engine's device (default: the trainer's)"))
    """Where the rollout engine runs; None: the trainer's device."""
    progress: bool = True
    out_dir: str = field(default="runs", metadata=flag(
        "--out-dir", "parent folder of run folders (default: %(default)s)"))
    run_name: str = field(default="", metadata=flag(
        "--run-name", "run folder name (default: from the settings)"))

    def __post_init__(self) -> None:
        from lowbit.models import is_model_folder

        folder = is_model_folder(self.model)
        if self.warmstart_steps is None:
            self.warmstart_steps = 0 if folder else 150
        if folder:
            require(self.warmstart_steps == 0,
                     f"a Hugging Face policy ({self.model}) starts RL from its own weights; the "
                     f"warm start trains presets only (drop --warmstart-steps)")
            require(self.n_layers is None and self.dim is None and self.n_experts == 0,
                     "--n-layers, --dim and --n-experts change a preset; a Hugging Face "
                     "policy's shape is its config.json's")
        require(self.align in ALIGNMENTS, f"unknown --align {self.align!r}; use one of {', '.join(ALIGNMENTS)}")
        # the engine's rules (RolloutMode) in our flags' words; then the trainer's alignment
        mode = RolloutMode.make(self.rollout, 0.0 if self.rac_ratio is None else self.rac_ratio,
                                self.rollout_activation_scale, self.packed_gemm, names=FLAG_NAMES)
        require(self.align == "none" or mode.precision is Precision.NVFP4,
                 f"--align {self.align} aligns the trainer with NVFP4 rollouts: use --rollout nvfp4")
        if self.rac_ratio is None:
            self.rac_ratio = DEFAULT_RAC_RATIO if self.align == "quads" else 0.0
        RolloutMode.make(mode.precision, self.rac_ratio, mode.activation_scale, mode.packed_gemm,
                         self.rac_group, names=FLAG_NAMES,
                         rac_fold=self.rac_fold)   # the group and fold against the ratio RAC runs at
        require(self.loss_type in LOSS_TYPES,
                f"unknown --loss-type {self.loss_type!r}; use one of {', '.join(LOSS_TYPES)}")
        require(self.scale_rewards in SCALE_REWARDS,
                 f"unknown --scale-rewards {self.scale_rewards!r}; use one of {', '.join(SCALE_REWARDS)}")
        require(self.importance_sampling in IS_LEVELS,
                 f"unknown --is {self.importance_sampling!r}; use one of {', '.join(IS_LEVELS)}")
        require(self.is_mode in IS_MODES, f"unknown --is-mode {self.is_mode!r}; use one of {', '.join(IS_MODES)}")
        require(math.isfinite(self.is_cap) and self.is_cap > 0, f"--is-cap must be > 0 (got {self.is_cap})")
        require(not self.routing_replay or self.n_experts > 0 or folder,   # folder: the trainer checks
                 "--routing-replay needs an MoE policy: add --n-experts 8")
        require(not self.compile_decode or self.n_experts == 0 or folder,
                 "--compile-decode needs a dense policy (MoE decode reads expert counts back "
                 "to the host); drop --n-experts or the flag")
        for name in ("num_generations", "prompts_per_step", "max_completion_length", "steps",
                     "log_every", "eval_problems", "num_iterations"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, f"{name} must be a positive integer (got {value!r})")
        require(self.num_generations >= 2, "num_generations must be >= 2: GRPO compares each "
                                            "completion with the others of its prompt")
        require(self.micro_batch_size is None or (
            isinstance(self.micro_batch_size, int) and self.micro_batch_size >= 1
            and self.batch_size % self.micro_batch_size == 0),
            f"--micro-batch-size must divide a step's {self.batch_size} completions "
            f"(--prompts-per-step x --num-generations; got {self.micro_batch_size})")
        require(not self.share_prompts or self.micro_batch_size is None
                or self.micro_batch_size % self.num_generations == 0,
                f"--share-prompts needs whole groups in a micro-batch: --micro-batch-size "
                f"{self.micro_batch_size} is not a multiple of --num-generations {self.num_generations}")
        if self.warmstart_seed is None:
            self.warmstart_seed = self.seed
        require(self.warmstart_target is None or (0 < self.warmstart_target <= 1 and self.warmstart_steps > 0),
                 f"--warmstart-target is an accuracy in (0, 1] for a warm start of "
                 f"--warmstart-steps > 0 (got {self.warmstart_target}, {self.warmstart_steps} steps)")
        for name in ("warmstart_steps", "eval_every", "checkpoint_every", "seed", "n_experts", "top_k",
                     "warmstart_seed"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 0, f"{name} must be a non-negative integer (got {value!r})")
        require(self.n_experts == 0 or self.n_experts >= 2, "n_experts must be 0 (dense) or >= 2 (top-2 MoE)")
        require(math.isfinite(self.temperature) and self.temperature > 0,
                 f"temperature must be > 0 (got {self.temperature})")
        require(0 < self.top_p <= 1, f"top_p must be in (0, 1] (got {self.top_p})")
        for name in ("lr", "warmstart_lr"):
            require(math.isfinite(getattr(self, name)) and getattr(self, name) > 0,
                     f"{name} must be a positive number (got {getattr(self, name)})")
        require(self.epsilon > 0 and self.epsilon_high > 0, "epsilon and epsilon_high must be > 0")
        require(self.beta >= 0, f"beta must be >= 0 (got {self.beta})")
        require(self.grad_clip >= 0 and self.weight_decay >= 0, "grad_clip and weight_decay must be >= 0")
        require(self.max_steps_per_session is None or self.max_steps_per_session >= 1,
                 "max_steps_per_session must be a positive integer")
        check_stop_after_minutes(self.stop_after_minutes)
        require(self.run_name == "" or _RUN_NAME.match(self.run_name) is not None,
                 f"run_name {self.run_name!r} must be a plain folder name")
        require(self.out_dir != "", "out_dir must be a folder")

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.num_generations

    @property
    def setting(self) -> str:
        """rollout[+align][@rac_ratio][+gG][+fold][+is-level][+static-act], the label --compare
        uses (and run folders are named by)."""
        out = self.rollout + ("" if self.align == "none" else f"+{self.align}")
        default = DEFAULT_RAC_RATIO if self.align == "quads" else 0.0
        if self.rac_ratio != default:
            out += f"@{self.rac_ratio:g}"
        if self.rac_group:
            out += f"+g{self.rac_group}"
        if self.rac_fold:
            out += "+fold"
        if self.importance_sampling != "none":
            out += f"+is-{self.importance_sampling}"
        if self.rollout_activation_scale != "per-token":
            out += f"+{self.rollout_activation_scale}-act"
        return out

    @property
    def name(self) -> str:
        import os

        from lowbit.models import is_model_folder

        experts = f"-moe{self.n_experts}" if self.n_experts else ""
        model = os.path.basename(os.path.normpath(self.model)) if is_model_folder(self.model) else self.model
        return self.run_name or f"rl-{model}{experts}-{self.task}-{self.setting}"

