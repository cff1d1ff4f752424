"""`lowbit bench train`: step time and peak memory of recipes on one model, ratios to bf16.

    lowbit bench train --model 1b --seq-len 2048 --batch-size 4 --recipes bf16,nvfp4,stable-fp4
    lowbit bench train --model tiny --seq-len 64 --batch-size 2 --steps 2 --warmup 1   # CPU smoke

Each recipe gets a fresh model (same seed), converted, with fused AdamW on CUDA; a full
training step (forward under bf16 autocast on CUDA, backward, clip, optimizer) runs on random
tokens. The median step time over --steps timed steps after --warmup untimed ones, and the
peak allocated memory, are printed as a table with ratios to the first recipe (the baseline,
normally bf16). Speed targets are checked here, in a benchmark, never in unit tests.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

__all__ = ["bench_train", "format_profiles", "format_rows", "profile_step"]


def bench_train(model: str = "tiny", recipes=("bf16", "stable-fp4"), seq_len: int = 128,
                batch_size: int = 4, steps: int = 10, warmup: int = 3, device: str = "auto",
                compile: bool = False, n_experts: int | None = None, profile: bool = False,
                progress=print) -> list[dict]:
    from lowbit.models import ModelConfig, build_model
    from lowbit.nn import convert
    from lowbit.recipes import get_recipe

    if steps < 1 or warmup < 0 or seq_len < 1 or batch_size < 1:
        raise ValueError("steps, seq_len and batch_size must be >= 1 and warmup >= 0")
    for name in recipes:
        get_recipe(name)  # refuse an unknown recipe before building anything
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available()
                       else ("cpu" if device == "auto" else device))
    overrides = {"max_seq_len": max(seq_len, 16)}
    if n_experts is not None:
        overrides["n_experts"] = n_experts
    cfg = ModelConfig.preset(model, **overrides)
    rows = []
    for name in recipes:
        torch.manual_seed(0)
        net = build_model(cfg)
        convert(net, name)
        net.to(dev).train()
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=dev.type == "cuda")
        forward = torch.compile(net) if compile else net
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")
        tokens = torch.randint(0, cfg.vocab_size, (batch_size, seq_len + 1), device=dev)
        x, y = tokens[:, :-1], tokens[:, 1:]

        def step():
            optimizer.zero_grad(set_to_none=True)
            with autocast:
                loss = forward(x, y).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            optimizer.step()
            return loss.detach()

        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        for _ in range(warmup):
            step()
        times = []
        for _ in range(steps):
            _sync(dev)
            t0 = time.perf_counter()
            loss = step()
            _sync(dev)
            times.append(time.perf_counter() - t0)
        step_s = statistics.median(times)
        row = {"recipe": name, "step_ms": step_s * 1e3,
               "tokens_per_s": batch_size * seq_len / step_s,
               "peak_mem_gib": (torch.cuda.max_memory_allocated(dev) / 2**30
                                if dev.type == "cuda" else None),
               "loss": loss.item(), "device": str(dev), "model": model,
               "params": sum(p.numel() for p in net.parameters()), "compile": compile}
        if profile and dev.type == "cuda":
            row["profile"] = profile_step(step, dev)
        rows.append(row)
        progress(f"{name}: {row['step_ms']:.1f} ms/step")
        del net, optimizer, forward
    base = rows[0]
    for row in rows:
        row["time_vs_base"] = row["step_ms"] / base["step_ms"]
        row["mem_vs_base"] = (row["peak_mem_gib"] / base["peak_mem_gib"]
                              if row["peak_mem_gib"] and base["peak_mem_gib"] else None)
    return rows


# kernel-name fragments -> where a training step's GPU time goes
_CATEGORIES = (
    ("quantize (lowbit Triton)", ("_quantize_kernel", "_tensor_amax_kernel")),
    ("fp8 fold (lowbit Triton)", ("_block_exponents_kernel", "_fold_kernel")),
    ("fp8 gemm", ("f8", "fp8", "e4m3", "_qqtst_")),   # nvjet's FP8 kernels: nvjet_sm90_qqtst_*
    ("gemm (bf16/fp32)", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "ampere_", "cublas")),
    ("attention", ("flash", "fmha", "attention")),
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
    for event in prof.events():
        # user annotations ("Optimizer.step#AdamW.step") also appear on the GPU timeline,
        # spanning kernels that are counted on their own
        annotation = getattr(event, "is_user_annotation", False) or "#" in event.name
        if event.device_type == torch.autograd.DeviceType.CUDA and not annotation:
            kernels[event.name] = kernels.get(event.name, 0.0) + event.time_range.elapsed_us() / 1e3
    by_category: dict[str, float] = {}
    for name, ms in kernels.items():
        low = name.lower()
        category = next((c for c, keys in _CATEGORIES if any(k in low for k in keys)), "other")
        by_category[category] = by_category.get(category, 0.0) + ms
    busy = sum(kernels.values())
    return {"wall_ms": wall * 1e3, "gpu_busy_ms": busy,
            "by_category_ms": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
            "top_kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:top])}


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
        out.append("  top kernels:")
        for name, ms in p["top_kernels_ms"].items():
            out.append(f"    {ms:9.2f} ms  {name[:110]}")
    return "\n".join(out)


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
    r0 = rows[0]
    return (f"model {r0['model']} ({r0['params'] / 1e6:.1f}M parameters) on {r0['device']}, "
            f"compile={r0['compile']}\n" + "\n".join(out))


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="WHAT", required=True)
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
    p.add_argument("--profile", action="store_true",
                   help="CUDA: profile one more step per recipe and print where its GPU time went")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")


def run(args) -> None:
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if not recipes:
        raise ValueError("--recipes is empty; name at least one, e.g. --recipes bf16,stable-fp4")
    rows = bench_train(args.model, recipes, args.seq_len, args.batch_size, args.steps, args.warmup,
                       args.device, args.compile, args.n_experts, args.profile)
    print(format_rows(rows))
    if args.profile:
        print(format_profiles(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
