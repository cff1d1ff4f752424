"""Checkpoints that survive a crash, detect damage, and resume a run bit for bit.

A checkpoint is one file, written atomically: the new state goes to a temporary file in the
same folder, is fsynced, then `os.replace`d into place (a rename within one filesystem is
atomic), so a crash at any moment leaves either the old checkpoint or the new one, never a
torn file. It is saved so that `torch.load(weights_only=True)` can read it: no pickled code
runs on load.

Integrity. Each checkpoint holds a SHA-256 of its own contents (every tensor's dtype, shape
and bytes, and every plain value, in order: `content_digest`), checked on every load, so a
flipped byte that still unpickles is refused instead of resuming with changed weights. A
file that does not load at all (truncated, empty, not a checkpoint) is refused with one line
that names it (CheckpointError), never a traceback.

History. `CheckpointStore` keeps a folder of them: `latest.pt` is the newest, and the
`keep - 1` before it stay beside it as `step-<N>.pt`. `load()` takes the newest one that
loads and verifies, and says which ones it skipped and why, so one damaged file costs the
steps since the checkpoint before it, not the run. Temporary files that a killed write left
behind (the size of a whole checkpoint each) are found and removed by `remove_temp_files()`.

Errors of the file system. A write that fails (a full disk, a quota, an I/O error) is an
OSError that names the file it was writing and keeps the errno (ENOSPC ...), never torch's
RuntimeError or an OSError without a path: the temporary file is removed and the previous
file stays as it was. Every file lowbit writes goes through lowbit.files (write_atomic and its
forms), or names its path through lowbit.files.naming_errors (an appended log).

lowbit.train's pretraining loop uses the store through lowbit.train.run_dir; QAT and RL jobs
use the same functions, so every lowbit job's checkpoints give the same guarantees.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import pickle
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lowbit.files import TEMP_NAME, fsync_folder, write_stream_atomic, write_text_atomic

__all__ = ["CHECKPOINT_VERSION", "CheckpointError", "CheckpointStore", "LoadedCheckpoint",
           "checkpoint_path", "save_checkpoint", "load_checkpoint", "content_digest",
           "write_json_atomic", "strict_json", "remove_temp_files",
           "check_same_data", "check_same_start", "rng_state", "set_rng_state", "TEMP_SUFFIX"]

CHECKPOINT_VERSION = 2
"""2: the file holds the SHA-256 of its contents ("sha256"). Version 1 files (no checksum)
still load, unverified."""
_READABLE_VERSIONS = (1, 2)
TEMP_SUFFIX = ".tmp"
"""The suffix of the temporary files atomic writes go through (dot-files: `.<name>.<pid>.<hex>.tmp`)."""
_STEP_NAME = re.compile(r"^step-(\d+)\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable, damaged, of another version, or made
    from other data. The message names the file and says what to do (one line)."""


def checkpoint_path(run_dir: str | Path) -> Path:
    """The newest checkpoint of a run folder: `<run_dir>/checkpoints/latest.pt`."""
    return Path(run_dir) / "checkpoints" / "latest.pt"


def save_checkpoint(state: dict, path: str | Path) -> None:
    """Write `state` (a dict) to `path` atomically (temp file + fsync + os.replace), with the
    SHA-256 of its contents under "sha256"."""
    state = {**state, "sha256": content_digest(state)}
    write_stream_atomic(path, lambda f: torch.save(state, f))


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    """Read and verify a checkpoint; CheckpointError (one line, naming `path`) if it cannot be
    read, is damaged, or is of a version this lowbit does not read."""
    path = Path(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}") from None
    except Exception as e:  # noqa: BLE001 -- zip, pickle, EOF and torch errors alike mean "damaged"
        raise CheckpointError(f"{path} is damaged or not a lowbit checkpoint "
                              f"({_load_failure(path, e)})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a lowbit checkpoint (it holds a "
                              f"{type(state).__name__}, not a dict)")
    version = state.get("version")
    if version not in _READABLE_VERSIONS:
        raise CheckpointError(f"{path} has checkpoint version {version!r}; this lowbit reads "
                              f"versions {', '.join(map(str, _READABLE_VERSIONS))}")
    stored = state.pop("sha256", None)
    if stored is None and version >= 2:
        raise CheckpointError(f"{path} is damaged: its checksum is missing")
    if stored is not None and content_digest(state) != stored:
        raise CheckpointError(f"{path} is damaged: its contents do not match its checksum "
                              f"(a changed or flipped byte)")
    return state


