"""The maintainers' tuning sweeps: the launch configs and GEMM modes lowbit's defaults were chosen
from, to re-run when a kernel, Triton or the GPU changes.

    python benchmarks/tune.py amax [--json PATH]            # two-level NVFP4's tensor-amax pass
    python benchmarks/tune.py fold [--operands X,dY]        # the one-chunk FP8 fold's two passes
    python benchmarks/tune.py nvfp4 [--rotated] [--amax]    # nvfp4's quantize and RHT kernels
    python benchmarks/tune.py fp8-gemm                      # torch._scaled_mm's scaling modes
    python benchmarks/tune.py engine-gemm                   # the rollout engine's GEMM tiles
    python benchmarks/tune.py activation                    # its activation pass's warps, RAC on/off
    python benchmarks/tune.py host-overhead [--profile R]   # lowbit's host time per linear
    python benchmarks/tune.py engine-sass                   # the engine GEMM's sm_90 code, on the CPU
    python benchmarks/tune.py activation-sass               # the activation pass's sm_90 code, RAC's forms
    python benchmarks/tune.py compile-sm90                  # every kernel variant, for sm_90
    python benchmarks/tune.py SWEEP --smoke                 # tiny shapes on the CPU

Run from a checkout where lowbit is installed (`pip install -e .`). The first four time on a
CUDA GPU (CUDA-graph replay: the GPU's time alone) and check that every config they try gives
the default's bits; --smoke runs them on tiny shapes on the CPU under Triton's interpreter (set
here before triton is imported), which checks the sweep and the bits, and times nothing;
without a GPU and without --smoke they refuse in one line. The last two need no GPU:
host-overhead measures lowbit's own host-side Python per layer on any machine, the kernels
stubbed (--smoke: a few iterations, to check it); compile-sm90 compiles every Triton kernel
variant lowbit launches for Hopper on the CPU (Triton's front end and ptxas), so a construct
that only the GPU compiler rejects is caught before a GPU is spent.
--json PATH writes the results with the run's date, machine and command. Measured results and
the defaults they chose: docs/results/ (the kernels' and the FP8 GEMM's files).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

SWEEPS = ("amax", "fold", "nvfp4", "fp8-gemm", "engine-gemm", "activation", "engine-sass", "activation-sass",
          "host-overhead", "compile-sm90")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as lowbit's CLI
        print(f"lowbit: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def counts(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated positive integers (row counts, splits, warps...)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tune.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="sweep", metavar="SWEEP", required=True, parser_class=_Parser)
    helps = {"amax": "tile, tiles per program and warps of two-level NVFP4's tensor-amax pass",
             "fold": "tiles and warps of the one-chunk FP8 fold's two passes (stable-fp4-fp8)",
             "nvfp4": "tiles of the quantize kernel on nvfp4's operands, of the row-group RHT "
                      "kernel, and (--amax) of the rotated tensor-amax pass",
             "fp8-gemm": "torch._scaled_mm row-wise against tensor-wise, fast accumulation on "
                         "and off, against bf16 mm: GPU time and error against fp64",
             "engine-gemm": "tiles of the rollout engine's GEMM (lowbit.kernels.engine_linear) on "
                            "packed NVFP4 weights, 1-256 rows of 1.1B and 8B projections, weights "
                            "streamed from HBM, against cuBLAS bf16 and torch._scaled_mm FP8",
             "activation": "warps per row of the rollout engine's activation pass "
                           "(lowbit.kernels.activation_quant: per-token NVFP4, RAC on and off) at "
                           "decode row counts of 0.6B-8B layers' inputs",
             "host-overhead": "host time of one quantized linear's forward + backward per recipe",
             "engine-sass": "the rollout engine GEMM's sm_90 machine code, compiled on this CPU: "
                            "instructions per weight in each tile's main loop, and its loads",
             "activation-sass": "the rollout engine's activation pass's sm_90 machine code, compiled "
                                "on this CPU: instructions, barriers and shuffles a row, without RAC "
                                "and with each of RAC's forms (row-wide, groups of 64, folded)",
             "compile-sm90": "compile every Triton kernel variant for sm_90 on this CPU"}
    for name in SWEEPS:
        p = sub.add_parser(name, help=helps[name], description=helps[name])
        if name not in ("compile-sm90", "engine-sass", "activation-sass"):
            p.add_argument("--smoke", action="store_true",
                           help="a few iterations, to check the harness" if name == "host-overhead"
                           else "tiny shapes on the CPU under Triton's interpreter, untimed")
        p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
        if name == "engine-gemm":
            p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256", type=counts,
                           help="comma-separated row counts M (default: %(default)s)")
            p.add_argument("--default-tiles", action="store_true",
                           help="time the default tile only, not the sweep")
            p.add_argument("--shapes", default=None,
                           help="comma-separated shape names to keep (e.g. '1.1b gate|up,8b down'; "
                                "default: all)")
            p.add_argument("--splits", default="1,2,4,8", type=counts,
                           help="SPLIT_K values (default: %(default)s)")
            p.add_argument("--stages", default="3,4", type=counts,
                           help="num_stages values (default: %(default)s)")
            p.add_argument("--block-ms", default=None, type=counts,
                           help="BLOCK_M values (default: the default tile's, and 128 from 128 rows)")
        if name == "activation":
            p.add_argument("--rows", default="1,16,128,256", type=counts,
                           help="comma-separated row counts M (default: %(default)s)")
            p.add_argument("--warps", default="2,4,8,16,32", type=counts,
                           help="num_warps values, powers of two up to 32 (default: %(default)s)")
            p.add_argument("--digits", default="4,8", type=counts,
                           help="RAC threshold's bits per radix step (RADIX_BITS: 1, 2, 4, 8), "
                                "at the default warps, RAC on (default: %(default)s)")
            p.add_argument("--groups", default="16,64", type=counts,
                           help="RAC's channels chosen within groups of G channels (rac_group; a "
                                "sort a group) instead of over the row, RAC on (default: %(default)s)")
        if name == "fold":
            p.add_argument("--operands", default="X,W,dY",
                           help="comma-separated, of X, W, dY (default: %(default)s)")
        if name == "nvfp4":
            p.add_argument("--rotated", action="store_true", help="only the wgrad operands "
                                                                  "(rotated, transposed views)")
            p.add_argument("--amax", action="store_true",
                           help="also sweep the tensor-amax pass on the rotated operands")
        if name == "activation-sass":
            p.add_argument("--widths", default="1024,2048,3072,4096", type=counts,
                           help="comma-separated row widths K (default: %(default)s)")
        if name == "compile-sm90":
            p.add_argument("--limit", type=int, default=None, metavar="N",
                           help="compile N of the variants, spread over every kernel (a quick "
                                "check; default: all of them)")
        if name == "host-overhead":
            p.add_argument("--profile", metavar="RECIPE", default=None,
                           help="also print a cProfile of this recipe's layer")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.sweep == "compile-sm90":
            results = compile_sm90(args.limit)
            device = "cpu"
        elif args.sweep == "engine-sass":
            results = engine_sass()
            device = "cpu"
        elif args.sweep == "activation-sass":
            results = activation_sass(args.widths)
            device = "cpu"
        elif args.sweep == "host-overhead":
            device = interpreter(args.sweep)
            results = host_overhead(args, device)
        else:
            from lowbit.bench import smoke_or_gpu   # sets TRITON_INTERPRET for --smoke

            device = smoke_or_gpu(args.smoke, f"tune.py {args.sweep}")
            run = {"amax": sweep_amax, "fold": sweep_fold, "nvfp4": sweep_nvfp4,
                   "fp8-gemm": sweep_fp8_gemm, "engine-gemm": sweep_engine_gemm,
                   "activation": sweep_activation}[args.sweep]
            results = run(args, device)
    except ValueError as e:
        print(f"lowbit: error: {e}", file=sys.stderr)
        return 2
    from lowbit.bench import run_meta, write_json

    write_json(args.json, {"meta": run_meta(device), "results": results})
    if args.sweep == "compile-sm90":
        return 1 if results["failed"] or not results["variants"] else 0
    return 0


# ---- shared --------------------------------------------------------------------------------

def interpreter(sweep: str) -> str:
    """"cpu", with Triton's interpreter on (set here if triton is not imported yet): what
    host-overhead runs under, on any machine."""
    from lowbit.kernels import interpret_mode

    if not interpret_mode():
        if "triton" in sys.modules:
            raise ValueError(f"tune.py {sweep} stubs the kernels in Triton's interpreter: set "
                             "TRITON_INTERPRET=1 before triton is first imported")
        os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


def gpu_ms(fn, device: str) -> float | None:
    """fn() once (on the CPU that is the smoke check), then on CUDA its GPU time alone
    (CUDA-graph replay, median ms); None on the CPU."""
    from lowbit.bench.timing import graph_time_ms

    fn()
    return graph_time_ms(fn, device)


def us(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:.1f} us"


def fastest(timings: dict, key=lambda v: v.get("same", True)) -> list[tuple[float, str]]:
    """(ms, label) of the timed entries that pass `key`, fastest first."""
    return sorted((v["ms"], k) for k, v in timings.items()
                  if isinstance(v, dict) and v.get("ms") is not None and key(v))


def top_text(entries: list[tuple[float, str]], n: int = 4) -> str:
    """The n fastest (ms, label) as text; "untimed" where nothing was timed (the CPU)."""
    return ", ".join(f"{label} {us(ms)}" for ms, label in entries[:n]) or "untimed"


def step_text(result) -> str:
    """An attempt's {"ms", "same"} as "12.3 us (same bits)", or its error line."""
    if not isinstance(result, dict):
        return str(result)
    return f"{us(result['ms'])} ({'same bits' if result['same'] else 'OTHER BITS'})"


