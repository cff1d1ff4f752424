"""`lowbit bench train` and `lowbit bench kernels`: speed measured in benchmarks, with ratios
against a baseline timed in the same run (never in unit tests).

    lowbit bench train --model 1b --seq-len 2048 --batch-size 4 --recipes bf16,nvfp4,stable-fp4
    lowbit bench train --model tiny --seq-len 64 --batch-size 2 --steps 2 --warmup 1   # CPU smoke
    lowbit bench kernels                          # the quantize kernels' GB/s vs copy (CUDA)
    TRITON_INTERPRET=1 lowbit bench kernels --shapes 64x256 --no-torchao   # CPU smoke

`bench train`:
Each recipe gets a fresh model (same seed), converted, with fused AdamW on CUDA; a full
training step (forward under bf16 autocast on CUDA, backward, clip, optimizer) runs on random
tokens. The median step time over --steps timed steps after --warmup untimed ones, and the
peak allocated memory, are printed as a table with ratios to the first recipe (the baseline,
normally bf16). Speed targets are checked here, in a benchmark, never in unit tests.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
import time

from pathlib import Path

import torch

__all__ = ["bench_kernels", "bench_train", "format_kernel_rows", "format_profiles", "format_rows",
           "graph_time_ms", "idle_gaps", "profile_step", "time_ms"]


def bench_train(model: str = "tiny", recipes=("bf16", "stable-fp4"), seq_len: int = 128,
                batch_size: int = 4, steps: int = 10, warmup: int = 3, device: str = "auto",
                compile: bool = False, n_experts: int | None = None, profile: bool = False,
                cuda_graph: bool = False, corpus: str | None = None,
                progress=print) -> list[dict]:
    """Each recipe's median step time and peak memory on the same model (seeded init) and the
    same batches, timing lowbit.train's own step (TrainStep: its optimizer groups, schedule,
    clipping, autocast, fold policy and CUDA graph), built as `lowbit train` builds a run.
    corpus None: one batch of random tokens, every step (the preset's vocabulary); a corpus
    name (lowbit.data, byte tokens, as `lowbit train --tokenizer bytes` reads it; the model's
    vocabulary is then 256): step i trains on that corpus's batch i, so the gradients are those
    of text (the FP8 folds' redo count depends on them)."""
    from lowbit.recipes import get_recipe
    from lowbit.train import TrainConfig
    from lowbit.train.build import (apply_recipe, build_data, build_model, build_optimizer,
                                    model_config, resolve_recipe)
    from lowbit.train.config import resolve_device
    from lowbit.train.distributed import Distributed
    from lowbit.train.step import TrainStep, refuse_cuda_graph

    if steps < 1 or warmup < 0 or seq_len < 1 or batch_size < 1:
        raise ValueError("steps, seq_len and batch_size must be >= 1 and warmup >= 0")
    for name in recipes:
        get_recipe(name)  # refuse an unknown recipe before building anything
    dev = resolve_device(device)
    process = Distributed(device=dev)   # one process: the benchmark is not run under torchrun
    total = warmup + steps
    base = TrainConfig(model=model, seq_len=seq_len, batch_size=batch_size, n_experts=n_experts,
                       max_steps=total + (1 if profile else 0), warmup_steps=min(warmup, 1),
                       compile=compile, cuda_graph=cuda_graph, device=str(dev),
                       corpus=corpus or "tinyshakespeare", tokenizer="bytes", progress=False,
                       diagnostics=False)
    data = build_data(base) if corpus is not None else None
    vocab_size = data.vocab_size if data is not None else None
    if cuda_graph:
        refuse_cuda_graph(process, moe=model_config(base).is_moe)
    rows = []
    for name in recipes:
        config = dataclasses.replace(base, recipe=name)
        torch.manual_seed(0)
        net = build_model(config, vocab_size)
        apply_recipe(net, resolve_recipe(name))
        net.to(dev).train()
        optimizer = build_optimizer(net, config, dev)
        step_fn = TrainStep(net, optimizer, config, process)
        tokens = torch.randint(0, net.config.vocab_size, (batch_size, seq_len + 1), device=dev)

        def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            if data is not None:
                return data.train_batch(i)
            return tokens[:, :-1], tokens[:, 1:]

        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        results = []

        def step():
            i = len(results)
            results.append(step_fn(i, *batch(i)))
            return results[-1]

        for _ in range(warmup):
            step()
        times = []
        for _ in range(steps):
            _sync(dev)
            t0 = time.perf_counter()
            result = step()
            _sync(dev)
            times.append(time.perf_counter() - t0 - result.capture_s)
        step_s = statistics.median(times)
        redone = [i + 1 for i, r in enumerate(results)
                  if any(rec["event"] == "fold_redo" for rec in r.records)]
        row = {"recipe": name, "step_ms": step_s * 1e3,
               "tokens_per_s": batch_size * seq_len / step_s,
               "peak_mem_gib": (torch.cuda.max_memory_allocated(dev) / 2**30
                                if dev.type == "cuda" else None),
               "loss": result.loss, "device": str(dev), "model": model,
               "params": sum(p.numel() for p in net.parameters()), "compile": compile,
               "cuda_graph": cuda_graph, "corpus": corpus,
               "fold_redo_steps": len(redone), "steps_run": len(results),
               "fold_redo_at": redone}
        if profile and dev.type == "cuda":
            row["profile"] = profile_step(step, dev)
        rows.append(row)
        progress(f"{name}: {row['step_ms']:.1f} ms/step")
        net = optimizer = step_fn = None   # free this recipe's GPU memory
    base_row = rows[0]
    for row in rows:
        row["time_vs_base"] = row["step_ms"] / base_row["step_ms"]
        row["mem_vs_base"] = (row["peak_mem_gib"] / base_row["peak_mem_gib"]
                              if row["peak_mem_gib"] and base_row["peak_mem_gib"] else None)
    return rows


# kernel-name fragments -> where a training step's GPU time goes
_CATEGORIES = (
    ("quantize (lowbit Triton)", ("_quantize_kernel", "_tensor_amax_kernel", "_rht_rows_kernel")),
    ("fp8 fold (lowbit Triton)", ("_live_blocks_kernel", "_fold_kernel", "_band_max_kernel",
                                  "_fold_one_chunk_kernel")),
    # before the GEMMs: cuDNN's attention kernels are named "..._sdpa_sm90_flash_..."
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("fp8 gemm", ("f8", "fp8", "e4m3", "_qqtst_")),   # nvjet's FP8 kernels: nvjet_sm90_qqtst_*
    ("gemm (bf16/fp32)", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "ampere_", "cublas")),
)


def profile_step(step, dev: torch.device, top: int = 12) -> dict:
    """Profile one step: GPU time by category (lowbit's quantize / fold kernels, FP8 and other
    GEMMs, attention, everything else), the busy fraction of the step's wall time (the rest is
    the GPU waiting on the host), and the `top` kernels by total time."""
    from torch.profiler import ProfilerActivity, profile

    _sync(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        _sync(dev)
        wall = time.perf_counter() - t0
    kernels: dict[str, float] = {}
    spans = []   # (start_us, end_us, name) of every GPU event, for the idle gaps between them
    for event in prof.events():
        # user annotations ("Optimizer.step#AdamW.step") also appear on the GPU timeline,
        # spanning kernels that are counted on their own
        annotation = getattr(event, "is_user_annotation", False) or "#" in event.name
        if event.device_type == torch.autograd.DeviceType.CUDA and not annotation:
            kernels[event.name] = kernels.get(event.name, 0.0) + event.time_range.elapsed_us() / 1e3
            spans.append((event.time_range.start, event.time_range.end, event.name))
    by_category: dict[str, float] = {}
    for name, ms in kernels.items():
        low = name.lower()
        category = next((c for c, keys in _CATEGORIES if any(k in low for k in keys)), "other")
        by_category[category] = by_category.get(category, 0.0) + ms
    busy = sum(kernels.values())
    # the host side: CPU self time per op / runtime call (a device sync shows up as time in
    # cudaStreamSynchronize / cudaDeviceSynchronize / a device-to-host cudaMemcpyAsync)
    host = {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()
            if e.self_cpu_time_total > 0}
    return {"wall_ms": wall * 1e3, "gpu_busy_ms": busy, **idle_gaps(spans, top),
            "by_category_ms": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
            "top_kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:top]),
            "host_total_ms": sum(ms for ms, _ in host.values()),
            "top_host_ms": dict(sorted(host.items(), key=lambda kv: -kv[1][0])[:top])}


def idle_gaps(spans: list[tuple[float, float, str]], top: int = 12) -> dict:
    """Where the GPU sat idle between its first and last event: spans are (start_us, end_us,
    name); overlapping spans (several streams) are merged. Returns the span of the timeline,
    the idle total, a histogram of the gaps by length, and the idle time summed per pair of
    events either side ("before -> after", names cut to 50 characters), the `top` pairs."""
    bins = (("< 5 us", 0.005), ("5-20 us", 0.02), ("20-100 us", 0.1), ("0.1-1 ms", 1.0),
            (">= 1 ms", math.inf))
    histogram = {label: [0, 0.0] for label, _ in bins}
    by_pair: dict[str, float] = {}
    end, last = None, ""
    for start, stop, name in sorted(spans):
        if end is not None and start > end:
            ms = (start - end) / 1e3
            label = next(label for label, upper in bins if ms < upper)
            histogram[label][0] += 1
            histogram[label][1] += ms
            pair = f"{last[:50]} -> {name[:50]}"
            by_pair[pair] = by_pair.get(pair, 0.0) + ms
        if end is None or stop >= end:
            end, last = stop, name
    idle = sum(ms for _, ms in histogram.values())
    return {"timeline_ms": (end - min(s for s, _, _ in spans)) / 1e3 if spans else 0.0,
            "idle_ms": idle, "idle_gap_count": sum(n for n, _ in histogram.values()),
            "idle_histogram": {label: {"gaps": n, "ms": ms} for label, (n, ms) in histogram.items()},
            "top_gaps_ms": dict(sorted(by_pair.items(), key=lambda kv: -kv[1])[:top])}


def format_profiles(rows: list[dict]) -> str:
    """Where each recipe's profiled step spent its GPU time (rows from bench_train(profile=True))."""
    out = []
    for r in rows:
        p = r.get("profile")
        if not p:
            continue
        out.append(f"\n{r['recipe']}: profiled step {p['wall_ms']:.1f} ms wall, GPU busy "
                   f"{p['gpu_busy_ms']:.1f} ms ({p['gpu_busy_ms'] / p['wall_ms']:.0%})")
        for category, ms in p["by_category_ms"].items():
            out.append(f"  {category:28s} {ms:9.2f} ms  {ms / p['gpu_busy_ms']:6.1%}")
        if "idle_ms" in p:
            lengths = ", ".join(f"{label}: {h['gaps']} ({h['ms']:.1f} ms)"
                                for label, h in p["idle_histogram"].items())
            out.append(f"  GPU timeline {p['timeline_ms']:.1f} ms, idle {p['idle_ms']:.1f} ms in "
                       f"{p['idle_gap_count']} gaps; by length {lengths}")
            out.append("  idle time by the events either side:")
            for label, ms in p["top_gaps_ms"].items():
                out.append(f"    {ms:9.2f} ms  {label}")
        out.append("  top kernels:")
        for name, ms in p["top_kernels_ms"].items():
            out.append(f"    {ms:9.2f} ms  {name[:110]}")
        if "top_host_ms" in p:
            out.append(f"  host (CPU self time, {p['host_total_ms']:.1f} ms under the profiler): "
                       "top ops and runtime calls")
            for name, (ms, count) in p["top_host_ms"].items():
                out.append(f"    {ms:9.2f} ms  {count:6d}x  {name[:100]}")
    return "\n".join(out)


# ---- lowbit bench kernels ------------------------------------------------------------------

KERNEL_SHAPES = [(4096, 4096), (8192, 8192), (16384, 8192),
                 (2048, 2048), (5632, 2048), (2048, 5632), (16384, 2048)]   # + a 1B model's GEMMs


def time_ms(fn, device: str) -> float:
    """Median milliseconds of fn() (triton.testing.do_bench, L2 flushed) on CUDA; elsewhere
    (smoke runs, which test the code, not the speed) one wall-clock call after a warm-up."""
    if device != "cuda":
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_time_ms(fn, device: str) -> float | None:
    """Median milliseconds of fn() replayed from a CUDA graph: the GPU's time alone, without the
    Python and launch overhead that time_ms includes when the GPU outruns the host. None on the
    CPU or when fn cannot be captured (it syncs with the host, say)."""
    if device != "cuda":
        return None
    from triton.testing import do_bench_cudagraph
    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as e:  # noqa: BLE001
        print(f"   (no CUDA-graph timing: {type(e).__name__}: {str(e)[:100]})", flush=True)
        torch.cuda.synchronize()
        return None


def kernel_spec(fmt: str, rule: str | None, block: tuple[int, int], two_level: bool | None = None,
                rounding: str = "rne"):
    from lowbit.formats import QuantSpec
    return QuantSpec.make(fmt, block, rule, rounding, tensor_scale=two_level)


def kernel_name(spec, kind: str = "q") -> str:
    rule = spec.scale_rule.value if spec.scale_rule else ("2lvl" if spec.tensor_scale else "1lvl")
    return f"{kind} {spec.format} {rule} {spec.block[0]}x{spec.block[1]} {spec.rounding.value}"


def timed_kernels() -> list[tuple[str, object, str]]:
    """(label, spec, kind) of the timed kernels, the recipes' quantizers first. kind: q
    (quantize to a QTensor), fq (fake quantize), q+t / fq+t (also the transpose)."""
    stable = kernel_spec("mxfp4", "rceil", (32, 32))                 # stable-fp4's quantizer
    stable_sr = kernel_spec("mxfp4", "rceil", (32, 32), rounding="stochastic")
    nvfp4 = kernel_spec("nvfp4", None, (1, 16), True)                # the nvfp4 recipe's
    nvfp4_sr = kernel_spec("nvfp4", None, (1, 16), True, "stochastic")
    nvfp4_w = kernel_spec("nvfp4", None, (16, 16), True)
    rows = [(kernel_name(spec), spec, "q") for spec in [
        stable, stable_sr, kernel_spec("mxfp4", "rceil", (16, 16)), kernel_spec("mxfp4", "rceil", (1, 32)),
        kernel_spec("mxfp4", "floor", (1, 32)), kernel_spec("mxfp8_e4m3", "rceil", (1, 32)),
        kernel_spec("mxfp8_e5m2", "rceil", (1, 32)), nvfp4, kernel_spec("nvfp4", None, (1, 16), False),
        nvfp4_w, nvfp4_sr]]
    rows += [(kernel_name(spec, "fq"), spec, "fq") for spec in [stable, stable_sr, nvfp4, nvfp4_w]]
    rows += [(kernel_name(stable, "q+t"), stable, "q+t"), (kernel_name(stable, "fq+t"), stable, "fq+t")]
    return rows


def kernel_call(spec, kind: str, x: torch.Tensor, seed: torch.Tensor):
    from lowbit.kernels import (fake_quantize_triton, fake_quantize_triton_with_transpose,
                                quantize_triton, quantize_triton_with_transpose)

    s = seed if spec.rounding.value == "stochastic" else None
    call = {"q": quantize_triton, "fq": fake_quantize_triton, "q+t": quantize_triton_with_transpose,
            "fq+t": fake_quantize_triton_with_transpose}[kind]
    return functools.partial(call, x, spec, s)


def moved_bytes(spec, kind: str, shape: tuple[int, int], in_bytes: int = 2) -> int:
    """Bytes read + written by one call: x once; packed codes, scales and the tensor scale
    (quantize) or the values (fake quantize); twice the outputs with the transpose."""
    rows, cols = shape
    br, bc = spec.block
    per_byte = 8 // spec.info.element.code_bits
    codes = rows * (-(-cols // bc) * bc) // per_byte
    scales = (rows if br == 1 else -(-rows // br)) * -(-cols // bc)
    quantized = codes + scales + (4 if spec.tensor_scale else 0)
    n = rows * cols
    return {"q": n * in_bytes + quantized, "q+t": n * in_bytes + 2 * quantized,
            "fq": 2 * n * in_bytes, "fq+t": 3 * n * in_bytes}[kind]


def torchao_baselines() -> dict:
    """kernel label -> (eager fn, compiled fn) of torchao's quantizer for the same format, or {}
    when torchao does not import."""
    try:
        import logging
        import warnings
        logging.getLogger("torchao").setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.prototype.mx_formats.mx_tensor import to_mx
            from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    except Exception as e:  # noqa: BLE001
        print(f"   torchao not importable ({type(e).__name__}: {e}); no baselines", flush=True)
        return {}

    def nvfp4_two_level(x):
        return nvfp4_quantize(x, 16, per_tensor_amax_to_scale(x.abs().amax().float()))

    def nvfp4_one_level(x):
        return nvfp4_quantize(x, 16, None)

    def mx(elem, mode):
        return lambda x: to_mx(x, elem, 32, mode)

    fns = {
        kernel_name(kernel_spec("nvfp4", None, (1, 16), True)): nvfp4_two_level,
        kernel_name(kernel_spec("nvfp4", None, (1, 16), False)): nvfp4_one_level,
        kernel_name(kernel_spec("mxfp4", "rceil", (1, 32))): mx(torch.float4_e2m1fn_x2, ScaleCalculationMode.RCEIL),
        kernel_name(kernel_spec("mxfp4", "floor", (1, 32))): mx(torch.float4_e2m1fn_x2, ScaleCalculationMode.FLOOR),
        kernel_name(kernel_spec("mxfp8_e4m3", "rceil", (1, 32))): mx(torch.float8_e4m3fn, ScaleCalculationMode.RCEIL),
    }
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    return {k: (f, torch.compile(f, dynamic=False)) for k, f in fns.items()}


def bench_kernels(shapes=KERNEL_SHAPES, device: str = "cuda", torchao: bool = True,
                  progress=print) -> list[dict]:
    """Time every kernel of timed_kernels() on bf16 inputs of each shape: microseconds and GB/s
    eager (do_bench) and replayed from a CUDA graph, each as a fraction of a device-to-device
    copy of the same tensor timed the same way in the same run; with torchao, its quantizer
    for the same format, eager and torch.compile'd."""
    baselines = torchao_baselines() if torchao else {}
    seed = torch.tensor([12345], device=device, dtype=torch.int64)
    results = []
    for shape in shapes:
        x = torch.randn(shape, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(x)
        copy_ms = time_ms(functools.partial(dst.copy_, x), device)
        copy_gbs = 4 * x.numel() / copy_ms / 1e6
        copy_graph = graph_time_ms(functools.partial(dst.copy_, x), device)
        copy_graph_gbs = 4 * x.numel() / copy_graph / 1e6 if copy_graph else None
        progress(f"   {shape}: copy {copy_ms * 1e3:.1f} us = {copy_gbs:.0f} GB/s")
        for label, spec, kind in timed_kernels():
            row = {"kernel": label, "shape": list(shape), "copy_us": copy_ms * 1e3,
                   "copy_GBps": copy_gbs}
            try:
                t = time_ms(kernel_call(spec, kind, x, seed), device)
                gbs = moved_bytes(spec, kind, shape) / t / 1e6
                row.update(us=t * 1e3, GBps=gbs, frac_copy=gbs / copy_gbs)
                g = graph_time_ms(kernel_call(spec, kind, x, seed), device)
                if g and copy_graph_gbs:
                    ggbs = moved_bytes(spec, kind, shape) / g / 1e6
                    row.update(graph_us=g * 1e3, graph_GBps=ggbs, graph_frac_copy=ggbs / copy_graph_gbs)
            except Exception as e:  # noqa: BLE001 -- one failing kernel must not lose the table
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            if label in baselines and kind == "q":
                eager, compiled = baselines[label]
                for key, fn in (("torchao_eager_us", eager), ("torchao_compiled_us", compiled)):
                    try:
                        row[key] = time_ms(functools.partial(fn, x), device) * 1e3
                    except Exception as e:  # noqa: BLE001
                        row[key + "_error"] = f"{type(e).__name__}: {e}"[:200]
                if "us" in row and "torchao_compiled_us" in row:
                    row["speedup_vs_compiled"] = row["torchao_compiled_us"] / row["us"]
            results.append(row)
            progress("   " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in row.items() if k not in ("copy_us", "copy_GBps")))
    return results


def format_kernel_rows(results: list[dict]) -> str:
    cols = [("kernel", 34, "s"), ("shape", 12, "s"), ("us", 9, ".1f"), ("GBps", 8, ".0f"),
            ("frac_copy", 9, ".0%"), ("graph_us", 9, ".1f"), ("graph_frac_copy", 9, ".0%"),
            ("torchao_eager_us", 12, ".1f"),
            ("torchao_compiled_us", 12, ".1f"), ("speedup_vs_compiled", 10, ".1f")]
    heads = ["kernel", "shape", "us", "GB/s", "of copy", "graph us", "graph/cp", "ao eager us",
             "ao comp. us", "x ao comp."]
    widths = [w for _, w, _ in cols]
    lines = ["  ".join(h.ljust(w) if i <= 1 else h.rjust(w)
                       for i, (h, w) in enumerate(zip(heads, widths, strict=True)))]
    for r in results:
        cells = []
        for i, (key, w, fmt) in enumerate(cols):
            v = r.get(key)
            if key == "shape":
                v = "x".join(map(str, v))
            text = "-" if v is None else (format(v, fmt) if fmt != "s" else str(v))
            if key == "us" and "error" in r:
                text = "ERROR"
            cells.append(text.ljust(w) if i <= 1 else text.rjust(w))
        lines.append("  ".join(cells))
    for r in [r for r in results if "error" in r][:10]:
        lines.append(f"   error {r['kernel']} {r['shape']}: {r['error']}")
    return "\n".join(lines)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def format_rows(rows: list[dict]) -> str:
    base = rows[0]["recipe"]
    head = ["recipe", "ms/step", "tokens/s", f"time vs {base}", "peak GiB", f"mem vs {base}"]
    lines = [head]
    for r in rows:
        lines.append([r["recipe"], f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
                      f"{r['time_vs_base']:.2f}x",
                      "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}",
                      "-" if r["mem_vs_base"] is None else f"{r['mem_vs_base']:.2f}x"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for k, line in enumerate(lines):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(line, widths))))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    for r in rows:
        if r.get("fold_redo_steps"):
            at = ", ".join(map(str, r.get("fold_redo_at", [])))
            out.append(f"{r['recipe']}: {r['fold_redo_steps']} of {r['steps_run']} steps (number "
                       f"{at}, warm-up included) had inexact one-chunk FP8 folds and were redone "
                       "with exact ones, as lowbit train does (in the times above)")
    r0 = rows[0]
    data = f"{r0['corpus']} bytes" if r0.get("corpus") else "random tokens"
    return (f"model {r0['model']} ({r0['params'] / 1e6:.1f}M parameters) on {r0['device']}, "
            f"compile={r0['compile']}, cuda_graph={r0.get('cuda_graph', False)}, {data}\n"
            + "\n".join(out))


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="WHAT", required=True)
    k = sub.add_parser("kernels", help="the quantize kernels' GB/s against copy and torchao (CUDA)")
    k.add_argument("--shapes", default=",".join(f"{r}x{c}" for r, c in KERNEL_SHAPES),
                   help="comma-separated ROWSxCOLS bf16 inputs (default: %(default)s)")
    k.add_argument("--no-torchao", action="store_true", help="skip torchao's quantizers")
    k.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    k.set_defaults(bench_func=run_kernels)
    p = sub.add_parser("train", help="step time and peak memory of recipes, ratios to the first")
    p.add_argument("--model", default="tiny", help="model preset (default: tiny)")
    p.add_argument("--n-experts", type=int, default=None, help="MoE experts (default: the preset's)")
    p.add_argument("--recipes", default="bf16,nvfp4,stable-fp4",
                   help="comma-separated, the first is the baseline (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--device", default="auto")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--cuda-graph", action="store_true",
                   help="CUDA: replay the step's forward, backward and clip from one CUDA graph, "
                        "as lowbit train --cuda-graph (AdamW eager); with --compile, the "
                        "compiled model")
    p.add_argument("--corpus", default=None,
                   help="train on this corpus's byte tokens, a new batch each step (default: "
                        "one batch of random tokens); e.g. tinyshakespeare")
    p.add_argument("--profile", action="store_true",
                   help="CUDA: profile one more step per recipe and print where its GPU time went")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.set_defaults(bench_func=run_train)


def run(args) -> None:
    args.bench_func(args)


def _shape(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"bad shape {text!r} in --shapes; write ROWSxCOLS, e.g. 4096x4096")
    return int(parts[0]), int(parts[1])


def run_kernels(args) -> None:
    from lowbit.kernels import triton_importable
    from lowbit.kernels.quantize import INTERPRET

    shapes = [_shape(t.strip()) for t in args.shapes.split(",") if t.strip()]
    if not shapes:
        raise ValueError("--shapes is empty; e.g. --shapes 4096x4096,8192x8192")
    if not triton_importable():
        raise ValueError("lowbit bench kernels needs triton (pip install triton)")
    if torch.cuda.is_available():
        device = "cuda"
    elif INTERPRET:
        device = "cpu"
        print("TRITON_INTERPRET=1 on the CPU: this runs the kernels in Triton's interpreter to "
              "check the benchmark itself; the timings mean nothing", flush=True)
    else:
        raise ValueError("lowbit bench kernels needs a CUDA GPU (or TRITON_INTERPRET=1 and small "
                         "--shapes, e.g. 64x256, to try it on the CPU)")
    rows = bench_kernels(shapes, device, torchao=not args.no_torchao)
    print(format_kernel_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def run_train(args) -> None:
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if not recipes:
        raise ValueError("--recipes is empty; name at least one, e.g. --recipes bf16,stable-fp4")
    rows = bench_train(args.model, recipes, args.seq_len, args.batch_size, args.steps, args.warmup,
                       args.device, args.compile, args.n_experts, args.profile, args.cuda_graph,
                       args.corpus)
    print(format_rows(rows))
    if args.profile:
        print(format_profiles(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
