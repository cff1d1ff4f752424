"""lowbit's built-in recipes, each a named function registered under its name (importing
lowbit.recipes imports this module, which registers them, in this order)."""

from __future__ import annotations

from dataclasses import replace

from lowbit.formats import QuantSpec
from lowbit.recipes._config import Gemm, LinearRecipe, Recipe
from lowbit.recipes._registry import register_recipe

__all__ = ["bf16", "mxfp4", "nvfp4", "stable_fp4", "stable_fp4_1d", "stable_fp4_floor", "stable_fp4_nosr",
           "stable_fp4_b16", "stable_fp4_qk_fp4", "stable_fp4_fp8", "stable_fp4_dy1d", "stable_nvfp4_16x16",
           "stable_nvfp4_dy1d", "stable_fp4_dy16", "stable_fp4_dy8"]


def _spec(fmt, block, rule=None, sr=False, tensor_scale=None) -> QuantSpec:
    return QuantSpec.make(fmt, block, rule, "stochastic" if sr else "rne", tensor_scale)


# ---- the recipes --------------------------------------------------------------------------
#
# Each recipe says what it is and where it comes from; its evidence (what this project
# measured with it) lives in the results file its docstring names, not here.

def _operands(x: QuantSpec | None, w: QuantSpec | None, dy: QuantSpec | None,
              **kwargs) -> LinearRecipe:
    """A LinearRecipe that quantizes X, W and dY the same way in every GEMM they enter."""
    return LinearRecipe(fprop_x=x, fprop_w=w, dgrad_dy=dy, dgrad_w=w, wgrad_dy=dy, wgrad_x=x,
                        **kwargs)


@register_recipe("bf16")
def bf16() -> Recipe:
    """The baseline: the same modules and code path with quantization off."""
    return Recipe("bf16", None, note="Reference: every GEMM in high precision.")


@register_recipe("mxfp4")
def mxfp4() -> Recipe:
    """Naive MXFP4: 1x32 blocks, OCP floor scales, round-to-nearest, every operand of every
    GEMM: the unstable baseline of arXiv 2607.24953 (floor scales clip block maxima; 1D blocks
    give the forward and backward passes different weights).
    Evidence: docs/results/stable-fp4.md."""
    s = _spec("mxfp4", (1, 32), "floor")
    return Recipe("mxfp4", _operands(s, s, s), note="1D MXFP4 floor/RNE everywhere (naive baseline).")


@register_recipe("nvfp4")
def nvfp4() -> Recipe:
    """NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149): 1x16 NVFP4 (E4M3 block scales
    under an FP32 tensor scale) for all three GEMMs; weights in 16x16 2D tiles (fprop and dgrad
    share them); stochastic rounding on the output gradient dY; a 16x16 random Hadamard
    transform on both wgrad operands; the first and last transformer blocks in BF16. NVFP4's
    E4M3 scales do not fold into FP8 exactly, so on Hopper it is emulated (dequantize + BF16
    GEMM). Evidence: docs/results/stable-fp4.md."""
    x = _spec("nvfp4", (1, 16))
    w = _spec("nvfp4", (16, 16))
    dy = _spec("nvfp4", (1, 16), sr=True)
    return Recipe("nvfp4", _operands(x, w, dy, wgrad_hadamard=True), keep_first_last_blocks=1,
                  note="NVFP4 1x16, 16x16 weights, SR on dY, RHT on wgrad, first/last block BF16.")


def _stable(name: str, block: int = 32, two_d: bool = True, rule: str = "rceil",
            sr: bool = True, qk_fp8: bool = True, dy_1d: bool = False,
            fmt: str = "mxfp4", dy_block: int | None = None) -> Recipe:
    """The stable-fp4 family. fmt "mxfp4" (E8M0 scales under `rule`) or "nvfp4" (E4M3 scales
    under an FP32 tensor scale; no rule); dy_block: dY's block size where it differs from W's
    and X's (square tiles if two_d, 1 x dy_block with dy_1d)."""
    b = (block, block) if two_d else (1, block)
    g = dy_block or block
    gb = (1, g) if dy_1d else (g, g) if two_d else (1, g)
    scale_rule = rule if fmt != "nvfp4" else None
    x = w = _spec(fmt, b, scale_rule)
    linear = _operands(x, w, _spec(fmt, gb, scale_rule, sr=sr))
    overrides = ()
    if qk_fp8:
        e = _spec("mxfp8_e4m3", b, rule)
        qk = _operands(e, e, _spec("mxfp8_e4m3", gb, rule, sr=sr))
        overrides = (("*q_proj", qk), ("*k_proj", qk))
    scales = f"{rule} scales" if fmt != "nvfp4" else "E4M3 scales under an FP32 tensor scale"
    return Recipe(name, linear, overrides, note=(
        f"{fmt.upper()} {b[0]}x{b[1]} {scales} for W and X, {gb[0]}x{gb[1]} for dY; SR on dY: "
        f"{sr}; q/k in MXFP8: {qk_fp8}."))


