"""The GEMM rules of a quantized linear layer, shared by the eager autograd.Functions
(lowbit.ops.linear) and the torch.compile custom ops (lowbit.ops.compiled).

    fprop  Y  = X W^T      X (N, in)  W (out, in)   reduce over in
    dgrad  dX = dY W       dY (N, out) W (out, in)  reduce over out
    wgrad  dW = dY^T X     dY (N, out) X (N, in)    reduce over N (tokens)

Each operand is quantized along its GEMM's reduction dim as the LinearRecipe says. Emulated
recipes then multiply the dequantized values in the compute dtype (the same values an FP4
tensor-core GEMM multiplies, up to accumulation order); FP8 recipes fold MXFP4 operands into
E4M3 and multiply them exactly on FP8 tensor cores (lowbit.kernels.fp8_gemm). With 2D tiles
an operand used by two GEMMs is quantized once and the second GEMM takes the transpose of that
copy, so the weight the forward pass used is bit for bit the weight the data gradient uses;
with 1D blocks the two copies differ (that is the gradient bias arXiv 2607.24953 removes).
Which copies a forward keeps for its backward is decided here too (`saved_operands`,
`kept_operands`), so both paths keep the same ones.

Stochastic rounding draws from torch's default generator on the operand's device (Philox
seeds drawn from it on CUDA), so a training run's RNG state, saved in its checkpoints, fixes
every draw.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit import dispatch
from lowbit.dispatch.fold_check import folding_operand
from lowbit.formats import QuantSpec
from lowbit.formats.spec import Rounding
from lowbit.kernels.fp8_gemm import fp4_gemm_fp8
from lowbit.recipes import LinearRecipe

__all__ = ["fake_quantize", "operand", "shared", "saved_operands", "dgrad_weight",
           "wgrad_operands", "gemm_operands", "kept_operands", "emulated_forward",
           "emulated_backward", "fp8_forward", "fp8_backward", "compilable", "autocast_operands",
           "WeightOperandCache", "fold_for_gemm", "fold_transposed", "weight_only_linear"]


def fake_quantize(t: torch.Tensor, spec: QuantSpec | None) -> torch.Tensor:
    """Quantize-dequantize: the values `spec` represents, in t's dtype and shape."""
    if spec is None:
        return t
    return dispatch.quantize_dequantize(t, spec)


def operand(t: torch.Tensor, spec: QuantSpec | None, reduce_dim: int,
            segment_ends: torch.Tensor | None = None) -> torch.Tensor:
    """t quantized with blocks along `reduce_dim` (0 or 1 of a 2-D tensor), in t's layout.

    Square 2D tiles are the same along either dim, so they need no transpose. segment_ends:
    t's rows (tokens) lie in segments, an MoE layer's experts' groups (lowbit.ops.grouped),
    and a tensor-scaled spec (NVFP4) gives each segment its own tensor scale, as quantizing
    each expert's rows alone does (lowbit.formats.quantize.segment_tensor_scales).
    """
    if spec is None:
        return t
    scales = None
    if segment_ends is not None and spec.tensor_scale:
        scales = dispatch.segment_tensor_scales(t, segment_ends, spec)   # (rows, 1)
    if spec.is_2d or reduce_dim == t.dim() - 1:
        return dispatch.quantize_dequantize(t, spec, tensor_scale=scales)
    return dispatch.quantize_dequantize(t.mT, spec, tensor_scale=None if scales is None else scales.mT).mT


def shared(first: QuantSpec | None, second: QuantSpec | None) -> bool:
    """One quantized copy can serve both uses: the same square-tile spec."""
    return first is not None and first == second and first.is_2d


def saved_operands(x, weight, r: LinearRecipe, x_f=None, w_f=None):
    """What forward keeps for backward: the quantized copy where the backward GEMM reuses it
    (2D tiles), the high-precision tensor where it must be quantized along the other dim.
    x_f / w_f: the forward's quantized copies; None: quantized here where needed (the same
    bits under round-to-nearest). x / weight None (no GEMM needs it) stays None."""
    x_saved, w_saved = x, weight
    if shared(r.fprop_x, r.wgrad_x) and x is not None:
        x_saved = x_f if x_f is not None else operand(x, r.fprop_x, reduce_dim=1)
    if shared(r.fprop_w, r.dgrad_w) and weight is not None:
        w_saved = w_f if w_f is not None else operand(weight, r.fprop_w, reduce_dim=1)
    return x_saved, w_saved


