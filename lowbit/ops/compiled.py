"""The quantized linear as two torch.library custom ops, for torch.compile.

Eagerly, quant_linear runs lowbit.ops.linear's autograd.Functions. Under torch.compile those
would be graph breaks (dynamo cannot trace the quantizers' Python and Triton launches), and a
model with a quantized linear in every block would compile into many small graphs. Here the
forward and the backward of one layer are each an opaque op (`lowbit::quant_linear`,
`lowbit::quant_linear_backward`) that the compiler places in one graph and fuses around: the
norms, rotary embeddings, activations and residual adds between the linears.

The two ops compute what the autograd.Functions compute, with one difference: the backward
quantizes X and W again (once more along the other dim where 2D tiles are shared) instead of
keeping the forward's quantized copies, because a custom op's outputs must have shapes the
compiler knows in advance, which an FP8 fold's K-chunks do not. That gives the same values,
since the forward operands round to nearest (`compilable`): the same input quantizes to the
same bits. Stochastic rounding (of dY) draws in the same order as eagerly.

FP8 folds under a deferred fold check: the forward op runs on the thread that holds the check
and remembers it per device; the backward op (on autograd's thread) uses the last forward's
while its block is still open, and folds exactly otherwise, as the autograd.Function does.
A watch_chunked_folds() block is carried to the backward the same way, and both ops name
their layer (`layer`, a string argument) to it, so --fold-inexact adapt finds chunked layers
in a compiled model too.
(A forward on another thread without a check, an evaluation say, makes a backward that
follows it fold exactly: slower, never inexact.)

Measured on an H200 (docs/results/kernels.md, sixth session): compiled alone, a quantized
1B step is host-bound on these ops' Python (stable-fp4-fp8 2.54x bf16's compiled step, its GPU
busy a third of the time); captured with `--cuda-graph` as well, none of that host work is
left (0.94x). The re-quantization in the backward costs about 4 ms of that step's 99.5 ms
(folds 15.3 ms against 12.8 eagerly, quantize 4.9 against 3.2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.formats.spec import Rounding
from lowbit.recipes import Gemm, LinearRecipe, recipe_for_op_key

__all__ = ["autocast_operands", "compilable", "quant_linear_compiled"]

_FORWARD_CHECKS: dict = {}                 # device -> the deferred fold check of the last forward
_FORWARD_WATCHES: dict = {}                # device -> the chunk watch of the last forward


def compilable(r: LinearRecipe) -> bool:
    """The recipe's forward operands round to nearest, so the backward op can quantize them
    again to the same values (stochastic rounding would draw new ones)."""
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


def quant_linear_compiled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          recipe: LinearRecipe, layer: str = "") -> torch.Tensor:
    """quant_linear through the custom ops (x (..., in) -> (..., out)); traceable by dynamo."""
    x, weight, bias = autocast_operands(x, weight, bias)
    lead = x.shape[:-1]
    y = torch.ops.lowbit.quant_linear(x.reshape(-1, x.shape[-1]), weight, recipe.op_key, layer)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, weight.shape[0])


@torch.library.custom_op("lowbit::quant_linear", mutates_args=())
def _forward(x: torch.Tensor, weight: torch.Tensor, recipe: str, layer: str) -> torch.Tensor:
    from lowbit.ops.linear import operand

    r = recipe_for_op_key(recipe)
    with torch.autocast(x.device.type, enabled=False):
        if r.gemm is Gemm.FP8:
            from lowbit.kernels.fp8_gemm import (_canonical, active_fold_check, active_watch,
                                                 folding_for, fp4_gemm_fp8, quantize_fold)

            device = _canonical(x.device)
            check = _FORWARD_CHECKS[device] = active_fold_check(x.device)
            watch = _FORWARD_WATCHES[device] = active_watch()
            _refuse_capture(check)
            with folding_for(layer, watch):
                fx, _ = quantize_fold(x, r.fprop_x, False, check)
                fw, _ = quantize_fold(weight, r.fprop_w, False, check)
            # contiguous, as the fake says (on CUDA, N padded to 16 comes back as a slice)
            return fp4_gemm_fp8(fx, fw, out_dtype=x.dtype).contiguous()
        return F.linear(operand(x, r.fprop_x, reduce_dim=1), operand(weight, r.fprop_w, 1))


def _refuse_capture(check) -> None:
    """A CUDA graph recorded around these ops by torch.compile (mode="reduce-overhead") would
    replay the folds without running this Python, so their inexact count would go to the
    check of the recording, not the one the caller reads: refuse, rather than lose it. A check
    opened inside the capture itself (lowbit.train.graphs.GraphedGradients) is the one its
    caller reads after each replay."""
    if (check is not None and not check.captured and torch.cuda.is_available()
            and torch.cuda.is_current_stream_capturing()):
        raise RuntimeError(
            "lowbit's FP8 folds under a deferred fold check cannot be recorded into a CUDA graph "
            "by torch.compile (mode='reduce-overhead'): the inexact count would be lost. Compile "
            "with the default mode, or use `lowbit train --cuda-graph` (no torch.compile)")


@_forward.register_fake
def _(x, weight, recipe, layer):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("lowbit::quant_linear_backward", mutates_args=())
def _backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, recipe: str,
                 layer: str, need_dx: bool, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from lowbit.ops.linear import _saved_operands, emulated_backward, fp8_backward

    r = recipe_for_op_key(recipe)
    with torch.autocast(dy.device.type, enabled=False):
        if r.gemm is Gemm.FP8:
            from lowbit.kernels.fp8_gemm import _canonical, folding_for

            device = _canonical(dy.device)
            check = _FORWARD_CHECKS.get(device)
            check = check if check is not None and check.open else None
            _refuse_capture(check)
            # X^T and W^T quantized here (1D blocks: along the other dim as eagerly; square
            # tiles: the transposes of the forward's, the same bits under RNE)
            with folding_for(layer, _FORWARD_WATCHES.get(device)):
                dx, dw = fp8_backward(dy, x, weight, None, None, r, check, need_dx, need_dw)
        else:   # what the forward would have saved, quantized again where 2D tiles share it
            dx, dw = emulated_backward(dy, *_saved_operands(x, weight, r), r, need_dx, need_dw)
    # an op returns tensors: an empty one where no gradient was asked for; contiguous ones
    return (dx.contiguous() if dx is not None else dy.new_empty(0),
            dw.contiguous() if dw is not None else dy.new_empty(0))


@_backward_op.register_fake
def _(dy, x, weight, recipe, layer, need_dx, need_dw):
    return (dy.new_empty(x.shape) if need_dx else dy.new_empty(0),
            dy.new_empty(weight.shape) if need_dw else dy.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, weight, recipe, layer = inputs
    ctx.save_for_backward(x, weight)
    ctx.recipe, ctx.layer = recipe, layer


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = torch.ops.lowbit.quant_linear_backward(dy, x, weight, ctx.recipe, ctx.layer,
                                                    need_dx, need_dw)
    return (dx if need_dx else None), (dw if need_dw else None), None, None


_forward.register_autograd(_backward, setup_context=_setup_context)
