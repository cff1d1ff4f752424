"""The training step with torch's fused AdamW and clip, then lowbit's AdamW with the clip inside,
on the same model in one process, blocks in turns (lowbit bench train's --interleave)."""
import json, sys
import torch
import lowbit.train.build as build
from lowbit.bench.train import bench_train

model = sys.argv[1]; out = sys.argv[2]
extra = dict(seq_len=1024, batch_size=8) if model != "tiny" else dict(seq_len=64, batch_size=2)
if model == "1b":
    extra = dict(seq_len=2048, batch_size=4)
real = build.build_optimizer
made = []

def patched(net, config, device, sharded=False):
    opt = real(net, config, device, sharded)
    if len(made) % 2 == 0 and isinstance(opt, build.dispatch.AdamW):   # the first unit: torch's
        opt = torch.optim.AdamW(build.param_groups(net, config.weight_decay), lr=config.lr,
                                betas=config.betas, fused=True)
    made.append(type(opt).__module__ + "." + type(opt).__name__)
    return opt

build.build_optimizer = patched
cuda = torch.cuda.is_available()
rows = bench_train(model, ("bf16", "bf16"), steps=6 if cuda else 2, warmup=3 if cuda else 1,
                   compile=cuda, cuda_graph=cuda, interleave=3 if cuda else 1, **extra)
for r, m in zip(rows, made):
    r["optimizer"] = m
print(json.dumps([{k: v for k, v in r.items() if k in ("optimizer", "ms", "block_ms", "tokens_per_s", "mfu", "median_ms", "step_ms")} for r in rows], indent=1))
json.dump({"made": made, "rows": rows}, open(out, "w"), indent=1, default=str)
