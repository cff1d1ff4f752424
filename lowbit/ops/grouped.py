"""Every expert's quantized GEMMs at once: the MoE counterpart of lowbit.ops.linear's emulated
Function, on grouped GEMMs (torch._grouped_mm).

    y = grouped_quant_linear(x, weight, ends, recipe)   # x (P, in) in the experts' layout, ends (E,)

The per-expert reference (lowbit.nn.QuantExperts' `_expert_linear`) quantizes each expert's
operands on their own: its rows of X and dY, and its own weight matrix. Here every operand is
quantized in one call where that is the same bit for bit, and the weights expert by expert
where it is not:
- the weight (E, out, in) quantized as one stacked tensor equals each expert's matrix
  quantized alone (tiles and blocks lie within a matrix) when no tensor scale spans the stack;
  a tensor-scaled weight format (NVFP4) takes one tensor scale per expert's rows of the
  stack (E * out, in), in one call, where no block or tile spans two experts, else expert by
  expert (E calls; no host read-back either way: the shapes are the weight's);
- the routed rows come laid out with each expert's rows starting at a multiple of `row_tile`
  (the largest block or tile any X or dY operand has along the tokens), zero rows between
  (lowbit.models.moe.ExpertRows, made once per MoE layer for both projections), so no block or
  tile holds two experts' rows, and a partial tile's zero rows quantize as the per-expert
  tensor's edge does.
- an operand that spans tokens (X, dY) under an FP32 tensor scale (NVFP4) takes one scale per
  expert's segment of rows (lowbit.formats.quantize.segment_tensor_scales: each segment's
  amax by one segmented reduction on the device), as quantizing each expert's rows alone does; and the
  random Hadamard transform of the wgrad operands rotates 16-row blocks, which lie within a
  segment, so each segment's rotated rows, under their own tensor scale, are the expert's own.
So every emulated recipe groups (`groups_exactly`): the MX family (mxfp4, stable-fp4 and its
variants), nvfp4 and the stable-nvfp4 variants, and weight-only recipes of any format (QUADS'
asymmetric QAT: NVFP4 weights in the forward, high-precision activations). A rounding that
draws random numbers (stochastic rounding of dY) draws them in the grouped layout's order, and
the Hadamard transform's 16 random signs are drawn once for the layer where the loop draws
them expert by expert: the same distributions as the per-expert path, not the same draws.
On CUDA one kernel takes the rows' (or the rotated 16-row groups') maxima, two more each
segment's maximum and each row's scale (lowbit.kernels.segment_scales_triton, every block of
rows in parallel), and the scales go to the fused fake-quantize kernel
(one per row, or per column for the operands transposed), which rotates in registers (no
host read-back either way). The three GEMMs:

    fprop  Y  = X W_e^T      one grouped GEMM, 2D x 3D
    dgrad  dX = dY W_e       one grouped GEMM, 2D x 3D
    wgrad  dW_e = dY_e^T X_e one grouped GEMM, 2D x 2D, the groups along the tokens

The group ends stay on the device (no host read-back) and the layout has a fixed size, so
nothing in the layer waits on the host;
under torch.compile it runs eagerly (a graph break), as lowbit.ops.linear's stochastically
rounding recipes do.

FP8 recipes (stable-fp4-fp8: MXFP4 operands folded into E4M3, lowbit.formats.fold) group the
same way, on one grouped FP8 GEMM per pass (lowbit.kernels.fp8_gemm.grouped_fp4_gemm_fp8,
torch._scaled_grouped_mm on CUDA): X and dY folded in the experts' layout, the stacked weight
(E * out, in) folded as one tensor for fprop, which equals each expert's own quantization when
the weight's square tiles lie within an expert (out and in multiples of the tile side). For
dgrad, square tiles (stable-fp4-fp8) give W^T's operand from the forward's quantization of W:
the fold kernels write it beside W's, the experts' transposes side by side (in, E * out) with
one factor per row and expert, and the forward keeps it (one byte a weight) in place of the
weight it would save (under autocast, its bf16 copy), so the backward neither transposes nor
folds the weight again; 1D blocks fold the experts' transposes stacked, (E * in, out), quantized
along out, from the saved weight. Where square tiles give the weight-gradient
operands dY^T and X^T (tokens along K) from the same quantization as dY and X (stable-fp4-fp8),
the fused kernels fold them with one factor per row and expert (`segment_ends`), as each
expert's own fold: a row spans only its expert's tokens' binades, and a NaN block makes only
its own expert's dW row NaN, as on the per-expert path. Recipes with 1D blocks along the tokens
(mxfp4 on FP8 GEMMs) fold those operands with one factor per row over every expert's tokens:
more of their steps fold inexactly (and are redone), and on the grouped CUDA GEMM a NaN token
makes its dW rows NaN in every expert. The values multiplied are the per-expert path's; a
row's fold factor, and so the GEMM's rounding, may differ.
"""

