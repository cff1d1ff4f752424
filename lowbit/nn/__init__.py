"""Quantized modules and the converter that swaps them into any nn.Module.

    report = lowbit.quantize_(model, "stable-fp4")  # in place; prints what it swapped and kept
    print(report)

(`lowbit.quantize_` with a recipe calls `convert_to_quantized_training` here; with a QATConfig,
lowbit.qat.prepare. Both walk the model with `gemm_modules`.)

`QuantLinear` is an nn.Linear whose forward runs the recipe's three quantized GEMMs
(lowbit.ops.quant_linear); `QuantExperts` does the same per expert for MoE expert weights
stored as 3D tensors (lowbit's models and Hugging Face Qwen3-MoE in transformers 5.x).
Both keep their parameters in high precision (the master weights); quantization happens in
each GEMM. `quantization_disabled(model)` turns it off temporarily (to compare against BF16
on the same weights); `reuse_weight_operands(model, optimizer)` quantizes each forward weight once
between optimizer steps (the RL trainer's log-prob passes and micro-batches).
"""

from lowbit.nn._convert import (GEMM_KINDS, ConversionReport, convert, convert_to_quantized_training,
                                default_module_filter, gemm_modules, quantization_disabled,
                                reuse_weight_operands)
from lowbit.nn._layers import QuantExperts, QuantLinear, is_experts

__all__ = ["QuantLinear", "QuantExperts", "convert_to_quantized_training", "convert", "gemm_modules",
           "GEMM_KINDS", "ConversionReport", "quantization_disabled",
           "default_module_filter", "is_experts", "reuse_weight_operands"]
