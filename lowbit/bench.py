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

__all__ = ["bench_train", "format_rows"]


def bench_train(model: str = "tiny", recipes=("bf16", "stable-fp4"), seq_len: int = 128,
                batch_size: int = 4, steps: int = 10, warmup: int = 3, device: str = "auto",
                compile: bool = False, n_experts: int | None = None, progress=print) -> list[dict]:
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
        rows.append(row)
        progress(f"{name}: {row['step_ms']:.1f} ms/step")
        del net, optimizer, forward
    base = rows[0]
    for row in rows:
        row["time_vs_base"] = row["step_ms"] / base["step_ms"]
        row["mem_vs_base"] = (row["peak_mem_gib"] / base["peak_mem_gib"]
                              if row["peak_mem_gib"] and base["peak_mem_gib"] else None)
    return rows


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
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")


def run(args) -> None:
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if not recipes:
        raise ValueError("--recipes is empty; name at least one, e.g. --recipes bf16,stable-fp4")
    rows = bench_train(args.model, recipes, args.seq_len, args.batch_size, args.steps, args.warmup,
                       args.device, args.compile, args.n_experts)
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
