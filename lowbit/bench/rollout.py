"""`lowbit bench rollout`: the rollout engine's decode speed against transformers' `generate`,
on the same random-weight model, in the same run.

    lowbit bench rollout                                  # CPU: tiny Llama, a smoke test
    lowbit bench rollout --model llama-1.1b --batch-sizes 1,8,32,128 --json rollout.json   # GPU

For each batch size, prompts of --prompt-len random tokens get --new-tokens sampled tokens
(temperature 1, no stop token, so every row runs to the end). Reported per batch size:

- decode steps/s: (new_tokens - 1) / (time of the whole generate - time of a generate of one
  token), i.e. the decode loop alone, prefill excluded;
- tokens/s: batch * new_tokens / time of the whole generate (prefill included);
- for the engine, the fraction of the bandwidth limit: the decode step must read every linear
  weight and the output head once, so it cannot run faster than (copy bandwidth measured in
  this run) / (those bytes) steps per second.

Rows: the engine in every precision mode (bf16, fp8, nvfp4-w4a16, nvfp4, nvfp4 + RAC; on
Hopper the FP4 modes emulate their numerics on BF16 GEMMs, so their speed is not FP4's), and
transformers' `generate` with its dynamic and its static cache. Medians of --repeats calls.
With --compile every engine mode gets a second row, its decode step compiled by torch.compile
(`RolloutEngine(compile_decode=True)`), mode labelled `<mode> compiled`; --compile MODE picks
torch.compile's mode (max-autotune-no-cudagraphs: `<mode> compiled max-autotune-no-cudagraphs`).

Beside each engine mode: the work one decode step launches (sampling included), counted by
torch.profiler on an uncaptured step at batch 1 (the same kernels its CUDA graph replays): on
CUDA the GPU kernels, memcpys and memsets; on the CPU the aten operators that do work (views
and no-op casts left out; a compiled step's fused kernels are no aten operators, so on the
CPU its count is left out).

With --profile, each engine row is also profiled as it is timed (CUDA graph and sampling
included): per decode step, the GPU time of its kernels against the step's wall time (how
busy the GPU is), summed by lowbit.bench.timing.kernel_category (GEMM, attention, ..., other), and the top
kernels. On the CPU the same table holds aten operators' CPU time.
"""

from __future__ import annotations

import collections
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from lowbit.bench.timing import gpu_events, kernel_category
from lowbit.kernels import kernels_available
from lowbit.rl.engine import RolloutEngine, decode_kernels_fit
from lowbit.rl.sampling import SamplingParams

__all__ = ["MODES", "HF_SHAPES", "bench_rollout", "decode_step_ops", "decode_step_profile",
           "format_rollout_rows", "parse_modes"]

# mode label -> (precision, rac_ratio)
MODES = {"bf16": ("bf16", 0.0), "fp8": ("fp8", 0.0), "nvfp4-w4a16": ("nvfp4-w4a16", 0.0),
         "nvfp4": ("nvfp4", 0.0), "nvfp4+rac0.25": ("nvfp4", 0.25)}

# --decode-kernels -> the engine's decode_kernels setting(s) to time
KERNEL_CHOICES = {"auto": (None,), "on": (True,), "off": (False,), "both": (False, True)}

# Llama shapes built with random weights (transformers' LlamaConfig fields)
HF_SHAPES = {
    # TinyLlama-1.1B's shape: the anchor model
    "llama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                       num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                       max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                       tie_word_embeddings=False),
    "llama-tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                       max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                       tie_word_embeddings=False),
}


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown --modes {','.join(bad) or repr(text)}; use some of {', '.join(MODES)}")
    return modes


