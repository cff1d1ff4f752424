"""What a QAT run quantizes and how its gradients pass the quantizer: `QATConfig`.

The weights are a weight format in lowbit.formats' grammar (lowbit.formats.weight_format), of
which QAT trains these (`qat_weight_format` refuses the rest in one line):
    int2:g64   int3:g128   int4:row   int2:g64:asym   ternary   binary   seq2:g64   nvfp4   mxfp4
(and `bf16`, for `lowbit qat` only: the control run, the same fine-tuning with no quantization);
- intK (K = 2, 3, 4, 8): symmetric -(2^(K-1)-1)..2^(K-1)-1 (lowbit.formats' intK), or with
  `asym` codes 0..2^K-1 and a zero point per group;
- ternary ({-1, 0, 1} x absmean, BitNet b1.58), binary ({-1, 1} x absmean), seq2 ({+-0.5, +-1.5}
  x s, ParetoQ's 2-bit grid without zero);
- nvfp4 / mxfp4: the formats' own blocks and scales (1x16 E4M3 under an FP32 tensor scale,
  1x32 E8M0), recomputed from the weight at every forward;
- gG: one scale per G consecutive inputs of a row (G must divide the layer's in_features);
  `row`: one per output row. Default g128 (intK, ternary, binary, seq2).
Every refusal is a ValueError with one line that says what to do. A field that `lowbit qat`
sets declares its flag where it is declared (lowbit.config.flag).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from dataclasses import dataclass, field

from lowbit.config import flag, require
from lowbit.formats.weight_format import WeightFormat, parse_weight_format

__all__ = ["QATConfig", "JacQuantConfig", "ESTIMATORS", "QAT_FORMATS", "qat_weight_format",
           "parse_qat_spec", "parse_compare_arm"]

ESTIMATORS = ("ste", "clipped-ste", "lsq", "jacquant")
QAT_FORMATS = ("int2", "int3", "int4", "int8", "ternary", "binary", "seq2", "nvfp4", "mxfp4",
               "bf16")


def qat_weight_format(text: str) -> WeightFormat:
    """A `--weights` value (lowbit.formats' grammar) as the WeightFormat QAT trains: the
    formats and options in the module docstring; anything else is refused in one line."""
    try:
        fmt = parse_weight_format(text, check_block=False)
    except ValueError:
        head = str(text).strip().lower().split(":")[0]
        if head.startswith("int") and head[3:].isdigit():   # int5, int9: say which ints QAT trains
            raise ValueError(f"{head}: QAT takes int2, int3, int4 or int8 weights") from None
        raise
    if fmt.name not in QAT_FORMATS:
        raise ValueError(f"QAT takes no {fmt.name} weights; use one of "
                         f"{', '.join(QAT_FORMATS)}, e.g. int2:g64")
    if fmt.data_scaled:
        fmt.refuse(f"QAT's {fmt.name}", set(), f"{fmt.name} has its own blocks; write plain "
                   f"{fmt.name!r}")
        return fmt
    fmt.refuse("QAT", {"group", "asym"}, "QAT trains one scale per G inputs (gG) or per row")
    if fmt.group is not None and (not 8 <= fmt.group <= 4096 or fmt.group % 8):
        raise ValueError(f"group size {fmt.group} in {text!r}: use a multiple of 8 from 8 to "
                         "4096 (32-256 is usual), or `row`")
    if fmt.name != "bf16" and not fmt.row:
        fmt.spec()   # any block left the format cannot take
    return fmt


@dataclass(frozen=True)
class JacQuantConfig:
    """JacQuant's surrogate B of the quantizer's Jacobian (DESIGN.md section 3)."""

    refresh_every: int = field(default=100, metadata=flag(
        "--refresh-every", "jacquant: refit B every N steps (default: %(default)s)"))
    """Refit B every this many optimizer steps (the first fit after step 1); never in between."""
    b_max: float = field(default=2.0, metadata=flag(
        "--b-max", "jacquant: B's upper clamp (default: %(default)s)"))
    """B is clamped to [0, b_max]."""
    estimate: str = field(default="probe", metadata=flag(
        "--b-estimate", "jacquant: how B is fit (default: %(default)s)",
        choices=("probe", "dither", "both")))
    """"probe": random-sign perturbations of size eps * step; "dither": the slope of the
    uniformly dithered quantizer over a window of eps * step either side; "both": their mean."""
    eps: float = field(default=0.5, metadata=flag(
        "--b-eps", "jacquant: perturbation half-width in quantization steps (default: %(default)s)",
        metavar="B_EPS"))
    """Perturbation half-width in units of the quantization step (0.5: one full step wide)."""
    samples: int = field(default=2, metadata=flag(
        "--b-samples", "jacquant: probes per refresh (default: %(default)s)", metavar="B_SAMPLES"))
    """Random-sign probes per refresh (probe only; dither is deterministic)."""
    ema: float = field(default=0.5, metadata=flag(
        "--b-ema", "jacquant: EMA across refreshes (default: %(default)s)", metavar="B_EMA"))
    """B <- ema * B + (1 - ema) * fit at each refresh after the first."""
    per_element: bool = field(default=True, metadata=flag(
        "--b-per-element", "jacquant: one B per weight (the default), or with --no-b-per-element "
        "one per quantization group", action=argparse.BooleanOptionalAction))
    """One B per weight; False: one per quantization group. Per group, on the update, measured
    worse than STE at W2 (1.085x its gap; docs/results/jacquant.md)."""
    weighted: bool = field(default=True, metadata=flag(
        "--b-unweighted", "jacquant: no input second-moment weighting of a per-group B (per "
        "element the weighting cancels, so it has none)", action="store_false"))
    """Weight the fit by the layer's input second moments diag(E[x x^T]) (an EMA the layer keeps).
    Per group only: per element the weight cancels from each weight's own ratio (up to
    rounding, and but for channels whose moment is 0), so no moments are kept; MoE experts'
    B is unweighted."""
    moment_decay: float = 0.5
    """EMA decay of the input second moments across refits (each refit's moments come from the
    training step just before it: the steps in between record nothing)."""
    b_on: str = field(default="update", metadata=flag(
        "--b-on", "jacquant: B scales each optimizer step's change of the weight, with an STE "
        "backward (update), or the gradient in backward (grad; under AdamW it measures as STE "
        "does) (default: %(default)s)", choices=("grad", "update")))
    """Where B acts. "update" (the default): backward is the STE's, and each optimizer step's
    change of the latent weight is scaled by B (W <- W_prev + B * (W - W_prev)), which is what
    the gradient-side B does under plain SGD. "grad": B on the gradient, in backward
    dL/dW ~ B * dL/dW_hat; under Adam a B that holds still between refits is divided out again
    by the second-moment normalization, except where B is 0, and it measured as STE does."""
    shuffle_b: bool = field(default=False, metadata=flag(
        "--b-shuffled", "jacquant: a control; the B used is the fitted B permuted within each "
        "tensor at each refit (same values, no information about which weight)",
        action="store_true"))
    """A control: after each refit, the B used is the fitted (smoothed) B permuted at random
    within each tensor, so it keeps B's values and mean step size and loses which weight each
    belongs to. The permutation is drawn from (seed, refit index, tensor): resume-exact. The
    unshuffled B is kept (FakeQuantWeight.b_unshuffled) so the EMA smooths the fits themselves."""
    b_dtype: str = field(default="float32", metadata=flag(
        "--b-dtype", "jacquant: how B is stored; bfloat16 halves its memory (per element, as "
        "large as the weights), uint8 quarters it (B in steps of 1/floor(255 / --b-max); B on "
        "the update only) (default: %(default)s)", choices=("float32", "bfloat16", "uint8")))
    """B's storage (and the shuffled control's unshuffled B's). The EMA across refits is formed
    in float32 and rounded to this; bfloat16 keeps B to about 3 significant digits; uint8 holds
    B as a level k / n, n = floor(255 / b_max) levels per unit so that B = 1 is one (a step of
    1/127 at the default b_max 2.0; FakeQuantWeight.b_values decodes it), for B on the update
    only (on the gradient B would be decoded for every forward and kept for the backward).
    Both narrow forms are refused with an ema above 0.5, where a refit's step of (1 - ema) of
    the change would round away (B stalls short of the fits: in bfloat16 toward 0.8 from 1, at
    0.816 for ema 0.9, 0.992 for 0.99)."""
    b_in_adamw: bool = field(default=True, metadata=flag(
        "--b-in-adamw", "jacquant, B on the update: under AdamW, B inside the optimizer's step "
        "(one Triton launch for all the weights on CUDA; the default), or with --no-b-in-adamw a copy "
        "of the weights before each step and three passes after it (the way any other optimizer takes), e.g. to time "
        "the two", action=argparse.BooleanOptionalAction))
    """B on the update under torch.optim.AdamW: True, the prepared weights' step is AdamW's
    arithmetic with the change times B (lowbit.dispatch.adamw_step); False, the general way
    (lowbit.qat.layers.UpdateScaling: W <- W_before + B (W - W_before) around the optimizer's
    own step). The same training to float32 rounding; they differ in time."""

    @property
    def uint8_levels_per_unit(self) -> int:
        """A uint8 B's levels per unit of B: B = level / this, with B = 1 a level."""
        return max(1, math.floor(255 / self.b_max))

    def __post_init__(self) -> None:
        require(isinstance(self.refresh_every, int) and self.refresh_every >= 1,
                 f"refresh_every must be a positive integer (got {self.refresh_every!r})")
        require(math.isfinite(self.b_max) and self.b_max > 0,
                 f"b_max must be a positive number (got {self.b_max})")
        require(self.estimate in ("probe", "dither", "both"),
                 f"jacquant estimate must be probe, dither or both (got {self.estimate!r})")
        require(math.isfinite(self.eps) and 0 < self.eps <= 4,
                 f"eps must be in (0, 4] quantization steps (got {self.eps})")
        require(isinstance(self.samples, int) and self.samples >= 1,
                 f"samples must be a positive integer (got {self.samples!r})")
        require(0 <= self.ema < 1, f"ema must be in [0, 1) (got {self.ema})")
        require(0 <= self.moment_decay < 1, f"moment_decay must be in [0, 1) (got {self.moment_decay})")
        require(self.b_dtype in ("float32", "bfloat16", "uint8"),
                f"b_dtype must be float32, bfloat16 or uint8 (got {self.b_dtype!r})")
        require(self.b_dtype == "float32" or self.ema <= 0.5,
                f"a {self.b_dtype} B with --b-ema {self.ema} would stop moving (each refit's step, "
                f"(1 - ema) of the change, rounds away below half a {self.b_dtype} step); use "
                f"--b-ema 0.5 or less, or --b-dtype float32")
        require(self.b_dtype != "uint8" or self.b_max <= 255,
                f"a uint8 B holds at most 255 (got --b-max {self.b_max}); lower --b-max or use "
                "--b-dtype float32")
        require(self.b_dtype != "uint8" or self.b_on == "update",
                "a uint8 B acts on the update only (--b-on update); on the gradient use "
                "--b-dtype float32 or bfloat16")
        require(self.b_on in ("grad", "update"),
                 f"jacquant b_on must be grad or update (got {self.b_on!r})")


