"""Run metrics: one JSON record per line in metrics.jsonl, mirrored to TensorBoard.

Every record has an "event" ("train", "eval", "diagnostics", "nonfinite_skip") and the
"step" it belongs to (optimizer steps completed). A train record's "loss" is the objective
the optimizer saw (for MoE models it includes the load-balancing term; with QAT's --distill it
is the distillation loss); an eval record's "val_loss" is pure next-token cross-entropy, and
"val_ppl" its exponential. NaN and Inf are written as the strings
"nan", "inf", "-inf" (lowbit.train.checkpoint.strict_json, as in every JSON file lowbit
writes): strict JSON has no spelling for them, and a record that jq or a browser cannot parse
is worse than a string. TensorBoard is optional: without the package
the run logs to metrics.jsonl only and says so once. A failed write (a full disk) is an OSError
naming metrics.jsonl (lowbit.files.naming_errors).
"""

from __future__ import annotations

import json
from pathlib import Path

from lowbit.files import naming_errors, write_text_atomic
from lowbit.train.checkpoint import strict_json

# TensorBoard tag prefix per event; the loss of a train record becomes "train/loss".
_TB_PREFIX = {"train": "train", "eval": "val", "diagnostics": "diag", "nonfinite_skip": "nonfinite"}


class MetricsLog:
    def __init__(self, run_dir: Path, records: list[dict], start_step: int, say) -> None:
        """Continue the log of `run_dir` from `records` (those a checkpoint holds).

        A resumed run rewrites metrics.jsonl with exactly the checkpoint's records, dropping
        what a crashed run logged after its last checkpoint, and tells TensorBoard to purge
        its events past `start_step` for the same reason.
        """
        self.records = list(records)
        self.path = run_dir / "metrics.jsonl"
        write_text_atomic(self.path, "".join(_json_line(r) for r in self.records))
        self._file = open(self.path, "a")
        self._tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            say("note: tensorboard is not installed, logging to metrics.jsonl only "
                "(pip install tensorboard)")
        else:
            self._tb = SummaryWriter(str(run_dir), purge_step=start_step + 1 if records else None)

    def write(self, record: dict) -> None:
        self.records.append(record)
        with naming_errors(self.path):
            self._file.write(_json_line(record))
            self._file.flush()
        if self._tb is not None:
            prefix = _TB_PREFIX.get(record["event"], record["event"])
            for key, value in record.items():
                if key not in ("event", "step") and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{prefix}/{key}", value, record["step"])

    def close(self) -> None:
        try:
            with naming_errors(self.path):
                self._file.close()
        finally:
            if self._tb is not None:
                self._tb.close()


def read_metrics(run_dir: str | Path, warn=None) -> list[dict]:
    """The records of `<run_dir>/metrics.jsonl`. A torn last line (a run killed mid-write) is
    left out, and warn(message) (default: a line on stderr) says so; a bad line elsewhere is a
    ValueError naming the file and the line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl; is it a lowbit run folder?")
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if all(not rest.strip() for rest in lines[number:]):
                (warn or _warn)(f"lowbit: warning: {path}: left out its torn last line "
                                f"{number} (a run killed while writing it)")
                break
            raise ValueError(f"{path}, line {number}, is not a JSON record; the file is "
                             f"damaged (remove or repair that line)") from None
    return records


def _warn(message: str) -> None:
    import sys

    print(message, file=sys.stderr)


def _json_line(record: dict) -> str:
    return json.dumps(strict_json(record), allow_nan=False) + "\n"
