"""Check and time the fused quantize-and-fold kernel (lowbit.kernels.fp8_fold) on a GPU.

    python benchmarks/bench_fp8_fold.py            # checks + timings (well under 3 min, H200)
    python benchmarks/bench_fp8_fold.py --smoke    # tiny shapes on the CPU (Triton interpreter)

1. Checks, bit for bit on the GPU: quantize_fold_mxfp4(x, spec[, transpose]) equals
   fold_operand(quantize_with_spec(x, spec)[, transpose]) -- the CUDA quantizer and the eager
   fold -- and the CPU reference fold of the CPU reference quantizer (RNE), for MXFP4 floor /
   rceil, 1x32, 32x32 and 16x16, bf16 inputs with block exponents over +-6 and +-30 binades,
   and float32 inputs with zero, -0, NaN, Inf, subnormal and huge blocks; stochastic rounding
   against the fold of quantize_triton with the same seed.
2. Timings (triton.testing.do_bench, median ms, L2 flushed), stable-fp4's quantizer (MXFP4
   rceil 32x32) on bf16 A (M, K) and B (N, K), at 4096^3, 8192^3 and the fprop GEMMs of
   lowbit's 1b preset at 8192 tokens. Per shape, for both operands together:
     eager_fold   fold_operand on QTensors quantized before (the bottleneck in
                  docs/results/kernels.md)
     eager        quantize (Triton) + fold_operand
     kernel       quantize_fold_mxfp4 (two Triton passes, one host sync: was one chunk exact?)
     eager_t / kernel_t   the same, each operand also folded transposed (the wgrad / dgrad
                  operands a training step needs from the same FP4 values)
     gemm         fp4_gemm_fp8 on operands folded before; bf16_mm: torch.mm(A, B^T)
     gemm+kernel  fp4_gemm_fp8(quantize_fold_mxfp4(A), quantize_fold_mxfp4(B))
     *_nosync     the same inside deferred_fold_check(): one K-chunk, no host sync (how
                  lowbit.train folds; the checks also test this path)
     *_graph      GPU time alone (CUDA-graph replay) of bf16_mm, gemm and gemm+kernel_nosync:
                  the GEMM with its quantization as a graphed training step runs it
   and kernel GB/s = (2 reads of bf16 + 1 byte written) per element / kernel ms.
3. GPU time alone (CUDA-graph replay) of the sync-free fold at the 1b preset's X, dY and W
   shapes, against a copy and stable-fp4's fake-quantize-with-transpose: pass 1 alone, both
   passes for x's operand (fold) and for x's and x^T's (fold_t), and fold_t - pass1.
4. The fold with the transpose at 8192x5504 for other tile shapes and warp counts
   (`--only-configs` runs this alone).

Prints a table; with $OUT set, writes $OUT/bench_fp8_fold.json. Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout
from common import Report, graph_time_ms, time_ms  # noqa: E402

DEVICE = "cuda"
_D, _F, _KV, _T = 2048, 5504, 1024, 8192                         # 1b preset at 8192 tokens
TIMED = [("4096^3", 4096, 4096, 4096), ("8192^3", 8192, 8192, 8192),
         ("1b q/o fprop", _T, _D, _D), ("1b k/v fprop", _T, _KV, _D),
         ("1b gate/up fprop", _T, _F, _D), ("1b down fprop", _T, _D, _F)]   # (label, M, N, K)
CHECK_SHAPE = (1000, 2080)     # not multiples of 32 rows: odd edges on the GPU too


def spread(rows, cols, binades, seed, tile):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, device=DEVICE)
    br, bc = tile
    e = torch.randint(-binades, binades + 1, (-(-rows // br), -(-cols // bc)), generator=g,
                      device=DEVICE).float()
    mag = torch.exp2(e).repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)
    return (x * mag[:, :cols]).to(torch.bfloat16)


def with_special_blocks(x, block):
    """x with an all-zero block column, a -0 block, NaN and +-Inf blocks, float32-subnormal
    blocks (scale clamped at 2^-127, some rounding to all-zero codes) and huge blocks."""
    br, bc = block
    rows = x.shape[0]                               # >= 40, and >= 4 blocks along K
    x = x.float()
    x[:, 0:bc] = 0.0
    x[0:br, bc:2 * bc] = -0.0
    x[5, 2 * bc + 3] = float("nan")
    x[rows // 2, 3 * bc + 1] = float("inf")
    x[rows // 2 + 1, 3 * bc + 2] = -float("inf")
    x[rows // 4:rows // 4 + br, 2 * bc:3 * bc] *= 2.0**-140
    x[rows - br:, 2 * bc:3 * bc] = 2.0**-149
    x[rows // 2 + 4:rows // 2 + 8, bc:2 * bc] = 3.0e38
    return x                                        # float32: bf16 cannot hold 2^-149


def same(a, b):
    return (torch.equal(a.fp8.view(torch.uint8).cpu(), b.fp8.view(torch.uint8).cpu())
            and torch.equal(a.factors.view(torch.int32).cpu(), b.factors.view(torch.int32).cpu())
            and a.bounds == b.bounds and torch.equal(a.nan_rows.cpu(), b.nan_rows.cpu()))


def run_checks():
    from lowbit.formats import QuantSpec, quantize_with_spec
    from lowbit.kernels import quantize_triton
    from lowbit.kernels.fp8_fold import quantize_fold_mxfp4
    from lowbit.kernels.fp8_gemm import deferred_fold_check, fold_operand

    print("== checks (bit for bit)", flush=True)
    passed, failed = 0, []
    rows, cols = CHECK_SHAPE
    for rounding in ("rne", "stochastic"):
        for rule in ("floor", "rceil"):
            for block in ((1, 32), (32, 32), (16, 16)):
                spec = QuantSpec.make("mxfp4", block, rule, rounding=rounding)
                for binades in (6, 30, "special"):
                    x = (with_special_blocks(spread(rows, cols, 6, seed=5, tile=block), block)
                         if binades == "special" else
                         spread(rows, cols, binades, seed=binades, tile=block))
                    seed = 1234 if rounding == "stochastic" else None
                    for transpose in ((False, True) if spec.is_2d else (False,)):
                        label = f"{rounding} {rule} {block} +-{binades} T={transpose}"
                        got = quantize_fold_mxfp4(x, spec, transpose=transpose, seed=seed)
                        if seed is None:
                            refs = [fold_operand(quantize_with_spec(x, spec), transpose),
                                    fold_operand(quantize_with_spec(x.cpu(), spec), transpose)]
                        else:
                            refs = [fold_operand(quantize_triton(x, spec, seed=seed), transpose)]
                        with deferred_fold_check(x.device) as check:   # one chunk, no sync
                            got_1 = quantize_fold_mxfp4(x, spec, transpose=transpose, seed=seed)
                        # the one-chunk fold is the exact one, or counted as not (+-30 binades)
                        one_ok = (same(got_1, refs[0]) if len(refs[0].bounds) == 2
                                  else check.inexact_values() > 0)
                        if all(same(got, r) for r in refs) and one_ok:
                            passed += 1
                        else:
                            failed.append(label)
                            print(f"  FAIL {label}", flush=True)
    print(f"   {passed} passed, {len(failed)} failed", flush=True)
    return passed, failed


def ms(fn):
    return time_ms(fn, DEVICE)


def deferred(fn):
    from lowbit.kernels.fp8_gemm import deferred_fold_check

    with deferred_fold_check(DEVICE):
        return fn()


def run_timings():
    from lowbit.formats import QuantSpec, quantize_with_spec
    from lowbit.kernels.fp8_fold import quantize_fold_mxfp4, quantize_fold_mxfp4_with_transpose
    from lowbit.kernels.fp8_gemm import fold_operand, fp4_gemm_fp8

    stable = QuantSpec.make("mxfp4", (32, 32), "rceil")
    print("\n== timings (ms, do_bench median; both operands unless noted)", flush=True)
    results = []
    for label, m, n, k in TIMED:
        a = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02
        qa, qb = quantize_with_spec(a, stable), quantize_with_spec(b, stable)
        fa, fb = fold_operand(qa), fold_operand(qb)

        def eager(t, transpose=False):
            q = quantize_with_spec(t, stable)
            return (fold_operand(q), fold_operand(q, True)) if transpose else fold_operand(q)

        calls = {
            "bf16_mm": lambda: torch.mm(a, b.t()),
            "gemm": lambda: fp4_gemm_fp8(fa, fb),
            "eager_fold": lambda: (fold_operand(qa), fold_operand(qb)),
            "eager": lambda: (eager(a), eager(b)),
            "kernel": lambda: (quantize_fold_mxfp4(a, stable), quantize_fold_mxfp4(b, stable)),
            "eager_t": lambda: (eager(a, True), eager(b, True)),
            "kernel_t": lambda: (quantize_fold_mxfp4_with_transpose(a, stable),
                                 quantize_fold_mxfp4_with_transpose(b, stable)),
            "gemm+kernel": lambda: fp4_gemm_fp8(quantize_fold_mxfp4(a, stable),
                                                quantize_fold_mxfp4(b, stable)),
        }
        # the same calls without host syncs, as lowbit.train runs them
        for name in ("kernel", "kernel_t", "gemm+kernel"):
            calls[name + "_nosync"] = functools.partial(deferred, calls[name])
        row = {"shape": label, "M": m, "N": n, "K": k, "chunks": (len(fa.bounds) - 1,
                                                                  len(fb.bounds) - 1)}
        for name, fn in calls.items():
            try:
                row[f"{name}_ms"] = ms(fn)
            except Exception as e:  # noqa: BLE001 -- report, keep measuring
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
                print(f"   {label} {name}: {row[name + '_error']}", flush=True)
        for name in ("bf16_mm", "gemm", "gemm+kernel_nosync"):
            row[f"{name}_graph_ms"] = graph_time_ms(calls[name], DEVICE)
        if "kernel_ms" in row:
            row["kernel_GBps"] = 5 * (m + n) * k / row["kernel_ms"] / 1e6
        results.append(row)
        print("   " + label + ": " + ", ".join(f"{k_} {v:.3f}" for k_, v in row.items()
                                                 if k_.endswith("_ms") and v is not None),
              flush=True)
        del a, b, qa, qb, fa, fb
    return results


PASS_SHAPES = [(8192, 2048), (8192, 5504), (5504, 2048)]   # X / dY / W of the 1b preset


def run_pass_timings():
    """GPU time alone (CUDA-graph replay) of each part of the sync-free fold, against a copy
    of x and stable-fp4's fused fake-quantize-with-transpose at the same shape (x bf16)."""
    import lowbit.kernels.fp8_fold as ff
    import lowbit.kernels.fp8_gemm as fp8_gemm
    from lowbit.formats import QuantSpec
    from lowbit.kernels import fake_quantize_triton_with_transpose
    from lowbit.kernels.fp8_gemm import deferred_fold_check

    stable = QuantSpec.make("mxfp4", (32, 32), "rceil")
    print("\n== GPU time of the fold's passes (ms, CUDA-graph replay), x bf16", flush=True)

    def fold(x, rows_out=True, transpose=True):
        with deferred_fold_check(x.device) as check:
            return ff._fold_one_chunk(ff._Launch(x, stable, None, None, transpose), rows_out,
                                      transpose, check.counter)

    def pass1(x):
        launch = ff._Launch(x, stable, None, None, True)
        n_bands, n_bands_t = launch.n_scale_rows, launch.n_scale_cols
        stats = torch.full((2 * (n_bands + n_bands_t),), fp8_gemm._NONE_HI, dtype=torch.int32,
                           device=x.device)
        scales = torch.empty(n_bands, n_bands_t, dtype=torch.uint8, device=x.device)
        p1 = launch.pass1
        ff._band_max_kernel[p1.grid](x, scales, stats, stats[2 * n_bands:], *x.shape,
                                     *x.stride(), n_bands, n_bands_t, ROWS=True, TRANSPOSE=True,
                                     EVEN=p1.even, **p1.kw, **launch.common)

    rows = []
    for m, k in PASS_SHAPES if DEVICE == "cuda" else [(40, 96)]:
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        calls = {"copy": lambda: x.clone(),
                 "fakequant_t": lambda: fake_quantize_triton_with_transpose(x, stable),
                 "pass1": lambda: pass1(x),
                 "fold": lambda: fold(x, transpose=False),
                 "fold_t": lambda: fold(x)}
        row = {"shape": f"{m}x{k}"}
        for name, fn in calls.items():
            fn()
            row[name] = graph_time_ms(fn, DEVICE)
        if row["fold_t"] is not None:   # None on the CPU: no graph timing there
            row["pass2_t"] = row["fold_t"] - row["pass1"]
        rows.append(row)
        print("   " + ", ".join(f"{key} {v:.3f}" if isinstance(v, float) else f"{key} {v}"
                                for key, v in row.items()), flush=True)
    return rows


