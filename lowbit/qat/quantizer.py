"""The forward quantizer of a QAT weight and the gradients that pass it.

`GroupQuantizer` holds a weight format's grid for one weight shape (..., out, in): its scales
from the trained weights (`init_scales`), the grid values of a weight under given scales
(`values`), and the packed `QTensor` those values are (`pack`). The forward is
Ŵ = values(W, s, z) * s, in float32, and `pack(W, s, z).dequantize(torch.float32)` is the same
tensor bit for bit, so a converted model computes exactly what its QAT run evaluated.

`fake_quantize` is the autograd function. Its backward, by estimator:
- ste:          dL/dW = dL/dŴ
- clipped-ste:  dL/dW = dL/dŴ where W lies in the grid's range, else 0
- lsq:          clipped-ste for W; the step size learns with LSQ's gradient (below)
- jacquant:     dL/dW = B ⊙ dL/dŴ, B the surrogate Jacobian (lowbit.qat.jacquant), one value
                per group (or per element); with B on the update (JacQuantConfig.b_on) the
                backward is the STE's and lowbit.qat.layers scales each step instead
Learned scales (lsq, or any estimator with learn_scales) take LSQ's gradient
dŴ/ds = v - W/s inside the range and v at saturation, summed over the group and multiplied by
g = 1 / sqrt(N * Qp) (N weights per scale, Qp the grid's largest value), as Esser et al. 2020.
"""

from __future__ import annotations

import math

import torch

from lowbit import dispatch
from lowbit.formats import QTensor, ScaleKind
from lowbit.formats.elements import encode, pack_codes
from lowbit.formats.quantize import grid_values
from lowbit.formats.weight_format import WeightFormat

__all__ = ["GroupQuantizer", "fake_quantize", "times_b", "MSE_RATIOS"]

# Clipping ratios of the MSE scale search: the scale absmax-rule * r minimizing the squared error.
MSE_RATIOS = tuple(round(1.0 - 0.025 * i, 4) for i in range(29))  # 1.0 .. 0.3
_TINY = 2.0 ** -120


