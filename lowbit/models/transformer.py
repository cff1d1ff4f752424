"""A LLaMA-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU), dense or MoE.

Module names follow Hugging Face's LlamaForCausalLM / Qwen3ForCausalLM / Qwen3MoeForCausalLM,
so their `state_dict()` keys are ours and one converter (or a module filter written against
Hugging Face names) works for both:

    model.embed_tokens
    model.layers[i].input_layernorm
    model.layers[i].self_attn.{q_proj, k_proj, v_proj, o_proj}   (+ q_norm, k_norm if qk_norm)
    model.layers[i].post_attention_layernorm
    model.layers[i].mlp.{gate_proj, up_proj, down_proj}            dense
    model.layers[i].mlp.gate, model.layers[i].mlp.experts          MoE (see moe.py)
    model.norm
    lm_head

RoPE uses Hugging Face's rotate_half layout (the two halves of a head, not interleaved
pairs), so converted checkpoints need no permutation of q_proj / k_proj.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.models.config import ModelConfig
from lowbit.models.moe import SparseMoeBlock


@dataclass
class ModelOutput:
    logits: torch.Tensor
    """(B, T, V) next-token logits."""
    loss: torch.Tensor | None
    """Scalar training loss: cross-entropy + moe_aux_loss_coef * aux_loss; None without targets."""
    aux_loss: torch.Tensor
    """Scalar load-balancing loss averaged over MoE layers (0 for a dense model)."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 and scale in the input dtype, as Hugging Face does, so bf16 models
        # match it bit for bit (on the CPU F.rms_norm is HF's x * rsqrt(mean(x^2) + eps), the
        # same bits; on CUDA it is one fused kernel forward and one backward, where the
        # operations written out were seven kernels forward, and more backward).
        x32 = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables (max_seq_len, head_dim), non-persistent so they never enter checkpoints."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta, self.scaling = head_dim, max_seq_len, theta, scaling
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        """(Re)compute the tables in fp32; also needed after building on the meta device."""
        device = self.cos.device if self.cos.device.type != "meta" else None
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, device)  # (D/2,)
        t = torch.arange(self.max_seq_len, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # (L, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (L, D): both halves share a frequency
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None,
                  device: torch.device | None = None) -> torch.Tensor:
    """RoPE's (head_dim/2,) float32 inverse frequencies theta^(-2i/head_dim), with LLaMA 3's
    rescaling when `scaling` is given: the one definition the model and the rollout engine share."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    return inv_freq if scaling is None else llama3_inv_freq(inv_freq, scaling)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """LLaMA 3.1's RoPE rescaling (Hugging Face's `_compute_llama3_parameters`): wavelengths
    longer than original_max / low_freq_factor are stretched by `factor`, shorter than
    original_max / high_freq_factor kept, and the band between interpolated smoothly."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D); cos, sin (T, D). Rotates channel i with channel i + D/2."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


