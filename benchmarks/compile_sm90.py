"""Compile every Triton kernel variant lowbit launches for Hopper (sm_90), on a machine with no GPU.

    python benchmarks/compile_sm90.py      # exit status 1 if any variant fails to compile

Triton's front end and ptxas run on the CPU. A kernel can run under TRITON_INTERPRET=1 (what
the CPU tests use) and still not compile for the GPU (a construct the interpreter accepts and
the compiler rejects), and a device call is too dear to find that out. Here the library's own
entry points run on small CPU tensors with every `kernel[grid](...)` launch intercepted: the
launch is compiled for sm_90, with NATIVE_CAST=True (the GPU's casts), instead of run. Outputs
stay uninitialised, so what a caller does after a launch (a readback, a fallback path) can go
anywhere; that is fine, since only compile errors count. The variants are those the recipes
use: MXFP4 1D/2D floor/rceil, RNE/SR, with transposes, whole-tile (unmasked) and ragged shapes,
float32, bfloat16 and float16 inputs; MXFP8; NVFP4 1D/2D, one- and two-level, with the fused
Hadamard transform; intK; the fold's both paths.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)   # the kernels must be JITFunctions, not interpreted

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout

TARGET = GPUTarget("cuda", 90, 32)
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32",
          torch.int64: "i64", torch.bool: "i1"}
_OPTIONS = ("num_warps", "num_stages")


class Compiler:
    """Stands in for every JITFunction launch: compiles each distinct variant once."""

    def __init__(self):
        self.done: dict[tuple, float] = {}
        self.failed: list[tuple[str, str]] = []

    def launch(self, fn: JITFunction, args: tuple, kwargs: dict) -> None:
        options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
        bound = dict(zip(fn.arg_names, args), **kwargs)
        signature, constants = {}, {}
        for p in fn.params:
            value = bound[p.name] if p.name in bound else p.default
            if p.is_constexpr:
                signature[p.name] = "constexpr"
                constants[p.name] = True if p.name == "NATIVE_CAST" else value
            elif isinstance(value, torch.Tensor):
                signature[p.name] = "*" + _TYPES[value.dtype]
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
        if key in self.done:
            return
        label = f"{fn.__name__} " + " ".join(f"{k}={v}" for k, v in sorted(constants.items()))
        t0 = time.time()
        try:
            triton.compile(ASTSource(fn, signature, constants), target=TARGET, options=options)
        except Exception as e:  # noqa: BLE001 -- every variant is tried and reported
            self.failed.append((label, "".join(traceback.format_exception_only(e))[-1500:]))
            print(f"FAIL {label}\n{self.failed[-1][1]}", flush=True)
        self.done[key] = time.time() - t0


def exercise(compiler: Compiler) -> None:
    """Call the library's kernel entry points on CPU tensors, each launch compiled for sm_90."""
    from lowbit.formats import QuantSpec
    from lowbit.kernels import (
        fake_quantize_triton, fake_quantize_triton_with_transpose, quantize_triton,
        quantize_triton_with_transpose, stochastic_uniforms, supports,
    )
    from lowbit.kernels import fp8_fold as ff
    from lowbit.kernels import quantize as kq
    from lowbit.kernels.fp8_gemm import deferred_fold_check
    from lowbit.kernels.hadamard import fake_quantize_rht_rows, rht_rows_supported

    kq.INTERPRET = True   # the entry points' "CUDA tensor or interpreter" check (casts: above)

    def attempt(fn, *args, **kwargs):
        # a launch compiles and returns: what the caller does with uninitialised outputs
        # afterwards (a readback, a fallback) can fail in any way, and does not count
        try:
            fn(*args, **kwargs)
        except Exception:  # noqa: BLE001
            pass

    shapes = [(64, 256), (67, 200)]       # whole tiles (unmasked path) and ragged
    specs = [("mxfp4", (1, 32), "floor", "rne"), ("mxfp4", (32, 32), "rceil", "rne"),
             ("mxfp4", (32, 32), "rceil", "stochastic"), ("mxfp4", (1, 32), "rceil", "stochastic"),
             ("mxfp8_e4m3", (32, 32), "rceil", "rne"), ("mxfp8_e4m3", (1, 32), "floor",
                                                        "stochastic"),
             ("nvfp4", (1, 16), None, "rne"), ("nvfp4", (16, 16), None, "rne"),
             ("nvfp4", (1, 16), None, "stochastic"), ("int4", (1, 32), None, "rne"),
             ("int8", (16, 16), None, "stochastic")]
    for fmt, block, rule, rounding in specs:
        kwargs = {"rounding": rounding}
        if rule is not None:
            kwargs["scale_rule"] = rule
        spec = QuantSpec.make(fmt, block, **kwargs)
        seed = 7 if rounding == "stochastic" else None
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            for shape in shapes:
                x = torch.randn(*shape, dtype=dtype)
                if supports(spec, codes=True):
                    attempt(quantize_triton, x, spec, seed=seed)
                    if spec.is_2d:
                        attempt(quantize_triton_with_transpose, x, spec, seed=seed)
                attempt(fake_quantize_triton, x, spec, seed=seed)
                if not spec.is_2d and shape[1] % 16 == 0:          # nvfp4's wgrad operands
                    attempt(fake_quantize_triton, x.t().contiguous().t(), spec, seed=seed,
                            hadamard=torch.ones(16))
                if rht_rows_supported(x, spec):                     # ... along rows
                    attempt(fake_quantize_rht_rows, x, spec, torch.ones(16), seed=seed)
                if spec.is_2d:
                    attempt(fake_quantize_triton_with_transpose, x, spec, seed=seed)
                if fmt == "mxfp4":
                    launch = ff._Launch(x, spec, seed, None, spec.is_2d)
                    with deferred_fold_check(x.device) as check:
                        attempt(ff._fold_one_chunk, launch, True, spec.is_2d, check.counter)
                        attempt(ff._fold_one_chunk, launch, False, spec.is_2d, check.counter)
                    attempt(ff._fold_planned, launch, True, spec.is_2d)
                    if spec.is_2d:
                        attempt(ff._fold_planned, launch, False, True)
    attempt(stochastic_uniforms, (64, 256), 3, device="cpu")


def main() -> int:
    compiler = Compiler()
    original = JITFunction.__getitem__
    JITFunction.__getitem__ = lambda fn, grid: (lambda *a, **k: compiler.launch(fn, a, k))
    t0 = time.time()
    try:
        exercise(compiler)
    finally:
        JITFunction.__getitem__ = original
    names = sorted({key[0] for key in compiler.done})
    print(f"{len(compiler.done)} kernel variants for sm_90 ({', '.join(names)}), "
          f"{len(compiler.failed)} failed, {time.time() - t0:.0f}s")
    return 1 if compiler.failed or not compiler.done else 0


if __name__ == "__main__":
    sys.exit(main())
