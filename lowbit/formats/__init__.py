"""Reference numerics: element formats, block scaling (1D/2D), rounding, and QTensor storage.

This package is the single source of truth for what every format means; kernels are tested
against it bit for bit.
"""

from lowbit.formats.elements import E2M1, E4M3, E5M2, ElementFormat
from lowbit.formats.qtensor import QTensor, load_qtensors, save_qtensors
from lowbit.formats.quantize import quantize, quantize_dequantize, quantize_with_spec
from lowbit.formats.spec import FORMATS, QuantSpec, Rounding, ScaleKind, ScaleRule, get_format

__all__ = ["quantize", "quantize_with_spec", "quantize_dequantize", "QTensor", "save_qtensors", "load_qtensors",
           "QuantSpec", "ScaleRule", "Rounding", "ScaleKind", "FORMATS", "get_format",
           "ElementFormat", "E2M1", "E4M3", "E5M2"]
