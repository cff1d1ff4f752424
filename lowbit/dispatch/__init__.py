"""The one place that chooses between the Triton kernels and the reference numerics.

    q = dispatch.quantize(x, "nvfp4")                   # what lowbit.quantize is
    qs = dispatch.quantize_rows(w, spec, [n1, n2])      # runs of rows, each its own tensor scale
    x_hat = dispatch.quantize_dequantize(x, spec)       # fake quantization (emulated GEMMs)
    w_hat, _ = dispatch.grid_fake_quantize(w, s, None, element, 64)   # QAT's, under given scales
    r = dispatch.rotated_fake_quantize(t, spec, signs)  # nvfp4's wgrad operands (RHT + quantize)
    a, a_t = dispatch.quantize_fold(x, spec, transpose_too=True)   # FP8-GEMM operands
    logp, entropy = dispatch.token_logprobs(logits, targets, temperature)   # RL's, (N, V) logits
    dispatch.adamw_step(params, grads, ...)   # AdamW's step (the clip's coefficient, B: optional)
    optimizer = dispatch.AdamW(groups, lr=3e-4)         # torch's fused AdamW, stepped by adamw_step

The rule: a CUDA tensor takes the kernels (lowbit.kernels) when triton imports, the kernels
cover the spec (`lowbit.kernels.supports`) and the reference is not forced (inside
`force_reference()`, or with LOWBIT_FORCE_REFERENCE=1 in the environment); everything else
takes the reference (lowbit.formats). CPU tensors always do, even under TRITON_INTERPRET=1,
where the kernels could run on them: the reference must stay the oracle the CPU tests check
the interpreted kernels against. Both give the same bits under round-to-nearest; stochastic
rounding draws torch.rand in the reference and Philox in the kernels (the seed contract of
lowbit/kernels/quantize.py).

Layers: lowbit.formats (references) <- lowbit.kernels <- this package <- lowbit.ops. Nothing
below imports it. Its fold_check module holds the per-thread state of the FP8 folds; the rule
and the quantizers above live in _quantizers, where a test that makes CPU tensors take the
kernels patches `use_kernels`.
"""

from lowbit.dispatch._quantizers import (
    force_reference, grid_fake_quantize, quantize, quantize_dequantize, quantize_fold, quantize_rows,
    quantize_with_spec, reference_forced, rotated_fake_quantize, segment_tensor_scales, use_kernels,
)
from lowbit.dispatch.logprobs import token_logprobs
from lowbit.dispatch.optimizer import AdamW, adamw_step, lr_tensor, new_adamw_state

__all__ = ["quantize", "quantize_with_spec", "quantize_rows", "quantize_dequantize", "grid_fake_quantize",
           "rotated_fake_quantize", "quantize_fold", "use_kernels", "force_reference", "reference_forced",
           "segment_tensor_scales", "adamw_step", "AdamW", "new_adamw_state", "lr_tensor", "token_logprobs"]
