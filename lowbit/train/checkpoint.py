"""Checkpoints that survive a crash and resume a run bit for bit.

A checkpoint is one file, `<run>/checkpoints/latest.pt`, replaced atomically: the new state
is written to a temporary file in the same folder, fsynced, then `os.replace`d over the old
one (a rename within one filesystem is atomic), so a crash at any moment leaves either the
old checkpoint or the new one, never a torn file. It holds everything the next step depends
on: weights, AdamW moments, the step (which is also the LR schedule's position, since the
schedule is a pure function of it), every RNG the loop or the model may draw from, the
config, and the metrics so far (so a resumed run's metrics.jsonl can be cut back to the
checkpoint's step). It is saved so that `torch.load(weights_only=True)` can read it: no
pickled code runs on load.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
from pathlib import Path

import numpy as np
import torch

CHECKPOINT_VERSION = 1


def checkpoint_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints" / "latest.pt"


def save_checkpoint(state: dict, path: str | Path) -> None:
    """Write `state` to `path` atomically (temp file + fsync + os.replace)."""
    _write_atomic(Path(path), "wb", lambda f: torch.save(state, f))


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    state = torch.load(path, map_location=map_location, weights_only=True)
    version = state.get("version")
    if version != CHECKPOINT_VERSION:
        raise ValueError(f"{path} has checkpoint version {version}; this lowbit reads "
                         f"version {CHECKPOINT_VERSION}")
    return state


def write_text_atomic(path: str | Path, text: str) -> None:
    """Small files (config.json, final.json, a cut-back metrics.jsonl) get the same guarantee."""
    _write_atomic(Path(path), "w", lambda f: f.write(text))


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


def _write_atomic(path: Path, mode: str, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same folder as the target, so os.replace is a rename on one filesystem; opened with "x"
    # rather than through tempfile.mkstemp so the file gets the umask's permissions, not 0600.
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, mode.replace("w", "x")) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    # The rename itself lives in the directory entry; without this a power loss right after
    # os.replace could bring back the old name. Not all platforms can open a directory.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
