"""The engine's decoder: lowbit's model forward (Llama, Qwen2, Qwen3, Qwen3-MoE) restated for
inference on the engine's weights and cache.

    logits = decoder.prefill(tokens, lengths)          # (B, T) right-padded prompts -> (B, V)
    logits = decoder.decode(tokens, positions)         # (B,) one token per row -> (B, V)

A decode step is, per layer (at one row in bf16 and W4A16, five launches on the kernels):

    qkv = W_qkv(x, norm=ln_1)                          # RMSNorm prologue
    y   = decode_attention(qkv, cache, positions)      # q/k norm, RoPE, cache write, attention
    x   = W_o(y, residual=x)                           # residual-add epilogue
    gu  = W_gate_up(x, norm=ln_2)
    x   = W_down(gu, silu_mul=True, residual=x)        # SiLU(gate) * up prologue

and an MoE layer routes instead (router, top-k) and runs its experts grouped. Each W is an
EngineLinear: the precision mode's activation quantization, then the GEMM on the stored weight.
Every piece goes through lowbit.dispatch.inference, which picks the Triton kernel or the plain
PyTorch reference; both round where the trainer's bf16 forward rounds, so they agree up to
accumulation order. Prefill runs the same GEMMs on all prompt tokens and causal attention over
the prompt itself (SDPA's flash path on CUDA), then writes the cache.

The decoder keeps no per-call state: the positions and the cache are the caller's, so one
CUDA graph of `decode` serves every step of every generate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.dispatch import inference
from lowbit.formats.linear_weight import LinearWeight
from lowbit.models.config import ModelConfig
from lowbit.models.transformer import rope_inv_freq
from lowbit.rl.engine.kv_cache import KVCache
from lowbit.rl.engine.weights import EngineLayer, EngineWeights

__all__ = ["Decoder", "rope_tables"]


class Decoder:
    def __init__(self, config: ModelConfig, weights: EngineWeights, cache: KVCache,
                 use_kernels: bool, pdl: bool) -> None:
        """cache: an MoE model's records each token's experts at its position (cache.routed);
        use_kernels: the inference kernels where they apply (else the PyTorch reference
        throughout); pdl: launch the decode kernels with programmatic dependent launch (no
        kernel of a step writes a weight)."""
        self.config, self.weights, self.cache = config, weights, cache
        self.use_kernels, self.pdl = use_kernels, pdl
        self.cos, self.sin_signed = rope_tables(config, weights.embed.device, weights.embed.dtype)
        self.lm_head = LinearWeight.dense(weights.lm_head)

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor,
                all_logits: bool = False) -> torch.Tensor:
        """Right-padded prompts tokens (B, T), row b's first lengths[b] tokens real: writes the
        cache (columns 0..T-1) and returns the logits at each row's last token (B, V), or at
        every position (B, T, V) with all_logits."""
        cfg, w = self.config, self.weights
        B, T = tokens.shape
        H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        eps, kw = cfg.norm_eps, dict(use_kernels=self.use_kernels)
        cos, sin = self.cos[:T][None, :, None], self.sin_signed[:T][None, :, None]   # (1, T, 1, D)
        x = F.embedding(tokens, w.embed)                                            # (B, T, C)
        for i, layer in enumerate(w.layers):
            qkv = layer.qkv_proj(x, norm=layer.input_layernorm, eps=eps, **kw).view(B, T, H + 2 * KV, D)
            qk, v = qkv[:, :, :H + KV], qkv[:, :, H + KV:]
            if layer.qk_norm is not None:
                qk = inference.prologue(qk, layer.qk_norm, eps)
            qk = inference.rotary(qk, cos, sin)                                      # (B, T, H + KV, D)
            q, k, v = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), v.transpose(1, 2)
            self.cache.write_prompt(i, k, v)
            # right padding: a row's real tokens see only real tokens before them
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=KV != H)
            x = layer.o_proj(y.transpose(1, 2).reshape(B, T, H * D), residual=x, **kw)
            x = self._mlp(i, layer, x, torch.arange(T, device=x.device).expand(B, T))
        if not all_logits:
            x = x[torch.arange(B, device=x.device), lengths - 1]                     # (B, C)
        return inference.linear(x.reshape(-1, cfg.dim), self.lm_head, norm=w.norm, eps=eps,
                                **kw).view(*x.shape[:-1], -1)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per row, tokens and positions (B,) (the row's length so far): writes the
        cache at the positions, returns the logits (B, V)."""
        cfg, w = self.config, self.weights
        eps, pdl, kw = cfg.norm_eps, self.pdl, dict(use_kernels=self.use_kernels)
        x = F.embedding(tokens, w.embed)                                            # (B, C)
        B = tokens.shape[0]   # each row's shared prompt (KVCache.share_prompts), if any
        prefix = dict(prefix_rows=self.cache.prefix_rows[:B], prefix_lens=self.cache.prefix_lens[:B])
        for i, layer in enumerate(w.layers):
            qkv = layer.qkv_proj(x, norm=layer.input_layernorm, eps=eps, pdl=pdl, **kw)
            y = inference.decode_attention(qkv, self.cache.k[i], self.cache.v[i], positions,
                                           self.cos, self.sin_signed, cfg.n_heads, cfg.n_kv_heads,
                                           layer.qk_norm, eps, pdl=pdl, **prefix, **kw)   # (B, H D)
            x = layer.o_proj(y, residual=x, pdl=pdl, **kw)
            x = self._mlp(i, layer, x, positions[:, None], pdl)
        return inference.linear(x, self.lm_head, norm=w.norm, eps=eps, pdl=pdl, **kw)

    def prepare(self) -> None:
        """Make what the GEMMs make of their weights on first use (inference.prepare_weights),
        before the decode step is compiled: its trace must find it made."""
        w = self.weights
        gemm = [lin.gemm_weight for layer in w.layers
                for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
                if lin is not None]
        inference.prepare_weights(gemm + [self.lm_head], self.use_kernels)

    def _mlp(self, i: int, layer: EngineLayer, x: torch.Tensor, positions: torch.Tensor,
             pdl: bool = False) -> torch.Tensor:
        """x + MLP(post_attention_layernorm(x)), x (..., C); an MoE layer records each token's
        experts at its position (positions: x's leading shape)."""
        eps, kw = self.config.norm_eps, dict(use_kernels=self.use_kernels)
        if layer.experts is None:
            gate_up = layer.gate_up_proj(x, norm=layer.post_attention_layernorm, eps=eps, pdl=pdl, **kw)
            return layer.down_proj(gate_up, silu_mul=True, residual=x, pdl=pdl, **kw)
        lead, C = x.shape[:-1], x.shape[-1]
        h = inference.prologue(x, layer.post_attention_layernorm, eps).reshape(-1, C)
        weights, index = self._route(layer, h)
        B = positions.shape[0]
        rows = torch.arange(B, device=x.device)[:, None].expand_as(positions)
        self.cache.routed[i][rows, positions] = index.view(*positions.shape, -1)
        return x + layer.experts(h, index, weights, **kw).view(*lead, C)

    def _route(self, layer: EngineLayer, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """lowbit.models.moe.TopKRouter on the engine's router: (weights (N, k) in h's dtype,
        index (N, k))."""
        logits = F.linear(h, layer.router)                                         # (N, E)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, self.config.experts_per_token, dim=-1)
        if self.config.moe_norm_topk:   # Qwen3-MoE's norm_topk_prob
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), index


def rope_tables(cfg: ModelConfig, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin (max_seq_len, head_dim) in `dtype`: lowbit.models.RotaryEmbedding's
    float32 tables rounded as its forward rounds them (cos.to(x.dtype)), the sin's first half
    negated (exact) for inference.rotary."""
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
    t = torch.arange(cfg.max_seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs] * 2, dim=-1)
    sign = torch.cat([-torch.ones_like(inv_freq), torch.ones_like(inv_freq)])
    return emb.cos().to(dtype), (emb.sin() * sign).to(dtype)
