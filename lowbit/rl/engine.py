"""The rollout engine: an inference implementation of lowbit's decoder with its own weights.

    engine = RolloutEngine(model_config, precision="nvfp4", rac_ratio=0.25, device="cuda")
    engine.load_state_dict(policy.state_dict())        # copies, then quantizes on arrival
    rollout = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=64,
                                                      stop_token_ids=(10,), seed=0))
    rollout.completions, rollout.logprobs, rollout.routed_experts

It is to the trainer what vLLM is to verl: a separate object that holds its own copy of the
weights (by Hugging Face parameter names: lowbit's models, Llama, Qwen2, Qwen3, Qwen3-MoE), never the
trainer's modules or tensors, so it may sit on another device. Weights are stored as the
precision mode says (lowbit.rl.precision: bf16, fp8, nvfp4-w4a16, nvfp4, nvfp4 + RAC);
attention, norms, the router, the embeddings, the output head and the KV cache stay in the
compute dtype (bf16 on CUDA, float32 on the CPU).

Batching. Prompts are left-padded to a common length and the cache is one preallocated tensor
per layer, (max_batch_size, kv_heads, max_seq_len, head_dim), written at the same column for
every row: a pad column is masked out of attention, and each row's RoPE position is its column
minus its padding, so every row computes what it would alone from position 0 (the trainer's
right-padded teacher forcing sees the same positions). Prefill runs all prompt tokens in one
forward; each decode step feeds one token per row. On CUDA a dense model's decode step (the
forward from the token ids to the logits) replays from a CUDA graph captured per batch size;
sampling runs eagerly between replays. At batch 1 (bf16, nvfp4-w4a16) that step runs on the
fused decode kernels of lowbit.kernels.decode, five launches per layer (decode_kernels), each
started while the one before it finishes on Hopper (programmatic dependent launch). MoE
decode runs eagerly (its expert grouping reads counts back to the host, which a graph cannot
hold).

Per token it returns the log-probability of what it sampled (lowbit.rl.sampling) and, for MoE
models, the experts each token was routed to in each layer (for routing replay, verl's R3).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowbit import kernels
from lowbit.models.config import ModelConfig
from lowbit.models.transformer import rope_inv_freq
from lowbit.rl.precision import EngineLinear, Precision, parse_precision
from lowbit.rl.sampling import SamplingParams, sample_next

__all__ = ["RolloutEngine", "Rollout", "COMPILE_MODES", "decode_kernels_fit"]

# torch.compile modes a decode step may be compiled with (compile_decode): those without
# inductor's own CUDA graphs, since the engine captures the step itself
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


def _decode_kernels():
    """lowbit.kernels.decode, imported on first use (it imports triton)."""
    from lowbit.kernels import decode
    return decode


@dataclass
class Rollout:
    """What one generate() call produced, one row per prompt."""

    prompts: list[list[int]]
    completions: torch.Tensor
    """(B, Tc) int64 sampled tokens, 0 after a row's end (Tc = the longest completion)."""
    completion_mask: torch.Tensor
    """(B, Tc) bool, True on a row's sampled tokens (its stop token included)."""
    logprobs: torch.Tensor
    """(B, Tc) float32, the engine's log-probability of each sampled token (0 where masked)."""
    stopped: torch.Tensor
    """(B,) bool, the row ended on a stop token (False: it reached max_new_tokens)."""
    routed_experts: torch.Tensor | None
    """MoE only: (B, T, n_layers, k) int64 experts each position was routed to, positions
    counted from the row's first prompt token (prompt, then completion), -1 where there is
    none (padding, and the last sampled token, which was never fed back)."""
    seconds: float
    """Wall time of the call (prefill, decode, sampling)."""

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(dim=1)

    @property
    def generated_tokens(self) -> int:
        return int(self.completion_mask.sum())

    def completion_lists(self) -> list[list[int]]:
        return [row[mask].tolist() for row, mask in zip(self.completions.cpu(),
                                                        self.completion_mask.cpu())]