@dataclass(frozen=True)
class QATConfig:
    weights: str = field(default="int2:g32", metadata=flag(
        "--weights", "weight format: int2|int3|int4|int8 with :gG, :row, :asym; ternary, binary, "
        "seq2 (with :gG or :row); nvfp4, mxfp4 (default: %(default)s)"))
    """The weight format (see the module docstring)."""
    estimator: str = field(default="jacquant", metadata=flag(
        "--estimator", "gradient estimator (default: %(default)s)", choices=ESTIMATORS))
    """How gradients pass the quantizer: ste, clipped-ste, lsq or jacquant."""
    learn_scales: bool | None = field(default=None, metadata=flag(
        "--learn-scales", "learn the scales with LSQ's gradient (default: only for lsq)",
        action=argparse.BooleanOptionalAction))
    """Learn the scales (LSQ's gradient); None: only for lsq. nvfp4/mxfp4 scales are never learned."""
    scale_init: str = field(default="absmax", metadata=flag(
        "--scale-init", "initial scales from the weights (default: %(default)s)",
        choices=("absmax", "mse")))
    """Initial scales from the trained weights: "absmax" (the format's own rule: absmax/qmax,
    absmean for ternary/binary, min-max for asym) or "mse" (the per-group clipping ratio that
    minimizes the squared rounding error)."""
    jacquant: JacQuantConfig = field(default_factory=JacQuantConfig)
    distill: float = field(default=0.0, metadata=flag(
        "--distill", "distill from the high-precision source model: loss = (1 - ALPHA) * CE + "
        "ALPHA * KL(teacher || student) on the logits (ALPHA default 1 when given)",
        nargs="?", const=1.0, metavar="ALPHA"))
    """Weight alpha of distillation from the high-precision source model (lowbit.qat.distill):
    loss = (1 - alpha) * CE + alpha * T^2 * KL(teacher || student); 0: plain cross-entropy."""
    distill_temperature: float = field(default=1.0, metadata=flag(
        "--distill-temperature", "softmax temperature of the distillation KL (default: %(default)s)",
        metavar="T"))
    """T, the softmax temperature of both sides of the KL."""

    def __post_init__(self) -> None:
        fmt = self.format  # validates the text
        require(isinstance(self.distill, (int, float)) and 0 <= self.distill <= 1,
                 f"--distill must be in [0, 1], the KL term's weight (got {self.distill!r})")
        require(isinstance(self.distill_temperature, (int, float))
                 and math.isfinite(self.distill_temperature) and self.distill_temperature > 0,
                 f"--distill-temperature must be a positive number (got {self.distill_temperature!r})")
        require(self.estimator in ESTIMATORS,
                 f"unknown estimator {self.estimator!r}; use one of {', '.join(ESTIMATORS)}")
        require(self.scale_init in ("absmax", "mse"),
                 f"scale_init must be absmax or mse (got {self.scale_init!r})")
        if fmt.data_scaled:
            require(self.estimator != "lsq" and not self.learn_scales,
                     f"{fmt.grid} scales come from the weights at every forward, so there is no "
                     "step size to learn: use --estimator ste, clipped-ste or jacquant")
            require(self.scale_init == "absmax",
                     f"{fmt.grid} has its own scale rule; leave --scale-init at absmax")
        if isinstance(self.jacquant, dict):
            object.__setattr__(self, "jacquant", JacQuantConfig(**self.jacquant))

    @functools.cached_property   # parsed once per config (frozen: cached in its __dict__)
    def format(self) -> WeightFormat:
        """`weights` as the WeightFormat QAT trains (qat_weight_format)."""
        return qat_weight_format(self.weights)

    @property
    def scales_learned(self) -> bool:
        if self.format.data_scaled:
            return False
        return self.estimator == "lsq" if self.learn_scales is None else bool(self.learn_scales)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> QATConfig:
        d = dict(d)
        d["jacquant"] = JacQuantConfig(**d.get("jacquant", {}))
        return cls(**d)


