"""What a run is built from: data, model, recipe and optimizer, each from a TrainConfig.

    data = build_data(config)                     # lowbit.data's corpus as TrainingData
    seed_everything(config.seed)
    model = build_model(config, data.vocab_size)  # a lowbit.models preset, seeded init
    say(apply_recipe(model, resolve_recipe(config.recipe)))   # in place; the report's first line
    optimizer = build_optimizer(model, config, device)

`lowbit train`, `lowbit bench train` and the tools under benchmarks/ build with these, so a
benchmark times the model, recipe and optimizer a training run uses.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Protocol
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn as nn

from lowbit import dispatch
from lowbit.train.config import TrainConfig
from lowbit.train.step import StepConfig

__all__ = ["Batch", "TrainingData", "CorpusData", "build_data", "model_config", "build_model",
           "resolve_recipe",
           "apply_recipe", "param_groups", "build_optimizer", "seed_everything", "epochs",
           "context_warning"]

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs, targets: LongTensor (B, T) each


class TrainingData(Protocol):
    """What the loop needs from a dataset (lowbit.data's, or a stand-in in tests)."""

    vocab_size: int

    def train_batch(self, step: int) -> Batch:
        """All batch_size * grad_accum_steps sequences of optimizer step `step`, (rows, seq_len);
        a pure function of (seed, step), which is what makes resume exact."""

    def eval_batches(self) -> Iterable[Batch]:
        """The validation micro-batches, the same ones on every call."""


class CorpusData:
    """lowbit.data's TokenDataset as the loop's TrainingData: the train split's batches by
    step, the first eval_batches micro-batches of the val split for evaluation."""

    def __init__(self, dataset, config: TrainConfig) -> None:
        self.dataset, self.config = dataset, config
        self.vocab_size = dataset.vocab_size
        self.tokens_per_epoch = dataset.tokens_per_epoch
        self.fingerprint = dataset.fingerprint   # what a resume checks (lowbit.train.checkpoint)
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


def build_data(config: TrainConfig) -> CorpusData:
    """config.corpus, tokenized with config.tokenizer (cached), as TrainingData."""
    from lowbit.data import BPETokenizer, load_dataset

    tokenizer = config.tokenizer
    if tokenizer == "model":   # a Hugging Face folder's own tokenizer.json
        from lowbit.models.hf import ModelLoadError, load_tokenizer, read_config
        read_config(config.model)   # a missing or unsupported folder is refused first
        found = load_tokenizer(config.model)
        if found is None:
            raise ModelLoadError(f"{config.model} has no tokenizer.json, which training on a "
                                 f"corpus needs")
        tokenizer = BPETokenizer(found)
    dataset = load_dataset(config.corpus, tokenizer=tokenizer,
                           vocab_size=config.bpe_vocab_size, data_dir=config.data_dir,
                           max_bytes=config.corpus_max_bytes)
    return CorpusData(dataset, config)


def epochs(config: TrainConfig, data) -> float | None:
    """How many times the run reads its training split (None if the data cannot say)."""
    per_epoch = getattr(data, "tokens_per_epoch", None)
    return config.total_steps * config.tokens_per_step / per_epoch if per_epoch else None


def model_config(config: TrainConfig, vocab_size: int | None = None):
    """The lowbit.models.ModelConfig of config.model with the config's overrides (depth, width,
    experts, dropout) and a context of at least seq_len; vocab_size None keeps the preset's.
    A Hugging Face folder's config is its config.json's (vocab_size is only checked)."""
    from lowbit.models import ModelConfig, is_model_folder

    if is_model_folder(config.model):
        from lowbit.models.hf import read_config
        built = read_config(config.model)[0]
        if built.max_seq_len < config.seq_len:
            raise ValueError(f"--seq-len {config.seq_len} exceeds the model's "
                             f"max_position_embeddings ({built.max_seq_len})")
        if vocab_size is not None and vocab_size > built.vocab_size:
            raise ValueError(f"the tokenizer has {vocab_size} tokens, more than the model's "
                             f"vocab_size ({built.vocab_size})")
        return built
    overrides = {name: getattr(config, name) for name in ("n_layers", "n_experts", "dropout")
                 if getattr(config, name) is not None}
    if config.dim is not None:
        overrides.update(dim=config.dim, n_heads=max(1, config.dim // 64), ffn_dim=None)
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    built = ModelConfig.preset(config.model, **overrides)
    if built.max_seq_len < config.seq_len:
        built = dataclasses.replace(built, max_seq_len=config.seq_len)
    return built


def context_warning(config: TrainConfig) -> str:
    """A line when seq_len exceeds the preset's context, which model_config then enlarges
    (the model is then not the preset: its rotary table is longer), else "". A Hugging Face
    folder's context is never enlarged (model_config refuses), so it gets no warning here."""
    from lowbit.models import ModelConfig, is_model_folder

    if is_model_folder(config.model):
        return ""
    preset = ModelConfig.preset(config.model).max_seq_len
    if config.seq_len <= preset:
        return ""
    return (f"lowbit: warning: --seq-len {config.seq_len} exceeds the {config.model} preset's "
            f"context of {preset} tokens; the model is built with a {config.seq_len}-token "
            f"context instead")


def build_model(config: TrainConfig, vocab_size: int | None = None) -> nn.Module:
    """model_config(config, vocab_size) built, initialized from torch's generator as it stands
    (seed it first); for a Hugging Face folder, its weights loaded in float32."""
    from lowbit.models import build_model as build
    from lowbit.models import is_model_folder, load_model

    built = model_config(config, vocab_size)
    if is_model_folder(config.model):   # its weights, as float32 master weights, in train mode
        return load_model(config.model, dtype=torch.float32)[0].train()
    return build(built)


def resolve_recipe(name: str):
    """The recipe object for `name`, or None for one that quantizes nothing (bf16: train the
    model as built). Refuses an unknown name before anything is built."""
    from lowbit.recipes import get_recipe

    recipe = get_recipe(name)
    return recipe if recipe.quantizes else None


def apply_recipe(model: nn.Module, recipe) -> str:
    """The one seam between training and quantization: swap the model's layers for the
    recipe's quantized ones, in place (lowbit.quantize_), and return the first line of its report
    ("" for no recipe). The loop itself never knows which formats are in play. Stochastic
    rounding draws from torch's default generators, which checkpoints save, so resume stays
    exact under quantized recipes too."""
    if recipe is None:
        return ""
    from lowbit.nn import convert_to_quantized_training

    return str(convert_to_quantized_training(model, recipe)).splitlines()[0]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only. Norm gains and biases are 1-D: pulling them toward 0
    fights the scale and offset they exist to learn. Embedding rows get gradient only when
    their token occurs, so decay would shrink rare tokens' rows between occurrences (a tied
    output head shares the embedding's Parameter and is treated the same). A parameter with
    `no_weight_decay = True` (QAT's learned scales) is never decayed."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            matrix = p.dim() >= 2 and not getattr(p, "no_weight_decay", False)
            (decay if matrix and id(p) not in embeddings else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, config: StepConfig | TrainConfig, device: torch.device,
                    sharded: bool = False) -> torch.optim.Optimizer:
    """The config's optimizer over param_groups (a StepConfig's, or a TrainConfig's: the same
    fields): AdamW at its lr, betas and weight_decay, or SGD at its lr and momentum, the weight
    decay as an L2 term. On CUDA AdamW is lowbit.dispatch.AdamW (fused AdamW's state, every
    weight of a group in one launch, the gradient clip's coefficient taken inside the step) and
    SGD torch's fused one; on the CPU, and over FSDP's DTensor parameters (`sharded`), torch's
    foreach implementations."""
    groups = param_groups(model, config.weight_decay)
    fused = device.type == "cuda" and not sharded
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, fused=fused)
    if fused:
        return dispatch.AdamW(groups, lr=config.lr, betas=config.betas)
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's generators (the CUDA ones too) from `seed`."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
