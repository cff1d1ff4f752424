"""Sweep the tiles and warps of the one-chunk fold's two passes (lowbit/kernels/fp8_fold.py) on
the operands stable-fp4-fp8 folds in a 1B model's step (32x32 rceil tiles, x and x^T from the
same passes; dY with stochastic rounding). GPU time from CUDA-graph replay, the bytes the
passes move over that time as a fraction of a device-to-device copy's bandwidth in the same
run, and whether every output (E4M3 bytes, factors, NaN rows) equals the default config's bit
for bit. Chose lowbit.kernels.fp8_fold.fold_configs.

    python benchmarks/sweep_fold.py        # CUDA; writes $OUT/fold_sweep.json (or /tmp)
    python benchmarks/sweep_fold.py dY     # only the operands named dY
    python benchmarks/sweep_fold.py --smoke   # tiny shapes on the CPU (Triton interpreter)
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout
from common import sweep_setup  # noqa: E402

SMOKE, dev, bench = sweep_setup("sweep_fold.py")   # before triton is first imported
import torch  # noqa: E402

from lowbit.formats.spec import QuantSpec  # noqa: E402
from lowbit.kernels import fp8_fold as ff  # noqa: E402
from lowbit.kernels.quantize import TileConfig  # noqa: E402

PASS1 = [(32, 128, 4), (32, 128, 8), (64, 128, 4), (64, 128, 8), (32, 256, 4), (32, 256, 8),
         (64, 256, 8), (128, 128, 8), (128, 256, 8), (128, 256, 16), (64, 512, 8)]
PASS2 = [(32, 128, 4), (32, 128, 8), (32, 64, 4), (64, 64, 4), (64, 64, 8), (64, 128, 4),
         (64, 128, 8), (32, 256, 8), (64, 256, 8), (128, 64, 4), (128, 64, 8), (128, 128, 8),
         (128, 128, 16)]
OPERANDS = [("X", 8192, 2048, False), ("X", 8192, 5504, False), ("W", 5504, 2048, False),
            ("W", 2048, 5504, False), ("dY", 8192, 2048, True), ("dY", 8192, 5504, True)]
if SMOKE:
    PASS1, PASS2 = PASS1[:2], [(32, 64, 4), (64, 64, 4)]
    OPERANDS = [("X", 96, 160, False), ("dY", 64, 256, True)]
SEED = torch.tensor([1234], dtype=torch.int64, device=dev)   # made before any graph capture


def spec_for(sr):
    return QuantSpec.make("mxfp4", (32, 32), "rceil", "stochastic" if sr else "rne")


def fold(x, spec, configs):
    over = torch.zeros(1, dtype=torch.int64, device=dev)
    launch = ff._Launch(x, spec, SEED, None, True, configs)
    return ff._fold_one_chunk(launch, True, True, over), over


def flat(out):
    return [t for op in out[0] for t in (op.fp8.view(torch.uint8), op.factors, op.nan_rows)]


def main():
    results = {}
    only = [a for a in sys.argv[1:] if a != "--smoke"]
    names = sorted({name for name, *_ in OPERANDS})
    if set(only) - set(names):
        sys.exit(f"sweep_fold.py sweeps the operands {', '.join(names)}; got "
                 f"{', '.join(sorted(set(only) - set(names)))}")
    for name, rows, k, sr in OPERANDS:
        if only and name not in only:
            continue
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        spec = spec_for(sr)
        y = torch.empty_like(x)
        copy_ms = bench(lambda: y.copy_(x))
        copy_bw = 4 * x.numel() / copy_ms / 1e6                  # GB/s, read + write
        default = (TileConfig(32, 128, 4),) * 2   # the quantize kernel's tile, both passes
        ref = flat(fold(x, spec, default))
        # bytes: pass 1 reads x; pass 2 reads x and writes x's and x^T's E4M3 bytes
        moved = {1: 2 * x.numel(), 2: 4 * x.numel()}
        row = {"copy_ms": copy_ms, "copy_GBs": copy_bw}

        def timed(configs):
            try:
                got = flat(fold(x, spec, configs))
                same = all(torch.equal(a, b) for a, b in zip(got, ref))
                return bench(lambda: fold(x, spec, configs)), same
            except Exception as e:                       # a tile past the registers, say
                return f"{type(e).__name__}: {str(e)[:80]}", False

        base_ms, _ = timed(default)
        row["default"] = {"configs": [list(c) for c in default], "ms": base_ms}
        best = {}
        for which, grid in ((1, PASS1), (2, PASS2)):
            for cfg in (TileConfig(*c) for c in grid):
                configs = (cfg, default[1]) if which == 1 else (default[0], cfg)
                key = f"pass{which} {cfg[0]}x{cfg[1]} w{cfg[2]}"
                ms, same = timed(configs)
                row[key] = {"ms": ms, "same": same}
                if same and isinstance(ms, float) and (which not in best or ms < best[which][0]):
                    best[which] = (ms, key, cfg)
        cfg1, cfg2 = best[1][2], best[2][2]
        both_ms, same = timed((cfg1, cfg2))
        row["best"] = {"configs": [list(cfg1), list(cfg2)], "ms": both_ms, "same": same}
        print(f"{name} {rows}x{k} {'SR' if sr else 'RNE'}: copy {copy_ms * 1e3:.1f} us "
              f"({copy_bw:.0f} GB/s); default {default} {base_ms * 1e3:.1f} us; best pass 1 "
              f"{best[1][1]} ({best[1][0] * 1e3:.1f} us with default pass 2), best pass 2 "
              f"{best[2][1]} ({best[2][0] * 1e3:.1f} us with default pass 1); both "
              f"{both_ms * 1e3:.1f} us, equal={same}; both passes at copy speed would be "
              f"{(moved[1] + moved[2]) / copy_bw / 1e3:.1f} us")
        results[f"{name} {rows}x{k}"] = row
    name = "fold_sweep" + ("_" + "_".join(only) if only else "") + ".json"
    json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), name), "w"),
              indent=1, default=str)


if __name__ == "__main__":
    main()
