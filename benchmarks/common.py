"""What the GPU benchmark scripts share: the timers (lowbit.bench's) and a JSON report under $OUT."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout
from lowbit.bench import graph_time_ms, time_ms  # noqa: E402  (the scripts import them from here)

__all__ = ["Checks", "Report", "graph_time_ms", "sweep_setup", "time_ms"]


class Checks:
    """Pass/fail tally of a script's bitwise checks: every failure is printed and kept, none
    stops the run."""

    def __init__(self):
        self.passed, self.failed = 0, []

    def run(self, label, fn, *args):
        try:
            fn(*args)
            self.passed += 1
        except Exception as e:  # noqa: BLE001 -- every failure is reported, none stops the run
            self.failed.append((label, f"{type(e).__name__}: {e}"[:300]))
            print(f"  FAIL {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)


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

    def section(self, key: str, run, show=None) -> None:
        """report[key] = run(), saved, then show(report[key]); an exception is printed and the
        script goes on to its next section (what was measured before is already saved)."""
        try:
            self[key] = run()
            self.save()
            if show is not None:
                show(self[key])
        except Exception:  # noqa: BLE001
            traceback.print_exc()

    def finish(self, checks: Checks | None, t0: float) -> None:
        """Print the checks' tally, save the run time, and exit 1 if a check failed."""
        if checks is not None:
            print(f"\nCHECKS: {checks.passed} passed, {len(checks.failed)} failed")
            for label, err in checks.failed:
                print(f"  FAIL {label}: {err}")
        self["meta"]["seconds"] = round(time.time() - t0)
        self.save()
        print(f"total {time.time() - t0:.0f}s"
              + (f"; wrote $OUT/{self.name}.json" if os.environ.get("OUT") else ""))
        sys.exit(1 if checks is not None and checks.failed else 0)


def sweep_setup(script: str):
    """(smoke, device, bench) for a tile sweep. Without --smoke: CUDA, or exit with a line that
    says so; bench(fn) is fn's GPU ms replayed from a CUDA graph. With --smoke: the CPU under
    Triton's interpreter (this must run before triton is first imported), and bench(fn) runs
    fn once and returns 1.0, so the script's checks run and its timings mean nothing."""
    smoke = "--smoke" in sys.argv
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        sys.exit(f"{script} times kernels on a CUDA GPU; this machine has none (--smoke: the CPU "
                 "interpreter on tiny shapes, untimed)")

    def bench(fn) -> float:
        if smoke:
            fn()
            return 1.0
        from triton.testing import do_bench_cudagraph
        return do_bench_cudagraph(fn, rep=50)

    return smoke, torch.device("cpu" if smoke else "cuda"), bench
