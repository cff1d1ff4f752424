"""The RL step per rollout mode, as a user runs `lowbit rl` on a Hugging Face model: where the
time goes (generate, score, train, weight sync) and QUADS's step against BF16's.

A random model of a real shape (Qwen3-0.6B's by default; `lowbit.bench.rollout.MODELS`, built
by transformers, saved with a byte-level BPE tokenizer trained on the task's own questions:
nothing is downloaded) is saved as a Hugging Face folder; then one `lowbit rl --model FOLDER`
process per mode runs, one after the other, and each mode's median per-step times (steps
after the first, which captures the CUDA graphs) are tabulated against the bf16 mode's.
`--rounds R` runs the modes in turns R times and takes each mode's ratio to bf16 round by round
(the same round's bf16 run), so a drift of the machine hits every mode alike; the table gives
each time's median over the rounds and the ratios' median and range.

    PYTHONPATH=. python benchmarks/rl_step.py --out rl-step          # one H200: GSM8K, 16 x 8 x 128
    python benchmarks/rl_step.py --smoke --out /tmp/rl-step           # CPU, a tiny shape, a minute

Modes (--modes, each `name=lowbit rl flags`): bf16, nvfp4 (naive W4A4), quads (asymmetric QAT +
RAC 25%), quads+g64 (RAC's channels chosen in groups of 64, --rac-group 64), quads+g64+fold (and
its residual added into the activation, --rac-fold), each NVFP4 one also with --packed-gemm,
and bf16 and the last with the trainer compiled (--compile) or running each prompt once a group
(--share-prompts). Writes --out/rl-step.json ({meta,
results}: each run's medians and every timed step's times) and rl-step.md, and keeps each
run's metrics.jsonl under --out/runs/.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = {
    "bf16": "--rollout bf16 --align none",
    "nvfp4": "--rollout nvfp4 --align none",
    "nvfp4 packed": "--rollout nvfp4 --align none --packed-gemm",
    "quads": "--rollout nvfp4 --align quads",
    "quads packed": "--rollout nvfp4 --align quads --packed-gemm",
    "quads+g64": "--rollout nvfp4 --align quads --rac-group 64",
    "quads+g64 packed": "--rollout nvfp4 --align quads --rac-group 64 --packed-gemm",
    "quads+g64+fold": "--rollout nvfp4 --align quads --rac-group 64 --rac-fold",
    "quads+g64+fold packed": "--rollout nvfp4 --align quads --rac-group 64 --rac-fold --packed-gemm",
    "bf16 compiled": "--rollout bf16 --align none --compile",
    "bf16 shared": "--rollout bf16 --align none --share-prompts",
    "quads+g64+fold packed shared": "--rollout nvfp4 --align quads --rac-group 64 --rac-fold --packed-gemm "
                                    "--share-prompts",
    "quads+g64+fold packed compiled": "--rollout nvfp4 --align quads --rac-group 64 --rac-fold --packed-gemm "
                                      "--compile",
}
TIMES = ("time/generate_s", "time/score_s", "time/train_s", "time/sync_s")


def save_model(name: str, folder: Path, data_dir: str | None, vocab: int) -> Path:
    """A random `name` model (lowbit.bench.rollout.MODELS) with lowbit's byte-level BPE
    (lowbit.data.tokenizer.train_bpe) of `vocab` entries, trained on GSM8K's problems where the
    data has them (lowbit.data.tasks), else on the model's name."""
    import torch

    from lowbit.bench.rollout import hf_config
    from lowbit.data.tasks import get_task
    from lowbit.data.tokenizer import train_bpe

    if (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    config, model_class = hf_config(name)
    torch.manual_seed(0)
    model_class(config).to(torch.bfloat16).save_pretrained(folder)
    try:
        text = "\n".join(p.prompt + p.solution for p in get_task("gsm8k", data_dir=data_dir).train)
    except FileNotFoundError:
        text = name
    train_bpe(text, vocab).tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def run_mode(label: str, flags: str, model: Path, args, runs: Path, round_: int = 0) -> dict:
    """One `lowbit rl` process; its per-step times (medians over the steps after the first)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", label) + (f"-round{round_}" if args.rounds > 1 else "")
    cmd = [sys.executable, "-m", "lowbit", "rl", "--model", str(model), "--task", args.task,
           "--prompts-per-step", str(args.prompts), "--num-generations", str(args.generations),
           "--max-completion-length", str(args.tokens), "--steps", str(args.steps),
           "--eval-every", "0", "--eval-problems", "8", "--checkpoint-every", str(args.steps),
           "--out-dir", str(runs), "--run-name", name, "--overwrite", "--no-progress",
           *shlex.split(flags), *shlex.split(args.extra_flags),
           *(["--data-dir", args.data_dir] if args.data_dir else []),
           *(["--device", "cpu"] if args.smoke else [])]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:   # this mode fails; the others' rows are kept
        shutil.rmtree(runs / name / "checkpoints", ignore_errors=True)
        return {"mode": label, "round": round_, "flags": flags, "returncode": None,
                "wall_s": round(time.perf_counter() - t0, 1), "error": f"stopped after --timeout {args.timeout:g} s"}
    row = {"mode": label, "round": round_, "flags": flags, "returncode": proc.returncode,
           "wall_s": round(time.perf_counter() - t0, 1)}
    # the run's last checkpoint (its weights and optimizer: gigabytes at a real shape) goes, its
    # metrics stay: eight runs of a 0.6B policy filled a 64 GB disk
    shutil.rmtree(runs / name / "checkpoints", ignore_errors=True)
    if proc.returncode != 0:
        row["error"] = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
        return row
    records = [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("event") == "train"][1:]   # the first captures graphs
    row["per_step"] = {}   # every timed step's times, so the raw file shows their spread
    for key in TIMES:
        values = [r[key] for r in steps if isinstance(r.get(key), (int, float))]
        row[key] = statistics.median(values) if values else None
        row["per_step"][key] = values
    row["step_s"] = sum(row[k] or 0.0 for k in TIMES)
    row["steps_timed"] = len(steps)
    row["rollout_tokens_per_s"] = statistics.median(
        [r["rollout/tokens_per_s"] for r in steps if "rollout/tokens_per_s" in r] or [0.0])
    return row


def summarize(rows: list[dict]) -> list[dict]:
    """Per mode (in the order run): each time's median over the rounds that ran, and its step's
    ratio to bf16's of the same round, round by round (none where either failed)."""
    bf16 = {r["round"]: r["step_s"] for r in rows if r["mode"] == "bf16" and "step_s" in r}
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        done = [r for r in rows if r["mode"] == mode and "step_s" in r]
        entry = {"mode": mode, "rounds": len(done),
                 "errors": [r["error"] for r in rows if r["mode"] == mode and "step_s" not in r]}
        if done:
            for key in (*TIMES, "step_s", "rollout_tokens_per_s"):
                values = [r[key] for r in done if r[key] is not None]
                entry[key] = statistics.median(values) if values else None
            entry["vs_bf16"] = [r["step_s"] / bf16[r["round"]] for r in done if r["round"] in bf16]
        out.append(entry)
    return out


def table(rows: list[dict]) -> str:
    lines = ["| mode | generate s | score s | train s | sync s | step s | vs bf16 | rollout tok/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in summarize(rows):
        if not r["rounds"]:
            lines.append(f"| {r['mode']} | failed: {r['errors'][0]} | | | | | | |")
            continue
        ratios = r["vs_bf16"]
        ratio = "-" if not ratios else f"{statistics.median(ratios):.2f}x" + (
            f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else "")
        cells = " | ".join("-" if r[k] is None else f"{r[k]:.3f}" for k in TIMES)
        failed = f", {len(r['errors'])} failed" if r["errors"] else ""
        lines.append(f"| {r['mode']}{failed} | {cells} | {r['step_s']:.3f} | {ratio} | "
                     f"{r['rollout_tokens_per_s']:,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-0.6b", help="a shape of lowbit.bench.rollout.MODELS")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated of: " + ", ".join(MODES))
    p.add_argument("--task", default="gsm8k")
    p.add_argument("--data-dir", default=None, help="folder holding gsm8k/ (default: lowbit's)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4000, help="the BPE tokenizer's entries")
    p.add_argument("--timeout", type=float, default=900, help="seconds per mode")
    p.add_argument("--rounds", type=int, default=1, help="run the modes in turns this many times")
    p.add_argument("--extra-flags", default="", help="lowbit rl flags added to every mode, e.g. "
                   "'--micro-batch-size 32'")
    p.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU (checks the script)")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"unknown --modes {unknown}; use some of {', '.join(MODES)}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1 (got {args.rounds})")
    if args.smoke:
        args.model, args.prompts, args.generations, args.tokens, args.steps = "qwen3-tiny", 2, 2, 8, 2
        args.task, args.vocab = "add", 300
        modes = [m for m in modes if "packed" not in m]      # the packed kernels need a GPU
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = save_model(args.model, out / f"model-{args.model}", args.data_dir, args.vocab)
    rows = []
    for round_ in range(args.rounds):
        for label in modes:
            rows.append(run_mode(label, MODES[label], model, args, out / "runs", round_))
            print(json.dumps(rows[-1]), flush=True)
    import torch

    from lowbit.bench import run_meta
    # the machine in words ("one H100"), its versions, the commit (LOWBIT_COMMIT where the code
    # runs from a copy without its git history)
    meta = {**run_meta("cuda" if torch.cuda.is_available() else "cpu"),
            "command": "python benchmarks/rl_step.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    (out / "rl-step.json").write_text(json.dumps({"meta": meta, "results": {
        "model": args.model, "task": args.task, "prompts": args.prompts,
        "generations": args.generations, "tokens": args.tokens, "steps": args.steps,
        "extra_flags": args.extra_flags, "rounds": args.rounds,
        "rows": rows, "summary": summarize(rows)}}, indent=1) + "\n")
    (out / "rl-step.md").write_text(table(rows))
    print(table(rows), end="")
    return 0 if all(r["returncode"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