def _hf_model(name: str, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    if name not in HF_SHAPES:
        raise ValueError(f"unknown --model {name!r}; use one of {', '.join(HF_SHAPES)}")
    config = LlamaConfig(**HF_SHAPES[name])
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    return model, config


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
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
        _sync(device)
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


def bench_rollout(model: str = "llama-tiny", modes=("bf16",), batch_sizes=(1, 2),
                  prompt_len: int = 16, new_tokens: int = 8, repeats: int = 3,
                  generate_baseline: bool = True, device: str = "cpu", say=print,
                  save=None, compile_decode: bool | str = False, profile_steps: bool = False,
                  decode_kernels: str = "auto") -> dict:
    """Engine rows for every mode and batch size (with compile_decode, a compiled row too;
    decode_kernels "auto" (the engine's default), "on", "off" or "both": the fused decode
    kernels, where they apply; a row that runs on them says so in its label),
    then transformers' generate rows; returns {"rows", "bandwidth_bytes_per_s", "weight_bytes",
    "limit_steps_per_s", "decode_step_ops", ...}; with profile_steps also "profiles" (label ->
    batch -> decode_step_profile). `save(result)`, if given, is called after every row, so a
    run stopped early keeps what it measured."""
    from lowbit.models.hf import config_from_hf

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hf, hf_config = _hf_model(model, dev, dtype)
    config = config_from_hf({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]}, model)
    seq_len = prompt_len + new_tokens
    if seq_len > config.max_seq_len:
        raise ValueError(f"--prompt-len {prompt_len} + --new-tokens {new_tokens} exceeds the "
                         f"model's {config.max_seq_len} positions")
    generator = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(0, config.vocab_size, (b, prompt_len), generator=generator)
               for b in batch_sizes}
    state = hf.state_dict()
    rows = []
    result = {"rows": rows, "bandwidth_bytes_per_s": copy_bandwidth(dev), "weight_bytes": None,
              "limit_steps_per_s": None, "model": model, "prompt_len": prompt_len,
              "new_tokens": new_tokens, "batch_sizes": list(batch_sizes), "modes": list(modes),
              "decode_step_ops": {}, "decode_step_ops_unit": ("GPU kernels" if dev.type == "cuda"
                                                               else "aten operators"),
              "profiles": {}}

    def add(row: dict) -> None:
        rows.append(row)
        say(_line(row))
        if save is not None:
            save(result)

    full = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=0)
    one = SamplingParams(temperature=1.0, max_new_tokens=1, seed=0)
    if decode_kernels not in KERNEL_CHOICES:
        raise ValueError(f"decode_kernels {decode_kernels!r}: use one of {', '.join(KERNEL_CHOICES)}")
    choices = KERNEL_CHOICES[decode_kernels]
    if True in choices and not kernels_available(torch.empty(0, device=dev)):
        if decode_kernels == "on":
            raise ValueError("--decode-kernels on needs triton and a CUDA device")
        say("   decode kernels: not timed here (they need triton and a CUDA device)")
        choices = (False,)
    runs = [(mode, compiled, kernels) for mode in modes
            for compiled in ((False, compile_decode) if compile_decode else (False,))
            for kernels in choices
            # compiled steps are what the kernels replace: a compiled row with kernels would
            # repeat the kernel row at batch <= MAX_ROWS and the compiled row past it
            if not (kernels and (compiled or not decode_kernels_fit(config, MODES[mode][0])))]
    for mode, compiled, kernels in runs:
        precision, rac = MODES[mode]
        base = mode if not compiled else (f"{mode} compiled" if compiled in (True, "default")
                                          else f"{mode} compiled {compiled}")
        engine = RolloutEngine(config, precision, rac, dev, max_batch_size=max(batch_sizes),
                               max_seq_len=seq_len, compile_decode=compiled, decode_kernels=kernels)
        engine.load_state_dict(state)

        def labelled(batch: int) -> str:
            return base + (", decode kernels" if engine.uses_decode_kernels(batch) else "")
        if mode == "bf16" and result["weight_bytes"] is None:
            # a decode step reads every linear weight and the output head once
            result["weight_bytes"] = (engine.weight_bytes()
                                      + engine.lm_head.numel() * engine.lm_head.element_size())
            if result["bandwidth_bytes_per_s"]:
                result["limit_steps_per_s"] = result["bandwidth_bytes_per_s"] / result["weight_bytes"]
        limit = result["limit_steps_per_s"]
        for b in batch_sizes:
            if kernels and not engine.uses_decode_kernels(b):
                continue                                    # the row without them has it
            label = labelled(b)
            ids = prompts[b].tolist()
            engine.generate(ids, full)                      # captures the decode graph
            t_full = _median_s(lambda: engine.generate(ids, full), dev, repeats)
            t_one = _median_s(lambda: engine.generate(ids, one), dev, repeats)
            row = _row("lowbit engine", label, b, new_tokens, t_full, t_one)
            if limit and mode == "bf16":
                row["of_limit"] = row["decode_steps_per_s"] / limit
            add(row)
            if profile_steps:
                prof = decode_step_profile(engine, ids, new_tokens)
                prof["step_us"] = 1e6 / row["decode_steps_per_s"]
                result["profiles"].setdefault(label, {})[b] = prof
                say(_profile_line(label, b, prof))
        label = labelled(batch_sizes[0])
        if engine.graph_note:
            say(f"   {label}: {engine.graph_note}")
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
        for cache in ("dynamic", "static"):
            for b in batch_sizes:
                ids = prompts[b].to(dev)
                kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                              top_p=1.0, top_k=0, pad_token_id=0, eos_token_id=None)
                if cache == "static":
                    kwargs["cache_implementation"] = "static"

                def gen(n: int) -> None:
                    hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)

                gen(2)   # warm-up
                t_full = _median_s(lambda: gen(new_tokens), dev, 1 if dev.type == "cuda" else repeats)
                t_one = _median_s(lambda: gen(1), dev, repeats)
                add(_row("transformers generate", f"bf16, {cache} cache", b, new_tokens, t_full, t_one))
    return result


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


