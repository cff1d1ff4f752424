"""JacQuant's surrogate B of the quantizer's Jacobian: the fit, and its statistics.

B replaces the STE's identity in backward, dL/dW ≈ B ⊙ dL/dŴ (lowbit.qat.quantizer), or, with
JacQuantConfig.b_on = "update", scales each optimizer step's change of W instead (AdamW
divides a gradient-side B that holds still back out; lowbit.qat.layers.refresh_hook). It is
fit every K steps from finite differences of the forward quantizer Q itself, at a
perturbation of eps quantization steps:
- probe:  Δ = eps * step * u with u uniform in [-1, 1] (a random sign and size per weight);
          B_G = <Q(W+Δ) - Q(W-Δ), Δ>_G / (2 |Δ|²_G), averaged over `samples` draws;
- dither: the slope of E_u[Q(W+u)], u uniform over eps * step either side, which is exactly
          (Q(W + eps*step) - Q(W - eps*step)) / (2 eps step) per weight (the derivative of
          a box average is the difference of its ends over the width), averaged over G.
At eps = 0.5 (a full step wide) dither is 1 inside the grid's range and 0 outside: clipped
STE, averaged over the group. Smaller eps sees where weights sit against the rounding
boundaries (a group whose weights sit at grid points gets a small B, one whose weights sit at
boundaries a large one); larger eps sees saturation from farther away. For nvfp4/mxfp4, Q
recomputes the block scales of the perturbed weight, so B also sees the scales respond.
Both sums are weighted, per input channel, by d = diag(E[x xᵀ]) of the layer's inputs (an
EMA the layer keeps), so B fits the layer's output, not its weights; this weighs the weights
of a group against each other, so it changes a per-group B only (per element, d cancels
from each weight's own ratio, and no moments are kept). The fit is clamped to
[0, b_max] and smoothed across refreshes by an EMA. The paper's exact formulas were not
public; this realization, and what it measured, are in docs/qat.md and docs/results/jacquant/.
"""

from __future__ import annotations

import torch

from lowbit.qat.config import JacQuantConfig
from lowbit.qat.quantizer import GroupQuantizer

__all__ = ["fit_b", "b_statistics", "quantization_step"]


def quantization_step(w: torch.Tensor, quantizer: GroupQuantizer, scales: torch.Tensor | None
                      ) -> torch.Tensor:
    """Each weight's grid step, shaped like w: the group's scale (intK, ternary, binary, seq2:
    grid spacing 1 in scale units; binary 2) or, for nvfp4/mxfp4, the block scale (one E2M1 unit)."""
    if quantizer.fmt.data_scaled:
        q = quantizer.pack(w, None, None)
        return q.element_scales().reshape(w.shape)
    spacing = 2.0 if quantizer.fmt.grid == "binary" else 1.0
    step = scales[..., None].expand(*scales.shape, quantizer.group) * spacing
    return step.reshape(w.shape)


@torch.no_grad()
def fit_b(w: torch.Tensor, quantizer: GroupQuantizer, scales: torch.Tensor | None,
          zeros: torch.Tensor | None, config: JacQuantConfig, moments: torch.Tensor | None,
          generator: torch.Generator) -> torch.Tensor:
    """One fit of B (not yet clamped or smoothed): per group (..., out, n_groups), or per
    element (shaped like w) with config.per_element."""
    wf = w.float()
    step = quantization_step(wf, quantizer, scales)
    weight = (torch.ones_like(wf) if moments is None or not config.weighted
              else moments.float().expand_as(wf))

    def q(x):
        return quantizer.dequantize(x, scales, zeros)

    num = torch.zeros_like(wf)
    den = torch.zeros_like(wf)
    if config.estimate in ("dither", "both"):
        half = config.eps * step
        jac = (q(wf + half) - q(wf - half)) / (2 * half)
        jac = torch.where(half > 0, jac, 1.0)
        d_num, d_den = weight * jac, weight
        if config.estimate == "dither":
            num, den = d_num, d_den
    if config.estimate in ("probe", "both"):
        p_num = torch.zeros_like(wf)
        p_den = torch.zeros_like(wf)
        for _ in range(config.samples):
            u = torch.rand(wf.shape, generator=generator, device=wf.device) * 2 - 1
            delta = config.eps * step * u
            p_num += weight * (q(wf + delta) - q(wf - delta)) * delta
            p_den += weight * 2 * delta * delta
        if config.estimate == "probe":
            num, den = p_num, p_den
    if config.estimate == "both":
        # the mean of the two fits, each formed on its own
        return 0.5 * (_ratio(p_num, p_den, quantizer, config) + _ratio(d_num, d_den, quantizer, config))
    return _ratio(num, den, quantizer, config)


def _ratio(num, den, quantizer: GroupQuantizer, config: JacQuantConfig) -> torch.Tensor:
    if not config.per_element:
        groups = quantizer.n_groups
        num = num.view(*num.shape[:-1], groups, num.shape[-1] // groups).sum(-1)
        den = den.view(*den.shape[:-1], groups, den.shape[-1] // groups).sum(-1)
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 1.0)


def b_statistics(b: torch.Tensor, b_max: float) -> dict[str, float]:
    """mean, and the fractions near 0 (< 5% of b_max) and near b_max (> 95%)."""
    b = b.float()
    return {"mean": b.mean().item(),
            "near_zero": (b < 0.05 * b_max).float().mean().item(),
            "near_max": (b > 0.95 * b_max).float().mean().item()}
