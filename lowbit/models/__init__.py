"""Small LLaMA-style dense and MoE transformers with Hugging Face's module names, and
Hugging Face folders loaded into them (`load_model`) and saved from them (`save_hf`)."""

from lowbit.models.config import PRESETS, ModelConfig
from lowbit.models.hf import ModelLoadError, is_model_folder, load_model, save_hf
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
    "load_model",
    "save_hf",
    "is_model_folder",
    "ModelLoadError",
]
