"""The quantized linear layer's three GEMMs, spelled out as one autograd.Function.

    fprop  Y  = X W^T      X (N, in)  W (out, in)   reduce over in
    dgrad  dX = dY W       dY (N, out) W (out, in)  reduce over out
    wgrad  dW = dY^T X     dY (N, out) X (N, in)    reduce over N (tokens)

Each operand is quantized along its GEMM's reduction dim as the LinearRecipe says, then the
GEMM runs on the dequantized values in the compute dtype ("emulated": the same values an FP4
tensor-core GEMM multiplies, up to accumulation order). With 2D tiles an operand used by two
GEMMs is quantized once and the second GEMM takes the transpose of that copy, so the weight
the forward pass used is bit for bit the weight the data gradient uses; with 1D blocks the
two copies differ (that is the gradient bias 2607.24953 removes).

Stochastic rounding draws from torch's default generator on the operand's device, so a
training run's RNG state (saved in its checkpoints) fixes every draw.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.formats import QuantSpec, quantize_dequantize
from lowbit.ops.compiled import autocast_operands, compilable, quant_linear_compiled
from lowbit.recipes import Gemm, LinearRecipe

__all__ = ["quant_linear", "fake_quantize", "operand", "random_hadamard", "gemm_operands"]


def fake_quantize(t: torch.Tensor, spec: QuantSpec | None) -> torch.Tensor:
    """Quantize-dequantize: the values `spec` represents, in t's dtype and shape."""
    if spec is None:
        return t
    return quantize_dequantize(t, spec)


def operand(t: torch.Tensor, spec: QuantSpec | None, reduce_dim: int) -> torch.Tensor:
    """t quantized with blocks along `reduce_dim` (0 or 1 of a 2-D tensor), in t's layout.

    Square 2D tiles are the same along either dim, so they need no transpose.
    """
    if spec is None:
        return t
    if spec.is_2d or reduce_dim == t.dim() - 1:
        return fake_quantize(t, spec)
    return fake_quantize(t.mT, spec).mT


def _shared(first: QuantSpec | None, second: QuantSpec | None) -> bool:
    """One quantized copy can serve both uses: the same square-tile spec."""
    return first is not None and first == second and first.is_2d


