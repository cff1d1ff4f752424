"""Small LLaMA-style dense and MoE transformers with Hugging Face's module names."""

from lowbit.models.config import PRESETS, ModelConfig
from lowbit.models.moe import Experts, SparseMoeBlock, TopKRouter, load_balancing_loss
from lowbit.models.transformer import ModelOutput, Transformer, build_model

__all__ = [
    "PRESETS",
    "ModelConfig",
    "ModelOutput",
    "Transformer",
    "build_model",
    "Experts",
    "SparseMoeBlock",
    "TopKRouter",
    "load_balancing_loss",
]
