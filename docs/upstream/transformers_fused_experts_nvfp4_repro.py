"""A reproducer for transformers, without lowbit: a Qwen3-MoE checkpoint whose experts are NVFP4
(compressed-tensors `nvfp4-pack-quantized`, written by compressed-tensors' own compressor)
loads into transformers with every expert weight missing its tensor scale.

    python docs/upstream/transformers_fused_experts_nvfp4_repro.py [--out DIR]

It builds a tiny random Qwen3MoeForCausalLM, compresses every attention and expert linear with
`NVFP4PackedCompressor.compress` (scales by NVFP4's convention: a global scale of
448 * 6 / amax(W) per weight and E4M3 block scales of 16 inputs), saves the checkpoint with the
NVFP4A16 quantization_config, loads it with `AutoModelForCausalLM.from_pretrained` (plain, and
with `CompressedTensorsConfig(dequantize=True)`) and compares the loaded weights with
`NVFP4PackedCompressor.decompress` of the same tensors (an attention projection transformers
keeps compressed: its tensors against those written). Prints the largest difference per kind
of weight; exits 1 while the fused experts load wrong, 0 once they load exactly.

Seen with transformers 5.25.0 and compressed-tensors 0.20.1 (2026-12-05, 2-core CPU): the
attention projections load exactly, the experts (fused into `experts.gate_up_proj` /
`experts.down_proj` at load) come out multiplied by their global scale (448 * 6 / amax(W), about
30,000 for these random weights), so their values reach 448 * 6 = 2,688 where the checkpoint's
are below 0.09. transformers' fused-experts decompression
(`integrations/compressed_tensors.py`, `CompressedTensorsDequantize.convert`) passes each
expert's weight_packed, weight_scale and weight_shape to the compressor but not its
weight_global_scale; transformers-compressed-tensors-fused-experts.diff beside this file passes
it (and weight_zero_point).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch


def nvfp4_scales(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's two-level scales of w (out, in): the per-tensor global scale and the E4M3 scale
    of each block of 16 inputs (E4M3 values, held in float32), as compressed-tensors' NVFP4
    observers define them."""
    global_scale = (448.0 * 6.0 / w.abs().amax().float()).reshape(1)
    block_amax = w.float().reshape(w.shape[0], -1, 16).abs().amax(dim=-1)
    scale = (block_amax / 6.0 * global_scale).clamp(max=448.0).to(torch.float8_e4m3fn).float()
    return global_scale, scale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for the checkpoint (default: a temporary one)")
    args = parser.parse_args()
    import transformers
    from compressed_tensors.compressors import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    scheme: QuantizationScheme = preset_name_to_scheme("NVFP4A16", ["Linear"])

    # every decoder projection, one 2D weight each, experts one by one as Hub checkpoints hold them
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    weights = {}
    for i, layer in enumerate(model.model.layers):
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            weights[f"model.layers.{i}.self_attn.{p}"] = getattr(layer.self_attn, p).weight
        experts = layer.mlp.experts
        F = config.moe_intermediate_size
        for e in range(config.num_experts):
            base = f"model.layers.{i}.mlp.experts.{e}"
            weights[f"{base}.gate_proj"] = experts.gate_up_proj[e, :F]
            weights[f"{base}.up_proj"] = experts.gate_up_proj[e, F:]
            weights[f"{base}.down_proj"] = experts.down_proj[e]
        for fused in ("gate_up_proj", "down_proj"):
            tensors.pop(f"model.layers.{i}.mlp.experts.{fused}")
    expected = {}
    for name, w in weights.items():
        tensors.pop(f"{name}.weight", None)
        global_scale, scale = nvfp4_scales(w.detach())
        packed = NVFP4PackedCompressor.compress(
            {"weight": w.detach(), "weight_scale": scale, "weight_global_scale": global_scale},
            scheme)
        for key in ("weight_packed", "weight_scale", "weight_global_scale"):
            tensors[f"{name}.{key}"] = packed[key].contiguous()
        expected[name] = NVFP4PackedCompressor.decompress(
            {k: packed[k] for k in ("weight_packed", "weight_scale", "weight_global_scale")},
            scheme)["weight"].to(torch.bfloat16)

    out = Path(args.out or tempfile.mkdtemp(prefix="fused-experts-nvfp4-"))
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file
    save_file(tensors, str(out / "model.safetensors"))
    hf_config = config.to_dict()
    hf_config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": scheme.model_dump(mode="json")},
        "ignore": ["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in range(config.num_hidden_layers)]}
    (out / "config.json").write_text(json.dumps(hf_config, indent=1))

    wrong = False
    for how, kw in (("plain", {}), ("dequantize=True", {"quantization_config":
                                                      transformers.CompressedTensorsConfig(dequantize=True)})):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, **kw)
        state = loaded.state_dict()
        worst = {"attention": 0.0, "experts": 0.0}
        for i in range(config.num_hidden_layers):
            for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
                name = f"model.layers.{i}.self_attn.{p}"
                module = loaded.get_submodule(name)
                if getattr(module, "weight", None) is not None:   # decompressed at load
                    diff = (module.weight.float() - expected[name].float()).abs().max().item()
                else:   # kept compressed (decompressed in its forward): the tensors as written
                    diff = max((getattr(module, k).float() - tensors[f"{name}.{k}"].float())
                               .abs().max().item() for k in ("weight_packed", "weight_scale",
                                                             "weight_global_scale"))
                worst["attention"] = max(worst["attention"], diff)
            experts = f"model.layers.{i}.mlp.experts"
            F = config.moe_intermediate_size
            for e in range(config.num_experts):
                gate_up = state[f"{experts}.gate_up_proj"][e].float()
                down = state[f"{experts}.down_proj"][e].float()
                for got, name in ((gate_up[:F], "gate_proj"), (gate_up[F:], "up_proj"), (down, "down_proj")):
                    diff = (got - expected[f"{experts}.{e}.{name}"].float()).abs().max().item()
                    worst["experts"] = max(worst["experts"], diff)
        largest = max(state[f"model.layers.0.mlp.experts.{k}"].float().abs().max().item()
                      for k in ("gate_up_proj", "down_proj"))
        print(f"{how}: largest |loaded - compressed-tensors' decompress|: attention "
              f"{worst['attention']:.3g}, experts {worst['experts']:.3g} (largest loaded expert "
              f"value {largest:.4g}; the checkpoint's are at most "
              f"{max(w.abs().max().item() for w in expected.values()):.3g})")
        wrong |= worst["experts"] > 0
    print(f"checkpoint: {out}")
    print("the fused experts load wrong" if wrong else "the fused experts load exactly")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
