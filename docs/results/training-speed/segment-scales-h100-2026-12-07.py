"""An MoE operand's per-expert NVFP4 tensor scales on CUDA: the maxima kernel and the chain of
PyTorch operations (before) against lowbit.kernels.segment_scales_triton (after), for X-like
rows (one scale a row) and the rotated wgrad operand (one a column, runs of 16); 33,280 rows
(8,192 tokens x top-4 plus padding), 32 experts at random ends; the same bits checked, each
timed from a CUDA graph. Run: PYTHONPATH=. python docs/results/training-speed/segment-scales-h100-2026-12-07.py"""
import torch
from triton.testing import do_bench_cudagraph

from lowbit.formats.quantize import segment_scales_from_amax
from lowbit.kernels import group_amax_triton, segment_scales_triton

torch.manual_seed(0)
for R, C in ((33280, 1024), (33280, 512)):
    x = torch.randn(R, C, device="cuda", dtype=torch.bfloat16)
    ends = torch.sort(torch.randint(0, R, (32,), device="cuda"))[0].to(torch.int32)
    signs = torch.ones(16, device="cuda")
    old_r = lambda: segment_scales_from_amax(group_amax_triton(x, rows=True), ends)[:, None]
    new_r = lambda: segment_scales_triton(x, ends, rows=True)[:, None]
    t = x.mT
    old_c = lambda: segment_scales_from_amax(group_amax_triton(t, signs), ends, 16).repeat_interleave(16)
    new_c = lambda: segment_scales_triton(t, ends, hadamard=signs)
    assert torch.equal(old_r(), new_r()) and torch.equal(old_c(), new_c())
    for name, f in (("rows old", old_r), ("rows new", new_r), ("cols old", old_c), ("cols new", new_c)):
        print(R, C, name, f"{do_bench_cudagraph(f, rep=50)*1000:.1f} us", flush=True)