def _load_failure(path: Path, error: Exception) -> str:
    """A short reason for a failed torch.load, without torch's advice to unpickle code."""
    size = path.stat().st_size if path.is_file() else 0
    if size == 0:
        return "the file is empty"
    if isinstance(error, pickle.UnpicklingError) and "weights_only" in str(error):
        return "it holds objects other than tensors and plain values"
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if "central directory" in first or isinstance(error, EOFError):
        return f"truncated: {size:,} bytes, the end is missing"
    return first[:120]


def content_digest(state) -> str:
    """SHA-256 of a checkpoint's contents: every tensor's dtype, shape and bytes, every plain
    value's repr, and the structure around them, in order. Independent of how torch lays the
    file out, so it can be checked after loading."""
    digest = hashlib.sha256()
    _feed(digest, state)
    return digest.hexdigest()


def _feed(digest, value) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, dict):
        digest.update(b"{")
        for key, item in value.items():
            _feed(digest, key)
            _feed(digest, item)
        digest.update(b"}")
    elif isinstance(value, (list, tuple)):
        digest.update(b"[" if isinstance(value, list) else b"(")
        for item in value:
            _feed(digest, item)
        digest.update(b"]")
    else:
        digest.update(f"{type(value).__name__}:{value!r};".encode())


@dataclass
class LoadedCheckpoint:
    state: dict
    """What save_checkpoint was given."""
    path: Path
    """The file it came from."""
    skipped: list[str] = field(default_factory=list)
    """One line per newer checkpoint that could not be used, with the reason."""


class CheckpointStore:
    """A folder of checkpoints: `latest.pt`, the newest, and up to `keep - 1` older ones kept
    as `step-<N>.pt`, so a damaged newest one falls back to the one before.

        store = CheckpointStore(run / "checkpoints", keep=2)
        store.save({"step": 100, ...})        # latest.pt (the previous one -> step-<its step>.pt)
        loaded = store.load()                 # the newest good one; loaded.skipped says why not others
    """

    def __init__(self, folder: str | Path, keep: int = 2) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1 (got {keep!r})")
        self.folder, self.keep = Path(folder), keep
        self._latest_step: int | None = None  # the step latest.pt holds, once known
        self._latest_damaged = False          # load() refused latest.pt: replace it, keep none

    @property
    def latest(self) -> Path:
        return self.folder / "latest.pt"

    def older(self) -> list[tuple[int, Path]]:
        """The kept earlier checkpoints, (step, path), newest first."""
        if not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir()
                 if (m := _STEP_NAME.match(p.name))]
        return sorted(found, reverse=True)

    def files(self) -> list[Path]:
        """Every checkpoint file here (what starting over removes)."""
        return [self.latest, *(p for _, p in self.older())]

    def exists(self) -> bool:
        return self.latest.is_file() or bool(self.older())

    def save(self, state: dict) -> Path:
        """Write `state` (with its "step") as latest.pt; the previous latest.pt becomes
        step-<its step>.pt, and only the keep - 1 newest of those stay.

        Crash-safe at every point: the new file is complete before anything is renamed, and
        between the two renames the previous checkpoint is there under its step name, which
        load() falls back to."""
        step = int(state["step"])
        self.folder.mkdir(parents=True, exist_ok=True)
        previous = self._step_of_latest() if self.keep > 1 else None

        def rotate_then_replace(tmp: Path) -> None:
            if previous is not None and previous < step:
                os.replace(self.latest, self.folder / f"step-{previous:08d}.pt")
            os.replace(tmp, self.latest)

        write_stream_atomic(self.latest,
                            lambda f: torch.save({**state, "sha256": content_digest(state)}, f),
                            replace=rotate_then_replace)
        self._latest_step, self._latest_damaged = step, False
        # older ones past `keep`, and any at or after this step (left by a run that fell back
        # to an earlier checkpoint and has now passed them again)
        older = self.older()
        for s, p in older:
            if s >= step:
                p.unlink(missing_ok=True)
        for _, p in [(s, p) for s, p in older if s < step][self.keep - 1:]:
            p.unlink(missing_ok=True)
        fsync_folder(self.folder)
        return self.latest

    def load(self, map_location: str | torch.device = "cpu") -> LoadedCheckpoint:
        """The newest checkpoint that loads and verifies (latest.pt, then step-<N>.pt from the
        newest). CheckpointError if there is none, naming each file and why it was refused."""
        candidates = ([self.latest] if self.latest.is_file() else []) + [p for _, p in self.older()]
        if not candidates:
            raise CheckpointError(f"no checkpoint in {self.folder}")
        skipped = []
        for path in candidates:
            try:
                state = load_checkpoint(path, map_location)
            except CheckpointError as e:
                skipped.append(str(e))
                continue
            if path == self.latest:
                self._latest_step = int(state["step"])
            else:
                self._latest_damaged = self.latest.is_file()
            return LoadedCheckpoint(state, path, skipped)
        raise CheckpointError(f"no usable checkpoint in {self.folder}: {'; '.join(skipped)}")

    def _step_of_latest(self) -> int | None:
        """The step latest.pt holds, or None if there is none or it is not worth keeping."""
        if not self.latest.is_file() or self._latest_damaged:
            return None
        if self._latest_step is None:
            with contextlib.suppress(Exception):  # unreadable: it is replaced, not kept
                state = torch.load(self.latest, map_location="cpu", weights_only=True, mmap=True)
                self._latest_step = int(state["step"])
        return self._latest_step

    def remove_temp_files(self) -> list[tuple[Path, int]]:
        """Remove the temporary files of interrupted writes here; returns (path, bytes) each."""
        return remove_temp_files(self.folder)


