"""lowbit: train large language models in 4-bit and lower precision.

    import torch, lowbit
    q = lowbit.quantize(torch.randn(256, 512), "nvfp4")   # packed QTensor
    x_hat = q.dequantize()

    lowbit.quantize_(model, "stable-fp4")                   # train in FP4: a recipe
    lowbit.quantize_(model, lowbit.recipes.stable_fp4())     # the same, as its config object
    lowbit.quantize_(model, lowbit.qat.QATConfig(weights="int2:g64", estimator="jacquant"))
"""

from lowbit.dispatch import quantize
from lowbit.formats import FORMATS, QTensor, QuantSpec, load_qtensors, save_qtensors

__version__ = "0.1.0"
# lowbit.convert, the deprecated name of quantize_(model, recipe), still resolves (with a
# DeprecationWarning) but is no longer listed
__all__ = ["quantize", "quantize_", "QTensor", "QuantSpec", "save_qtensors", "load_qtensors",
           "FORMATS", "get_recipe"]


def quantize_(model, config, filter_fn=None):
    """Quantize `model` for training, in place, in torchao's `quantize_(model, config,
    filter_fn)` shape; returns what was done (a report that prints as a table).

    config: a training recipe -- its name ("stable-fp4", "nvfp4", ...) or a Recipe, such as
    lowbit.recipes.stable_fp4() -- swaps every nn.Linear and 3D-experts module for one whose
    GEMMs quantize their operands (lowbit.nn.convert_to_quantized_training); a
    lowbit.qat.QATConfig fake-quantizes the weights for quantization-aware training
    (lowbit.qat.prepare; lowbit.qat.convert packs them afterwards). filter_fn(module, name)
    -> bool picks the modules (default: all but the output head and MoE routers). All or
    nothing: a model that cannot take the config is left as it was (ValueError, one line)."""
    from lowbit.recipes import Recipe

    if isinstance(config, (str, Recipe)):
        from lowbit.nn import convert_to_quantized_training
        return convert_to_quantized_training(model, config, filter_fn)
    from lowbit.qat import QATConfig, prepare   # QAT's stack, only when it is asked for

    if isinstance(config, QATConfig):
        return prepare(model, config, filter_fn)
    raise TypeError(f"lowbit.quantize_ takes a recipe (a name such as 'stable-fp4', or a "
                    f"lowbit.recipes.Recipe) or a lowbit.qat.QATConfig, not "
                    f"{type(config).__name__}")


def __getattr__(name):
    # The training side (nn, recipes) imports lazily, so `import lowbit` for numerics stays light.
    if name == "convert":   # deprecated: lowbit.quantize_
        from lowbit.nn import convert
        return convert
    if name == "get_recipe":
        from lowbit.recipes import get_recipe
        return get_recipe
    if name in ("recipes", "qat", "nn"):
        import importlib
        return importlib.import_module(f"lowbit.{name}")
    raise AttributeError(f"module 'lowbit' has no attribute {name!r}")