def attempt(fn):
    """fn()'s result, or the error in one line (a config past the registers, say)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 -- every config is tried and reported
        return f"{type(e).__name__}: {str(e)[:120]}"


def copy_bandwidth(x, device: str) -> tuple[float | None, float | None]:
    """(ms, GB/s read + write) of a device-to-device copy of x."""
    import torch

    y = torch.empty_like(x)
    ms = gpu_ms(lambda: y.copy_(x), device)
    return ms, (2 * x.numel() * x.element_size() / ms / 1e6 if ms else None)


# ---- amax ------------------------------------------------------------------------------------

def sweep_amax(args, device: str) -> dict:
    """Two-level NVFP4's tensor-amax pass on bf16 x: per (tile, warps, tiles per program) GPU
    time, read GB/s against a copy's and whether the amax is torch's (of x, or of
    random_hadamard(x) with the fused transform); chose lowbit.kernels.quantize.amax_config."""
    import torch

    from lowbit.formats.hadamard import random_hadamard
    from lowbit.kernels.launch import cdiv
    from lowbit.kernels.quantize import (INTERPRET, amax_config, default_config, sm_count,
                                         tensor_amax_kernel)

    dev = torch.device(device)
    shapes = [(8192, 2048), (8192, 5632), (5632, 2048), (16384, 8192)]
    grid_configs = [(tr, tc, w, it) for tr, tc in [(32, 128), (64, 128), (32, 256), (64, 256),
                                                   (16, 512)]
                    for w in (4, 8) for it in (1, 4, 16)]
    if args.smoke:
        shapes, grid_configs = [(64, 96)], [(32, 64, 4, 1), (16, 32, 4, 2)]
    signs = torch.tensor([1.0, -1.0] * 8, device=dev)
    out = {}
    for rows, cols in shapes:
        x = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16)
        copy_ms, copy_bw = copy_bandwidth(x, device)
        want = {False: x.float().abs().max().view(torch.int32).item(),
                True: random_hadamard(x, signs).float().abs().max().view(torch.int32).item()}
        amax = torch.zeros(1, device=dev, dtype=torch.int32)
        tile = default_config(rows, cols, (1, 16))
        launches = [(*amax_config(rows, cols, 1, tile, had, sm_count(dev)), had, " default")
                    for had in (False, True)]        # what lowbit launches, without and with
        launches += [(*c, False, "") for c in grid_configs]
        launches += [(*c, True, "") for c in grid_configs if args.smoke or c[2:] == (8, 4)]
        row = {"copy_ms": copy_ms, "copy_GBs": copy_bw, "torch_abs_amax_ms":
               gpu_ms(lambda: x.abs().amax(), device), "configs": {}}
        for tr, tc, w, iters, had, note in launches:
            n_tc, n_tr = cdiv(cols, tc), cdiv(rows, tr)

            def launch(tr=tr, tc=tc, w=w, iters=iters, had=had, n_tc=n_tc, n_tr=n_tr):
                tensor_amax_kernel[(cdiv(n_tc * n_tr, iters),)](
                    x, amax, signs, rows, cols, 0, *x.stride(), n_tc, n_tr, n_tc * n_tr,
                    ITERS=iters, TILE_R=tr, TILE_C=tc, NATIVE_CAST=not INTERPRET, HADAMARD=had,
                    num_warps=w)

            def timed(launch=launch, had=had):
                amax.zero_()
                launch()
                same = amax.item() == want[had]
                ms = gpu_ms(launch, device)
                return {"ms": ms, "same": same,
                        "vs_copy": x.numel() * 2 / ms / 1e6 / copy_bw if ms else None}
            key = f"{tr}x{tc} w{w} it{iters}{' hadamard' if had else ''}{note}"
            row["configs"][key] = attempt(timed)
        top = fastest({k: v for k, v in row["configs"].items() if "hadamard" not in k})
        print(f"{rows}x{cols}: copy {us(copy_ms)}; "
              + ", ".join(f"{k} {us(v['ms'])}" for k, v in row["configs"].items()
                          if isinstance(v, dict) and "default" in k)
              + "; fastest " + top_text(top))
        bad = [k for k, v in row["configs"].items() if not (isinstance(v, dict) and v["same"])]
        print(f"    {len(row['configs']) - len(bad)}/{len(row['configs'])} configs give torch's "
              "amax" + (f"; not: {', '.join(bad)}" if bad else ""))
        out[f"{rows}x{cols}"] = row
    return out


# ---- fold ------------------------------------------------------------------------------------

def sweep_fold(args, device: str) -> dict:
    """The one-chunk fold's passes (x and x^T from the same two passes, 32x32 rceil tiles; dY
    stochastically rounded) on stable-fp4-fp8's 1B operands: GPU time per pass-1 and pass-2
    tile, each with the other pass at the default (fold_configs), whether every output equals
    the default's bit for bit, and the two best together; chose fold_configs."""
    import torch

    from lowbit.formats.spec import QuantSpec
    from lowbit.kernels.fp8_fold import fold_configs, quantize_fold_mxfp4_with_transpose
    from lowbit.kernels.quantize import TileConfig

    dev = torch.device(device)
    pass1 = [(32, 128, 4), (32, 128, 8), (64, 128, 4), (64, 128, 8), (32, 256, 4), (32, 256, 8),
             (64, 256, 8), (128, 128, 8), (128, 256, 8), (128, 256, 16), (64, 512, 8)]
    pass2 = [(32, 128, 4), (32, 128, 8), (32, 64, 4), (64, 64, 4), (64, 64, 8), (64, 128, 4),
             (64, 128, 8), (32, 256, 8), (64, 256, 8), (128, 64, 4), (128, 64, 8),
             (128, 128, 8), (128, 128, 16)]
    operands = [("X", 8192, 2048, False), ("X", 8192, 5504, False), ("W", 5504, 2048, False),
                ("W", 2048, 5504, False), ("dY", 8192, 2048, True), ("dY", 8192, 5504, True)]
    if args.smoke:
        pass1, pass2 = [(32, 128, 4), (32, 64, 4)], [(32, 64, 4), (64, 64, 4)]
        operands = [("X", 96, 96, False), ("dY", 64, 128, True)]
    wanted = [t.strip() for t in args.operands.split(",") if t.strip()]
    if not wanted or set(wanted) - {"X", "W", "dY"}:
        raise ValueError(f"--operands takes X, W and dY; got {args.operands!r}")
    seed = torch.tensor([1234], dtype=torch.int64, device=dev)   # made before any graph capture
    out = {}
    for name, rows, k, sr in operands:
        if name not in wanted:
            continue
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        spec = QuantSpec.make("mxfp4", (32, 32), "rceil", "stochastic" if sr else "rne")
        copy_ms, copy_bw = copy_bandwidth(x, device)
        over = torch.zeros(1, dtype=torch.int64, device=dev)

        def fold(configs):
            return quantize_fold_mxfp4_with_transpose(x, spec, seed, counter=over,
                                                      path="one_chunk", configs=configs)

        def bits(configs):
            return [t for op in fold(configs) for t in (op.fp8.view(torch.uint8), op.factors,
                                                        op.nan_rows)]

        default = fold_configs(rows, k, spec.block)
        ref = bits(default)

        def timed(configs):
            same = all(torch.equal(a, b) for a, b in zip(bits(configs), ref))
            return {"ms": gpu_ms(lambda: fold(configs), device), "same": same}

        row = {"copy_ms": copy_ms, "copy_GBs": copy_bw,
               "default": {"configs": [list(c) for c in default], **timed(default)}}
        best = {}
        for which, grid in ((1, pass1), (2, pass2)):
            for cfg in (TileConfig(*c) for c in grid):
                configs = (cfg, default[1]) if which == 1 else (default[0], cfg)
                key = f"pass{which} {cfg[0]}x{cfg[1]} w{cfg[2]}"
                row[key] = attempt(lambda: timed(configs))
                ms = row[key]["ms"] if isinstance(row[key], dict) and row[key]["same"] else None
                if which not in best or (ms is not None and (best[which][0] is None
                                                              or ms < best[which][0])):
                    best[which] = (ms, key, cfg)
        both = (best[1][2], best[2][2])
        row["best"] = {"configs": [list(c) for c in both], **timed(both)}
        moved = 2 * x.numel() + 4 * x.numel()   # pass 1 reads x; pass 2 reads x, writes 2 bytes
        same = all(isinstance(v, dict) and v["same"] for key, v in row.items()
                   if key.startswith("pass") or key == "best")
        print(f"{name} {rows}x{k} {'SR' if sr else 'RNE'}: copy {us(copy_ms)}; default "
              f"{[tuple(c) for c in default]} {us(row['default']['ms'])}; best pass 1 "
              f"{best[1][1]}, pass 2 {best[2][1]}: both {us(row['best']['ms'])}; every config "
              f"equal to the default: {same}"
              + (f"; both passes at copy speed {moved / copy_bw / 1e3:.1f} us" if copy_bw else ""))
        out[f"{name} {rows}x{k}"] = row
    return out