@dataclass
class SharedPrompts:
    """A batch of completions whose prompts come in groups (GRPO's G samples of a prompt), run
    with each prompt once: the tokens are the Gp prompts (Gp, P), right-padded, then the
    B = Gp * G completions (B, Tc), flattened into one row (1, Gp * P + B * Tc). A prompt's
    tokens attend causally within it; a completion's attend to its group's prompt (its first
    prompt_lengths[g] positions) and causally to its own earlier tokens, at the positions
    they hold in prompt + completion. The same attention, so the same logits, as each row of
    prompt + completion run alone, with the prompt's work done once a group instead of G times."""

    prompt_lengths: torch.Tensor
    """(Gp,) int64, each prompt's tokens (1..P)."""
    prompt_len: int
    """P, the prompts' padded length."""
    completion_len: int
    """Tc, the completions' padded length."""
    group_size: int
    """G, completions a prompt."""
    group: torch.Tensor = field(init=False)
    """(B,) each completion's prompt; made once a forward (__post_init__), not once a layer."""
    mask: torch.Tensor = field(init=False)
    """(B, 1, Tc, P + Tc) bool: the keys a completion's token reads, its prompt's then its own."""

    def __post_init__(self) -> None:
        Gp, P, Tc, dev = self.prompt_lengths.shape[0], self.prompt_len, self.completion_len, self.prompt_lengths.device
        B = Gp * self.group_size
        self.group = torch.arange(B, device=dev) // self.group_size
        in_prompt = torch.arange(P, device=dev) < self.prompt_lengths[self.group][:, None]   # (B, P)
        causal = torch.ones(Tc, Tc, dtype=torch.bool, device=dev).tril()
        self.mask = torch.cat((in_prompt[:, None, :].expand(B, Tc, P), causal.expand(B, Tc, Tc)), dim=2)[:, None]

    def positions(self) -> torch.Tensor:
        """(N,) each token's position: 0..P-1 in a prompt, p_g + j for completion token j."""
        P, Tc, dev = self.prompt_len, self.completion_len, self.prompt_lengths.device
        prompt = torch.arange(P, device=dev).repeat(self.prompt_lengths.shape[0])
        completion = self.prompt_lengths[self.group][:, None] + torch.arange(Tc, device=dev)
        return torch.cat((prompt, completion.reshape(-1)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool,
               dropout_p: float = 0.0) -> torch.Tensor:
        """q (1, H, N, D), k and v (1, KV, N, D) of the flattened tokens -> (1, H, N, D)."""
        # the sizes from group and mask, not prompt_lengths: a compiled layer reads only what
        # it is given here, so it guards on no view's strides of the caller's lengths
        (B, _, Tc, _), P = self.mask.shape, self.prompt_len
        Gp = B // self.group_size
        Np = Gp * P

        def prompts(t):   # (Gp, heads, P, D)
            return t[0, :, :Np].unflatten(1, (Gp, P)).transpose(0, 1)

        def completions(t):   # (B, heads, Tc, D)
            return t[0, :, Np:].unflatten(1, (B, Tc)).transpose(0, 1)

        y_prompt = F.scaled_dot_product_attention(prompts(q), prompts(k), prompts(v), is_causal=True,
                                                  dropout_p=dropout_p, enable_gqa=gqa)
        keys = torch.cat((prompts(k)[self.group], completions(k)), dim=2)     # (B, KV, P + Tc, D)
        values = torch.cat((prompts(v)[self.group], completions(v)), dim=2)
        if gqa:
            # each KV head repeated for its H / KV query heads (enable_gqa's pairing), as
            # transformers' repeat_kv does under a mask: SDPA's fused kernels that take a mask
            # take no enable_gqa, so on CUDA it would fall back to the math kernel
            H = q.shape[1]
            keys, values = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (keys, values))
        y_completion = F.scaled_dot_product_attention(completions(q), keys, values, attn_mask=self.mask,
                                                      dropout_p=dropout_p)
        return torch.cat((y_prompt.transpose(0, 1).flatten(1, 2),
                          y_completion.transpose(0, 1).flatten(1, 2)), dim=1)[None]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.o_bias)
        # Identity when off: no parameters, so the state_dict has LLaMA's keys exactly.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                shared: SharedPrompts | None = None) -> torch.Tensor:
        """x (B, T, C); shared: x is SharedPrompts' one row of prompts then completions."""
        B, T, C = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim))  # (B, T, H, D)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim))  # (B, T, KV, D)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, KV, D)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        gqa = self.n_kv_heads != self.n_heads  # each KV head serves H / KV query heads
        dropout_p = self.dropout if self.training else 0.0
        if shared is not None:
            y = shared.attend(q, k, v, gqa, dropout_p)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                               enable_gqa=gqa)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H*D)
        return self.o_proj(y)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.is_moe = cfg.is_moe
        if cfg.is_moe:
            self.mlp = SparseMoeBlock(cfg.n_experts, cfg.dim, cfg.moe_ffn_dim, cfg.experts_per_token,
                                      norm_topk=cfg.moe_norm_topk)
        else:
            self.mlp = MLP(cfg.dim, cfg.ffn_dim, bias=cfg.mlp_bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                shared: SharedPrompts | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C) -> x (B, T, C), aux_loss (scalar; 0 for a dense layer)."""
        x = x + self.resid_dropout(self.self_attn(self.input_layernorm(x), cos, sin, shared))
        h = self.post_attention_layernorm(x)
        if self.is_moe:
            h, aux_loss = self.mlp(h)
        else:
            h, aux_loss = self.mlp(h), x.new_zeros((), dtype=torch.float32)
        return x + self.resid_dropout(h), aux_loss


class Decoder(nn.Module):
    """Hugging Face's `model` submodule: embeddings, layers, final norm (no output head)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta,
                                          cfg.rope_scaling)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor,
                shared: SharedPrompts | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """idx (B, T) -> hidden states (B, T, C), aux_loss averaged over MoE layers. shared:
        idx is its one row of prompts then completions, each token at its own position."""
        T = idx.shape[1]
        cos, sin = self.rotary_emb.cos[:T], self.rotary_emb.sin[:T]  # (T, D)
        if shared is not None:
            positions = shared.positions()
            cos, sin = self.rotary_emb.cos[positions], self.rotary_emb.sin[positions]  # (N, D)
        x = self.dropout(self.embed_tokens(idx))  # (B, T, C)
        aux_losses = []
        for layer in self.layers:
            x, aux_loss = layer(x, cos, sin, shared)
            if layer.is_moe:
                aux_losses.append(aux_loss)
        # Averaged rather than summed, so moe_aux_loss_coef means the same at every depth.
        aux = torch.stack(aux_losses).mean() if aux_losses else x.new_zeros((), dtype=torch.float32)
        return self.norm(x), aux


