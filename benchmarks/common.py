"""What the GPU benchmark scripts share: a median timer and a JSON report under $OUT."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch


def time_ms(fn, device: str) -> float:
    """Median milliseconds of fn() (triton.testing.do_bench, L2 flushed) on CUDA; on the CPU
    (--smoke runs, which test the scripts, not the speed) one wall-clock call after a warm-up."""
    if device != "cuda":
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_time_ms(fn, device: str) -> float | None:
    """Median milliseconds of fn() replayed from a CUDA graph: the GPU's time alone, without the
    Python and launch overhead that time_ms includes when the GPU outruns the host. None on the
    CPU or when fn cannot be captured (it syncs with the host, say)."""
    if device != "cuda":
        return None
    from triton.testing import do_bench_cudagraph
    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as e:  # noqa: BLE001
        print(f"   (no CUDA-graph timing: {type(e).__name__}: {str(e)[:100]})", flush=True)
        torch.cuda.synchronize()
        return None


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
