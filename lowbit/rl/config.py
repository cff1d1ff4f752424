"""RLConfig: everything that defines a GRPO run, validated where it is built (TRL's names
where TRL has one)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from lowbit.config import RunConfig, require
from lowbit.rl.grpo import IS_LEVELS, IS_MODES, LOSS_TYPES, SCALE_REWARDS
from lowbit.rl.precision import ActivationScale, Precision

__all__ = ["RLConfig", "ALIGNMENTS", "FREE_ON_RESUME"]

ALIGNMENTS = ("none", "qat", "quads")
DEFAULT_RAC_RATIO = 0.25
# observation and placement only: a resumed run may change them
FREE_ON_RESUME = frozenset({"eval_every", "log_every", "checkpoint_every",
                            "progress", "out_dir", "run_name", "data_dir", "max_steps_per_session"})
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+@-]*$")


@dataclass
class RLConfig(RunConfig):
    FREE_ON_RESUME = FREE_ON_RESUME

    # --- policy ----------------------------------------------------------------------------
    model: str = "tiny"
    """lowbit.models preset of the policy (byte tokenizer: vocab 256), or the path of a Hugging
    Face model folder (Llama, Qwen2, Qwen3, Qwen3-MoE): the policy is its weights, prompts
    and completions go through its tokenizer.json, and there is no warm start."""
    n_layers: int | None = None
    """Override the preset's depth."""
    dim: int | None = None
    """Override the preset's width (64-dim heads)."""
    n_experts: int = 0
    """Experts per MoE layer (top-2); 0: dense."""
    warmstart_steps: int | None = None
    """Supervised steps on the task's reference solutions (lowbit.train) before RL, cached in
    <out_dir>/warmstart/; 0 starts RL from random weights. None: 150 for a preset, 0 for a
    Hugging Face folder (the only choice there: it starts RL from its own weights)."""
    warmstart_lr: float = 3e-3
    warmstart_seed: int | None = None
    """Seed of the warm start's initialization and data; None: the run's seed. Runs that
    differ only in their RL seed share one warm start when this is set."""
    warmstart_target: float | None = None
    """Stop the warm start once the bf16 engine's greedy accuracy on a validation set (the
    VALIDATION_PROBLEMS problems after the held-out set, left out of its training data, as the
    held-out set is) reaches this fraction, checked every 1/40 of warmstart_steps; None: train
    all warmstart_steps. The start RL gets is then about the same on any device."""

    # --- task ------------------------------------------------------------------------------
    task: str = "add"
    """lowbit.data.tasks: add, mul, countdown, gsm8k."""
    task_size: int | None = 1
    """Digits (add, mul) or numbers (countdown); None: the task's default (2 digits, 3 numbers)."""
    data_dir: str | None = None
    """Folder holding gsm8k/ (default: lowbit.data's)."""

    # --- rollouts --------------------------------------------------------------------------
    rollout: str = "nvfp4"
    """Engine precision: bf16, fp8, nvfp4-w4a16, nvfp4."""
    align: str = "quads"
    """none; qat: asymmetric QAT in the trainer (NVFP4 weights, BF16 activations); quads: qat
    plus RAC in the engine."""
    rac_ratio: float | None = None
    """Fraction of input channels RAC compensates; None: 0.25 under quads, else 0."""
    num_generations: int = 8
    prompts_per_step: int = 8
    max_completion_length: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    # --- loss ------------------------------------------------------------------------------
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0
    scale_rewards: str = "group"
    mask_truncated_completions: bool = False
    num_iterations: int = 1
    """Optimizer steps on each batch of rollouts (PPO epochs; the ratio departs from 1 after the first)."""
    importance_sampling: str = "none"
    """Correction for the engine/trainer mismatch: none, token, sequence."""
    is_mode: str = "truncate"
    is_cap: float = 3.0
    routing_replay: bool = False
    """MoE: the trainer replays the engine's expert choices (verl's R3)."""
    compile_decode: bool = False
    """Compile the engine's decode step (torch.compile, once per batch size; dense policies)."""
    rollout_activation_scale: str = "per-token"
    """NVFP4 rollouts' activation scale (RolloutEngine's activation_scale): per-token, a
    power-of-two pre-scale from each token's amax; static, a served NVFP4 checkpoint's one FP32
    input scale per linear, calibrated on the policy at every weight sync, with dynamic 1x16
    E4M3 block scales under it."""
    packed_gemm: bool = False
    """NVFP4 rollouts multiply the packed weights on the tiled kernel (exact NVFP4 values,
    0.37-0.47x bf16's GPU memory), not a dequantized bf16 copy (RolloutEngine's packed_gemm)."""

    # --- optimizer -------------------------------------------------------------------------
    lr: float = 3e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0

    # --- run -------------------------------------------------------------------------------
    steps: int = 40
    eval_every: int = 10
    eval_problems: int = 30
    log_every: int = 1
    checkpoint_every: int = 20
    max_steps_per_session: int | None = None
    """Stop after this many steps of this invocation (a later --resume continues the run); None: run to the end."""
    seed: int = 0
    device: str = "auto"
    engine_device: str | None = None
    """Where the rollout engine runs; None: the trainer's device."""
    progress: bool = True
    out_dir: str = "runs"
    run_name: str = ""

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
        require(self.rollout in {p.value for p in Precision},
                 f"unknown --rollout {self.rollout!r}; use one of {', '.join(p.value for p in Precision)}")
        require(self.align in ALIGNMENTS, f"unknown --align {self.align!r}; use one of {', '.join(ALIGNMENTS)}")
        require(self.align == "none" or self.rollout == "nvfp4",
                 f"--align {self.align} aligns the trainer with NVFP4 rollouts: use --rollout nvfp4")
        if self.rac_ratio is None:
            self.rac_ratio = DEFAULT_RAC_RATIO if self.align == "quads" else 0.0
        require(0.0 <= self.rac_ratio <= 1.0, f"--rac-ratio must be in [0, 1] (got {self.rac_ratio})")
        require(self.rac_ratio == 0 or self.rollout == "nvfp4",
                 "--rac-ratio compensates NVFP4 activations: use --rollout nvfp4")
        scales = [a.value for a in ActivationScale]
        require(self.rollout_activation_scale in scales,
                 f"unknown --rollout-activation-scale {self.rollout_activation_scale!r}; use one of "
                 f"{', '.join(scales)}")
        require(self.rollout_activation_scale == "per-token" or self.rollout == "nvfp4",
                 f"--rollout-activation-scale {self.rollout_activation_scale} scales NVFP4 "
                 f"activations (W4A4): use --rollout nvfp4 (got --rollout {self.rollout})")
        require(self.loss_type in LOSS_TYPES, f"unknown --loss-type {self.loss_type!r}; use one of {', '.join(LOSS_TYPES)}")
        require(self.scale_rewards in SCALE_REWARDS,
                 f"unknown --scale-rewards {self.scale_rewards!r}; use one of {', '.join(SCALE_REWARDS)}")
        require(self.importance_sampling in IS_LEVELS,
                 f"unknown --is {self.importance_sampling!r}; use one of {', '.join(IS_LEVELS)}")
        require(self.is_mode in IS_MODES, f"unknown --is-mode {self.is_mode!r}; use one of {', '.join(IS_MODES)}")
        require(math.isfinite(self.is_cap) and self.is_cap > 0, f"--is-cap must be > 0 (got {self.is_cap})")
        require(not self.routing_replay or self.n_experts > 0 or folder,   # folder: the trainer checks
                 "--routing-replay needs an MoE policy: add --n-experts 8")
        require(not self.packed_gemm or self.rollout in ("nvfp4", "nvfp4-w4a16"),
                 f"--packed-gemm multiplies packed NVFP4 weights: use it with --rollout nvfp4 or "
                 f"nvfp4-w4a16 (got --rollout {self.rollout})")
        require(not self.compile_decode or self.n_experts == 0 or folder,
                 "--compile-decode needs a dense policy (MoE decode reads expert counts back "
                 "to the host); drop --n-experts or the flag")
        for name in ("num_generations", "prompts_per_step", "max_completion_length", "steps",
                     "log_every", "eval_problems", "num_iterations"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, f"{name} must be a positive integer (got {value!r})")
        require(self.num_generations >= 2, "num_generations must be >= 2: GRPO compares each "
                                            "completion with the others of its prompt")
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
        require(self.run_name == "" or _RUN_NAME.match(self.run_name) is not None,
                 f"run_name {self.run_name!r} must be a plain folder name")
        require(self.out_dir != "", "out_dir must be a folder")

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.num_generations

    @property
    def setting(self) -> str:
        """rollout[+align][@rac_ratio][+is-level][+static-act], the label --compare uses."""
        out = self.rollout + ("" if self.align == "none" else f"+{self.align}")
        default = DEFAULT_RAC_RATIO if self.align == "quads" else 0.0
        if self.rac_ratio != default:
            out += f"@{self.rac_ratio:g}"
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