from __future__ import annotations

import math

import torch

from lowbit.dispatch.fold_check import active_fold_check, active_observer, active_watch, folding_for
from lowbit.kernels.fp8_gemm import grouped_fp4_gemm_fp8
from lowbit.ops.gemms import (WeightOperandCache, autocast_operands, fold_for_gemm, fold_transposed,
                              kept_operands, operand, shared, wgrad_operands)
from lowbit.recipes import Gemm, LinearRecipe

__all__ = ["grouped_quant_linear", "groups_exactly", "row_tile"]


def groups_exactly(r: LinearRecipe, weight_shape: tuple[int, ...] | None = None) -> bool:
    """The recipe's GEMMs on stacked experts (weight (E, out, in)) equal its per-expert GEMMs
    in every quantized operand (see the module doc): emulated GEMMs always (a tensor scale on
    X or dY is taken per expert's segment, the Hadamard rotation segment by segment); FP8 GEMMs
    (MXFP4 operands: no tensor scale, no rotation) where the weight's square tiles lie within
    an expert and the grouped FP8 GEMM's 16-byte strides hold (weight_shape given, out and in
    multiples of the tile side and of 16)."""
    if r.gemm is Gemm.EMULATED:
        return True
    if weight_shape is None:
        return False
    sides = [16] + [s.block[0] for s in (r.fprop_w, r.dgrad_w) if s is not None and s.is_2d]
    return all(width % side == 0 for width in weight_shape[-2:] for side in sides)


def _weights(weight: torch.Tensor, spec, reduce_dim: int) -> torch.Tensor:
    """The stacked experts' weight (E, out, in) quantized as each expert's alone: in one call;
    with a tensor scale (one per expert), as one (E * out, in) matrix whose experts' rows are
    segments (`operand`'s segment_ends) where no block or tile spans two experts (blocks along
    in, or out a multiple of the block's side along it), else expert by expert."""
    if spec is None or not spec.tensor_scale:
        return operand(weight, spec, reduce_dim)
    experts, out_features, in_features = weight.shape
    side = spec.block[0] if spec.is_2d else (spec.block[1] if reduce_dim == 1 else 1)
    if out_features % side:
        return torch.stack([operand(w, spec, reduce_dim - 1) for w in weight])
    ends = _expert_ends(experts, out_features, weight.device)
    flat = weight.reshape(experts * out_features, in_features)
    return operand(flat, spec, reduce_dim - 1, ends).reshape(weight.shape)


def row_tile(r: LinearRecipe) -> int:
    """Rows an expert's segment is padded to a multiple of: every block or tile side of the
    operands that span tokens (X and dY, either GEMM), and 16 where the wgrad operands are
    rotated (the Hadamard transform's 16-row blocks), so none spans two experts."""
    sides = [max(s.block) for s in (r.fprop_x, r.dgrad_dy, r.wgrad_dy, r.wgrad_x) if s is not None]
    return math.lcm(*sides, *([16] if r.wgrad_hadamard else []), 1)


