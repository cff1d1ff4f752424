"""The RL trainer's pass over a step's completions with each prompt run once for its group
(`lowbit rl --share-prompts`, Transformer's `prompts`) against each completion's whole row
(prompt + completion, the lm_head at the completion positions): forward, token log-probs and
backward, as GRPOLoss runs them, on the CPU. GSM8K's proportions: micro-batches of 32
completions of 128 tokens, 4 prompts of 90-100 tokens sampled 8 times each; a Qwen3-shaped
model shrunk to run on a CPU (4 layers, width 512, 8 query and 4 key-value heads of 64,
q/k norms, vocabulary 4,096), float32. The arms take turns, 5 passes each; the first of each
is left out of the median.

    PYTHONPATH=. python docs/results/rollout/shared-prompts-cpu-2026-12-07.py --out FILE.json"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import torch

from lowbit.models import ModelConfig, build_model
from lowbit.rl import grpo
from lowbit.rl.trainer import completion_logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--passes", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    V = 4096
    cfg = ModelConfig(vocab_size=V, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64,
                      ffn_dim=1536, max_seq_len=512, qk_norm=True)
    model = build_model(cfg)
    Gp, G, Tc = 4, 8, 128
    g = torch.Generator().manual_seed(0)
    prompt_lengths = torch.randint(90, 101, (Gp,), generator=g)
    P = int(prompt_lengths.max())
    prompts = torch.randint(0, V, (Gp, P), generator=g)
    completions = torch.randint(0, V, (Gp * G, Tc), generator=g)
    lengths = prompt_lengths.repeat_interleave(G)
    rows = [torch.cat((prompts[b // G, :lengths[b]], completions[b])) for b in range(Gp * G)]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.int64)
    for b, row in enumerate(rows):
        ids[b, :len(row)] = row
    prompt_ids = prompts.repeat_interleave(G, dim=0)
    arms = {"rows": 0, "shared": G}
    times = {arm: [] for arm in arms}
    logps = {}
    for _ in range(args.passes):
        for arm, group in arms.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            logits = completion_logits(model, ids, lengths, completions, prompt_ids, group)
            logp, _ = grpo.completion_logprobs(logits, completions, 1.0)
            logp.sum().backward()
            times[arm].append(time.perf_counter() - start)
            logps[arm] = logp.detach()
    tokens = {"rows": ids.numel(), "shared": prompts.numel() + completions.numel()}
    results = {arm: {"median_s": statistics.median(t[1:]), "all_s": [round(x, 4) for x in t],
                     "tokens": tokens[arm]} for arm, t in times.items()}
    results["rows_over_shared"] = results["rows"]["median_s"] / results["shared"]["median_s"]
    results["max_abs_logp_difference"] = float((logps["rows"] - logps["shared"]).abs().max())
    results["shape"] = {"prompts": Gp, "group": G, "prompt_lengths": prompt_lengths.tolist(),
                        "completion_len": Tc, "row_len": ids.shape[1], "model": vars(cfg)}
    commit = os.environ.get("LOWBIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": commit,
            "machine": f"{os.cpu_count()}-core CPU ({platform.machine()})",
            "command": f"PYTHONPATH=. python docs/results/rollout/shared-prompts-cpu-2026-12-07.py --out {args.out}"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
    print(json.dumps({k: v for k, v in results.items() if k != "shape"}, default=str))


if __name__ == "__main__":
    main()
