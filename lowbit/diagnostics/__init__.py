"""Diagnostics: what quantization does to a tensor (SQNR, clipping, flush to zero), and,
for training, forward/backward operand consistency and gradient bias against BF16."""

from lowbit.diagnostics.quant_error import QuantError, quantization_error, sqnr_db

__all__ = ["QuantError", "quantization_error", "sqnr_db"]
