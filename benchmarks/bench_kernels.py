"""Check the Triton quantize kernels bit for bit on a GPU, then time them.

    python benchmarks/bench_kernels.py               # checks, then timings (bf16 inputs)
    python benchmarks/bench_kernels.py --checks-only
    python benchmarks/bench_kernels.py --no-torchao --no-sweep
    TRITON_INTERPRET=1 python benchmarks/bench_kernels.py --smoke   # the script itself, on a CPU

1. Checks: every kernel (MXFP4/MXFP8 floor/rceil 1D/2D, NVFP4 1D/2D single/two-level; RNE
   and stochastic; quantize, fake quantize and the transposed outputs) against the reference
   quantizer -- codes, scales, tensor scale and dequantized values, bitwise -- on random
   inputs spread over many binades (1M values, CPU reference; 16M, CUDA reference after
   checking that the CUDA reference equals the CPU one), the adversarial inputs of
   lowbit.kernels.checks, odd and 3D shapes, fp32/bf16/fp16; stochastic rounding against
   the reference fed the seed contract's uniforms (NumPy Philox).
2. Timings: triton.testing.do_bench (median; L2 flushed before every call) of each kernel on
   bf16 inputs, GB/s = (bytes read + bytes written) / time, counting x once (two-level NVFP4
   reads x twice: its tensor amax pass, then the quantize pass), the ratio to a
   device-to-device copy of the same tensor timed in the same run, and torchao's
   nvfp4_quantize / to_mx eager and torch.compile'd when torchao imports. The "graph"
   columns time the same call replayed from a CUDA graph (do_bench_cudagraph, no L2 flush):
   the GPU's time alone, so the gap to the first timing is host (Python + launch) overhead.
3. A tile-config sweep on one shape, to choose the default.

Prints aligned tables; with $OUT set, writes $OUT/bench_kernels.json. Exit status 1 if a
check failed. Needs a CUDA GPU and triton (written against triton 3.6).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout

import triton  # noqa: E402
from common import Report, graph_time_ms, time_ms  # noqa: E402

from lowbit.formats import QuantSpec, quantize_with_spec  # noqa: E402
from lowbit.formats.quantize import blocked  # noqa: E402
from lowbit.kernels import (  # noqa: E402
    _run, fake_quantize_triton, fake_quantize_triton_with_transpose, force_reference,
    quantize_triton, quantize_triton_with_transpose, stochastic_uniforms,
)
from lowbit.kernels.checks import (  # noqa: E402
    adversarial, assert_bits_equal, assert_same_qtensor, contract_uniforms, nvfp4_order_cases,
)
from lowbit.kernels.quantize import TileConfig, default_config  # noqa: E402

MX = [QuantSpec.make(fmt, block, rule) for fmt in ("mxfp4", "mxfp8_e4m3", "mxfp8_e5m2")
      for rule in ("floor", "rceil") for block in ((1, 32), (16, 16), (32, 32))]
NV = [QuantSpec.make("nvfp4", block, tensor_scale=two) for two in (True, False)
      for block in ((1, 16), (16, 16))]
SPECS = MX + NV
SHAPES = [(4096, 4096), (8192, 8192), (16384, 8192),
          (2048, 2048), (5632, 2048), (2048, 5632), (16384, 2048)]   # + a 1B model's GEMMs
CHECK_SIZES = {"random": (1024, 1024), "big": (4096, 4096), "adversarial": (512, 1024),
               "odd": (3, 77, 45), "stochastic": (256, 1000), "sweep": (8192, 8192)}
DEVICE = "cuda"


def find(fmt, rule, block, two_level=None):
    return QuantSpec.make(fmt, block, rule, tensor_scale=two_level)


def sr(spec):
    return QuantSpec.make(spec.format, spec.block, spec.scale_rule, "stochastic", spec.tensor_scale)


def name_of(spec, kind="q"):
    rule = spec.scale_rule.value if spec.scale_rule else ("2lvl" if spec.tensor_scale else "1lvl")
    return f"{kind} {spec.format} {rule} {spec.block[0]}x{spec.block[1]} {spec.rounding.value}"


def spread(shape, seed, device=None):
    """Values over many binades, block by block, with rare outliers (like real activations)."""
    device = device or DEVICE
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, generator=g, device=device)
    mag = torch.exp2(torch.randint(-30, 30, (*shape[:-1], -(-shape[-1] // 16), 1), generator=g,
                                   device=device).float())
    mag = mag.expand(*shape[:-1], -1, 16).reshape(*shape[:-1], -1)[..., : shape[-1]]
    outliers = (torch.rand(shape, generator=g, device=device) < 1e-3) * 50
    return x * mag * (1 + outliers)


def reference(x, spec):
    with force_reference():
        return quantize_with_spec(x, spec)


# ---- 1. checks -----------------------------------------------------------------------------

class Checks:
    def __init__(self):
        self.passed, self.failed = 0, []

    def run(self, label, fn, *args):
        try:
            fn(*args)
            self.passed += 1
        except Exception as e:  # noqa: BLE001 -- every failure is reported, none stops the run
            self.failed.append((label, f"{type(e).__name__}: {e}"[:300]))
            print(f"  FAIL {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)


def check_against_cpu(x, spec, seed=None):
    r = reference(x.cpu(), spec)
    assert_same_qtensor(quantize_triton(x, spec, seed), r)
    assert_bits_equal(fake_quantize_triton(x, spec, seed), r.dequantize())


def check_against_cuda(x, spec):
    r = reference(x, spec)
    assert_same_qtensor(quantize_triton(x, spec), r)
    assert_bits_equal(fake_quantize_triton(x, spec), r.dequantize())


def check_cuda_reference(x, spec):
    assert_same_qtensor(reference(x, spec), reference(x.cpu(), spec))


def check_transpose(x, spec, seed):
    q, q_t = quantize_triton_with_transpose(x, spec, seed)
    ref_t = q.t()
    assert torch.equal(q_t.codes, ref_t.codes)
    assert torch.equal(q_t.scales.view(torch.uint8), ref_t.scales.view(torch.uint8))
    v, v_t = fake_quantize_triton_with_transpose(x, spec, seed)
    assert_bits_equal(v, q.dequantize())
    assert_bits_equal(v_t, v.mT.contiguous())


def check_stochastic(x, spec, seed):
    """Kernel SR == the reference drawing the seed contract's uniforms."""
    u = contract_uniforms(tuple(x.shape), seed)
    noise = blocked(u, spec.block)[0]
    real_rand = torch.rand
    torch.rand = lambda *a, **k: noise          # the reference's one draw
    try:
        r = reference(x.cpu(), spec)
    finally:
        torch.rand = real_rand
    assert_same_qtensor(quantize_triton(x, spec, seed), r)
    assert_bits_equal(fake_quantize_triton(x, spec, seed), r.dequantize())


