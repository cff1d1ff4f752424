"""RolloutEngine.sync of a random model's float32 state dict on the same GPU, two A/Bs:

    python docs/results/rollout/sync-h100-2026-12-07.py one-pass --out DIR qwen3-0.6b qwen3-moe-1b
    python docs/results/rollout/sync-h100-2026-12-07.py graph --out DIR qwen3-0.6b qwen3-moe-1b

one-pass: QUADS's engine (nvfp4, RAC 25% in groups of 64 folded, packed GEMM), every run of fused
projections and an MoE layer's experts quantized in one pass (lowbit.dispatch.quantize_rows)
against a part at a time (the same function patched to go run by run), four syncs each way in
turns; the linear weights' stored bits after a sync each way compared. Writes DIR/sync-ab.json.

graph: the same tensors at every sync (the parameters scaled in place between rounds, as a
trainer steps them), an eager engine (cuda_graph=False) against a captured one (the first sync
after the load captured, later ones replayed) in each of three modes, six rounds in turns, each
engine having decoded once (so a sync also re-lays the tiles); the stored bits compared, the
reserved memory's growth over the first two rounds. Writes DIR/sync-graph-ab.json.

SMOKE=1 runs a one-layer model on the CPU, to check the script itself (no capture there)."""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import lowbit.dispatch as dispatch   # precision.py calls dispatch.quantize_rows: patched by name
from lowbit.bench.rollout import hf_config
from lowbit.models.hf import config_from_hf
from lowbit.rl.engine import RolloutEngine
from lowbit.rl.sampling import SamplingParams

SMOKE = os.environ.get("SMOKE") == "1"
DEV = torch.device("cpu" if SMOKE else "cuda")
GRAPH_MODES = {"bf16": dict(precision="bf16"),
               "quads+g64+fold packed": dict(precision="nvfp4", rac_ratio=0.25, packed_gemm=True,
                                             rac_group=64, rac_fold=True),
               "nvfp4 packed": dict(precision="nvfp4", packed_gemm=True)}


def sync_timed(engine, state) -> float:
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    engine.sync(state)
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def random_model(name: str):
    """(lowbit's config, the transformers model, seeded, float32, on DEV) of a MODELS shape."""
    tc, cls = hf_config(name)
    if SMOKE:
        tc.num_hidden_layers, tc.vocab_size = 1, 512
    torch.manual_seed(0)
    with torch.device(DEV):
        hf = cls(tc).float().eval()
    return config_from_hf(tc.to_dict(), name), hf


def linear_tensors(weights) -> list[torch.Tensor]:
    """The linear weights' codes, block scales and row scales, in order."""
    return [u for w in weights._linear_weights() for u in (w.data, w.block_scales, w.row_scales) if u is not None]


def stored(weights) -> list[torch.Tensor]:
    """Every tensor an engine's weights hold, the linear weights' included."""
    return [t for t in weights._parts() if isinstance(t, torch.Tensor)] + linear_tensors(weights)


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
                                    for x, y in zip(a, b))


def one_pass(models: list[str]) -> dict:
    out, calls = {"per_run_calls": {}}, [0]
    real = dispatch.quantize_rows

    def per_run(x, spec, rows):
        calls[0] += 1
        return [dispatch.quantize_with_spec(r, spec) for r in x.detach().split(list(rows))]

    for name in models:
        config, hf = random_model(name)
        state = hf.state_dict()
        engine = RolloutEngine(config, "nvfp4", 0.25, DEV, max_batch_size=8, max_seq_len=256, packed_gemm=True,
                               rac_group=64, rac_fold=True)
        engine.sync(state)
        times = {"one pass": [], "a part at a time": []}
        try:
            for _ in range(4):
                for label, fn in (("one pass", real), ("a part at a time", per_run)):
                    dispatch.quantize_rows = fn
                    times[label].append(sync_timed(engine, state))
            dispatch.quantize_rows = real
            engine.sync(state)
            want = [t.clone() for t in linear_tensors(engine.weights)]
            dispatch.quantize_rows = per_run
            engine.sync(state)
        finally:
            dispatch.quantize_rows = real
        out["per_run_calls"][name] = calls[0]
        out[name] = {k: {"median_s": statistics.median(v), "all_s": v} for k, v in times.items()}
        out[name]["same_bits"] = same_bits(want, linear_tensors(engine.weights))
        print(name, json.dumps(out[name]), flush=True)
        del engine, hf, state
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    return out


def graph(models: list[str]) -> dict:
    out = {}
    reserved = torch.cuda.memory_reserved if DEV.type == "cuda" else (lambda: 0)
    for name in models:
        config, hf = random_model(name)
        params = list(hf.parameters())
        for mode, kw in GRAPH_MODES.items():
            engines = {label: RolloutEngine(config, max_batch_size=8, max_seq_len=256, device=DEV,
                                            cuda_graph=captured and not SMOKE, **kw)
                       for label, captured in (("eager", False), ("captured", True))}
            for e in engines.values():
                e.sync(hf.state_dict())
                e.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=0))
            reserved0 = reserved()
            times = {k: [] for k in engines}
            for rep in range(6):
                with torch.no_grad():
                    for p in params:
                        p.mul_(1.0001)
                for label, e in engines.items():
                    times[label].append(sync_timed(e, hf.state_dict()))
                if rep == 1:
                    reserved1 = reserved()
            a, b = engines["eager"].weights, engines["captured"].weights
            row = {k: {"median_s": statistics.median(v[2:]), "all_s": v} for k, v in times.items()}
            row.update(same_bits=same_bits(stored(a), stored(b)), replayed=b.replayed_syncs,
                       graph_off=b.sync_graph_off, reserved_growth_mib=(reserved1 - reserved0) / 2**20)
            out[f"{name} {mode}"] = row
            print(name, mode, json.dumps(row), flush=True)
            del engines, a, b
            if DEV.type == "cuda":
                torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ab", choices=("one-pass", "graph"))
    p.add_argument("--out", required=True, help="folder for the JSON")
    p.add_argument("models", nargs="+", help="shapes of lowbit.bench.rollout.MODELS")
    args = p.parse_args()
    result = (one_pass if args.ab == "one-pass" else graph)(args.models)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "sync-ab.json" if args.ab == "one-pass" else "sync-graph-ab.json"
    (out / name).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
