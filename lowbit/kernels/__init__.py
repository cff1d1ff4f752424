"""Triton kernels: fused quantize and quantize-dequantize ("fake quant"), bit-exact to the
reference in lowbit.formats (see lowbit/kernels/quantize.py for how, and for the stochastic
rounding seed contract).

    q = quantize_triton(x, spec)               # QTensor, same bits as quantize_with_spec(x, spec)
    x_hat = fake_quantize_triton(x, spec)      # == quantize_dequantize(x, spec), same bits
    q, q_t = quantize_triton_with_transpose(x, spec2d)       # q_t == q.t(), from the same pass
    x_hat, x_hat_t = fake_quantize_triton_with_transpose(x, spec2d)

The kernels cover `supports(spec)`: NVFP4 and MX formats with power-of-two blocks, and for
fake quantization also intK (`supports(spec, codes=False)`). They run on CUDA tensors, and on
CPU tensors under TRITON_INTERPRET=1 (Triton's interpreter: the CPU test mode). Which of a
kernel and the reference a quantizer runs is lowbit.dispatch's choice, not this package's.

Importing this package does not import triton; the kernels load on first use. The entry points
above live in _quantize_api, `supports` and `kernels_available` in _support.
"""

from lowbit.kernels._quantize_api import (
    fake_quantize_triton, fake_quantize_triton_with_transpose, given_scales_axis, group_amax_triton,
    quantize_rows_takes, quantize_rows_triton, quantize_triton, quantize_triton_with_transpose, run_quantize_kernel,
    seed_tensor, segment_scales_triton, stochastic_uniforms,
)
from lowbit.kernels._support import interpret_mode, kernels_available, supports, triton_importable

__all__ = ["quantize_triton", "fake_quantize_triton", "quantize_triton_with_transpose",
           "fake_quantize_triton_with_transpose", "kernels_available", "supports",
           "triton_importable", "stochastic_uniforms", "seed_tensor", "interpret_mode",
           "run_quantize_kernel", "group_amax_triton", "given_scales_axis", "segment_scales_triton",
           "quantize_rows_triton", "quantize_rows_takes"]
