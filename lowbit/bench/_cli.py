"""The `lowbit bench` subcommands: their flags (`add_arguments`, one function per subcommand) and
what each runs (`run`); the package docstring lists them."""

from __future__ import annotations

import argparse
import os

from lowbit.bench._devices import kernel_device, smoke_or_gpu
from lowbit.bench._records import check_json_path, run_meta, write_json

__all__ = ["add_arguments", "run", "parse_shapes"]


def add_arguments(parser) -> None:
    """The `lowbit bench` subcommands, each added by its own function below."""
    sub = parser.add_subparsers(dest="bench", metavar="WHAT", required=True)
    for add in (add_train_bench, add_kernels_bench, add_fp8_bench, add_folds_bench,
                add_recipes_bench, add_rollout_bench):
        add(sub)


def add_train_bench(sub) -> None:
    """`lowbit bench train`."""
    p = sub.add_parser("train", help="step time and peak memory of recipes, ratios to the first")
    p.add_argument("--model", default="tiny",
                   help="model preset, or PATH of a Hugging Face model folder (default: tiny)")
    p.add_argument("--n-experts", type=int, default=None, help="MoE experts (default: the preset's)")
    p.add_argument("--recipes", default="bf16,nvfp4,stable-fp4",
                   help="comma-separated, the first is the baseline (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--interleave", type=int, default=1, metavar="R",
                   help="keep every recipe's model on the device and time R blocks of --steps "
                        "in turns, so drift hits every recipe alike (default: %(default)s)")
    p.add_argument("--device", default="auto")
    p.add_argument("--compile", nargs="?", const="model", default=None, choices=("model", "layers"),
                   help="torch.compile the whole model, as lowbit train --compile; --compile "
                        "layers: each decoder layer on its own, as lowbit rl --compile")
    p.add_argument("--cuda-graph", action="store_true",
                   help="CUDA: replay the step's forward, backward and clip from one CUDA graph, "
                        "as lowbit train --cuda-graph (AdamW eager); with --compile, the "
                        "compiled model")
    p.add_argument("--corpus", default=None,
                   help="train on this corpus's byte tokens, a new batch each step (default: "
                        "one batch of random tokens); e.g. tinyshakespeare")
    p.add_argument("--profile", action="store_true",
                   help="CUDA: profile one more step per recipe and print where its GPU time went")
    p.add_argument("--trace", metavar="DIR",
                   help="with --profile: also write each recipe's profiled step as a Chrome trace, "
                        "DIR/<recipe>.json.gz (open it in Perfetto)")
    p.add_argument("--parallel", default="ddp", choices=("ddp", "fsdp"),
                   help="under torchrun: replicate the model (ddp) or shard it (fsdp), as lowbit "
                        "train --parallel; --batch-size is then the global batch (default: %(default)s)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.set_defaults(bench_func=run_train)


def add_kernels_bench(sub) -> None:
    """`lowbit bench kernels`."""
    from lowbit.bench.kernels import KERNEL_SHAPES
    k = sub.add_parser("kernels", help="the quantize kernels' GB/s against copy and torchao (CUDA)")
    k.add_argument("--shapes", default=",".join(f"{r}x{c}" for r, c in KERNEL_SHAPES),
                   help="comma-separated ROWSxCOLS bf16 inputs (default: %(default)s)")
    k.add_argument("--no-torchao", action="store_true", help="skip torchao's quantizers")
    k.add_argument("--check", action="store_true",
                   help="first check every kernel against the reference quantizer, bit for bit "
                        "(exit status 1 if one differs)")
    k.add_argument("--json", metavar="PATH",
                   help="also write {meta, checks, timings} as JSON")
    k.set_defaults(bench_func=run_kernels)


def add_fp8_bench(sub) -> None:
    """`lowbit bench fp8`."""
    from lowbit.bench.fp8 import SECTIONS
    f = sub.add_parser("fp8", help="the exact MXFP4 GEMM on FP8 tensor cores: checks, error, "
                                   "timings (CUDA)")
    f.add_argument("--sections", default=",".join(SECTIONS),
                   help="comma-separated, of " + ", ".join(SECTIONS) + " (default: all)")
    f.add_argument("--smoke", action="store_true",
                   help="small shapes on the CPU under Triton's interpreter: checks this "
                        "benchmark, measures nothing")
    f.add_argument("--json", metavar="PATH", help="also write {meta, section: rows} as JSON")
    f.set_defaults(bench_func=run_fp8)


def add_folds_bench(sub) -> None:
    """`lowbit bench folds`."""
    d = sub.add_parser("folds", help="per step, layer and operand, the values the sync-free "
                                     "FP8 folds round while training stable-fp4-fp8")
    d.add_argument("--model", default="1b", help="model preset (default: %(default)s)")
    d.add_argument("--corpus", default="tinyshakespeare",
                   help="byte tokens of this corpus (default: %(default)s)")
    d.add_argument("--seq-len", type=int, default=2048)
    d.add_argument("--batch-size", type=int, default=4)
    d.add_argument("--steps", type=int, default=8)
    d.add_argument("--device", default="auto")
    d.add_argument("--v-proj-fp8", action="store_true",
                   help="multiply the v projections on FP8 tensor cores too (the recipe "
                        "keeps them emulated)")
    d.add_argument("--json", metavar="PATH", help="also write the steps as JSON")
    d.set_defaults(bench_func=run_folds)


def add_recipes_bench(sub) -> None:
    """`lowbit bench recipes`."""
    r = sub.add_parser("recipes", help="`lowbit train` runs of several recipes side by side "
                                       "(parallel processes, same tokens and seed), one table",
                       description="Everything after `--` is passed to every `lowbit train` "
                                   "run, e.g. -- --model small --corpus english --steps 900")
    r.add_argument("--name", required=True, help="the comparison's name: runs NAME-<recipe>, "
                                                 "the table and plots in OUT/NAME/")
    r.add_argument("--recipes", required=True, help="comma-separated, the first is the baseline")
    r.add_argument("--out", default="runs", metavar="DIR",
                   help="folder of the runs and the comparison (default: %(default)s)")
    r.add_argument("--deadline-min", type=float, default=8.0,
                   help="stop the runs still going after this many minutes (default: %(default)s)")
    r.add_argument("--fit-min", type=float, default=None,
                   help="choose --steps so that the slowest recipe ends in about this many "
                        "minutes, from a timed probe of every recipe")
    r.add_argument("--probe-s", type=float, default=75.0,
                   help="--fit-min: seconds the probe trains (default: %(default)s)")
    r.add_argument("--probe-window-s", type=float, default=30.0,
                   help="--fit-min: the probe's last seconds whose steps are timed "
                        "(default: %(default)s)")
    r.add_argument("train_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    r.set_defaults(bench_func=run_recipes)


def add_rollout_bench(sub) -> None:
    """`lowbit bench rollout`."""
    from lowbit.bench.rollout import DEFAULT_MODES, MODELS, MODES
    o = sub.add_parser("rollout", help="the RL rollout engine's decode steps/s in every precision "
                                       "mode against the bandwidth limit and transformers' generate")
    o.add_argument("--model", default=None, choices=list(MODELS),
                   help="random-weight model: llama-1.1b (TinyLlama-1.1B's shape), qwen3-0.6b "
                        "(Qwen3-0.6B's), qwen3-moe-1b (Qwen3-MoE, 48 experts, 8 a token), or the "
                        "CPU-sized llama-tiny, qwen3-tiny, qwen3-moe-tiny (default: llama-1.1b on "
                        "CUDA, llama-tiny on the CPU)")
    o.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated engine modes, of {', '.join(MODES)} (default: %(default)s)")
    o.add_argument("--batch-sizes", default=None,
                   help="comma-separated (default: 1,8,32,128,256 on CUDA, 1,2 on the CPU)")
    o.add_argument("--prompt-len", type=int, default=None, help="(default: 128 on CUDA, 16 on the CPU)")
    o.add_argument("--new-tokens", type=int, default=None, help="(default: 256 on CUDA, 8 on the CPU)")
    o.add_argument("--repeats", type=int, default=3, help="timed calls per row, median (default: 3)")
    o.add_argument("--no-generate", action="store_true", help="skip transformers' generate rows")
    o.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                   help="also time every mode with its decode step compiled (torch.compile; "
                        "on the decode kernels where they run, each kernel one operator; dense "
                        "models only; MODE: default or max-autotune-no-cudagraphs)")
    o.add_argument("--decode-kernels", choices=("auto", "on", "off", "both"), default="auto",
                   help="run the engine on lowbit's Triton inference kernels, at every batch size "
                        "and in every mode: auto is the engine's default (on CUDA), both times "
                        "each mode with and without them (default: %(default)s)")
    o.add_argument("--profile", action="store_true",
                   help="also profile each engine row: per decode step, how busy the GPU is "
                        "and which kernels take the time")
    o.add_argument("--device", default="auto")
    o.add_argument("--json", metavar="PATH",
                   help="also write {meta, rows, weight_bytes, bandwidth_bytes_per_s, ...} as JSON")
    o.set_defaults(bench_func=run_rollout)


def run(args) -> None:
    check_json_path(getattr(args, "json", None))   # before the benchmark, not after it ran
    args.bench_func(args)


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


def run_kernels(args) -> None:
    from lowbit.bench.kernels import bench_kernels, format_check_rows, format_kernel_rows, kernel_checks

    shapes = parse_shapes(args.shapes)
    device = kernel_device()
    report = {"meta": run_meta(device)}
    if args.check:
        print("== checks: every kernel against the reference quantizer, bit for bit", flush=True)
        report["checks"] = kernel_checks(device)
        print(format_check_rows(report["checks"]), flush=True)
        write_json(args.json, report)
    report["timings"] = bench_kernels(shapes, device=device, torchao=not args.no_torchao)
    print(format_kernel_rows(report["timings"]))
    write_json(args.json, report)
    if any(not r["passed"] for r in report.get("checks", [])):
        raise SystemExit(1)


def run_fp8(args) -> None:
    from lowbit.bench.fp8 import bench_fp8, parse_sections

    sections = parse_sections(args.sections)
    device = smoke_or_gpu(args.smoke, "lowbit bench fp8")
    report = bench_fp8(sections, device=device,
                       save=lambda report: write_json(args.json, {"meta": run_meta(device),
                                                                  **report}))
    if any(not r["passed"] for r in report.get("checks", [])):
        raise SystemExit(1)


def run_folds(args) -> None:
    from lowbit.bench.folds import count_inexact_folds, format_fold_counts

    steps = count_inexact_folds(args.model, seq_len=args.seq_len, batch_size=args.batch_size,
                                steps=args.steps, device=args.device,
                                v_proj_fp8=args.v_proj_fp8, corpus=args.corpus)
    print(format_fold_counts(steps))
    args_used = {k: getattr(args, k) for k in ("model", "corpus", "seq_len", "batch_size",
                                               "steps", "device", "v_proj_fp8")}
    write_json(args.json, {"meta": run_meta(steps[0]["device"]), "args": args_used,
                           "steps": steps})


def run_recipes(args) -> None:
    from lowbit.bench.recipes import compare_recipes

    compare_recipes(args.name, args.recipes, args.train_args, out=args.out,
                    deadline_min=args.deadline_min, fit_min=args.fit_min, probe_s=args.probe_s,
                    probe_window_s=args.probe_window_s)


def run_rollout(args) -> None:
    from lowbit.bench.rollout import bench_rollout, format_rollout_rows, parse_modes
    from lowbit.rl.engine import COMPILE_MODES
    from lowbit.train.config import resolve_device

    modes = parse_modes(args.modes)
    if args.compile is not None and args.compile not in COMPILE_MODES:
        raise ValueError(f"--compile {args.compile!r}: use one of {', '.join(COMPILE_MODES)}")
    device = str(resolve_device(args.device))
    gpu = device.startswith("cuda")
    batches = _positive_ints(args.batch_sizes or ("1,8,32,128,256" if gpu else "1,2"), "--batch-sizes")
    prompt_len = args.prompt_len or (128 if gpu else 16)
    new_tokens = args.new_tokens or (256 if gpu else 8)
    for name, value in (("--prompt-len", prompt_len), ("--new-tokens", new_tokens),
                        ("--repeats", args.repeats)):
        if value < 1 or (name == "--new-tokens" and value < 2):
            raise ValueError(f"{name} must be {'>= 2' if name == '--new-tokens' else 'positive'} "
                             f"(got {value})")
    if not gpu:
        print("on the CPU this checks the benchmark itself; its speeds mean nothing", flush=True)
    meta = run_meta("cuda" if gpu else "cpu")
    result = bench_rollout(args.model or ("llama-1.1b" if gpu else "llama-tiny"), modes,
                           batch_sizes=batches, prompt_len=prompt_len, new_tokens=new_tokens,
                           repeats=args.repeats, generate_baseline=not args.no_generate,
                           device=device, save=lambda partial: write_json(args.json, {"meta": meta, **partial}),
                           compile_decode=args.compile or False, profile_steps=args.profile,
                           decode_kernels=args.decode_kernels)
    print(format_rollout_rows(result))


def _positive_ints(text: str, flag: str) -> list[int]:
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not parts or not all(t.isdigit() and int(t) > 0 for t in parts):
        raise ValueError(f"{flag} takes comma-separated positive integers, e.g. 1,8,32 (got {text!r})")
    return [int(t) for t in parts]


def run_train(args) -> None:
    from lowbit.bench.timing import format_profiles
    from lowbit.bench.train import bench_train, format_rows

    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if not recipes:
        raise ValueError("--recipes is empty; name at least one, e.g. --recipes bf16,stable-fp4")
    rows = bench_train(args.model, recipes, seq_len=args.seq_len, batch_size=args.batch_size,
                       steps=args.steps, warmup=args.warmup, device=args.device,
                       compile=args.compile, n_experts=args.n_experts, profile=args.profile,
                       cuda_graph=args.cuda_graph, corpus=args.corpus,
                       interleave=args.interleave, parallel=args.parallel, trace=args.trace)
    if os.environ.get("RANK", "0") != "0":   # under torchrun, rank 0 reports for the job
        return
    print(format_rows(rows))
    if args.profile:
        print(format_profiles(rows))
    write_json(args.json, rows)
