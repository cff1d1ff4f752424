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

compressed-tensors "pack-quantized" (integer weights, int4 / int8, schemes W4A16 / W8A16 /
W4A16_ASYM, vLLM's WNA16 kernels), per linear `m` (lowbit.export.packing has the bit layout):
    m.weight_packed      int32 (R, C * bits / 32)  codes + 2^(bits-1), element i of a row at
                                                   bits [bits * i, bits * (i + 1)) of its words
    m.weight_scale       float32 (R, C / group)    (R, 1) for one scale per row ("channel")
    m.weight_shape       int64 (2,)                (R, C)
    m.weight_zero_point  int32 (R * bits / 32, C / group), packed along the rows (asym only)
value = (code - zero_point) * weight_scale, in float32: lowbit's own dequantize, bit for bit.

The reciprocal is the one place a layout cannot hold lowbit's bits: float32 1/(1/s) is not
always s (about 16% of scales do not round-trip through a float32 reciprocal). So a
compressed-tensors file also carries lowbit's own tensor scales, bit for bit, in its
safetensors header metadata ("lowbit.tensor_scales": name -> float32 bits as hex), which
servers ignore and lowbit.load_exported reads.
"""

from __future__ import annotations

from dataclasses import replace

from lowbit.formats.weight_format import WeightFormat, names_block, parse_weight_format

__all__ = ["LAYOUTS", "FORMAT_LAYOUTS", "parse_export_format", "tensor_names",
           "modelopt_config", "compressed_tensors_config", "int_compressed_tensors_config"]

LAYOUTS = ("modelopt", "compressed-tensors")
# which layouts exist for which format: ModelOpt's HF export has no MXFP4 or integer layout
# lowbit writes (its INT4 is AWQ's, another packing)
FORMAT_LAYOUTS = {"nvfp4": ("modelopt", "compressed-tensors"), "mxfp4": ("compressed-tensors",),
                  "int4": ("compressed-tensors",), "int8": ("compressed-tensors",)}
EXPORTS = "nvfp4, mxfp4, int4 and int8 (with :gG or :row, and :asym)"


def parse_export_format(text: str) -> WeightFormat:
    """'nvfp4', 'mxfp4', 'int4', 'int4:g64:asym', 'int8:g128' (lowbit.formats' grammar) as the
    WeightFormat to export (defaults: int4 in groups of 128, as GPTQ / AWQ checkpoints are; int8
    per output channel, `:row`, as W8A16 ones are). What no server kernel reads is refused with
    a line saying which exports there are."""
    try:
        fmt = parse_weight_format(text)
    except ValueError as e:
        raise ValueError(f"--format {text}: {e}; lowbit exports {EXPORTS}") from None
    if fmt.name in ("int2", "int3", "ternary", "binary", "seq2"):
        raise ValueError(f"{fmt.format_name} weights have no serving layout: vLLM's and SGLang's "
                         f"integer kernels (compressed-tensors pack-quantized, WNA16) take 4- and "
                         f"8-bit integers only, and no server reads 1-3-bit or ternary codes; "
                         f"lowbit exports {EXPORTS}")
    if fmt.name not in FORMAT_LAYOUTS:
        raise ValueError(f"unknown --format {text!r}; lowbit exports {EXPORTS}")
    if fmt.scale_rule is not None:
        raise ValueError(f"--format {text}: the MX scale rule is its own flag; write --format "
                         f"{fmt.name} --scale-rule {fmt.scale_rule}")
    if fmt.data_scaled:
        fmt.refuse(f"--format {fmt.name}", set(), f"{fmt.name} has its own blocks; write plain "
                   f"--format {fmt.name}")
        return fmt
    fmt.refuse(f"--format {fmt.name}", {"group", "asym"}, "an integer export takes gG, row and "
               "asym")
    if fmt.name == "int8" and not names_block(text):
        fmt = replace(fmt, row=True)
    return fmt


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


def int_compressed_tensors_config(fmt: WeightFormat, ignore: list[str], version: str) -> dict:
    """config.json's quantization_config for integer weights, format "pack-quantized" (the
    W4A16 / W8A16 / W4A16_ASYM schemes of compressed_tensors.quantization.quant_scheme), with
    float32 scales: the scales QAT trained, unrounded."""
    args = {"num_bits": fmt.bits, "type": "int", "symmetric": not fmt.asym, "dynamic": False,
            "strategy": "channel" if fmt.group is None else "group", "group_size": fmt.group,
            "scale_dtype": "torch.float32", "observer": "minmax", "actorder": None,
            "block_structure": None}
    if fmt.asym:
        args["zp_dtype"] = "torch.int8"
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args,
                                          "input_activations": None, "output_activations": None,
                                          "format": "pack-quantized"}},
            "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None,
            "sparsity_config": {}, "transform_config": {}, "version": version,
            "producer": "lowbit"}
