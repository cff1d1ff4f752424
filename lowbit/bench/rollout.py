"""`lowbit bench rollout`: the rollout engine's decode speed against the bandwidth limit of what
a decode step reads, and against transformers' `generate` on the same random-weight model, in
the same run.

    lowbit bench rollout                                   # CPU: tiny Llama, a smoke test
    lowbit bench rollout --model qwen3-moe-1b --json rollout.json           # GPU: 1,8,32,128,256

Models (--model; random weights, seed 0, built by transformers from their configs and handed
to the engine as `hf.state_dict()`): llama-1.1b (TinyLlama-1.1B's shape), qwen3-0.6b
(Qwen3-0.6B's, tied embeddings), qwen3-moe-1b (Qwen3-MoE, 48 experts, 8 a token: 1.26B
parameters, 0.50B active), and llama-tiny, qwen3-tiny, qwen3-moe-tiny for the CPU.

Prompts of --prompt-len random tokens get --new-tokens sampled tokens (temperature 1, no stop
token: every row runs to the end). Per batch size: decode steps/s = (new_tokens - 1) / (time
of the whole generate - time of a one-token generate), the decode loop alone; tokens/s =
batch * new_tokens / time of the whole generate (prefill included); medians of --repeats.
Rows: the engine in every precision mode (bf16, fp8, nvfp4-w4a16, nvfp4, nvfp4 + RAC), on
lowbit's Triton inference kernels where it runs them (on CUDA by default: `<mode>, decode
kernels`; --decode-kernels both: with and without), with --compile also its decode step
compiled by torch.compile (`<mode> compiled[, decode kernels]`: on the kernels, each kernel call
one operator and Inductor fusing the PyTorch operations between them; dense models only);
then `generate` with its dynamic and static cache (a static cache the model kind cannot run is
skipped in one note).

The bandwidth limit
-------------------

A decode step of B rows reads, at least once each:

    linear weights   engine.weight_bytes(): every projection as the mode stores it (packed
                     NVFP4 codes and scales, FP8 codes and scales, or bf16 values)
    output head      engine.weights.lm_head in the compute dtype (read once, tied or not:
                     the embedding lookup reads B rows only)
    KV cache         each row's filled length L times engine.cache.bytes_per_token()

Decode step j (j = 1 .. N-1 of a generate of N new tokens from P-token prompts) writes
position P + j - 1 and attends over positions 0 .. P + j - 1, so the mean length read is
L = P + N / 2. Norms, rotary tables and embedding rows are left out (under 0.1% of the
GPU models' bytes).

An MoE layer reads its attention and router, and only the experts its B tokens are routed to.
With each token choosing k of E experts uniformly, an expert escapes one token with
probability 1 - k/E and all B with (1 - k/E)^B, so a layer reads

    E * (1 - (1 - k/E)^B)  distinct experts, expected      (k at B = 1, E as B grows)

of one expert's stored bytes each (gate|up and down: the stacks' nbytes / E). Uniform routing
reads the most (sum_e 1 - (1 - p_e)^B, concave, with sum_e p_e = k, is largest at p_e = k/E):
a router that favours some experts reads fewer bytes than counted, so MoE rows also carry the
distinct experts their tokens were routed to on the warm-up generate. (A batch between the
CUDA-graph buckets, 1, 2, 4, 8 and multiples of 16, also runs padding rows, not counted.)

    bytes_per_step = dense linear weights + routers + head
                     + MoE layers * expected experts * expert bytes + B * L * KV bytes a token
    of_limit       = decode steps/s / (copy bandwidth measured in this run / bytes_per_step)

per engine row (each mode stores its own weights); no of_limit off CUDA, where no bandwidth is
measured. The result also holds, per mode, weight_bytes (the stored linear weights) and
gpu_weight_bytes (every weight tensor the engine holds on its device, each once).

The report
----------

format_rollout_rows prints the table of rows; per batch size and kernel setting each mode's
decode steps/s against bf16's (`nvfp4-w4a16 2.31x bf16`), nvfp4 against nvfp4-w4a16 (quantized
activations), nvfp4+rac0.25 against nvfp4 (RAC), nvfp4+rac0.25+g64 (RAC's channels chosen in
groups of 64; asked for with --modes) against nvfp4 and nvfp4+rac0.25, nvfp4 against fp8; each
mode's weight memory against bf16's; every engine row's bytes per step and fraction of the
limit; the engine's bf16 tokens/s against generate's best; the work one decode step launches
per mode (torch.profiler, batch 1, an uncaptured step, sampling included: GPU kernels, memcpys
and memsets on CUDA, working aten operators on the CPU, where a compiled step's count is left
out); and with --profile, per decode step as timed, its kernels' time by
lowbit.bench.timing.kernel_category against the step's wall time, and the top kernels.
"""

