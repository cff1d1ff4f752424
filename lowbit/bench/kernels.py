"""`lowbit bench kernels`: each Triton quantizer's GB/s, timed eagerly and replayed from a CUDA
graph, against a device-to-device copy of the same tensor in the same run, and against
torchao's quantizers for the same formats where torchao imports; with --check, first every
kernel against the reference quantizer, bit for bit.

    lowbit bench kernels --check                                       # CUDA
    TRITON_INTERPRET=1 lowbit bench kernels --check --shapes 64x256 --no-torchao   # CPU smoke

The checks (`kernel_checks`) are those of tests/test_kernels.py, on a GPU's large shapes:
every spec the kernels cover in MXFP4 / MXFP8 (floor and rceil, 1x32, 16x16 and 32x32) and
NVFP4 (1x16 and 16x16, one- and two-level) -- codes, scales, tensor scale and dequantized
values against the CPU reference (and against the reference run on the GPU, at 4096x4096,
after checking that the two references agree) on values spread over many binades in float32,
bfloat16 and float16, on lowbit.kernels.checks' adversarial inputs, a 3-D odd shape, a
non-contiguous view, 1-D tensors; the transposed outputs of 2D tiles; stochastic rounding
against the reference fed the seed contract's uniforms (an independent NumPy Philox); the
NVFP4 operation-order cases; and nvfp4's fused random Hadamard transform (quantize.py's kernel
on the transposed view, and lowbit.kernels.hadamard's row-group kernel) against the rotation
followed by the quantizer. On the CPU (Triton's interpreter) the same checks run on tiny
shapes for one spec of each kind, which is what CI runs (tests/test_kernels.py covers every
spec there).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from lowbit.bench.timing import graph_time_ms, record_check, time_ms

__all__ = ["KERNEL_SHAPES", "bench_kernels", "format_kernel_rows", "kernel_call", "kernel_name",
           "kernel_spec", "moved_bytes", "timed_kernels", "torchao_baselines", "kernel_checks",
           "format_check_rows"]

KERNEL_SHAPES = [(4096, 4096), (8192, 8192), (16384, 8192),
                 (2048, 2048), (5632, 2048), (2048, 5632), (16384, 2048)]   # + a 1B model's GEMMs



def kernel_spec(fmt: str, rule: str | None, block: tuple[int, int], two_level: bool | None = None,
                rounding: str = "rne"):
    from lowbit.formats import QuantSpec
    return QuantSpec.make(fmt, block, rule, rounding, tensor_scale=two_level)


def kernel_name(spec, kind: str = "q") -> str:
    rule = spec.scale_rule.value if spec.scale_rule else ("2lvl" if spec.tensor_scale else "1lvl")
    return f"{kind} {spec.format} {rule} {spec.block[0]}x{spec.block[1]} {spec.rounding.value}"


def timed_kernels() -> list[tuple[str, object, str]]:
    """(label, spec, kind) of the timed kernels, the recipes' quantizers first. kind: q
    (quantize to a QTensor), fq (fake quantize), q+t / fq+t (also the transpose)."""
    stable = kernel_spec("mxfp4", "rceil", (32, 32))                 # stable-fp4's quantizer
    stable_sr = kernel_spec("mxfp4", "rceil", (32, 32), rounding="stochastic")
    nvfp4 = kernel_spec("nvfp4", None, (1, 16), True)                # the nvfp4 recipe's
    nvfp4_sr = kernel_spec("nvfp4", None, (1, 16), True, "stochastic")
    nvfp4_w = kernel_spec("nvfp4", None, (16, 16), True)
    rows = [(kernel_name(spec), spec, "q") for spec in [
        stable, stable_sr, kernel_spec("mxfp4", "rceil", (16, 16)), kernel_spec("mxfp4", "rceil", (1, 32)),
        kernel_spec("mxfp4", "floor", (1, 32)), kernel_spec("mxfp8_e4m3", "rceil", (1, 32)),
        kernel_spec("mxfp8_e5m2", "rceil", (1, 32)), nvfp4, kernel_spec("nvfp4", None, (1, 16), False),
        nvfp4_w, nvfp4_sr]]
    rows += [(kernel_name(spec, "fq"), spec, "fq") for spec in [stable, stable_sr, nvfp4, nvfp4_w]]
    rows += [(kernel_name(stable, "q+t"), stable, "q+t"), (kernel_name(stable, "fq+t"), stable, "fq+t")]
    return rows


def kernel_call(spec, kind: str, x: torch.Tensor, seed: torch.Tensor):
    from lowbit.kernels import (fake_quantize_triton, fake_quantize_triton_with_transpose,
                                quantize_triton, quantize_triton_with_transpose)

    s = seed if spec.rounding.value == "stochastic" else None
    call = {"q": quantize_triton, "fq": fake_quantize_triton, "q+t": quantize_triton_with_transpose,
            "fq+t": fake_quantize_triton_with_transpose}[kind]
    return functools.partial(call, x, spec, s)


def moved_bytes(spec, kind: str, shape: tuple[int, int], in_bytes: int = 2) -> int:
    """Bytes read + written by one call: x once; packed codes, scales and the tensor scale
    (quantize) or the values (fake quantize); twice the outputs with the transpose."""
    rows, cols = shape
    br, bc = spec.block
    per_byte = 8 // spec.info.element.code_bits
    codes = rows * (-(-cols // bc) * bc) // per_byte
    scales = (rows if br == 1 else -(-rows // br)) * -(-cols // bc)
    quantized = codes + scales + (4 if spec.tensor_scale else 0)
    n = rows * cols
    return {"q": n * in_bytes + quantized, "q+t": n * in_bytes + 2 * quantized,
            "fq": 2 * n * in_bytes, "fq+t": 3 * n * in_bytes}[kind]


def torchao_baselines() -> dict:
    """kernel label -> (eager fn, compiled fn) of torchao's quantizer for the same format, or {}
    when torchao does not import."""
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
        kernel_name(kernel_spec("nvfp4", None, (1, 16), True)): nvfp4_two_level,
        kernel_name(kernel_spec("nvfp4", None, (1, 16), False)): nvfp4_one_level,
        kernel_name(kernel_spec("mxfp4", "rceil", (1, 32))): mx(torch.float4_e2m1fn_x2, ScaleCalculationMode.RCEIL),
        kernel_name(kernel_spec("mxfp4", "floor", (1, 32))): mx(torch.float4_e2m1fn_x2, ScaleCalculationMode.FLOOR),
        kernel_name(kernel_spec("mxfp8_e4m3", "rceil", (1, 32))): mx(torch.float8_e4m3fn, ScaleCalculationMode.RCEIL),
    }
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    return {k: (f, torch.compile(f, dynamic=False)) for k, f in fns.items()}


def bench_kernels(shapes=KERNEL_SHAPES, *, device: str = "cuda", torchao: bool = True,
                  progress=print) -> list[dict]:
    """Time every kernel of timed_kernels() on bf16 inputs of each shape: microseconds and GB/s
    eager (do_bench) and replayed from a CUDA graph, each as a fraction of a device-to-device
    copy of the same tensor timed the same way in the same run; with torchao, its quantizer
    for the same format, eager and torch.compile'd."""
    baselines = torchao_baselines() if torchao else {}
    seed = torch.tensor([12345], device=device, dtype=torch.int64)
    results = []
    for shape in shapes:
        x = torch.randn(shape, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(x)
        copy_ms = time_ms(functools.partial(dst.copy_, x), device)
        copy_gbs = 4 * x.numel() / copy_ms / 1e6
        copy_graph = graph_time_ms(functools.partial(dst.copy_, x), device)
        copy_graph_gbs = 4 * x.numel() / copy_graph / 1e6 if copy_graph else None
        progress(f"   {shape}: copy {copy_ms * 1e3:.1f} us = {copy_gbs:.0f} GB/s")
        for label, spec, kind in timed_kernels():
            row = {"kernel": label, "shape": list(shape), "copy_us": copy_ms * 1e3,
                   "copy_GBps": copy_gbs}
            try:
                t = time_ms(kernel_call(spec, kind, x, seed), device)
                gbs = moved_bytes(spec, kind, shape) / t / 1e6
                row.update(us=t * 1e3, GBps=gbs, frac_copy=gbs / copy_gbs)
                g = graph_time_ms(kernel_call(spec, kind, x, seed), device)
                if g and copy_graph_gbs:
                    ggbs = moved_bytes(spec, kind, shape) / g / 1e6
                    row.update(graph_us=g * 1e3, graph_GBps=ggbs, graph_frac_copy=ggbs / copy_graph_gbs)
            except Exception as e:  # noqa: BLE001 -- one failing kernel must not lose the table
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            if label in baselines and kind == "q":
                eager, compiled = baselines[label]
                for key, fn in (("torchao_eager_us", eager), ("torchao_compiled_us", compiled)):
                    try:
                        row[key] = time_ms(functools.partial(fn, x), device) * 1e3
                    except Exception as e:  # noqa: BLE001
                        row[key + "_error"] = f"{type(e).__name__}: {e}"[:200]
                if "us" in row and "torchao_compiled_us" in row:
                    row["speedup_vs_compiled"] = row["torchao_compiled_us"] / row["us"]
            results.append(row)
            progress("   " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in row.items() if k not in ("copy_us", "copy_GBps")))
    return results