SWEEP = [(32, 128, 4), (32, 128, 8), (64, 128, 8), (32, 256, 8), (64, 64, 4), (64, 256, 16)]


def run_config_sweep():
    """GPU time (CUDA-graph replay) of the sync-free fold with the transpose at 8192x5504 bf16
    for other tile shapes and warp counts than kq.default_config's (tile rows, tile columns,
    warps); the default's row is the first."""
    import lowbit.kernels.fp8_fold as ff
    from lowbit.formats import QuantSpec
    from lowbit.kernels.fp8_gemm import deferred_fold_check
    from lowbit.kernels.quantize import TileConfig

    stable = QuantSpec.make("mxfp4", (32, 32), "rceil")
    shape = (8192, 5504) if DEVICE == "cuda" else (64, 256)
    print(f"\n== tile configs, fold with transpose, {shape[0]}x{shape[1]} bf16 (ms)", flush=True)
    x = torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16)
    default = ff.kq.default_config
    rows = []
    try:
        for tile_r, tile_c, warps in SWEEP:
            ff.kq.default_config = lambda r, c, b: TileConfig(tile_r, tile_c, warps)

            def fold():
                with deferred_fold_check(x.device) as check:
                    return ff._fold_one_chunk(ff._Launch(x, stable, None, None, True), True,
                                              True, check.counter)
            fold()
            ms = graph_time_ms(fold, DEVICE)
            rows.append({"tile": f"{tile_r}x{tile_c}", "warps": warps, "ms": ms})
            print(f"   {tile_r}x{tile_c} warps {warps}: {ms}", flush=True)
    finally:
        ff.kq.default_config = default
    return rows


