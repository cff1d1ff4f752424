"""Timers and the step profile every benchmark shares: medians of CUDA events (triton's
do_bench, L2 flushed), CUDA-graph replays (the GPU's time alone), and where a profiled step's
GPU time goes.

On the CPU the timers take one wall-clock call after a warm-up: smoke runs test the code, not
the speed.
"""

from __future__ import annotations

import math
import time

import torch

__all__ = ["time_ms", "time_calls", "graph_time_ms", "sync", "profile_step", "gpu_events", "idle_gaps", "exposed",
           "format_profiles", "record_check", "kernel_category"]


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


def time_calls(calls: dict, device: str, row: dict, progress=print) -> None:
    """row[f"{name}_ms"] = time_ms(fn) for each of calls' (name, fn); a call that raises gets
    row[f"{name}_error"] instead (printed), and the others are still timed."""
    for name, fn in calls.items():
        try:
            row[f"{name}_ms"] = time_ms(fn, device)
        except Exception as e:  # noqa: BLE001 -- one failing call must not lose the table
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
            progress(f"   {row.get('shape', '')} {name}: {row[name + '_error']}")


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


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


_CATEGORIES = (
    # NCCL's collectives (ncclDevKernel_AllReduce_..., ReduceScatter, AllGather) under torchrun
    ("communication (nccl)", ("nccl",)),
    ("quantize (lowbit Triton)", ("_quantize_kernel", "tensor_amax_kernel", "_rht_rows_kernel",
                                 "group_amax_kernel")),
    ("fp8 fold (lowbit Triton)", ("_live_blocks_kernel", "_fold_kernel", "_band_max_kernel",
                                  "_fold_one_chunk_kernel")),
    # before the GEMMs: cuDNN's attention kernels are named "..._sdpa_sm90_flash_..."
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("fp8 gemm", ("f8", "fp8", "e4m3", "_qqtst_")),   # nvjet's FP8 kernels: nvjet_sm90_qqtst_*
    # triton_tem_*: inductor's GEMM templates (max-autotune), epilogues fused in;
    # engine_linear_kernel: lowbit.kernels.engine_linear's GEMM, prologue and epilogue fused in
    ("gemm (bf16/fp32)", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "ampere_", "cublas", "triton_tem",
                          "_linear_kernel",
                          "aten::linear", "aten::mm", "aten::addmm")),   # the last: CPU operators
)


def kernel_category(name: str) -> str:
    """The category a profile sums a GPU kernel (or a CPU aten operator) under: communication
    (NCCL), lowbit's quantize or fold kernels, attention, fp8 gemm, gemm (bf16/fp32), or other."""
    low = name.lower()
    return next((c for c, keys in _CATEGORIES if any(k in low for k in keys)), "other")


def gpu_events(prof) -> list:
    """A torch.profiler profile's GPU work: its kernels and copies, each once. User annotations
    (record_function ranges such as "Optimizer.step#AdamW.step") also appear on the GPU
    timeline, spanning kernels that are counted on their own, and are left out: those flagged
    as annotations, and those named as an annotation on the CPU side. A '#' in a name is no
    sign of one: PyTorch's own kernels carry demangled lambdas, "...::{lambda(int)#1}>"."""
    events = prof.events()
    annotations = {e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU
                   and getattr(e, "is_user_annotation", False)}
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False) and e.name not in annotations]


def profile_step(step, dev: torch.device, top: int = 12, trace: str | None = None) -> dict:
    """Profile one step: GPU time by category (lowbit's quantize / fold kernels, FP8 and other
    GEMMs, attention, everything else), the busy fraction of the step's wall time (the rest is
    the GPU waiting on the host), and the `top` kernels by total time. trace: also write the
    step's Chrome trace there (gzip-compressed for a .gz name), to read in Perfetto."""
    from torch.profiler import ProfilerActivity, profile

    sync(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        sync(dev)
        wall = time.perf_counter() - t0
    if trace:
        prof.export_chrome_trace(trace)
    kernels: dict[str, float] = {}
    spans = []   # (start_us, end_us, name) of every GPU event, for the idle gaps between them
    for event in gpu_events(prof):
        kernels[event.name] = kernels.get(event.name, 0.0) + event.time_range.elapsed_us() / 1e3
        spans.append((event.time_range.start, event.time_range.end, event.name))
    by_category: dict[str, float] = {}
    for name, ms in kernels.items():
        category = kernel_category(name)
        by_category[category] = by_category.get(category, 0.0) + ms
    kernel_ms = sum(kernels.values())
    # busy: the time some kernel ran; with NCCL on its own stream beside compute, kernels
    # overlap, and their sum (kernel_ms) can exceed the wall time
    busy = _covered([(a, b) for a, b, _ in spans]) / 1e3
    communication, compute = [], []
    for a, b, name in spans:
        (communication if kernel_category(name).startswith("communication") else compute).append((a, b))
    # the host side: CPU self time per op / runtime call (a device sync shows up as time in
    # cudaStreamSynchronize / cudaDeviceSynchronize / a device-to-host cudaMemcpyAsync)
    host = {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()
            if e.self_cpu_time_total > 0}
    return {"wall_ms": wall * 1e3, "gpu_busy_ms": busy, "kernel_ms": kernel_ms, **idle_gaps(spans, top),
            "communication_ms": _covered(communication) / 1e3,
            "communication_exposed_ms": exposed(communication, compute) / 1e3,
            "by_category_ms": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
            "top_kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:top]),
            "host_total_ms": sum(ms for ms, _ in host.values()),
            "top_host_ms": dict(sorted(host.items(), key=lambda kv: -kv[1][0])[:top])}


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, stop in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop])
    return [(a, b) for a, b in out]