from __future__ import annotations

import collections
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lowbit.bench.timing import gpu_events, kernel_category, sync
from lowbit.kernels import kernels_available
from lowbit.rl.engine import RolloutEngine
from lowbit.rl.sampling import SamplingParams

__all__ = ["MODES", "DEFAULT_MODES", "MODELS", "DecodeReads", "bench_rollout", "copy_bandwidth", "decode_step_ops",
           "decode_step_profile", "expected_distinct_experts", "format_rollout_rows", "parse_modes",
           "stored_weight_bytes", "hf_config"]

# mode label -> (precision, rac_ratio, rac_group, packed_gemm, rac_fold): the NVFP4 modes twice,
# multiplying the dequantized copy (the engine's default) and the packed weights
# (RolloutEngine(packed_gemm=True)); +g64: RAC's channels chosen in groups of 64 (rac_group);
# +fold: RAC's residual added into the activation, one GEMM operand (rac_fold)
MODES = {"bf16": ("bf16", 0.0, 0, False, False), "fp8": ("fp8", 0.0, 0, False, False),
         "nvfp4-w4a16": ("nvfp4-w4a16", 0.0, 0, False, False), "nvfp4": ("nvfp4", 0.0, 0, False, False),
         "nvfp4+rac0.25": ("nvfp4", 0.25, 0, False, False),
         "nvfp4+rac0.25+g64": ("nvfp4", 0.25, 64, False, False),
         "nvfp4-w4a16 packed": ("nvfp4-w4a16", 0.0, 0, True, False), "nvfp4 packed": ("nvfp4", 0.0, 0, True, False),
         "nvfp4+rac0.25 packed": ("nvfp4", 0.25, 0, True, False),
         "nvfp4+rac0.25+g64 packed": ("nvfp4", 0.25, 64, True, False),
         "nvfp4+rac0.25+g64+fold packed": ("nvfp4", 0.25, 64, True, True)}

# what --modes times unless told: every mode but the grouped-RAC ones
DEFAULT_MODES = [m for m in MODES if "+g" not in m]

# the ratios format_rollout_rows prints: (mode, against), each where both were timed
RATIOS = ([(m, "bf16") for m in MODES if m != "bf16"]
          + [(f"nvfp4{p}", f"nvfp4-w4a16{p}") for p in ("", " packed")]
          + [(f"nvfp4+rac0.25{g}{p}", f"nvfp4{p}") for g in ("", "+g64") for p in ("", " packed")]
          + [(f"nvfp4+rac0.25+g64{p}", f"nvfp4+rac0.25{p}") for p in ("", " packed")]
          + [("nvfp4+rac0.25+g64+fold packed", m) for m in ("nvfp4 packed", "nvfp4+rac0.25+g64 packed")]
          + [(f"nvfp4{p}", "fp8") for p in ("", " packed")])

# --decode-kernels -> the engine's decode_kernels setting(s) to time
KERNEL_CHOICES = {"auto": (None,), "on": (True,), "off": (False,), "both": (False, True)}


def _rope(theta: float) -> dict:
    return {"rope_type": "default", "rope_theta": theta}


# name -> (architecture, its transformers config's fields); random weights, no download
MODELS = {
    # TinyLlama-1.1B's shape
    "llama-1.1b": ("LlamaForCausalLM", dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_parameters=_rope(10000.0), tie_word_embeddings=False)),
    # Qwen3-0.6B's shape
    "qwen3-0.6b": ("Qwen3ForCausalLM", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_parameters=_rope(1e6), tie_word_embeddings=True)),
    # a Qwen3-MoE of 1.26B parameters, 0.50B active a token (untied, as Qwen3-MoE's are)
    "qwen3-moe-1b": ("Qwen3MoeForCausalLM", dict(
        hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
        head_dim=64, num_experts=48, moe_intermediate_size=384, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_parameters=_rope(1e6),
        tie_word_embeddings=False)),
    # CPU-sized versions, for tests
    "llama-tiny": ("LlamaForCausalLM", dict(
        hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_parameters=_rope(10000.0), tie_word_embeddings=False)),
    "qwen3-tiny": ("Qwen3ForCausalLM", dict(
        hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_parameters=_rope(1e6), tie_word_embeddings=True)),
    "qwen3-moe-tiny": ("Qwen3MoeForCausalLM", dict(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_experts=8, moe_intermediate_size=64, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=512,
        max_position_embeddings=512, rms_norm_eps=1e-6, rope_parameters=_rope(1e6),
        tie_word_embeddings=False)),
}


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown --modes {','.join(bad) or repr(text)}; use some of {', '.join(MODES)}")
    return modes


