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
4. nvfp4's wgrad operand with the random Hadamard transform fused into the kernel (quantize.py's
   on the transposed view, and lowbit.kernels.hadamard's row-group kernel on the tensor
   itself, which the layers use), against the rotation then the kernel: bitwise (RNE and
   stochastic), eager and CUDA-graph times
   (`--only-hadamard` runs this alone).

Prints aligned tables; with $OUT set, writes $OUT/bench_kernels.json. Exit status 1 if a
check failed. Needs a CUDA GPU and triton (written against triton 3.6).
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

import triton  # noqa: E402
from common import Checks, Report, graph_time_ms, time_ms  # noqa: E402

from lowbit.bench import KERNEL_SHAPES, bench_kernels, format_kernel_rows, kernel_name  # noqa: E402
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
SHAPES = KERNEL_SHAPES
CHECK_SIZES = {"random": (1024, 1024), "big": (4096, 4096), "adversarial": (512, 1024),
               "odd": (3, 77, 45), "stochastic": (256, 1000), "sweep": (8192, 8192)}
DEVICE = "cuda"


def find(fmt, rule, block, two_level=None):
    return QuantSpec.make(fmt, block, rule, tensor_scale=two_level)


def sr(spec):
    return QuantSpec.make(spec.format, spec.block, spec.scale_rule, "stochastic", spec.tensor_scale)


name_of = kernel_name


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


def run_timings(use_torchao: bool):
    print("\n== timings (bf16 inputs, do_bench median, L2 flushed; and CUDA-graph replay)", flush=True)
    return bench_kernels(SHAPES, DEVICE, torchao=use_torchao, progress=lambda m: print(m, flush=True))


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


HADAMARD_SHAPES = [(8192, 2048), (8192, 5504)]   # (tokens, features): dY / X of the 1b preset


def run_hadamard(checks: Checks):
    """nvfp4's wgrad operand: the fused kernel (rotation in registers) against the rotation
    followed by the quantize kernel, on t = x.mT as lowbit.ops.linear hands it: bitwise (into
    `checks`), then eager (do_bench) and GPU-alone (CUDA-graph replay) times in ms."""
    from lowbit.kernels.hadamard import fake_quantize_rht_rows
    from lowbit.ops import random_hadamard

    print("\n== nvfp4 wgrad operand: fused random Hadamard + fake quantize (bf16); rows: "
          "lowbit.kernels.hadamard on the untransposed tensor", flush=True)
    spec = find("nvfp4", None, (1, 16), True)
    signs = torch.tensor([1, -1, -1, 1, 1, 1, -1, 1, -1, 1, 1, -1, 1, -1, -1, -1],
                         device=DEVICE, dtype=torch.float32)
    out = []
    for shape in HADAMARD_SHAPES if DEVICE == "cuda" else [(64, 96)]:
        t = spread(shape, seed=5).to(torch.bfloat16).mT                # (features, tokens)
        seed = torch.tensor([3], device=DEVICE, dtype=torch.int64)
        fused = functools.partial(fake_quantize_triton, t, spec, hadamard=signs)
        unfused = lambda: fake_quantize_triton(random_hadamard(t, signs), spec)  # noqa: E731
        fused_sr = functools.partial(fake_quantize_triton, t, sr(spec), seed, hadamard=signs)
        # the row-group kernel lowbit's nvfp4 layers use: on the (tokens, features) tensor
        rows = functools.partial(fake_quantize_rht_rows, t.mT, spec, signs)
        checks.run(f"hadamard {shape} rne", assert_bits_equal, fused(), unfused())
        checks.run(f"hadamard {shape} sr", assert_bits_equal, fused_sr(),
                   fake_quantize_triton(random_hadamard(t, signs), sr(spec), seed))
        checks.run(f"hadamard rows {shape} rne", assert_bits_equal, rows(), fused().mT)
        checks.run(f"hadamard rows {shape} sr", assert_bits_equal,
                   fake_quantize_rht_rows(t.mT, sr(spec), signs, seed), fused_sr().mT)
        row = {"shape": f"{shape[0]}x{shape[1]}"}
        for name, fn in (("rows", rows), ("fused", fused), ("unfused", unfused)):
            row[f"{name}_ms"] = ms(fn)
            row[f"{name}_graph_ms"] = graph_time_ms(fn, DEVICE)
        out.append(row)
        print("   " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in row.items()), flush=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks-only", action="store_true")
    parser.add_argument("--no-checks", action="store_true")
    parser.add_argument("--no-torchao", action="store_true")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--only-hadamard", action="store_true",
                        help="only section 4, the fused random Hadamard transform")
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

    checks = None
    if args.only_hadamard:
        checks = Checks()
        report.section("hadamard", lambda: run_hadamard(checks))
        report.finish(checks, t0)
        return
    if not args.no_checks:
        checks = run_checks()
        report["checks"] = {"passed": checks.passed, "failed": checks.failed}
        report.save()
    if not args.checks_only:
        report.section("timings", lambda: run_timings(not args.no_torchao),
                       lambda rows: print("\n" + format_kernel_rows(rows)))
        if not args.no_sweep:
            report.section("sweep", run_sweep)
        checks = checks or Checks()
        report.section("hadamard", lambda: run_hadamard(checks))
    report.finish(checks, t0)


if __name__ == "__main__":
    main()
