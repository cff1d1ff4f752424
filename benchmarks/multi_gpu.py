"""What a second GPU buys: `lowbit bench train` on one process and on N processes under
torchrun (DDP and FSDP2), every recipe, in one go on one machine, with the scaling table.

    PYTHONPATH=. python benchmarks/multi_gpu.py --out DIR                # 2 GPUs: 1B model, sequence 2048
    PYTHONPATH=. python benchmarks/multi_gpu.py --out DIR --profile      # and where the 2-GPU step goes
    PYTHONPATH=. python benchmarks/multi_gpu.py --out DIR --smoke        # 2 CPU processes (gloo), tiny

Weak scaling, as data parallelism is used: every process trains --batch-size rows a step, so
the N-process job's global batch is N times the one-process batch (each run's --batch-size
is the global one, as `lowbit bench train` takes it under torchrun). Per recipe:
- tokens/s of the whole job, and the scaling: N-process tokens/s over one-process tokens/s
  (ideal N);
- the peak memory of the largest process (one GPU's), and its ratio to one process's: FSDP2
  shards parameters, gradients and AdamW state, DDP replicates them;
- with --profile, the N-process step's NCCL time and the part of it that no compute kernel
  overlaps (lowbit.bench.timing.exposed), rank 0's.
The one-process run is the same `lowbit bench train` without torchrun (no DDP wrapper).

Writes DIR/bench-1.json, DIR/bench-<mode>-<N>.json (each command's rows), DIR/results.json
({meta, results}: the date, commit, machine and this command, and the table's rows) and
DIR/summary.md (the table); prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the JSON and summary.md")
    p.add_argument("--gpus", type=int, default=2, help="processes of the multi-process runs (default: 2)")
    p.add_argument("--model", default="1b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4, help="rows per process per step (default: 4)")
    p.add_argument("--recipes", default="bf16,stable-fp4-fp8,nvfp4")
    p.add_argument("--modes", default="ddp,fsdp", help="comma-separated: ddp, fsdp (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torch.compile the model in every run")
    p.add_argument("--profile", action="store_true", help="profile one more step of every multi-process run")
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeout-min", type=float, default=9.0, help="per command (default: %(default)s)")
    p.add_argument("--smoke", action="store_true",
                   help="2 CPU processes (gloo), the tiny model, 2 steps: checks the pipeline")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.model, args.seq_len, args.batch_size, args.steps, args.warmup = "tiny", 32, 2, 2, 1
        args.device, args.gpus, args.recipes = "cpu", 2, "bf16,stable-fp4"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("ddp", "fsdp")]
    if bad or not modes:
        print(f"multi_gpu.py: error: --modes takes ddp and/or fsdp (got {args.modes!r})", file=sys.stderr)
        return 2
    if args.gpus < 2 or args.batch_size < 1 or args.steps < 1:
        print("multi_gpu.py: error: --gpus must be >= 2, --batch-size and --steps >= 1", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"multi_gpu.py: error: --out {out} is a file, not a folder", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    common = ["--model", args.model, "--seq-len", str(args.seq_len), "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--recipes", args.recipes, "--device", args.device]
    if args.compile:
        common.append("--compile")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    runs = [("1", 1, [sys.executable, "-m", "lowbit.cli"], [])]
    for mode in modes:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", str(args.gpus), "-m", "lowbit.cli"]
        runs.append((f"{mode}-{args.gpus}", args.gpus, launcher,
                     ["--parallel", mode] + (["--profile"] if args.profile else [])))
    results: dict[str, list[dict]] = {}
    for label, n, launcher, extra in runs:
        path = out / f"bench-{label}.json"
        command = [*launcher, "bench", "train", *common, "--batch-size", str(args.batch_size * n),
                   *extra, "--json", str(path)]
        print(f"== {' '.join(command[1:])}", flush=True)
        t0 = time.perf_counter()
        done = _run(command, env, args.timeout_min * 60)
        if done is None:
            print(f"   stopped after {args.timeout_min} min", flush=True)
            continue
        print(done.stdout[-4000:], end="", flush=True)
        if done.returncode != 0 or not path.is_file():
            print(f"   failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}", flush=True)
            continue
        print(f"   {time.perf_counter() - t0:.0f} s", flush=True)
        results[label] = json.loads(path.read_text())

    from lowbit.bench import git_commit

    rows = scaling_rows(results, args.gpus, modes)
    table = format_table(rows, args)
    (out / "summary.md").write_text(table)
    meta = {"date": date.today().isoformat(), "commit": git_commit(), "machine": _machine(args),
            "command": "python benchmarks/multi_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")
    print(table, end="")
    return 0 if len(results) == len(runs) else 1


def _run(command: list[str], env: dict, timeout_s: float) -> subprocess.CompletedProcess | None:
    """The command's result, or None when it ran past timeout_s. Then torchrun gets SIGTERM
    first, which it passes on to its workers (they run in sessions of their own, so killing
    torchrun alone would leave them holding the GPUs), and SIGKILL 60 s later if need be."""
    proc = subprocess.Popen(command, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        return None
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def scaling_rows(results: dict[str, list[dict]], gpus: int, modes: list[str]) -> list[dict]:
    """One row per recipe and run: tokens/s, step time, peak memory, and the ratios to the
    same recipe's one-process run."""
    single = {r["recipe"]: r for r in results.get("1", [])}
    rows = []
    for label in ["1"] + [f"{m}-{gpus}" for m in modes]:
        for r in results.get(label, []):
            one = single.get(r["recipe"])
            row = {"recipe": r["recipe"], "processes": r.get("world_size", 1),
                   "parallel": r.get("parallel") or "-", "step_ms": r["step_ms"],
                   "tokens_per_s": r["tokens_per_s"], "peak_mem_gib": r.get("peak_mem_gib"),
                   "scaling": r["tokens_per_s"] / one["tokens_per_s"] if one else None,
                   "mem_vs_one": (r["peak_mem_gib"] / one["peak_mem_gib"]
                                  if one and r.get("peak_mem_gib") and one.get("peak_mem_gib") else None)}
            profile = r.get("profile")
            if profile:
                row["communication_ms"] = profile.get("communication_ms")
                row["communication_exposed_ms"] = profile.get("communication_exposed_ms")
                row["profiled_step_ms"] = profile.get("wall_ms")
            rows.append(row)
    return rows


def format_table(rows: list[dict], args) -> str:
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [f"`lowbit bench train --model {args.model} --seq-len {args.seq_len}`, {args.batch_size} "
             f"rows per process per step, median of {args.steps} steps after {args.warmup}; "
             f"scaling = tokens/s over the same recipe's one-process tokens/s (ideal {args.gpus}).", "",
             "| recipe | processes | parallel | ms/step | tokens/s | scaling | peak GiB per process | memory vs 1 |"
             + (" NCCL ms | not overlapped ms |" if args.profile else ""),
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if args.profile else "")]
    for r in rows:
        line = (f"| {r['recipe']} | {r['processes']} | {r['parallel']} | {r['step_ms']:.1f} | "
                f"{r['tokens_per_s']:,.0f} | {num(r['scaling'], '.2f')}{'x' if r['scaling'] else ''} | "
                f"{num(r['peak_mem_gib'], '.2f')} | {num(r['mem_vs_one'], '.2f')} |")
        if args.profile:
            line += f" {num(r.get('communication_ms'), '.2f')} | {num(r.get('communication_exposed_ms'), '.2f')} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _machine(args) -> str:
    if args.device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"{os.cpu_count()}-core CPU, {args.gpus} processes (gloo)"


if __name__ == "__main__":
    sys.exit(main())