def format_kernel_rows(results: list[dict]) -> str:
    cols = [("kernel", 34, "s"), ("shape", 12, "s"), ("us", 9, ".1f"), ("GBps", 8, ".0f"),
            ("frac_copy", 9, ".0%"), ("graph_us", 9, ".1f"), ("graph_frac_copy", 9, ".0%"),
            ("torchao_eager_us", 12, ".1f"),
            ("torchao_compiled_us", 12, ".1f"), ("speedup_vs_compiled", 10, ".1f")]
    heads = ["kernel", "shape", "us", "GB/s", "of copy", "graph us", "graph/cp", "ao eager us",
             "ao comp. us", "x ao comp."]
    widths = [w for _, w, _ in cols]
    lines = ["  ".join(h.ljust(w) if i <= 1 else h.rjust(w)
                       for i, (h, w) in enumerate(zip(heads, widths, strict=True)))]
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
        lines.append("  ".join(cells))
    for r in [r for r in results if "error" in r][:10]:
        lines.append(f"   error {r['kernel']} {r['shape']}: {r['error']}")
    return "\n".join(lines)




# ---- bit-exact checks against the reference ------------------------------------------------

CHECK_SIZES = {"cuda": {"random": (1024, 1024), "big": (4096, 4096), "adversarial": (512, 1024),
                        "odd": (3, 77, 45), "stochastic": (256, 1000),
                        "hadamard": [(8192, 2048), (8192, 5504)]},
               "cpu": {"random": (64, 128), "adversarial": (64, 128), "odd": (2, 20, 45),
                       "stochastic": (32, 100), "hadamard": [(64, 96)]}}


