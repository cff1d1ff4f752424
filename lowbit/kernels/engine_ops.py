"""The rollout engine's inference kernels as PyTorch custom operators (`torch.ops.lowbit.*`), for
a decode step compiled by torch.compile: each kernel call stays one opaque operator, and
Inductor fuses the PyTorch operations between them (RMSNorm, residual adds, SiLU * up, what
cuBLAS's GEMMs leave around them).

    y = engine_ops.linear(x, weight, norm=ln)               # lowbit.kernels.engine_linear.linear
    x_hat, r_hat = engine_ops.quantize_activations(x, "nvfp4", 0.25)
    y = engine_ops.decode_attention(qkv, k_cache, v_cache, positions, ...)

Each takes the arguments of the function it stands for and calls that function, unchanged,
inside the operator: a compiled step launches the kernels an eager step launches, with the same
tiles, launch options and programmatic dependent launch, so each gives the same bits.

Why opaque rather than traced: traced as they are (torch 2.11, Triton 3.6, one H100,
docs/results/rollout.md), Dynamo takes the GEMM and the activation pass whole, but Inductor
fails to build the decode-attention kernel (it passes Python floats such as sm_scale as fp64,
which turns the online softmax's float32 accumulator into float64 for tl.dot), and cannot tell
which tensors any of these kernels writes (inline assembly, constexpr ints), so it takes every
argument as written. An opaque operator also keeps the wrappers' host-side work as it is: launch
options beside the kernel's arguments (launch_pdl, enable_fp_fusion), the NVFP4 GEMM's split-K
workspace (one buffer per device, grown on demand), tiles chosen from shapes and the device's
multiprocessor count. A custom operator's arguments are tensors and plain values, so a
LinearWeight crosses as LinearWeight.flatten's tensors and constants. Only
lowbit.dispatch.inference calls this module, while a step is being compiled (the eager path
calls the kernels directly: an operator's dispatch costs host time that an uncaptured eager
step would pay at every call).
"""

import torch

from lowbit.formats.activations import rac_channel_count
from lowbit.formats.linear_weight import LinearWeight

__all__ = ["linear", "quantize_activations", "decode_attention"]

Tensor = torch.Tensor


def linear(x: Tensor, weight: LinearWeight, bias: Tensor | None = None, *,
           x2: Tensor | None = None, norm: Tensor | None = None, eps: float = 1e-6,
           silu_mul: bool = False, residual: Tensor | None = None, pdl: bool = False) -> Tensor:
    """lowbit.kernels.engine_linear.linear as one operator (a weight's NVFP4 tiles must be made
    before: lowbit.dispatch.inference.prepare_weights)."""
    tensors, (storage, in_features, saturates) = weight.flatten()
    return torch.ops.lowbit.engine_linear(x, *tensors, bias, x2, norm, residual, storage,
                                          in_features, saturates, eps, silu_mul, pdl)


def quantize_activations(x: Tensor, mode: str, rac_ratio: float = 0.0, *,
                         norm: Tensor | None = None, eps: float = 1e-6, silu_mul: bool = False,
                         input_amax: Tensor | None = None, rac_group: int = 0, rac_fold: bool = False):
    """lowbit.kernels.activation_quant.quantize_activations as one operator: the same pair
    (x_hat, r_hat or None), (codes, scale) or (input, None)."""
    a, b = torch.ops.lowbit.quantize_activations(x, norm, input_amax, mode, rac_ratio, eps,
                                                 silu_mul, rac_group, rac_fold)
    return a, (b if _second_output(x, mode, rac_ratio, silu_mul, rac_fold) else None)


def decode_attention(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, positions: Tensor,
                     cos: Tensor, sin_signed: Tensor, n_heads: int, n_kv_heads: int,
                     qk_norm: Tensor | None = None, eps: float = 1e-6, pdl: bool = False,
                     prefix_rows: Tensor | None = None, prefix_lens: Tensor | None = None) -> Tensor:
    """lowbit.kernels.decode_attention.decode_attention as one operator, which writes the new
    k and v into the caches in place (declared: the compiler orders the cache's readers)."""
    return torch.ops.lowbit.decode_attention(qkv, k_cache, v_cache, positions, cos, sin_signed,
                                             qk_norm, n_heads, n_kv_heads, eps, pdl, prefix_rows,
                                             prefix_lens)


