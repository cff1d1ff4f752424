"""Check, measure and time the exact MXFP4 GEMM on FP8 tensor cores (lowbit.kernels.fp8_gemm).

    python benchmarks/bench_fp8_gemm.py                 # checks, errors, timings (~2 min, H200)
    python benchmarks/bench_fp8_gemm.py --no-timings
    python benchmarks/bench_fp8_gemm.py --smoke         # tiny shapes on the CPU: tests the script

1. Checks, bit for bit: MXFP4 (floor / rceil; 1x32, 32x32, 16x16) quantized on the GPU, with
   block exponents spread over +-6 and +-30 binades, and QTensors with random codes and
   exponents over all of E8M0 (NaN blocks included): fold_operand on CUDA gives the same FP8
   bits, factors and K-chunks as on the CPU, and its fp8 * factor equals dequantize() (and
   its transpose for 2D tiles); NaN rows / columns of the GEMM are where fp64's are.
2. Error of C = A B^T against an fp64 GEMM of the dequantized operands, for a linear layer's
   fprop, dgrad and wgrad (stable-fp4's rceil 32x32 tiles and naive mxfp4's floor 1x32),
   random (+-6 binades) and adversarial (+-30 binades, 10% all-zero blocks: K-chunked)
   scales: the FP8 path with float32 and bf16 output, with and without fast accumulation,
   beside torch.mm of the same dequantized values in bf16 (bf16 output) and float32 (TF32 off).
   Metrics: ||C - C64||_F / ||C64||_F and max|C - C64| / max|C64|.
3. Timings (triton.testing.do_bench, median, L2 flushed): bf16 torch.mm (x @ w.T) against
   the FP8 path with pre-folded operands (bare torch._scaled_mm, fp4_gemm_fp8, and with fast
   accumulation), folding only, the FP8 path with quantization (Triton, bf16 -> MXFP4 rceil
   32x32) and folding included, and today's emulated path (fused fake quantization of both
   operands + bf16 torch.mm), at 4096^3, 8192^3, M,N,K = 16384,2048,8192 and the GEMMs of
   lowbit's 1b preset (dim 2048, ffn 5504, 8 KV heads of 128) at 8192 tokens.

Prints aligned tables; with $OUT set, writes $OUT/bench_fp8_gemm.json (after every section).
Exit status 1 if a check failed. Needs a CUDA GPU with FP8 (SM 8.9+) and triton.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout
from common import Checks, Report, time_ms  # noqa: E402

from lowbit.formats import QTensor, QuantSpec, quantize_dequantize, quantize_with_spec  # noqa: E402
from lowbit.formats.elements import pack_codes  # noqa: E402
from lowbit.kernels import fp8_gemm  # noqa: E402
from lowbit.kernels.fp8_gemm import fold_operand, fold_report, fp4_gemm_fp8  # noqa: E402

DEVICE = "cuda"
STABLE = QuantSpec.make("mxfp4", (32, 32), "rceil")        # stable-fp4's W / X / dY quantizer
NAIVE = QuantSpec.make("mxfp4", (1, 32), "floor")          # the mxfp4 recipe's
CHECK_SPECS = [QuantSpec.make("mxfp4", block, rule) for rule in ("floor", "rceil")
               for block in ((1, 32), (32, 32), (16, 16))]
SIZES = {"check": (1024, 2048), "layer": (4096, 2048, 5504)}   # layer: tokens, in, out
_D, _F, _KV, _T = 2048, 5504, 1024, 8192                         # 1b preset at 8192 tokens
TIMED = [("4096^3", 4096, 4096, 4096), ("8192^3", 8192, 8192, 8192),
         ("16384x2048x8192", 16384, 2048, 8192),
         ("1b q/o fprop", _T, _D, _D), ("1b k/v fprop", _T, _KV, _D),
         ("1b gate/up fprop", _T, _F, _D), ("1b down fprop", _T, _D, _F),
         ("1b gate/up dgrad", _T, _D, _F), ("1b gate/up wgrad", _F, _D, _T)]   # (label, M, N, K)


def spread(rows, cols, binades, seed, tile=(1, 32), zero_frac=0.0):
    """Gaussian values times 2^U{-binades..binades} per tile; a fraction of tiles all zero."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, device=DEVICE)
    br, bc = tile
    shape = (-(-rows // br), -(-cols // bc))
    e = torch.randint(-binades, binades + 1, shape, generator=g, device=DEVICE).float()
    mag = torch.exp2(e) * (torch.rand(shape, generator=g, device=DEVICE) >= zero_frac)
    mag = mag.repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]
    return x * mag


def wild_qtensor(rows, cols, seed, low=-127, high=124):
    """Random codes, block exponents uniform over low..high (124: no float32 overflow), 5% NaN."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    exps = torch.randint(low, high + 1, (rows, cols // 32), generator=g)
    exps[torch.rand(exps.shape, generator=g) < 0.05] = 128
    spec = QuantSpec.make("mxfp4", (1, 32), "rceil")
    return QTensor(pack_codes(codes, 4), (exps + 127).to(torch.uint8), None, spec, (rows, cols),
                   torch.float32)


def bits_equal(a, b):
    nan = torch.isnan(b)
    return (torch.equal(torch.isnan(a), nan)
            and torch.equal(a.view(torch.int32)[~nan], b.view(torch.int32)[~nan]))


# ---- 1. checks -----------------------------------------------------------------------------

def check_fold(q, transpose=False):
    gpu = fold_operand(q, transpose=transpose)
    cpu = fold_operand(q.to("cpu"), transpose=transpose)
    assert gpu.bounds == cpu.bounds, (gpu.bounds, cpu.bounds)
    assert torch.equal(gpu.fp8.view(torch.uint8).cpu(), cpu.fp8.view(torch.uint8)), "fp8 bits"
    assert torch.equal(gpu.factors.cpu(), cpu.factors), "factors"
    deq = q.dequantize(torch.float32)
    assert bits_equal(gpu.unfold(), deq.T if transpose else deq), "fp8 * factor != dequantize"


def check_nan_gemm(a, b):
    out = fp4_gemm_fp8(a, b, out_dtype=torch.float32)
    ref = a.dequantize(torch.float32).double() @ b.dequantize(torch.float32).double().T
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), "NaN pattern differs from fp64's"


def run_checks() -> Checks:
    c = Checks()
    t0 = time.time()
    print("== checks: folding on the GPU, bitwise", flush=True)
    rows, cols = SIZES["check"]
    for spec in CHECK_SPECS:
        for binades in (6, 30):
            name = f"mxfp4 {spec.scale_rule.value} {spec.block[0]}x{spec.block[1]} +-{binades}"
            x = spread(rows, cols, binades, seed=binades, tile=spec.block).bfloat16()
            q = quantize_with_spec(x, spec)            # the Triton kernel on CUDA
            c.run(f"{name} fold", check_fold, q)
            if spec.is_2d:
                c.run(f"{name} fold transposed", check_fold, q, True)
    wild = wild_qtensor(256, 1024, seed=1).to(DEVICE)
    c.run("random codes, exponents over all of E8M0, NaN blocks: fold", check_fold, wild)
    # exponents within +-40: no product or float32 partial sum overflows, so every NaN of the
    # output comes from a NaN block (Inf - Inf would add NaNs of its own)
    a = wild_qtensor(256, 1024, 3, -40, 40).to(DEVICE)
    b = wild_qtensor(64, 1024, 2, -40, 40).to(DEVICE)
    c.run("NaN rows and columns of the GEMM (K-chunked)", check_nan_gemm, a, b)
    print(f"   {c.passed} passed, {len(c.failed)} failed ({time.time() - t0:.0f}s)", flush=True)
    return c


# ---- 2. error against fp64 -----------------------------------------------------------------

def layer_operands(spec, binades, zero_frac, seed=0):
    """(name, a, b) with C = a @ b^T for fprop X.W^T, dgrad dY.W, wgrad dY^T.X."""
    tokens, d_in, d_out = SIZES["layer"]
    x = spread(tokens, d_in, binades, seed, spec.block, zero_frac).bfloat16()
    w = spread(d_out, d_in, binades, seed + 1, spec.block, zero_frac).bfloat16()
    dy = spread(tokens, d_out, binades, seed + 2, spec.block, zero_frac).bfloat16()

    def q(t):
        return quantize_with_spec(t.contiguous(), spec)

    if spec.is_2d:
        qx, qw, qdy = q(x), q(w), q(dy)
        return [("fprop", qx, qw), ("dgrad", qdy, qw.t()), ("wgrad", qdy.t(), qx.t())]
    return [("fprop", q(x), q(w)), ("dgrad", q(dy), q(w.T)), ("wgrad", q(dy.T), q(x.T))]


def errors(out, ref):
    diff = out.double() - ref
    return {"rel_fro": (diff.norm() / ref.norm()).item(),
            "rel_max": (diff.abs().max() / ref.abs().max()).item()}


def run_errors():
    print("\n== error against an fp64 GEMM of the dequantized operands", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for spec in (STABLE, NAIVE):
        for scales, binades, zero_frac in (("random", 6, 0.0), ("adversarial", 30, 0.1)):
            for gemm, a, b in layer_operands(spec, binades, zero_frac):
                a32, b32 = a.dequantize(torch.float32), b.dequantize(torch.float32)
                ref = a32.double() @ b32.double().T
                fa, fb = fold_operand(a), fold_operand(b)
                row = {"spec": f"{spec.scale_rule.value} {spec.block[0]}x{spec.block[1]}",
                       "scales": scales, "gemm": gemm,
                       "shape": [a.shape[0], b.shape[0], a.shape[1]],
                       "chunks_a": len(fa.bounds) - 1, "chunks_b": len(fb.bounds) - 1,
                       "pieces": len(fp8_gemm._pieces(fa, fb)),
                       "rows_over_window": fold_report(a).rows_over_window}
                for fast in (False, True):
                    tag = "fast" if fast else "acc"
                    row[f"fp8_{tag}_f32"] = errors(fp4_gemm_fp8(fa, fb, torch.float32, fast), ref)
                    row[f"fp8_{tag}_bf16"] = errors(fp4_gemm_fp8(fa, fb, torch.bfloat16, fast), ref)
                row["mm_bf16"] = errors(a32.bfloat16() @ b32.bfloat16().T, ref)
                row["mm_f32"] = errors(a32 @ b32.T, ref)
                row["ref_in_bf16"] = errors(ref.bfloat16(), ref)      # output rounding alone
                rows.append(row)
                print(f"   {row['spec']} {scales:11s} {gemm}: chunks {row['chunks_a']}/"
                      f"{row['chunks_b']}, fp8 f32 {row['fp8_acc_f32']['rel_fro']:.2e} "
                      f"(fast {row['fp8_fast_f32']['rel_fro']:.2e}), bf16 mm "
                      f"{row['mm_bf16']['rel_fro']:.2e}", flush=True)
    return rows


def print_errors(rows):
    cols = [("fp8_acc_f32", "fp8 f32"), ("fp8_fast_f32", "fp8 f32 fast"),
            ("fp8_acc_bf16", "fp8 bf16"), ("fp8_fast_bf16", "fp8 bf16 fast"),
            ("mm_bf16", "bf16 mm"), ("mm_f32", "fp32 mm"), ("ref_in_bf16", "fp64->bf16")]
    print("\nrelative error ||C - C64||_F / ||C64||_F  [max|C - C64| / max|C64|]")
    head = f"{'spec':11s} {'scales':11s} {'gemm':5s} {'chunks':>6s} " + " ".join(
        f"{h:>19s}" for _, h in cols)
    print(head)
    for r in rows:
        cells = " ".join(f"{r[k]['rel_fro']:8.2e} [{r[k]['rel_max']:8.2e}]" for k, _ in cols)
        print(f"{r['spec']:11s} {r['scales']:11s} {r['gemm']:5s} {r['pieces']:6d} {cells}")


# ---- 3. timings ----------------------------------------------------------------------------

def ms(fn):
    return time_ms(fn, DEVICE)


def run_timings():
    print("\n== timings (do_bench median, L2 flushed; bf16 output everywhere)", flush=True)
    results = []
    for label, m, n, k in TIMED:
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02
        qx, qw = quantize_with_spec(x, STABLE), quantize_with_spec(w, STABLE)
        fx, fw = fold_operand(qx), fold_operand(qw)
        one = len(fp8_gemm._pieces(fx, fw)) == 1
        sx, sw = fx.factors[:, :1].contiguous(), fw.factors[:, 0][None, :].contiguous()
        calls = {
            "bf16_mm": lambda: torch.mm(x, w.t()),
            "scaled_mm": lambda: torch._scaled_mm(fx.fp8, fw.fp8.t(), scale_a=sx, scale_b=sw,
                                                  out_dtype=torch.bfloat16),
            "fp8": lambda: fp4_gemm_fp8(fx, fw),
            "fp8_fast": lambda: fp4_gemm_fp8(fx, fw, use_fast_accum=True),
            "fold": lambda: (fold_operand(qx), fold_operand(qw)),
            "fp8_incl_quant": lambda: fp4_gemm_fp8(quantize_with_spec(x, STABLE),
                                                   quantize_with_spec(w, STABLE)),
            "emulated": lambda: torch.mm(quantize_dequantize(x, STABLE),
                                         quantize_dequantize(w, STABLE).t()),
        }
        row = {"shape": label, "M": m, "N": n, "K": k, "one_chunk": one}
        for name, fn in calls.items():
            if name == "scaled_mm" and (DEVICE != "cuda" or not one):
                continue
            try:
                row[f"{name}_ms"] = ms(fn)
            except Exception as e:  # noqa: BLE001
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
        flops = 2 * m * n * k
        for name in calls:
            if f"{name}_ms" in row and name != "fold":
                row[f"{name}_tflops"] = flops / row[f"{name}_ms"] / 1e9
        results.append(row)
        print("   " + label + ": " + ", ".join(f"{k_} {v:.3f}" for k_, v in row.items()
                                                 if k_.endswith("_ms")), flush=True)
        for name in [n_ for n_ in calls if f"{n_}_error" in row]:
            print(f"   {label} {name}: {row[name + '_error']}", flush=True)
        del x, w, qx, qw, fx, fw
    return results


def print_timings(results):
    cols = [("bf16_mm", "bf16 mm"), ("scaled_mm", "_scaled_mm"), ("fp8", "fp8"),
            ("fp8_fast", "fp8 fast"), ("fp8_incl_quant", "fp8+q+fold"), ("emulated", "emulated")]
    print("\nTFLOP/s (ratio to bf16 torch.mm); fold = ms to fold both operands")
    print(f"{'shape':18s} {'M':>6s} {'N':>6s} {'K':>6s} " + " ".join(f"{h:>16s}" for _, h in cols)
          + f" {'fold ms':>8s}")
    for r in results:
        base = r.get("bf16_mm_tflops")
        cells = []
        for key, _ in cols:
            t = r.get(f"{key}_tflops")
            if t is None:
                cells.append(f"{'-':>16s}")
            elif key == "bf16_mm" or not base:
                cells.append(f"{t:16.0f}")
            else:
                cells.append(f"{t:9.0f} ({t / base:4.2f})")
        fold_ms = r.get("fold_ms")
        print(f"{r['shape']:18s} {r['M']:6d} {r['N']:6d} {r['K']:6d} " + " ".join(cells)
              + (f" {fold_ms:8.3f}" if fold_ms is not None else f" {'-':>8s}"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-checks", action="store_true")
    parser.add_argument("--no-errors", action="store_true")
    parser.add_argument("--no-timings", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU: tests this script, measures nothing")
    args = parser.parse_args()
    global DEVICE, TIMED
    if args.smoke:
        DEVICE = "cpu"
        SIZES.update(check=(64, 256), layer=(64, 128, 96))
        TIMED = [("smoke", 64, 96, 128)]
    elif not torch.cuda.is_available():
        sys.exit("bench_fp8_gemm needs a CUDA GPU (or --smoke)")
    t0 = time.time()
    report = Report("bench_fp8_gemm", DEVICE, cuda=torch.version.cuda)

    checks = None
    if not args.no_checks:
        checks = run_checks()
        report["checks"] = {"passed": checks.passed, "failed": checks.failed}
        report.save()
    if not args.no_errors:
        report.section("errors", run_errors, print_errors)
    if not args.no_timings:
        report.section("timings", run_timings, print_timings)
    report["meta"]["rowwise_out_dtype_direct"] = {f"{k[0]} {k[1]}": v for k, v in
                                                  fp8_gemm._ROWWISE_DTYPE_OK.items()}
    report.finish(checks, t0)


if __name__ == "__main__":
    main()