def check_specs(device: str) -> list:
    """The specs --check covers: all of the kernels' MX and NVFP4 specs on CUDA; on the CPU
    one of each kind (1D MX, 2D MX, two-level NVFP4 1x16, one-level NVFP4 16x16)."""
    mx = [kernel_spec(fmt, rule, block) for fmt in ("mxfp4", "mxfp8_e4m3", "mxfp8_e5m2")
          for rule in ("floor", "rceil") for block in ((1, 32), (16, 16), (32, 32))]
    nv = [kernel_spec("nvfp4", None, block, two) for two in (True, False)
          for block in ((1, 16), (16, 16))]
    if device == "cuda":
        return mx + nv
    return [mx[0], mx[5], nv[0], nv[3]]


def _stochastic(spec):
    from lowbit.formats import QuantSpec
    return QuantSpec.make(spec.format, spec.block, spec.scale_rule, "stochastic",
                          spec.tensor_scale if spec.format == "nvfp4" else None)


def spread(shape, seed: int, device: str) -> torch.Tensor:
    """float32 values over many binades, one exponent per 16 along the last dim, with rare
    outliers (like real activations)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, generator=g, device=device)
    exps = torch.randint(-30, 30, (*shape[:-1], -(-shape[-1] // 16), 1), generator=g,
                         device=device)
    mag = torch.exp2(exps.float()).expand(*shape[:-1], -1, 16).reshape(*shape[:-1], -1)
    outliers = (torch.rand(shape, generator=g, device=device) < 1e-3) * 50
    return x * mag[..., : shape[-1]] * (1 + outliers)


@contextlib.contextmanager
def _reference_drawing(u: torch.Tensor, spec):
    """The reference quantizer's stochastic rounding draws `u` (the seed contract's uniforms of
    its input's shape) instead of torch.rand's: the reference draws them in one torch.rand
    call, in its blocked layout, which is replaced for the duration of this block (as
    tests/test_kernels.py does)."""
    from lowbit.formats.quantize import blocked

    noise = blocked(u, spec.block)[0]
    real = torch.rand

    def rand(size, *args, **kwargs):
        if tuple(size) != tuple(noise.shape):
            raise AssertionError(f"the reference drew {tuple(size)}, not {tuple(noise.shape)}")
        return noise.to(kwargs.get("device") or "cpu")

    torch.rand = rand
    try:
        yield
    finally:
        torch.rand = real


def _check_bodies(device: str):
    """The check functions, each raising AssertionError on a difference."""
    from lowbit.formats import quantize_with_spec as reference
    from lowbit.kernels import (fake_quantize_triton, fake_quantize_triton_with_transpose,
                                quantize_triton, quantize_triton_with_transpose,
                                stochastic_uniforms)
    from lowbit.kernels.checks import assert_bits_equal, assert_same_qtensor, contract_uniforms

    def against_cpu(x, spec, seed=None):
        r = reference(x.cpu(), spec)
        assert_same_qtensor(quantize_triton(x, spec, seed), r)
        assert_bits_equal(fake_quantize_triton(x, spec, seed), r.dequantize())

    def against_device_reference(x, spec):
        r = reference(x, spec)
        assert_same_qtensor(quantize_triton(x, spec), r)
        assert_bits_equal(fake_quantize_triton(x, spec), r.dequantize())

    def references_agree(x, spec):
        assert_same_qtensor(reference(x, spec), reference(x.cpu(), spec))

    def transposed(x, spec, seed):
        q, q_t = quantize_triton_with_transpose(x, spec, seed)
        ref_t = q.t()
        assert torch.equal(q_t.codes, ref_t.codes), "transposed codes"
        assert torch.equal(q_t.scales.view(torch.uint8), ref_t.scales.view(torch.uint8)), \
            "transposed scales"
        v, v_t = fake_quantize_triton_with_transpose(x, spec, seed)
        assert_bits_equal(v, q.dequantize())
        assert_bits_equal(v_t, v.mT.contiguous())

    def stochastic(x, spec, seed):
        with _reference_drawing(contract_uniforms(tuple(x.shape), seed), spec):
            r = reference(x.cpu(), spec)
        assert_same_qtensor(quantize_triton(x, spec, seed), r)
        assert_bits_equal(fake_quantize_triton(x, spec, seed), r.dequantize())

    def uniforms(shape, seed):
        assert torch.equal(stochastic_uniforms(shape, seed, device).cpu(),
                           contract_uniforms(shape, seed)), "uniforms differ"

    return against_cpu, against_device_reference, references_agree, transposed, stochastic, uniforms


def kernel_checks(device: str = "cuda", progress=print) -> list[dict]:
    """Run the checks of the module doc on `device` ("cuda", or "cpu" under Triton's
    interpreter: tiny shapes, one spec of each kind). Returns one row per check: {"check":
    label, "passed": bool, "error": what differed (failures only)}; a failure does not stop
    the others."""
    from lowbit.formats.hadamard import random_hadamard
    from lowbit.kernels import fake_quantize_triton
    from lowbit.kernels.checks import adversarial, assert_bits_equal, nvfp4_order_cases
    from lowbit.kernels.hadamard import fake_quantize_rht_rows

    against_cpu, against_device_reference, references_agree, transposed, stochastic, uniforms = (
        _check_bodies(device))
    sizes = CHECK_SIZES["cuda" if device == "cuda" else "cpu"]
    rows: list[dict] = []

    def run(label, fn, *args):
        record_check(rows, label, fn, *args, progress=progress)

    for spec in check_specs(device):
        name = kernel_name(spec)
        x = spread(sizes["random"], 1, device)
        run(f"{name} random bf16", against_cpu, x.bfloat16(), spec)
        run(f"{name} random fp32", against_cpu, x[:256], spec)
        run(f"{name} random fp16", against_cpu, (x[:256] / x.abs().max() * 6e4).half(), spec)
        if device == "cuda":
            run(f"{name} cuda reference == cpu reference", references_agree, x.bfloat16(), spec)
            big = spread(sizes["big"], 2, device).bfloat16()
            run(f"{name} random bf16 {tuple(big.shape)} (cuda reference)",
                against_device_reference, big, spec)
        adv = adversarial(*sizes["adversarial"], spec, seed=3).to(device)
        run(f"{name} adversarial fp32", against_cpu, adv, spec)
        run(f"{name} adversarial bf16", against_cpu, adv.bfloat16(), spec)
        odd = spread(sizes["odd"], 4, device)
        run(f"{name} 3-D odd shape", against_cpu, odd, spec)
        run(f"{name} non-contiguous", against_cpu, x[:200, :300].t(), spec)
        if spec.is_2d:
            run(f"{name} transposed outputs", transposed, odd.bfloat16(), spec, 7)
            run(f"{name} transposed outputs SR", transposed, odd.bfloat16(), _stochastic(spec), 7)
        else:
            run(f"{name} 1-D", against_cpu, x[0, :1000], spec)
        run(f"{kernel_name(_stochastic(spec))} == reference with the contract's uniforms",
            stochastic, spread(sizes["stochastic"], 5, device).bfloat16(), _stochastic(spec),
            2**40 + 7)
    order, _ = nvfp4_order_cases(seed=0)
    nvfp4 = kernel_spec("nvfp4", None, (1, 16), True)
    run("nvfp4 operation-order cases", against_cpu, order.to(device), nvfp4)
    for shape in [(1000, 1000), (7, 333)] if device == "cuda" else [(7, 333)]:
        run(f"uniforms {shape} == NumPy Philox", uniforms, shape, 2**62 + 3)

    # nvfp4's wgrad operands: the fused random Hadamard transform, on t = x.mT as the layers
    # hand it (quantize.py's kernel) and on x itself (the row-group kernel the layers use)
    signs = torch.tensor([1, -1, -1, 1, 1, 1, -1, 1, -1, 1, 1, -1, 1, -1, -1, -1],
                         device=device, dtype=torch.float32)
    seed = torch.tensor([3], device=device, dtype=torch.int64)
    nvfp4_sr = _stochastic(nvfp4)
    for shape in sizes["hadamard"]:
        t = spread(shape, 5, device).bfloat16().mT                       # (features, tokens)
        rotated = random_hadamard(t, signs)
        fused = fake_quantize_triton(t, nvfp4, hadamard=signs)
        fused_sr = fake_quantize_triton(t, nvfp4_sr, seed, hadamard=signs)
        run(f"hadamard {shape} rne == rotation, then quantize", assert_bits_equal, fused,
            fake_quantize_triton(rotated, nvfp4))
        run(f"hadamard {shape} sr == rotation, then quantize", assert_bits_equal, fused_sr,
            fake_quantize_triton(rotated, nvfp4_sr, seed))
        run(f"hadamard rows {shape} rne == the transposed view's", assert_bits_equal,
            fake_quantize_rht_rows(t.mT, nvfp4, signs), fused.mT)
        run(f"hadamard rows {shape} sr == the transposed view's", assert_bits_equal,
            fake_quantize_rht_rows(t.mT, nvfp4_sr, signs, seed), fused_sr.mT)
    return rows


def format_check_rows(rows: list[dict]) -> str:
    """One line of totals, then one per failed check."""
    failed = [r for r in rows if not r["passed"]]
    lines = [f"checks: {len(rows) - len(failed)} passed, {len(failed)} failed (bit for bit "
             "against the reference)"]
    lines += [f"  FAIL {r['check']}: {r['error']}" for r in failed]
    return "\n".join(lines)