def remove_temp_files(folder: str | Path) -> list[tuple[Path, int]]:
    """Remove the temporary files that atomic writes (lowbit.files: checkpoints, configs)
    killed mid-way left in `folder`; returns (path, bytes) of each. Only names of the form
    those writes use are touched."""
    folder = Path(folder)
    removed = []
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        if TEMP_NAME.match(p.name) and p.is_file():
            size = p.stat().st_size
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed.append((p, size))
    return removed


def check_same_data(saved: str | None, current: str | None, where: str | Path) -> None:
    """Refuse to resume on other data: `saved` is the fingerprint in the checkpoint, `current`
    that of the data the resumed run built (None where the data cannot say)."""
    if saved is None or current is None or saved == current:
        return
    raise CheckpointError(f"cannot resume {where}: its data is not the data the run started "
                          f"with (fingerprint {current[:12]}, the checkpoint's {saved[:12]}); "
                          f"point --data-dir at the original corpus, or start a new run "
                          f"with --run-name")


def check_same_start(saved: str | None, current: str | None, where: str | Path,
                     source: str | None = None) -> None:
    """Refuse to resume a run that started from given weights (JobRecord.init_from: QAT's
    --from or --model) from other weights: `saved` and `current` are the fingerprints of the
    weights it started from and of those given now (None where unknown); `source` is where the
    run's came from. The same weights moved elsewhere resume."""
    if saved is None or current is None or saved == current:
        return
    raise CheckpointError(f"cannot resume {where}: it started from other weights "
                          f"({source or 'its source'}, fingerprint {saved[:12]}; the source given "
                          f"now has {current[:12]}); resume with the --from or --model it started "
                          f"from, or start a new run with --run-name")








def strict_json(value):
    """`value` with every NaN, Inf and -Inf float (at any depth of dicts, lists and tuples)
    written as the string "nan", "inf" or "-inf": strict JSON has no spelling for them, and
    Python's bare `NaN` is a file that jq, browsers and other languages cannot parse.
    `float(text)` reads the strings back. Every JSON file lowbit writes goes through this."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def write_json_atomic(path: str | Path, value, indent: int | None = 2) -> None:
    """`value` as strict JSON (through strict_json), written through lowbit.files."""
    write_text_atomic(path, json.dumps(strict_json(value), indent=indent, allow_nan=False) + "\n")


def rng_state() -> dict:
    """Every generator a training step may draw from, as tensors and plain Python values."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        # numpy's key array is uint32; int64 keeps it loadable with weights_only=True.
        "numpy": {"kind": np_kind, "keys": torch.from_numpy(np_keys.astype(np.int64)),
                  "pos": np_pos, "has_gauss": np_has_gauss, "gauss": np_gauss},
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available():
        if len(state["cuda"]) != torch.cuda.device_count():
            raise ValueError(f"the checkpoint saved {len(state['cuda'])} CUDA RNG states but "
                             f"{torch.cuda.device_count()} GPUs are visible; resume on the same "
                             f"GPU count")
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))


