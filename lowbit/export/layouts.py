"""The on-disk conventions of the low-bit checkpoints servers load, tensor by tensor.

Both layouts store what lowbit's QTensor holds (lowbit.formats.qtensor), so writing one is a
renaming, never a conversion of codes:

- FP4 codes: sign << 3 | index into {0, 0.5, 1, 1.5, 2, 3, 4, 6}, two per byte along the
  input (reduction) dimension, the even element in the low nibble; uint8 (R, C/2).
- NVFP4 block scales: float8_e4m3fn (R, C/16), row-major, not swizzled (servers swizzle
  when they load). MXFP4 block scales: E8M0 biased exponents, uint8 (R, C/32).

ModelOpt (`hf_quant_config.json`, quant_algo "W4A16_NVFP4" or "NVFP4"), per linear `m`:
    m.weight          uint8 (R, C/2)        packed codes
    m.weight_scale    float8_e4m3fn (R, C/16)
    m.weight_scale_2  float32 ()            the tensor scale, amax / (448 * 6), as lowbit's
    m.input_scale     float32 ()            activation amax / (448 * 6) (NVFP4 W4A4 only)
compressed-tensors (config.json `quantization_config`, format "nvfp4-pack-quantized"):
    m.weight_packed        uint8 (R, C/2)
    m.weight_scale         float8_e4m3fn (R, C/16)
    m.weight_global_scale  float32 (1,)     the reciprocal, (448 * 6) / amax: the value is
                                            code * (weight_scale / weight_global_scale)
    m.input_global_scale   float32 (1,)     W4A4 only, also a reciprocal
and "mxfp4-pack-quantized": weight_packed, weight_scale (uint8 exponents), no global scale.

The reciprocal is the one place a layout cannot hold lowbit's bits: float32 1/(1/s) is not
always s (about 16% of scales do not round-trip through a float32 reciprocal). So a
compressed-tensors file also carries lowbit's own tensor scales, bit for bit, in its
safetensors header metadata ("lowbit.tensor_scales": name -> float32 bits as hex), which
servers ignore and lowbit.load_exported reads.
"""

from __future__ import annotations

__all__ = ["LAYOUTS", "FORMAT_LAYOUTS", "tensor_names", "modelopt_config", "compressed_tensors_config"]

LAYOUTS = ("modelopt", "compressed-tensors")
# which layouts exist for which format: ModelOpt's HF export has no MXFP4 layout
FORMAT_LAYOUTS = {"nvfp4": ("modelopt", "compressed-tensors"), "mxfp4": ("compressed-tensors",)}


def tensor_names(layout: str) -> dict[str, str]:
    """The role -> suffix map of a layout ('codes', 'scales', 'tensor_scale', 'input_scale')."""
    if layout == "modelopt":
        return {"codes": "weight", "scales": "weight_scale", "tensor_scale": "weight_scale_2",
                "input_scale": "input_scale"}
    return {"codes": "weight_packed", "scales": "weight_scale",
            "tensor_scale": "weight_global_scale", "input_scale": "input_global_scale"}


def modelopt_config(exclude: list[str], activations: bool, version: str) -> dict:
    """hf_quant_config.json (the file TensorRT-LLM, vLLM and SGLang read for ModelOpt)."""
    return {"producer": {"name": "lowbit", "version": version},
            "quantization": {"quant_algo": "NVFP4" if activations else "W4A16_NVFP4",
                             "kv_cache_quant_algo": None, "group_size": 16,
                             "exclude_modules": exclude}}


def compressed_tensors_config(format: str, ignore: list[str], activations: bool,
                              version: str) -> dict:
    """config.json's quantization_config for compressed-tensors (the schemes NVFP4A16 / NVFP4
    and MXFP4A16 of compressed_tensors.quantization.quant_scheme)."""
    nv = format == "nvfp4"
    args = {"num_bits": 4, "type": "float", "symmetric": True, "dynamic": False,
            "strategy": "tensor_group" if nv else "group", "group_size": 16 if nv else 32,
            "scale_dtype": "torch.float8_e4m3fn" if nv else "torch.uint8",
            "zp_dtype": "torch.float8_e4m3fn" if nv else "torch.uint8",
            "observer": "minmax", "actorder": None, "block_structure": None}
    inputs = None
    if activations:
        inputs = {**args, "dynamic": "local", "observer": None}
    fmt = "nvfp4-pack-quantized" if nv else "mxfp4-pack-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args,
                                          "input_activations": inputs, "output_activations": None,
                                          "format": fmt}},
            "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None,
            "sparsity_config": {}, "transform_config": {}, "version": version,
            "producer": "lowbit"}
