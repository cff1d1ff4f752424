"""The decode-attention kernel with shared prompt rows against the prompt copied into every row:
128 rows in groups of 8 sharing a prompt, Qwen3-0.6B's attention shape (16 query heads, 8 KV
heads of 128), bf16; the same output checked bit for bit, then each timed from a CUDA graph.
Run: PYTHONPATH=. python docs/results/rollout/decode-attention-shared-prompt-h100-2026-12-07.py"""
import torch
from triton.testing import do_bench_cudagraph

from lowbit.kernels.decode_attention import decode_attention

torch.manual_seed(0)
B, H, KV, D, L = 128, 16, 8, 128, 256
for plen, gen in ((66, 64), (66, 128), (200, 64)):
    qkv = torch.randn(B, (H + 2 * KV) * D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, KV, max(L, plen + gen + 1), D, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
    Lc = k.shape[2]
    cos = torch.randn(Lc, D, device="cuda", dtype=torch.bfloat16); sin = torch.randn_like(cos)
    pos = torch.full((B,), plen + gen, device="cuda")
    rows = (torch.arange(B, device="cuda") // 8) * 8
    lens = torch.full((B,), plen, device="cuda")
    a = decode_attention(qkv, k.clone(), v.clone(), pos, cos, sin, H, KV)
    k2, v2 = k.clone(), v.clone(); k2[:, :, :plen] = k[rows, :, :plen]; v2[:, :, :plen] = v[rows, :, :plen]
    want = decode_attention(qkv, k2.clone(), v2.clone(), pos, cos, sin, H, KV)
    got = decode_attention(qkv, k.clone(), v.clone(), pos, cos, sin, H, KV, prefix_rows=rows, prefix_lens=lens)
    assert torch.equal(got, want)
    t_copy = do_bench_cudagraph(lambda: decode_attention(qkv, k2, v2, pos, cos, sin, H, KV), rep=50)
    t_pref = do_bench_cudagraph(lambda: decode_attention(qkv, k, v, pos, cos, sin, H, KV, prefix_rows=rows, prefix_lens=lens), rep=50)
    print(f"prompt {plen} + {gen}: copies {t_copy*1000:.1f} us, shared {t_pref*1000:.1f} us, {t_copy/t_pref:.2f}x", flush=True)
