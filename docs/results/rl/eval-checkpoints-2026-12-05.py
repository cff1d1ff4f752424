"""Every run's kept checkpoints (and the shared warm start, step 0) scored by the same four engines
on the run's held-out set: bf16, NVFP4 weights with bf16 activations (W4A16: the numerics of
asymmetric QAT's trainer), naive W4A4, and W4A4 with RAC 25% (QUADS's rollouts). Greedy, the
same problems for every run. Usage (CPU):

    python eval-checkpoints-2026-12-05.py OUT.json WARM_START_CHECKPOINT RUN_DIR...
"""
import json
import sys
import time
from pathlib import Path

import torch

from lowbit.data.tasks import get_task
from lowbit.rl.config import RLConfig
from lowbit.rl.engine import RolloutEngine
from lowbit.rl.warmstart import greedy_accuracy, policy_config, policy_tokenizer
from lowbit.train.checkpoint import load_checkpoint

EVALUATORS = {"bf16": ("bf16", 0.0), "w4a16": ("nvfp4-w4a16", 0.0), "w4a4": ("nvfp4", 0.0),
              "w4a4+rac0.25": ("nvfp4", 0.25)}
torch.set_num_threads(1)
out, ws, runs = Path(sys.argv[1]), Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]]
first = json.loads((runs[0] / "config.json").read_text())
fields = set(RLConfig.__dataclass_fields__)
c = RLConfig(**{k: v for k, v in first.items() if k in fields})
task = get_task(c.task, digits=c.task_size)
eval_set = task.eval_problems(c.eval_problems)
cfg = policy_config(c, task)
tokenizer, stop_ids = policy_tokenizer(c)
engines = {name: RolloutEngine(cfg, prec, rac, device="cpu", max_batch_size=256)
           for name, (prec, rac) in EVALUATORS.items()}


def score(state):
    acc = {}
    for name, engine in engines.items():
        engine.load_state_dict(state)
        acc[name] = greedy_accuracy(engine, task, tokenizer, eval_set, c.max_completion_length, stop_ids)
    return acc


results = {}
t0 = time.time()
results["step0 (shared warm start)"] = {"checkpoint": ws.parent.parent.name,
                                        "accuracy": score(load_checkpoint(ws)["model"])}
print("step0", results["step0 (shared warm start)"], f"{time.time() - t0:.0f}s", flush=True)
for run in runs:   # every checkpoint the run kept (steps 200 and 300 of a 300-step run)
    results[run.name] = {}
    for path in sorted((run / "checkpoints").glob("*.pt")):
        ck = load_checkpoint(path)
        results[run.name][str(ck.get("step"))] = score(ck["model"])
    print(run.name, results[run.name], f"{time.time() - t0:.0f}s", flush=True)
out.write_text(json.dumps(results, indent=1) + "\n")
