"""Host-side (Python) cost of one quantized linear layer's forward + backward, on any machine.

    TRITON_INTERPRET=1 python benchmarks/host_overhead.py            # per recipe, microseconds
    TRITON_INTERPRET=1 python benchmarks/host_overhead.py stable-fp4 # + a cProfile of that recipe

Eager training steps with quantized recipes are host-bound on an H200 (docs/results/kernels.md:
the GPU is busy 47% of a 1B stable-fp4 step). This measures the part lowbit's own Python adds:
the Triton kernels are replaced by no-ops (the launch arguments are still built), the tensors
are tiny, so what remains is dispatch, argument handling, allocation and autograd. Triton's own
launcher cost is not included (the interpreter's stand-in replaces it). Minimum over 5 repeats.
"""
import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (the kernels are stubbed, and dispatch must accept CPU tensors)")

import torch  # noqa: E402

import lowbit.kernels as k  # noqa: E402
import lowbit.kernels.quantize as kq  # noqa: E402


class Stub:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


kq._quantize_kernel = Stub()
kq._tensor_amax_kernel = Stub()
k.use_kernels = lambda x, spec: k.supports(spec)
from lowbit.ops import quant_linear  # noqa: E402
from lowbit.recipes import get_recipe  # noqa: E402

x = torch.randn(32, 64, requires_grad=True)
w = torch.randn(64, 64, requires_grad=True)


def step(r):
    y = quant_linear(x, w, None, r)
    y.sum().backward()


res = {}
for name in ['bf16', 'stable-fp4', 'nvfp4', 'mxfp4']:
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
