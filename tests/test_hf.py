"""Hugging Face folders in (lowbit.models.load_model) and out (save_hf), against transformers'
own forward on tiny random models built and saved by tests/hf_models.py."""

import json

import pytest
import torch

from hf_models import VOCAB, save_hf_model
from lowbit.models import ModelConfig, ModelLoadError, build_model, load_model, save_hf

transformers = pytest.importorskip("transformers")

KINDS = ["llama", "llama3", "qwen2", "qwen3", "qwen3-moe"]


def _logits(model, idx):
    with torch.no_grad():
        return model(idx).logits


@pytest.mark.parametrize("kind", KINDS)
def test_load_model_gives_transformers_logits(kind, tmp_path):
    save_hf_model(kind, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    model, tokenizer, config = load_model(tmp_path)
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(model, idx), _logits(hf, idx), rtol=1e-5, atol=1e-6)
    assert tokenizer.get_vocab_size() == VOCAB - 20
    assert config.vocab_size == VOCAB


def test_checkpoint_dtype_shards_and_fused_experts(tmp_path):
    # bf16, several shards, experts saved fused (save_original_format=False): loads as it is,
    # in bf16, with transformers' bf16 logits
    save_hf_model("qwen3-moe", tmp_path, dtype=torch.bfloat16, max_shard_size="40KB",
                  save_original_format=False)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    model, _, _ = load_model(tmp_path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_logits(model, idx), _logits(hf, idx), rtol=2e-2, atol=2e-2)
    model32, _, _ = load_model(tmp_path, dtype=torch.float32)
    assert {p.dtype for p in model32.parameters()} == {torch.float32}


def test_unsupported_or_incomplete_folders_are_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(tmp_path)
    save_hf_model("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel is not supported"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(tmp_path)


@pytest.mark.parametrize("config", [
    ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96),
    ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, qk_norm=True,
                n_experts=4, experts_per_token=2, moe_ffn_dim=32, tie_embeddings=True),
], ids=["llama", "qwen3-moe"])
def test_save_hf_loads_in_transformers_with_the_same_logits(config, tmp_path):
    torch.manual_seed(0)
    ours = build_model(config).eval()
    save_hf(ours, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == ("Qwen3MoeForCausalLM" if config.is_moe else "LlamaForCausalLM")
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_logits(hf, idx), _logits(ours, idx), rtol=1e-5, atol=1e-6)
    again, _, _ = load_model(tmp_path)   # and back: the same parameters, bit for bit
    for (name, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
