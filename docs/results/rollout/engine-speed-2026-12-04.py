"""The script that measured engine-speed-llama-1.1b-2026-12-04.json (one H200, 2026-12-04):
the rollout engine's decode steps/s per precision mode and batch on TinyLlama-1.1B's shape.
The code is as it ran; `lowbit bench rollout` now measures the same quantities and more.

    PYTHONPATH=. python docs/results/rollout/engine-speed-2026-12-04.py OUT.json [MODES] [BATCHES]
"""
import json, sys, time, statistics
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from lowbit.models.hf import config_from_hf
from lowbit.rl.engine import RolloutEngine
from lowbit.rl.sampling import SamplingParams

out = sys.argv[1]
modes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["bf16", "nvfp4-w4a16", "fp8", "nvfp4", "nvfp4+rac"]
batches = [int(b) for b in (sys.argv[3].split(",") if len(sys.argv) > 3 else "1,8,32,128".split(","))]
P, N = 128, 128
shape = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=False)
torch.manual_seed(0)
with torch.device("cuda"):
    hf = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16)
cfg = config_from_hf({**hf.config.to_dict(), "architectures": ["LlamaForCausalLM"]}, "llama-1.1b")
sd = hf.state_dict()
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(10): y.copy_(x)
torch.cuda.synchronize(); bw = 2 * (1 << 30) * 10 / (time.perf_counter() - t)
del x, y
print(f"copy bandwidth {bw/1e12:.2f} TB/s", flush=True)
rows = []
def timed(fn, reps=3):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    return statistics.median(ts)
g = torch.Generator().manual_seed(0)
for mode in modes:
    prec, rac = ("nvfp4", 0.25) if mode == "nvfp4+rac" else (mode, 0.0)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine = RolloutEngine(cfg, prec, rac, "cuda", max_batch_size=max(batches), max_seq_len=P + N)
    engine.load_state_dict(sd)
    torch.cuda.synchronize()
    t_load = time.perf_counter() - t0
    wbytes = engine.weight_bytes() + engine.weights.lm_head.numel() * 2
    kvtok = engine.cache.bytes_per_token()
    for B in batches:
        prompts = torch.randint(0, 32000, (B, P), generator=g).tolist()
        full = SamplingParams(max_new_tokens=N, seed=0); one = SamplingParams(max_new_tokens=1, seed=0)
        t0 = time.perf_counter(); engine.generate(prompts, full); torch.cuda.synchronize(); first = time.perf_counter() - t0
        tf = timed(lambda: engine.generate(prompts, full)); t1 = timed(lambda: engine.generate(prompts, one))
        steps = (N - 1) / (tf - t1)
        step_bytes = wbytes + B * (P + (N - 1) / 2) * kvtok
        row = dict(mode=mode, batch=B, steps_per_s=steps, tokens_per_s=B * N / tf, prefill_s=t1,
                   of_limit=steps * step_bytes / bw, weight_bytes=wbytes, first_call_s=first,
                   load_s=t_load, note=engine.graph_note)
        rows.append(row)
        print(f"{mode:12} B={B:4}: {steps:8.1f} steps/s  {B*N/tf:9.0f} tok/s  {row['of_limit']:.0%} of limit  "
              f"prefill {t1*1e3:.1f} ms  first {first:.1f}s  weights {wbytes/1e9:.3f} GB", flush=True)
        json.dump({"bandwidth": bw, "rows": rows}, open(out, "w"), indent=1)
    print(f"   {mode}: peak memory {torch.cuda.max_memory_allocated()/1e9:.2f} GB, load {t_load:.1f}s", flush=True)
    del engine; torch.cuda.empty_cache()
