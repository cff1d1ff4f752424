"""Tiny random Hugging Face models, saved as folders with a tokenizer, for the tests of
--model PATH, save_hf and lowbit export (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 300
TEXT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
        "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles. ") * 40


def tokenizer():
    """A byte-level BPE of VOCAB - 20 entries (smaller than the model's vocabulary, as Qwen's
    tokenizers are), trained on TEXT."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 20, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer=trainer)
    return tok


def hf_model(kind: str, seed: int = 0):
    """A tiny random transformers model: llama, llama3 (RoPE scaling, tied, biases), qwen2,
    qwen3, qwen3-moe."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, intermediate_size=96)
    torch.manual_seed(seed)
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    if kind == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        return tf.LlamaForCausalLM(tf.LlamaConfig(**{**common, "tie_word_embeddings": True},
                                                  attention_bias=True, mlp_bias=True,
                                                  rope_parameters=rope))
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    if kind == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=32))
    if kind == "qwen3-moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**common, head_dim=16, num_experts=4,
                                                        num_experts_per_tok=2,
                                                        moe_intermediate_size=32))
    raise ValueError(kind)


def randomize(model) -> None:
    # transformers initializes biases and norm gains to 0 / 1; random ones test their mapping
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)


def save_hf_model(kind: str, path: Path, dtype=torch.float32, seed: int = 0, **save_kw) -> Path:
    """hf_model(kind) in dtype, save_pretrained'd to path with tokenizer.json; returns path."""
    model = hf_model(kind, seed)
    randomize(model)
    model.to(dtype).save_pretrained(path, **save_kw)
    tokenizer().save(str(path / "tokenizer.json"))
    return path


def load_decompressed(path: Path, **kw):
    """A compressed-tensors export loaded by transformers with its weights decompressed
    (`CompressedTensorsConfig(dequantize=True)`, as docs/models.md tells users), in eval mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
        **kw).eval()


def compressed_tensors_weights(path: Path) -> dict:
    """Every quantized weight of a compressed-tensors export as compressed-tensors' own
    compressor decompresses it (no transformers in between): {"<module>.weight": dense}."""
    import json

    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open

    config = QuantizationConfig.model_validate(
        json.loads((path / "config.json").read_text())["quantization_config"])
    (scheme,) = config.config_groups.values()
    compressor = BaseCompressor.load_from_registry(config.format)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    modules = {k.removesuffix(".weight_scale") for k in tensors if k.endswith(".weight_scale")}
    return {f"{m}.weight": compressor.decompress(
        {k.removeprefix(m + "."): v for k, v in tensors.items() if k.startswith(m + ".")},
        scheme)["weight"] for m in sorted(modules)}