def _second_output(x: Tensor, mode: str, rac_ratio: float, silu_mul: bool, rac_fold: bool) -> bool:
    """quantize_activations gives a second tensor: fp8's scales, or RAC's residual (not folded)."""
    k = x.shape[-1] // 2 if silu_mul else x.shape[-1]
    return mode == "fp8" or (mode == "nvfp4" and not rac_fold and rac_channel_count(k, rac_ratio) > 0)


# ---- the operators --------------------------------------------------------------------------------

@torch.library.custom_op("lowbit::engine_linear", mutates_args=())
def _engine_linear(x: Tensor, data: Tensor, block_scales: Tensor | None, row_scales: Tensor | None,
                   tile_words: Tensor | None, tile_scales: Tensor | None,
                   tile_row_scales: Tensor | None, bias: Tensor | None, x2: Tensor | None,
                   norm: Tensor | None, residual: Tensor | None, storage: str, in_features: int,
                   saturates: bool, eps: float, silu_mul: bool, pdl: bool) -> Tensor:
    from lowbit.kernels import engine_linear
    weight = LinearWeight.unflatten(
        [data, block_scales, row_scales, tile_words, tile_scales, tile_row_scales],
        (storage, in_features, saturates), x.dtype)
    return engine_linear.linear(x, weight, bias, x2=x2, norm=norm, eps=eps, silu_mul=silu_mul,
                                residual=residual, pdl=pdl)


@_engine_linear.register_fake
def _(x, data, block_scales, row_scales, tile_words, tile_scales, tile_row_scales, bias, x2, norm,
      residual, storage, in_features, saturates, eps, silu_mul, pdl):
    return x.new_empty(x.shape[0], data.shape[-2])


@torch.library.custom_op("lowbit::quantize_activations", mutates_args=())
def _quantize_activations(x: Tensor, norm: Tensor | None, input_amax: Tensor | None, mode: str,
                          rac_ratio: float, eps: float, silu_mul: bool,
                          rac_group: int, rac_fold: bool) -> tuple[Tensor, Tensor]:
    from lowbit.kernels import activation_quant
    a, b = activation_quant.quantize_activations(x, mode, rac_ratio, norm=norm, eps=eps,
                                                 silu_mul=silu_mul, input_amax=input_amax,
                                                 rac_group=rac_group, rac_fold=rac_fold)
    return a, (b if b is not None else x.new_empty(0))   # an operator returns tensors only


@_quantize_activations.register_fake
def _(x, norm, input_amax, mode, rac_ratio, eps, silu_mul, rac_group, rac_fold):
    M, K = x.shape[0], x.shape[-1] // 2 if silu_mul else x.shape[-1]
    if mode == "fp8":
        return (x.new_empty(M, K, dtype=torch.float8_e4m3fn),
                x.new_empty(M, 1, dtype=torch.float32))
    second = _second_output(x, mode, rac_ratio, silu_mul, rac_fold)
    return x.new_empty(M, K), (x.new_empty(M, K) if second else x.new_empty(0))


@torch.library.custom_op("lowbit::decode_attention", mutates_args=("k_cache", "v_cache"))
def _decode_attention(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, positions: Tensor,
                      cos: Tensor, sin_signed: Tensor, qk_norm: Tensor | None, n_heads: int,
                      n_kv_heads: int, eps: float, pdl: bool, prefix_rows: Tensor | None,
                      prefix_lens: Tensor | None) -> Tensor:
    from lowbit.kernels.decode_attention import decode_attention as kernel
    return kernel(qkv, k_cache, v_cache, positions, cos, sin_signed, n_heads, n_kv_heads,
                  qk_norm=qk_norm, eps=eps, pdl=pdl, prefix_rows=prefix_rows, prefix_lens=prefix_lens)


@_decode_attention.register_fake
def _(qkv, k_cache, v_cache, positions, cos, sin_signed, qk_norm, n_heads, n_kv_heads, eps, pdl,
      prefix_rows, prefix_lens):
    return qkv.new_empty(qkv.shape[0], n_heads * k_cache.shape[-1])