@register_recipe("stable-fp4")
def stable_fp4() -> Recipe:
    """Stable FP4 training (arXiv 2607.24953): transposition-invariant block quantization. 2D
    32x32 tiles for W, X and dY (an operand and its transpose share scales, so forward and
    backward see bit-identical operands), truncation-free `rceil` power-of-two scales (nothing
    clips), stochastic rounding on dY, query/key projections in MXFP8. Its power-of-two scales
    fold exactly into FP8 E4M3 (stable-fp4-fp8). Evidence: docs/results/stable-fp4.md."""
    return _stable("stable-fp4")


@register_recipe("stable-fp4-1d")
def stable_fp4_1d() -> Recipe:
    """Ablation: stable-fp4 with 1x32 blocks (forward and backward operands differ).
    Evidence: docs/results/stable-fp4.md."""
    return _stable("stable-fp4-1d", two_d=False)


@register_recipe("stable-fp4-floor")
def stable_fp4_floor() -> Recipe:
    """Ablation: stable-fp4 with OCP floor scales instead of rceil (block maxima can clip).
    Evidence: docs/results/stable-fp4.md."""
    return _stable("stable-fp4-floor", rule="floor")


@register_recipe("stable-fp4-nosr")
def stable_fp4_nosr() -> Recipe:
    """Ablation: stable-fp4 with round-to-nearest on dY too (no stochastic rounding).
    Evidence: docs/results/stable-fp4.md."""
    return _stable("stable-fp4-nosr", sr=False)


@register_recipe("stable-fp4-b16")
def stable_fp4_b16() -> Recipe:
    """Ablation: stable-fp4 with 16x16 tiles instead of 32x32.
    Evidence: docs/results/stable-fp4.md."""
    return _stable("stable-fp4-b16", block=16)


@register_recipe("stable-fp4-qk-fp4")
def stable_fp4_qk_fp4() -> Recipe:
    """Ablation: stable-fp4 with the query/key projections in MXFP4 too.
    Evidence: docs/results/stable-fp4.md."""
    return _stable("stable-fp4-qk-fp4", qk_fp8=False)


@register_recipe("stable-fp4-fp8")
def stable_fp4_fp8() -> Recipe:
    """stable-fp4 with its MXFP4 GEMMs run exactly on FP8 tensor cores: the same FP4 operands,
    each block's power-of-two scale folded into E4M3 elements and a factor per row
    (lowbit.formats.fold), multiplied by torch._scaled_mm (on the CPU an FP32-accumulating
    emulation). The forward GEMM accumulates in the FP8 tensor cores' reduced precision
    (fast_accum, as Transformer Engine's FP8 recipes do); dgrad and wgrad promote partial sums
    to float32. On CUDA the operands come from the fused quantize-and-fold kernels without host
    syncs inside a step; a step whose one-chunk folds rounded values is redone exactly (see
    lowbit.train.fold_policy). The MXFP8 q/k projections and v_proj stay emulated: v_proj's
    output gradient weighs each token by the attention it receives, so along tokens (dW's K)
    its 32x32 tiles span more binades than one FP8 factor per row holds, and every step would
    be redone (`lowbit bench folds` shows which operands need it).
    Evidence: docs/results/training-speed.md (step time), docs/results/kernels.md (GEMM
    accumulation error)."""
    base = stable_fp4()
    return Recipe("stable-fp4-fp8", replace(base.linear, gemm=Gemm.FP8, fast_accum=("fprop",)),
                  (("*v_proj", base.linear), *base.overrides),
                  note=base.note + " GEMMs on FP8 tensor cores (fprop fast-accumulating), "
                  "v_proj's emulated.")


