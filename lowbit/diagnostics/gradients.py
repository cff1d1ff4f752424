"""Gradient bias and variance of a recipe, measured apart.

A quantized training step's weight gradient ĝ is a random variable when any operand rounds
stochastically. Its error against the high-precision gradient g splits into a bias, the error
of its mean E[ĝ] − g, which no number of steps averages away, and a variance E‖ĝ − E[ĝ]‖²,
which the optimizer averages over steps. A cosine or relative error of one draw mixes the two;
this module estimates them apart from `draws` stochastic-rounding draws on one batch:

    bias²     = (‖m − g‖² − Σᵢ vᵢ / N) / ‖g‖²   unbiased for ‖E[ĝ] − g‖² / ‖g‖²
    variance  = Σᵢ vᵢ / ‖g‖²                     (the trace of Cov[ĝ], relative)
    bias      = √max(bias², 0)

with m the draws' mean, vᵢ each element's sample variance and N the draws; bias² carries a
standard error from the per-element variances (the diagonal of the covariance: elements are
taken as independent, Var[‖m − g‖²] ≈ 4 Σ (m − g)ᵢ² vᵢ / N + 2 Σ vᵢ² / N²). A recipe without
stochastic rounding has no variance, and its bias is exact: a configuration whose first two
draws give bit-identical gradients stops there (its rows say draws = 2), which spares the
other draws for the operands that round stochastically.

Per layer (every quantized linear's and experts' weight) and summed over the model, for the
recipe as it is ("all") and, with `operands=True`, for each of its six GEMM operands alone (the
others left in high precision): which operand brings the bias and which the variance.

    report = gradient_bias_variance(model, idx, targets, ["mxfp4", "stable-fp4"], draws=64)
    print(format_report(report)); plot_report(report, "gradients.png")

The draws run on their own RNG stream (torch.random.fork_rng, seeded `seed + i`), so the
caller's random state is left as it was, and a report is reproducible.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from lowbit.diagnostics.training import quantized_weights
from lowbit.nn import QuantExperts, QuantLinear, convert_to_quantized_training
from lowbit.recipes import Gemm, LinearRecipe, get_recipe

__all__ = ["gradient_bias_variance", "bias_variance", "GradientStats", "GradientReport",
           "format_report", "plot_report", "OPERANDS"]

OPERANDS = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")


@dataclass
class GradientStats:
    """One (recipe, operands, layer)'s estimates, relative to ‖g‖² (see the module doc)."""
    recipe: str
    operands: str
    """"all", or the one operand quantized (the others in high precision)."""
    layer: str
    """A weight's name, or "model" for the sums over every quantized weight."""
    bias2: float
    bias2_se: float
    variance: float
    grad_norm2: float
    """‖g‖², the reference gradient's (what the others are relative to)."""
    draws: int
    """The draws taken: the report's, or 2 where the first two were bit-identical."""

    @property
    def bias(self) -> float:
        return max(self.bias2, 0.0) ** 0.5


@dataclass
class GradientReport:
    draws: int
    rows: list[GradientStats] = field(default_factory=list)

    def model_rows(self) -> list[GradientStats]:
        return [r for r in self.rows if r.layer == "model"]


def _only(r: LinearRecipe, keep: str) -> LinearRecipe:
    """r with every operand but `keep` in high precision ("all": r as it is). The Hadamard
    rotation of wgrad needs both its operands: with one of them alone it is off; FP8 GEMMs
    need every operand MXFP4: with one alone the GEMMs are emulated (the same products)."""
    if keep == "all":
        return r
    changes = {name: None for name in OPERANDS if name != keep}
    if r.wgrad_hadamard:
        changes["wgrad_hadamard"] = False
    if r.gemm is Gemm.FP8:
        changes["gemm"] = Gemm.EMULATED
    return dataclasses.replace(r, **changes)


def _grads(model: nn.Module, idx, targets, names) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    model.zero_grad(set_to_none=True)
    out = model(idx, targets)
    (out.loss if hasattr(out, "loss") else out[1]).backward()
    return {n: params[n].grad.detach().double() for n in names if params[n].grad is not None}


def gradient_bias_variance(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor,
                           recipes, draws: int = 64, operands: bool = False,
                           seed: int = 0, progress=None) -> GradientReport:
    """Each recipe's weight-gradient bias and variance against `model`'s own high-precision
    gradient on the batch (idx, targets): `model` is a plain (unconverted) lowbit or Hugging
    Face causal LM, left as it was; each recipe converts a copy. recipes: names or Recipes.
    draws >= 2. operands: also each GEMM operand alone (see the module doc). progress: called
    with (recipe, operands, draws taken) after each configuration is measured."""
    if draws < 2:
        raise ValueError(f"draws must be >= 2 to tell variance from bias (got {draws})")
    recipes = [get_recipe(r) for r in recipes]
    devices = [idx.device.index or 0] if idx.device.type == "cuda" else []
    report = GradientReport(draws)
    with torch.random.fork_rng(devices=devices):
        for recipe in recipes:
            quantized = copy.deepcopy(model)
            convert_to_quantized_training(quantized, recipe)
            modules = [m for m in quantized.modules() if isinstance(m, (QuantLinear, QuantExperts))]
            names = list(quantized_weights(quantized))
            if not names:
                raise ValueError(f"recipe {recipe.name!r} quantizes no layer of this model")
            own = [m.linear_recipe for m in modules]
            for m in modules:
                m.quantize = False
            reference = _grads(quantized, idx, targets, names)
            for m in modules:
                m.quantize = True
            for keep in ("all", *(OPERANDS if operands else ())):
                for m, r in zip(modules, own):
                    m.linear_recipe = None if r is None else _only(r, keep)
                rows = _draw_stats(quantized, idx, targets, names, reference, draws, seed,
                                   recipe.name, keep)
                report.rows += rows
                if progress is not None:
                    progress(recipe.name, keep, rows[-1].draws)
            for m, r in zip(modules, own):
                m.linear_recipe = r
    return report