_SPEC_OPTIONS = ("kK (refit B every K steps), epsE (probe half-width), probe|dither|both, elem "
                 "(per-element B, the default) or group, upd (B on the update, the default) or grad, "
                 "shuffled (B permuted within each tensor: a control), bf16b or u8b (B stored in bfloat16 "
                 "or uint8), around (B on the update around AdamW's step, not inside it), "
                 "learned (learned scales), "
                 "mse (MSE scales), kd or kdA (distill from the BF16 model with weight A, default 1)")


def parse_qat_spec(text: str) -> QATConfig:
    """'WEIGHTS/ESTIMATOR[/OPTION...]' -> its QATConfig: the one spelling of a QAT setting that
    `lowbit bench train --recipes qat/...` and benchmarks/qat_experiment.py take, e.g.
    int2:g64/jacquant/k100/mse. Options: kK, epsE, probe|dither|both, elem|group, upd|grad,
    shuffled, bf16b|u8b, around, learned, mse, kd[A] (distillation with weight A, default 1: QATConfig.distill)."""
    parts = [p.strip() for p in text.strip().split("/")]
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise ValueError(f"{text!r}: write a QAT setting as WEIGHTS/ESTIMATOR[/OPTION...], "
                         "e.g. int2:g64/jacquant/k100/mse")
    jq, qat = _setting_options(parts[2:], text, "QAT setting")
    return QATConfig(weights=parts[0], estimator=parts[1], jacquant=JacQuantConfig(**jq), **qat)


