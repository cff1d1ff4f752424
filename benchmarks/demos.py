"""The numbers docs/qat.md and docs/rl.md quote for `lowbit qat` and `lowbit rl` on their
defaults: each command run from an empty folder, its results read from the files it wrote,
into docs/results/demos/demos-<date>.json (tests/test_results.py checks the docs quote them).

    python benchmarks/demos.py --out docs/results/demos [--work DIR]

CPU-sized: a few minutes on a 2-core CPU. The values are seeded, and each command runs with
THREADS CPU threads (OMP_NUM_THREADS, recorded in the file): float sums split over another
number of threads round differently, and over hundreds of steps that moves the third decimal.
So the same values come back on this machine at this thread count; elsewhere, nearby ones. The
wall times are what this machine took.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lowbit.bench import git_commit  # noqa: E402


THREADS = 2   # the CI machine's cores; pinned, since other counts round sums differently


def run(command: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "lowbit", *command, "--no-progress"], cwd=cwd,
                   check=True, env={**os.environ, "PYTHONPATH": str(ROOT),
                                    "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)})
    return time.perf_counter() - started


def qat_demo(work: Path) -> dict:
    seconds = run(["qat"], work)
    (summary_file,) = (work / "runs").glob("qat-*-summary/summary.json")
    summary = json.loads(summary_file.read_text())
    losses = {name.partition(" ")[0]: loss for name, loss in summary["baselines"].items()}
    losses.update({row["estimator"]: row["val_loss"] for row in summary["runs"]})
    return {"command": "lowbit qat", "seconds": round(seconds, 1), "val_loss": losses,
            "quoted_in": "docs/qat.md",
            "quoted": {k: f"{v:.4f}" for k, v in losses.items()}}


def rl_demo(work: Path) -> dict:
    seconds = run(["rl"], work)
    (run_dir,) = (work / "runs").glob("rl-*")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["event"] == "train"]
    evals = [r for r in records if r["event"] == "eval"]
    numbers = {
        "reward_first_10": sum(r["reward"] for r in train[:10]) / len(train[:10]),
        "reward_last_10": sum(r["reward"] for r in train[-10:]) / len(train[-10:]),
        "held_out_first": evals[0]["eval/accuracy"], "held_out_last": evals[-1]["eval/accuracy"],
        "held_out_bf16_first": evals[0].get("eval/accuracy_bf16"),
        "held_out_bf16_last": evals[-1].get("eval/accuracy_bf16"),
        "mean_logprob_gap": sum(r["sampling/sampling_logp_difference/mean"] for r in train)
        / len(train),
    }
    digits = {"mean_logprob_gap": 4}
    return {"command": "lowbit rl", "seconds": round(seconds, 1), "steps": [evals[0]["step"],
            evals[-1]["step"]], **numbers, "quoted_in": "docs/rl.md",
            "quoted": {k: f"{v:.{digits.get(k, 3)}f}" for k, v in numbers.items()
                       if v is not None}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results/demos", help="folder for the JSON")
    parser.add_argument("--work", help="folder to run in (default: a temporary one)")
    parser.add_argument("--machine", default=os.environ.get("LOWBIT_MACHINE", "2-core CPU"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work or scratch)
        work.mkdir(parents=True, exist_ok=True)
        results = {"qat": qat_demo(work), "rl": rl_demo(work)}
    date = datetime.date.today().isoformat()
    meta = {"date": date, "commit": git_commit(), "machine": args.machine,
            "command": "python benchmarks/demos.py --out docs/results/demos", "threads": THREADS}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"demos-{date}.json"
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