def _covered(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in _merged(spans))


def exposed(communication: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """How long communication runs with no compute kernel beside it (the same units as the
    (start, end) spans): the time the collectives add to the step, where overlap hides none."""
    hidden, other = 0.0, _merged(compute)
    for a, b in _merged(communication):
        hidden += sum(max(0.0, min(b, d) - max(a, c)) for c, d in other)
    return _covered(communication) - hidden


def idle_gaps(spans: list[tuple[float, float, str]], top: int = 12) -> dict:
    """Where the GPU sat idle between its first and last event: spans are (start_us, end_us,
    name); overlapping spans (several streams) are merged. Returns the span of the timeline,
    the idle total, a histogram of the gaps by length, the idle time summed per pair of
    events either side ("before -> after", names cut to 50 characters), the `top` pairs, and
    the `top` longest gaps one by one (where in the timeline, how long, between which events,
    names cut to 80 characters)."""
    bins = (("< 5 us", 0.005), ("5-20 us", 0.02), ("20-100 us", 0.1), ("0.1-1 ms", 1.0),
            (">= 1 ms", math.inf))
    histogram = {label: [0, 0.0] for label, _ in bins}
    by_pair: dict[str, float] = {}
    end, last = None, ""
    gaps = []   # (ms, at_ms, before, after)
    origin = min((s for s, _, _ in spans), default=0.0)
    for start, stop, name in sorted(spans):
        if end is not None and start > end:
            ms = (start - end) / 1e3
            gaps.append((ms, (end - origin) / 1e3, last[:80], name[:80]))
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
            "top_gaps_ms": dict(sorted(by_pair.items(), key=lambda kv: -kv[1])[:top]),
            "longest_gaps": [{"at_ms": at, "ms": ms, "before": before, "after": after}
                             for ms, at, before, after in sorted(gaps, reverse=True)[:top]]}


def format_profiles(rows: list[dict]) -> str:
    """Where each recipe's profiled step spent its GPU time (rows from bench_train(profile=True))."""
    out = []
    for r in rows:
        p = r.get("profile")
        if not p:
            continue
        out.append(f"\n{r['recipe']}: profiled step {p['wall_ms']:.1f} ms wall, GPU busy "
                   f"{p['gpu_busy_ms']:.1f} ms ({p['gpu_busy_ms'] / p['wall_ms']:.0%})")
        total = p.get("kernel_ms", p["gpu_busy_ms"])   # the categories' shares of all kernel time
        for category, ms in p["by_category_ms"].items():
            out.append(f"  {category:28s} {ms:9.2f} ms  {ms / total:6.1%}")
        if p.get("communication_ms"):
            out.append(f"  communication {p['communication_ms']:.2f} ms, of which "
                       f"{p['communication_exposed_ms']:.2f} ms with no compute kernel beside it")
        if "idle_ms" in p:
            lengths = ", ".join(f"{label}: {h['gaps']} ({h['ms']:.1f} ms)"
                                for label, h in p["idle_histogram"].items())
            out.append(f"  GPU timeline {p['timeline_ms']:.1f} ms, idle {p['idle_ms']:.1f} ms in "
                       f"{p['idle_gap_count']} gaps; by length {lengths}")
            out.append("  idle time by the events either side:")
            for label, ms in p["top_gaps_ms"].items():
                out.append(f"    {ms:9.2f} ms  {label}")
            if p.get("longest_gaps"):
                out.append("  the longest gaps (ms into the timeline: length, before -> after):")
                for g in p["longest_gaps"]:
                    out.append(f"    {g['at_ms']:8.2f}: {g['ms']:6.3f} ms  {g['before'][:50]} -> "
                               f"{g['after'][:50]}")
        out.append("  top kernels:")
        for name, ms in p["top_kernels_ms"].items():
            out.append(f"    {ms:9.2f} ms  {name[:110]}")
        if "top_host_ms" in p:
            out.append(f"  host (CPU self time, {p['host_total_ms']:.1f} ms under the profiler): "
                       "top ops and runtime calls")
            for name, (ms, count) in p["top_host_ms"].items():
                out.append(f"    {ms:9.2f} ms  {count:6d}x  {name[:100]}")
    return "\n".join(out)


def record_check(rows: list[dict], label: str, fn, *args, progress=print) -> None:
    """Run one bit-exact check, fn(*args) (it raises on a mismatch), and append its row to
    `rows`: {"check", "passed"} and, for a failure, its "error". Every failure is reported and
    none stops the run."""
    try:
        fn(*args)
        rows.append({"check": label, "passed": True})
    except Exception as e:  # noqa: BLE001 -- every failure is reported, none stops the run
        rows.append({"check": label, "passed": False, "error": f"{type(e).__name__}: {e}"[:300]})
        progress(f"   FAIL {label}: {rows[-1]['error'][:200]}")
