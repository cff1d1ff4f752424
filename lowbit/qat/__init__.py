"""Quantization-aware training to 1-4-bit weights: `prepare`, `convert`, four gradient
estimators (ste, clipped-ste, lsq, jacquant), RTN and GPTQ baselines, and `lowbit qat`.

    from lowbit.qat import QATConfig, prepare, convert
    report = prepare(model, QATConfig(weights="int2:g64", estimator="jacquant"))
    hook = refresh_hook(model, config, seed); hook.attach(optimizer)   # JacQuant (lowbit.qat.QATHook)
    ...train model as usual, calling hook(step) after each optimizer step...
    convert(model)   # packed low-bit weights; lowbit.save_qtensors(path, packed_weights(model))

DESIGN.md section 3 has the method; docs/qat.md the user's guide.
"""

from lowbit.qat.config import (ESTIMATORS, QAT_FORMATS, JacQuantConfig, QATConfig, parse_compare_arm,
                               parse_qat_spec, qat_weight_format)
from lowbit.qat.distill import Distillation, distillation, distillation_kl
from lowbit.qat.gptq import gptq
from lowbit.qat.layers import (CodeFlips, FakeQuantWeight, PackedWeight, QATReport, check_model, convert,
                               fake_quantizers, jacquant_metrics, load_packed, packed_weights, prepare,
                               QATHook, UpdateScaling, refresh, refresh_hook)
from lowbit.qat.quantizer import GroupQuantizer, fake_quantize

__all__ = ["QATConfig", "JacQuantConfig", "QAT_FORMATS", "qat_weight_format", "parse_qat_spec",
           "parse_compare_arm", "ESTIMATORS", "CodeFlips",
           "prepare", "check_model", "convert", "packed_weights", "load_packed", "refresh", "refresh_hook",
           "QATHook", "UpdateScaling", "jacquant_metrics", "fake_quantizers", "gptq", "FakeQuantWeight", "PackedWeight",
           "QATReport", "GroupQuantizer", "fake_quantize", "Distillation", "distillation",
           "distillation_kl"]
