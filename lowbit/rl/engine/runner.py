"""The engine's runner: `RolloutEngine`, which generates and scores on its decoder, and the CUDA
graphs of its decode step, one per batch-size bucket."""

from __future__ import annotations

import time
from dataclasses import dataclass
from collections.abc import Mapping

import torch

from lowbit.models.config import ModelConfig
from lowbit.rl.engine.config import EngineConfig
from lowbit.rl.engine.decoder import Decoder
from lowbit.rl.engine.kv_cache import KVCache
from lowbit.rl.engine.weights import EngineWeights, pack_state_dict
from lowbit.rl.precision import ActivationScale, Precision
from lowbit.rl.sampling import SamplingParams, sample_next

__all__ = ["RolloutEngine", "Rollout", "batch_bucket"]


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
    none (past the row's end, and its last token, whose forward no log-prob needs)."""
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


def batch_bucket(batch: int, max_batch_size: int) -> int:
    """The CUDA-graph batch size a decode batch runs at: 1, 2, 4, 8, then multiples of 16,
    never above max_batch_size (the rows past the batch are padding)."""
    bucket = batch if batch <= 2 else 4 if batch <= 4 else 8 if batch <= 8 else -(-batch // 16) * 16
    return min(bucket, max_batch_size)


class RolloutEngine:
    def __init__(self, config: ModelConfig, precision: str | Precision = "bf16",
                 rac_ratio: float = 0.0, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, max_batch_size: int = 64,
                 max_seq_len: int | None = None, cuda_graph: bool | None = None,
                 compile_decode: bool | str = False, packed_gemm: bool = False,
                 decode_kernels: bool | None = None,
                 activation_scale: str | ActivationScale = "per-token", rac_group: int = 0,
                 rac_fold: bool = False) -> None:
        """config: the decoder's shape (lowbit.models.ModelConfig); the rest are
        lowbit.rl.engine.EngineConfig's settings (precision mode, RAC ratio, device, compute
        dtype, the cache's max_batch_size and max_seq_len, CUDA graphs, compile_decode,
        packed_gemm, decode_kernels, activation_scale, RAC's channel group and fold), checked
        here."""
        self.config = config
        self.settings = EngineConfig(
            precision=precision, rac_ratio=rac_ratio, rac_group=rac_group, rac_fold=rac_fold, device=device,
            dtype=dtype, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
            cuda_graph=cuda_graph, compile_decode=compile_decode, packed_gemm=packed_gemm,
            decode_kernels=decode_kernels, activation_scale=activation_scale).resolve(config)
        s = self.settings
        self.precision, self.rac_ratio, self.device, self.dtype = s.precision, s.rac_ratio, s.device, s.dtype
        self.rac_group, self.rac_fold = s.rac_group, s.rac_fold
        self.activation_scale = s.activation_scale
        self.max_batch_size, self.max_seq_len = s.max_batch_size, s.max_seq_len
        self.cuda_graph, self.compile_decode, self.decode_kernels = s.cuda_graph, s.compile_decode, s.decode_kernels
        self.decode_pdl = False
        """The decode kernels launch with programmatic dependent launch (Hopper and newer)."""
        if self.decode_kernels:
            from lowbit.kernels.launch import pdl_supported
            self.decode_pdl = pdl_supported(self.device)
        self.cache = KVCache(config.n_layers, s.max_batch_size, config.n_kv_heads, s.max_seq_len,
                             config.head_dim, s.device, s.dtype,
                             capacity=None if s.preallocate else KVCache.GROWTH,
                             routed_k=config.experts_per_token if config.is_moe else 0)
        self.weights: EngineWeights | None = None
        self.decoder: Decoder | None = None
        self._graphs: dict[int, _DecodeGraph] = {}
        self._compiled_decode = None
        self.graph_note: str | None = None
        """Why CUDA-graph decode was turned off after a failed capture (None: it was not)."""

    # ---- weights --------------------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        """The engine holds whole weights (none yet, or a sync that stopped while writing: not)."""
        return self.weights is not None and not self.weights.partial

    def sync(self, state_dict: Mapping[str, torch.Tensor],
             input_amax: Mapping[str, float] | None = None) -> None:
        """A weight sync from a trainer: load_state_dict, with the linear weights packed where
        they are first (pack_state_dict) when they sit on another GPU than the engine's, so the
        transfer moves packed bytes; otherwise (one device, or a CPU trainer, whose quantizer is
        the slow reference) quantized on arrival one weight at a time, with no packed copy of
        the whole model held at once."""
        source = next((v.device for v in state_dict.values() if isinstance(v, torch.Tensor)), None)
        if source is not None and source.type == "cuda" and source != self.device:
            state_dict = self.pack_state_dict(state_dict)
        self.load_state_dict(state_dict, input_amax=input_amax)

    def pack_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> dict:
        """The sender's half of a packed weight sync: `state_dict` with each linear weight this
        engine stores quantized already quantized, where the tensor is, into what this engine
        would store (lowbit.rl.engine.weights.pack_state_dict); load_state_dict takes it as the
        same bits, moving 0.5625 bytes a parameter for NVFP4 instead of 2. For a bf16 engine, a
        copy of the dict."""
        s = self.settings
        return pack_state_dict(state_dict, self.config, s.precision, s.dtype)

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, torch.Tensor],
                        input_amax: Mapping[str, float] | None = None) -> None:
        """Take a state dict by Hugging Face parameter names: every tensor is copied to the
        engine's device and dtype, then stored as the precision mode says (EngineWeights); a
        linear weight packed by pack_state_dict is moved as it is. The engine keeps no reference
        to the given tensors. Missing or unexpected keys, and tensors of other shapes, are
        refused in one line, before anything is written. After the first load, a sync writes
        into the weights the engine holds, one part at a time (EngineWeights.load_): its CUDA
        graphs stay valid, and the weights are never held twice; an error while writing (out of
        memory) leaves the engine unloaded (`loaded` False) until a sync succeeds. With
        `cuda_graph`, syncs from the same tensors (a trainer's parameters, stepped in place)
        are captured once and replayed (EngineWeights.load_'s `graph`).

        input_amax: with activation_scale "static" (and only then), each linear's calibrated
        input amax by module name, as lowbit.export.calibrate_input_amax returns it for the
        model these weights come from (what `lowbit export --activations nvfp4` calibrates);
        give it at every sync, as a served checkpoint is calibrated for its own weights."""
        s = self.settings
        static = s.activation_scale is ActivationScale.STATIC
        if static and input_amax is None:
            raise ValueError("activation_scale 'static' needs each linear's calibrated input amax: "
                             "load_state_dict(sd, input_amax=lowbit.export.calibrate_input_amax("
                             "model, batches))")
        if not static and input_amax is not None:
            raise ValueError("input_amax sets static activation scales; this engine's are "
                             f"{s.activation_scale.value} (pass activation_scale='static')")
        if self.weights is not None:
            if not self.weights.load_(state_dict, input_amax, graph=self.cuda_graph):
                # a weight's saturation flag changed: the captured kernels took it as a constant
                self._graphs.clear()
                self._compiled_decode = None
            return
        self.weights = EngineWeights.load(state_dict, self.config, s.precision, s.rac_ratio, s.device,
                                          s.dtype, s.packed_gemm, input_amax, rac_group=s.rac_group,
                                          rac_fold=s.rac_fold)
        self.decoder = Decoder(self.config, self.weights, self.cache, s.decode_kernels,
                               self.decode_pdl)

    def _loaded_weights(self) -> EngineWeights:
        if self.weights is None:
            raise ValueError("the engine has no weights yet; call load_state_dict first")
        if self.weights.partial:
            raise ValueError("the engine's last weight sync stopped while writing (its weights are "
                             "part old, part new); sync again")
        return self.weights

    def weight_bytes(self) -> int:
        """Bytes of the stored linear-layer weights (packed in the quantizing modes)."""
        return self._loaded_weights().linear_bytes()

    def linear_values(self, layer: int, name: str) -> torch.Tensor:
        """The weight the engine stores for a dense projection, by its Hugging Face name (q_proj,
        k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj): (out, in), dequantized to the
        compute dtype in the quantizing modes (EngineLinear.values)."""
        where = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0),
                 "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
        if name not in where:
            raise ValueError(f"unknown projection {name!r}; use one of {', '.join(where)}")
        fused, part = where[name]
        lin = getattr(self._loaded_weights().layers[layer], fused)
        if lin is None:
            raise ValueError(f"layer {layer} has no dense {name} (an MoE layer's experts are "
                             "in weights.layers[i].experts)")
        return lin.part(part)

    # ---- generation -----------------------------------------------------------------------

    def _prepare(self, prompts: list[list[int]], new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded prompt tokens (B, T) and lengths (B,) on the device, after the checks."""
        self._loaded_weights()
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
        if self.cache.reserve(Tp + new_tokens):
            self._graphs.clear()     # they read the old cache tensors
            self._compiled_decode = None
        tokens = torch.tensor([list(p) + [0] * (Tp - len(p)) for p in prompts], device=self.device)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        if self.cache.routed is not None:
            self.cache.routed[:, :B] = -1
        self.cache.unshare()
        return tokens, lengths

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        """Sample a completion for each prompt (lists of token ids)."""
        t0 = time.perf_counter()
        tokens, lengths = self._prepare(prompts, params.max_new_tokens)
        B = tokens.shape[0]
        graph = self._graph(B) if self.cuda_graph and params.max_new_tokens > 1 else None
        logits = self._prefill_distinct(prompts, tokens, lengths)
        positions = lengths.clone()                  # where each row's next token goes
        if graph is not None:
            graph.start(positions)
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        stop = torch.tensor(params.stop_token_ids or [-1], device=self.device)
        alive = torch.ones(B, dtype=torch.bool, device=self.device)
        out_tokens, out_logprobs, out_alive = [], [], []
        # "Is any row alive?" is read one step late, so the host queues the next step before it
        # waits on the last: the GPU never idles on a round trip. The one extra step after
        # every row ended samples only masked tokens, trimmed below.
        any_alive = None                             # (host flag, its copy's CUDA event or None)
        for step in range(params.max_new_tokens):
            token, logprob = sample_next(logits, params, generator)
            token = torch.where(alive, token, torch.zeros_like(token))
            out_tokens.append(token), out_logprobs.append(logprob), out_alive.append(alive)
            alive = alive & ~torch.isin(token, stop)
            if step + 1 == params.max_new_tokens:
                break
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
            if graph is not None:
                logits = graph.replay(token)
            else:
                logits = self._decode_step()(token, positions)
                positions += 1
        mask = torch.stack(out_alive, dim=1)
        n = int(mask.any(0).nonzero().max()) + 1     # the columns sampled after every row ended
        completions = torch.stack(out_tokens[:n], dim=1) * mask[:, :n]
        logprobs = torch.stack(out_logprobs[:n], dim=1) * mask[:, :n]
        mask = mask[:, :n]
        routed = None if self.cache.routed is None else self._routed_by_position(lengths, mask)
        return Rollout([list(p) for p in prompts], completions, mask, logprobs, ~alive, routed,
                       time.perf_counter() - t0)

    def _prefill_distinct(self, prompts: list[list[int]], tokens: torch.Tensor,
                          lengths: torch.Tensor) -> torch.Tensor:
        """The prefill's last-token logits (B, V), each distinct prompt forwarded once (GRPO
        samples every prompt num_generations times: vLLM's prefix caching, for whole prompts)
        into the first row that samples it, whose columns the rows repeating it read
        (KVCache.share_prompts). The engine's numerics are per row, so a row's values are
        those of the full batch's prefill up to accumulation order (GEMMs over fewer rows may
        sum in another order, as a row alone does)."""
        first: dict[tuple[int, ...], int] = {}
        source = [first.setdefault(tuple(p), b) for b, p in enumerate(prompts)]
        if len(first) == len(prompts):
            return self.decoder.prefill(tokens, lengths)
        distinct = list(first.values())                  # rows of first occurrences, in order
        slot = {b: i for i, b in enumerate(distinct)}
        logits = self.decoder.prefill(tokens[distinct], lengths[distinct])   # cache rows 0..U-1
        index = torch.tensor([slot[b] for b in source], device=self.device)
        self.cache.share_prompts(index, torch.tensor(distinct, device=self.device), lengths, tokens.shape[1])
        return logits[index]

    def _routed_by_position(self, lengths: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The routing record (layers, B, positions, k) as (B, T, layers, k), -1 from each row's
        last token on (what was recorded there is padding, or a token fed after the row ended)."""
        B, Tc = mask.shape
        T = int(lengths.max()) + Tc
        routed = self.cache.routed[:, :B, :T].permute(1, 2, 0, 3)               # (B, T, L, k)
        last = (lengths + mask.sum(1) - 1)[:, None]                              # (B, 1)
        beyond = torch.arange(T, device=self.device)[None, :] >= last
        return torch.where(beyond[:, :, None, None], torch.full_like(routed, -1), routed)

    @torch.no_grad()
    def score(self, sequences: list[list[int]], temperature: float = 1.0) -> list[torch.Tensor]:
        """Teacher-forced log-probs under the engine's numerics, one full-sequence forward:
        for each sequence s, log softmax(logits / T)[s[t+1]] for t < len(s) - 1 (float32)."""
        if not temperature > 0:
            raise ValueError(f"score needs a positive temperature (got {temperature}); 1.0 scores "
                             "the model's own distribution")
        tokens, lengths = self._prepare(sequences, 0)
        logits = self.decoder.prefill(tokens, lengths, all_logits=True).float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        return [logp[b, :len(s) - 1].gather(-1, tokens[b, 1:len(s), None])[:, 0]
                for b, s in enumerate(sequences)]

    # ---- decode steps and CUDA graphs -----------------------------------------------------

    def _decode_step(self):
        """The decoder's decode step, compiled with compile_decode (the weights and the cache
        are inputs of the compiled graph, never baked in, so a weight sync does not recompile;
        one graph a batch-size bucket, fullgraph: a step that does not trace whole fails here,
        and _graph falls back to the eager step)."""
        if not self.compile_decode:
            return self.decoder.decode
        if self._compiled_decode is None:
            self.decoder.prepare()
            compiled = torch.compile(self.decoder.decode, dynamic=False, fullgraph=True,
                                     options=compile_options(self.compile_decode))
            # Dynamo keeps at most recompile_limit graphs of one function (8 by default) for
            # every engine in the process together, fewer than one engine's buckets up to 128
            limit = ("recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit")
                     else "cache_size_limit")

            def step(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
                with torch._dynamo.config.patch(**{limit: COMPILED_STEPS_MAX}):
                    return compiled(tokens, positions)
            self._compiled_decode = step
        return self._compiled_decode

    def _graph(self, batch: int) -> _DecodeGraph | None:
        bucket = batch_bucket(batch, self.max_batch_size)
        if bucket not in self._graphs:
            try:
                self._graphs[bucket] = _DecodeGraph(self._decode_step(), bucket, self.device)
            except Exception as e:   # noqa: BLE001 -- any compile or capture failure
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                if self.compile_decode:      # the eager step, still in CUDA graphs
                    self.compile_decode, self._compiled_decode = False, None
                    self.graph_note = f"compile_decode turned off: {type(e).__name__}: {first}"
                    return self._graph(batch)
                self.cuda_graph = False
                self.graph_note = ((self.graph_note + "; ") if self.graph_note else "") + \
                    f"CUDA-graph decode turned off: capture failed ({type(e).__name__}: {first})"
                return None
        return self._graphs[bucket]


COMPILED_STEPS_MAX = 256
"""Compiled decode steps (one a batch-size bucket and engine) a process keeps before a new one
fails to compile (and _graph falls back to the eager step)."""


def compile_options(mode: bool | str) -> dict:
    """torch.compile's Inductor options for a compile_decode mode: the mode's own (never its
    CUDA graphs: the engine captures the step itself), and where this torch has it
    emulate_precision_casts, so that a fused kernel rounds to the compute dtype where the eager
    ops round (RMSNorm's output before its weight multiplies, SiLU's before up's), as lowbit's
    kernels do."""
    import torch._inductor.config as inductor_config
    options = {} if mode in (True, "default") else dict(torch._inductor.list_mode_options(mode))
    options.pop("triton.cudagraphs", None)
    if hasattr(inductor_config, "emulate_precision_casts"):
        options["emulate_precision_casts"] = True
    return options


class _DecodeGraph:
    """One decode step (tokens -> logits) of a batch-size bucket captured in a CUDA graph, the
    positions advanced inside it; a smaller batch fills the first rows and leaves the rest as
    padding rows (token 0 from position 0 on, in cache rows this generate is not using)."""

    def __init__(self, step, batch: int, device: torch.device) -> None:
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(batch, dtype=torch.int64, device=device)
        self.step = step
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):      # warm-up: writes columns 0 and 1, which prefill rewrites
                self._step()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()
        self.positions.zero_()

    def _step(self) -> torch.Tensor:
        logits = self.step(self.tokens, self.positions)
        self.positions.add_(1)
        return logits

    def start(self, positions: torch.Tensor) -> None:
        """A new generate: the first rows at these positions, the padding rows at 0."""
        self.positions.zero_()
        self.positions[:positions.shape[0]] = positions
        self.tokens.zero_()

    def replay(self, tokens: torch.Tensor) -> torch.Tensor:
        B = tokens.shape[0]
        self.tokens[:B] = tokens
        self.graph.replay()
        return self.logits[:B]
