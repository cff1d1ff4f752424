"""Read an exported low-bit folder back: its packed weights as QTensors, bit for bit, and a
lowbit model that runs on their dequantized values (what a weight-only server computes)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.export.layouts import parse_export_format, tensor_names
from lowbit.export.packing import int_qtensor
from lowbit.formats import QTensor, QuantSpec
from lowbit.models.hf import (ModelLoadError, checkpoint_files, load_tokenizer, load_weights_into,
                              read_config)
from lowbit.models.transformer import Transformer

__all__ = ["Exported", "load_exported", "read_layout", "is_low_bit_export"]


@dataclass
class Exported:
    model: Transformer
    """A lowbit Transformer whose quantized weights are the packed weights dequantized."""
    weights: dict[str, QTensor]
    """Hugging Face weight name (`....q_proj.weight`) -> the packed weight, as written."""
    tokenizer: object
    """The folder's tokenizer.json as a `tokenizers.Tokenizer`, or None."""
    format: str
    """nvfp4, mxfp4, or int4 / int8 with their groups (e.g. int4:g128:asym)."""
    layout: str
    input_scales: dict[str, torch.Tensor]
    """Module name -> static activation tensor scale (amax / 2688) for W4A4 exports."""


def is_low_bit_export(path: str | Path) -> bool:
    """Whether a model folder holds quantized weights in a layout `load_exported` reads (ModelOpt's
    hf_quant_config.json, or a compressed-tensors quantization_config), as lowbit export writes."""
    try:
        read_layout(path)
    except (ModelLoadError, OSError, ValueError):
        return False
    return True


def read_layout(path: str | Path) -> tuple[str, str]:
    """(format, layout) of an exported folder, from its quantization config; an integer
    format is named as --format takes it (int4:g128, int8:row, int4:g32:asym)."""
    path = Path(path)
    if (path / "hf_quant_config.json").is_file():
        algo = json.loads((path / "hf_quant_config.json").read_text())["quantization"]["quant_algo"]
        if "NVFP4" not in algo.upper():
            raise ModelLoadError(f"{path}: ModelOpt quant_algo {algo} is not one lowbit reads (NVFP4)")
        return "nvfp4", "modelopt"
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    q = config.get("quantization_config") or {}
    if q.get("quant_method") == "compressed-tensors":
        fmt = {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4"}.get(q.get("format"))
        if q.get("format") == "pack-quantized":
            fmt = _int_format(path, q)
        if fmt is None:
            raise ModelLoadError(f"{path}: compressed-tensors format {q.get('format')} is not one "
                                 f"lowbit reads (nvfp4-pack-quantized, mxfp4-pack-quantized, "
                                 f"pack-quantized)")
        return fmt, "compressed-tensors"
    raise ModelLoadError(f"{path} is not a low-bit export (no hf_quant_config.json, no "
                         f"compressed-tensors quantization_config)")


def _int_format(path: Path, q: dict) -> str:
    groups = list((q.get("config_groups") or {}).values())
    if len(groups) != 1 or groups[0].get("input_activations"):
        raise ModelLoadError(f"{path}: lowbit reads pack-quantized checkpoints with one "
                             f"weight-only scheme")
    w = groups[0]["weights"]
    if w.get("type") != "int" or w.get("num_bits") not in (4, 8) or w.get("strategy") not in ("group", "channel"):
        raise ModelLoadError(f"{path}: pack-quantized {w.get('type')}{w.get('num_bits')} "
                             f"{w.get('strategy')} is not one lowbit reads (int4/int8, group or channel)")
    group = "row" if w["strategy"] == "channel" else f"g{w['group_size']}"
    return f"int{w['num_bits']}:{group}" + ("" if w.get("symmetric", True) else ":asym")


def load_exported(path: str | Path, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> Exported:
    """An exported folder (either layout) as an `Exported`: QTensors bit for bit, and a model
    in `dtype` on `device` whose packed weights are dequantized (float32 products, then
    cast), everything else as stored (BF16)."""
    from safetensors import safe_open

    path = Path(path)
    format, layout = read_layout(path)
    config, _ = read_config(path)
    names = tensor_names(layout)
    codes_suffix = "." + names["codes"]
    fmt = parse_export_format(format)
    spec = (QuantSpec.make("nvfp4") if format == "nvfp4"
            else QuantSpec.make("mxfp4", scale_rule="floor"))
    raw: dict[str, torch.Tensor] = {}
    exact: dict[str, str] = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            exact.update(json.loads(meta.get("lowbit.tensor_scales", "{}")))
            for key in f.keys():
                raw[key] = f.get_tensor(key)
    packed = sorted(k.removesuffix(".weight_scale") for k in raw if k.endswith(".weight_scale"))
    weights, inputs = {}, {}
    for module in packed if fmt.is_int else []:
        parts = {k: raw.pop(f"{module}.{k}") for k in ("weight_packed", "weight_scale", "weight_shape")}
        if fmt.asym:
            parts["weight_zero_point"] = raw.pop(f"{module}.weight_zero_point")
        weights[f"{module}.weight"] = int_qtensor(parts, fmt.bits, fmt.asym)
    for module in packed if not fmt.is_int else []:
        codes = raw.pop(module + codes_suffix)
        scales = raw.pop(f"{module}.weight_scale")
        tensor_scale = None
        if format == "nvfp4":
            stored = raw.pop(f"{module}.{names['tensor_scale']}").float().reshape(())
            if layout == "modelopt":
                tensor_scale = stored
            elif module in exact:    # lowbit's own bits; a reader without them takes 1 / stored
                tensor_scale = torch.tensor(float.fromhex(exact[module]), dtype=torch.float32)
            else:
                tensor_scale = 1.0 / stored
        act = raw.pop(f"{module}.{names['input_scale']}", None)
        if act is not None:
            act = act.float().reshape(())
            inputs[module] = act if layout == "modelopt" else 1.0 / act
        shape = (codes.shape[0], codes.shape[1] * 2)
        weights[f"{module}.weight"] = QTensor(codes, scales, tensor_scale, spec, shape, torch.bfloat16)

    def items():
        for name, q in weights.items():
            yield name, q.dequantize(torch.float32)
        yield from raw.items()

    with torch.device("meta"):
        model = Transformer(config)
    load_weights_into(model, items(), device, dtype)
    return Exported(model.eval(), weights, load_tokenizer(path), format, layout, inputs)