class _Layer:
    """One decoder layer's weights as the engine holds them: the projections that read the
    same input fused into one GEMM each (q|k|v, gate|up; see EngineLinear.fused)."""

    def __init__(self) -> None:
        self.input_layernorm = self.post_attention_layernorm = None
        self.qk_norm = None                                             # (H + KV, D): q_norm, k_norm
        self.qkv_proj = self.o_proj = None
        self.gate_up_proj = self.down_proj = None                       # dense
        self.router = None                                              # MoE: (E, C)
        self.experts_gate_up: list[EngineLinear] = []                  # MoE: per expert
        self.experts_down: list[EngineLinear] = []


def decode_kernels_fit(config: ModelConfig, precision: str | Precision) -> bool:
    """The fused decode kernels cover this model and precision: a dense decoder with an even
    head_dim, and weights the GEMM multiplies by unquantized activations (bf16, nvfp4-w4a16)."""
    return (not config.is_moe and config.head_dim % 2 == 0
            and parse_precision(precision) in (Precision.BF16, Precision.NVFP4_W4A16))


class RolloutEngine:
    def __init__(self, config: ModelConfig, precision: str | Precision = "bf16",
                 rac_ratio: float = 0.0, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, max_batch_size: int = 64,
                 max_seq_len: int | None = None, cuda_graph: bool | None = None,
                 compile_decode: bool | str = False, decode_kernels: bool | None = None) -> None:
        """config: the decoder's shape (lowbit.models.ModelConfig); precision: bf16, fp8,
        nvfp4-w4a16 or nvfp4; rac_ratio: the fraction of input channels RAC compensates (nvfp4
        only); dtype: compute dtype (default bf16 on CUDA, float32 elsewhere); max_batch_size
        and max_seq_len (default config.max_seq_len): the KV cache's size, allocated here;
        cuda_graph: replay decode steps from CUDA graphs (default: on CUDA, dense models);
        compile_decode: compile the decode step with torch.compile (inductor, compiled once per
        batch size; on CUDA before its graph is captured; dense models only); True for
        torch.compile's default mode, or a mode's name (e.g. "max-autotune-no-cudagraphs", which
        autotunes the GEMMs and may fuse their epilogues; the engine captures the graph itself,
        so modes that add inductor's own CUDA graphs are refused); decode_kernels: run decode
        steps of up to lowbit.kernels.decode.MAX_ROWS rows on the fused decode kernels (a layer
        in five launches, attention over the filled cache only; bf16 and nvfp4-w4a16, dense
        models; default: on CUDA when triton imports, for batch 1 only, where they are faster;
        True: for every batch up to MAX_ROWS), which take precedence over compile_decode at
        those batch sizes."""
        self.config = config
        self.precision = parse_precision(precision)
        if not 0.0 <= rac_ratio <= 1.0:
            raise ValueError(f"rac_ratio must be in [0, 1] (got {rac_ratio}); e.g. 0.25 compensates "
                             "a quarter of the input channels")
        if rac_ratio and self.precision is not Precision.NVFP4:
            raise ValueError(f"RAC compensates NVFP4 activations, so rac_ratio needs precision "
                             f"nvfp4 (got {self.precision.value})")
        self.rac_ratio = float(rac_ratio)
        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len or config.max_seq_len
        if self.max_seq_len > config.max_seq_len:
            raise ValueError(f"max_seq_len {self.max_seq_len} exceeds the model's RoPE tables "
                             f"(config.max_seq_len={config.max_seq_len})")
        self.cuda_graph = (self.device.type == "cuda" and not config.is_moe
                           if cuda_graph is None else cuda_graph)
        if self.cuda_graph and (self.device.type != "cuda" or config.is_moe):
            raise ValueError("cuda_graph needs a dense model on a CUDA device (MoE expert "
                             "grouping reads counts back to the host)")
        if compile_decode and config.is_moe:
            raise ValueError("compile_decode needs a dense model (MoE expert grouping reads "
                             "counts back to the host)")
        if isinstance(compile_decode, str) and compile_decode not in COMPILE_MODES:
            raise ValueError(f"compile_decode mode {compile_decode!r}: use one of "
                             f"{', '.join(COMPILE_MODES)} (the engine captures its own CUDA graphs)")
        self.compile_decode = compile_decode
        self._compiled_decode = None
        kernels_fit = decode_kernels_fit(config, self.precision)
        if decode_kernels and not kernels_fit:
            raise ValueError("decode_kernels needs a dense model with an even head_dim and "
                             f"precision bf16 or nvfp4-w4a16 (got {self.precision.value}"
                             f"{', MoE' if config.is_moe else ''}); leave it off")
        if decode_kernels and not kernels.kernels_available(torch.empty(0, device=self.device)):
            raise ValueError("decode_kernels needs triton and a CUDA device (or TRITON_INTERPRET=1 "
                             "on the CPU, which is slow)")
        self.decode_kernels = (kernels_fit and self.device.type == "cuda" and kernels.triton_importable()
                               if decode_kernels is None else bool(decode_kernels))
        self.decode_kernels_max_batch = 0
        """The largest decode batch that runs on the kernels: ENGINE_MAX_ROWS (one row, where
        they are faster) by default, every size they take (MAX_ROWS) when asked for explicitly."""
        self.decode_pdl = False
        """The decode kernels launch with programmatic dependent launch (on Hopper and newer:
        each starts while the one before it finishes). Read when a step is captured or run."""
        if self.decode_kernels:
            kd = _decode_kernels()
            self.decode_kernels_max_batch = kd.MAX_ROWS if decode_kernels else kd.ENGINE_MAX_ROWS
            self.decode_pdl = kd.pdl_supported(self.device)
        self.cos, self.sin_signed = _rope_tables(config, self.device, self.dtype)
        B, L, KV, D = max_batch_size, self.max_seq_len, config.n_kv_heads, config.head_dim
        # The preallocated cache, one (B, KV, L, D) key and value tensor per layer.
        self.k_cache = [torch.zeros(B, KV, L, D, device=self.device, dtype=self.dtype)
                        for _ in range(config.n_layers)]
        self.v_cache = [torch.zeros_like(k) for k in self.k_cache]
        # padded to 16 columns (see _attention_bias); columns past max_seq_len stay False
        self.key_valid = torch.zeros(B, -(-L // 16) * 16, dtype=torch.bool, device=self.device)
        self.routed = (torch.full((config.n_layers, B, L, config.experts_per_token), -1,
                                  dtype=torch.int64, device=self.device) if config.is_moe else None)
        self.layers: list[_Layer] = []
        self.embed = self.norm = self.lm_head = None
        self._graphs: dict[int, _DecodeGraph] = {}
        self.loaded = False
        self.graph_note: str | None = None
        """Why CUDA-graph decode (and compile_decode) was turned off after a failed capture
        (None: it was not)."""

    # ---- weights --------------------------------------------------------------------------

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Take a state dict by Hugging Face parameter names: every tensor is copied to the
        engine's device and dtype, then quantized as the precision mode says. The engine keeps
        no reference to the given tensors. Missing or unexpected keys are refused."""
        cfg = self.config
        sd = _fuse_hf_experts(dict(state_dict), cfg)
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise ValueError(f"state dict has no {name!r}; the engine's model has "
                                 f"{cfg.n_layers} layers, dim {cfg.dim}"
                                 + (f", {cfg.n_experts} experts" if cfg.is_moe else ""))
            used.add(name)
            return sd[name]

        def plain(name: str) -> torch.Tensor:
            return take(name).detach().to(device=self.device, dtype=self.dtype, copy=True)

        def linear(*names: str, bias: bool = False) -> EngineLinear:
            # bias: the config says these projections have one (Qwen2's q/k/v; attention_bias,
            # mlp_bias), named as their weights are
            biases = [take(n.removesuffix("weight") + "bias") for n in names] if bias else None
            return EngineLinear.fused([take(n) for n in names], self.precision, self.rac_ratio,
                                      self.device, self.dtype, biases)

        self.embed = plain("model.embed_tokens.weight")
        layers = []
        for i in range(cfg.n_layers):
            p, layer = f"model.layers.{i}.", _Layer()
            layer.input_layernorm = plain(p + "input_layernorm.weight")
            layer.post_attention_layernorm = plain(p + "post_attention_layernorm.weight")
            layer.qkv_proj = linear(*(p + f"self_attn.{n}_proj.weight" for n in "qkv"), bias=cfg.qkv_bias)
            layer.o_proj = linear(p + "self_attn.o_proj.weight", bias=cfg.o_bias)
            if cfg.qk_norm:   # one per-head weight for q's and k's heads side by side
                layer.qk_norm = torch.cat([plain(p + "self_attn.q_norm.weight").expand(cfg.n_heads, -1),
                                           plain(p + "self_attn.k_norm.weight").expand(cfg.n_kv_heads, -1)])
            if cfg.is_moe:
                layer.router = plain(p + "mlp.gate.weight")
                gate_up, down = take(p + "mlp.experts.gate_up_proj"), take(p + "mlp.experts.down_proj")
                # each expert quantized on its own (its own NVFP4 tensor scale), as
                # lowbit.nn.QuantExperts fake-quantizes them in the trainer
                layer.experts_gate_up = [EngineLinear(gate_up[e], self.precision, self.rac_ratio,
                                                      self.device, self.dtype)
                                         for e in range(cfg.n_experts)]
                layer.experts_down = [EngineLinear(down[e], self.precision, self.rac_ratio,
                                                   self.device, self.dtype)
                                      for e in range(cfg.n_experts)]
            else:
                layer.gate_up_proj = linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight",
                                            bias=cfg.mlp_bias)
                layer.down_proj = linear(p + "mlp.down_proj.weight", bias=cfg.mlp_bias)
            layers.append(layer)
        self.layers = layers
        self.norm = plain("model.norm.weight")
        if "lm_head.weight" in sd:
            self.lm_head = plain("lm_head.weight")
        elif cfg.tie_embeddings:
            self.lm_head = self.embed
        else:
            take("lm_head.weight")
        unexpected = sorted(k for k in sd if k not in used and not k.endswith("rotary_emb.inv_freq"))
        if unexpected:
            raise ValueError(f"state dict has keys the engine's model does not: "
                             f"{', '.join(unexpected[:4])}{' ...' if len(unexpected) > 4 else ''}")
        self._graphs.clear()   # the graphs read the old weight tensors
        self.loaded = True

    def weight_bytes(self) -> int:
        """Bytes of the stored linear-layer weights (packed in the quantizing modes)."""
        total = 0
        for layer in self.layers:
            for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj,
                        *layer.experts_gate_up, *layer.experts_down):
                total += lin.nbytes if lin is not None else 0
        return total

    def linear_values(self, layer: int, name: str) -> torch.Tensor:
        """What the engine multiplies for a dense projection, by its Hugging Face name (q_proj,
        k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj): (out, in), dequantized in the
        quantizing modes; a view into the fused GEMM's weight where the engine fuses it."""
        where = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0),
                 "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
        if name not in where:
            raise ValueError(f"unknown projection {name!r}; use one of {', '.join(where)}")
        fused, part = where[name]
        lin = getattr(self.layers[layer], fused)
        if lin is None:
            raise ValueError(f"layer {layer} has no dense {name} (an MoE layer's experts are "
                             "in experts_gate_up / experts_down)")
        return lin.part(part)

    # ---- the decoder ----------------------------------------------------------------------

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, cols: torch.Tensor,
                 n_keys: int, all_logits: bool = False) -> torch.Tensor:
        """tokens, positions (B, T) at cache columns cols (T,) -> logits (B, V) of the last
        position, or (B, T, V) with all_logits. Attends over cache columns [0, n_keys)."""
        cfg = self.config
        B, T = tokens.shape
        H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        cos = self.cos[positions][:, :, None]                           # (B, T, 1, D)
        sin = self.sin_signed[positions][:, :, None]
        bias = self._attention_bias(B, cols, n_keys)                    # (B, 1, T, n_keys)
        x = F.embedding(tokens, self.embed)                             # (B, T, C)
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.input_layernorm, cfg.norm_eps)
            qkv = layer.qkv_proj(h).view(B, T, H + 2 * KV, D)
            qk, v = qkv[:, :, :H + KV], qkv[:, :, H + KV:]              # q's and k's heads, v's
            if layer.qk_norm is not None:
                qk = _rms_norm(qk, layer.qk_norm, cfg.norm_eps)
            qk = _rotary(qk, cos, sin)                                  # (B, T, H + KV, D)
            self.k_cache[i][:B].index_copy_(2, cols, qk[:, :, H:].transpose(1, 2))
            self.v_cache[i][:B].index_copy_(2, cols, v.transpose(1, 2))
            keys, values = self.k_cache[i][:B, :, :n_keys], self.v_cache[i][:B, :, :n_keys]
            if T == 1:
                # one query per head: the H / KV heads that share a KV head become that head's
                # queries (HF's repeat_kv order: head h reads KV head h // (H / KV)), so the
                # cache is read as it is, never repeated per head
                q = qk[:, 0, :H].reshape(B, KV, H // KV, D)
                y = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias)  # (B, KV, H/KV, D)
            else:
                y = F.scaled_dot_product_attention(
                    qk[:, :, :H].transpose(1, 2), keys, values, attn_mask=bias,
                    enable_gqa=KV != H).transpose(1, 2)                 # (B, T, H, D)
            x = x + layer.o_proj(y.reshape(B, T, H * D))
            h = _rms_norm(x, layer.post_attention_layernorm, cfg.norm_eps)
            if cfg.is_moe:
                h = self._moe(i, layer, h, cols)
            else:
                gate, up = layer.gate_up_proj(h).chunk(2, dim=-1)
                h = layer.down_proj(F.silu(gate) * up)
            x = x + h
        x = _rms_norm(x if all_logits else x[:, -1], self.norm, cfg.norm_eps)
        return F.linear(x, self.lm_head)

    def _attention_bias(self, B: int, cols: torch.Tensor, n_keys: int) -> torch.Tensor:
        """The additive attention mask (B, 1, T, n_keys) in the compute dtype: 0 where a key is
        visible, -inf elsewhere. A key is visible when it is a real token at or before the
        query's column; a padding query sees itself only (its output is never used, but must
        stay finite). Built once per forward (SDPA would convert a boolean mask in every
        layer), with rows 16 columns apart so SDPA's memory-efficient kernel need not pad it."""
        T = cols.shape[0]
        width = -(-n_keys // 16) * 16
        if T == 1:
            # decode: the query's column is already marked valid and no later one is (prefill
            # cleared them), so the visible keys are the valid ones
            visible = self.key_valid[:B, None, None, :width]
        else:
            key_cols = torch.arange(width, device=self.device)
            causal = key_cols[None, :] <= cols[:, None]                 # (T, width)
            visible = ((self.key_valid[:B, None, :width] | (key_cols[None, :] == cols[:, None])[None])
                       & causal[None])[:, None]
        bias = torch.full(visible.shape, -math.inf, dtype=self.dtype, device=self.device)
        return bias.masked_fill_(visible, 0.0)[..., :n_keys]

    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        """One decode step (tokens, positions (B, 1) at cache column col (1,)) -> logits (B, V),
        over the whole cache: the fixed shapes a CUDA graph or a compiled step needs."""
        return self._forward(tokens, positions, col, self.max_seq_len)

    def uses_decode_kernels(self, batch: int) -> bool:
        """A decode step of `batch` rows runs on lowbit.kernels.decode."""
        return self.decode_kernels and batch <= self.decode_kernels_max_batch

    def _decode_fused(self, tokens: torch.Tensor, positions: torch.Tensor,
                      col: torch.Tensor) -> torch.Tensor:
        """_decode on lowbit.kernels.decode: five launches per layer, attention over the cache
        columns up to col only (read on the GPU, so one CUDA graph still serves every step)."""
        kd, cfg = _decode_kernels(), self.config
        eps, pdl = cfg.norm_eps, self.decode_pdl   # no kernel of the step writes a weight
        x = F.embedding(tokens[:, 0], self.embed)                      # (B, C)
        for i, layer in enumerate(self.layers):
            qkv = kd.linear(x, layer.qkv_proj.values, layer.qkv_proj.bias,
                            norm=layer.input_layernorm, eps=eps, pdl=pdl)   # (B, (H + 2 KV) D)
            y = kd.attention(qkv, self.k_cache[i], self.v_cache[i], self.key_valid, positions,
                             col, self.cos, self.sin_signed, cfg.n_heads, cfg.n_kv_heads,
                             layer.qk_norm, eps, pdl=pdl)                   # (B, H D)
            x = kd.linear(y, layer.o_proj.values, layer.o_proj.bias, residual=x, pdl=pdl)
            gate_up = kd.linear(x, layer.gate_up_proj.values, layer.gate_up_proj.bias,
                                norm=layer.post_attention_layernorm, eps=eps, pdl=pdl)
            x = kd.linear(gate_up, layer.down_proj.values, layer.down_proj.bias,
                          silu_mul=True, residual=x, pdl=pdl)
        return kd.linear(x, self.lm_head, norm=self.norm, eps=eps, pdl=pdl)   # (B, V)

    def _decode_step(self, batch: int):
        """The decode step for `batch` rows: the fused decode kernels where they apply, else
        _decode, compiled with compile_decode. The weights and the cache are read as inputs of
        the compiled graph (never baked in), so a weight sync does not recompile it."""
        if self.uses_decode_kernels(batch):
            return self._decode_fused
        if not self.compile_decode:
            return self._decode
        if self._compiled_decode is None:
            # inductor without its own CUDA graphs: the engine captures the step itself
            mode = None if self.compile_decode is True else self.compile_decode
            self._compiled_decode = torch.compile(self._decode, dynamic=False,
                                                  mode=None if mode == "default" else mode)
        return self._compiled_decode

    def _moe(self, i: int, layer: _Layer, h: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """lowbit.models.moe's routing and expert grouping, on the engine's expert weights;
        records each token's experts at its cache column."""
        B, T, C = h.shape
        k = self.config.experts_per_token
        x = h.reshape(B * T, C)
        logits = F.linear(x, layer.router)                                      # (N, E)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, k, dim=-1)                           # (N, k)
        if self.config.moe_norm_topk:   # as TopKRouter (Qwen3-MoE's norm_topk_prob)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        self.routed[i, :B].index_copy_(1, cols, index.view(B, T, k))
        out = torch.zeros_like(x)
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of_slot, weight_of_slot = order // k, weights.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=self.config.n_experts).tolist()
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of_slot[start:start + count]
            gate, up = layer.experts_gate_up[e](x[tokens]).chunk(2, dim=-1)
            y = layer.experts_down[e](F.silu(gate) * up) * weight_of_slot[start:start + count, None]
            out.index_add_(0, tokens, y.to(out.dtype))
            start += count
        return out.view(B, T, C)

    # ---- generation -----------------------------------------------------------------------

    def _prepare(self, prompts: list[list[int]], new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.loaded:
            raise ValueError("the engine has no weights yet; call load_state_dict first")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt, each of at least one token")
        B, Tp = len(prompts), max(len(p) for p in prompts)
        if B > self.max_batch_size:
            raise ValueError(f"{B} prompts exceed the engine's max_batch_size={self.max_batch_size}")
        if Tp + new_tokens > self.max_seq_len:
            raise ValueError(f"prompt length {Tp} + {new_tokens} new tokens exceeds the engine's "
                             f"max_seq_len={self.max_seq_len}")
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for p in prompts for t in p):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if self.cuda_graph and new_tokens > 1:
            # captured before the cache is filled: its warm-up runs write cache column 0
            self._graph(B)
        pad = torch.tensor([Tp - len(p) for p in prompts], device=self.device)   # (B,)
        tokens = torch.tensor([[0] * (Tp - len(p)) + list(p) for p in prompts], device=self.device)
        cols = torch.arange(Tp, device=self.device)
        self.key_valid[:B] = False
        self.key_valid[:B, :Tp] = cols[None, :] >= pad[:, None]
        if self.routed is not None:
            self.routed[:, :B] = -1
        return tokens, pad

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        """Sample a completion for each prompt (lists of token ids)."""
        t0 = time.perf_counter()
        tokens, pad = self._prepare(prompts, params.max_new_tokens)
        B, Tp = tokens.shape
        cols = torch.arange(Tp, device=self.device)
        positions = (cols[None, :] - pad[:, None]).clamp(min=0)
        logits = self._forward(tokens, positions, cols, Tp)                    # prefill
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        stop = torch.tensor(params.stop_token_ids or [-1], device=self.device)
        alive = torch.ones(B, dtype=torch.bool, device=self.device)
        out_tokens, out_logprobs, out_alive = [], [], []
        graph = self._graphs.get(B) if self.cuda_graph else None
        # A dense model reads "is any row alive?" one step late, so the host queues the next
        # step before it waits on the last: the GPU never idles on a round trip. The one extra
        # step after every row ended samples only masked tokens, trimmed below. (MoE decode
        # reads expert counts back every step anyway, and records the routing of every fed
        # token, so it checks at once.)
        late = not self.config.is_moe
        any_alive = None                             # (host flag, its copy's CUDA event or None)
        for step in range(params.max_new_tokens):
            token, logprob = sample_next(logits, params, generator)
            token = torch.where(alive, token, torch.zeros_like(token))
            out_tokens.append(token), out_logprobs.append(logprob), out_alive.append(alive)
            alive = alive & ~torch.isin(token, stop)
            if step + 1 == params.max_new_tokens:
                break
            if not late:
                if not bool(alive.any()):
                    break
            else:
                if any_alive is not None:
                    if any_alive[1] is not None:
                        any_alive[1].synchronize()
                    if not bool(any_alive[0]):
                        break
                flag = alive.any().to("cpu", non_blocking=True)
                event = None
                if self.device.type == "cuda":
                    event = torch.cuda.Event()
                    event.record()
                any_alive = (flag, event)
            col = Tp + step
            if graph is not None:
                logits = graph.replay(token, col - pad, col)
            else:
                col_t = torch.tensor([col], device=self.device)
                self.key_valid[:B, col] = True
                if self.compile_decode or self.uses_decode_kernels(B):
                    logits = self._decode_step(B)(token[:, None], (col - pad)[:, None], col_t)
                else:
                    logits = self._forward(token[:, None], (col - pad)[:, None], col_t, col + 1)
        mask = torch.stack(out_alive, dim=1)
        if late:   # the columns sampled after every row had ended
            n = int(mask.any(0).nonzero().max()) + 1
            out_tokens, out_logprobs, mask = out_tokens[:n], out_logprobs[:n], mask[:, :n]
        completions = torch.stack(out_tokens, dim=1) * mask
        logprobs = torch.stack(out_logprobs, dim=1) * mask
        routed = None
        if self.routed is not None:
            routed = self._routed_by_position(pad, Tp, mask)
        return Rollout([list(p) for p in prompts], completions, mask, logprobs, ~alive, routed,
                       time.perf_counter() - t0)

    def _routed_by_position(self, pad: torch.Tensor, Tp: int, mask: torch.Tensor) -> torch.Tensor:
        """The routing buffer (layers, B, cols, k) re-indexed from cache columns to positions
        from each row's first token: (B, T, layers, k), -1 where nothing was routed."""
        B, Tc = mask.shape
        n_cols = Tp + Tc
        routed = self.routed[:, :B, :n_cols].permute(1, 2, 0, 3)                # (B, cols, L, k)
        positions = torch.arange(n_cols, device=self.device)[None, :] + pad[:, None]
        valid = positions < n_cols
        idx = positions.clamp(max=n_cols - 1)
        out = routed.gather(1, idx[:, :, None, None].expand_as(routed))
        out = torch.where(valid[:, :, None, None], out, torch.full_like(out, -1))
        # completion tokens after a row's end were fed (as 0) but are not part of it
        seq_len = (Tp - pad)[:, None] + mask.sum(1, keepdim=True)               # (B, 1)
        beyond = torch.arange(n_cols, device=self.device)[None, :] >= seq_len
        return torch.where(beyond[:, :, None, None], torch.full_like(out, -1), out)

    @torch.no_grad()
    def score(self, sequences: list[list[int]], temperature: float = 1.0) -> list[torch.Tensor]:
        """Teacher-forced log-probs under the engine's numerics, one full-sequence forward:
        for each sequence s, log softmax(logits / T)[s[t+1]] for t < len(s) - 1 (float32)."""
        tokens, pad = self._prepare(sequences, 0)
        B, T = tokens.shape
        cols = torch.arange(T, device=self.device)
        positions = (cols[None, :] - pad[:, None]).clamp(min=0)
        logits = self._forward(tokens, positions, cols, T, all_logits=True).float()
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        out = []
        for b, seq in enumerate(sequences):
            p = int(pad[b])
            lp = logp[b, p:T - 1].gather(-1, tokens[b, p + 1:, None])[:, 0]
            out.append(lp)
        return out

    # ---- CUDA graphs ----------------------------------------------------------------------

    def _graph(self, batch: int) -> "_DecodeGraph | None":
        if batch not in self._graphs:
            try:
                self._graphs[batch] = _DecodeGraph(self, batch)
            except Exception as e:   # noqa: BLE001 -- any capture failure: run eagerly
                what = "CUDA-graph decode" + (" and compile_decode" if self.compile_decode else "")
                self.cuda_graph = self.compile_decode = False
                self.graph_note = f"{what} turned off: capture failed ({e})"
                return None
        return self._graphs[batch]


class _DecodeGraph:
    """One decode step (tokens -> logits) of batch size B captured in a CUDA graph; replay()
    fills its static inputs. The column being written is an input tensor too, so one graph
    serves every step: attention spans the whole cache, masked to the valid columns."""

    def __init__(self, engine: RolloutEngine, batch: int) -> None:
        self.engine, dev = engine, engine.device
        self.tokens = torch.zeros(batch, 1, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(batch, 1, dtype=torch.int64, device=dev)
        self.col = torch.zeros(1, dtype=torch.int64, device=dev)
        # the warm-up runs write cache column `col` (0 here); generate() replays at real
        # columns afterwards, and prefill rewrites column 0, so nothing they leave is read
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream(dev).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()

    def _step(self) -> torch.Tensor:
        e = self.engine
        B = self.tokens.shape[0]
        e.key_valid[:B].index_fill_(1, self.col, True)
        return e._decode_step(B)(self.tokens, self.positions, self.col)

    def replay(self, tokens: torch.Tensor, positions: torch.Tensor, col: int) -> torch.Tensor:
        self.tokens.copy_(tokens[:, None])
        self.positions.copy_(positions[:, None])
        self.col.fill_(col)
        self.graph.replay()
        return self.logits


# ---- shared math (the trainer's lowbit.models definitions, restated for the engine) ---------

def _rope_tables(cfg: ModelConfig, device: torch.device,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin (max_seq_len, head_dim) in `dtype`: lowbit.models.RotaryEmbedding's
    float32 tables rounded as its forward rounds them (cos.to(x.dtype)), the sin's first half
    negated (exact) for _rotary."""
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
    t = torch.arange(cfg.max_seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs] * 2, dim=-1)
    sign = torch.cat([-torch.ones_like(inv_freq), torch.ones_like(inv_freq)])
    return emb.cos().to(dtype), (emb.sin() * sign).to(dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x normalized in float32, rounded to x's dtype), as lowbit.models.RMSNorm;
    F.rms_norm upcasts, normalizes and rounds once in one kernel on CUDA (the weight is
    applied after, in x's dtype, to keep that second rounding)."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1): the same products, as
    cat(x2, x1) = roll(x, D/2) times the sin whose first half is negated."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def _fuse_hf_experts(sd: dict, cfg: ModelConfig) -> dict:
    """Checkpoints that store experts one by one (`mlp.experts.<e>.gate_proj.weight`, older
    Qwen3-MoE files) become the fused (E, 2F, C) / (E, C, F) layout lowbit and transformers 5.x
    use."""
    if not cfg.is_moe:
        return sd
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}.mlp.experts."
        if p + "0.gate_proj.weight" not in sd:
            continue
        gates = [sd.pop(p + f"{e}.gate_proj.weight") for e in range(cfg.n_experts)]
        ups = [sd.pop(p + f"{e}.up_proj.weight") for e in range(cfg.n_experts)]
        downs = [sd.pop(p + f"{e}.down_proj.weight") for e in range(cfg.n_experts)]
        sd[p + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups)])
        sd[p + "down_proj"] = torch.stack(downs)
    return sd