def dgrad_weight(w_saved, r: LinearRecipe):
    """W for dX = dY W, blocks along out."""
    return w_saved if shared(r.fprop_w, r.dgrad_w) else operand(w_saved, r.dgrad_w, reduce_dim=0)


def wgrad_operands(dy, dy_d, x_saved, r: LinearRecipe, segment_ends: torch.Tensor | None = None):
    """(dY, X) for dW = dY^T X, each (N, features), blocks along N; with the random Hadamard
    transform, both rotated by the same random orthonormal R along N (N padded to 16k).
    segment_ends: `operand`'s (an MoE layer's experts; one draw of R for all of them)."""
    if r.wgrad_hadamard:
        # float32, as the kernels and the reference read them (not cast again at each use)
        signs = torch.randint(0, 2, (16,), device=dy.device, dtype=torch.float32).mul_(2).sub_(1)
        return (dispatch.rotated_fake_quantize(dy, r.wgrad_dy, signs, segment_ends),
                dispatch.rotated_fake_quantize(x_saved, r.wgrad_x, signs, segment_ends))
    dy_w = dy_d if shared(r.dgrad_dy, r.wgrad_dy) else operand(dy, r.wgrad_dy, 0, segment_ends)
    x_w = x_saved if shared(r.fprop_x, r.wgrad_x) else operand(x_saved, r.wgrad_x, 0, segment_ends)
    return dy_w, x_w


def gemm_operands(x, weight, dy, r: LinearRecipe) -> dict[str, torch.Tensor]:
    """The six operands the three emulated GEMMs multiply, computed as the layer computes them
    (for diagnostics). x (N, in), weight (out, in), dy (N, out)."""
    x_f = operand(x, r.fprop_x, reduce_dim=1)
    w_f = operand(weight, r.fprop_w, reduce_dim=1)
    x_saved, w_saved = saved_operands(x, weight, r, x_f, w_f)
    dy_d = operand(dy, r.dgrad_dy, reduce_dim=1)
    dy_w, x_w = wgrad_operands(dy, dy_d, x_saved, r)
    return {"fprop_x": x_f, "fprop_w": w_f, "dgrad_dy": dy_d, "dgrad_w": dgrad_weight(w_saved, r),
            "wgrad_dy": dy_w, "wgrad_x": x_w}


def kept_operands(r: LinearRecipe, grad_x: bool, grad_w: bool) -> tuple[bool, bool]:
    """Which quantized operands a forward keeps for its backward: X's where dW will be asked
    for (grad_w) and square tiles share X between fprop and wgrad; W's where dX will be
    (grad_x) and they share W between fprop and dgrad."""
    return grad_w and shared(r.fprop_x, r.wgrad_x), grad_x and shared(r.fprop_w, r.dgrad_w)


def emulated_forward(x, weight, r: LinearRecipe, bias=None, w_f=None):
    """(Y, the quantized X, the quantized W) of the emulated fprop GEMM. x (N, in); w_f: the
    quantized W where the caller holds it already (WeightOperandCache)."""
    x_f = operand(x, r.fprop_x, reduce_dim=1)                   # (N, in), blocks along in
    if w_f is None:
        w_f = operand(weight, r.fprop_w, reduce_dim=1)          # (out, in), blocks along in
    return F.linear(x_f, w_f, bias), x_f, w_f                   # (N, out)


def emulated_backward(dy, x_saved, w_saved, r: LinearRecipe, need_dx: bool, need_dw: bool):
    """(dX or None, dW or None) of the emulated GEMMs, from what the forward saved
    (saved_operands). dy: (N, out)."""
    dx = dw = None
    dy_d = operand(dy, r.dgrad_dy, reduce_dim=1)                # (N, out), blocks along out
    if need_dx:
        dx = dy_d @ dgrad_weight(w_saved, r)                    # (N, out) @ (out, in) -> (N, in)
    if need_dw:
        dy_w, x_w = wgrad_operands(dy, dy_d, x_saved, r)        # (N, out), (N, in)
        dw = dy_w.mT @ x_w                                      # (out, N) @ (N, in) -> (out, in)
    return dx, dw