class Transformer(nn.Module):
    """Decoder-only language model; forward(idx, targets) -> ModelOutput."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """normal(0, init_std) for every matrix, init_std / sqrt(2 * n_layers) for the residual
        output projections (o_proj, down_proj, experts.down_proj), ones for norms.

        Called by __init__; call it again after `to_empty()` when the model was built on the
        meta device (e.g. for FSDP), which also rebuilds the RoPE tables.
        """
        cfg = self.config
        residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):  # input_layernorm, post_attention_layernorm, norm, q/k_norm
                nn.init.ones_(param)
            elif name.endswith(".bias"):
                nn.init.zeros_(param)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                nn.init.normal_(param, mean=0.0, std=residual_std)
            else:
                nn.init.normal_(param, mean=0.0, std=cfg.init_std)
        self.model.rotary_emb.reset()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None,
                prompts: tuple[torch.Tensor, torch.Tensor] | None = None) -> ModelOutput:
        """idx (B, T) token ids; targets (B, T) next-token ids, -100 where no loss is wanted.
        logits_at (B, K) positions (int64, < T): the logits of those positions only, (B, K, V),
        the lm_head run on nothing else (RL's log-probs of a completion need none of its
        prompt's); not with targets.

        prompts: (prompt_ids (Gp, P) right-padded, prompt_lengths (Gp,)) shared by groups of
        B / Gp consecutive rows of idx, which are then completions (B, Tc) that follow them:
        the logits that predict each completion token, (B, Tc, V), each prompt run once for its
        group (SharedPrompts); what `logits_at` at completion positions gives for the rows of
        prompt + completion (an MoE model's aux_loss then counts each prompt token once). Not
        with targets or logits_at."""
        if prompts is not None:
            return self._completion_logits(idx, *prompts, targets=targets, logits_at=logits_at)
        B, T = idx.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.config.max_seq_len}; "
                             f"shorten the input or build the model with a larger max_seq_len")
        if logits_at is not None and (targets is not None or logits_at.dim() != 2 or logits_at.shape[0] != B):
            raise ValueError(f"logits_at takes (B, K) = ({B}, K) positions and no targets; got "
                             f"{tuple(logits_at.shape)}{' with targets' if targets is not None else ''}")
        h, aux_loss = self.model(idx)  # (B, T, C), scalar
        if logits_at is not None:
            h = h.gather(1, logits_at[:, :, None].expand(-1, -1, h.shape[-1]))   # (B, K, C)
        logits = self.lm_head(h)  # (B, T or K, V)
        loss = None
        if targets is not None:
            # Cross-entropy in fp32 even under bf16 autocast: with an 8-bit mantissa the
            # log-softmax (and so the loss curve) would move in steps of ~0.4%.
            loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T), ignore_index=-100)
            if self.config.is_moe:
                loss = loss + self.config.moe_aux_loss_coef * aux_loss
        return ModelOutput(logits=logits, loss=loss, aux_loss=aux_loss)

    def _completion_logits(self, completions: torch.Tensor, prompt_ids: torch.Tensor,
                           prompt_lengths: torch.Tensor, targets=None, logits_at=None) -> ModelOutput:
        (Gp, P), (B, Tc) = prompt_ids.shape, completions.shape
        if targets is not None or logits_at is not None:
            raise ValueError("prompts (shared prompts) give the completions' logits; not with "
                             "targets or logits_at")
        if Gp == 0 or B % Gp or prompt_lengths.shape != (Gp,):
            raise ValueError(f"prompts: {Gp} prompts (with {tuple(prompt_lengths.shape)} lengths) "
                             f"for {B} completions; each prompt needs the same number of "
                             f"completions and one length")
        if P + Tc > self.config.max_seq_len:
            raise ValueError(f"prompts of {P} tokens and completions of {Tc} exceed "
                             f"max_seq_len={self.config.max_seq_len}")
        shared = SharedPrompts(prompt_lengths, P, Tc, B // Gp)
        tokens = torch.cat((prompt_ids.reshape(-1), completions.reshape(-1)))[None]   # (1, N)
        h, aux_loss = self.model(tokens, shared)   # (1, N, C)
        # completion token j is predicted at the token before it: its prompt's last for j = 0
        last = (torch.arange(Gp, device=h.device) * P + prompt_lengths - 1)[shared.group]   # (B,)
        rest = Gp * P + torch.arange(B, device=h.device)[:, None] * Tc + torch.arange(Tc - 1, device=h.device)
        at = torch.cat((last[:, None], rest), dim=1)   # (B, Tc)
        return ModelOutput(logits=self.lm_head(h[0, at]), loss=None, aux_loss=aux_loss)

    def compile_layers(self, dynamic: bool | None = None) -> None:
        """torch.compile each decoder layer in place (regional compilation, as torchtitan
        compiles its blocks). The layers run one code and their weights are the graph's inputs,
        so one compiled graph serves every layer: compiling costs one layer's time whatever the
        depth, where the whole model compiled inlines every layer (a Qwen3-0.6B shape's 28: about
        32 s against 186 s on a 2-core CPU, docs/results/rollout.md). The embedding, the final
        norm and the head stay eager; the state dict's keys do not change. dynamic=True: one
        graph for every sequence length (RL's change from step to step); sizes that are equal
        when first traced are taken as equal (torch's duck sizing), so the layer compiles once
        more on the first step they differ."""
        for layer in self.model.layers:
            layer.compile(dynamic=dynamic)

    def num_parameters(self) -> int:
        """Parameters actually held (a tied matrix counted once); equals config.num_parameters()."""
        return sum(p.numel() for p in self.parameters())


def build_model(cfg: ModelConfig) -> Transformer:
    """A freshly initialized model (on the current default device and dtype)."""
    return Transformer(cfg)
