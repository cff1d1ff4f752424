"""A weight sync (RolloutEngine.sync of a float32 state dict on the same GPU), QUADS's engine
(nvfp4, RAC 25% in groups of 64 folded, packed GEMM): every run of fused projections and an
MoE layer's experts quantized in one pass (dispatch.quantize_rows, this code) against one
quantize a part (the same function patched to go run by run), in turns; the bits compared."""
import json, statistics, sys, time
import torch
import lowbit.dispatch as dq  # precision.py calls dispatch.quantize_rows: patch the package's name
from lowbit.bench.rollout import hf_config
from lowbit.models.hf import config_from_hf
from lowbit.rl.engine import RolloutEngine

import os
SMOKE = os.environ.get("SMOKE") == "1"   # a 1-layer CPU smoke run of the script itself
dev = torch.device("cpu" if SMOKE else "cuda")
if SMOKE:
    torch.cuda.synchronize = lambda: None
out = {}
real = dq.quantize_rows
def per_run(x, spec, rows):
    calls[0] += 1
    return [dq.quantize_with_spec(r, spec) for r in x.detach().split(list(rows))]
calls = [0]
for model in sys.argv[1:]:
    tc, cls = hf_config(model)
    if SMOKE:
        tc.num_hidden_layers, tc.vocab_size = 1, 512
    config = config_from_hf(tc.to_dict(), model)
    torch.manual_seed(0)
    with torch.device(dev):
        hf = cls(tc).float().eval()
    state = hf.state_dict()
    engine = RolloutEngine(config, "nvfp4", 0.25, dev, max_batch_size=8, max_seq_len=256, packed_gemm=True,
                           rac_group=64, rac_fold=True)
    engine.sync(state)
    times = {"one pass": [], "a part at a time": []}
    for rep in range(4):
        for label, fn in (("one pass", real), ("a part at a time", per_run)):
            dq.quantize_rows = fn
            torch.cuda.synchronize(); t = time.perf_counter()
            engine.sync(state)
            torch.cuda.synchronize(); times[label].append(time.perf_counter() - t)
    # the bits: a sync each way, every stored tensor compared
    dq.quantize_rows = real
    engine.sync(state); a = [t.clone() for t in engine.weights._parts() if isinstance(t, torch.Tensor)]
    from lowbit.formats.linear_weight import LinearWeight
    la = [[x.clone() for x in (w.data, w.block_scales, w.row_scales) if x is not None] for w in engine.weights._linear_weights()]
    dq.quantize_rows = per_run
    engine.sync(state)
    lb = [[x.clone() for x in (w.data, w.block_scales, w.row_scales) if x is not None] for w in engine.weights._linear_weights()]
    dq.quantize_rows = real
    out.setdefault('per_run_calls', {})[model] = calls[0]
    same = all(torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x, y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y) for p, q in zip(la, lb) for x, y in zip(p, q))
    out[model] = {k: {"median_s": statistics.median(v), "all_s": v} for k, v in times.items()}
    out[model]["same_bits"] = same
    print(model, json.dumps(out[model]), flush=True)
    del engine, hf, state
    torch.cuda.empty_cache()
import os
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "sync-ab.json"), "w"), indent=1)
