"""TrainConfig: everything that defines a pretraining run, validated where it is built.

One flat dataclass, because a run is one thing: the CLI fills it from flags, `train()` reads
it, the checkpoint stores it, and `resume` compares it field by field. Every field is
documented where it is declared, with its `lowbit train` flag if it has one (lowbit.config.flag);
`__post_init__` rejects bad values with a one-line
message that says what was wrong and what to do, so the CLI can print it as is. What made the
run rather than how it trains (`lowbit qat`'s settings, the weights it started from) is the
run's job record beside it (lowbit.train.job_record.JobRecord, job.json).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from lowbit.config import RunConfig, check_stop_after_minutes, flag, require, stop_after_minutes_field
from lowbit.train.job_record import OLD_CONFIG_KEYS

# Fields that can change between a run and its resumption without changing the run itself:
# they decide what is observed (logs, evals, diagnostics), where data is read from and files
# are written (a run folder may be moved or renamed), how the processes share the work, or
# when to give up, never the sequence of weights the optimizer produces. Every other field must
# match the checkpoint exactly, or `resume` refuses (changing max_steps, for instance,
# stretches the cosine schedule, so the resumed run would not be the run that was started).
FIELDS_FREE_ON_RESUME = frozenset(
    {
        "data_dir",
        "eval_every",
        "eval_batches",
        "log_every",
        "diag_every",
        "diagnostics",
        "checkpoint_every",
        "keep_checkpoints",
        "max_consecutive_nonfinite",
        "progress",
        "parallel",
        "cuda_graph",
        "out_dir",
        "run_name",
        "stop_after_minutes",
    }
)

# Fields added after checkpoints were first written whose declared default is not how a run
# saved before them behaved: such a run resumes with the value here, and only with it
# (lowbit.config.RunConfig.changed_fields). What made the run (QAT's settings, the weights it
# started from) is not here but in its job record, with its own rules (lowbit.train.job_record).
FIELDS_ADDED_LATER = {"fold_inexact": "redo"}

OPTIMIZERS = ("adamw", "sgd")
"""The optimizers a run may take (TrainConfig.optimizer; lowbit.train.build.build_optimizer)."""


def require_optimizer(optimizer: str, momentum: float) -> None:
    """A one-line ValueError unless `optimizer` is one of OPTIMIZERS and `momentum` (SGD's) is
    in [0, 1): the check of every config that carries them (TrainConfig, StepConfig, QATJob)."""
    require(optimizer in OPTIMIZERS,
            f"optimizer must be one of {', '.join(OPTIMIZERS)} (got {optimizer!r})")
    require(math.isfinite(momentum) and 0 <= momentum < 1,
            f"momentum must be in [0, 1) (got {momentum}); e.g. --momentum 0.9")

FINE_TUNE_LR = 2e-5
"""The learning rate a trained model (a Hugging Face folder, or a run trained from one) is
fine-tuned at when none is given -- `lowbit train --model PATH`, and `lowbit qat` from such a
model (TRL's SFT default) -- not the 2e-3 a fresh model from a preset starts with."""

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass
class TrainConfig(RunConfig):
    FREE_ON_RESUME = FIELDS_FREE_ON_RESUME
    ADDED_LATER = FIELDS_ADDED_LATER

    # --- model -----------------------------------------------------------------------------
    model: str = field(default="tiny", metadata=flag(
        "--model", "model preset (tiny, small, 100m, 1b) or PATH of a Hugging Face model folder "
        "(Llama, Qwen2, Qwen3, Qwen3-MoE), trained with its own tokenizer (default: %(default)s)",
        metavar="NAME"))
    """Preset of lowbit.models.ModelConfig ("tiny", "small", "100m", "1b", ...), or the path of
    a Hugging Face model folder (Llama, Qwen2, Qwen3, Qwen3-MoE; lowbit.models.load_model),
    trained from its weights (in float32) with its own tokenizer."""
    n_layers: int | None = field(default=None, metadata=flag(
        "--n-layers", "override the preset's depth", metavar="N"))
    """Override the preset's depth; None keeps the preset's."""
    dim: int | None = field(default=None, metadata=flag(
        "--dim", "override the preset's width (64-dim heads)", metavar="N"))
    """Override the preset's width (with 64-dim heads, as ModelConfig.from_size picks);
    None keeps the preset's width and heads."""
    n_experts: int | None = field(default=None, metadata=flag(
        "--n-experts", "override the preset's MoE experts (0: dense)", metavar="N"))
    """Override the preset's number of MoE experts (0: dense); None keeps the preset's."""
    dropout: float | None = field(default=None, metadata=flag(
        "--dropout", "override the preset's dropout", metavar="X"))
    """Override the preset's dropout probability; None keeps the preset's."""

    # --- data ------------------------------------------------------------------------------
    corpus: str = field(default="tinyshakespeare", metadata=flag(
        "--corpus", "tinyshakespeare, wikitext2, gutenberg, english, pycode (default: %(default)s)",
        metavar="NAME"))
    """Corpus in lowbit.data.CORPORA: tinyshakespeare, wikitext2, gutenberg, english, pycode."""
    tokenizer: str = field(default="bytes", metadata=flag(
        "--tokenizer", "bytes or bpe (default: %(default)s)", metavar="NAME"))
    """Tokenizer understood by lowbit.data: "bytes" (256 symbols, nothing to train) or "bpe";
    "model": the model folder's tokenizer.json (the only choice, and the default, with a
    Hugging Face --model PATH)."""
    bpe_vocab_size: int = field(default=4096, metadata=flag(
        "--bpe-vocab-size", "vocabulary of the BPE tokenizer (default: %(default)s)", metavar="N"))
    """Vocabulary of the BPE tokenizer, trained on the corpus (the bytes tokenizer has 256)."""
    corpus_max_bytes: int | None = field(default=None, metadata=flag(
        "--corpus-max-bytes", "cut each split of the corpus to this many bytes", metavar="N"))
    """Cut each split of the corpus to this many bytes (pycode: of whole files); None: all of it."""
    data_dir: str | None = field(default=None, metadata=flag(
        "--data-dir", "folder of the corpora (default: lowbit.data's)", metavar="DIR"))
    """Folder holding the corpora; None uses lowbit.data's default (env var, ../shared/data)."""
    seq_len: int = field(default=128, metadata=flag(
        "--seq-len", "tokens per training sequence (default: %(default)s)", metavar="N"))
    """Tokens per training sequence (the model's context during training)."""
    batch_size: int = field(default=16, metadata=flag(
        "--batch-size", "sequences per micro-batch (default: %(default)s)", metavar="N"))
    """Sequences per micro-batch, i.e. per forward/backward pass."""
    grad_accum_steps: int = field(default=1, metadata=flag(
        "--grad-accum-steps", "micro-batches per optimizer step (default: %(default)s)",
        metavar="N"))
    """Micro-batches per optimizer step; tokens per step = batch_size * this * seq_len."""

    # --- run length ------------------------------------------------------------------------
    max_steps: int = field(default=300, metadata=flag(
        "--steps", "optimizer steps to train for; a small number shortens the run (e.g. --steps 20 "
        "for CI), the warmup shrinks to fit unless --warmup-steps is given (default: %(default)s)",
        metavar="N"))
    """Optimizer steps to train for (ignored when max_tokens is set). The defaults train the
    tiny preset on half of Tiny Shakespeare's bytes (300 steps of 2,048 tokens) with
    stable-fp4, on the CPU, where the quantizers run as the plain-PyTorch reference: a falling
    loss, a validation perplexity and the plot in about two minutes on 2 cores
    (docs/results/README.md has the measured time)."""
    max_tokens: int | None = field(default=None, metadata=flag(
        "--tokens", "train for this many tokens instead of --steps", metavar="N"))
    """If set, train for this many tokens instead, rounded up to whole optimizer steps."""

    # --- optimizer and schedule ------------------------------------------------------------
    lr: float = field(default=2e-3, metadata=flag(
        "--lr", "peak learning rate (default: %(default)s; 2e-5 with --model PATH, which "
        "fine-tunes)", metavar="X"))
    """Peak learning rate of the optimizer, reached at the end of warmup."""
    min_lr_ratio: float = field(default=0.1, metadata=flag(
        "--min-lr-ratio", "final learning rate as a fraction of --lr (default: %(default)s)",
        metavar="X"))
    """The cosine decay ends at lr * min_lr_ratio on the last step."""
    warmup_steps: int = field(default=30, metadata=flag(
        "--warmup-steps", "linear warmup steps (default: %(default)s)", metavar="N"))
    """Steps of linear warmup from lr/warmup_steps to lr."""
    weight_decay: float = field(default=0.1, metadata=flag(
        "--weight-decay", "weight decay, matrices only (AdamW's decoupled; SGD's an L2 term) "
        "(default: %(default)s)", metavar="X"))
    """Weight decay, applied to matrices only (lowbit.train.build.param_groups): AdamW's
    decoupled decay, or under SGD an L2 term added to the gradient."""
    betas: tuple[float, float] = field(default=(0.9, 0.95), metadata=flag(
        "--betas", "AdamW betas as two comma-separated numbers (default: %(default)s)",
        type=str, metavar="NAME"))
    """AdamW (beta1, beta2)."""
    optimizer: str = field(default="adamw", metadata=flag(
        "--optimizer", "adamw, or sgd: SGD with --momentum, weight decay added to the gradient "
        "(default: %(default)s)", choices=OPTIMIZERS))
    """"adamw" (decoupled weight decay, --betas), or "sgd": torch.optim.SGD with heavy-ball
    momentum (--momentum), its weight decay an L2 term added to the gradient. Under SGD a
    per-weight factor on the gradient (JacQuant's B on the gradient, lowbit.qat) scales that
    weight's step; AdamW's per-weight normalization divides such a factor out again."""
    momentum: float = field(default=0.9, metadata=flag(
        "--momentum", "SGD's momentum (with --optimizer sgd) (default: %(default)s)", metavar="X"))
    """SGD's momentum (heavy ball, no dampening, not Nesterov); unused by AdamW."""
    grad_clip: float = field(default=1.0, metadata=flag(
        "--grad-clip", "clip the gradient norm to this (0: no clipping) (default: %(default)s)",
        metavar="X"))
    """Clip the global gradient L2 norm to this; 0 disables clipping (the norm is still logged)."""

    # --- observation -----------------------------------------------------------------------
    eval_every: int = field(default=100, metadata=flag(
        "--eval-every", "steps between evaluations (0: only at the end) (default: %(default)s)",
        metavar="N"))
    """Evaluate the validation loss every this many steps and at the end; 0: only at the end."""
    eval_batches: int = field(default=10, metadata=flag(
        "--eval-batches", "validation micro-batches per evaluation (default: %(default)s)",
        metavar="N"))
    """Validation micro-batches per evaluation (the same ones every time)."""
    log_every: int = field(default=10, metadata=flag(
        "--log-every", "steps between metrics records (default: %(default)s)", metavar="N"))
    """Write a training record (loss, lr, grad norm, throughput) every this many steps."""
    diag_every: int = field(default=100, metadata=flag(
        "--diag-every", "steps between diagnostics (default: %(default)s)", metavar="N"))
    """Run the diagnostics every this many steps."""
    diagnostics: bool = True
    """Log lowbit.diagnostics.training's operand consistency, gradient bias against BF16 and
    clipping for quantized recipes (train()'s diagnostics_fn, if given, replaces them)."""
    checkpoint_every: int = field(default=100, metadata=flag(
        "--checkpoint-every", "steps between checkpoints (0: only at the end) "
        "(default: %(default)s)", metavar="N"))
    """Save a checkpoint every this many steps (and always at the end); 0: only at the end."""
    keep_checkpoints: int = field(default=2, metadata=flag(
        "--keep-checkpoints", "checkpoints kept, the newest and those before it (a damaged one "
        "falls back to the previous) (default: %(default)s)", metavar="N"))
    """Checkpoints kept: the newest (checkpoints/latest.pt) and the keep_checkpoints - 1 before
    it (step-<N>.pt), so a resume falls back to the previous one if the newest is damaged."""
    stop_after_minutes: float | None = stop_after_minutes_field()
    """Stop this call M minutes after the command started, at the end of its step, checkpointed
    and without final.json, so that a later --resume continues it: a run longer than a job's
    time limit on a cluster, split over several jobs. None: no limit."""
    max_consecutive_nonfinite: int = field(default=5, metadata=flag(
        "--max-consecutive-nonfinite", "stop after this many NaN/Inf steps in a row "
        "(default: %(default)s)", metavar="N"))
    """Stop the run after this many optimizer steps in a row had a NaN/Inf loss or gradient."""
    progress: bool = True
    """Report progress on stderr: a tqdm bar on a terminal, else one line per log record."""

    # --- run -------------------------------------------------------------------------------
    seed: int = field(default=0, metadata=flag(
        "--seed", "seed of the init, dropout and data order (default: %(default)s)", metavar="N"))
    """Seeds the model's initialization, dropout and the data order."""
    device: str = field(default="auto", metadata=flag(
        "--device", "auto, cpu, cuda or cuda:N (default: %(default)s)", metavar="NAME"))
    """"auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N"."""
    bf16_autocast: bool = True
    """On CUDA, run forward and loss under bf16 autocast (weights and AdamW stay fp32).
    The CPU always computes in fp32: CPU bf16 autocast is slow, and exact resume is tested there."""
    compile: bool = False
    """Wrap the model in torch.compile (needs a C++ compiler on the CPU; Triton on CUDA)."""
    fold_inexact: str = field(default="redo", metadata=flag(
        "--fold-inexact", "FP8-GEMM recipes, a step whose one-chunk folds rounded values: redo "
        "(exactly), adapt (redo, and move the layers that needed it to the emulated path) or round "
        "(keep it, log the count) (default: %(default)s)", metavar="NAME"))
    """FP8-GEMM recipes (stable-fp4-fp8): what a step does when its sync-free folds rounded
    values, i.e. some operand row's block scales spanned more than 14 binades, so E4M3 rounds
    its blocks that lie more than 14 binades below the row's largest (to its subnormals or
    zero). "redo": redo the step's gradients with exact, K-chunked folds (every GEMM exactly
    the FP4 values; costs an eager step with host syncs). "adapt": redo it, and move the
    layers whose folds needed K-chunks to the emulated path for the rest of the run (the same
    FP4 values, a bf16 GEMM; "fold_adapted" records; kept in checkpoints), so a layer like
    v_proj stops costing redos. "round": keep the step, and log the count ("fold_rounded"
    records): each rounded value moves by at most 2^-16 times its row's largest block scale
    (half of E4M3's smallest subnormal step at the row's factor)."""
    cuda_graph: bool = False
    """Replay each step's forward, backward and gradient clip from one CUDA graph (one process
    on a CUDA GPU; an MoE model's experts on the grouped GEMM, lowbit.train.graphs.
    experts_refusal; with compile, the compiled model): no per-kernel host work, so
    a quantized step is not host-bound. The same numbers as eager (lowbit.train.graphs)."""
    parallel: str = field(default="ddp", metadata=flag(
        "--parallel", "under torchrun: ddp (replicate) or fsdp (shard with FSDP2) "
        "(default: %(default)s)", metavar="NAME"))
    """Under torchrun: "ddp" replicates the model on every process; "fsdp" shards parameters,
    gradients and optimizer state over them (FSDP2's fully_shard, one unit per transformer
    block). Checkpoints hold the full state either way, so a run can resume under the other
    or on one process. Ignored without torchrun."""
    recipe: str = field(default="stable-fp4", metadata=flag(
        "--recipe", "quantized-training recipe (bf16: none) (default: %(default)s)",
        metavar="NAME"))
    """Quantized-training recipe from lowbit.recipes; "bf16" trains the model as built."""
    out_dir: str = field(default="runs", metadata=flag(
        "--out-dir", "parent folder of run folders (default: %(default)s)", metavar="DIR"))
    """Parent folder of run folders."""
    run_name: str = field(default="", metadata=flag(
        "--run-name", "run folder name (default: <model>-<corpus>-<recipe>)", metavar="NAME"))
    """Run folder name under out_dir; empty: "<model>-<corpus>-<recipe>"."""

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # JSON round trips turn it into a list
        require(self.model != "", "model must name a preset, e.g. --model tiny")
        for name in ("n_layers", "dim"):
            value = getattr(self, name)
            require(value is None or (isinstance(value, int) and value >= 1),
                     f"{name} must be a positive integer (got {value!r}); "
                     f"omit it to keep the preset's")
        require(self.n_experts is None or self.n_experts >= 0,
                 f"n_experts must be >= 0 (got {self.n_experts}); use 0 for a dense model")
        require(self.dropout is None or 0.0 <= self.dropout < 1.0,
                 f"dropout must be in [0, 1) (got {self.dropout})")
        from lowbit.data import CORPORA, TOKENIZERS

        require(self.corpus in CORPORA,
                 f"unknown corpus {self.corpus!r}; choose one of {', '.join(CORPORA)}")
        from lowbit.models import is_model_folder

        if is_model_folder(self.model):
            require(self.tokenizer == "model",
                     f"a Hugging Face model ({self.model}) trains with its own tokenizer; drop "
                     f"--tokenizer (or pass --tokenizer model)")
            require(self.n_layers is None and self.dim is None and self.n_experts is None,
                     "--n-layers, --dim and --n-experts change a preset; a Hugging Face model's "
                     "shape is its config.json's")
        else:
            require(self.tokenizer in TOKENIZERS,
                     f"unknown tokenizer {self.tokenizer!r}; choose one of {', '.join(TOKENIZERS)}"
                     + (" ('model' needs --model PATH)" if self.tokenizer == "model" else ""))
        require(isinstance(self.bpe_vocab_size, int) and self.bpe_vocab_size >= 256,
                 f"bpe_vocab_size must be an integer >= 256 (got {self.bpe_vocab_size!r})")
        for name in ("seq_len", "batch_size", "grad_accum_steps", "max_steps",
                     "eval_batches", "log_every", "diag_every", "max_consecutive_nonfinite",
                     "keep_checkpoints"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1,
                     f"{name} must be a positive integer (got {value!r})")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "seed"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 0,
                     f"{name} must be a non-negative integer (got {value!r})")
        require(self.corpus_max_bytes is None or self.corpus_max_bytes >= 1,
                 f"corpus_max_bytes must be a positive integer (got {self.corpus_max_bytes})")
        require(self.max_tokens is None or self.max_tokens >= 1,
                 f"max_tokens must be a positive integer (got {self.max_tokens})")
        check_stop_after_minutes(self.stop_after_minutes)
        require(math.isfinite(self.lr) and self.lr > 0,
                 f"lr must be a positive number (got {self.lr}); e.g. --lr 1e-3")
        require(0.0 <= self.min_lr_ratio <= 1.0,
                 f"min_lr_ratio must be in [0, 1] (got {self.min_lr_ratio})")
        require(math.isfinite(self.weight_decay) and self.weight_decay >= 0,
                 f"weight_decay must be >= 0 (got {self.weight_decay})")
        require(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
                 f"betas must be two numbers in [0, 1) (got {self.betas}); e.g. --betas 0.9,0.95")
        require_optimizer(self.optimizer, self.momentum)
        require(math.isfinite(self.grad_clip) and self.grad_clip >= 0,
                 f"grad_clip must be >= 0 (got {self.grad_clip}); 0 disables clipping")
        require(self.warmup_steps <= self.total_steps,
                 f"warmup_steps ({self.warmup_steps}) exceeds the run's {self.total_steps} steps; "
                 f"lower --warmup-steps")
        _check_device_name(self.device)
        require(self.fold_inexact in ("redo", "adapt", "round"),
                 f"fold_inexact must be redo, adapt or round (got {self.fold_inexact!r})")
        require(self.parallel in ("ddp", "fsdp"),
                 f"parallel must be ddp or fsdp (got {self.parallel!r})")
        require(self.recipe != "", "recipe must be a name, e.g. --recipe bf16")
        require(self.out_dir != "", "out_dir must be a folder, e.g. --out-dir runs")
        require(self.run_name == "" or _RUN_NAME.match(self.run_name) is not None,
                 f"run_name {self.run_name!r} must be a plain folder name "
                 f"(letters, digits, . _ + -; no slashes)")

    @classmethod
    def from_dict(cls, fields: dict) -> TrainConfig:
        """RunConfig.from_dict; a config saved before job records also holds its job's fields
        (OLD_CONFIG_KEYS), which JobRecord.of_checkpoint reads, so they are left out here."""
        return super().from_dict(_without_job_fields(fields))

    def changed_fields(self, saved: dict) -> list[str]:
        """RunConfig.changed_fields, the job's old fields left to the job record's own check."""
        return super().changed_fields(_without_job_fields(saved))

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum_steps * self.seq_len

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run: max_steps, or max_tokens rounded up to steps."""
        if self.max_tokens is None:
            return self.max_steps
        return -(-self.max_tokens // self.tokens_per_step)

    @property
    def name(self) -> str:
        """The run folder's name."""
        from lowbit.models import is_model_folder

        model = os.path.basename(os.path.normpath(self.model)) if is_model_folder(self.model) else self.model
        return self.run_name or f"{model}-{self.corpus}-{self.recipe}"


def resolve_device(name: str):
    """A --device value as a torch.device: "auto" is cuda when a GPU is there, else cpu.
    Refuses a malformed name, or CUDA where there is none, with a message."""
    import torch

    _check_device_name(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    require(not name.startswith("cuda") or torch.cuda.is_available(),
             f"device {name!r} asked for, but CUDA is not available; use --device cpu (or auto)")
    return torch.device(name)


def _without_job_fields(saved: dict) -> dict:
    return {k: v for k, v in saved.items() if k not in OLD_CONFIG_KEYS}


def _check_device_name(name: str) -> None:
    require(_DEVICE.match(name) is not None,
             f"device must be auto, cpu, cuda or cuda:N (got {name!r})")


__all__ = ["TrainConfig", "FIELDS_FREE_ON_RESUME", "FIELDS_ADDED_LATER", "FINE_TUNE_LR", "OPTIMIZERS",
           "require_optimizer"]
