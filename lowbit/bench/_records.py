"""What a benchmark's results file records: its rows as JSON (`write_json`, with `--json PATH`
checked before the benchmark runs) and, beside them, the run's date, machine, versions,
command (`run_meta`) and commit (`git_commit`)."""

from __future__ import annotations

import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

__all__ = ["check_json_path", "write_json", "git_commit", "run_meta"]


def check_json_path(path: str | None) -> None:
    """Refuse a --json PATH that cannot be written: a folder, or below a file."""
    if not path:
        return
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"--json {path} is a folder; give a file name, e.g. {target / 'bench.json'}")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"--json {path}: {parent} is a file, not a folder")
            break


def write_json(path: str | None, rows) -> None:
    """--json PATH: the rows as JSON (the folder is made if need be)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(rows, indent=1, default=str) + "\n")


def git_commit() -> str:
    """The checkout's short commit, or "unknown" outside a git checkout: what a results file
    names as the code that ran. LOWBIT_COMMIT, where set, names it instead (a copy of the code
    run on a machine without its git history, e.g. an exported snapshot)."""
    import os
    import subprocess

    if os.environ.get("LOWBIT_COMMIT"):
        return os.environ["LOWBIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out or "unknown"


def machine_words(device: str) -> str:
    """The machine in a reader's words ("one H200", "2 H100s": the GPUs the job runs on, one
    per process under torchrun; "2-core CPU"); LOWBIT_MACHINE, where set, instead."""
    import os
    import re

    import torch

    if os.environ.get("LOWBIT_MACHINE"):
        return os.environ["LOWBIT_MACHINE"]
    if device == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        short = re.search(r"\b([A-Z]\d{2,4})\b", name)
        name = short[1] if short else name
        dist = torch.distributed
        count = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return f"one {name}" if count == 1 else f"{count} {name}s"
    return f"{os.cpu_count()}-core CPU"


def run_meta(device: str) -> dict:
    """What a results file records beside its numbers: date (YYYY-MM-DD, as docs/results
    files carry it) and time (UTC), commit, machine, versions, command."""
    import torch

    now = datetime.now(timezone.utc)
    meta = {"date": now.date().isoformat(), "time": now.isoformat(timespec="seconds"),
            "commit": git_commit(), "machine": machine_words(device),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:])}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta
