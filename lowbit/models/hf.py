"""Hugging Face causal-LM folders in and out: `load_model` and `save_hf`.

    model, tokenizer, config = load_model("path/to/Qwen3-0.6B", device="cuda", dtype=None)
    model, tokenizer, config = load_model("tiny")          # a preset: no tokenizer (None)
    save_hf(model, "out/", tokenizer)                       # transformers' from_pretrained loads it

A folder is what `save_pretrained` writes: config.json, model.safetensors or shards with
model.safetensors.index.json, and tokenizer.json (read with the `tokenizers` package; other
tokenizer files are copied along by the export). Its weights go into lowbit's own
`Transformer` (lowbit.models.transformer), whose module names are Hugging Face's, so the
mapping is the identity except for MoE experts: checkpoints on the Hub (and
`save_pretrained`'s default, `save_original_format=True`) hold one 2D tensor per expert,
`mlp.experts.{e}.gate_proj.weight` (F, C), `up_proj` (F, C), `down_proj` (C, F), which are
stacked into lowbit's (and transformers 5.x's) fused `experts.gate_up_proj` (E, 2F, C) and
`experts.down_proj` (E, C, F); checkpoints already fused load as they are.

Supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, with
SiLU MLPs, plain or LLaMA-3 RoPE, no sliding window, every MoE layer sparse. Anything else is
refused with a `ModelLoadError` (a ValueError: one line, the CLI's exit 2) naming what.

Loading is shard by shard and tensor by tensor: the model is built on the meta device, and
each parameter becomes the tensor read from its shard, cast to `dtype` (None: the
checkpoint's), on `device`; the experts' stacks are filled in place, one expert at a time. No
second full copy of the weights exists at any point.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from lowbit.files import write_atomic, write_safetensors, write_text_atomic
from lowbit.models.config import PRESETS, ModelConfig
from lowbit.models.transformer import Transformer

__all__ = ["ARCHITECTURES", "ModelLoadError", "load_model", "is_model_folder", "read_config", "config_from_hf",
           "load_tokenizer", "save_hf", "hf_config_dict", "hf_state_items", "iter_checkpoint",
           "checkpoint_files", "load_weights_into", "write_shards"]

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """A model folder lowbit cannot load: the message says what is missing or unsupported."""


def is_model_folder(path_or_preset: str | os.PathLike) -> bool:
    """True for a path to a folder (a Hugging Face model), False for a preset name."""
    text = str(path_or_preset)
    return text not in PRESETS and (os.sep in text or "/" in text or Path(text).is_dir())


def load_model(path_or_preset: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None):
    """A Hugging Face folder (or a lowbit preset name) as `(model, tokenizer, config)`.

    model: a lowbit.models.Transformer in eval mode, on `device`, parameters in `dtype`
        (None: the checkpoint's dtype; presets: float32, freshly initialized).
    tokenizer: a `tokenizers.Tokenizer` from the folder's tokenizer.json (None for a preset, or
        a folder without one); lowbit.data.BPETokenizer(tokenizer) gives lowbit's interface.
    config: the lowbit.models.ModelConfig it was built from.
    Raises ModelLoadError for a missing file or an unsupported architecture.
    """
    if not is_model_folder(path_or_preset):
        config = ModelConfig.preset(str(path_or_preset))
        with torch.device(device):
            model = Transformer(config)
        return model.to(dtype or torch.float32).eval(), None, config
    path = Path(path_or_preset)
    config, hf = read_config(path)
    files = checkpoint_files(path)
    if dtype is None:
        dtype = _DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype") or "float32"), torch.float32)
    device = torch.device(device)
    with torch.device("meta"):
        model = Transformer(config)
    load_weights_into(model, iter_checkpoint(files), device, dtype)
    return model.eval(), load_tokenizer(path), config


def read_config(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """config.json as a lowbit ModelConfig, and the raw dict."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"no such model folder: {path}")
    file = path / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"{path} has no config.json; a Hugging Face model folder holds "
                             f"config.json and *.safetensors (what save_pretrained writes)")
    if (path / "checkpoints" / "latest.pt").is_file():   # lowbit.train.run_dir's layout
        raise ModelLoadError(f"{path} is a lowbit run folder, not a Hugging Face model folder; "
                             f"export it as one (lowbit export {path} --format bf16 --out DIR) "
                             f"and give DIR")
    hf = json.loads(file.read_text())
    return config_from_hf(hf, path), hf


