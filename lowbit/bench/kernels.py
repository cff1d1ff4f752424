"""`lowbit bench kernels`: each Triton quantizer's GB/s, timed eagerly and replayed from a CUDA
graph, against a device-to-device copy of the same tensor in the same run, and against
torchao's quantizers for the same formats where torchao imports.

    lowbit bench kernels                                      # CUDA
    TRITON_INTERPRET=1 lowbit bench kernels --shapes 64x256 --no-torchao   # CPU smoke
"""

from __future__ import annotations

import functools

import torch

from lowbit.bench.timing import graph_time_ms, time_ms

__all__ = ["KERNEL_SHAPES", "bench_kernels", "format_kernel_rows", "kernel_call", "kernel_name",
           "kernel_spec", "moved_bytes", "timed_kernels", "torchao_baselines"]

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


def bench_kernels(shapes=KERNEL_SHAPES, device: str = "cuda", torchao: bool = True,
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


