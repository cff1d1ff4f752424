"""Training math as explicit autograd.Functions: the quantized linear layer's three GEMMs."""

from lowbit.formats.hadamard import random_hadamard
from lowbit.ops.gemms import fake_quantize, gemm_operands, operand
from lowbit.ops.linear import quant_linear

__all__ = ["quant_linear", "fake_quantize", "operand", "random_hadamard", "gemm_operands"]