# ---- nvfp4 -----------------------------------------------------------------------------------

def sweep_nvfp4(args, device: str) -> dict:
    """nvfp4's fake quantization (1x16 two-level) of a 1B step's operands: X and dY along
    features (dY stochastic), and the wgrad operands X^T and dY^T, transposed views rotated by
    the fused random Hadamard transform: GPU time per quantize-kernel tile against a copy, and
    whether the values equal the default tile's; for the rotated ones also the row-group
    kernel's configs (lowbit.kernels.hadamard, the same values) and, with --amax, the tensor-amax
    pass's. Chose quantize.py's and hadamard.py's nvfp4 configs."""
    import torch

    from lowbit.formats.hadamard import random_hadamard
    from lowbit.formats.spec import QuantSpec
    from lowbit.kernels import run_quantize_kernel, seed_tensor
    from lowbit.kernels import quantize as kq
    from lowbit.kernels.hadamard import fake_quantize_rht_rows
    from lowbit.kernels.launch import cdiv

    dev = torch.device(device)
    configs = [(32, 128, 4), (16, 128, 4), (32, 128, 8), (64, 128, 8), (32, 64, 4), (64, 64, 4),
               (16, 256, 4), (32, 256, 8), (64, 256, 8), (128, 64, 8), (8, 512, 4), (16, 512, 8)]
    rht_rows = [(g, f, w) for g in (1, 2, 4) for f in (128, 256, 512) for w in (4, 8)]
    amax_grid = [(tr, tc, w, it) for tr, tc in [(16, 128), (32, 128), (64, 128), (32, 256),
                                                (64, 64), (128, 64), (16, 256)]
                 for w in (4, 8) for it in (1, 2, 4)]
    operands = [("X", 8192, 2048, False, False), ("X", 8192, 5504, False, False),
                ("dY", 8192, 2048, True, False), ("dY", 8192, 5504, True, False),
                ("X^T rht", 8192, 2048, False, True), ("X^T rht", 8192, 5504, False, True),
                ("dY^T rht", 8192, 2048, True, True), ("dY^T rht", 8192, 5504, True, True)]
    if args.smoke:
        configs, rht_rows, amax_grid = configs[:2], [(1, 32, 4), (2, 64, 4)], amax_grid[:2]
        operands = [("dY", 32, 64, True, False), ("dY^T rht", 32, 64, True, True)]
    signs = (torch.randint(0, 2, (16,), device=dev) * 2 - 1).float()
    seed = seed_tensor(1234, None, dev)
    out = {}
    for name, rows, feats, sr, rotated in operands:
        if args.rotated and not rotated:
            continue
        spec = QuantSpec.make("nvfp4", (1, 16), None, "stochastic" if sr else "rne")
        base = torch.randn(rows, feats, device=dev, dtype=torch.bfloat16)
        x = base.mT if rotated else base                 # the wgrad operand: (features, tokens)
        had = signs if rotated else None
        copy_ms, _ = copy_bandwidth(base, device)

        def run(cfg):
            return run_quantize_kernel(x, spec, seed if sr else None, None, codes=False,
                                       values=True, transpose=False, config=cfg, hadamard=had)[0]

        default = kq.default_config(x.shape[0], x.shape[1], spec.block)
        ref = run(default).view(torch.int16)
        row = {"copy_ms": copy_ms, "configs": {}}
        for cfg in [tuple(default)] + [c for c in configs if c != tuple(default)]:
            cfg = kq.TileConfig(*cfg)
            row["configs"][str(tuple(cfg))] = attempt(lambda: {
                "same": torch.equal(run(cfg).view(torch.int16), ref),
                "ms": gpu_ms(lambda: run(cfg), device), "default": cfg == default})
        summary = [f"{name} {rows}x{feats}{' SR' if sr else ''}: copy {us(copy_ms)}; default "
                   f"{tuple(default)} {us(row['configs'][str(tuple(default))]['ms'])}; fastest "
                   + top_text(fastest(row["configs"]))]
        equal = sum(1 for v in row["configs"].values() if isinstance(v, dict) and v["same"])
        summary.append(f"    {equal}/{len(row['configs'])} tiles give the default tile's values")
        if rotated:   # the row-group kernel on the untransposed tensor: the same values
            want = ref.mT.contiguous()
            row["rht_rows"] = {str(cfg): attempt(lambda cfg=cfg: {
                "same": torch.equal(fake_quantize_rht_rows(
                    base, spec, signs, seed if sr else None, config=cfg).view(torch.int16), want),
                "ms": gpu_ms(lambda: fake_quantize_rht_rows(base, spec, signs, seed if sr else None,
                                                            config=cfg), device)})
                for cfg in rht_rows}
            equal = sum(1 for v in row["rht_rows"].values() if isinstance(v, dict) and v["same"])
            summary.append("    row-group kernel (G, TILE_F, warps): fastest "
                           + top_text(fastest(row["rht_rows"]))
                           + f"; {equal}/{len(row['rht_rows'])} configs equal the transposed-view "
                           "kernel")
        if rotated and args.amax:   # the tensor-amax pass alone, over the rotated groups
            x3 = x.reshape(1, -1, x.shape[-1])
            r_, c_ = x3.shape[1], x3.shape[2]
            want_amax = random_hadamard(x, signs).float().abs().max().view(torch.int32).item()
            amax = torch.zeros(1, device=dev, dtype=torch.int32)
            timings = {}
            for tr, tc, w, it in amax_grid:
                n_tc, n_tr = cdiv(c_, tc), cdiv(r_, tr)

                def launch(tr=tr, tc=tc, w=w, it=it, n_tc=n_tc, n_tr=n_tr):
                    kq.tensor_amax_kernel[(cdiv(n_tc * n_tr, it),)](
                        x3, amax, signs, r_, c_, *x3.stride(), n_tc, n_tr, n_tc * n_tr, ITERS=it,
                        TILE_R=tr, TILE_C=tc, NATIVE_CAST=not kq.INTERPRET, HADAMARD=True,
                        num_warps=w)

                def timed(launch=launch):
                    amax.zero_()
                    launch()
                    return {"same": amax.item() == want_amax, "ms": gpu_ms(launch, device)}
                timings[f"{tr}x{tc} w{w} it{it}"] = attempt(timed)
            row["amax"] = timings
            cfg_r, cfg_c, cfg_w, cfg_it = kq.amax_config(r_, c_, 1, default, True, kq.sm_count(dev))
            equal = sum(1 for v in timings.values() if isinstance(v, dict) and v["same"])
            summary.append(f"    rotated amax: default {cfg_r}x{cfg_c} w{cfg_w} it{cfg_it}; "
                           "fastest " + top_text(fastest(timings))
                           + f"; {equal}/{len(timings)} configs give the rotation's amax")
        print("\n".join(summary))
        out[f"{name} {rows}x{feats}"] = row
    return out