def random_hadamard(t: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """t (rows, N) times a block-diagonal orthonormal (diag(signs) . H16 / 4) along N, in t's
    dtype (rows, N'), N' = N padded with zero tokens to a multiple of 16 (zeros add nothing).

    Applied to both wgrad operands, it cancels in dW = (dY^T R)(X^T R)^T = dY^T X, while
    spreading outliers across each block of 16 tokens before they are quantized.

    The arithmetic is fixed, so the fused Triton kernel (lowbit.kernels.fake_quantize_triton
    with `hadamard`) does exactly the same operations: t times the signs, a fast Walsh-Hadamard
    transform in float32 (butterflies a + b, a - b at strides 1, 2, 4, 8, in that order), times
    1/4, rounded once to t's dtype. The butterflies of bf16 inputs are exact in float32 unless
    a group's values span more than about 12 binades (fp16: 9), so this is the exact product
    rounded once in practice, and the same bits wherever it is computed.
    """
    rows, n = t.shape
    pad = (-n) % 16
    if pad:
        t = F.pad(t, (0, pad))
    x = t.to(torch.float32) * signs.to(t.device, torch.float32).repeat((n + pad) // 16)
    for stride in (1, 2, 4, 8):
        y = x.reshape(rows, -1, 2, stride)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        x = torch.stack([a + b, a - b], dim=2).reshape(rows, n + pad)
    return (x * 0.25).to(t.dtype)


def _saved_operands(x, weight, r: LinearRecipe, x_f=None, w_f=None):
    """What forward keeps for backward: the quantized copy where the backward GEMM reuses it
    (2D tiles), the high-precision tensor where it must be quantized along the other dim.
    x_f / w_f: the forward's quantized copies; None: quantized here where needed (the same
    bits under round-to-nearest). x / weight None (no GEMM needs it) stays None."""
    x_saved, w_saved = x, weight
    if _shared(r.fprop_x, r.wgrad_x) and x is not None:
        x_saved = x_f if x_f is not None else operand(x, r.fprop_x, reduce_dim=1)
    if _shared(r.fprop_w, r.dgrad_w) and weight is not None:
        w_saved = w_f if w_f is not None else operand(weight, r.fprop_w, reduce_dim=1)
    return x_saved, w_saved


def _dgrad_weight(w_saved, r: LinearRecipe):
    """W for dX = dY W, blocks along out."""
    return w_saved if _shared(r.fprop_w, r.dgrad_w) else operand(w_saved, r.dgrad_w, reduce_dim=0)


def _wgrad_operands(dy, dy_d, x_saved, r: LinearRecipe):
    """(dY, X) for dW = dY^T X, each (N, features), blocks along N; with the random Hadamard
    transform, both rotated by the same random orthonormal R along N (N padded to 16k)."""
    if r.wgrad_hadamard:
        signs = torch.randint(0, 2, (16,), device=dy.device) * 2 - 1
        return _rotated_operand(dy, r.wgrad_dy, signs), _rotated_operand(x_saved, r.wgrad_x, signs)
    dy_w = dy_d if _shared(r.dgrad_dy, r.wgrad_dy) else operand(dy, r.wgrad_dy, reduce_dim=0)
    x_w = x_saved if _shared(r.fprop_x, r.wgrad_x) else operand(x_saved, r.wgrad_x, reduce_dim=0)
    return dy_w, x_w


def _rotated_operand(t: torch.Tensor, spec: QuantSpec | None, signs: torch.Tensor) -> torch.Tensor:
    """t (N, features) rotated along N by random_hadamard and quantized with blocks along N:
    (N', features). On CUDA, with 1D blocks and N a multiple of 16, one fused kernel reads t
    and writes the fake-quantized values (the same bits: the kernel does random_hadamard's
    arithmetic): for NVFP4 1x16 the row-group kernel (lowbit.kernels.hadamard), which reads
    and writes along features; elsewhere the rotation, then the quantizer."""
    from lowbit.kernels import fake_quantize_triton, use_kernels

    t_t = t.mT                                                     # (features, N), a view
    if (spec is not None and not spec.is_2d and t_t.shape[1] % 16 == 0
            and use_kernels(t_t, spec, codes=False)):
        from lowbit.kernels.hadamard import fake_quantize_rht_rows, rht_rows_supported

        if rht_rows_supported(t, spec):
            return fake_quantize_rht_rows(t, spec, signs)
        return fake_quantize_triton(t_t, spec, hadamard=signs).mT
    return operand(random_hadamard(t_t, signs), spec, reduce_dim=1).mT


def gemm_operands(x, weight, dy, r: LinearRecipe) -> dict[str, torch.Tensor]:
    """The six operands the three GEMMs multiply, computed as _QuantLinear computes them
    (for diagnostics). x (N, in), weight (out, in), dy (N, out)."""
    x_f = operand(x, r.fprop_x, reduce_dim=1)
    w_f = operand(weight, r.fprop_w, reduce_dim=1)
    x_saved, w_saved = _saved_operands(x, weight, r, x_f, w_f)
    dy_d = operand(dy, r.dgrad_dy, reduce_dim=1)
    dy_w, x_w = _wgrad_operands(dy, dy_d, x_saved, r)
    return {"fprop_x": x_f, "fprop_w": w_f, "dgrad_dy": dy_d, "dgrad_w": _dgrad_weight(w_saved, r),
            "wgrad_dy": dy_w, "wgrad_x": x_w}


def kept_operands(r: LinearRecipe, grad_x: bool, grad_w: bool) -> tuple[bool, bool]:
    """Which quantized operands a forward keeps for its backward: X's where dW will be asked
    for (grad_w) and square tiles share X between fprop and wgrad; W's where dX will be
    (grad_x) and they share W between fprop and dgrad."""
    return grad_w and _shared(r.fprop_x, r.wgrad_x), grad_x and _shared(r.fprop_w, r.dgrad_w)


def emulated_forward(x, weight, r: LinearRecipe, bias=None):
    """(Y, the quantized X, the quantized W) of the emulated fprop GEMM. x (N, in)."""
    x_f = operand(x, r.fprop_x, reduce_dim=1)                   # (N, in), blocks along in
    w_f = operand(weight, r.fprop_w, reduce_dim=1)              # (out, in), blocks along in
    return F.linear(x_f, w_f, bias), x_f, w_f                   # (N, out)


def emulated_backward(dy, x_saved, w_saved, r: LinearRecipe, need_dx: bool, need_dw: bool):
    """(dX or None, dW or None) of the emulated GEMMs, from what the forward saved
    (_saved_operands). dy: (N, out)."""
    dx = dw = None
    dy_d = operand(dy, r.dgrad_dy, reduce_dim=1)                # (N, out), blocks along out
    if need_dx:
        dx = dy_d @ _dgrad_weight(w_saved, r)                   # (N, out) @ (out, in) -> (N, in)
    if need_dw:
        dy_w, x_w = _wgrad_operands(dy, dy_d, x_saved, r)       # (N, out), (N, in)
        dw = dy_w.mT @ x_w                                      # (out, N) @ (N, in) -> (out, in)
    return dx, dw


class _QuantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: LinearRecipe):
        # x: (N, in); weight: (out, in); bias: (out,) or None
        y, x_f, w_f = emulated_forward(x, weight, recipe, bias)
        ctx.save_for_backward(*_saved_operands(x, weight, recipe, x_f, w_f))
        ctx.recipe = recipe
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x_saved, w_saved = ctx.saved_tensors
        dx, dw = emulated_backward(dy, x_saved, w_saved, ctx.recipe, *ctx.needs_input_grad[:2])
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


class _QuantLinearFP8(torch.autograd.Function):
    """The same three GEMMs on MXFP4 operands, multiplied exactly on FP8 tensor cores: each
    operand is quantized to MXFP4 and its block scales folded into E4M3 elements and
    power-of-two row factors (lowbit.kernels.fp8_gemm; on CUDA one fused Triton kernel pair,
    lowbit.kernels.fp8_fold), and torch._scaled_mm multiplies them. A 2D operand shared by two
    GEMMs gives both folded copies (rows, and transposed) from one quantization; the forward
    saves the transposed copies, 1 byte per value, for the backward, and makes them only when
    a backward will use them (`grad`: autograd is recording; forward itself runs without)."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: LinearRecipe, grad: bool, layer: str):
        from lowbit.kernels.fp8_gemm import active_fold_check, active_watch, folding_for

        # x: (N, in); weight: (out, in). X^T serves dW, W^T serves dX.
        need_x_t, need_w_t = kept_operands(recipe, grad and ctx.needs_input_grad[0],
                                           grad and ctx.needs_input_grad[1])
        # the caller's deferred fold check and chunk watch, if any; the backward (on autograd's
        # thread) uses them too
        check = ctx.fold_check = active_fold_check(x.device)
        ctx.layer, ctx.watch = layer, active_watch()
        with folding_for(layer, ctx.watch):
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
        from lowbit.kernels.fp8_gemm import folding_for

        x, weight = ctx.saved_tensors
        with folding_for(ctx.layer, ctx.watch):
            dx, dw = fp8_backward(dy, x, weight, ctx.x_w, ctx.w_d, ctx.recipe, ctx.fold_check,
                                  *ctx.needs_input_grad[:2])
        ctx.x_w = ctx.w_d = ctx.fold_check = ctx.watch = None
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None


def fp8_forward(x, weight, r: LinearRecipe, keep_x_t: bool, keep_w_t: bool, check):
    """(Y (N, out), X^T's folded operand or None, W^T's or None) on FP8 tensor cores: one
    quantization of each operand gives its fprop operand and, where kept (kept_operands), the
    transposed one for the backward. check: the deferred fold check, or None (exact folds)."""
    from lowbit.kernels.fp8_gemm import fp4_gemm_fp8, quantize_fold

    fx, fx_t = quantize_fold(x, r.fprop_x, keep_x_t, check)
    fw, fw_t = quantize_fold(weight, r.fprop_w, keep_w_t, check)
    y = fp4_gemm_fp8(fx, fw, out_dtype=x.dtype, use_fast_accum="fprop" in r.fast_accum)
    return y, fx_t, fw_t


def fp8_backward(dy, x, weight, x_w, w_d, r: LinearRecipe, check, need_dx: bool, need_dw: bool):
    """(dX or None, dW or None) on FP8 tensor cores. dy: (N, out). x_w / w_d: X^T's and W^T's
    folded operands where the forward made them (shared 2D tiles), else None and they are
    made here from x / weight (shared tiles: x^T's operand of the forward's quantization, the
    same bits under round-to-nearest; 1D blocks: quantized along the other dim). check: the
    forward's deferred fold check."""
    from lowbit.kernels.fp8_gemm import fp4_gemm_fp8, quantize_fold

    def transposed(t, forward_spec, spec):
        if _shared(forward_spec, spec):
            return quantize_fold(t, spec, True, check, rows=False)[1]
        return quantize_fold(t.mT, spec, check=check)[0]

    dx = dw = None
    shared_dy = _shared(r.dgrad_dy, r.wgrad_dy) and need_dw
    fdy, fdy_t = quantize_fold(dy, r.dgrad_dy, shared_dy, check)       # (N, out), along out
    if need_dx:
        # dX = dY W: B = W^T (in, out), blocks along out
        w_d = w_d if w_d is not None else transposed(weight, r.fprop_w, r.dgrad_w)
        dx = fp4_gemm_fp8(fdy, w_d, out_dtype=dy.dtype,                              # (N, in)
                          use_fast_accum="dgrad" in r.fast_accum)
    if need_dw:
        # dW = dY^T X: A = dY^T (out, N), B = X^T (in, N), both blocked along N
        dy_w = fdy_t if fdy_t is not None else quantize_fold(dy.mT, r.wgrad_dy, check=check)[0]
        x_w = x_w if x_w is not None else transposed(x, r.fprop_x, r.wgrad_x)
        dw = fp4_gemm_fp8(dy_w, x_w, out_dtype=dy.dtype,                            # (out, in)
                          use_fast_accum="wgrad" in r.fast_accum)
    return dx, dw


def quant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 recipe: LinearRecipe | None, layer: str = "") -> torch.Tensor:
    """y = x @ weight.T + bias with the recipe's quantized GEMMs; x (..., in) -> (..., out).

    layer: the name watch_chunked_folds() reports when an exact FP8 fold of this layer needs
    K-chunks (under --fold-inexact adapt lowbit.train names each QuantLinear by its module
    name); "" is never reported.

    recipe None is exactly F.linear. Under autocast the operands are cast to the autocast
    dtype first (the Function itself runs with autocast off, so its GEMMs see exactly the
    values it quantized). Under torch.compile the layer is two custom ops, its forward and its
    backward (lowbit.ops.compiled), which the compiler keeps in one graph and fuses around; a
    recipe whose forward operands round stochastically runs eagerly instead, a graph break.
    """
    if recipe is None or not recipe.is_quantized:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling() and compilable(recipe):
        return quant_linear_compiled(x, weight, bias, recipe, layer)
    return _quant_linear(x, weight, bias, recipe, layer)


@torch.compiler.disable
def _quant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  recipe: LinearRecipe, layer: str) -> torch.Tensor:
    x, weight, bias = autocast_operands(x, weight, bias)
    lead = x.shape[:-1]
    args = (x.reshape(-1, x.shape[-1]), weight, bias, recipe)
    with torch.autocast(x.device.type, enabled=False):
        if recipe.gemm is Gemm.FP8:
            y = _QuantLinearFP8.apply(*args, torch.is_grad_enabled(), layer)
        else:
            y = _QuantLinear.apply(*args)
    return y.reshape(*lead, weight.shape[0])