def print_timings(results):
    cols = ["bf16_mm", "gemm", "eager_fold", "eager", "kernel", "kernel_nosync", "eager_t",
            "kernel_t", "kernel_t_nosync", "gemm+kernel", "gemm+kernel_nosync"]
    print("\nms (median); kernel GB/s; eager/kernel = speedup of the fused fold")
    print(f"{'shape':18s} " + " ".join(f"{c:>11s}" for c in cols)
          + f" {'GB/s':>7s} {'eager/kern':>10s} {'eager_t/k_t':>11s}")
    for r in results:
        cells = [f"{r[c + '_ms']:11.3f}" if c + "_ms" in r else f"{'-':>11s}" for c in cols]

        def ratio(x, y):
            return (f"{r[x + '_ms'] / r[y + '_ms']:.2f}x" if x + "_ms" in r and y + "_ms" in r
                    else "-")
        gbps = f"{r['kernel_GBps']:7.0f}" if "kernel_GBps" in r else f"{'-':>7s}"
        print(f"{r['shape']:18s} " + " ".join(cells) + f" {gbps} {ratio('eager', 'kernel'):>10s}"
              f" {ratio('eager_t', 'kernel_t'):>11s}")
    graphed = [r for r in results if r.get("bf16_mm_graph_ms")]
    if graphed:
        print("\nGPU time alone (ms, CUDA-graph replay); speedup = bf16_mm / that")
        print(f"{'shape':18s} {'bf16_mm':>9s} {'gemm':>9s} {'speedup':>8s} "
              f"{'gemm+fold':>10s} {'speedup':>8s}")
        for r in graphed:
            mm, g, q = (r.get(f"{c}_graph_ms") for c in ("bf16_mm", "gemm", "gemm+kernel_nosync"))
            cells = [f"{'-':>9s}" if v is None else f"{v:9.3f}" for v in (g, q)]
            print(f"{r['shape']:18s} {mm:9.3f} {cells[0]} "
                  f"{'-' if g is None else f'{mm / g:.2f}x':>8s} {cells[1]:>10s} "
                  f"{'-' if q is None else f'{mm / q:.2f}x':>8s}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-checks", action="store_true")
    parser.add_argument("--no-timings", action="store_true",
                        help="skip the per-shape eager timings (section 2)")
    parser.add_argument("--only-configs", action="store_true",
                        help="only the tile-config sweep (section 4)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1: tests the script")
    args = parser.parse_args()
    global DEVICE, TIMED, CHECK_SHAPE
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"    # before triton is first imported
        DEVICE = "cpu"
        TIMED = [("smoke", 40, 72, 96)]
        CHECK_SHAPE = (40, 130)
    elif not torch.cuda.is_available():
        sys.exit("bench_fp8_fold needs a CUDA GPU (or --smoke)")
    t0 = time.time()
    report = Report("bench_fp8_fold", DEVICE)
    save = report.save

    failed = []
    if args.only_configs:
        report["configs"] = run_config_sweep()
        save()
        return
    if not args.no_checks:
        passed, failed = run_checks()
        report["checks"] = {"passed": passed, "failed": failed}
        save()
    report["passes"] = run_pass_timings()
    save()
    report["configs"] = run_config_sweep()
    save()
    if not args.no_timings:
        report["timings"] = run_timings()
        save()
        print_timings(report["timings"])
    print(f"\ntotal {time.time() - t0:.0f}s")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