def parse_compare_arm(text: str, base: QATConfig) -> tuple[QATConfig, float]:
    """One arm of `lowbit qat --compare`, 'ESTIMATOR[/OPTION...]' -> (its QATConfig, its
    learning-rate multiplier). The options are parse_qat_spec's, applied on top of `base` (the
    config the other flags give; the arm's own options win), plus `lrxM`: this arm trains at M
    times --lr, e.g. ste/lrx1.5. B's options (kK, epsE, ..., shuffled) need estimator jacquant."""
    parts = [p.strip() for p in text.strip().split("/")]
    if not parts[0] or parts[0] not in ESTIMATORS:
        raise ValueError(f"unknown estimator {parts[0]!r} in --compare arm {text!r}; write "
                         f"ESTIMATOR[/OPTION...] with one of {', '.join(ESTIMATORS)}, e.g. ste/lrx1.5")
    multiplier, options = 1.0, []
    for option in parts[1:]:
        if option[:3] == "lrx":
            if not (_is_number(option[3:]) and math.isfinite(float(option[3:]))
                    and float(option[3:]) > 0):
                raise ValueError(f"{option!r} in --compare arm {text!r}: write the learning-rate "
                                 "multiplier as lrxM with M a positive number, e.g. ste/lrx1.5")
            multiplier = float(option[3:])
        else:
            options.append(option)
    jq, qat = _setting_options(options, text, "--compare arm")
    if jq and parts[0] != "jacquant":
        raise ValueError(f"--compare arm {text!r}: its options set jacquant's B, which "
                         f"{parts[0]} does not use; leave them out, or write jacquant/...")
    jacquant = dataclasses.replace(base.jacquant if parts[0] == "jacquant" else JacQuantConfig(), **jq)
    return dataclasses.replace(base, estimator=parts[0], jacquant=jacquant, **qat), multiplier