def hf_config(name: str):
    """The transformers config of a MODELS entry, and its model class."""
    import transformers

    if name not in MODELS:
        raise ValueError(f"unknown --model {name!r}; use one of {', '.join(MODELS)}")
    arch, fields = MODELS[name]
    config_class = {"LlamaForCausalLM": transformers.LlamaConfig,
                    "Qwen3ForCausalLM": transformers.Qwen3Config,
                    "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig}[arch]
    return config_class(**fields, architectures=[arch]), getattr(transformers, arch)


# ---- what a decode step reads ------------------------------------------------------------------

def expected_distinct_experts(n_experts: int, experts_per_token: int, batch: int) -> float:
    """Experts a layer's B tokens are routed to, expected, each token choosing k of E uniformly:
    E * (1 - (1 - k/E)^B) (see the module doc)."""
    return n_experts * (1.0 - (1.0 - experts_per_token / n_experts) ** batch)


@dataclass(frozen=True)
class DecodeReads:
    """What one decode step must read from device memory, by part (bytes; see the module doc)."""

    dense_bytes: int
    """Linear weights every token goes through as stored (attention, dense MLPs), MoE routers."""
    head_bytes: int
    """The output head in the compute dtype."""
    kv_bytes_per_token: int
    """Keys and values of one token across the layers."""
    expert_bytes: int = 0
    """One expert's gate|up and down as stored (0 for a dense model)."""
    moe_layers: int = 0
    n_experts: int = 0
    experts_per_token: int = 0

    @classmethod
    def of(cls, engine: RolloutEngine) -> DecodeReads:
        w = engine.weights
        moe = [layer for layer in w.layers if layer.experts is not None]
        experts = sum(layer.experts.nbytes for layer in moe)
        routers = sum(_tensor_bytes(layer.router) for layer in moe)
        cfg = engine.config
        return cls(dense_bytes=engine.weight_bytes() - experts + routers,
                   head_bytes=_tensor_bytes(w.lm_head),
                   kv_bytes_per_token=engine.cache.bytes_per_token(),
                   expert_bytes=moe[0].experts.nbytes // cfg.n_experts if moe else 0,
                   moe_layers=len(moe), n_experts=cfg.n_experts if moe else 0,
                   experts_per_token=cfg.experts_per_token if moe else 0)

    def experts_per_layer(self, batch: int) -> float:
        """Expected distinct experts a layer reads at this batch (0 for a dense model)."""
        if not self.moe_layers:
            return 0.0
        return expected_distinct_experts(self.n_experts, self.experts_per_token, batch)

    def per_step(self, batch: int, prompt_len: int, new_tokens: int) -> float:
        """Mean bytes a decode step reads over a generate of new_tokens from prompt_len-token
        prompts at this batch: weights + head + routed experts + each row's filled KV cache."""
        mean_len = prompt_len + new_tokens / 2          # step j reads positions 0 .. P + j - 1
        return (self.dense_bytes + self.head_bytes
                + self.moe_layers * self.experts_per_layer(batch) * self.expert_bytes
                + batch * mean_len * self.kv_bytes_per_token)


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def stored_weight_bytes(engine: RolloutEngine) -> int:
    """Bytes of every weight tensor the engine holds on its device: embeddings, norms, linear
    weights as stored (codes, block and row scales), biases, routers, experts, output head; a
    tensor held twice (a head that is the embedding) counted once. The dequantized copies the
    plain-PyTorch path keeps of quantized weights (LinearWeight.reference_values) are not,
    except where the GEMMs multiply them (the NVFP4 modes without packed_gemm)."""
    w = engine.weights

    def stored(lw):
        return [lw.data, lw.block_scales, lw.row_scales]
    tensors = [w.embed, w.norm, w.lm_head]
    for layer in w.layers:
        tensors += [layer.input_layernorm, layer.post_attention_layernorm, layer.qk_norm, layer.router]
        for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            if lin is not None:
                tensors += stored(lin.weight) + [lin.bias, lin.gemm_weight.data]
        if layer.experts is not None:
            e = layer.experts
            tensors += stored(e.gate_up) + stored(e.down) + [e.gate_up_gemm.data, e.down_gemm.data]
    unique = {(t.data_ptr(), t.numel()): _tensor_bytes(t) for t in tensors if t is not None}
    return sum(unique.values())


def routed_experts_per_layer(routed: torch.Tensor, prompt_len: int, n_experts: int) -> float:
    """From a generate's routed_experts (B, T, layers, k) of prompt_len-token prompts: the
    distinct experts a layer's decode step was routed to, mean over steps and layers (decode
    step j feeds position prompt_len + j - 1; the last position is never fed)."""
    B, T, L, k = routed.shape
    steps = routed[:, prompt_len:T - 1]                                          # (B, S, L, k)
    if steps.shape[1] == 0:
        return float("nan")
    index = steps.permute(1, 2, 0, 3).reshape(-1, B * k)                         # (S L, B k)
    hit = torch.zeros(index.shape[0], n_experts, dtype=torch.bool, device=routed.device)
    hit.scatter_(1, index, True)
    return hit.sum(1).float().mean().item()


def _check_fits(config, batch: int, seq_len: int, state: dict, device: torch.device,
                dtype: torch.dtype) -> None:
    """Refuse a batch whose KV cache, beside the engine's copy of the weights and the logits,
    exceeds the device's free memory (on the CPU, MemAvailable) -- before anything is made."""
    elem = torch.empty(0, dtype=dtype).element_size()
    kv = 2 * config.n_layers * config.n_kv_heads * config.head_dim * seq_len * batch * elem
    weights = sum(t.numel() for t in state.values()) * elem    # the bf16 mode's copy, the largest
    logits = 4 * batch * config.vocab_size * 4                 # float32 logits, probabilities, sampling
    free = _free_bytes(device)
    if free is not None and weights + kv + logits > free:
        raise ValueError(f"--batch-sizes {batch} does not fit: the KV cache of {batch} rows x "
                         f"{seq_len} positions takes {kv / 1e9:.1f} GB, beside {weights / 1e9:.1f} GB "
                         f"of weights and {logits / 1e9:.1f} GB of logits; {free / 1e9:.1f} GB are free")


def _free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ---- timing ------------------------------------------------------------------------------------

def _median_s(fn, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """Device-memory bandwidth (bytes/s) of a large copy (read + write), None off CUDA."""
    if device.type != "cuda":
        return None
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    seconds = _median_s(lambda: y.copy_(x), device, 10)
    return 2 * nbytes / seconds


# aten operators that launch no work: views, allocations, casts that return their input
_NO_WORK = frozenset("aten::" + n for n in (
    "view", "_unsafe_view", "_reshape_alias", "reshape", "as_strided", "t", "transpose", "permute",
    "expand", "expand_as", "slice", "select", "unsqueeze", "squeeze", "split", "split_with_sizes",
    "chunk", "narrow", "unbind", "unflatten", "flatten", "alias", "detach", "lift_fresh",
    "resolve_conj", "resolve_neg", "empty", "empty_strided", "empty_like", "result_type",
    "scalar_tensor", "to", "_to_copy", "contiguous", "resize_", "item", "_local_scalar_dense",
    "is_nonzero"))


def _works(event) -> bool:
    return event.name not in _NO_WORK or any(_works(c) for c in event.cpu_children)


def _profiled_ops(fn, device: torch.device) -> tuple[collections.Counter, collections.Counter]:
    """What fn launches, by name: (counts, microseconds). GPU activities on CUDA (kernels run
    from a CUDA graph included), top-level working aten operators elsewhere."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    counts, micros = collections.Counter(), collections.Counter()
    if cuda:
        for e in gpu_events(prof):
            counts[e.name] += 1
            micros[e.name] += e.time_range.elapsed_us()
        return counts, micros
    for e in prof.events():
        if e.cpu_parent is None and e.name.startswith("aten::") and _works(e):
            counts[e.name] += 1
            micros[e.name] += e.cpu_time_total
    return counts, micros


def decode_step_ops(engine: RolloutEngine, prompt: list[int]) -> int:
    """The GPU kernels (CUDA) or working aten operators (CPU) of one decode step and its
    sampling at batch 1: a 2-token generate's minus a 1-token one's (prefill and the first
    sample), profiled without the CUDA graph (whose replay launches the same kernels)."""
    graphed, engine.cuda_graph = engine.cuda_graph, False
    try:
        engine.generate([prompt], SamplingParams(max_new_tokens=2))          # warm-up
        two, _ = _profiled_ops(lambda: engine.generate([prompt], SamplingParams(max_new_tokens=2)),
                               engine.device)
        one, _ = _profiled_ops(lambda: engine.generate([prompt], SamplingParams(max_new_tokens=1)),
                               engine.device)
    finally:
        engine.cuda_graph = graphed
    return sum(two.values()) - sum(one.values())


def decode_step_profile(engine: RolloutEngine, prompts: list[list[int]], new_tokens: int,
                        top: int = 12) -> dict:
    """Where one decode step's GPU time goes, as the timed rows run it (CUDA graph and
    sampling included): a new_tokens generate's profile minus a one-token generate's, per
    decode step. {"busy_us": kernel time per step, "kernels_per_step", "classes": {class:
    [us, count]}, "top": [[name, us, count], ...]} (on the CPU: aten operators' CPU time)."""
    full = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=0)
    one = SamplingParams(temperature=1.0, max_new_tokens=1, seed=0)
    engine.generate(prompts, full)                                             # warm-up
    n_full, t_full = _profiled_ops(lambda: engine.generate(prompts, full), engine.device)
    n_one, t_one = _profiled_ops(lambda: engine.generate(prompts, one), engine.device)
    steps = new_tokens - 1
    per = {name: ((t_full[name] - t_one[name]) / steps, (n_full[name] - n_one[name]) / steps)
           for name in t_full}
    classes: dict[str, list[float]] = {}
    for name, (us, count) in per.items():
        c = classes.setdefault(kernel_category(name), [0.0, 0.0])
        c[0] += us
        c[1] += count
    ranked = sorted(per.items(), key=lambda kv: -kv[1][0])[:top]
    return {"busy_us": sum(us for us, _ in per.values()),
            "kernels_per_step": sum(c for _, c in per.values()),
            "classes": {k: [round(v[0], 2), round(v[1], 2)] for k, v in
                        sorted(classes.items(), key=lambda kv: -kv[1][0])},
            "top": [[name[:90], round(us, 2), round(c, 2)] for name, (us, c) in ranked]}


def _row(kind: str, mode: str, batch: int, new_tokens: int, t_full: float, t_one: float) -> dict:
    decode = max(t_full - t_one, 1e-9)
    return {"impl": kind, "mode": mode, "batch": batch,
            "decode_steps_per_s": (new_tokens - 1) / decode,
            "tokens_per_s": batch * new_tokens / t_full, "generate_s": t_full, "prefill_s": t_one}


def bench_rollout(model: str = "llama-tiny", modes=("bf16",), *, batch_sizes=(1, 2),
                  prompt_len: int = 16, new_tokens: int = 8, repeats: int = 3,
                  generate_baseline: bool = True, device: str = "cpu", say=print,
                  save=None, compile_decode: bool | str = False, profile_steps: bool = False,
                  decode_kernels: str = "auto") -> dict:
    """Engine rows for every mode and batch size, then transformers' generate rows.

    decode_kernels: "auto" (the engine's default: on CUDA, its Triton inference kernels),
    "on", "off", or "both" (each mode with and without them; a row on them is labelled
    `<mode>, decode kernels`). compile_decode: also a `<mode> compiled` row per mode and kernel
    setting, its decode step compiled (dense models only). Returns {"rows" (each engine row
    with bytes_per_step, and of_limit where the bandwidth was measured), "weight_bytes",
    "gpu_weight_bytes" (per mode), "head_bytes", "kv_bytes_per_token",
    "bandwidth_bytes_per_s", "params_total", "params_active", "decode_step_ops", "profiles"
    (with profile_steps: label -> batch -> decode_step_profile), "notes", ...}. `save(result)`,
    if given, is called after every row, so a run stopped early keeps what it measured."""
    from lowbit.models.hf import config_from_hf

    if decode_kernels not in KERNEL_CHOICES:
        raise ValueError(f"decode_kernels {decode_kernels!r}: use one of {', '.join(KERNEL_CHOICES)}")
    dev = torch.device(device)
    kernels_here = kernels_available(torch.empty(0, device=dev))
    if decode_kernels == "on" and not kernels_here:
        raise ValueError("--decode-kernels on needs triton and a CUDA device")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    transformers_config, model_class = hf_config(model)
    config = config_from_hf(transformers_config.to_dict(), model)
    seq_len = prompt_len + new_tokens
    if seq_len > config.max_seq_len:
        raise ValueError(f"--prompt-len {prompt_len} + --new-tokens {new_tokens} exceeds the "
                         f"model's {config.max_seq_len} positions")
    torch.manual_seed(0)
    with torch.device(dev):
        hf = model_class(transformers_config).to(dtype).eval()
    state = hf.state_dict()
    _check_fits(config, max(batch_sizes), seq_len, state, dev, dtype)
    generator = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(0, config.vocab_size, (b, prompt_len), generator=generator)
               for b in batch_sizes}
    rows, notes = [], []
    result = {"rows": rows, "model": model, "architecture": MODELS[model][0],
              "params_total": config.num_parameters(),
              "params_active": config.num_parameters(active=True),
              "prompt_len": prompt_len, "new_tokens": new_tokens, "batch_sizes": list(batch_sizes),
              "modes": list(modes), "bandwidth_bytes_per_s": copy_bandwidth(dev),
              "weight_bytes": {}, "gpu_weight_bytes": {}, "head_bytes": None,
              "kv_bytes_per_token": None, "decode_step_ops": {},
              "decode_step_ops_unit": "GPU kernels" if dev.type == "cuda" else "aten operators",
              "profiles": {}, "notes": notes}

    def add(row: dict) -> None:
        rows.append(row)
        say(_line(row))
        if save is not None:
            save(result)

    def note(text: str) -> None:
        notes.append(text)
        say(f"   {text}")

    full = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=0)
    one = SamplingParams(temperature=1.0, max_new_tokens=1, seed=0)
    choices = KERNEL_CHOICES[decode_kernels]
    if True in choices and not kernels_here:
        note("decode kernels: not timed here (they need triton and a CUDA device)")
        choices = (False,)
    compile_modes = (compile_decode,) if compile_decode else ()
    if compile_modes and config.is_moe:
        note("compiled rows: skipped (the engine compiles a dense model's decode step only)")
        compile_modes = ()
    runs = [(mode, compiled, kernels) for mode in modes for compiled in (False, *compile_modes)
            for kernels in choices]
    bandwidth = result["bandwidth_bytes_per_s"]
    for mode, compiled, kernels in runs:
        precision, rac, group, packed, fold = MODES[mode]
        compile_mode = None if not compiled else "default" if compiled is True else compiled
        engine = RolloutEngine(config, precision, rac, dev, max_batch_size=max(batch_sizes),
                               max_seq_len=seq_len, compile_decode=compiled, packed_gemm=packed,
                               decode_kernels=kernels, rac_group=group, rac_fold=fold)
        engine.load_state_dict(state)
        reads = DecodeReads.of(engine)
        result["weight_bytes"][mode] = engine.weight_bytes()
        result["gpu_weight_bytes"][mode] = stored_weight_bytes(engine)
        result["head_bytes"], result["kv_bytes_per_token"] = reads.head_bytes, reads.kv_bytes_per_token
        label = (mode + ("" if compile_mode is None else " compiled" if compile_mode == "default"
                         else f" compiled {compile_mode}")
                 + (", decode kernels" if engine.decode_kernels else ""))
        for b in batch_sizes:
            ids = prompts[b].tolist()
            warm = engine.generate(ids, full)               # captures the decode graph
            t_full = _median_s(lambda e=engine: e.generate(ids, full), dev, repeats)
            t_one = _median_s(lambda e=engine: e.generate(ids, one), dev, repeats)
            row = _row("lowbit engine", label, b, new_tokens, t_full, t_one)
            row.update(precision=mode, decode_kernels=bool(engine.decode_kernels),
                       compiled=compile_mode, bytes_per_step=reads.per_step(b, prompt_len, new_tokens))
            if reads.moe_layers:
                row["expected_experts_per_layer"] = reads.experts_per_layer(b)
                row["routed_experts_per_layer"] = routed_experts_per_layer(
                    warm.routed_experts, prompt_len, config.n_experts)
            if bandwidth:
                row["limit_steps_per_s"] = bandwidth / row["bytes_per_step"]
                row["of_limit"] = row["decode_steps_per_s"] / row["limit_steps_per_s"]
            add(row)
            if profile_steps:
                prof = decode_step_profile(engine, ids, new_tokens)
                prof["step_us"] = 1e6 / row["decode_steps_per_s"]
                result["profiles"].setdefault(label, {})[b] = prof
                say(_profile_line(label, b, prof))
        if engine.graph_note:
            note(f"{label}: {engine.graph_note}")
        if not (compiled and dev.type != "cuda"):
            ops = decode_step_ops(engine, prompts[batch_sizes[0]][0].tolist())
            result["decode_step_ops"][label] = ops
            say(f"   {label}: {ops} {result['decode_step_ops_unit']} per decode step (sampling included)")
            if save is not None:
                save(result)
        del engine
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if generate_baseline:
        _bench_generate(hf, prompts, new_tokens, repeats, dev, add, note)
    return result


