"""The quantized linear as torch.library custom ops, for torch.compile.

Eagerly, quant_linear runs lowbit.ops.linear's autograd.Functions. Under torch.compile those
would be graph breaks (dynamo cannot trace the quantizers' Python and Triton launches), and a
model with a quantized linear in every block would compile into many small graphs. Here the
forward and the backward of one layer are each an opaque op that the compiler places in one
graph and fuses around: the norms, rotary embeddings, activations and residual adds between
the linears. Emulated recipes: `lowbit::quant_linear` and `lowbit::quant_linear_backward`;
FP8 recipes: `lowbit::quant_linear_fp8` and `lowbit::quant_linear_fp8_backward`.

The ops compute what the autograd.Functions compute. The FP8 forward returns, beside Y, the
folded transposes its one quantization of X and W gives (X^T for dW, W^T for dX, square tiles),
packed into tensors of shapes the compiler knows in advance (an exact fold's K-chunks are
chosen from the data; see _kept), and the backward multiplies those, as the Function does.
The emulated forward returns, beside Y, the quantized X and W where square tiles let the
backward reuse them, as the Function saves them. Only recipes whose forward operands round to
nearest compile to these ops (`compilable`; a stochastic forward stays eager, a graph break).
Stochastic rounding (of dY) draws in the same order as eagerly.

FP8 folds under a deferred fold check: the forward op runs on the thread that holds the check
and remembers it per device; the backward op (on autograd's thread) uses the last forward's
while its block is still open, and folds exactly otherwise, as the autograd.Function does.
A watch_chunked_folds() block and an observe_folds() observer are carried to the backward the
same way, and both FP8 ops name their layer (`layer`, a string argument) to them, so
--fold-inexact adapt finds chunked layers, and `lowbit bench folds` counts each layer's folds,
in a compiled model too. Only a forward that a backward will follow updates what is carried
(an evaluation on another thread does not), but it is one per device, not per thread: two
threads training on one GPU at once would share it.
(A forward on another thread without a check, an evaluation say, makes a backward that
follows it fold exactly: slower, never inexact.)

A weight-only recipe (QUADS' asymmetric QAT) whose quantized W the caller hands in needs no
op at all (lowbit.ops.gemms.weight_only_linear, plain operations the compiler traces); the op
pair would quantize W at every forward, in Python the host pays for at every call.

The ops take the recipe as a string (`op_key(recipe)`: the recipe serialized; a custom op takes
no Python objects) and rebuild it from that (`recipe_for_op_key`, cached). Under torch.compile
the string is an attribute of the recipe, which the graph holds as a constant.

Compiled alone, a quantized step is host-bound on these ops' Python; captured with
`lowbit train --cuda-graph` as well, none of that host work is left (docs/results/training-speed.md).
"""

from __future__ import annotations

import functools

import torch

from lowbit.dispatch.fold_check import (active_fold_check, active_observer, active_watch,
                                        canonical_device, folding_for)
from lowbit.formats.fold import FoldedOperand
from lowbit.ops.gemms import (autocast_operands, emulated_backward, emulated_forward,
                              fp8_backward, fp8_forward, kept_operands, saved_operands)
from lowbit.recipes import Gemm, LinearRecipe

__all__ = ["quant_linear_compiled", "op_key", "recipe_for_op_key"]

_FORWARD_CHECKS: dict = {}                 # device -> the deferred fold check of the last forward
_FORWARD_WATCHES: dict = {}                # device -> the chunk watch of the last forward
_FORWARD_OBSERVERS: dict = {}              # device -> the fold observer of the last forward


def op_key(r: LinearRecipe) -> str:
    """The string the custom ops know `r` by: the recipe itself, serialized (LinearRecipe.key),
    so equal recipes share it in every process (it may sit in torch.compile's on-disk caches)
    and no registry is needed to read it back."""
    return r.key