# ---- fp8-gemm --------------------------------------------------------------------------------

def sweep_fp8_gemm(args, device: str) -> dict:
    """stable-fp4-fp8's 1B GEMMs (o, gate/up, down; fprop, dgrad, wgrad) through
    torch._scaled_mm on random E4M3 operands with power-of-two row factors over 2^+-4: row-wise
    factors (what lowbit runs) against one scale per tensor, each with and without
    use_fast_accum, and bf16 torch.mm, in GPU time; and the error of the row-wise GEMM with
    bf16 output (with and without fast accumulation) and of bf16 mm against an fp64 GEMM of
    the same values."""
    import torch

    dev = torch.device(device)
    d, f, t = 2048, 5504, 8192          # model dim, MLP hidden, tokens (batch 4 x 2048)
    gemms = [("o fprop", t, d, d), ("o dgrad", t, d, d), ("o wgrad", d, d, t),
             ("gate/up fprop", t, f, d), ("gate/up dgrad", t, d, f), ("gate/up wgrad", f, d, t),
             ("down fprop", t, d, f), ("down dgrad", t, f, d), ("down wgrad", d, f, t)]
    if args.smoke:
        gemms = [("smoke", 64, 96, 128)]
    g = torch.Generator(device=dev).manual_seed(0)

    def operand(rows, k):
        codes = torch.randint(0, 256, (rows, k), device=dev, dtype=torch.uint8, generator=g)
        codes[(codes & 0x7F) == 0x7F] = 0x38          # no NaN codes
        factors = torch.exp2(torch.randint(-4, 5, (rows,), device=dev, generator=g).float())
        return codes.view(torch.float8_e4m3fn), factors

    def rel_err(c, ref):
        return ((c.double() - ref).norm() / ref.norm()).item()

    results = {}
    one = torch.ones((), device=dev)
    for name, m, n, k in gemms:
        a8, sa = operand(m, k)
        b8, sb = operand(n, k)
        a16 = (a8.float() * sa[:, None]).bfloat16()
        b16 = (b8.float() * sb[:, None]).bfloat16()
        sa2, sb2 = sa[:, None].contiguous(), sb[None, :].contiguous()

        def scaled(scale_a, scale_b, fast):
            return lambda: torch._scaled_mm(a8, b8.t(), scale_a=scale_a, scale_b=scale_b,
                                            out_dtype=torch.bfloat16, use_fast_accum=fast)
        fns = {"bf16_mm": lambda: torch.mm(a16, b16.t()),
               "rowwise": scaled(sa2, sb2, False), "rowwise_fast": scaled(sa2, sb2, True),
               "tensorwise": scaled(one, one, False), "tensorwise_fast": scaled(one, one, True)}
        row = {"M": m, "N": n, "K": k}
        for key, fn in fns.items():
            row[f"{key}_ms"] = gpu_ms(fn, device)
        ref = (a8.double() * sa[:, None].double()) @ (b8.double() * sb[:, None].double()).t()
        for key in ("rowwise", "rowwise_fast", "bf16_mm"):
            row[f"err_{key}"] = rel_err(fns[key](), ref)
        base = row["bf16_mm_ms"]
        print(f"{name:14} {m:5} {n:5} {k:5}: bf16 mm {us(base)}; row-wise {us(row['rowwise_ms'])}, "
              f"fast {us(row['rowwise_fast_ms'])}; tensor-wise {us(row['tensorwise_ms'])}, fast "
              f"{us(row['tensorwise_fast_ms'])}; rel. error (bf16 out): row-wise "
              f"{row['err_rowwise']:.2e}, fast {row['err_rowwise_fast']:.2e}, bf16 mm "
              f"{row['err_bf16_mm']:.2e}")
        results[name] = row
    if device == "cuda":
        total = {key: sum(r[f"{key}_ms"] or 0 for r in results.values()) * 1e3 for key in
                 ("bf16_mm", "rowwise", "rowwise_fast", "tensorwise", "tensorwise_fast")}
        print("sum over the GEMMs (us): " + ", ".join(f"{k} {v:.0f}" for k, v in total.items()))
    return results


# ---- engine-gemm ---------------------------------------------------------------------------

