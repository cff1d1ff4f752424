"""Where a kernel benchmark runs: a CUDA GPU to measure, or the CPU under Triton's interpreter
to check the benchmark itself; anything else is refused in one line."""

from __future__ import annotations

import os
import sys

__all__ = ["kernel_device", "smoke_or_gpu"]


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


def smoke_or_gpu(smoke: bool, what: str) -> str:
    """The device of a benchmark with a --smoke mode: "cuda" to measure; "cpu" for --smoke
    (small shapes, the kernels in Triton's interpreter: TRITON_INTERPRET=1 is set here if
    triton has not been imported yet). Without --smoke and without a GPU, or with --smoke after
    triton was imported without the interpreter, one line says why not (ValueError)."""
    from lowbit.kernels import interpret_mode, triton_importable

    if smoke and not interpret_mode():
        if "triton" in sys.modules:
            raise ValueError(f"{what} --smoke runs the kernels in Triton's interpreter: set "
                             "TRITON_INTERPRET=1 before triton is first imported")
        os.environ["TRITON_INTERPRET"] = "1"     # before triton_importable imports it
    if not triton_importable():
        raise ValueError(f"{what} needs triton (pip install triton)")
    if smoke:
        print(f"{what} --smoke: small shapes on the CPU in Triton's interpreter, to check the "
              "benchmark itself; the timings mean nothing", flush=True)
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"{what} measures on a CUDA GPU and this machine has none (--smoke: "
                         "small shapes on the CPU, to check it runs)")
    return "cuda"
