"""The host cost of QUADS's asymmetric QAT layer against F.linear: a 28-layer model with
matrices so small (width 32) that the time is the layers' Python and dispatch, forward and
backward, in float32 on the CPU, with the weight cache on (lowbit.nn.reuse_weight_operands, as
lowbit rl trains). Eager, and with each decoder layer compiled (Transformer.compile_layers, as
lowbit rl --compile): the weight-only layer's GEMMs traced on the quantized weight that
reuse_weight_operands' hook hands it once an update (lowbit.ops.gemms.weight_only_linear),
or, arm `qat-op-pair`, through the forward/backward custom-op pair every other emulated recipe
compiles to, which quantizes the weight at every forward. Prints and writes each arm's median
step in three rounds (the arms in turns) and the extra per linear call against F.linear's.

Two raw files: qat-host-overhead-operand-cpu-2026-12-08.json (this script as it is), and
qat-host-overhead-cpu-2026-12-08.json from its form at commit 18b5314, where the compiled
weight-only layer quantized its weight itself at every forward (one custom op) and traced its
GEMMs; to reproduce that one, run the script at that commit.

    PYTHONPATH=. python docs/results/rollout/qat-host-overhead-cpu-2026-12-08.py --out FILE.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from unittest import mock

import torch

from lowbit.bench import run_meta
from lowbit.models.config import ModelConfig
from lowbit.models.transformer import Transformer
from lowbit.nn import reuse_weight_operands
from lowbit.recipes import LinearRecipe
from lowbit.rl.trainer_side import apply_asymmetric_qat

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=28, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64,
                  max_seq_len=64, qk_norm=True)
LINEARS = 7 * CFG.n_layers   # q, k, v, o, gate, up, down
ARMS = ("linear", "qat", "linear-compiled", "qat-compiled", "qat-op-pair-compiled")


def step_times(arm: str, steps: int) -> list[float]:
    """Seconds of each forward and backward after three warm-up ones (compiling in the first)."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = Transformer(CFG)
    if arm.startswith("qat"):
        apply_asymmetric_qat(model)
    if arm.endswith("compiled"):
        model.compile_layers(dynamic=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    idx = torch.randint(0, CFG.vocab_size, (2, 16))
    times = []
    # the op pair: the weight-only path turned off, as every other emulated recipe compiles
    pair = (mock.patch.object(LinearRecipe, "weight_only", property(lambda self: False))
            if "op-pair" in arm else contextlib.nullcontext())
    with pair, reuse_weight_operands(model, opt):
        for _ in range(3 + steps):
            t = time.perf_counter()
            model(idx, targets=idx).loss.backward()
            times.append(time.perf_counter() - t)
    return times[3:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    rounds = [{arm: statistics.median(step_times(arm, args.steps)) for arm in ARMS} for _ in range(3)]
    extra_us = {arm: [(r[arm] - r["linear-compiled" if arm.endswith("compiled") else "linear"]) / LINEARS * 1e6
                      for r in rounds] for arm in ARMS if arm.startswith("qat")}
    result = {"rounds_s": rounds, "linears_per_forward": LINEARS, "extra_us_per_linear_call": extra_us,
              "extra_us_median": {arm: statistics.median(v) for arm, v in extra_us.items()}}
    script = "docs/results/rollout/qat-host-overhead-cpu-2026-12-08.py"
    meta = {**run_meta("cpu"), "command": f"PYTHONPATH=. python {script} --out FILE.json --steps {args.steps}"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": result}, f, indent=1)
    print(json.dumps(result["extra_us_median"]))


if __name__ == "__main__":
    main()
