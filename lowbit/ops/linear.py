"""The quantized linear layer's three GEMMs as autograd.Functions, and `quant_linear`.

    fprop  Y  = X W^T      X (N, in)  W (out, in)   reduce over in
    dgrad  dX = dY W       dY (N, out) W (out, in)  reduce over out
    wgrad  dW = dY^T X     dY (N, out) X (N, in)    reduce over N (tokens)

`QuantLinearFunction` runs an emulated recipe's GEMMs, `QuantLinearFP8Function` an FP8
recipe's; what each operand is and which quantized copies the forward keeps are
lowbit.ops.gemms' rules, which the torch.compile custom ops (lowbit.ops.compiled) follow too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.dispatch.fold_check import (active_fold_check, active_observer, active_watch,
                                        folding_for)
from lowbit.ops.compiled import quant_linear_compiled
from lowbit.ops.gemms import (WeightOperandCache, autocast_operands, compilable,
                              emulated_backward, emulated_forward, fp8_backward, fp8_forward,
                              kept_operands, saved_operands, weight_only_linear)
from lowbit.recipes import Gemm, LinearRecipe

__all__ = ["quant_linear", "QuantLinearFunction", "QuantLinearFP8Function"]


class QuantLinearFunction(torch.autograd.Function):
    """The three GEMMs of an emulated recipe: each operand quantize-dequantized along its
    reduction dim, multiplied in the compute dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: LinearRecipe, w_f=None):
        # x: (N, in); weight: (out, in); bias: (out,) or None; w_f: the quantized weight, if
        # held already (lowbit.ops.gemms.WeightOperandCache)
        y, x_f, w_f = emulated_forward(x, weight, recipe, bias, w_f)
        ctx.save_for_backward(*saved_operands(x, weight, recipe, x_f, w_f))
        ctx.recipe = recipe
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x_saved, w_saved = ctx.saved_tensors
        dx, dw = emulated_backward(dy, x_saved, w_saved, ctx.recipe, *ctx.needs_input_grad[:2])
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None


class QuantLinearFP8Function(torch.autograd.Function):
    """The same three GEMMs on MXFP4 operands, multiplied exactly on FP8 tensor cores: each
    operand is quantized to MXFP4 and its block scales folded into E4M3 elements and
    power-of-two row factors (lowbit.formats.fold; on CUDA one fused Triton kernel pair,
    lowbit.kernels.fp8_fold), and torch._scaled_mm multiplies them. A 2D operand shared by two
    GEMMs gives both folded copies (rows, and transposed) from one quantization; the forward
    saves the transposed copies, 1 byte per value, for the backward, and makes them only when
    a backward will use them (`grad`: autograd is recording; forward itself runs without)."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: LinearRecipe, grad: bool, layer: str):
        # x: (N, in); weight: (out, in). X^T serves dW, W^T serves dX.
        need_x_t, need_w_t = kept_operands(recipe, grad and ctx.needs_input_grad[0],
                                           grad and ctx.needs_input_grad[1])
        # the caller's deferred fold check, chunk watch and fold observer, if any; the backward
        # (on autograd's thread) uses them too
        check = ctx.fold_check = active_fold_check(x.device)
        ctx.layer, ctx.watch, ctx.observer = layer, active_watch(), active_observer()
        with folding_for(layer, ctx.watch, ctx.observer):
            y, fx_t, fw_t = fp8_forward(x, weight, recipe, need_x_t, need_w_t, check)
        if bias is not None:
            y = y + bias
        # FoldedOperands are not tensors, so they ride on ctx; the inputs are saved only where
        # the backward GEMM needs them quantized along the other dim (1D blocks).
        ctx.x_w, ctx.w_d = fx_t, fw_t
        ctx.save_for_backward(x if fx_t is None else None, weight if fw_t is None else None)
        ctx.recipe, ctx.has_bias = recipe, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        with folding_for(ctx.layer, ctx.watch, ctx.observer):
            dx, dw = fp8_backward(dy, x, weight, ctx.x_w, ctx.w_d, ctx.recipe, ctx.fold_check,
                                  *ctx.needs_input_grad[:2])
        ctx.x_w = ctx.w_d = ctx.fold_check = ctx.watch = ctx.observer = None
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None


def quant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 recipe: LinearRecipe | None, layer: str = "",
                 cache: WeightOperandCache | None = None,
                 weight_operand: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias with the recipe's quantized GEMMs; x (..., in) -> (..., out).

    layer: the name watch_chunked_folds() reports when an exact FP8 fold of this layer needs
    K-chunks (under --fold-inexact adapt lowbit.train names each QuantLinear by its module
    name); "" is never reported. A fold observer (observe_folds) is told it with every fold
    of this layer, its forward's and its backward's.

    recipe None is exactly F.linear. Under autocast the operands are cast to the autocast
    dtype first (the Function itself runs with autocast off, so its GEMMs see exactly the
    values it quantized). Under torch.compile the layer is two custom ops, its forward and its
    backward (lowbit.ops.compiled), which the compiler keeps in one graph and fuses around; a
    recipe whose forward operands round stochastically runs eagerly instead, a graph break.

    cache: where an emulated recipe's round-to-nearest forward weight is kept while `weight`
    is unchanged (lowbit.ops.gemms.WeightOperandCache); eager only, the same values.
    weight_operand: a weight-only recipe's quantized forward weight (LinearRecipe.weight_only:
    QUADS' asymmetric QAT) handed in by the caller, in the dtype the GEMM runs in (lowbit.nn.
    reuse_weight_operands takes it from the cache as the model's forward begins): the layer is
    then lowbit.ops.gemms.weight_only_linear, eagerly and under torch.compile (which cannot run
    the cache's Python), plain operations it traces. Other recipes ignore it.
    """
    if recipe is None or not recipe.is_quantized:
        return F.linear(x, weight, bias)
    if weight_operand is not None and recipe.weight_only:
        y = weight_only_linear(x, weight, bias, weight_operand)
        if y is not None:
            return y
    if torch.compiler.is_compiling() and compilable(recipe):
        return quant_linear_compiled(x, weight, bias, recipe, layer)
    return _quant_linear(x, weight, bias, recipe, layer, cache)


@torch.compiler.disable
def _quant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  recipe: LinearRecipe, layer: str, cache: WeightOperandCache | None) -> torch.Tensor:
    master = weight
    x, weight, bias = autocast_operands(x, weight, bias)
    lead = x.shape[:-1]
    args = (x.reshape(-1, x.shape[-1]), weight, bias, recipe)
    with torch.autocast(x.device.type, enabled=False):
        if recipe.gemm is Gemm.FP8:
            y = QuantLinearFP8Function.apply(*args, torch.is_grad_enabled(), layer)
        else:
            w_f = None if cache is None else cache.forward_weight(master, weight.dtype, recipe.fprop_w)
            y = QuantLinearFunction.apply(*args, w_f)
    return y.reshape(*lead, weight.shape[0])
