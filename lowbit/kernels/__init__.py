"""Triton kernels (fused quantize, quantize-dequantize, exact FP4 GEMMs on FP8 tensor cores).

Not built yet (issue 4). Every kernel will take lowbit.formats' reference as its CPU fallback
and its test oracle; until then all quantization runs through the reference on every device.
"""