def sweep_engine_gemm(args, device: str) -> dict:
    """lowbit.kernels.engine_linear on decode and prefill row counts (M = 1..256) of
    TinyLlama-1.1B's and Llama-3-8B's projections, dense bf16 and packed NVFP4 weights, each
    tile against cuBLAS's bf16 F.linear (and torch._scaled_mm's FP8 row-wise GEMM) on the same
    shape: GPU time per call and the weight bytes read per second. Each call reads another copy
    of the weight, enough copies to pass the L2, so the weights stream from HBM as in a decode
    step. At one row the NVFP4 kernel's CUDA-core tiles (USE_DOT False) are swept too (not under
    --smoke, whose one tile a row the tests count). Every tile's output is checked against
    dequantize-then-F.linear (to rounding)."""
    import itertools
    import math

    import torch
    import torch.nn.functional as F

    from lowbit.formats import QuantSpec, quantize_with_spec
    from lowbit.formats.linear_weight import LinearWeight
    from lowbit.kernels import engine_linear, nvfp4_gemm

    dev = torch.device(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = [("1.1b q|k|v", 2560, 2048), ("1.1b o", 2048, 2048), ("1.1b gate|up", 11264, 2048),
              ("1.1b down", 2048, 5632), ("0.6b q|k|v", 4096, 1024), ("0.6b down", 1024, 3072),
              ("8b gate|up", 28672, 4096), ("8b down", 4096, 14336)]
    rows = args.rows
    if args.shapes:
        keep = [n.strip() for n in args.shapes.split(",")]
        if unknown := [n for n in keep if n not in {name for name, _, _ in shapes}]:
            raise ValueError(f"--shapes: unknown {unknown}; the shapes are "
                             f"{', '.join(name for name, _, _ in shapes)}")
        shapes = [s for s in shapes if s[0] in keep]
    sweep = [{"BLOCK_N": bn, "SPLIT_K": sk, "num_warps": w, "num_stages": st}
             for bn, sk, w, st in itertools.product((64, 128), args.splits, (4, 8), args.stages)]
    if args.default_tiles:
        sweep = []
    if args.smoke:
        shapes, rows = [("smoke", 48, 96)], (1, 3)
        sweep = [{"BLOCK_N": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1}]
    g = torch.Generator(device=dev).manual_seed(0)
    results = {}
    for name, n, k in shapes:
        dense_bytes = n * k * 2
        copies = 1 if device != "cuda" else max(2, math.ceil(300e6 / (n * k * 0.5625)))
        master = [torch.randn(n, k, device=dev, generator=g).div_(k ** 0.5).to(dtype)
                  for _ in range(copies)]
        spec = QuantSpec.make("nvfp4", (1, 16))
        packed = [LinearWeight.from_qtensors([quantize_with_spec(w, spec)], dtype) for w in master]
        for w in packed:
            w.tiles()      # the NVFP4 kernel's layout, made at sync: not timed
        tiles_k = packed[0].tiles().tiles_k
        fp8 = None
        if device == "cuda":
            f8 = [quantize_with_spec(w, QuantSpec.make("mxfp8_e4m3", (1, k), "rceil")) for w in master]
            fp8 = [LinearWeight.from_qtensors([q], dtype) for q in f8]
        dense_copies = master[:max(2, math.ceil(300e6 / dense_bytes))] if device == "cuda" else master
        for m in rows:
            x = torch.randn(m, k, device=dev, generator=g).to(dtype)
            x2 = torch.randn(m, k, device=dev, generator=g).to(dtype)   # RAC's residual operand

            def per_call(fn, count):
                ms = gpu_ms(fn, device)
                return None if ms is None else ms / count
            expected = F.linear(x.float(), packed[0].reference_values())
            row = {"N": n, "K": k, "M": m, "nvfp4_bytes": packed[0].nbytes, "dense_bytes": dense_bytes,
                   "cublas_ms": per_call(lambda: [F.linear(x, w) for w in dense_copies], len(dense_copies)),
                   "dense_kernel_ms": per_call(lambda: [engine_linear.linear(x, LinearWeight.dense(w))
                                                        for w in dense_copies], len(dense_copies)),
                   "default_ms": per_call(lambda: [engine_linear.linear(x, w) for w in packed], copies),
                   "default_x2_ms": per_call(lambda: [engine_linear.linear(x, w, x2=x2) for w in packed],
                                             copies),
                   "default": str(nvfp4_gemm.nvfp4_tile(m, n, tiles_k))}
            if fp8 is not None and k % 16 == 0 and n % 16 == 0:
                xq = x.to(torch.float8_e4m3fn)
                scale_a = torch.ones(m, 1, device=dev)
                row["scaled_mm_fp8_ms"] = per_call(lambda: [torch._scaled_mm(
                    xq, w.data.view(torch.float8_e4m3fn).t(), scale_a=scale_a,
                    scale_b=w.row_scales[None, :], out_dtype=dtype) for w in fp8], copies)
            timings = {}
            block_ms = ([bm for bm in args.block_ms if bm <= max(16, 2 * m)] if args.block_ms
                        else [16 if m <= 16 else 32 if m <= 32 else 64] + ([128] if m >= 128 else []))
            tiles = [dict(t, BLOCK_M=bm) for t in sweep for bm in block_ms]
            if m == 1 and sweep and not args.smoke:   # the CUDA-core tile (USE_DOT False) at one row
                tiles += [{"BLOCK_M": 1, "BLOCK_N": bn, "SPLIT_K": sk, "USE_DOT": False, "num_warps": w,
                           "num_stages": st}
                          for bn, sk, w, st in itertools.product((8, 16, 32, 64), args.splits, (2, 4, 8),
                                                                 args.stages)]
            for tile in tiles:
                def run(tile=tile):
                    out = engine_linear.linear(x, packed[0], tile=tile).float()
                    same = torch.allclose(out, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
                    return {"ms": per_call(lambda: [engine_linear.linear(x, w, tile=tile) for w in packed],
                                           copies), "same": same}
                timings[str(tile)] = attempt(run)
            row["tiles"] = timings
            gbps = lambda ms, b: "" if not ms else f" ({b / ms / 1e6:,.0f} GB/s)"
            print(f"{name:12} M={m:3}: cuBLAS bf16 {us(row['cublas_ms'])}{gbps(row['cublas_ms'], dense_bytes)}, "
                  f"kernel bf16 {us(row['dense_kernel_ms'])}, nvfp4 default {us(row['default_ms'])}"
                  f"{gbps(row['default_ms'], row['nvfp4_bytes'])}"
                  + f", with RAC's x2 {us(row['default_x2_ms'])}"
                  + (f", fp8 scaled_mm {us(row['scaled_mm_fp8_ms'])}" if row.get("scaled_mm_fp8_ms") else "")
                  + f"; fastest nvfp4: {top_text(fastest(timings), 2)}", flush=True)
            results[f"{name} M={m}"] = row
    return results


def sweep_activation(args, device: str) -> dict:
    """lowbit.kernels.activation_quant.quantize_activations (per-token NVFP4 of a linear's input,
    RAC 25% on and off; one program a row) at each --warps against the default's, and RAC's
    threshold at each --digits bits per radix step, on the inputs
    of Qwen3-0.6B's (K 1024, 2048, 3072) and Llama-3-8B's (4096, 14336) linears, M rows: GPU time
    per call (CUDA-graph replay) and whether every count gives the default's bits; and RAC's
    radix select with its early stop (`early_stop`) and without (`every_radix_step`), and both
    on rows where zeros tie across RAC's cut, the stop's worst case (`ties_at_the_cut`); and
    RAC's channels chosen within groups of each --groups G (`groups`, its own reference's bits)."""
    import torch

    from lowbit.formats.activations import check_rac_group, per_token_nvfp4, rac_residual
    from lowbit.kernels.activation_quant import quantize_activations

    dev = torch.device(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ks, rows, warps, digits = (1024, 2048, 3072, 4096, 14336), args.rows, args.warps, args.digits
    if bad := [w for w in warps if w not in (1, 2, 4, 8, 16, 32)]:
        raise ValueError(f"--warps takes powers of two from 1 to 32; got {bad}")
    if bad := [d for d in digits if d not in (1, 2, 4, 8)]:
        raise ValueError(f"--digits takes 1, 2, 4 or 8; got {bad}")
    groups = args.groups
    for group in groups:
        check_rac_group(group)
    if args.smoke:
        ks, rows, warps, digits, groups = (48,), (1, 3), (2, 4), (4, 8), (16,)
    g = torch.Generator(device=dev).manual_seed(0)
    results = {}
    for k in ks:
        for m in rows:
            x = torch.randn(m, k, device=dev, generator=g).to(dtype)
            x[:, ::97] *= 30   # outlier channels, as real activations have
            for ratio in (0.0, 0.25):
                ref = quantize_activations(x, "nvfp4", ratio)

                def variant(inp, expected, **options):
                    """One setting of the pass: its GPU time, and whether its outputs are
                    `expected` bit for bit."""
                    out = quantize_activations(inp, "nvfp4", ratio, **options)
                    same = all(torch.equal(a, b) for a, b in zip(out, expected) if a is not None)
                    return {"ms": gpu_ms(lambda: quantize_activations(inp, "nvfp4", ratio, **options),
                                         device), "same": same}
                row = {"K": k, "M": m, "rac": ratio,
                       "default_ms": gpu_ms(lambda: quantize_activations(x, "nvfp4", ratio), device),
                       "warps": {str(w): attempt(lambda w=w: variant(x, ref, num_warps=w)) for w in warps}}
                if ratio:
                    row["digits"] = {str(d): attempt(lambda d=d: variant(x, ref, radix_bits=d))
                                     for d in digits}
                    # the radix select with and without its early stop
                    row["every_radix_step"] = attempt(lambda: variant(x, ref, early_stop=False))
                    row["early_stop"] = attempt(lambda: variant(x, ref, early_stop=True))
                    # the stop's worst case: rows on the NVFP4 grid but for 10% of channels, so
                    # fewer residuals are nonzero than RAC chooses and zeros tie across the cut;
                    # checked against the reference quantizers
                    tied = ref[0].clone()
                    tied[:, ::10] += 0.01 * x[:, ::10]
                    tied_hat = per_token_nvfp4(tied)
                    expected = (tied_hat, rac_residual(tied, tied_hat, ratio))
                    row["ties_at_the_cut"] = {
                        str(stop): attempt(lambda stop=stop: variant(tied, expected, early_stop=stop))
                        for stop in (True, False)}
                    # RAC's channels chosen group by group: other channels, so checked against
                    # the reference of that choice
                    x_hat = per_token_nvfp4(x)
                    row["groups"] = {str(gs): attempt(lambda gs=gs: variant(
                        x, (x_hat, rac_residual(x, x_hat, ratio, gs)), rac_group=gs)) for gs in groups}
                print(f"K={k:5} M={m:3} rac={ratio}: default {us(row['default_ms'])}; fastest: "
                      f"{top_text(fastest(row['warps']), 3)}", flush=True)
                if ratio:
                    print(f"    RAC threshold bits per step: {top_text(fastest(row['digits']), 4)}; "
                          f"early stop on / off: {step_text(row['early_stop'])} / "
                          f"{step_text(row['every_radix_step'])}; "
                          f"ties at the cut, early stop on / off: "
                          f"{step_text(row['ties_at_the_cut']['True'])} / "
                          f"{step_text(row['ties_at_the_cut']['False'])}; by group: "
                          + ", ".join(f"{gs}: {step_text(v)}" for gs, v in row["groups"].items()), flush=True)
                results[f"K={k} M={m} rac={ratio}"] = row
    return results


# ---- engine-sass ---------------------------------------------------------------------------

def engine_sass() -> dict:
    """lowbit.kernels.engine_linear's tiles compiled for sm_90 on this CPU (no GPU), with the
    divisibility Triton assumes at run time for 16-aligned pointers and strides, then
    disassembled with the nvdisasm Triton carries: per tile, the instructions of the main loop
    per weight element a thread handles in one trip (at one row a tile is instruction-bound
    above about 4.5 a weight on an H200: 132 SMs x 128 lanes x 1.98 GHz against the bytes
    a weight costs), its global loads by width, and its tensor-core MMAs and the waits for them
    (`WARPGROUP.DEPBAR`). A lead to a kernel's cost before a GPU times it, not a timing; compiled
    by this machine's triton, which may differ from the GPU machine's."""
    import collections
    import re

    from lowbit.kernels import engine_linear, nvfp4_gemm

    dense_fn, nvfp4_fn = engine_linear.engine_linear_kernel, nvfp4_gemm.nvfp4_linear_kernel
    # (kernel, rows a tile, weight rows a tile, columns a trip, split over K, warps)
    # (kernel, rows a tile, weight rows a tile, columns a trip, split over K, warps)
    tiles = [("dense", 1, 2, 1024, 1, 4), ("dense", 16, 64, 128, 1, 4),
             ("nvfp4", 16, 64, 128, 1, 4), ("nvfp4", 16, 64, 128, 4, 4), ("nvfp4", 16, 128, 128, 4, 4),
             ("nvfp4", 32, 64, 128, 4, 4), ("nvfp4", 64, 128, 128, 1, 4), ("nvfp4", 64, 128, 128, 1, 8)]
    results = {}
    for fmt, block_m, block_n, block_k, split, warps in tiles:
        fn = dense_fn if fmt == "dense" else nvfp4_fn
        pointers = {n: "*bf16" for n in ("x_ptr", "x2_ptr", "bias_ptr", "norm_ptr", "res_ptr", "y_ptr", "w_ptr")}
        pointers.update(wq_ptr="*i32", ws_ptr="*bf16", rs_ptr="*fp32", part_ptr="*fp32", count_ptr="*i32",
                        tile_expert_ptr="*i32", row_ids_ptr="*i32")
        if fmt == "dense":
            constants = dict(FORMAT=0, PROLOGUE=0, HAS_X2=False, HAS_BIAS=False, HAS_RES=False,
                             GROUPED=False, ROW_DIV=1, SATURATE=False, LIMIT=3.38e38, F32_DOT=False,
                             NATIVE_CAST=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                             USE_DOT=block_m > 1, PDL=False)
        else:
            constants = dict(HAS_X2=False, HAS_BIAS=False, HAS_RES=False, GROUPED=False, ROW_DIV=1,
                             ASM=True, F32_DOT=False, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=split,
                             USE_DOT=True)
        signature = {p.name: "constexpr" if p.is_constexpr else pointers.get(p.name,
                     "fp32" if p.name == "eps" else "i32") for p in fn.params}
        names = list(signature)
        aligned = [n for n in names if n.endswith("_ptr") or n in ("N", "K") or n.startswith("stride")]
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        text = sm90_sass("engine-sass", fn, signature, constants, attrs,
                         {"num_warps": warps, "num_stages": 3})
        loop, body = 0, ""
        for label in sorted(set(re.findall(r"BRA `\((\.L_x_\d+)\)", text))):
            start, end = text.find(label + ":"), text.find("BRA `(" + label + ")")
            if 0 <= start < end and (n := len(instructions(text[start:end]))) > loop:
                loop, body = n, text[start:end]
        per_trip = block_n * block_k / (32 * warps)            # weights a thread decodes a trip
        loads = collections.Counter(re.findall(r"\b(LDG[.A-Z0-9]*|LDGSTS[.A-Z0-9]*)", text))
        # the main loop's tensor-core MMAs and its waits for them (a wait after each: one
        # after another)
        mmas, waits = len(re.findall(r"\bHGMMA\.", body)), len(re.findall(r"\bWARPGROUP\.DEPBAR", body))
        label = f"{fmt} {block_m}x{block_n}x{block_k}" + (f" split {split}" if fmt == "nvfp4" else "") + f" w{warps}"
        results[label] = {"loop_instructions": loop, "weights_per_thread": per_trip,
                          "per_weight": loop / per_trip, "loads": dict(loads), "loop_mmas": mmas,
                          "loop_mma_waits": waits}
        print(f"{label:42} loop {loop:5} instructions, {per_trip:4.0f} weights a thread: "
              f"{loop / per_trip:5.1f} a weight; {mmas} MMAs, {waits} waits; loads {dict(loads)}", flush=True)
    return results


def sm90_sass(sweep: str, fn, signature: dict, constants: dict, attrs: dict | None, options: dict) -> str:
    """A Triton kernel compiled for sm_90 on this CPU (no GPU) and disassembled by the nvdisasm
    Triton carries: the SASS text."""
    import subprocess
    import tempfile

    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(nvdisasm):
        raise ValueError(f"tune.py {sweep} needs the nvdisasm Triton ships ({nvdisasm} is missing)")
    kernel = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                            options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True).stdout


def instructions(sass: str) -> list[str]:
    """The instruction lines of nvdisasm's text (each opens with its address, /*0000*/, four
    hex digits or more: a kernel past 64 KiB of code has five)."""
    import re

    return re.findall(r"^\s+/\*[0-9a-f]{4,}\*/.*$", sass, re.M)


# ---- activation-sass -----------------------------------------------------------------------

def activation_sass(widths: tuple[int, ...] = (1024, 2048, 3072, 4096)) -> dict:
    """lowbit.kernels.activation_quant's pass compiled for sm_90 on this CPU, as the engine
    launches it for a bf16 row with the RMSNorm prologue, per-token NVFP4, at each width K:
    without RAC, and with RAC 25% chosen over the row (every radix step), in groups of 64,
    and in groups of 64 folded into the activation (rac_fold). Per variant: its instructions,
    barriers (BAR) and shuffles (SHFL); the kernel has no loops, so about what a thread runs a
    row. A lead to the pass's cost before a GPU times it (`tune.py activation`), not a timing;
    compiled by this machine's triton, which may differ from the GPU machine's."""
    import torch
    import triton

    from lowbit.kernels import activation_quant as aq
    from lowbit.kernels import quantize as kq

    if max(widths) > aq.MAX_K:
        raise ValueError(f"--widths: the pass holds rows of up to {aq.MAX_K} values (longer ones take the "
                         f"reference), got {max(widths)}")
    fn = aq.activation_kernel
    variants = {"no RAC": (False, 0, False), "RAC over the row": (True, 0, False),
                "RAC in groups of 64": (True, 64, False), "RAC in groups of 64, folded": (True, 64, True)}
    pointers = dict(x_ptr="*bf16", norm_ptr="*bf16", xhat_ptr="*bf16", rhat_ptr="*bf16", codes_ptr="*u8",
                    scale_ptr="*fp32", amax_ptr="*i32")
    results = {}
    for k in widths:
        block_k = max(16, triton.next_power_of_2(k))
        for label, (rac, group, fold) in variants.items():
            constants = dict(MODE=0, RAC=rac, PROLOGUE=1, BLOCK_K=block_k, NATIVE_CAST=True,
                             DIGIT=aq.RADIX_BITS, STATIC=False, OUT_LIMIT=kq.OUT_LIMIT[torch.bfloat16],
                             EARLY=False, GROUP=group, GROUP_IS_BLOCK=group == 64, FOLD=fold)
            signature = {p.name: "constexpr" if p.is_constexpr else pointers.get(p.name, "fp32" if p.name == "eps"
                                                                                 else "i32") for p in fn.params}
            text = sm90_sass("activation-sass", fn, signature, constants, None,
                             {"num_warps": 8, "enable_fp_fusion": False})
            lines = instructions(text)
            row = {"instructions": len(lines), "BAR": sum("BAR" in line for line in lines),
                   "SHFL": sum("SHFL" in line for line in lines)}
            results[f"K={k} {label}"] = row
            print(f"K={k:5} {label:28} {row['instructions']:6} instructions, {row['BAR']:3} barriers, "
                  f"{row['SHFL']:4} shuffles", flush=True)
    return results


# ---- host-overhead ---------------------------------------------------------------------------

def host_overhead(args, device: str) -> dict:
    """Microseconds per forward + backward of one quantized linear (32 x 64 x 64), per recipe:
    the host-side cost that lowbit's own Python adds (dispatch, argument handling, allocation,
    autograd), on any machine. CPU tensors take the kernels' path (lowbit.dispatch.use_kernels
    answers as for a CUDA tensor) with every Triton launch a no-op (the launch arguments are
    still built; Triton's own launcher cost is not counted), and the FP8 GEMM takes its CUDA
    path with torch._scaled_mm a no-op too (an empty output); FP8 folds run inside a deferred
    fold check, as in lowbit.train's step. One intra-op thread: the tensors are tiny, and a
    thread pool's wake-ups would be timed instead. The stubs hold for the measurement only.
    The best of 5 repeats (2 with --smoke, which checks the harness); --profile RECIPE prints
    that recipe's cProfile. The outputs are not computed, so they mean nothing: only the time
    does."""
    import cProfile
    import contextlib
    import functools
    import pstats

    import torch
    from triton.runtime.interpreter import InterpretedFunction

    import lowbit.dispatch._quantizers as quantizers   # where each dispatched quantizer reads use_kernels
    import lowbit.ops.gemms as gemms
    from lowbit import kernels
    from lowbit.dispatch.fold_check import deferred_fold_check
    from lowbit.ops import quant_linear
    from lowbit.recipes import get_recipe, recipe_names

    recipes = ["bf16", "stable-fp4", "stable-fp4-fp8", "nvfp4", "mxfp4"]
    if args.profile is not None and args.profile not in recipe_names():
        raise ValueError(f"--profile: unknown recipe {args.profile!r}; choose from "
                         f"{', '.join(recipe_names())}")
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    warmup, repeats, calls = (3, 2, 5) if args.smoke else (100, 5, 300)

    @contextlib.contextmanager
    def stubbed():
        saved = (InterpretedFunction.__getitem__, quantizers.use_kernels, gemms.fp4_gemm_fp8,
                 torch._scaled_mm, torch.get_num_threads())
        InterpretedFunction.__getitem__ = lambda fn, grid: (lambda *a, **k: None)
        quantizers.use_kernels = lambda t, spec, codes=True: kernels.supports(spec, codes)
        gemms.fp4_gemm_fp8 = functools.partial(saved[2], backend="scaled_mm")
        torch._scaled_mm = lambda a, b, **kw: torch.empty(a.shape[0], b.shape[1],
                                                          dtype=kw["out_dtype"])
        torch.set_num_threads(1)
        try:
            yield
        finally:
            (InterpretedFunction.__getitem__, quantizers.use_kernels, gemms.fp4_gemm_fp8,
             torch._scaled_mm) = saved[:4]
            torch.set_num_threads(saved[4])

    def step(r):
        with deferred_fold_check(x.device):   # as lowbit.train's step: FP8 folds without syncs
            quant_linear(x, w, None, r).sum().backward()

    results = {}
    with stubbed():
        for name in recipes:
            r = get_recipe(name).linear
            for _ in range(warmup):
                step(r)
            best = []
            for _ in range(repeats):
                t = time.perf_counter()
                for _ in range(calls):
                    step(r)
                best.append((time.perf_counter() - t) / calls * 1e6)
            results[name] = min(best)
            print(f"{name} {min(best):.0f} us per linear fwd+bwd")
        if args.profile is not None:
            r = get_recipe(args.profile).linear
            profiler = cProfile.Profile()
            profiler.runcall(lambda: [step(r) for _ in range(calls)])
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    return results


# ---- compile-sm90 ----------------------------------------------------------------------------

def compile_sm90(limit: int | None = None) -> dict:
    """Compile, for sm_90, every Triton kernel variant lowbit's entry points launch (the
    recipes' MXFP4 1D/2D floor/rceil RNE/SR with transposes, whole-tile and ragged shapes,
    float32 / bfloat16 / float16 inputs; MXFP8; NVFP4 1D/2D one- and two-level with the fused
    Hadamard transform and the row-group kernel; intK; both paths of the fold and its pass 1;
    the rollout engine's decode GEMV, each prologue, one row and several, and its attention):
    the entry points run on small CPU tensors with every `kernel[grid](...)` launch intercepted
    and recorded (NATIVE_CAST=True: the GPU's casts) instead of run, then each distinct variant
    is compiled, in parallel over the CPU's cores (Triton caches what it compiled, so a second
    run is quick). Outputs stay uninitialised, so what a caller does after a launch (a
    readback, a fallback) may fail in any way; only compile errors count. limit: compile that
    many of the recorded variants, taken in turn from every kernel and spread over each one's
    variants (`spread_variants`), instead of all."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be a positive number of variants, got {limit}")
    import concurrent.futures
    import multiprocessing

    os.environ.pop("TRITON_INTERPRET", None)   # the kernels must be JITFunctions, not interpreted
    if "lowbit.kernels.quantize" in sys.modules:
        from lowbit.kernels.quantize import INTERPRET
        if INTERPRET:
            raise ValueError("tune.py compile-sm90 needs the kernels compiled, not interpreted: "
                             "run it in a process without TRITON_INTERPRET=1")
    import torch
    from triton.runtime.jit import JITFunction

    types = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
             torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32",
             torch.int64: "i64", torch.bool: "i1"}
    variants: dict[tuple, tuple] = {}   # key -> (module, kernel, signature, constants, options)

    def record(fn: JITFunction, args: tuple, kwargs: dict) -> None:
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl") if k in kwargs}
        bound = dict(zip(fn.arg_names, args), **kwargs)
        signature, constants = {}, {}
        for p in fn.params:
            value = bound[p.name] if p.name in bound else p.default
            if p.is_constexpr:
                signature[p.name] = "constexpr"
                constants[p.name] = True if p.name in ("NATIVE_CAST", "ASM") else value   # the GPU's
            elif isinstance(value, torch.Tensor):
                signature[p.name] = "*" + types[value.dtype]
            elif isinstance(value, bool):
                signature[p.name] = "i1"
            elif isinstance(value, int) and value == 1 and not p.do_not_specialize:
                signature[p.name] = "constexpr"    # as Triton specializes it (a unit stride)
                constants[p.name] = 1
            elif isinstance(value, int):
                signature[p.name] = "i64" if abs(value) >= 2**31 else "i32"
            elif isinstance(value, float):
                signature[p.name] = "fp32"
            else:
                raise TypeError(f"{fn.__name__}: cannot type argument {p.name}={value!r}")
        key = (fn.__name__, tuple(sorted(signature.items())),
               tuple(sorted((k, repr(v)) for k, v in constants.items())),
               tuple(sorted(options.items())))
        variants.setdefault(key, (fn.fn.__module__, fn.__name__, signature, constants, options))

    original = JITFunction.__getitem__
    JITFunction.__getitem__ = lambda fn, grid: (lambda *a, **k: record(fn, a, k))
    t0 = time.time()
    try:
        _exercise_kernels()
    finally:
        JITFunction.__getitem__ = original
    failed = []
    chosen = spread_variants(variants, limit)
    spawn = multiprocessing.get_context("spawn")   # the workers import the kernels afresh
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count() or 1, mp_context=spawn) as pool:
        for variant, error in zip(chosen, pool.map(_compile_variant, chosen)):
            if error is not None:
                module, name, _, constants, _ = variant
                label = f"{name} " + " ".join(f"{k}={v}" for k, v in sorted(constants.items()))
                failed.append({"variant": label, "error": error})
                print(f"FAIL {label}\n{error}", flush=True)
    names = sorted({key[0] for key in variants})
    print(f"{len(chosen)} of {len(variants)} kernel variants compiled for sm_90 "
          f"({', '.join(names)}), {len(failed)} failed, {time.time() - t0:.0f}s")
    return {"variants": len(variants), "compiled": len(chosen), "kernels": names,
            "failed": failed}


def spread_variants(variants: dict, limit: int | None) -> list:
    """All the recorded variants, or `limit` of them: one of each kernel in turn, each kernel's
    taken evenly spaced over its own (so every kernel and a spread of its constants compile)."""
    chosen = list(variants.values())
    if limit is None or limit >= len(chosen):
        return chosen
    by_kernel: dict[str, list] = {}
    for key, variant in variants.items():
        by_kernel.setdefault(key[0], []).append(variant)
    queues = []
    for own in by_kernel.values():       # an evenly spaced order: 0, n/2, n/4, 3n/4, ...
        order, step = [], len(own)
        while len(order) < len(own) and step >= 1:
            order += [i for i in range(0, len(own), step) if i not in order]
            step //= 2
        queues.append([own[i] for i in order])
    picked = []
    while len(picked) < limit:
        for queue in queues:
            if queue and len(picked) < limit:
                picked.append(queue.pop(0))
    return picked


def _compile_variant(variant: tuple) -> str | None:
    """Compile one recorded launch for sm_90 (in a worker process); its error, or None."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name, signature, constants, options = variant
    fn = getattr(importlib.import_module(module), name)
    try:
        triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32),
                       options=options)
    except Exception as e:  # noqa: BLE001 -- every variant is tried and reported
        return "".join(traceback.format_exception_only(e))[-1500:]
    return None


