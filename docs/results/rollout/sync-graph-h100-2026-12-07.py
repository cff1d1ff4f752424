"""RolloutEngine.sync of a float32 state dict on the same GPU, the same tensors each time (a
trainer's parameters, stepped in place between syncs): eager (cuda_graph=False) against captured
(the second sync captured, later ones replayed), in turns; the bits compared; the graph pool's memory."""
import json, os, statistics, sys, time
import torch
from lowbit.bench.rollout import hf_config
from lowbit.models.hf import config_from_hf
from lowbit.rl.engine import RolloutEngine

SMOKE = os.environ.get("SMOKE") == "1"
dev = torch.device("cpu" if SMOKE else "cuda")
if SMOKE:
    torch.cuda.synchronize = lambda: None
    torch.cuda.memory_reserved = lambda: 0
    torch.cuda.empty_cache = lambda: None
out = {}
modes = {"bf16": dict(precision="bf16"),
         "quads+g64+fold packed": dict(precision="nvfp4", rac_ratio=0.25, packed_gemm=True, rac_group=64, rac_fold=True),
         "nvfp4 packed": dict(precision="nvfp4", packed_gemm=True)}
for model in sys.argv[1:]:
    tc, cls = hf_config(model)
    if SMOKE:
        tc.num_hidden_layers, tc.vocab_size = 1, 512
    config = config_from_hf(tc.to_dict(), model)
    torch.manual_seed(0)
    with torch.device(dev):
        hf = cls(tc).float().eval()
    params = list(hf.parameters())
    for mode, kw in modes.items():
        engines = {label: RolloutEngine(config, max_batch_size=8, max_seq_len=256, device=dev, cuda_graph=g and not SMOKE, **kw)
                   for label, g in (("eager", False), ("captured", True))}
        for e in engines.values():
            e.sync(hf.state_dict())
            e.generate([[1, 2, 3]], __import__("lowbit.rl.sampling", fromlist=["SamplingParams"]).SamplingParams(max_new_tokens=2, seed=0))
        reserved0 = torch.cuda.memory_reserved()
        times = {k: [] for k in engines}
        for rep in range(6):
            with torch.no_grad():
                for p in params:
                    p.mul_(1.0001)
            for label, e in engines.items():
                torch.cuda.synchronize(); t = time.perf_counter()
                e.sync(hf.state_dict())
                torch.cuda.synchronize(); times[label].append(time.perf_counter() - t)
            if rep == 1:
                reserved1 = torch.cuda.memory_reserved()
        a, b = engines["eager"].weights, engines["captured"].weights
        same = all(torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
                   for x, y in zip([t for t in a._parts() if isinstance(t, torch.Tensor)] +
                                   [u for w in a._linear_weights() for u in (w.data, w.block_scales, w.row_scales) if u is not None],
                                   [t for t in b._parts() if isinstance(t, torch.Tensor)] +
                                   [u for w in b._linear_weights() for u in (w.data, w.block_scales, w.row_scales) if u is not None]))
        row = {k: {"median_s": statistics.median(v[2:]), "all_s": v} for k, v in times.items()}
        row.update(same_bits=same, replayed=b.replayed_syncs, graph_off=b.sync_graph_off,
                   reserved_growth_mib=(reserved1 - reserved0) / 2**20)
        out[f"{model} {mode}"] = row
        print(model, mode, json.dumps(row), flush=True)
        del engines, a, b
        torch.cuda.empty_cache()
    del hf, params
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "sync-graph-ab.json"), "w"), indent=1)