def _setting_options(options: list[str], text: str, what: str) -> tuple[dict, dict]:
    """The options of a setting string: (JacQuantConfig fields, QATConfig fields)."""
    jq: dict = {}
    qat: dict = {}
    for option in options:
        number = option[1:] if option[:1] == "k" else option[3:] if option[:3] == "eps" else ""
        if option[:1] == "k" and number.isdigit():
            jq["refresh_every"] = int(number)
        elif option[:3] == "eps" and _is_number(number):
            jq["eps"] = float(number)
        elif option in ("probe", "dither", "both"):
            jq["estimate"] = option
        elif option in ("elem", "group"):
            jq["per_element"] = option == "elem"
        elif option in ("upd", "grad"):
            jq["b_on"] = "update" if option == "upd" else "grad"
        elif option == "shuffled":
            jq["shuffle_b"] = True
        elif option in ("bf16b", "u8b"):
            jq["b_dtype"] = "bfloat16" if option == "bf16b" else "uint8"
        elif option == "around":
            jq["b_in_adamw"] = False
        elif option == "learned":
            qat["learn_scales"] = True
        elif option == "mse":
            qat["scale_init"] = "mse"
        elif option[:2] == "kd" and (option == "kd" or _is_number(option[2:])):
            qat["distill"] = 1.0 if option == "kd" else float(option[2:])
        elif option[:3] == "lrx":
            raise ValueError(f"{option!r} in {what} {text!r}: a learning-rate multiplier is an arm "
                             "option of lowbit qat --compare (e.g. --compare ste,ste/lrx1.5); "
                             "elsewhere set the learning rate itself (--lr)")
        else:
            raise ValueError(f"unknown option {option!r} in {what} {text!r}; use {_SPEC_OPTIONS}")
    return jq, qat


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


