"""One-row packed NVFP4 GEMM: the default tile (tensor cores, BLOCK_M 16) against every one-row
CUDA-core tile (USE_DOT False, BLOCK_M 1) of a small sweep, on TinyLlama-1.1B's four decode
projections, each time over enough copies of the weight (~300 MB) that it streams from HBM, in
a CUDA graph. Writes JSON (default nvfp4-one-row.json): per projection, the default's
microseconds a call and each tile's (microseconds, output within 2% of the default's).

    PYTHONPATH=. python benchmarks/nvfp4_one_row.py [OUT.json]      # one CUDA GPU
"""
import json
import math
import sys

import torch

from lowbit.formats import QuantSpec, quantize_with_spec
from lowbit.formats.linear_weight import LinearWeight
from lowbit.kernels import engine_linear

torch.manual_seed(0)
dev = "cuda"
res = {}


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(reps):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


for name, n, k in [("q|k|v", 2560, 2048), ("o", 2048, 2048), ("gate|up", 11264, 2048), ("down", 2048, 5632)]:
    copies = max(2, math.ceil(300e6 / (n * k * 0.5625)))
    spec = QuantSpec.make("nvfp4", (1, 16))
    ws = [LinearWeight.from_qtensors([quantize_with_spec(torch.randn(n, k, device=dev) / k**0.5, spec)],
                                     torch.bfloat16) for _ in range(copies)]
    for w in ws:
        w.tiles()
    x = torch.randn(1, k, device=dev).to(torch.bfloat16)
    ref = engine_linear.linear(x, ws[0]).float()
    nbytes = ws[0].nbytes
    row = {"default_us": 1000 * timed(lambda: [engine_linear.linear(x, w) for w in ws]) / copies}
    for bn in (8, 16, 32, 64):
        for sk in (1, 2, 4, 8):
            for nw in (2, 4):
                t = {"BLOCK_M": 1, "BLOCK_N": bn, "SPLIT_K": sk, "USE_DOT": False, "num_warps": nw, "num_stages": 3}
                try:
                    out = engine_linear.linear(x, ws[0], tile=t).float()
                    ok = torch.allclose(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
                    row[f"bn{bn} sk{sk} w{nw}"] = (round(1000 * timed(
                        lambda: [engine_linear.linear(x, w, tile=t) for w in ws]) / copies, 2), ok)
                except Exception as e:
                    row[f"bn{bn} sk{sk} w{nw}"] = str(e)[:80]
    best = min((v[0], key) for key, v in row.items() if isinstance(v, tuple) and v[1])
    print(f"{name:8} default {row['default_us']:.2f} us ({nbytes / row['default_us'] / 1e3:.0f} GB/s); best CUDA-core "
          f"{best[1]}: {best[0]:.2f} us ({nbytes / best[0] / 1e3:.0f} GB/s)", flush=True)
    res[name] = row
with open(sys.argv[1] if len(sys.argv) > 1 else "nvfp4-one-row.json", "w") as f:
    json.dump(res, f, indent=1)
