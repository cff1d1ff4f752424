"""The rollout engine: an inference implementation of lowbit's decoder with its own weights.

    engine = RolloutEngine(model_config, precision="nvfp4", rac_ratio=0.25, device="cuda")
    engine.load_state_dict(policy.state_dict())        # copies, then quantizes on arrival
    rollout = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=64,
                                                      stop_token_ids=(10,), seed=0))
    rollout.completions, rollout.logprobs, rollout.routed_experts

It is to the trainer what vLLM is to verl: a separate object that holds its own copy of the
weights (by Hugging Face parameter names: lowbit's models, Llama, Qwen3, Qwen3-MoE), never the
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
sampling runs eagerly between replays. MoE decode runs eagerly (its expert grouping reads
counts back to the host, which a graph cannot hold).

Per token it returns the log-probability of what it sampled (lowbit.rl.sampling) and, for MoE
models, the experts each token was routed to in each layer (for routing replay, verl's R3).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowbit.models.config import ModelConfig
from lowbit.rl.precision import EngineLinear, Precision, parse_precision
from lowbit.rl.sampling import SamplingParams, sample_next

__all__ = ["RolloutEngine", "Rollout"]


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
    """One decoder layer's weights as the engine holds them."""

    def __init__(self) -> None:
        self.input_layernorm = self.post_attention_layernorm = None
        self.q_norm = self.k_norm = None
        self.q_proj = self.k_proj = self.v_proj = self.o_proj = None
        self.gate_proj = self.up_proj = self.down_proj = None          # dense
        self.router = None                                              # MoE: (E, C)
        self.experts_gate_up: list[EngineLinear] = []                  # MoE: per expert
        self.experts_down: list[EngineLinear] = []


