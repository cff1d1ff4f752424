"""lowbit: train large language models in 4-bit and lower precision.

    import torch, lowbit
    q = lowbit.quantize(torch.randn(256, 512), "nvfp4")   # packed QTensor
    x_hat = q.dequantize()
"""

from lowbit.dispatch import quantize
from lowbit.formats import FORMATS, QTensor, QuantSpec, load_qtensors, save_qtensors

__version__ = "0.1.0"
__all__ = ["quantize", "QTensor", "QuantSpec", "save_qtensors", "load_qtensors", "FORMATS",
           "convert", "get_recipe"]


def __getattr__(name):
    # The training side (nn, recipes) imports lazily, so `import lowbit` for numerics stays light.
    if name == "convert":
        from lowbit.nn import convert
        return convert
    if name == "get_recipe":
        from lowbit.recipes import get_recipe
        return get_recipe
    raise AttributeError(f"module 'lowbit' has no attribute {name!r}")