@functools.cache
def recipe_for_op_key(key: str) -> LinearRecipe:
    """The LinearRecipe whose op_key is `key` (the custom ops take the key)."""
    return LinearRecipe.from_key(key)


def quant_linear_compiled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          recipe: LinearRecipe, layer: str = "") -> torch.Tensor:
    """quant_linear through the custom ops (x (..., in) -> (..., out)); traceable by dynamo."""
    x, weight, bias = autocast_operands(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    # keep, for the backward, the quantized (emulated) or folded transposed (FP8) operands of
    # X and W where square tiles let it reuse them and it will need them
    grad_x = torch.is_grad_enabled() and x.requires_grad      # dX will be asked for
    grad_w = torch.is_grad_enabled() and weight.requires_grad  # dW will be
    keep_x, keep_w = kept_operands(recipe, grad_x, grad_w)
    if recipe.gemm is Gemm.FP8:
        y = torch.ops.lowbit.quant_linear_fp8(x2, weight, op_key(recipe), layer, keep_x, keep_w,
                                              grad_x or grad_w)[0]
    else:
        y = torch.ops.lowbit.quant_linear(x2, weight, op_key(recipe), keep_x, keep_w)[0]
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, weight.shape[0])


@torch.library.custom_op("lowbit::quant_linear", mutates_args=())
def _forward(x: torch.Tensor, weight: torch.Tensor, recipe: str, keep_x: bool,
             keep_w: bool) -> list[torch.Tensor]:
    """[y, the quantized X (empty unless keep_x), the quantized W (empty unless keep_w)], for
    an emulated recipe (FP8 ones: quant_linear_fp8)."""
    with torch.autocast(x.device.type, enabled=False):
        y, x_f, w_f = emulated_forward(x, weight, recipe_for_op_key(recipe))
    # (kept ones are the quantizer's new tensors, never x or weight: r's specs are not None)
    return [y, x_f.contiguous() if keep_x else x.new_empty(0),
            w_f.contiguous() if keep_w else x.new_empty(0)]


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
            "with the default mode, and capture with `lowbit train --cuda-graph`, which opens "
            "its check inside the capture")


@_forward.register_fake
def _(x, weight, recipe, keep_x, keep_w):
    return [x.new_empty(x.shape[0], weight.shape[0]),
            x.new_empty(x.shape) if keep_x else x.new_empty(0),
            x.new_empty(weight.shape) if keep_w else x.new_empty(0)]


