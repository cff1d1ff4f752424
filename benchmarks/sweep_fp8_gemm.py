"""The FP8 GEMMs of stable-fp4-fp8's 1B step (o, gate/up and down projections; fprop, dgrad and
wgrad) through torch._scaled_mm: row-wise factors (what lowbit runs) against one scale per
tensor, each with and without use_fast_accum, and bf16 torch.mm, in GPU time (CUDA-graph
replay); and the error of the row-wise GEMM with bf16 output against an fp64 GEMM of the same
E4M3 values, with and without fast accumulation (bf16 mm's error of the same values shown
beside). Random E4M3 operands with power-of-two row factors over 2^+-4.

    python benchmarks/sweep_fp8_gemm.py    # CUDA; writes $OUT/fp8_gemm_sweep.json (or /tmp)
"""
import json
import os
import sys

import torch
from triton.testing import do_bench_cudagraph

if not torch.cuda.is_available():
    sys.exit("sweep_fp8_gemm.py times GEMMs on a CUDA GPU; this machine has none")
dev = torch.device("cuda")
D, F, T = 2048, 5504, 8192          # model dim, MLP hidden, tokens (batch 4 x 2048)
# (name, M, N, K): out (M, N) = A (M, K) @ B (N, K)^T
GEMMS = [("o fprop", T, D, D), ("o dgrad", T, D, D), ("o wgrad", D, D, T),
         ("gate/up fprop", T, F, D), ("gate/up dgrad", T, D, F), ("gate/up wgrad", F, D, T),
         ("down fprop", T, D, F), ("down dgrad", T, F, D), ("down wgrad", D, F, T)]


def operand(rows, k):
    codes = torch.randint(0, 256, (rows, k), device=dev, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38          # no NaN codes
    fp8 = codes.view(torch.float8_e4m3fn)
    factors = torch.exp2(torch.randint(-4, 5, (rows,), device=dev).float())
    return fp8, factors


def rel_err(c, ref):
    return ((c.double() - ref).norm() / ref.norm()).item()


def main():
    results = {}
    one = torch.ones((), device=dev)
    print(f"{'gemm':14} {'M':>5} {'N':>5} {'K':>5}  bf16 mm us | row-wise us (x bf16), fast | "
          "tensor-wise us, fast | rel err bf16-out: row-wise, fast, bf16 mm")
    for name, m, n, k in GEMMS:
        a8, sa = operand(m, k)
        b8, sb = operand(n, k)
        a16 = (a8.float() * sa[:, None]).bfloat16()
        b16 = (b8.float() * sb[:, None]).bfloat16()
        sa2, sb2 = sa[:, None].contiguous(), sb[None, :].contiguous()
        fns = {
            "bf16_mm": lambda: torch.mm(a16, b16.t()),
            "rowwise": lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa2, scale_b=sb2,
                                                out_dtype=torch.bfloat16),
            "rowwise_fast": lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa2, scale_b=sb2,
                                                     out_dtype=torch.bfloat16, use_fast_accum=True),
            "tensorwise": lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                   out_dtype=torch.bfloat16),
            "tensorwise_fast": lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                        out_dtype=torch.bfloat16,
                                                        use_fast_accum=True),
        }
        row = {"M": m, "N": n, "K": k}
        for key, f in fns.items():
            row[f"{key}_us"] = do_bench_cudagraph(f, rep=100) * 1e3
        ref = (a8.double() * sa[:, None].double()) @ (b8.double() * sb[:, None].double()).t()
        row["err_rowwise"] = rel_err(fns["rowwise"](), ref)
        row["err_rowwise_fast"] = rel_err(fns["rowwise_fast"](), ref)
        row["err_bf16_mm"] = rel_err(fns["bf16_mm"](), ref)
        b = row["bf16_mm_us"]
        print(f"{name:14} {m:5} {n:5} {k:5}  {b:7.1f} | {row['rowwise_us']:6.1f} "
              f"({b / row['rowwise_us']:.2f}x), {row['rowwise_fast_us']:6.1f} "
              f"({b / row['rowwise_fast_us']:.2f}x) | {row['tensorwise_us']:6.1f}, "
              f"{row['tensorwise_fast_us']:6.1f} | {row['err_rowwise']:.2e}, "
              f"{row['err_rowwise_fast']:.2e}, {row['err_bf16_mm']:.2e}")
        results[name] = row
    total = {key: sum(r[f"{key}_us"] for r in results.values()) for key in
             ("bf16_mm", "rowwise", "rowwise_fast", "tensorwise", "tensorwise_fast")}
    print("sum over the nine GEMMs (us): " + ", ".join(f"{k} {v:.0f}" for k, v in total.items()))
    path = os.path.join(os.environ.get("OUT", "/tmp"), "fp8_gemm_sweep.json")
    json.dump(results, open(path, "w"), indent=1)


if __name__ == "__main__":
    main()