@register_recipe("stable-fp4-fp8-fast")
def stable_fp4_fp8_fast() -> Recipe:
    """Variant: stable-fp4-fp8 with dgrad and wgrad fast-accumulating too, for speed where the
    promoting FP8 GEMM is slow: an MoE's grouped FP8 GEMM (torch._scaled_grouped_mm) promotes
    at about half bf16's grouped speed on Hopper. The price is accumulation error over each
    GEMM's K (dgrad: the layer's output width; wgrad: the tokens, an expert's own for experts).
    Evidence: docs/results/training-speed.md (the grouped GEMMs), docs/results/kernels.md
    (fast accumulation's error)."""
    base = stable_fp4_fp8()
    return Recipe("stable-fp4-fp8-fast", replace(base.linear, fast_accum=("fprop", "dgrad", "wgrad")),
                  base.overrides, note=stable_fp4().note + " GEMMs on FP8 tensor cores (every GEMM "
                  "fast-accumulating), v_proj's emulated.")


@register_recipe("stable-fp4-dy1d")
def stable_fp4_dy1d() -> Recipe:
    """Variant: stable-fp4 with 2D tiles for W and X but 1x32 blocks for dY (along out
    features in dgrad, along tokens in wgrad): a 32x32 dY tile spans 32 tokens whose gradient
    magnitudes can differ by orders of magnitude, and its scale follows the largest; W and X
    keep their forward/backward consistency. Evidence: docs/results/stable-fp4.md."""
    return _stable("stable-fp4-dy1d", dy_1d=True)


# ---- 2D-tile variants that keep one quantized copy per operand ----------------------------
#
# A 32x32 dY tile spans 32 tokens and its power-of-two scale follows the largest of them
# (docs/results/stable-fp4.md, "Why stable-fp4 (32x32) trails here"). These keep the paper's
# idea, one quantized copy of an operand serving it and its transpose, and change what the
# tile costs dY: NVFP4's E4M3 scales (a block's max maps to 6, not into [3, 6]), a smaller
# tile, or 1D dY blocks.

@register_recipe("stable-nvfp4-16x16")
def stable_nvfp4_16x16() -> Recipe:
    """Variant: stable-fp4 with NVFP4 16x16 tiles for W, X and dY: E4M3 tile scales under an
    FP32 tensor scale (as NVIDIA's recipe scales), each operand still one quantized copy for
    both of its GEMMs; stochastic rounding on dY; q/k in MXFP8 16x16. Emulated GEMMs (E4M3
    scales do not fold into FP8 exactly). Evidence (docs/results/stable-fp4.md, 3 seeds, one
    H200, 2026-12-02): gap to bf16 +0.61% +- 0.83% at 10.2M (stable-fp4: +2.12% +- 1.99%) and
    +0.09% +- 1.44% at 97.5M, within noise at both; the best 2D recipe at 10M, not within
    bf16's seed spread on every seed at either size."""
    return _stable("stable-nvfp4-16x16", block=16, fmt="nvfp4")


@register_recipe("stable-nvfp4-dy1d")
def stable_nvfp4_dy1d() -> Recipe:
    """Variant: NVFP4 16x16 tiles for W and X (one copy each, forward and backward), 1x16 NVFP4
    blocks with stochastic rounding for dY: in dgrad one scale per token and 16 output
    features, in wgrad per output feature and 16 tokens, so dY's two copies differ (as in
    nvfp4, here without its Hadamard transform and BF16 first/last blocks); q/k in MXFP8.
    Evidence: docs/results/stable-fp4.md."""
    return _stable("stable-nvfp4-dy1d", block=16, fmt="nvfp4", dy_1d=True)


@register_recipe("stable-fp4-dy16")
def stable_fp4_dy16() -> Recipe:
    """Variant: stable-fp4 (MXFP4 32x32 rceil tiles for W and X) with 16x16 tiles for dY only,
    still one copy of dY for dgrad and wgrad. Evidence (docs/results/stable-fp4.md): worse than
    bf16 at 10.2M over 3 seeds (+1.54% +- 0.35%, paired t-test), no better than stable-fp4."""
    return _stable("stable-fp4-dy16", dy_block=16)


@register_recipe("stable-fp4-dy8")
def stable_fp4_dy8() -> Recipe:
    """Variant: stable-fp4 with 8x8 tiles for dY only (a tile spans 8 tokens). Evidence
    (docs/results/stable-fp4.md): worse than bf16 at 10.2M over 3 seeds (+1.62% +- 0.51%)."""
    return _stable("stable-fp4-dy8", dy_block=8)