class GroupQuantizer:
    """A weight format on weights shaped (..., out, in), groups of `group` inputs per scale."""

    def __init__(self, fmt: WeightFormat, shape: torch.Size | tuple[int, ...]) -> None:
        self.fmt = fmt
        self.shape = torch.Size(shape)
        self.in_features = self.shape[-1]
        self.spec = fmt.spec(self.in_features)
        self.group = self.spec.block[1]
        self.element = self.spec.info.element
        self.qmax = self.element.max_value

    @property
    def n_groups(self) -> int:
        return -(-self.in_features // self.group)

    @property
    def scale_shape(self) -> torch.Size:
        return torch.Size((*self.shape[:-1], self.n_groups))

    # -- scales -----------------------------------------------------------------------------
    def init_scales(self, w: torch.Tensor, rule: str = "absmax") -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scales, zeros) of the trained weight w: the format's own rule (lowbit.formats),
        or with rule="mse" the ratio r of MSE_RATIOS per group minimizing |W - Q_{r s}(W)|^2."""
        if self.fmt.data_scaled:
            raise ValueError(f"{self.fmt.grid} scales come from the weights at every forward")
        q = dispatch.quantize_with_spec(w.detach().float(), self.spec)
        scales = torch.clamp(q.scales.float(), min=_TINY)
        zeros = None if q.zeros is None else q.zeros.float()
        if rule == "absmax":
            return scales, zeros
        wf = w.detach().float()
        best_err = torch.full(scales.shape, math.inf, device=w.device)
        best = scales.clone()
        for ratio in MSE_RATIOS:
            trial = scales * ratio
            err = ((self.dequantize(wf, trial, zeros) - wf) ** 2)
            err = err.view(*err.shape[:-1], self.n_groups, self.group).sum(-1)
            better = err < best_err
            best = torch.where(better, trial, best)
            best_err = torch.where(better, err, best_err)
        return best, zeros

    # -- the grid ---------------------------------------------------------------------------
    def _grouped(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(*t.shape[:-1], self.n_groups, self.group)

    def values(self, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(v, inside), both shaped like w: the grid values of w / s (float32; q or q - z) and
        whether w lies in the grid's range (where clipped STE passes the gradient)."""
        return grid_values(w, scales, zeros, self.element, self.group)

    def dequantize(self, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> torch.Tensor:
        """Ŵ in float32 (grid formats) -- the forward, without its gradient."""
        if self.fmt.data_scaled:
            return dispatch.quantize_dequantize(w.float(), self.spec, dtype=torch.float32)
        return dispatch.grid_fake_quantize(w.float(), scales, zeros, self.element, self.group)[0]

    def quantize_blocks(self, w: torch.Tensor, tensor_amax: torch.Tensor | None = None) -> QTensor:
        """nvfp4 / mxfp4: w's own block scales, packed. With `tensor_amax` (nvfp4), the
        per-tensor scale is tensor_amax / (448 * 6) instead of w's own amax: a fused group
        (q/k/v, gate/up) shares one tensor scale, as servers need (lowbit.export)."""
        wf = w.detach().float()
        if tensor_amax is None or self.fmt.grid != "nvfp4":
            return dispatch.quantize_with_spec(wf, self.spec)
        # One extra row holding the group's amax makes the tensor scale the group's; 1x16
        # blocks never span rows, so each block of w is the block it is alone under that
        # scale -- what lowbit.export.quantize_group computes on the stacked group.
        anchor = torch.zeros((*wf.shape[:-2], 1, wf.shape[-1]), dtype=wf.dtype, device=wf.device)
        anchor[..., 0, 0] = tensor_amax
        q = dispatch.quantize_with_spec(torch.cat([wf, anchor], dim=-2), self.spec)
        return QTensor(q.codes[..., :-1, :].contiguous(), q.scales[..., :-1, :].contiguous(),
                       q.tensor_scale, q.spec, tuple(wf.shape), wf.dtype)

    def pack(self, w: torch.Tensor, scales: torch.Tensor | None, zeros: torch.Tensor | None,
             tensor_amax: torch.Tensor | None = None) -> QTensor:
        """The packed weight; its dequantize(torch.float32) equals dequantize(w, scales, zeros)
        (data-scaled formats: the forward's values, under `tensor_amax` if given)."""
        if self.fmt.data_scaled:
            return self.quantize_blocks(w, tensor_amax)
        v, _ = self.values(w.detach(), scales, zeros)
        codes = encode(v if zeros is None else self._grouped(v).add(zeros[..., None]).reshape(v.shape),
                       self.element)
        packed = pack_codes(codes, self.element.code_bits)
        z = None if zeros is None else zeros.to(torch.uint8)
        return QTensor(packed, scales.detach().float().clone(), None, self.spec, tuple(w.shape),
                       w.dtype, zeros=z)

    def lsq_grad_scale(self) -> float:
        """LSQ's 1 / sqrt(N * Qp): N weights per scale, Qp the grid's largest positive value."""
        qp = self.qmax if self.spec.info.scale_kind is not ScaleKind.MINMAX else self.qmax / 2
        return 1.0 / math.sqrt(self.group * max(qp, 1.0))


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, scales, zeros, b, quantizer: GroupQuantizer, estimator: str, learn: bool,
                tensor_amax):
        if quantizer.fmt.data_scaled:
            q = quantizer.quantize_blocks(w, tensor_amax)
            out = q.dequantize(torch.float32)
            inside = w.detach().float().abs() <= q.block_max() if estimator == "clipped-ste" else None
            ctx.save_for_backward(inside, b)
            ctx.grid = None
        elif learn:   # LSQ's gradient needs the grid values too
            v, inside = quantizer.values(w.detach(), scales.detach(), zeros)
            out = (quantizer._grouped(v) * scales.detach()[..., None]).reshape(w.shape).to(w.dtype)
            ctx.save_for_backward(inside, b, v, w, scales)
            ctx.grid = True
        else:         # one fused pass on a GPU (lowbit.dispatch.grid_fake_quantize)
            out, inside = dispatch.grid_fake_quantize(w.detach(), scales.detach(), zeros, quantizer.element,
                                                      quantizer.group, inside=estimator in ("clipped-ste", "lsq"))
            ctx.save_for_backward(inside, b)
            ctx.grid = True
        ctx.quantizer, ctx.estimator, ctx.learn = quantizer, estimator, learn
        return out

    @staticmethod
    def backward(ctx, grad):
        quantizer, estimator = ctx.quantizer, ctx.estimator
        saved = ctx.saved_tensors
        inside, b = saved[0], saved[1]
        g = grad.float()
        if estimator in ("clipped-ste", "lsq"):
            grad_w = torch.where(inside, g, 0.0)
        elif estimator == "jacquant":
            grad_w = times_b(g, b)
        else:
            grad_w = g
        grad_s = None
        if ctx.grid and ctx.learn:
            v, w, scales = saved[2], saved[3], saved[4]
            data = quantizer._grouped(w.float()) / scales[..., None]
            vg = quantizer._grouped(v)
            dwhat_ds = torch.where(quantizer._grouped(inside), vg - data, vg)
            grad_s = (quantizer._grouped(g) * dwhat_ds).sum(-1) * quantizer.lsq_grad_scale()
        return grad_w.to(grad.dtype), grad_s, None, None, None, None, None, None


def times_b(g: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """B ⊙ g, B one value per element (b shaped like g) or per group (b shaped (..., n_groups))."""
    if b.shape == g.shape:
        return g * b
    groups = b.shape[-1]
    return (g.view(*g.shape[:-1], groups, g.shape[-1] // groups) * b[..., None]).reshape(g.shape)


def fake_quantize(w: torch.Tensor, scales: torch.Tensor | None, zeros: torch.Tensor | None,
                  b: torch.Tensor | None, quantizer: GroupQuantizer, estimator: str,
                  learn: bool = False, tensor_amax: torch.Tensor | None = None) -> torch.Tensor:
    """Ŵ = Q(w) with the estimator's backward (see the module docstring); tensor_amax: an
    nvfp4 fused group's amax, for its shared tensor scale (GroupQuantizer.quantize_blocks)."""
    return _FakeQuantize.apply(w, scales, zeros, b, quantizer, estimator, learn, tensor_amax)
