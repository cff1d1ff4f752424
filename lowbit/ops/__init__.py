"""Training math as explicit autograd.Functions: the quantized linear layer's three GEMMs."""

from lowbit.ops.linear import fake_quantize, gemm_operands, operand, quant_linear, random_hadamard

__all__ = ["quant_linear", "fake_quantize", "operand", "random_hadamard", "gemm_operands"]