def _bench_generate(hf, prompts: dict, new_tokens: int, repeats: int, dev: torch.device, add,
                    note) -> None:
    """transformers' generate rows, dynamic then static cache; a static cache the model kind
    cannot run (its warm-up raises) is skipped in one note."""
    for cache in ("dynamic", "static"):
        for b, prompt in prompts.items():
            ids = prompt.to(dev)
            kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                          top_p=1.0, top_k=0, pad_token_id=0, eos_token_id=None)
            if cache == "static":
                kwargs["cache_implementation"] = "static"

            def gen(n: int) -> None:
                hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)

            try:
                gen(2)                                      # warm-up (and, on CUDA, its compile)
            except Exception as e:   # noqa: BLE001 -- a cache this model kind cannot run
                if cache == "dynamic":
                    raise
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
                note(f"transformers generate, static cache: skipped for {type(hf).__name__} "
                     f"from batch {b} on ({type(e).__name__}: {first})")
                break
            t_full = _median_s(lambda: gen(new_tokens), dev, 1 if dev.type == "cuda" else repeats)
            t_one = _median_s(lambda: gen(1), dev, repeats)
            add(_row("transformers generate", f"bf16, {cache} cache", b, new_tokens, t_full, t_one))


def _profile_line(label: str, batch: int, prof: dict) -> str:
    classes = ", ".join(f"{k} {us:.0f} us ({n:.0f})" for k, (us, n) in prof["classes"].items())
    top = "; ".join(f"{name[:60]} {us:.1f} us x{n:.0f}" for name, us, n in prof["top"][:5])
    return (f"   {label} batch {batch}: {prof['busy_us']:.0f} us busy of a {prof['step_us']:.0f} us "
            f"decode step ({prof['busy_us'] / prof['step_us']:.0%}), {prof['kernels_per_step']:.0f} "
            f"launches: {classes}\n      top: {top}"
            + (f"\n      {OVERLAP_NOTE}" if prof["busy_us"] > prof["step_us"] else ""))


