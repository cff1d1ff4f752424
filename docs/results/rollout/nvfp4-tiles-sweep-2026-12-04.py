"""Prototype W4A16 NVFP4 GEMM on the GPU: correctness and speed vs cuBLAS bf16.

    python docs/results/rollout/nvfp4-tiles-sweep-2026-12-04.py --out DIR   # writes DIR/proto-gemm.json
"""
import argparse, json, os, sys, time
import torch
sys.path.insert(0, os.path.dirname(__file__))
import importlib; proto = importlib.import_module("nvfp4-tiles-prototype-2026-12-04")
from lowbit.formats import QuantSpec, quantize_with_spec
from lowbit.formats.linear_weight import LinearWeight

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", metavar="DIR", required=True, help="folder for proto-gemm.json")
OUT = parser.parse_args().out
os.makedirs(OUT, exist_ok=True)
dev = "cuda"
torch.manual_seed(0)
results = {"correct": [], "timing": []}

def make(N, K):
    w = torch.randn(N, K, device=dev) * 0.02
    lw = LinearWeight.from_qtensors([quantize_with_spec(w, QuantSpec.make("nvfp4", (1, 16)))], torch.bfloat16)
    words, s = proto.relayout(lw.data, lw.block_scales)
    return lw, words, s

def reference(x, lw, words, s, N, K):
    vals = (proto.emulate_decode(words.cpu(), s.cpu())[:N, :K].double() * 128 * lw.row_scales.cpu().double()[:, None])
    return (x.cpu().double() @ vals.T)

# bandwidth of a copy
big = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device=dev)
dst = torch.empty_like(big)
for _ in range(3): dst.copy_(big)
torch.cuda.synchronize()
e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
e0.record()
for _ in range(10): dst.copy_(big)
e1.record(); torch.cuda.synchronize()
copy_bw = 2 * big.numel() * 2 * 10 / (e0.elapsed_time(e1) / 1e3)
results["copy_GBps"] = copy_bw / 1e9
print(f"copy {copy_bw/1e9:.0f} GB/s", flush=True)
del big, dst

# correctness on odd shapes, every config
cfgs = [dict(BLOCK_N=bn, BLOCK_M=bm, SPLIT_K=sk, num_warps=nw, num_stages=st)
        for bn in (64, 128) for bm in (16, 32, 64) for sk in (1, 2, 4) for nw in (4, 8) for st in (3, 4)
        if not (bn == 64 and nw == 8)]
N, K = 200, 1000 
lw, words, s = make(N, K)
for M in (1, 5, 33):
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    ref = reference(x, lw, words, s, N, K)
    for cfg in cfgs:
        T = words.shape[1] // 16
        if T % cfg["SPLIT_K"]:
            continue
        try:
            y = proto.gemm(x, words, s, lw.row_scales, N, K, **cfg)
            err = ((y.cpu().double() - ref).abs() / (ref.abs() + 1e-3)).max().item()
        except Exception as e:
            err = repr(e)[:200]
        results["correct"].append({"M": M, **cfg, "max_rel": err})
bad = [r for r in results["correct"] if not isinstance(r["max_rel"], float) or r["max_rel"] > 1e-2]
print("correctness:", len(results["correct"]), "runs,", len(bad), "bad", bad[:5], flush=True)
# plus dequantize-then-gemm agreement (the old contract) at bf16 tolerance
x = torch.randn(4, K, device=dev, dtype=torch.bfloat16)
y = proto.gemm(x, words, s, lw.row_scales, N, K)
y_old = x @ lw.dequantize().T
print("vs dequantize-then-gemm: max abs", (y.float() - y_old.float()).abs().max().item(), "max ref", y_old.float().abs().max().item(), flush=True)

shapes = {"1.1b qkv": (2560, 2048), "1.1b o": (2048, 2048), "1.1b gate|up": (11264, 2048), "1.1b down": (2048, 5632),
          "0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate|up": (6144, 1024), "0.6b down": (1024, 3072),
          "8b gate|up": (28672, 4096), "8b down": (4096, 14336)}

def graph_time(fns, reps=3):
    """fns: list of callables; capture them all in one graph, time a replay; us per call."""
    s_ = torch.cuda.Stream()
    s_.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s_):
        for f in fns: f()
    torch.cuda.current_stream().wait_stream(s_)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns: f()
    g.replay(); torch.cuda.synchronize()
    best = 1e9
    for _ in range(reps):
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) * 1e3 / len(fns))
    return best

t_start = time.time()
for name, (N, K) in shapes.items():
    copies = max(2, int(300e6 // (N * K * 2)) + 1)
    dense = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
    packed = []
    for _ in range(copies):
        lw, words, s = make(N, K)
        packed.append((words, s, lw.row_scales))
    for M in (1, 8, 16, 32, 64, 128):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        t_cublas = graph_time([lambda W=W: x @ W.T for W in dense] * 2)
        row = {"shape": name, "N": N, "K": K, "M": M, "cublas_us": t_cublas, "configs": {}}
        T = packed[0][0].shape[1] // 16
        for cfg in cfgs:
            if T % cfg["SPLIT_K"] or cfg["BLOCK_M"] > max(16, M) * 2 or (M >= 64 and cfg["BLOCK_M"] < 32):
                continue
            key = "{BLOCK_N}x{BLOCK_M} sk{SPLIT_K} w{num_warps} s{num_stages}".format(**cfg)
            try:
                t = graph_time([lambda p=p: proto.gemm(x, p[0], p[1], p[2], N, K, **cfg) for p in packed] * 2)
            except Exception:
                t = None
            row["configs"][key] = t
        ok = {k: v for k, v in row["configs"].items() if v}
        best = min(ok, key=ok.get) if ok else None
        row["best"] = best
        nbytes = N * K * 0.5625
        if best:
            print(f"{name:14} M={M:3} cublas {t_cublas:7.1f} us  nvfp4 best {ok[best]:7.1f} us ({best}) "
                  f"= {t_cublas / ok[best]:.2f}x, {nbytes / ok[best] / 1e3:.0f} GB/s", flush=True)
        results["timing"].append(row)
        json.dump(results, open(f"{OUT}/proto-gemm.json", "w"))
    del dense, packed
    if time.time() - t_start > 420:
        print("time limit: stopping shapes", flush=True)
        break
json.dump(results, open(f"{OUT}/proto-gemm.json", "w"))