class RolloutEngine:
    def __init__(self, config: ModelConfig, precision: str | Precision = "bf16",
                 rac_ratio: float = 0.0, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, max_batch_size: int = 64,
                 max_seq_len: int | None = None, cuda_graph: bool | None = None) -> None:
        """config: the decoder's shape (lowbit.models.ModelConfig); precision: bf16, fp8,
        nvfp4-w4a16 or nvfp4; rac_ratio: the fraction of input channels RAC compensates (nvfp4
        only); dtype: compute dtype (default bf16 on CUDA, float32 elsewhere); max_batch_size
        and max_seq_len (default config.max_seq_len): the KV cache's size, allocated here;
        cuda_graph: replay decode steps from CUDA graphs (default: on CUDA, dense models)."""
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
        self.cos, self.sin = _rope_tables(config, self.device)
        B, L, KV, D = max_batch_size, self.max_seq_len, config.n_kv_heads, config.head_dim
        # The preallocated cache, one (B, KV, L, D) key and value tensor per layer.
        self.k_cache = [torch.zeros(B, KV, L, D, device=self.device, dtype=self.dtype)
                        for _ in range(config.n_layers)]
        self.v_cache = [torch.zeros_like(k) for k in self.k_cache]
        self.key_valid = torch.zeros(B, L, dtype=torch.bool, device=self.device)
        self.routed = (torch.full((config.n_layers, B, L, config.experts_per_token), -1,
                                  dtype=torch.int64, device=self.device) if config.is_moe else None)
        self.layers: list[_Layer] = []
        self.embed = self.norm = self.lm_head = None
        self._graphs: dict[int, _DecodeGraph] = {}
        self.loaded = False
        self.graph_note: str | None = None
        """Why CUDA-graph decode was turned off after a failed capture (None: it was not)."""

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

        def linear(name: str) -> EngineLinear:
            return EngineLinear(take(name), self.precision, self.rac_ratio, self.device, self.dtype)

        self.embed = plain("model.embed_tokens.weight")
        layers = []
        for i in range(cfg.n_layers):
            p, layer = f"model.layers.{i}.", _Layer()
            layer.input_layernorm = plain(p + "input_layernorm.weight")
            layer.post_attention_layernorm = plain(p + "post_attention_layernorm.weight")
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(layer, proj, linear(p + f"self_attn.{proj}.weight"))
            if cfg.qk_norm:
                layer.q_norm = plain(p + "self_attn.q_norm.weight")
                layer.k_norm = plain(p + "self_attn.k_norm.weight")
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
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    setattr(layer, proj, linear(p + f"mlp.{proj}.weight"))
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
            for lin in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj, layer.gate_proj,
                        layer.up_proj, layer.down_proj, *layer.experts_gate_up, *layer.experts_down):
                total += lin.nbytes if lin is not None else 0
        return total

    # ---- the decoder ----------------------------------------------------------------------

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, cols: torch.Tensor,
                 n_keys: int, all_logits: bool = False) -> torch.Tensor:
        """tokens, positions (B, T) at cache columns cols (T,) -> logits (B, V) of the last
        position, or (B, T, V) with all_logits. Attends over cache columns [0, n_keys)."""
        cfg = self.config
        B, T = tokens.shape
        H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        cos = self.cos[positions][:, None]                              # (B, 1, T, D)
        sin = self.sin[positions][:, None]
        key_cols = torch.arange(n_keys, device=self.device)
        # a key is visible when it is a real token at or before the query's column; a padding
        # query sees itself only (its output is never used, but must stay finite)
        causal = key_cols[None, :] <= cols[:, None]                     # (T, n_keys)
        mask = ((self.key_valid[:B, None, :n_keys] | (key_cols[None, :] == cols[:, None])[None])
                & causal[None])[:, None]                                # (B, 1, T, n_keys)
        x = F.embedding(tokens, self.embed)                             # (B, T, C)
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.input_layernorm, cfg.norm_eps)
            q = layer.q_proj(h).view(B, T, H, D)
            k = layer.k_proj(h).view(B, T, KV, D)
            v = layer.v_proj(h).view(B, T, KV, D)
            if layer.q_norm is not None:
                q, k = _rms_norm(q, layer.q_norm, cfg.norm_eps), _rms_norm(k, layer.k_norm, cfg.norm_eps)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # (B, heads, T, D)
            q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
            self.k_cache[i][:B].index_copy_(2, cols, k)
            self.v_cache[i][:B].index_copy_(2, cols, v)
            y = F.scaled_dot_product_attention(
                q, self.k_cache[i][:B, :, :n_keys], self.v_cache[i][:B, :, :n_keys],
                attn_mask=mask, enable_gqa=KV != H)                     # (B, H, T, D)
            x = x + layer.o_proj(y.transpose(1, 2).reshape(B, T, H * D))
            h = _rms_norm(x, layer.post_attention_layernorm, cfg.norm_eps)
            if cfg.is_moe:
                h = self._moe(i, layer, h, cols)
            else:
                h = layer.down_proj(F.silu(layer.gate_proj(h)) * layer.up_proj(h))
            x = x + h
        x = _rms_norm(x if all_logits else x[:, -1], self.norm, cfg.norm_eps)
        return F.linear(x, self.lm_head)

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
        for step in range(params.max_new_tokens):
            token, logprob = sample_next(logits, params, generator)
            token = torch.where(alive, token, torch.zeros_like(token))
            out_tokens.append(token), out_logprobs.append(logprob), out_alive.append(alive)
            alive = alive & ~torch.isin(token, stop)
            if step + 1 == params.max_new_tokens or not bool(alive.any()):
                break
            col = Tp + step
            if graph is not None:
                logits = graph.replay(token, col - pad, col)
            else:
                col_t = torch.tensor([col], device=self.device)
                self.key_valid[:B, col] = True
                logits = self._forward(token[:, None], (col - pad)[:, None], col_t, col + 1)
        mask = torch.stack(out_alive, dim=1)
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
                self.cuda_graph = False
                self.graph_note = f"CUDA-graph decode turned off: capture failed ({e})"
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
        return e._forward(self.tokens, self.positions, self.col, e.max_seq_len)

    def replay(self, tokens: torch.Tensor, positions: torch.Tensor, col: int) -> torch.Tensor:
        self.tokens.copy_(tokens[:, None])
        self.positions.copy_(positions[:, None])
        self.col.fill_(col)
        self.graph.replay()
        return self.logits


# ---- shared math (the trainer's lowbit.models definitions, restated for the engine) ---------

def _rope_tables(cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (max_seq_len, head_dim) in float32, as lowbit.models.RotaryEmbedding builds them."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32,
                                                      device=device) / cfg.head_dim))
    t = torch.arange(cfg.max_seq_len, dtype=torch.float32, device=device)
    emb = torch.cat([torch.outer(t, inv_freq)] * 2, dim=-1)
    return emb.cos(), emb.sin()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


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
