"""`lowbit bench`: speed and numerics measured in benchmarks, printed as tables with ratios
against a baseline measured in the same run (never in unit tests).

    lowbit bench train      step time and peak memory of recipes on one model (lowbit.bench.train)
    lowbit bench kernels    the quantize kernels' GB/s against a copy and torchao (lowbit.bench.kernels)

Every subcommand runs on the CPU too, as a smoke test of itself (small shapes; the Triton
kernels under TRITON_INTERPRET=1), which CI runs; its numbers mean something on a GPU only.
Each takes --json PATH to write its rows.
"""

from __future__ import annotations

import json
from pathlib import Path

from lowbit.bench.kernels import KERNEL_SHAPES, bench_kernels, format_kernel_rows
from lowbit.bench.timing import format_profiles
from lowbit.bench.train import bench_train, format_rows

__all__ = ["bench_train", "bench_kernels", "format_rows", "format_kernel_rows",
           "format_profiles", "add_arguments", "run", "write_json"]


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
    k = sub.add_parser("kernels", help="the quantize kernels' GB/s against copy and torchao (CUDA)")
    k.add_argument("--shapes", default=",".join(f"{r}x{c}" for r, c in KERNEL_SHAPES),
                   help="comma-separated ROWSxCOLS bf16 inputs (default: %(default)s)")
    k.add_argument("--no-torchao", action="store_true", help="skip torchao's quantizers")
    k.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    k.set_defaults(bench_func=run_kernels)


def run(args) -> None:
    args.bench_func(args)


def write_json(path: str | None, rows) -> None:
    """--json PATH: the rows as JSON (the folder is made if need be)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(rows, indent=1) + "\n")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """--shapes ROWSxCOLS,... -> [(rows, cols), ...]; a bad one is refused in one line."""
    shapes = []
    for part in (t.strip() for t in text.split(",")):
        if not part:
            continue
        dims = part.lower().split("x")
        if len(dims) != 2 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise ValueError(f"bad shape {part!r} in --shapes; write ROWSxCOLS, e.g. 4096x4096")
        shapes.append((int(dims[0]), int(dims[1])))
    if not shapes:
        raise ValueError("--shapes is empty; e.g. --shapes 4096x4096,8192x8192")
    return shapes


def kernel_device() -> str:
    """Where the Triton kernels can be benchmarked: "cuda", or "cpu" under TRITON_INTERPRET=1
    (a smoke run, said so); refuses anything else in one line."""
    import torch

    from lowbit.kernels import interpret_mode, triton_importable

    if not triton_importable():
        raise ValueError("this benchmark needs triton (pip install triton)")
    if torch.cuda.is_available():
        return "cuda"
    if interpret_mode():
        print("TRITON_INTERPRET=1 on the CPU: this runs the kernels in Triton's interpreter to "
              "check the benchmark itself; the timings mean nothing", flush=True)
        return "cpu"
    raise ValueError("this benchmark needs a CUDA GPU (or TRITON_INTERPRET=1 and small shapes, "
                     "e.g. --shapes 64x256, to try it on the CPU)")


def run_kernels(args) -> None:
    shapes = parse_shapes(args.shapes)
    rows = bench_kernels(shapes, kernel_device(), torchao=not args.no_torchao)
    print(format_kernel_rows(rows))
    write_json(args.json, rows)


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
    write_json(args.json, rows)
