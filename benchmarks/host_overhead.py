"""Host-side (Python) cost of one quantized linear layer's forward + backward, on any machine.

    TRITON_INTERPRET=1 python benchmarks/host_overhead.py            # per recipe, microseconds
    TRITON_INTERPRET=1 python benchmarks/host_overhead.py stable-fp4 # + a cProfile of that recipe

Eager training steps with quantized recipes are host-bound on an H200 (docs/results/kernels.md:
the GPU is busy 47% of a 1B stable-fp4 step). This measures the part lowbit's own Python adds:
the Triton kernels and the FP8 GEMM (torch._scaled_mm, reached through its CUDA-side code) are
replaced by no-ops (the launch arguments are still built), the tensors are tiny, so what remains
is dispatch, argument handling, allocation and autograd; FP8 folds run as in lowbit.train's
step, inside deferred_fold_check(). Triton's own launcher cost is not included (the
interpreter's stand-in replaces it). Minimum over 5 repeats.
"""
import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (the kernels are stubbed, and dispatch must accept CPU tensors)")

import torch  # noqa: E402
from triton.runtime.jit import KernelInterface  # noqa: E402

import lowbit.kernels as k  # noqa: E402
import lowbit.kernels.quantize as kq  # noqa: E402


class Stub:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


import lowbit.kernels.fp8_fold as ff  # noqa: E402
import lowbit.kernels.fp8_gemm as fp8_gemm  # noqa: E402
import lowbit.kernels.hadamard as hadamard  # noqa: E402
from lowbit.kernels.fp8_gemm import deferred_fold_check  # noqa: E402

# every launched kernel (a jit function named *_kernel) of the kernel modules: a no-op
for module in (kq, ff, hadamard):
    for name, fn in list(vars(module).items()):
        if isinstance(fn, KernelInterface) and name.endswith("_kernel"):
            setattr(module, name, Stub())
k.use_kernels = lambda x, spec, codes=True: k.supports(spec, codes)
# the FP8 GEMM takes its CUDA path (row-wise torch._scaled_mm) with the GEMM itself stubbed
fp8_gemm._gemm_emulated = lambda fa, fb, pieces, out_dtype: fp8_gemm._gemm_scaled_mm(
    fa, fb, pieces, out_dtype, False)
torch._scaled_mm = lambda a, b, **kw: torch.empty(a.shape[0], b.shape[1], dtype=kw["out_dtype"])
from lowbit.ops import quant_linear  # noqa: E402
from lowbit.recipes import get_recipe  # noqa: E402

x = torch.randn(32, 64, requires_grad=True)
w = torch.randn(64, 64, requires_grad=True)


def step(r):
    with deferred_fold_check(x.device):   # as lowbit.train's step: FP8 folds without syncs
        y = quant_linear(x, w, None, r)
        y.sum().backward()


res = {}
for name in ['bf16', 'stable-fp4', 'stable-fp4-fp8', 'nvfp4', 'mxfp4']:
    r = get_recipe(name).linear
    for _ in range(100): step(r)
    best = []
    for rep in range(5):
        t = time.perf_counter(); n = 300
        for _ in range(n): step(r)
        best.append((time.perf_counter() - t) / n * 1e6)
    res[name] = min(best)
    print(name, round(min(best)), 'us per linear fwd+bwd')
if len(sys.argv) > 1:
    import cProfile, pstats
    r = get_recipe(sys.argv[1]).linear
    cProfile.run('for _ in range(1000): step(r)', '/tmp/prof')
    pstats.Stats('/tmp/prof').sort_stats('tottime').print_stats(18)
