"""`lowbit bench fp8 --sections grouped`: an MoE layer's expert GEMMs, each in one launch, in
bf16 against FP8.

The six GEMMs of a layer's experts (gate|up and down; fprop and dgrad with the experts' rows
stacked, wgrad with their tokens along K), as lowbit.ops.grouped lays them out: bf16
torch._grouped_mm against FP8 torch._scaled_grouped_mm with row-wise factors, promoting partial
sums to float32 and fast-accumulating, and beside them one dense GEMM of the same FLOPs in each
precision (torch.mm, torch._scaled_mm): what grouping costs, and whether FP8's tensor cores pay
at an MoE's expert widths. ms (do_bench median, L2 flushed) and TFLOP/s. The values do not
change the time, so the operands are random (bf16, and the same cast to E4M3 with unit
factors), the tokens balanced over the experts; every grouped output is checked against its
experts' products in float32 first (its relative error in the row: bf16's rounding, about
1e-3), so a time is never that of a wrong layout.

Shapes (GPU): the moe-120m preset's experts (32 of width 512, top-4, hidden 1024) at 8192 and
32768 tokens, and a Qwen3-30B-A3B-sized layer (128 experts of width 768, top-8, hidden 2048) at
8192. On the CPU (the smoke run) a tiny layer, bf16 only: torch._scaled_grouped_mm has kernels
for Hopper and datacenter Blackwell GPUs only, and the rows say so.
"""

from __future__ import annotations

import functools

import torch

from lowbit.bench.timing import time_calls

__all__ = ["LAYERS", "grouped_gemms", "grouped_timings", "grouped_error", "format_grouped_timings"]

LAYERS = {"cuda": [("moe-120m", 32, 8192, 4, 1024, 512),
                   ("moe-120m x4 tokens", 32, 32768, 4, 1024, 512),
                   ("qwen3-30b-a3b layer", 128, 8192, 8, 2048, 768)],
          "cpu": [("smoke", 4, 64, 2, 64, 32)]}
"""(label, experts, tokens, top-k, hidden, expert width) per device kind."""

_FP8 = ("fp8_grouped", "fp8_grouped_fast", "fp8_mm")


def grouped_gemms(experts: int, tokens: int, top_k: int, hidden: int, width: int) -> list[tuple]:
    """An MoE layer's six expert GEMMs as (name, layout, rows, n, k): "rows" stacks the experts'
    rows (rows = tokens * top_k, C (rows, n) from B (experts, n, k)); "k" holds each expert's
    tokens along K (k = tokens * top_k, C (experts, rows, n)). gate|up is one (2 * width, hidden)
    weight per expert, down a (hidden, width) one."""
    p = tokens * top_k
    return [("gate_up fprop", "rows", p, 2 * width, hidden),
            ("gate_up dgrad", "rows", p, hidden, 2 * width),
            ("gate_up wgrad", "k", 2 * width, hidden, p),
            ("down fprop", "rows", p, hidden, width),
            ("down dgrad", "rows", p, width, hidden),
            ("down wgrad", "k", hidden, width, p)]


def grouped_error(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor,
                  layout: str) -> float:
    """||out - ref||_F / ||ref||_F, ref expert by expert in float32 on the same operands (a, b
    as the grouped GEMM took them: "rows" a (P, K), b (E, N, K); "k" a (M, P), b (N, P))."""
    bounds = [0, *ends.tolist()]
    a, b = a.float(), b.float()
    if layout == "rows":
        ref = torch.cat([a[s:e] @ b[g].t() for g, (s, e) in enumerate(zip(bounds, bounds[1:]))])
        out = out[:bounds[-1]]
    else:
        ref = torch.stack([a[:, s:e] @ b[:, s:e].t() for s, e in zip(bounds, bounds[1:])])
    return float((out.float() - ref).norm() / ref.norm())


def _has_fp8_grouped(device: str) -> bool:
    return (device == "cuda" and hasattr(torch, "_scaled_grouped_mm")
            and torch.cuda.get_device_capability() in ((9, 0), (10, 0)))