def fold_for_gemm(operand: str, t, spec, transpose_too: bool = False, check=None, rows: bool = True,
                  segment_ends=None):
    """dispatch.quantize_fold of one of the layer's operands, named by its role ("X", "W" or
    "dY") for the fold observer in force (lowbit.dispatch.fold_check.observe_folds).
    segment_ends: t's rows are grouped (a grouped GEMM's tokens): t^T's factors per group."""
    with folding_operand(operand):
        if rows and segment_ends is None:
            return dispatch.quantize_fold(t, spec, transpose_too, check)
        return dispatch.quantize_fold(t, spec, transpose_too, check, rows=rows,
                                      segment_ends=segment_ends if transpose_too else None)


def fold_transposed(operand: str, t, forward_spec, spec, check, segment_ends=None):
    """The folded operand of t^T blocked along t's rows, for a backward GEMM: from t's own
    quantization where square tiles share it (forward_spec == spec; the same bits as the
    forward's copy under round-to-nearest; segment_ends: factors per group of t's rows, as
    fold_for_gemm's), else t^T quantized with `spec`."""
    if shared(forward_spec, spec):
        return fold_for_gemm(operand, t, spec, True, check, rows=False, segment_ends=segment_ends)[1]
    return fold_for_gemm(operand, t.mT, spec, check=check)[0]


def fp8_forward(x, weight, r: LinearRecipe, keep_x_t: bool, keep_w_t: bool, check):
    """(Y (N, out), X^T's folded operand or None, W^T's or None) on FP8 tensor cores: one
    quantization of each operand gives its fprop operand and, where kept (kept_operands), the
    transposed one for the backward. check: the deferred fold check, or None (exact folds)."""
    fx, fx_t = fold_for_gemm("X", x, r.fprop_x, keep_x_t, check)
    fw, fw_t = fold_for_gemm("W", weight, r.fprop_w, keep_w_t, check)
    y = fp4_gemm_fp8(fx, fw, out_dtype=x.dtype, use_fast_accum="fprop" in r.fast_accum)
    return y, fx_t, fw_t


def fp8_backward(dy, x, weight, x_w, w_d, r: LinearRecipe, check, need_dx: bool, need_dw: bool):
    """(dX or None, dW or None) on FP8 tensor cores. dy: (N, out). x_w / w_d: X^T's and W^T's
    folded operands where the forward made them (shared 2D tiles), else None and they are
    made here from x / weight (shared tiles: x^T's operand of the forward's quantization, the
    same bits under round-to-nearest; 1D blocks: quantized along the other dim). check: the
    forward's deferred fold check."""
    dx = dw = None
    shared_dy = shared(r.dgrad_dy, r.wgrad_dy) and need_dw
    fdy, fdy_t = fold_for_gemm("dY", dy, r.dgrad_dy, shared_dy, check)     # (N, out), along out
    if need_dx:
        # dX = dY W: B = W^T (in, out), blocks along out
        w_d = w_d if w_d is not None else fold_transposed("W", weight, r.fprop_w, r.dgrad_w, check)
        dx = fp4_gemm_fp8(fdy, w_d, out_dtype=dy.dtype,                              # (N, in)
                          use_fast_accum="dgrad" in r.fast_accum)
    if need_dw:
        # dW = dY^T X: A = dY^T (out, N), B = X^T (in, N), both blocked along N
        dy_w = fdy_t if fdy_t is not None else fold_for_gemm("dY", dy.mT, r.wgrad_dy, check=check)[0]
        x_w = x_w if x_w is not None else fold_transposed("X", x, r.fprop_x, r.wgrad_x, check)
        dw = fp4_gemm_fp8(dy_w, x_w, out_dtype=dy.dtype,                            # (out, in)
                          use_fast_accum="wgrad" in r.fast_accum)
    return dx, dw


