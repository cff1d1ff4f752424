"""Sweep the two-level NVFP4 tensor-amax kernel's tile, tiles per program and warps on bf16
inputs: GPU time (CUDA-graph replay), read GB/s and the ratio to a device-to-device copy's
(read + write) bandwidth in the same run, the default launch config, and whether the result
equals torch's. Chose lowbit.kernels.quantize.amax_config.

    python benchmarks/sweep_amax.py        # CUDA; writes $OUT/amax_sweep.json (or /tmp)
"""
import json
import os
import sys

import torch
import triton
from triton.testing import do_bench_cudagraph
sys.path.insert(0, ".")
from lowbit.kernels.quantize import tensor_amax_kernel, default_config, pow2_at_least, sm_count

if not torch.cuda.is_available():
    sys.exit("sweep_amax.py times the kernel on a CUDA GPU; this machine has none")
dev = torch.device("cuda")
sm = sm_count(dev)
out = {}
signs = torch.ones(16, device=dev)
for (R, C) in [(8192, 2048), (8192, 5632), (5632, 2048), (16384, 8192)]:
    x = torch.randn(R, C, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    nbytes = x.numel() * 2
    copy = do_bench_cudagraph(lambda: y.copy_(x), rep=50)
    copy_bw = 2 * nbytes / copy / 1e6   # GB/s, read + write
    tamax = do_bench_cudagraph(lambda: x.abs().amax(), rep=50)
    amax = torch.zeros(1, device=dev, dtype=torch.int32)
    rows = {"copy_ms": copy, "copy_GBs": copy_bw, "torch_abs_amax_ms": tamax}
    d = default_config(R, C, (1, 16))
    configs = [(d.tile_rows if hasattr(d, "tile_rows") else d[0], d[1], d[2], None)]
    for tr, tc in [(32, 128), (64, 128), (32, 256), (64, 256), (16, 512)]:
        for w in (4, 8):
            for it in (1, 4, 16):
                configs.append((tr, tc, w, it))
    best = None
    for tr, tc, w, it in configs:
        n_tc, n_tr = triton.cdiv(C, tc), triton.cdiv(R, tr)
        n = n_tc * n_tr
        iters = it if it is not None else pow2_at_least(triton.cdiv(n, 4 * sm))
        grid = (triton.cdiv(n, iters),)
        for had in (False, True):
            if had and not (it is None or (w == 8 and it == 4)):
                continue
            f = lambda: tensor_amax_kernel[grid](x, amax, signs, R, C, 0, *x.stride(), n_tc, n_tr, n,
                                                  ITERS=iters, TILE_R=tr, TILE_C=tc, NATIVE_CAST=True,
                                                  HADAMARD=had, num_warps=w)
            try:
                amax.zero_(); f(); torch.cuda.synchronize()
                ok = amax.item() == x.float().abs().max().view(torch.int32).item() if not had else None
                ms = do_bench_cudagraph(f, rep=50)
            except Exception as e:
                print("fail", tr, tc, w, it, had, type(e).__name__, str(e)[:100]); continue
            key = f"{tr}x{tc} w{w} it{iters}{' default' if it is None else ''}{' had' if had else ''}"
            rows[key] = {"ms": ms, "read_GBs": nbytes / ms / 1e6, "vs_copy": nbytes / ms / 1e6 / copy_bw, "ok": ok}
            if not had and (best is None or ms < best[1]):
                best = (key, ms)
    print(f"{R}x{C}: copy {copy:.4f} ms ({copy_bw:.0f} GB/s), torch abs.amax {tamax:.4f} ms, best {best}")
    for k, v in rows.items():
        if isinstance(v, dict) and ("default" in k or k.startswith(best[0].split(' ')[0])):
            print("   ", k, {a: (round(b, 4) if isinstance(b, float) else b) for a, b in v.items()})
    srt = sorted(((k, v["ms"]) for k, v in rows.items() if isinstance(v, dict) and "had" not in k), key=lambda kv: kv[1])[:8]
    print("    top:", [(k, round(ms, 4)) for k, ms in srt])
    srt = sorted(((k, v["ms"]) for k, v in rows.items() if isinstance(v, dict) and "had" in k), key=lambda kv: kv[1])[:5]
    print("    top hadamard:", [(k, round(ms, 4)) for k, ms in srt])
    out[f"{R}x{C}"] = rows
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "amax_sweep.json"), "w"), indent=1)
