"""What the GPU benchmark scripts share: the timers (lowbit.bench's) and a JSON report under $OUT."""

from __future__ import annotations

import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout
from lowbit.bench import graph_time_ms, time_ms  # noqa: E402  (the scripts import them from here)

__all__ = ["Report", "graph_time_ms", "time_ms"]


class Report(dict):
    """{"meta": ..., section: results}; save() writes $OUT/<name>.json, after every section,
    so a run cut short keeps what it measured."""

    def __init__(self, name: str, device: str, **meta):
        super().__init__()
        self.name = name
        self["meta"] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                        "torch": torch.__version__, "python": platform.python_version(),
                        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), **meta}
        print(json.dumps(self["meta"]), flush=True)

    def save(self) -> None:
        if os.environ.get("OUT"):
            (Path(os.environ["OUT"]) / f"{self.name}.json").write_text(json.dumps(self, indent=1))
