"""`lowbit export`: low-bit Hugging Face folders that vLLM, SGLang and TensorRT-LLM serve,
and `load_exported` to read them back.

    from lowbit.export import export_model, load_exported
    report = export_model(model, "out/", format="nvfp4", layout="modelopt")   # or compressed-tensors
    exported = load_exported("out/")   # .weights: name -> QTensor (bit for bit), .model

The writer (lowbit.export.writer) says what is quantized, how fused groups share a tensor
scale and how already-quantized weights (QAT) are written as they are; the layouts' tensor
names, dtypes and configs are in lowbit.export.layouts.
"""

from lowbit.export.calibrate import calibrate_input_amax
from lowbit.export.layouts import FORMAT_LAYOUTS, LAYOUTS
from lowbit.export.reader import Exported, is_low_bit_export, load_exported, read_layout
from lowbit.export.writer import (ExportReport, export_model, quantize_group, row_blocks,
                                  split_rows, weight_groups)

__all__ = ["export_model", "load_exported", "Exported", "ExportReport", "quantize_group",
           "split_rows", "row_blocks", "weight_groups", "read_layout", "is_low_bit_export",
           "calibrate_input_amax",
           "LAYOUTS", "FORMAT_LAYOUTS"]
