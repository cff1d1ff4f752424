"""RAC's activation pass (lowbit.kernels.activation_quant, nvfp4 + RAC 25% with the RMSNorm
prologue) with its threshold found 8 bits a histogram step against 1 bit a step, in the same
process, CUDA-graph timed; and the pass without RAC. Run on one H200 (torch 2.11, triton 3.6),
2026-12-04: `PYTHONPATH=. python docs/results/rollout/rac-radix-steps-2026-12-04.py`; output in
rac-radix-steps-2026-12-04.txt."""
import torch
from lowbit.bench.timing import graph_time_ms
from lowbit.kernels import activation_quant as aq
for M in (1, 128):
    for K in (2048, 5632):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16); norm = torch.randn(K, device="cuda", dtype=torch.bfloat16)
        res = {}
        for bits in (8, 1):
            aq.RADIX_BITS = bits
            r = aq.quantize_activations(x, "nvfp4", 0.25, norm=norm)[1]
            res[bits] = (graph_time_ms(lambda: aq.quantize_activations(x, "nvfp4", 0.25, norm=norm), "cuda") * 1e3, r)
        aq.RADIX_BITS = 8
        t0 = graph_time_ms(lambda: aq.quantize_activations(x, "nvfp4", 0.0, norm=norm), "cuda") * 1e3
        print(f"M={M} K={K}: rac 8-bit steps {res[8][0]:.1f} us, 1-bit steps {res[1][0]:.1f} us, no rac {t0:.1f} us, same bits {torch.equal(res[8][1].view(torch.int16), res[1][1].view(torch.int16))}", flush=True)