def format_rollout_rows(result: dict) -> str:
    """Markdown: one row per (impl, mode), decode steps/s and tokens/s per batch size, and the
    engine's bf16 speed against transformers' best cache at each batch size."""
    batches = result["batch_sizes"]
    head = ("| implementation | mode | " + " | ".join(f"steps/s @{b}" for b in batches) + " | "
            + " | ".join(f"tok/s @{b}" for b in batches) + " |")
    out = [head, "|" + " --- |" * 2 + " ---: |" * (2 * len(batches))]
    keys = list(dict.fromkeys((r["impl"], r["mode"]) for r in result["rows"]))
    by = {(r["impl"], r["mode"], r["batch"]): r for r in result["rows"]}
    for impl, mode in keys:
        cells = [by.get((impl, mode, b)) for b in batches]
        out.append(f"| {impl} | {mode} | "
                   + " | ".join(f"{c['decode_steps_per_s']:,.1f}" if c else "-" for c in cells) + " | "
                   + " | ".join(f"{c['tokens_per_s']:,.0f}" if c else "-" for c in cells) + " |")
    if result.get("limit_steps_per_s"):
        out.append("")
        out.append(f"Bandwidth limit: {result['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s (a copy, "
                   f"measured) / {result['weight_bytes'] / 1e9:.2f} GB read per decode step = "
                   f"{result['limit_steps_per_s']:,.0f} steps/s.")
        for r in result["rows"]:
            if "of_limit" in r:
                out.append(f"- engine {r['mode']}, batch {r['batch']}: {r['of_limit']:.0%} of the limit")
    for b in batches:
        ours = by.get(("lowbit engine", "bf16", b)) or by.get(("lowbit engine", "bf16, decode kernels", b))
        theirs = [by[k] for k in by if k[0] == "transformers generate" and k[2] == b]
        if ours and theirs:
            best = max(theirs, key=lambda r: r["tokens_per_s"])
            out.append(f"- batch {b}: engine {ours['mode']} {ours['tokens_per_s'] / best['tokens_per_s']:.1f}x "
                       f"the tokens/s of generate ({best['mode']})")
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
    return "\n".join(out)