def compilable(r: LinearRecipe) -> bool:
    """The recipe's forward operands round to nearest. A forward that rounds stochastically
    stays in the eager Function (a graph break), so that it draws its random numbers in eager's
    order, not in whatever order the compiled graph runs the ops."""
    return all(s is None or s.rounding is Rounding.RNE for s in (r.fprop_x, r.fprop_w))


def autocast_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """(x, weight, bias) cast to the autocast dtype when autocast is on, as it would cast a
    linear's inputs; the quantized GEMMs then run with it off and see exactly these values."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    return x, weight, bias


def weight_only_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       w_f: torch.Tensor) -> torch.Tensor | None:
    """A weight-only recipe's layer (LinearRecipe.weight_only: QUADS' asymmetric QAT) on its
    quantized forward weight `w_f`, held by the caller (WeightOperandCache): x (..., in) ->
    (..., out). Y = X W_f^T + b, dX = dY W (the weight itself: straight through), dW = dY^T X,
    db = dY summed: the GEMMs emulated_forward and emulated_backward make when every operand
    but the forward's W is high precision, the same bits. Plain torch operations, so
    torch.compile traces them, and an eager call runs one small autograd.Function. Under
    autocast the operands are cast to its dtype first, as quant_linear casts them (autocast
    then leaves the GEMM's operands as they are); None where w_f is not in the dtype the GEMM
    runs in (the caller quantizes instead)."""
    x, weight, bias = autocast_operands(x, weight, bias)
    if w_f.dtype != weight.dtype:
        return None
    y = _WeightOnlyLinear.apply(x.reshape(-1, x.shape[-1]), weight, w_f.detach(), bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


class _WeightOnlyLinear(torch.autograd.Function):
    """weight_only_linear's GEMMs (see there): x (N, in), weight and w_f (out, in)."""

    @staticmethod
    def forward(ctx, x, weight, w_f, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, w_f, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        dw = dy.mT @ x if ctx.needs_input_grad[1] else None
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return dx, dw, None, db


class WeightOperandCache:
    """Layers' quantized forward weights, each kept while its weight is unchanged, so that the
    micro-batches and no-grad passes between two optimizer steps quantize it once (the RL
    trainer's log-prob passes and gradient accumulation: lowbit.nn.reuse_weight_operands, which
    clears it as each step of the optimizer it is given begins).

    `get(master, dtype, spec, make)` returns make(), the operand of `master` (the parameter,
    or an expert's view of it: its device, storage, shape and stride) quantized in `dtype`
    (master as autocast casts it), computed once until `clear()`, or until master's autograd
    version counter moves (an in-place op outside the optimizer: load_state_dict; fused
    optimizers and writes through .data do not move it, hence the clearing). It returns None
    (the caller quantizes as usual) for a spec that rounds stochastically (drawn afresh each
    forward) or none, and while a CUDA graph is captured (its replays would read a tensor the
    cache frees). The cached value is detached: gradients go through the layer's
    straight-through rule, which never reads it."""

    def __init__(self) -> None:
        self.entries: dict[tuple, tuple[int, torch.Tensor]] = {}

    def get(self, master: torch.Tensor, dtype: torch.dtype, spec: QuantSpec | None,
            make) -> torch.Tensor | None:
        if (spec is None or spec.rounding is not Rounding.RNE
                or (master.is_cuda and torch.cuda.is_current_stream_capturing())):
            return None
        where = (master.device, master.data_ptr(), tuple(master.shape), master.stride(), dtype, spec)
        held = self.entries.get(where)
        if held is None or held[0] != master._version:
            with torch.no_grad():
                held = self.entries[where] = (master._version, make())
        return held[1]

    def forward_weight(self, master: torch.Tensor, dtype: torch.dtype,
                       spec: QuantSpec | None) -> torch.Tensor | None:
        """get() of a layer's forward operand: `master` cast to `dtype` and quantized along its
        input dim (operand(w, spec, reduce_dim=1)), autocast off."""
        def make() -> torch.Tensor:
            with torch.autocast(master.device.type, enabled=False):
                return operand(master.detach().to(dtype), spec, reduce_dim=1)
        return self.get(master, dtype, spec, make)

    def clear(self) -> None:
        self.entries.clear()
