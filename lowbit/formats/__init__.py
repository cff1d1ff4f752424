"""Reference numerics: element formats, block scaling (1D/2D), rounding, QTensor storage, the
random Hadamard transform, the fold of MXFP4 into FP8, and AdamW's step with a per-element
factor on the change (lowbit.formats.optimizer, which a kernel fuses).

This package is the single source of truth for what every format means: plain PyTorch that
runs as written on any device. Kernels are tested against it bit for bit; lowbit.dispatch
picks between them (`lowbit.quantize` goes through it).
"""

from lowbit.formats.elements import E2M1, E4M3, E5M2, ElementFormat
from lowbit.formats.hadamard import random_hadamard
from lowbit.formats.qtensor import QTensor, load_qtensors, save_qtensors
from lowbit.formats.quantize import check_input, quantize, quantize_dequantize, quantize_with_spec
from lowbit.formats.spec import FORMATS, QuantSpec, Rounding, ScaleKind, ScaleRule, get_format
from lowbit.formats.weight_format import WeightFormat, parse_weight_format

__all__ = ["quantize", "quantize_with_spec", "quantize_dequantize", "check_input", "QTensor",
           "save_qtensors", "load_qtensors", "QuantSpec", "ScaleRule", "Rounding", "ScaleKind",
           "FORMATS", "get_format", "WeightFormat", "parse_weight_format", "ElementFormat", "E2M1",
           "E4M3", "E5M2", "random_hadamard"]
