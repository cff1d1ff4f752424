"""How long torch.compile takes on a Qwen3-0.6B-shaped model (28 layers), the whole model
compiled (what `lowbit rl --compile` did before 2026-12-07) against each decoder layer compiled
with dynamic shapes (Transformer.compile_layers(dynamic=True), what it does now): the wall time
of each forward and backward pass (loss = cross-entropy on random tokens) at three sequence
lengths in turn, as RL's steps change length, with torch's compile caches off so every arm
compiles from nothing. Each arm runs in its own process.

    PYTHONPATH=. python docs/results/rollout/compile-time-2026-12-07.py --out FILE.json

On the CPU the passes run in float32 (the compiler writes C++); on CUDA under bf16 autocast
(Triton)."""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ARMS = ("eager", "whole-model", "layers-dynamic")
LENGTHS = (96, 130, 160)


def run_arm(arm: str, batch: int) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from lowbit.bench.rollout import hf_config
    from lowbit.models import build_model
    from lowbit.models.hf import config_from_hf

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    hf, _ = hf_config("qwen3-0.6b")
    cfg = config_from_hf(hf.to_dict(), "qwen3-0.6b")
    model = build_model(cfg).to(device)
    forward = model
    if arm == "whole-model":
        forward = torch.compile(model)
    elif arm == "layers-dynamic":
        model.compile_layers(dynamic=True)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    passes = []
    for T in LENGTHS:
        idx = torch.randint(0, cfg.vocab_size, (batch, T), device=device,
                            generator=torch.Generator(device).manual_seed(T))
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast:
            loss = forward(idx, targets=idx).loss
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        passes.append({"seq_len": T, "seconds": round(time.perf_counter() - start, 2), "loss": loss.item()})
    return {"arm": arm, "device": device, "batch": batch, "layers": cfg.n_layers, "passes": passes,
            "graphs": counters["stats"]["unique_graphs"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)   # one arm, in this process
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.batch)))
        return
    env = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    results = []
    for arm in ARMS:
        out = subprocess.run([sys.executable, __file__, "--out", args.out, "--batch", str(args.batch),
                              "--arm", arm], env=env, capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(results[-1], flush=True)
    commit = os.environ.get("LOWBIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": commit,
            "machine": os.environ.get("LOWBIT_MACHINE", f"{os.cpu_count()}-core CPU ({platform.machine()})"),
            "command": f"PYTHONPATH=. python docs/results/rollout/compile-time-2026-12-07.py --out {args.out}"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