def check_uniforms(shape, seed):
    assert torch.equal(stochastic_uniforms(shape, seed, DEVICE).cpu(), contract_uniforms(shape, seed))


def run_checks() -> Checks:
    c = Checks()
    t0 = time.time()
    print("== checks: kernels vs the reference, bitwise", flush=True)
    for spec in SPECS:
        name = name_of(spec)
        x = spread(CHECK_SIZES["random"], seed=1)
        c.run(f"{name} random bf16", check_against_cpu, x.bfloat16(), spec)
        c.run(f"{name} random fp32", check_against_cpu, x[:256], spec)
        c.run(f"{name} random fp16", check_against_cpu, (x[:256] / x.abs().max() * 6e4).half(), spec)
        c.run(f"{name} cuda ref == cpu ref", check_cuda_reference, x.bfloat16(), spec)
        big = spread(CHECK_SIZES["big"], seed=2).bfloat16()
        c.run(f"{name} random bf16 {tuple(big.shape)} (cuda ref)", check_against_cuda, big, spec)
        adv = adversarial(*CHECK_SIZES["adversarial"], spec, seed=3).to(DEVICE)
        c.run(f"{name} adversarial fp32", check_against_cpu, adv, spec)
        c.run(f"{name} adversarial bf16", check_against_cpu, adv.bfloat16(), spec)
        odd = spread(CHECK_SIZES["odd"], seed=4)
        c.run(f"{name} 3D odd shape", check_against_cpu, odd, spec)
        c.run(f"{name} non-contiguous", check_against_cpu, x[:200, :300].t(), spec)
        if spec.block[0] == 1:
            c.run(f"{name} 1-D", check_against_cpu, x[0, :1000], spec)
        else:
            c.run(f"{name} transposed outputs", check_transpose, odd.bfloat16(), spec, 7)
            c.run(f"{name} transposed outputs SR", check_transpose, odd.bfloat16(), sr(spec), 7)
        c.run(f"{name_of(sr(spec))} == reference with contract uniforms", check_stochastic,
              spread(CHECK_SIZES["stochastic"], seed=5).bfloat16(), sr(spec), 2**40 + 7)
    order, _ = nvfp4_order_cases(seed=0)
    c.run("nvfp4 operation-order cases", check_against_cpu, order.to(DEVICE), NV[0])
    for shape in [(1000, 1000), (7, 333)]:
        c.run(f"uniforms {shape} == NumPy Philox", check_uniforms, shape, 2**62 + 3)
    print(f"   {c.passed} passed, {len(c.failed)} failed ({time.time() - t0:.0f}s)", flush=True)
    return c