def config_from_hf(hf: dict, path: str | os.PathLike = "config") -> ModelConfig:
    """A Hugging Face config dict (config.json, or a loaded model's `config.to_dict()`) as a
    lowbit ModelConfig; `path` names it in the ModelLoadError an unsupported one raises."""
    arch = (hf.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: architecture {arch} is not supported; lowbit loads "
                             f"{', '.join(ARCHITECTURES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: hidden_act {hf['hidden_act']!r}; lowbit's MLPs are SwiGLU (silu)")
    if hf.get("use_sliding_window"):
        raise ModelLoadError(f"{path}: use_sliding_window is set; lowbit's attention is full causal")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ModelLoadError(f"{path}: rope_type {rope_type!r} is not supported (default, llama3)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{path}: partial_rotary_factor is not supported")
    scaling = None
    if rope_type == "llama3":
        scaling = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                        "original_max_position_embeddings")}
        scaling["rope_type"] = "llama3"
    n_heads = hf["num_attention_heads"]
    fields = dict(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        ffn_dim=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(theta), rope_scaling=scaling, norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dropout=0.0,
    )
    bias = bool(hf.get("attention_bias", False))
    if arch == "Qwen2ForCausalLM":
        fields.update(qkv_bias=True)           # Qwen2: q/k/v biases always, o_proj none
    else:
        fields.update(qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        fields.update(qk_norm=True)
    if arch == "Qwen3MoeForCausalLM":
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
            raise ModelLoadError(f"{path}: mlp_only_layers / decoder_sparse_step mix dense and MoE "
                                 f"layers; lowbit's MoE model makes every layer sparse")
        k = hf["num_experts_per_tok"]
        fields.update(n_experts=hf.get("num_experts") or hf["num_local_experts"], experts_per_token=k,
                      moe_ffn_dim=hf["moe_intermediate_size"],
                      moe_norm_topk=bool(hf.get("norm_topk_prob", False)),  # transformers' default
                      # transformers' aux loss is k times lowbit's (lowbit.models.moe)
                      moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)) * k)
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The folder's safetensors files: the index's shards, or model.safetensors."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        for key, shard in weight_map.items():
            # a shard name is a file of this folder: `../x` or `/x` would read elsewhere
            if (not isinstance(shard, str) or not shard or Path(shard).is_absolute()
                    or ".." in shard.replace("\\", "/").split("/")):
                raise ModelLoadError(f"{index}: weight_map entry {key!r} names shard {shard!r}, "
                                     f"outside the model folder; an index names its shards by "
                                     f"their file name in {path} (fix or remove the entry)")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelLoadError(f"{path}: shard {missing[0]} named in {index.name} is missing")
        return [path / s for s in shards]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        raise ModelLoadError(f"{path} holds PyTorch .bin weights; lowbit reads safetensors "
                             f"(save_pretrained(..., safe_serialization=True))")
    raise ModelLoadError(f"{path} has no model.safetensors or model.safetensors.index.json")


def iter_checkpoint(files: list[Path], device: str | torch.device = "cpu"):
    """(name, tensor) for every tensor of the files, one at a time (memory-mapped reads)."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_tokenizer(path: str | os.PathLike):
    """The folder's tokenizer.json as a `tokenizers.Tokenizer`, or None if it has none."""
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json"
    return Tokenizer.from_file(str(file)) if file.is_file() else None


def _expert_key(name: str):
    """'model.layers.3.mlp.experts.7.up_proj.weight' -> ('model.layers.3.mlp.experts', 7, 'up_proj')."""
    parts = name.split(".")
    if len(parts) >= 4 and parts[-1] == "weight" and parts[-4] == "experts" and parts[-3].isdigit():
        return ".".join(parts[:-3]), int(parts[-3]), parts[-2]
    return None


@torch.no_grad()
def load_weights_into(model: Transformer, items, device: torch.device, dtype: torch.dtype) -> None:
    """Fill a model built on the meta device from (Hugging Face name, tensor) items, each cast
    to dtype on device as it comes; per-expert tensors are stacked into the fused experts.
    Refuses a missing, unexpected or misshapen tensor."""
    config = model.config
    device = torch.device(device)
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = set(params)
    if config.tie_embeddings:
        expected.discard("lm_head.weight")
    stacks: dict[str, torch.Tensor] = {}      # fused experts parameter name -> (E, ., .) tensor
    filled: dict[str, set] = {}
    seen = set()
    F = config.moe_ffn_dim
    for name, tensor in items:
        if name.startswith("lm_head.") and config.tie_embeddings:
            continue
        if name in params:
            want = params[name].shape
            if tensor.shape != want:
                raise ModelLoadError(f"{name}: the checkpoint's shape {tuple(tensor.shape)} is not "
                                     f"config.json's {tuple(want)}")
            _set_parameter(model, name, tensor.to(device=device, dtype=dtype))
            seen.add(name)
            continue
        key = _expert_key(name)
        if key is None:
            if "rotary_emb" in name:
                continue
            raise ModelLoadError(f"the checkpoint has tensor {name}, which "
                                 f"{type(model).__name__} (lowbit) has no place for")
        prefix, e, proj = key
        target = f"{prefix}.gate_up_proj" if proj in ("gate_proj", "up_proj") else f"{prefix}.down_proj"
        if target not in params:
            raise ModelLoadError(f"the checkpoint has expert tensor {name}, but no {target} exists")
        if target not in stacks:
            stacks[target] = torch.empty(params[target].shape, device=device, dtype=dtype)
            filled[target] = set()
        rows = {"gate_proj": slice(0, F), "up_proj": slice(F, 2 * F)}.get(proj, slice(None))
        stacks[target][e, rows].copy_(tensor)
        filled[target].add((e, proj))
    for target, stack in stacks.items():
        need = (2 if target.endswith("gate_up_proj") else 1) * config.n_experts
        if len(filled[target]) != need:
            raise ModelLoadError(f"{target}: the checkpoint holds {len(filled[target])} of its "
                                 f"{need} per-expert tensors")
        _set_parameter(model, target, stack)
        seen.add(target)
    missing = sorted(expected - seen)
    if missing:
        raise ModelLoadError(f"the checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]}")
    if config.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    rotary = model.model.rotary_emb
    rotary.cos = torch.empty(rotary.cos.shape, device=device)
    rotary.sin = torch.empty(rotary.sin.shape, device=device)
    rotary.reset()


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=True))