def _exercise_kernels() -> None:
    """Call the library's kernel entry points on CPU tensors (each launch compiled, not run)."""
    import torch

    from lowbit.formats import QuantSpec
    from lowbit.kernels import (fake_quantize_triton, fake_quantize_triton_with_transpose,
                                quantize_triton, quantize_triton_with_transpose,
                                stochastic_uniforms, supports)
    from lowbit.kernels import quantize as kq
    from lowbit.kernels.fp8_fold import (fold_pass_one, quantize_fold_mxfp4,
                                         quantize_fold_mxfp4_with_transpose)
    from lowbit.kernels.hadamard import fake_quantize_rht_rows, rht_rows_supported

    kq.INTERPRET = True   # lets the entry points take CPU tensors; the casts are set above

    def attempt_launch(fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 -- after a compiled launch, anything may fail
            pass

    shapes = [(64, 256), (67, 200)]       # whole tiles (unmasked path) and ragged
    specs = [("mxfp4", (1, 32), "floor", "rne"), ("mxfp4", (32, 32), "rceil", "rne"),
             ("mxfp4", (32, 32), "rceil", "stochastic"), ("mxfp4", (1, 32), "rceil", "stochastic"),
             ("mxfp8_e4m3", (32, 32), "rceil", "rne"),
             ("mxfp8_e4m3", (1, 32), "floor", "stochastic"),
             ("nvfp4", (1, 16), None, "rne"), ("nvfp4", (16, 16), None, "rne"),
             ("nvfp4", (1, 16), None, "stochastic"), ("int4", (1, 32), None, "rne"),
             ("int8", (16, 16), None, "stochastic")]
    for fmt, block, rule, rounding in specs:
        spec = QuantSpec.make(fmt, block, rule, rounding)
        seed = 7 if rounding == "stochastic" else None
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            for shape in shapes:
                x = torch.randn(*shape, dtype=dtype)
                if supports(spec, codes=True):
                    attempt_launch(quantize_triton, x, spec, seed=seed)
                    if spec.is_2d:
                        attempt_launch(quantize_triton_with_transpose, x, spec, seed=seed)
                attempt_launch(fake_quantize_triton, x, spec, seed=seed)
                if not spec.is_2d and shape[1] % 16 == 0:          # nvfp4's wgrad operands
                    attempt_launch(fake_quantize_triton, x.t().contiguous().t(), spec, seed=seed,
                                   hadamard=torch.ones(16))
                if rht_rows_supported(x, spec):                     # ... along rows
                    attempt_launch(fake_quantize_rht_rows, x, spec, torch.ones(16), seed=seed)
                if spec.is_2d:
                    attempt_launch(fake_quantize_triton_with_transpose, x, spec, seed=seed)
                if fmt == "mxfp4":
                    counter = torch.zeros(1, dtype=torch.int64)
                    for path in ("one_chunk", "planned"):
                        attempt_launch(quantize_fold_mxfp4, x, spec, seed=seed, counter=counter,
                                       path=path)
                        if spec.is_2d:
                            attempt_launch(quantize_fold_mxfp4, x, spec, transpose=True,
                                           seed=seed, counter=counter, path=path)
                            attempt_launch(quantize_fold_mxfp4_with_transpose, x, spec, seed=seed,
                                           counter=counter, path=path)
                    if spec.is_2d:   # a grouped GEMM's wgrad operand: factors per segment
                        ends = torch.tensor([0, x.shape[0] // 2 // spec.block[0] * spec.block[0],
                                             x.shape[0]], dtype=torch.int32)
                        attempt_launch(quantize_fold_mxfp4_with_transpose, x, spec, seed=seed,
                                       counter=counter, path="one_chunk", segment_ends=ends)
                        attempt_launch(quantize_fold_mxfp4, x, spec, transpose=True, seed=seed,
                                       counter=counter, path="one_chunk", segment_ends=ends)
                    attempt_launch(fold_pass_one, x, spec, transpose=spec.is_2d)
    attempt_launch(stochastic_uniforms, (64, 256), 3, device="cpu")
    exercise_engine_kernels(attempt_launch)


def exercise_engine_kernels(attempt_launch) -> None:
    """The rollout engine's kernels: its GEMM on dense, FP8 and packed-NVFP4 weights (one row
    and several, each prologue, RAC's second input, the grouped experts, PDL), the decode
    attention (one split and several, PDL) and the activation quantizers."""
    import torch

    from lowbit.formats import QuantSpec, quantize_with_spec
    from lowbit.formats.linear_weight import LinearWeight
    from lowbit.kernels import activation_quant, decode_attention, engine_linear, launch

    supported, launch.pdl_supported = launch.pdl_supported, lambda device: True
    try:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            w = torch.randn(48, 64, dtype=dtype)
            weights = [LinearWeight.dense(w),
                       LinearWeight.from_qtensors([quantize_with_spec(w, QuantSpec.make(
                           "mxfp8_e4m3", (1, 64), "rceil"))], dtype),
                       LinearWeight.from_qtensors([quantize_with_spec(w, QuantSpec.make(
                           "nvfp4", (1, 16)))], dtype)]
            for lw in weights:
                for m in (1, 3, 100):   # the one-row (CUDA-core) tile, tensor-core tiles
                    x = torch.randn(m, 64, dtype=dtype)
                    attempt_launch(engine_linear.linear, x, lw, torch.randn(48, dtype=dtype),
                                   norm=torch.ones(64, dtype=dtype), pdl=True)
                    attempt_launch(engine_linear.linear, x, lw, residual=torch.randn(m, 48, dtype=dtype),
                                   pdl=True)
                    attempt_launch(engine_linear.linear, torch.randn(m, 128, dtype=dtype), lw,
                                   silu_mul=True, residual=torch.randn(m, 48, dtype=dtype))
                    attempt_launch(engine_linear.linear, x, lw, x2=x)
                experts = LinearWeight.stack([lw, lw])
                rows = torch.tensor([0, 1, 1, 0, 1, 1])
                tile_expert, row_ids = engine_linear.moe_align(rows, 2)
                attempt_launch(engine_linear.grouped_linear, torch.randn(3, 64, dtype=dtype), experts,
                               tile_expert, row_ids, 6, 2)
                attempt_launch(engine_linear.grouped_linear, torch.randn(6, 128, dtype=dtype), experts,
                               tile_expert, row_ids, 6, 1, silu_mul=True)
                attempt_launch(engine_linear.grouped_linear, torch.randn(6, 64, dtype=dtype), experts,
                               tile_expert, row_ids, 6, 1, x2=torch.randn(6, 64, dtype=dtype))
            for B, L in ((2, 8), (1, 512)):   # one split, several (and their combine)
                qkv = torch.randn(B, (4 + 2 * 2) * 16, dtype=dtype)
                cache = [torch.zeros(B, 2, L, 16, dtype=dtype) for _ in range(2)]
                rope = [torch.randn(L, 16, dtype=dtype) for _ in range(2)]
                for norm in (None, torch.ones(6, 16, dtype=dtype)):
                    for splits in (1, 4):
                        attempt_launch(decode_attention.decode_attention, qkv, *cache,
                                       torch.tensor([3, 2][:B]), *rope, 4, 2, norm, splits=splits,
                                       pdl=True)
            for silu_mul, norm in ((False, None), (False, torch.ones(64, dtype=dtype)), (True, None)):
                x = torch.randn(3, 128 if silu_mul else 64, dtype=dtype)
                for mode, ratio in (("nvfp4", 0.0), ("nvfp4", 0.25), ("fp8", 0.0)):
                    attempt_launch(activation_quant.quantize_activations, x, mode, ratio, norm=norm,
                                   silu_mul=silu_mul)
                # RAC's radix select without its early stop (tune.py activation's baseline)
                attempt_launch(activation_quant.quantize_activations, x, "nvfp4", 0.25, norm=norm,
                               silu_mul=silu_mul, early_stop=False)
                # RAC's channels chosen within groups of 16 (a sort a group)
                attempt_launch(activation_quant.quantize_activations, x, "nvfp4", 0.25, norm=norm,
                               silu_mul=silu_mul, rac_group=16)
    finally:
        launch.pdl_supported = supported

if __name__ == "__main__":
    sys.exit(main())