class GroupedQuantLinearFunction(torch.autograd.Function):
    """The three emulated GEMMs of every expert (see the module doc)."""

    @staticmethod
    def forward(ctx, x, weight, ends, recipe: LinearRecipe, w_f=None):
        # x: (P, in) in the experts' layout; weight: (E, out, in); ends: (E,) int32 group ends;
        # w_f: the quantized weight, if held already (lowbit.ops.gemms.WeightOperandCache)
        x_f = operand(x, recipe.fprop_x, 1, ends)                         # blocks along in
        if w_f is None:
            w_f = _weights(weight, recipe.fprop_w, reduce_dim=2)         # blocks along in
        y = torch._grouped_mm(x_f, w_f.transpose(-2, -1), offs=ends)
        # what the backward reuses: the quantized copies where 2D tiles share them
        x_saved = x_f if shared(recipe.fprop_x, recipe.wgrad_x) else x
        w_saved = w_f if shared(recipe.fprop_w, recipe.dgrad_w) else weight
        ctx.save_for_backward(x_saved, w_saved, ends)
        ctx.recipe = recipe
        return y

    @staticmethod
    def backward(ctx, dy):
        x_saved, w_saved, ends = ctx.saved_tensors
        r = ctx.recipe
        dx = dw = None
        dy_d = operand(dy, r.dgrad_dy, 1, ends)                           # blocks along out
        if ctx.needs_input_grad[0]:
            w_d = w_saved if shared(r.fprop_w, r.dgrad_w) else _weights(w_saved, r.dgrad_w, reduce_dim=1)
            dx = torch._grouped_mm(dy_d, w_d, offs=ends)
        if ctx.needs_input_grad[1]:
            dy_w, x_w = wgrad_operands(dy, dy_d, x_saved, r, ends)        # blocks along the tokens
            dw = torch._grouped_mm(dy_w.mT, x_w, offs=ends)               # (E, out, in)
        return dx, dw, None, None, None


class GroupedQuantLinearFP8Function(torch.autograd.Function):
    """The three GEMMs of every expert on FP8 tensor cores (see the module doc), as
    lowbit.ops.linear.QuantLinearFP8Function runs one layer's: the same deferred fold check,
    watch and observer (the folds are the layer's, named `layer`), X^T's and W^T's folded copies
    kept from the forward where square tiles share them and a backward will use them."""

    @staticmethod
    def forward(ctx, x, weight, ends, recipe: LinearRecipe, grad: bool, layer: str = ""):
        # x: (P, in) in the experts' layout; weight: (E, out, in); ends: (E,) int32 group ends;
        # layer: the name its folds are watched and observed under ("": unnamed)
        experts, out_features, in_features = weight.shape
        keep_x_t, keep_w_t = kept_operands(recipe, grad and ctx.needs_input_grad[0],
                                           grad and ctx.needs_input_grad[1])
        check = ctx.fold_check = active_fold_check(x.device)
        ctx.watch, ctx.observer = active_watch(), active_observer()
        ctx.layer = layer
        with folding_for(layer, ctx.watch, ctx.observer):
            fx, fx_t = fold_for_gemm("X", x, recipe.fprop_x, keep_x_t, check, segment_ends=ends)
            # blocks along in; where square tiles share it with dgrad, also W^T's operand
            # (in, E * out): the experts' transposes side by side, one factor per row and expert
            fw, fw_t = fold_for_gemm("W", weight.reshape(experts * out_features, in_features),
                                     recipe.fprop_w, keep_w_t, check,
                                     segment_ends=_expert_ends(experts, out_features, x.device)
                                     if keep_w_t else None)
            y = grouped_fp4_gemm_fp8(fx, fw, ends, "rows", out_dtype=x.dtype,
                                     use_fast_accum="fprop" in recipe.fast_accum)
        ctx.x_w, ctx.w_d = fx_t, fw_t
        ctx.weight_shape = weight.shape
        ctx.save_for_backward(x if fx_t is None else None, weight if fw_t is None else None, ends)
        ctx.recipe = recipe
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, ends = ctx.saved_tensors
        r, check = ctx.recipe, ctx.fold_check
        need_dx, need_dw = ctx.needs_input_grad[:2]
        experts, out_features, in_features = ctx.weight_shape
        dx = dw = None
        with folding_for(ctx.layer, ctx.watch, ctx.observer):
            fdy, fdy_t = fold_for_gemm("dY", dy, r.dgrad_dy, shared(r.dgrad_dy, r.wgrad_dy) and need_dw,
                                       check, segment_ends=ends)                # blocks along out
            if need_dx and ctx.w_d is not None:
                # dX = dY W_e: B_e = W_e^T (in, out), side by side in the forward's W^T operand
                dx = grouped_fp4_gemm_fp8(fdy, ctx.w_d, ends, "rows", out_dtype=dy.dtype,
                                          use_fast_accum="dgrad" in r.fast_accum, b_layout="side_by_side")
            elif need_dx:
                # 1D blocks: W_e^T (in, out) stacked, quantized along out
                w_t = weight.transpose(1, 2).reshape(experts * in_features, out_features)
                fw_d, _ = fold_for_gemm("W", w_t, r.dgrad_w, check=check)
                dx = grouped_fp4_gemm_fp8(fdy, fw_d, ends, "rows", out_dtype=dy.dtype,
                                          use_fast_accum="dgrad" in r.fast_accum)
            if need_dw:
                # dW_e = dY_e^T X_e: A = dY^T (out, P), B = X^T (in, P), blocked along the tokens
                dy_w = fdy_t if fdy_t is not None else fold_for_gemm("dY", dy.mT, r.wgrad_dy, check=check)[0]
                x_w = ctx.x_w if ctx.x_w is not None else fold_transposed(
                    "X", x, r.fprop_x, r.wgrad_x, check, ends)
                dw = grouped_fp4_gemm_fp8(dy_w, x_w, ends, "k", out_dtype=dy.dtype,
                                          use_fast_accum="wgrad" in r.fast_accum)
        ctx.x_w = ctx.w_d = ctx.fold_check = ctx.watch = ctx.observer = None
        return dx, dw, None, None, None, None