OVERLAP_NOTE = ("Busy above 100%: the kernels overlap (programmatic dependent launch), and each "
                "one's time counts its wait for the one before.")


def _line(row: dict) -> str:
    extra = f"  ({row['of_limit']:.0%} of the bandwidth limit)" if "of_limit" in row else ""
    return (f"   {row['impl']:<22} {row['mode']:<20} batch {row['batch']:>4}: "
            f"{row['decode_steps_per_s']:9.1f} decode steps/s, {row['tokens_per_s']:11,.0f} tokens/s{extra}")


# ---- the report ----------------------------------------------------------------------------------

def _precision(row: dict) -> str:
    """The row's MODES label (rows written before rows carried it: the label's first word)."""
    return row.get("precision") or row["mode"].split(",")[0].split(" ")[0]


def _bytes(n: float) -> str:
    return f"{n / 1e9:,.3f} GB" if n >= 1e8 else f"{n / 1e6:,.3f} MB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _ratio_lines(result: dict) -> list[str]:
    """Per batch size and kernel setting: decode steps/s of each RATIOS pair timed."""
    lines = []
    engine = [r for r in result["rows"] if r["impl"] == "lowbit engine"]
    # beside rows on the kernels, the plain rows say so
    plain = " without decode kernels" if any(r.get("decode_kernels") for r in engine) else ""
    for b in result["batch_sizes"]:
        variants: dict[str, dict[str, dict]] = {}    # ", decode kernels" / " compiled" / "" -> mode -> row
        for r in engine:
            if r["batch"] == b:
                variants.setdefault(r["mode"][len(_precision(r)):], {})[_precision(r)] = r
        for variant, by_mode in variants.items():
            speed = {m: r["decode_steps_per_s"] for m, r in by_mode.items()}
            parts = [f"{m} {speed[m] / speed[base]:.2f}x {base}"
                     for m, base in RATIOS if m in speed and base in speed]
            if parts:
                lines.append(f"- batch {b}{variant or plain}: " + ", ".join(parts))
    return lines