# --- out: lowbit models as Hugging Face folders ---------------------------------------------

def hf_config_dict(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json of `config` as LlamaForCausalLM (dense, no q/k norm), Qwen3ForCausalLM
    (dense with q/k norm) or Qwen3MoeForCausalLM (MoE)."""
    c = config
    if c.mlp_bias or (c.qkv_bias != c.o_bias):
        if not (c.qkv_bias and not c.o_bias and not c.qk_norm and not c.is_moe):
            raise ValueError("this combination of biases has no Hugging Face architecture")
    if c.is_moe and not c.qk_norm:
        raise ValueError("an MoE model saves as Qwen3MoeForCausalLM, which has q/k norms; build it "
                         "with qk_norm=True")
    if c.is_moe:
        arch, model_type = "Qwen3MoeForCausalLM", "qwen3_moe"
    elif c.qk_norm:
        arch, model_type = "Qwen3ForCausalLM", "qwen3"
    elif c.qkv_bias and not c.o_bias:
        arch, model_type = "Qwen2ForCausalLM", "qwen2"
    else:
        arch, model_type = "LlamaForCausalLM", "llama"
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        rope = {**c.rope_scaling, "rope_theta": c.rope_theta}
    out = {
        "architectures": [arch], "model_type": model_type, "vocab_size": c.vocab_size,
        "hidden_size": c.dim, "intermediate_size": c.ffn_dim, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim, "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps, "rope_parameters": rope, "hidden_act": "silu",
        "tie_word_embeddings": c.tie_embeddings, "attention_dropout": 0.0,
        "dtype": str(dtype).removeprefix("torch."), "use_cache": True,
    }
    if model_type != "qwen2":
        out["attention_bias"] = c.qkv_bias
    if model_type == "llama":
        out["mlp_bias"] = c.mlp_bias
    if c.is_moe:
        out.update(num_experts=c.n_experts, num_experts_per_tok=c.experts_per_token,
                   moe_intermediate_size=c.moe_ffn_dim, norm_topk_prob=c.moe_norm_topk,
                   decoder_sparse_step=1, mlp_only_layers=[],
                   router_aux_loss_coef=c.moe_aux_loss_coef / c.experts_per_token)
    return out


def hf_state_items(model: nn.Module):
    """(Hugging Face name, tensor) of the model's weights, experts split per expert (the Hub
    layout servers load), a tied lm_head left out."""
    config: ModelConfig = model.config
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_embeddings:
            continue
        if name.endswith("experts.gate_up_proj"):
            prefix, F = name.removesuffix(".gate_up_proj"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.gate_proj.weight", tensor[e, :F]
                yield f"{prefix}.{e}.up_proj.weight", tensor[e, F:]
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor


def save_hf(model: nn.Module, path: str | os.PathLike, tokenizer=None,
            dtype: torch.dtype | None = None, max_shard_bytes: int = 4 * 2**30) -> Path:
    """Write a lowbit Transformer as a Hugging Face folder: config.json, safetensors shards
    (with an index when there are several), tokenizer.json if given (a `tokenizers.Tokenizer`
    or an object holding one as `.tokenizer`). dtype None: the parameters' dtype."""
    config: ModelConfig = model.config
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = dtype or next(model.parameters()).dtype
    write_shards(path, ((name, t.detach().to("cpu", dtype).contiguous())
                        for name, t in hf_state_items(model)), max_shard_bytes=max_shard_bytes)
    write_text_atomic(path / "config.json", json.dumps(hf_config_dict(config, dtype), indent=2) + "\n")
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    if tok is not None:
        write_atomic(path / "tokenizer.json", lambda tmp: tok.save(str(tmp)))
    return path


def write_shards(path: Path, items, metadata: dict | None = None,
                 max_shard_bytes: int = 4 * 2**30) -> list[Path]:
    """items, (name, tensor) pairs in file order, as model.safetensors, or, past
    max_shard_bytes, model-0000i-of-0000n.safetensors plus the index (the names
    save_pretrained gives), each through lowbit.files' atomic writes; returns the paths
    written."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in items:
        if size and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total, written = {}, 0, []
    for name, shard in zip(names, shards):
        write_safetensors(path / name, shard, {"format": "pt", **(metadata or {})})
        written.append(path / name)
        for key, t in shard.items():
            weight_map[key] = name
            total += t.nbytes
    if len(shards) > 1:
        index = path / "model.safetensors.index.json"
        write_text_atomic(index, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                            indent=2) + "\n")
        written.append(index)
    return written


