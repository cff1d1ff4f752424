"""Sweep the quantize kernel's tile and warps on the operands the nvfp4 recipe fake-quantizes in
a 1B model's step (1x16 two-level NVFP4: X and dY along features, dY with stochastic
rounding; the wgrad operands X^T and dY^T, transposed views, rotated by the fused random
Hadamard transform), and the tensor-amax pass's tile, warps and tiles per program on the
rotated operands. GPU time from CUDA-graph replay against a device-to-device copy of the same
tensor in the same run, and whether the output equals the default config's bit for bit.
Chose lowbit.kernels.quantize's nvfp4 configs.

    python benchmarks/sweep_nvfp4.py [--rotated] [--amax]   # CUDA; writes $OUT/nvfp4_sweep.json
    (--rotated: only the wgrad operands; --amax: also sweep the tensor-amax pass on them;
    --smoke: tiny shapes on the CPU under the Triton interpreter, untimed)
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout
from common import sweep_setup  # noqa: E402

SMOKE, dev, bench = sweep_setup("sweep_nvfp4.py")   # before triton is first imported
import torch  # noqa: E402
import triton  # noqa: E402

from lowbit.formats.spec import QuantSpec  # noqa: E402
from lowbit.kernels import _seed_tensor  # noqa: E402
from lowbit.kernels import quantize as kq  # noqa: E402
from lowbit.kernels.hadamard import fake_quantize_rht_rows  # noqa: E402

CONFIGS = [(32, 128, 4), (16, 128, 4), (32, 128, 8), (64, 128, 8), (32, 64, 4), (64, 64, 4),
           (16, 256, 4), (32, 256, 8), (64, 256, 8), (128, 64, 8), (8, 512, 4), (16, 512, 8)]
# lowbit.kernels.hadamard's row-group kernel: (groups of 16 rows, columns, warps)
RHT_ROWS = [(g, f, w) for g in (1, 2, 4) for f in (128, 256, 512) for w in (4, 8)]
AMAX = [(tr, tc, w, it) for tr, tc in [(16, 128), (32, 128), (64, 128), (32, 256), (64, 64),
                                       (128, 64), (16, 256)]
        for w in (4, 8) for it in (1, 2, 4)]
# (name, rows, features, stochastic, rotated): rotated operands are (features, rows) views of
# a (rows, features) tensor, as the wgrad operands are
OPERANDS = [("X", 8192, 2048, False, False), ("X", 8192, 5504, False, False),
            ("dY", 8192, 2048, True, False), ("dY", 8192, 5504, True, False),
            ("X^T rht", 8192, 2048, False, True), ("X^T rht", 8192, 5504, False, True),
            ("dY^T rht", 8192, 2048, True, True), ("dY^T rht", 8192, 5504, True, True)]
if SMOKE:
    CONFIGS, RHT_ROWS, AMAX = CONFIGS[:2], [(1, 32, 4), (2, 64, 4)], AMAX[:2]
    OPERANDS = [("dY", 64, 96, True, False), ("dY^T rht", 64, 96, True, True)]


def main():
    results = {}
    signs = (torch.randint(0, 2, (16,), device=dev) * 2 - 1).float()
    seed = _seed_tensor(1234, None, dev)
    only_rotated = "--rotated" in sys.argv
    for name, rows, feats, sr, rotated in OPERANDS:
        if only_rotated and not rotated:
            continue
        spec = QuantSpec.make("nvfp4", (1, 16), None, "stochastic" if sr else "rne")
        base = torch.randn(rows, feats, device=dev, dtype=torch.bfloat16)
        x = base.mT if rotated else base
        x3 = x.reshape(1, -1, x.shape[-1])
        had = signs if rotated else None
        y = torch.empty_like(base)
        copy_ms = bench(lambda: y.copy_(base))
        copy_bw = 4 * base.numel() / copy_ms / 1e6

        def run(cfg):
            return kq.launch(x3, spec, seed=seed if sr else None, codes=False, values=True,
                             transpose=False, config=cfg, hadamard=had)["values"]

        default = kq.default_config(x3.shape[1], x3.shape[2], spec.block)
        ref = run(default)
        row = {"copy_ms": copy_ms, "copy_GBs": copy_bw}
        for cfg in [default] + [c for c in CONFIGS if c != tuple(default)]:
            cfg = kq.TileConfig(*cfg)
            try:
                same = torch.equal(run(cfg).view(torch.int16), ref.view(torch.int16))
                ms = bench(lambda: run(cfg))
            except Exception as e:
                row[str(tuple(cfg))] = f"{type(e).__name__}: {str(e)[:80]}"
                continue
            row[str(tuple(cfg))] = {"ms": ms, "same": same, "default": cfg == default}
        ok = sorted((v["ms"], k) for k, v in row.items() if isinstance(v, dict) and v.get("same"))
        print(f"{name} {rows}x{feats}{' SR' if sr else ''}: copy {copy_ms * 1e3:.1f} us; "
              f"default {tuple(default)} {row[str(tuple(default))]['ms'] * 1e3:.1f} us; best "
              + ", ".join(f"{k} {ms * 1e3:.1f} us" for ms, k in ok[:4])
              + f"; amax pass + quantize pass at copy speed "
              f"{(2 + 4) * base.numel() / copy_bw / 1e3:.1f} us")
        if rotated:   # the row-group kernel on the untransposed tensor: the same values
            timings = {}
            for cfg in RHT_ROWS:
                def f():
                    return fake_quantize_rht_rows(base, spec, signs, seed if sr else None,
                                                  config=cfg)
                try:
                    want = ref[0].mT.contiguous().view(torch.int16)
                    same = torch.equal(f().view(torch.int16), want)
                    timings[str(cfg)] = {"ms": bench(f), "same": same}
                except Exception as e:
                    timings[str(cfg)] = f"{type(e).__name__}: {str(e)[:80]}"
            row["rht_rows"] = timings
            top = sorted((v["ms"], k) for k, v in timings.items()
                         if isinstance(v, dict) and v["same"])
            print("    row-group kernel (G, TILE_F, warps), both passes: best "
                  + ", ".join(f"{k} {ms * 1e3:.1f} us" for ms, k in top[:4])
                  + f"; {sum(1 for v in timings.values() if isinstance(v, dict) and v['same'])}"
                  f"/{len(timings)} configs equal the transposed-view kernel")
        if rotated and "--amax" in sys.argv:   # the tensor-amax pass alone, over the rotated groups
            amax = torch.zeros(1, device=dev, dtype=torch.int32)
            R, C = x3.shape[1], x3.shape[2]
            ref_amax = None
            timings = {}
            for tr, tc, w, it in AMAX:
                n_tc, n_tr = triton.cdiv(C, tc), triton.cdiv(R, tr)
                n = n_tc * n_tr
                grid = (triton.cdiv(n, it),)

                def f():
                    kq.tensor_amax_kernel[grid](x3, amax, signs, R, C, *x3.stride(), n_tc, n_tr,
                                                 n, ITERS=it, TILE_R=tr, TILE_C=tc,
                                                 NATIVE_CAST=True, HADAMARD=True, num_warps=w)
                try:
                    amax.zero_()
                    f()
                    value = amax.item()
                    ref_amax = value if ref_amax is None else ref_amax
                    timings[f"{tr}x{tc} w{w} it{it}"] = {"ms": bench(f),
                                                         "same": value == ref_amax}
                except Exception as e:
                    timings[f"{tr}x{tc} w{w} it{it}"] = f"{type(e).__name__}: {str(e)[:80]}"
            cfg_r, cfg_c, cfg_w, cfg_it = kq.amax_config(R, C, 1, default, True, kq.sm_count(dev))
            row["amax"] = timings
            top = sorted((v["ms"], k) for k, v in timings.items()
                         if isinstance(v, dict) and v["same"])
            default_ms = timings.get(f"{cfg_r}x{cfg_c} w{cfg_w} it{cfg_it}", {})
            default_ms = default_ms.get("ms", float("nan")) if isinstance(default_ms, dict) else float("nan")
            print(f"    rotated amax: default {cfg_r}x{cfg_c} w{cfg_w} it{cfg_it} "
                  f"{default_ms * 1e3:.1f} us; "
                  f"read at copy speed {2 * base.numel() / copy_bw / 1e3:.1f} us; best "
                  + ", ".join(f"{k} {ms * 1e3:.1f} us" for ms, k in top[:4]))
        results[f"{name} {rows}x{feats}"] = row
    json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "nvfp4_sweep.json"), "w"),
              indent=1, default=str)


if __name__ == "__main__":
    main()