def _calls(layout: str, experts: int, rows: int, n: int, k: int, ends: torch.Tensor, device: str):
    """The operands (a, b and their E4M3 casts) and the timed calls of one GEMM."""
    stacked = layout == "rows"
    # rows: A (P, K), B (E, N, K); k: A (M, P), B (N, P). Either way the grouped GEMM takes B's
    # transpose, column-major (as lowbit.ops.grouped passes it); the dense GEMM of the same
    # FLOPs takes A against B's first expert (rows) or B itself (k)
    a = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(*((experts,) if stacked else ()), n, k, device=device, dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    dense_b, dense_b8 = (b[0], b8[0]) if stacked else (b, b8)
    scale_a = torch.ones(rows if stacked else experts * rows, device=device)
    scale_b = torch.ones(*((experts, n) if stacked else (experts * n,)), device=device)
    scaled = functools.partial(torch._scaled_grouped_mm, a8, b8.transpose(-2, -1), scale_a, scale_b,
                               offs=ends, out_dtype=torch.bfloat16)
    dsa = torch.ones(rows, 1, device=device)
    dsb = torch.ones(1, dense_b.shape[0], device=device)
    calls = {"bf16_grouped": functools.partial(torch._grouped_mm, a, b.transpose(-2, -1), offs=ends),
             "bf16_mm": lambda: torch.mm(a, dense_b.t()),
             "fp8_grouped": scaled,
             "fp8_grouped_fast": functools.partial(scaled, use_fast_accum=True),
             "fp8_mm": lambda: torch._scaled_mm(a8, dense_b8.t(), scale_a=dsa, scale_b=dsb,
                                                out_dtype=torch.bfloat16)}
    return (a, b), (a8, b8), calls


def grouped_timings(device: str, progress=print) -> list[dict]:
    """One row per expert GEMM of each LAYERS[device] layer: ms, TFLOP/s and the checked error
    of each call of the module doc (the FP8 ones where the device has the grouped FP8 GEMM)."""
    results = []
    for label, experts, tokens, top_k, hidden, width in LAYERS[device]:
        total = tokens * top_k
        # balanced; the last expert takes the remainder of an uneven split
        ends = (torch.arange(1, experts + 1, device=device, dtype=torch.int32) * (total // experts))
        ends[-1] = total
        for name, layout, rows, n, k in grouped_gemms(experts, tokens, top_k, hidden, width):
            high, low, calls = _calls(layout, experts, rows, n, k, ends, device)
            row = {"shape": f"{label}: {name}", "layout": layout, "experts": experts,
                   "rows": rows, "N": n, "K": k, "tokens_per_expert": total // experts}
            if not _has_fp8_grouped(device):
                for c in _FP8:
                    del calls[c]
                row["fp8"] = "no FP8 grouped GEMM on this device"
            for c, operands in (("bf16_grouped", high), ("fp8_grouped", low), ("fp8_grouped_fast", low)):
                if c in calls:   # checked before it is timed; a call that raises is left out
                    try:
                        row[f"{c}_rel_err"] = grouped_error(calls[c](), *operands, ends, layout)
                    except Exception as e:  # noqa: BLE001 -- one failing call must not lose the table
                        row[f"{c}_error"] = f"{type(e).__name__}: {e}"[:200]
                        del calls[c]
            time_calls(calls, device, row, progress)
            for c in calls:
                if f"{c}_ms" in row:
                    row[f"{c}_tflops"] = 2 * rows * n * k / row[f"{c}_ms"] / 1e9
            results.append(row)
            progress(f"   {row['shape']}: " + ", ".join(
                f"{key} {v:.3f}" for key, v in row.items() if key.endswith("_ms")))
    return results


def format_grouped_timings(rows: list[dict]) -> str:
    cols = [("bf16_grouped", "bf16 grouped"), ("fp8_grouped", "fp8 grouped"),
            ("fp8_grouped_fast", "fp8 gr. fast"), ("bf16_mm", "bf16 dense"), ("fp8_mm", "fp8 dense")]
    lines = ["TFLOP/s (ratio to bf16 grouped); dense = one GEMM of the same FLOPs",
             f"{'layer: GEMM':36s} {'rows':>6s} {'N':>5s} {'K':>6s} "
             + " ".join(f"{h:>15s}" for _, h in cols)]
    for r in rows:
        base = r.get("bf16_grouped_tflops")
        cells = []
        for key, _ in cols:
            t = r.get(f"{key}_tflops")
            cells.append(f"{'-':>15s}" if t is None else f"{t:15.0f}" if key == "bf16_grouped"
                         or not base else f"{t:8.0f} ({t / base:4.2f})")
        lines.append(f"{r['shape']:36s} {r['rows']:6d} {r['N']:5d} {r['K']:6d} " + " ".join(cells))
    return "\n".join(lines)