def format_rollout_rows(result: dict) -> str:
    """Markdown: one row per (impl, mode), decode steps/s and tokens/s per batch size; the
    decode-speed ratios between modes; weight memory per mode against bf16; bytes per step and
    the fraction of the bandwidth limit per engine row; the engine's bf16 speed against
    transformers' best cache at each batch size; with profiles, where a step's time goes."""
    batches = result["batch_sizes"]
    out = []
    if result.get("params_total"):
        out += [f"{result['model']} ({result['architecture']}): {_count(result['params_total'])} "
                f"parameters, {_count(result['params_active'])} active a token; prompts of "
                f"{result['prompt_len']} tokens, {result['new_tokens']} new tokens.", ""]
    out += ["| implementation | mode | " + " | ".join(f"steps/s @{b}" for b in batches) + " | "
            + " | ".join(f"tok/s @{b}" for b in batches) + " |",
            "|" + " --- |" * 2 + " ---: |" * (2 * len(batches))]
    keys = list(dict.fromkeys((r["impl"], r["mode"]) for r in result["rows"]))
    by = {(r["impl"], r["mode"], r["batch"]): r for r in result["rows"]}
    for impl, mode in keys:
        cells = [by.get((impl, mode, b)) for b in batches]
        out.append(f"| {impl} | {mode} | "
                   + " | ".join(f"{c['decode_steps_per_s']:,.1f}" if c else "-" for c in cells) + " | "
                   + " | ".join(f"{c['tokens_per_s']:,.0f}" if c else "-" for c in cells) + " |")
    ratios = _ratio_lines(result)
    if ratios:
        out += ["", "Decode steps/s against another mode (same batch and kernels, this run):", *ratios]
    weights, on_device = result.get("weight_bytes") or {}, result.get("gpu_weight_bytes") or {}
    if weights:
        base, base_device = weights.get("bf16"), on_device.get("bf16")
        out += ["", "Weight memory: the linear weights as stored, and every weight tensor on the device:", "",
                "| mode | linear weights | vs bf16 | on the device | vs bf16 |",
                "| --- | ---: | ---: | ---: | ---: |"]
        for m, n in weights.items():
            out.append(f"| {m} | {_bytes(n)} | {f'{n / base:.2f}x' if base else '-'} | "
                       f"{_bytes(on_device[m])} | "
                       f"{f'{on_device[m] / base_device:.2f}x' if base_device else '-'} |")
    reads = [r for r in result["rows"] if "bytes_per_step" in r]
    if reads:
        bandwidth = result.get("bandwidth_bytes_per_s")
        moe = any("expected_experts_per_layer" in r for r in reads)
        what = "linear weights as stored, output head, filled KV cache" + (
            ", the experts routed to" if moe else "")
        out += ["", (f"Bandwidth limit: {bandwidth / 1e12:.2f} TB/s (a copy, measured) / the bytes a "
                     f"decode step reads ({what}):") if bandwidth else
                f"Bytes a decode step reads ({what}; no bandwidth measured here, so no limit):", "",
                "| mode | batch | read per step |" + (" experts a layer (expected, routed) |" if moe else "")
                + " limit steps/s | steps/s | of limit |",
                "| --- | ---: | ---: |" + (" ---: |" if moe else "") + " ---: | ---: | ---: |"]
        for r in reads:
            experts = (f" {r['expected_experts_per_layer']:.1f}, {r['routed_experts_per_layer']:.1f} |"
                       if moe else "")
            limit = (f"{r['limit_steps_per_s']:,.0f} | {r['decode_steps_per_s']:,.1f} | {r['of_limit']:.0%}"
                     if "of_limit" in r else f"- | {r['decode_steps_per_s']:,.1f} | -")
            out.append(f"| {r['mode']} | {r['batch']} | {_bytes(r['bytes_per_step'])} |{experts} {limit} |")
    generate_lines = []
    for b in batches:
        ours = by.get(("lowbit engine", "bf16", b)) or by.get(("lowbit engine", "bf16, decode kernels", b))
        theirs = [by[k] for k in by if k[0] == "transformers generate" and k[2] == b]
        if ours and theirs:
            best = max(theirs, key=lambda r: r["tokens_per_s"])
            generate_lines.append(f"- batch {b}: engine {ours['mode']} "
                                  f"{ours['tokens_per_s'] / best['tokens_per_s']:.1f}x the tokens/s of "
                                  f"generate ({best['mode']})")
    if generate_lines:
        out += ["", "Against transformers' generate (tokens/s, prefill included):", *generate_lines]
    if result.get("profiles"):
        classes = list(dict.fromkeys(k for per in result["profiles"].values() for p in per.values()
                                     for k in p["classes"]))
        out += ["", "Per decode step (profiled as timed; us, launches in brackets):", "",
                "| mode | batch | step us | busy us | busy | " + " | ".join(classes) + " |",
                "|" + " --- |" + " ---: |" * (4 + len(classes))]
        for label, per in result["profiles"].items():
            for b, p in per.items():
                cells = [f"{p['classes'][k][0]:.0f} ({p['classes'][k][1]:.0f})" if k in p["classes"] else "-"
                         for k in classes]
                out.append(f"| {label} | {b} | {p['step_us']:.0f} | {p['busy_us']:.0f} | "
                           f"{p['busy_us'] / p['step_us']:.0%} | " + " | ".join(cells) + " |")
        if any(p["busy_us"] > p["step_us"] for per in result["profiles"].values() for p in per.values()):
            out += ["", OVERLAP_NOTE]
    if result.get("decode_step_ops"):
        out.append("")
        unit = result["decode_step_ops_unit"]
        out.append(f"{unit[0].upper() + unit[1:]} per decode step (sampling included, "
                   "batch 1): " + ", ".join(f"{k} {v}" for k, v in result["decode_step_ops"].items()))
    if result.get("notes"):
        out += ["", "Notes:", *(f"- {n}" for n in result["notes"])]
    return "\n".join(out)