# ---- 2. timings ----------------------------------------------------------------------------

def ms(fn):
    return time_ms(fn, DEVICE)


def qbytes(spec, shape, in_bytes=2):
    """Bytes read + written by one quantize call: x once, packed codes, scales, tensor scale."""
    rows, cols = shape
    br, bc = spec.block
    per_byte = 8 // spec.info.element.code_bits
    codes = rows * (-(-cols // bc) * bc) // per_byte
    scale_rows = rows if br == 1 else -(-rows // br)
    scales = scale_rows * -(-cols // bc)
    return rows * cols * in_bytes + codes + scales + (4 if spec.tensor_scale else 0)


def timed_kernels():
    """(label, spec, kind) for the table: the recipes' quantizers first."""
    rows = []
    stable = find("mxfp4", "rceil", (32, 32))                 # stable-fp4's quantizer
    nvfp4 = find("nvfp4", None, (1, 16), True)                 # the nvfp4 recipe's
    for spec in [stable, sr(stable), find("mxfp4", "rceil", (16, 16)), find("mxfp4", "rceil", (1, 32)),
                 find("mxfp4", "floor", (1, 32)), find("mxfp8_e4m3", "rceil", (1, 32)),
                 find("mxfp8_e5m2", "rceil", (1, 32)), nvfp4, find("nvfp4", None, (1, 16), False),
                 find("nvfp4", None, (16, 16), True), sr(nvfp4)]:
        rows.append((name_of(spec), spec, "q"))
    for spec in [stable, sr(stable), nvfp4, find("nvfp4", None, (16, 16), True)]:
        rows.append((name_of(spec, "fq"), spec, "fq"))
    rows.append((name_of(stable, "q+t"), stable, "q+t"))
    rows.append((name_of(stable, "fq+t"), stable, "fq+t"))
    return rows


def kernel_call(spec, kind, x, seed):
    s = seed if spec.rounding.value == "stochastic" else None
    if kind == "q":
        return lambda: quantize_triton(x, spec, s)
    if kind == "fq":
        return lambda: fake_quantize_triton(x, spec, s)
    if kind == "q+t":
        return lambda: quantize_triton_with_transpose(x, spec, s)
    return lambda: fake_quantize_triton_with_transpose(x, spec, s)


def moved_bytes(spec, kind, shape):
    n = shape[0] * shape[1]
    if kind == "q":
        return qbytes(spec, shape)
    if kind == "q+t":
        return 2 * qbytes(spec, shape) - 2 * n
    if kind == "fq":
        return 4 * n
    return 6 * n


def torchao_baselines():
    """name -> (eager fn, compiled fn) of torchao's quantizers matching lowbit's, or {}."""
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
        name_of(find("nvfp4", None, (1, 16), True)): nvfp4_two_level,
        name_of(find("nvfp4", None, (1, 16), False)): nvfp4_one_level,
        name_of(find("mxfp4", "rceil", (1, 32))): mx(torch.float4_e2m1fn_x2, ScaleCalculationMode.RCEIL),
        name_of(find("mxfp4", "floor", (1, 32))): mx(torch.float4_e2m1fn_x2, ScaleCalculationMode.FLOOR),
        name_of(find("mxfp8_e4m3", "rceil", (1, 32))): mx(torch.float8_e4m3fn, ScaleCalculationMode.RCEIL),
    }
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    return {k: (f, torch.compile(f, dynamic=False)) for k, f in fns.items()}


def run_timings(use_torchao: bool):
    print("\n== timings (bf16 inputs, do_bench median, L2 flushed)", flush=True)
    baselines = torchao_baselines() if use_torchao else {}
    seed = torch.tensor([12345], device=DEVICE, dtype=torch.int64)
    results = []
    for shape in SHAPES:
        x = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
        dst = torch.empty_like(x)
        copy_ms = ms(functools.partial(dst.copy_, x))
        copy_gbs = 4 * x.numel() / copy_ms / 1e6
        copy_graph = graph_time_ms(functools.partial(dst.copy_, x), DEVICE)
        copy_graph_gbs = 4 * x.numel() / copy_graph / 1e6 if copy_graph else None
        print(f"   {shape}: copy {copy_ms * 1e3:.1f} us = {copy_gbs:.0f} GB/s", flush=True)
        for label, spec, kind in timed_kernels():
            row = {"kernel": label, "shape": list(shape), "copy_us": copy_ms * 1e3,
                   "copy_GBps": copy_gbs}
            try:
                t = ms(kernel_call(spec, kind, x, seed))
                gbs = moved_bytes(spec, kind, shape) / t / 1e6
                row.update(us=t * 1e3, GBps=gbs, frac_copy=gbs / copy_gbs)
                g = graph_time_ms(kernel_call(spec, kind, x, seed), DEVICE)
                if g and copy_graph_gbs:
                    ggbs = moved_bytes(spec, kind, shape) / g / 1e6
                    row.update(graph_us=g * 1e3, graph_GBps=ggbs, graph_frac_copy=ggbs / copy_graph_gbs)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            if label in baselines and kind == "q":
                eager, compiled = baselines[label]
                for key, fn in (("torchao_eager_us", eager), ("torchao_compiled_us", compiled)):
                    try:
                        row[key] = ms(functools.partial(fn, x)) * 1e3
                    except Exception as e:  # noqa: BLE001
                        row[key + "_error"] = f"{type(e).__name__}: {e}"[:200]
                if "us" in row and "torchao_compiled_us" in row:
                    row["speedup_vs_compiled"] = row["torchao_compiled_us"] / row["us"]
            results.append(row)
            print("   " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in row.items() if k not in ("copy_us", "copy_GBps")),
                  flush=True)
    return results


def run_sweep():
    """Time a few tile configs per kernel family on one shape: is the default the best?"""
    shape = CHECK_SIZES["sweep"]
    print(f"\n== tile-config sweep on {shape} bf16", flush=True)
    x = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    seed = torch.tensor([1], device=DEVICE, dtype=torch.int64)
    configs = [TileConfig(16, 128, 4), TileConfig(32, 128, 4), TileConfig(64, 128, 4),
               TileConfig(32, 256, 4), TileConfig(64, 128, 8), TileConfig(32, 64, 4),
               TileConfig(64, 256, 8), TileConfig(128, 128, 8)]
    out = []
    stable, mx1d = find("mxfp4", "rceil", (32, 32)), find("mxfp4", "rceil", (1, 32))
    nvfp4 = find("nvfp4", None, (1, 16), True)
    for spec, values in [(mx1d, False), (stable, False), (sr(stable), False), (nvfp4, False),
                         (stable, True), (nvfp4, True)]:
        default = default_config(*shape, spec.block)
        times = {}
        for cfg in configs:
            if cfg[0] % spec.block[0]:
                continue
            s = seed if spec.rounding.value == "stochastic" else None
            try:
                call = functools.partial(_run, x, spec, s, None, codes=not values, values=values,
                                         transpose=False, config=cfg)
                times[tuple(cfg)] = ms(call) * 1e3
            except Exception as e:  # noqa: BLE001
                print(f"   {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        best = min(times, key=times.get)
        label = name_of(spec, "fq" if values else "q")
        print(f"   {label:34s} default {tuple(default)} {times.get(tuple(default), float('nan')):8.1f} us"
              f" | best {best} {times[best]:8.1f} us", flush=True)
        out.append({"kernel": label, "default": list(default),
                    "times_us": {str(k): v for k, v in times.items()}, "best": list(best)})
    return out


def print_table(results):
    cols = [("kernel", 34, "s"), ("shape", 12, "s"), ("us", 9, ".1f"), ("GBps", 8, ".0f"),
            ("frac_copy", 9, ".0%"), ("graph_us", 9, ".1f"), ("graph_frac_copy", 9, ".0%"),
            ("torchao_eager_us", 12, ".1f"),
            ("torchao_compiled_us", 12, ".1f"), ("speedup_vs_compiled", 10, ".1f")]
    heads = ["kernel", "shape", "us", "GB/s", "of copy", "graph us", "graph/cp", "ao eager us",
             "ao comp. us", "x ao comp."]
    widths = [w for _, w, _ in cols]
    print("\n" + "  ".join(h.ljust(w) if i <= 1 else h.rjust(w)
                           for i, (h, w) in enumerate(zip(heads, widths, strict=True))))
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
        print("  ".join(cells))
    errors = [r for r in results if "error" in r]
    for r in errors[:10]:
        print(f"   error {r['kernel']} {r['shape']}: {r['error']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks-only", action="store_true")
    parser.add_argument("--no-checks", action="store_true")
    parser.add_argument("--no-torchao", action="store_true")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1: tests this script, "
                             "measures nothing")
    args = parser.parse_args()
    global DEVICE, SHAPES
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke needs TRITON_INTERPRET=1 in the environment")
        DEVICE, SHAPES = "cpu", [(64, 256)]
        CHECK_SIZES.update(random=(64, 128), big=(128, 128), adversarial=(64, 128),
                           odd=(2, 20, 45), stochastic=(32, 100), sweep=(128, 256))
    elif not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    t0 = time.time()
    report = Report("bench_kernels", DEVICE, triton=triton.__version__)
    save = report.save

    checks = None
    if not args.no_checks:
        checks = run_checks()
        report["checks"] = {"passed": checks.passed, "failed": checks.failed}
        save()
    if not args.checks_only:
        try:
            report["timings"] = run_timings(not args.no_torchao)
            save()
            print_table(report["timings"])
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        if not args.no_sweep:
            try:
                report["sweep"] = run_sweep()
                save()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    if checks is not None:
        print(f"\nCHECKS: {checks.passed} passed, {len(checks.failed)} failed")
        for label, err in checks.failed:
            print(f"  FAIL {label}: {err}")
    report["meta"]["seconds"] = round(time.time() - t0)
    save()
    print(f"total {time.time() - t0:.0f}s"
          + ("; wrote $OUT/bench_kernels.json" if os.environ.get("OUT") else ""))
    sys.exit(1 if checks is not None and checks.failed else 0)


if __name__ == "__main__":
    main()
