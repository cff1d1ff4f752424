"""The inference kernels' one place of choice: the rollout engine's GEMMs, activation
quantizers and decode attention, each on its Triton kernel or on plain PyTorch.

    y = inference.linear(x, weight, norm=ln)                # a LinearWeight, RMSNorm prologue
    x_hat, r_hat = inference.quantize_activations(x, "nvfp4", rac_ratio=0.25)
    x_hat, _ = inference.quantize_activations(x, "nvfp4", input_amax=amax)   # static scale
    codes, scale = inference.quantize_activations(x, "fp8")
    y = inference.fp8_linear(codes, scale, weight)          # torch._scaled_mm on CUDA
    y = inference.decode_attention(qkv, k_cache, v_cache, positions, ...)
    y = inference.grouped_linear(x, experts, expert_of_row, row_div=k)   # MoE experts

The rule: the kernels run where the caller allows them (`use_kernels`, the engine's
`decode_kernels`), triton can run them (a CUDA tensor; a CPU tensor under TRITON_INTERPRET=1,
Triton's interpreter, which is how the CPU tests run the engine on its kernels) and the
reference is not forced (`force_reference()`, LOWBIT_FORCE_REFERENCE=1); everything else takes
the reference. (The engine allows them on CUDA by default and on the CPU only when asked.) One
exception is made for speed, not numerics: a dense (bf16) weight with more than one row on
CUDA goes to cuBLAS (DENSE_KERNEL_MAX_ROWS says why). While torch.compile traces a step, the
kernels are called as custom operators (lowbit.kernels.engine_ops: the same functions, each one
opaque node of the graph), and `prepare_weights` makes beforehand what they make on first use.

The references are the engine's eager decoder, op by op: every prologue, GEMM and epilogue
rounds to the compute dtype where the kernels do, so the two agree up to accumulation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit import kernels
from lowbit.dispatch import reference_forced
from lowbit.formats import activations as reference_activations
from lowbit.formats.linear_weight import LinearWeight, WeightStorage

__all__ = ["use_inference_kernels", "linear", "quantize_activations", "fp8_linear",
           "decode_attention", "rotary", "grouped_linear", "expert_groups", "prologue",
           "prepare_weights", "DENSE_KERNEL_MAX_ROWS"]

DENSE_KERNEL_MAX_ROWS = 1
"""A dense weight with more rows than this multiplies on cuBLAS: the kernel's one-row tile
keeps up with cuBLAS and fuses the norm and the residual, its tensor-core tiles do not yet
(`python benchmarks/tune.py engine-gemm`; docs/results/rollout.md)."""


def use_inference_kernels(x: torch.Tensor, allowed: bool = True) -> bool:
    """The inference kernels run on x: allowed, triton able to run them on x's device (see the
    module doc), the reference not forced."""
    return allowed and not reference_forced() and kernels.kernels_available(x)


def _kernels(module):
    """The kernels' module, or while torch.compile traces a step, lowbit.kernels.engine_ops: the
    same functions as custom operators, each kept whole in the compiled graph (that module says
    why)."""
    if torch.compiler.is_compiling():
        from lowbit.kernels import engine_ops
        return engine_ops
    return module


def prepare_weights(weights: list[LinearWeight], use_kernels: bool = True) -> None:
    """Make now what the kernels make of a weight on first use (an NVFP4 weight's tiles,
    LinearWeight.tiles) and what the reference keeps (a dense weight's reference_values, the
    weight itself): before a step is compiled, whose trace must find them made, not make them
    at every call."""
    for weight in weights:
        if weight.format is WeightStorage.NVFP4 and use_inference_kernels(weight.data, use_kernels):
            from lowbit.kernels.nvfp4_tiles import nvfp4_tiles_triton
            weight.tiles(nvfp4_tiles_triton)
        elif weight.format is WeightStorage.DENSE:
            weight.reference_values()


def prologue(x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 1e-6,
             silu_mul: bool = False) -> torch.Tensor:
    """What a prologue makes of x, in plain PyTorch: the engine's RMSNorm `norm * rms_norm(x)`
    (F.rms_norm normalizes in float32 and rounds once; the weight multiplies after, in x's
    dtype), or SiLU(gate) * up of x = [gate | up]; else x."""
    if norm is not None:
        return norm * F.rms_norm(x, (x.shape[-1],), eps=eps)
    if silu_mul:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return x


def linear(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None, *,
           x2: torch.Tensor | None = None, norm: torch.Tensor | None = None, eps: float = 1e-6,
           silu_mul: bool = False, residual: torch.Tensor | None = None, pdl: bool = False,
           use_kernels: bool = True) -> torch.Tensor:
    """(prologue(x) + x2) @ W^T (+ bias) (+ residual), (M, K_in) -> (M, N) in x's dtype: the
    packed-weight kernel (lowbit.kernels.engine_linear) or the reference (the prologue, then
    F.linear on the dequantized weight, x2's GEMM added, each rounded as the eager ops round)."""
    dense_prefill = (weight.format is WeightStorage.DENSE and x.is_cuda
                     and x.shape[0] > DENSE_KERNEL_MAX_ROWS)
    if use_inference_kernels(x, use_kernels) and not dense_prefill:
        from lowbit.kernels import activation_quant, engine_linear
        if (weight.format is WeightStorage.NVFP4 and (norm is not None or silu_mul)
                and weight.in_features > activation_quant.MAX_K):
            # rows longer than the activation pass holds: the NVFP4 kernel's prologue in torch
            x, norm, silu_mul = prologue(x, norm, eps, silu_mul), None, False
        return _kernels(engine_linear).linear(x, weight, bias, x2=x2, norm=norm, eps=eps,
                                              silu_mul=silu_mul, residual=residual, pdl=pdl)
    y = _gemm(prologue(x, norm, eps, silu_mul), x2, weight.reference_values())
    if bias is not None:
        y = y + bias
    return y if residual is None else residual + y


def _gemm(x: torch.Tensor, x2: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T, or with RAC's residual x2 (x + x2) @ w^T as the kernel forms it: both products
    exact in one float32 sum, rounded once. w: a weight's reference_values -- in x's dtype, or
    float32 for NVFP4, which multiplies in float32 and rounds once to x's dtype. With x2, a
    16-bit w on CUDA takes two cuBLAS GEMMs with float32 outputs, summed and rounded once (no
    copy of the weight); elsewhere one GEMM over [x | x2] and [w | w]."""
    if x2 is not None:
        if x.dim() == 2 and x.dtype == w.dtype and _float32_mm(x):
            y = torch.mm(x, w.t(), out_dtype=torch.float32)
            return (y + torch.mm(x2, w.t(), out_dtype=torch.float32)).to(x.dtype)
        x, w = torch.cat([x, x2], dim=-1), torch.cat([w, w], dim=-1)
    return F.linear(x.to(w.dtype), w).to(x.dtype)


_FLOAT32_MM: dict = {}
"""Per device and dtype: torch.mm takes out_dtype=float32 for these 16-bit operands (CUDA)."""


def _float32_mm(x: torch.Tensor) -> bool:
    """torch.mm(..., out_dtype=torch.float32) runs on x's device and dtype: asked once, the
    first time (outside any CUDA-graph capture: the engine's warm-up steps come first)."""
    key = (x.device, x.dtype)
    if key not in _FLOAT32_MM:
        ok = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
        if ok:
            try:
                probe = torch.ones(1, 1, dtype=x.dtype, device=x.device)
                ok = torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
            except (RuntimeError, TypeError):
                ok = False
        _FLOAT32_MM[key] = ok
    return _FLOAT32_MM[key]


def quantize_activations(x: torch.Tensor, mode: str, rac_ratio: float = 0.0, *,
                         norm: torch.Tensor | None = None, eps: float = 1e-6,
                         silu_mul: bool = False, input_amax: torch.Tensor | None = None,
                         rac_group: int = 0, rac_fold: bool = False, use_kernels: bool = True):
    """A linear's input quantized after its prologue (lowbit.formats.activations): mode
    "nvfp4" -> (x_hat, r_hat or None), the NVFP4 values and RAC's compensated residual
    (rac_ratio > 0) in x's dtype -- per token, or with input_amax (the layer's calibrated
    amax, float32, one element) under its one static FP32 scale as a served checkpoint
    (static_nvfp4; RAC's residual keeps its per-token pre-scale); mode "fp8" -> (E4M3 codes,
    (M, 1) float32 power-of-two scales). rac_group: RAC's channels chosen over the whole row
    (0) or group by group (rac_residual's `group`). rac_fold: with RAC, (rac_folded(x_hat,
    r_hat), None), the residual added into the one GEMM operand. One fused pass on the kernels."""
    if input_amax is not None and mode != "nvfp4":
        raise ValueError(f"a static input scale (input_amax) is NVFP4's; mode {mode!r} has none")
    reference_activations.check_rac_group(rac_group)   # on either path
    k = x.shape[-1] // 2 if silu_mul else x.shape[-1]
    if use_inference_kernels(x, use_kernels):
        from lowbit.kernels import activation_quant
        if k <= activation_quant.MAX_K:   # longer rows than one program holds: the reference
            return _kernels(activation_quant).quantize_activations(
                x, mode, rac_ratio, norm=norm, eps=eps, silu_mul=silu_mul, input_amax=input_amax,
                rac_group=rac_group, rac_fold=rac_fold)
    xp = prologue(x, norm, eps, silu_mul)
    if mode == "fp8":
        return reference_activations.per_token_fp8(xp)
    x_hat = (reference_activations.per_token_nvfp4(xp) if input_amax is None else
             reference_activations.static_nvfp4(xp, input_amax))
    if not reference_activations.rac_channel_count(k, rac_ratio):   # no channel: as the kernel, no residual
        return x_hat, None
    r_hat = reference_activations.rac_residual(xp, x_hat, rac_ratio, rac_group)
    return (reference_activations.rac_folded(x_hat, r_hat), None) if rac_fold else (x_hat, r_hat)


def fp8_linear(codes: torch.Tensor, scale: torch.Tensor, weight: LinearWeight,
               bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
               use_kernels: bool = True) -> torch.Tensor:
    """W8A8: (codes * scale) @ W^T (+ bias) (+ residual) for per-token FP8 activations and a
    row-scaled FP8 weight, out in the weight's compute dtype. On CUDA torch._scaled_mm with
    row-wise scales (what vLLM runs for FP8 checkpoints on Hopper; exact products, float32
    accumulation); elsewhere the same values multiplied in float32."""
    dtype = weight.dtype
    N, K = weight.out_features, weight.in_features
    if (use_inference_kernels(codes, use_kernels) and codes.is_cuda and K % 16 == 0
            and N % 16 == 0 and dtype == torch.bfloat16):
        w = weight.data.view(torch.float8_e4m3fn)
        y = torch._scaled_mm(codes, w.t(), scale_a=scale, scale_b=weight.row_scales[None, :],
                             out_dtype=dtype)
    else:
        y = F.linear(reference_activations.fp8_values(codes, scale, dtype), weight.reference_values())
    if bias is not None:
        y = y + bias
    return y if residual is None else residual + y


def decode_attention(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                     n_heads: int, n_kv_heads: int, qk_norm: torch.Tensor | None = None,
                     eps: float = 1e-6, pdl: bool = False, use_kernels: bool = True,
                     prefix_rows: torch.Tensor | None = None,
                     prefix_lens: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step's attention, (B, (H + 2 KV) D) q|k|v -> (B, H D): q/k norm, RoPE at
    each row's position, the new k and v written at that position of the row's cache, and
    attention over the row's positions 0..p (lowbit.kernels.decode_attention). prefix_rows,
    prefix_lens ((B,), both or neither): row b reads positions below prefix_lens[b] from cache
    row prefix_rows[b], a shared prompt's one copy. The reference attends over the whole cache
    with a mask: the fixed shapes a compiled step needs."""
    if use_inference_kernels(qkv, use_kernels):
        from lowbit.kernels import decode_attention as kernel
        return _kernels(kernel).decode_attention(qkv, k_cache, v_cache, positions, cos, sin_signed,
                                                 n_heads, n_kv_heads, qk_norm=qk_norm, eps=eps, pdl=pdl,
                                                 prefix_rows=prefix_rows, prefix_lens=prefix_lens)
    if (prefix_rows is None) != (prefix_lens is None):
        raise ValueError("prefix_rows and prefix_lens go together: give both or neither")
    B = qkv.shape[0]
    H, KV, D = n_heads, n_kv_heads, k_cache.shape[-1]
    qkv = qkv.view(B, H + 2 * KV, D)
    qk, v = qkv[:, :H + KV], qkv[:, H + KV:]
    if qk_norm is not None:
        qk = qk_norm * F.rms_norm(qk, (D,), eps=eps)
    qk = rotary(qk, cos[positions][:, None], sin_signed[positions][:, None])     # (B, H + KV, D)
    rows = torch.arange(B, device=qkv.device)
    k_cache[rows, :, positions] = qk[:, H:]
    v_cache[rows, :, positions] = v
    L = k_cache.shape[2]
    visible = torch.arange(L, device=qkv.device)[None, :] <= positions[:, None]    # (B, L)
    bias = torch.zeros(B, 1, 1, L, dtype=qkv.dtype, device=qkv.device)
    bias.masked_fill_(~visible[:, None, None, :], float("-inf"))
    # columns past a row's position hold what earlier generates left (maybe NaN): zeroed, so
    # only the row's own tokens reach the products
    hidden = ~visible[:, None, :, None]
    keys, values = k_cache[:B], v_cache[:B]
    if prefix_rows is not None:   # the prompt's columns from the row that holds it
        shared = (torch.arange(L, device=qkv.device)[None, :] < prefix_lens[:, None])[:, None, :, None]
        keys = torch.where(shared, k_cache[prefix_rows], keys)
        values = torch.where(shared, v_cache[prefix_rows], values)
    keys = keys.masked_fill(hidden, 0.0)
    values = values.masked_fill(hidden, 0.0)
    # the H / KV query heads that share a KV head are that head's queries (HF's repeat_kv
    # order: head h reads KV head h // (H / KV)), so the cache is read as it is
    q = qk[:, :H].reshape(B, KV, H // KV, D)
    y = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias)
    return y.reshape(B, H * D)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1): the same products, as
    cat(x2, x1) = roll(x, D/2) times the sin whose first half is negated."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def expert_groups(x: torch.Tensor, expert_of_row: torch.Tensor, n_experts: int,
                  use_kernels: bool = True):
    """The rows grouped by expert once for a layer's expert GEMMs (grouped_linear's `groups`):
    on the kernels the device-side tiles of lowbit.kernels.engine_linear.moe_align, else None."""
    if use_inference_kernels(x, use_kernels):
        from lowbit.kernels import engine_linear
        return engine_linear.moe_align(expert_of_row, n_experts)
    return None


def grouped_linear(x: torch.Tensor, weight: LinearWeight, expert_of_row: torch.Tensor,
                   row_div: int = 1, *, x2: torch.Tensor | None = None, silu_mul: bool = False,
                   groups=None, use_kernels: bool = True) -> torch.Tensor:
    """Expert GEMMs: out[r] = (prologue(x[r // row_div]) + x2[r // row_div]) @ W[e_r]^T for
    e_r = expert_of_row[r]; weight a stack of experts (E, N, K) -> (rows, N). On the kernels,
    one launch for all experts, each expert's weight read once for all its rows, grouped on
    the device (no host read-back, so it fits in a CUDA graph; `groups`: expert_groups' result,
    to group once for several GEMMs); the reference loops over the experts that have rows."""
    rows = expert_of_row.shape[0]
    if use_inference_kernels(x, use_kernels):
        from lowbit.kernels import engine_linear
        tile_expert, row_ids = groups or engine_linear.moe_align(expert_of_row, weight.n_experts)
        return engine_linear.grouped_linear(x, weight, tile_expert, row_ids, rows, row_div,
                                            x2=x2, silu_mul=silu_mul)
    src = torch.arange(rows, device=x.device) // row_div
    out = torch.empty(rows, weight.out_features, dtype=x.dtype, device=x.device)
    values = weight.reference_values()
    order = torch.argsort(expert_of_row, stable=True)
    counts = torch.bincount(expert_of_row, minlength=weight.n_experts).tolist()
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        r = order[start:start + count]
        out[r] = _gemm(prologue(x[src[r]], silu_mul=silu_mul),
                       None if x2 is None else x2[src[r]], values[e])
        start += count
    return out