def _expert_ends(experts: int, rows: int, device: torch.device) -> torch.Tensor:
    """(E,) int32 ends of the stacked weight's experts along its rows: rows, 2 rows, ..."""
    return torch.arange(1, experts + 1, dtype=torch.int32, device=device) * rows


@torch.compiler.disable   # eager under torch.compile, as a stochastically rounding quant_linear
def grouped_quant_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor,
                         recipe: LinearRecipe, cache: WeightOperandCache | None = None,
                         layer: str = "") -> torch.Tensor:
    """Every expert's y_e = x_e @ weight[e]^T with the recipe's quantized GEMMs: x (P, in) in
    the experts' layout (lowbit.models.moe.ExpertRows: expert e's rows from ends[e - 1] to
    ends[e], each group starting at a multiple of `row_tile(recipe)`; ends (E,) int32 on the
    device), weight (E, out, in) -> (P, out). Rows that hold no token (a group's padding, the
    rows past ends[-1]) must be zeros, in x and in the gradient that comes back; the output's
    rows past ends[-1], and dX's in the backward, are left unwritten. The recipe must group exactly (`groups_exactly`);
    under autocast the operands are cast to its dtype first, as quant_linear casts them.
    torch._grouped_mm takes bf16 with in and out multiples of 8. cache: where an emulated
    recipe's round-to-nearest forward weight is kept while `weight` is unchanged
    (lowbit.ops.gemms.WeightOperandCache; the same values); FP8 recipes fold their weights
    afresh, as quant_linear's do."""
    if not groups_exactly(recipe, tuple(weight.shape)):
        raise ValueError(f"recipe {recipe.describe()} does not group exactly on a {tuple(weight.shape)} "
                         "weight (FP8 GEMMs whose weight tiles straddle two experts, or widths "
                         "not a multiple of 16): run its experts one by one")
    master = weight
    x, weight, _ = autocast_operands(x, weight, None)
    if recipe.gemm is Gemm.FP8:
        with torch.autocast(x.device.type, enabled=False):
            return GroupedQuantLinearFP8Function.apply(x, weight, ends, recipe, torch.is_grad_enabled(),
                                                       layer)
    w_f = None if cache is None else cache.get(
        master, weight.dtype, recipe.fprop_w,
        lambda: _weights(weight.detach(), recipe.fprop_w, reduce_dim=2))
    with torch.autocast(x.device.type, enabled=False):
        return GroupedQuantLinearFunction.apply(x, weight, ends, recipe, w_f)