@torch.library.custom_op("lowbit::quant_linear_backward", mutates_args=())
def _backward_op(dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor | None,
                 recipe: str, x_kept: bool, w_kept: bool, need_dx: bool,
                 need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """dX, dW (empty where not asked for) of an emulated recipe. x / weight: the forward's
    quantized copies where x_kept / w_kept, else the inputs (quantized here where square tiles
    share them, lowbit.ops.gemms.saved_operands' rule), or None where no GEMM needs them."""
    r = recipe_for_op_key(recipe)
    with torch.autocast(dy.device.type, enabled=False):
        x_saved, w_saved = saved_operands(x, weight, r, x if x_kept else None,
                                           weight if w_kept else None)
        dx, dw = emulated_backward(dy, x_saved, w_saved, r, need_dx, need_dw)
    # an op returns tensors: an empty one where no gradient was asked for; contiguous ones
    return (dx.contiguous() if dx is not None else dy.new_empty(0),
            dw.contiguous() if dw is not None else dy.new_empty(0))


@_backward_op.register_fake
def _(dy, x, weight, recipe, x_kept, w_kept, need_dx, need_dw):
    k_in = x.shape[1] if x is not None else weight.shape[1]
    return (dy.new_empty(dy.shape[0], k_in) if need_dx else dy.new_empty(0),
            dy.new_empty(dy.shape[1], k_in) if need_dw else dy.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, weight, recipe, keep_x, keep_w = inputs
    _, x_f, w_f = output
    # dW = dY^T X needs X (or its kept quantized copy), dX = dY W needs W; nothing else
    ctx.save_for_backward((x_f if keep_x else x) if weight.requires_grad else None,
                          (w_f if keep_w else weight) if x.requires_grad else None)
    ctx.recipe, ctx.kept = recipe, (keep_x, keep_w)


def _backward(ctx, grads):
    dy = grads[0]   # the op returns a list: its gradients come as one (the kept ones unused)
    x, weight = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = torch.ops.lowbit.quant_linear_backward(dy, x, weight, ctx.recipe, *ctx.kept,
                                                    need_dx, need_dw)
    return (dx if need_dx else None), (dw if need_dw else None), None, None, None


_forward.register_autograd(_backward, setup_context=_setup_context)


# ---- FP8 recipes: the forward keeps the transposed folded operands for the backward --------
#
# As the eager autograd.Function does, the forward's single quantization of a square-tile
# operand gives the backward's folded transpose (X^T for dW, W^T for dX) in the same pass, and
# the backward uses it instead of quantizing X and W again. A custom op returns tensors of
# shapes known in advance, and a FoldedOperand has one factor column per K-chunk, which exact
# folds choose from the data; so each kept operand is returned as four tensors: the E4M3
# values, the factors padded to one column per block along K (the most chunks there can be),
# the NaN rows, and the chunk bounds padded with -1, a CPU tensor (the forward knows them on
# the host; the backward reads them without a device sync).


def _kept(folded, rows: int, k: int, block: int, device: torch.device) -> list[torch.Tensor]:
    """A FoldedOperand (rows, k) or None -> [fp8, factors, nan_rows, bounds] (empty if None)."""
    if folded is None:
        return _kept_empty(device)
    most = -(-k // block)
    factors = torch.ones(rows, most, device=device, dtype=torch.float32)
    chunks = len(folded.bounds) - 1
    factors[:, :chunks] = folded.factors
    bounds = torch.full((most + 1,), -1, dtype=torch.int64, device="cpu")
    bounds[:chunks + 1] = torch.tensor(folded.bounds, dtype=torch.int64, device="cpu")
    return [folded.fp8.contiguous(), factors, folded.nan_rows.contiguous(), bounds]


def _kept_empty(device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(0, 0, device=device, dtype=torch.float8_e4m3fn),
            torch.empty(0, 0, device=device, dtype=torch.float32),
            torch.empty(0, device=device, dtype=torch.bool),
            torch.empty(0, dtype=torch.int64, device="cpu")]


def _unkept(fp8, factors, nan_rows, bounds):
    """The FoldedOperand _kept packed, or None."""
    if bounds.numel() == 0:
        return None
    edges = [b for b in bounds.tolist() if b >= 0]   # a CPU tensor: no device sync
    return FoldedOperand(fp8, factors[:, :len(edges) - 1], tuple(edges), nan_rows)


@torch.library.custom_op("lowbit::quant_linear_fp8", mutates_args=())
def _fp8_forward(x: torch.Tensor, weight: torch.Tensor, recipe: str, layer: str,
                 keep_x_t: bool, keep_w_t: bool, grad: bool) -> list[torch.Tensor]:
    """[y, X^T's kept operand (4 tensors, empty unless keep_x_t), W^T's (likewise)]. grad: a
    backward will follow, which uses this forward's fold check and chunk watch; a forward
    without one (an evaluation, on this thread or another) leaves those of the last one that
    has one in place."""
    r = recipe_for_op_key(recipe)
    with torch.autocast(x.device.type, enabled=False):
        device = canonical_device(x.device)
        check, watch, observer = active_fold_check(x.device), active_watch(), active_observer()
        if grad:
            _FORWARD_CHECKS[device], _FORWARD_WATCHES[device] = check, watch
            _FORWARD_OBSERVERS[device] = observer
        _refuse_capture(check)
        with folding_for(layer, watch, observer):
            y, fx_t, fw_t = fp8_forward(x, weight, r, keep_x_t, keep_w_t, check)
        # contiguous, as the fake says (on CUDA, N padded to 16 comes back as a slice)
        y = y.contiguous()
    n, k_in = x.shape
    return [y, *_kept(fx_t, k_in, n, r.fprop_x.block[0], x.device),
            *_kept(fw_t, k_in, weight.shape[0], r.fprop_w.block[0], x.device)]


@_fp8_forward.register_fake
def _(x, weight, recipe, layer, keep_x_t, keep_w_t, grad):
    r = recipe_for_op_key(recipe)
    n, k_in = x.shape

    def kept(keep, k, block):
        if not keep:
            return _kept_empty(x.device)
        most = (k + block - 1) // block
        return [x.new_empty(k_in, k, dtype=torch.float8_e4m3fn),
                x.new_empty(k_in, most, dtype=torch.float32),
                x.new_empty(k_in, dtype=torch.bool),
                torch.empty(most + 1, dtype=torch.int64, device="cpu")]

    return [x.new_empty(n, weight.shape[0]), *kept(keep_x_t, n, r.fprop_x.block[0]),
            *kept(keep_w_t, weight.shape[0], r.fprop_w.block[0])]


@torch.library.custom_op("lowbit::quant_linear_fp8_backward", mutates_args=())
def _fp8_backward_op(dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor | None,
                     kept: list[torch.Tensor], recipe: str, layer: str, need_dx: bool,
                     need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """dX, dW (empty where not asked for). x / weight: None where the forward kept their
    transposed operands (kept: X^T's four tensors, then W^T's)."""
    r = recipe_for_op_key(recipe)
    with torch.autocast(dy.device.type, enabled=False):
        device = canonical_device(dy.device)
        check = _FORWARD_CHECKS.get(device)
        check = check if check is not None and check.open else None
        _refuse_capture(check)
        with folding_for(layer, _FORWARD_WATCHES.get(device), _FORWARD_OBSERVERS.get(device)):
            # where not kept: 1D blocks, quantized along the other dim here, as eagerly
            dx, dw = fp8_backward(dy, x, weight, _unkept(*kept[:4]), _unkept(*kept[4:]), r,
                                  check, need_dx, need_dw)
    return (dx.contiguous() if dx is not None else dy.new_empty(0),
            dw.contiguous() if dw is not None else dy.new_empty(0))


@_fp8_backward_op.register_fake
def _(dy, x, weight, kept, recipe, layer, need_dx, need_dw):
    # in_features: from whichever of X, W, X^T's or W^T's operand the forward saved
    k_in = next(t.shape[dim] for t, dim in ((x, 1), (weight, 1), (kept[0], 0), (kept[4], 0))
                if t is not None and t.numel())
    n_out = dy.shape[1]
    return (dy.new_empty(dy.shape[0], k_in) if need_dx else dy.new_empty(0),
            dy.new_empty(n_out, k_in) if need_dw else dy.new_empty(0))


def _fp8_setup_context(ctx, inputs, output):
    x, weight, recipe, layer, keep_x_t, keep_w_t, grad = inputs
    kept = output[1:]
    # dW needs X where X^T was not kept (1D blocks along tokens), dX needs W where W^T was not
    ctx.save_for_backward(x if weight.requires_grad and not keep_x_t else None,
                          weight if x.requires_grad and not keep_w_t else None, *kept)
    ctx.recipe, ctx.layer = recipe, layer


def _fp8_backward(ctx, grads):
    dy = grads[0]   # the op returns a list: its gradients come as one (the kept ones unused)
    x, weight, *kept = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = torch.ops.lowbit.quant_linear_fp8_backward(dy, x, weight, kept, ctx.recipe,
                                                        ctx.layer, need_dx, need_dw)
    return (dx if need_dx else None), (dw if need_dw else None), None, None, None, None, None


_fp8_forward.register_autograd(_fp8_backward, setup_context=_fp8_setup_context)