def _draw_stats(model, idx, targets, names, reference, draws, seed, recipe: str,
                operands: str) -> list[GradientStats]:
    total = {n: torch.zeros_like(g) for n, g in reference.items()}
    square = {n: torch.zeros_like(g) for n, g in reference.items()}
    first = None
    taken = draws
    for i in range(draws):
        torch.manual_seed(seed + i)
        grads = _grads(model, idx, targets, names)
        for n, g in grads.items():
            total[n] += g
            square[n] += g * g
        if i == 0:
            first = grads   # float64 copies of their own (_grads), so kept as they are
        elif i == 1:
            if all(torch.equal(first[n], g) for n, g in grads.items()):
                taken = 2   # deterministic: no variance, and more draws would add nothing
                break
            first = None
    rows, sums = [], [0.0, 0.0, 0.0, 0.0]
    for n, g in reference.items():
        parts = bias_variance(g, total[n], square[n], taken)
        sums = [a + b for a, b in zip(sums, parts)]
        rows.append(_stats(recipe, operands, n, *parts, taken))
    rows.append(_stats(recipe, operands, "model", *sums, taken))
    return rows


def bias_variance(g: torch.Tensor, total: torch.Tensor, square: torch.Tensor,
                  draws: int) -> tuple[float, float, float, float]:
    """From N = draws samples of ĝ (their sum `total` and sum of squares `square`, float64)
    and the reference g: (bias² estimate, its variance, Σ element variances, ‖g‖²), absolute
    (see the module doc)."""
    m = total / draws
    v = ((square - draws * m * m) / (draws - 1)).clamp_min(0)
    d2 = (m - g) ** 2
    bias2 = (d2.sum() - v.sum() / draws).item()
    bias2_var = (4 * (d2 * v).sum() / draws + 2 * (v * v).sum() / draws**2).item()
    return bias2, bias2_var, v.sum().item(), (g * g).sum().item()


def _stats(recipe, operands, layer, bias2, bias2_var, variance, norm2, draws) -> GradientStats:
    scale = 1.0 / norm2 if norm2 > 0 else float("nan")
    return GradientStats(recipe, operands, layer, bias2 * scale, bias2_var ** 0.5 * scale,
                         variance * scale, norm2, draws)


def format_report(report: GradientReport, layers: bool = False) -> str:
    """A table: per recipe and operands, bias (√bias², ± the standard error of bias²
    shown as bias² ± se) and √variance, all relative to ‖g‖; the model's sums, or every layer's
    too."""
    head = ["recipe", "operands", "layer", "bias", "bias²", "± se", "√variance", "draws"]
    lines = [head]
    for r in report.rows:
        if r.layer != "model" and not layers:
            continue
        lines.append([r.recipe, r.operands, r.layer, f"{r.bias:.4f}", f"{r.bias2:.2e}",
                      f"{r.bias2_se:.1e}", f"{r.variance ** 0.5:.4f}", str(r.draws)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for k, line in enumerate(lines):
        out.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return (f"weight-gradient bias and variance over {report.draws} draws (2 where the first two "
            f"were identical), relative to the high-precision gradient's norm (bias² unbiased; ± "
            f"its standard error)\n" + "\n".join(out))


def plot_report(report: GradientReport, path: str) -> None:
    """Bars of each recipe's bias (its error bar: √(bias² ∓ se), the interval of bias² carried
    to bias, floored at 0) and √variance over the model, one group per operand set; both axes
    linear, so that a bias of zero reads as zero."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.model_rows()
    recipes = list(dict.fromkeys(r.recipe for r in rows))
    sets = list(dict.fromkeys(r.operands for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(min(16, max(8, 0.35 * len(sets) * len(recipes))), 4.2))
    width = 0.8 / max(len(recipes), 1)
    for k, recipe in enumerate(recipes):
        own = {r.operands: r for r in rows if r.recipe == recipe}
        xs = [i + k * width for i in range(len(sets))]
        bias = [own[s].bias if s in own else 0 for s in sets]
        low = [max(own[s].bias2 - own[s].bias2_se, 0) ** 0.5 if s in own else 0 for s in sets]
        high = [max(own[s].bias2 + own[s].bias2_se, 0) ** 0.5 if s in own else 0 for s in sets]
        err = [[b - lo for b, lo in zip(bias, low)], [hi - b for b, hi in zip(bias, high)]]
        axes[0].bar(xs, bias, width, yerr=err, label=recipe, capsize=2)
        axes[1].bar(xs, [own[s].variance ** 0.5 if s in own else 0 for s in sets], width,
                    label=recipe)
    for ax, title in zip(axes, ("bias ‖E[ĝ] − g‖ / ‖g‖", "√variance / ‖g‖")):
        ax.set_xticks([i + width * (len(recipes) - 1) / 2 for i in range(len(sets))], sets,
                      rotation=30, ha="right")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"weight-gradient error, {report.draws} draws")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
