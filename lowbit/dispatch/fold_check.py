"""Per-thread state of the FP8 folds: deferred fold checks and chunked-fold watches.

A deferred fold check (`deferred_fold_check(device)`) lets the fused Triton folds of a
training step run without host syncs: each operand is folded with one power-of-two factor
per row, and the values that leaves inexact are counted on the device, in the check's
counter, instead of being read back and re-folded in K-chunks. Whoever opened the check reads
the count once (with the step's loss) and redoes the step outside it if it is nonzero.
A watch (`watch_chunked_folds()`) collects the names of the layers whose exact folds needed
K-chunks (lowbit.train moves them off the FP8 path under --fold-inexact adapt).

Both are per thread: a fold on another thread (an evaluation, a rollout) stays exact and
unwatched. Autograd runs CUDA backward passes on its own threads, so the quantized linear's
forward takes the check and watch in force and hands them to its backward explicitly.
lowbit.dispatch.quantize_fold is the one place that reads them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["ACTIVE", "FoldCheck", "deferred_fold_check", "active_fold_check", "resolve_check",
           "watch_chunked_folds", "active_watch", "folding_for", "note_chunks",
           "canonical_device"]


class FoldCheck:
    """The device-side count of values that folds under deferred_fold_check() could not keep
    exact (nonzero values in a block below its row's window: the row spans more than
    WINDOW_SPAN binades). Nonzero means the work done under the check used inexact operands and
    is to be redone outside it (lowbit.train redoes the step). int64, so a step's count cannot
    wrap."""

    def __init__(self, device: torch.device):
        self.device = canonical_device(device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.open = True   # once its block has closed, folds handed this check fold exactly
        # opened inside a CUDA graph capture: the graph zeroes and fills this counter at each
        # replay, so the folds it records count here (lowbit.ops.compiled checks this)
        self.captured = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def inexact_values(self) -> int:
        """The count so far (reads it back: one host sync on CUDA)."""
        return int(self.counter.item())


# The check and watch in force, per thread (see the module doc); a backward that runs after
# its forward's check has closed folds exactly.
_LOCAL = threading.local()
ACTIVE = "active"   # quantize_fold(check=ACTIVE): the calling thread's check, if any


def canonical_device(device) -> torch.device:
    """`device` with its index: "cuda" is the current CUDA device (checks are per device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@contextlib.contextmanager
def deferred_fold_check(device) -> Iterator[FoldCheck]:
    """Fold without host syncs inside this block (on this thread, for tensors on `device`).

    The fused kernels fold every operand with one factor per row (one K-chunk) and count, on
    the device, the values that this leaves inexact, instead of reading a count back per
    operand and re-folding in K-chunks. Check `inexact_values()` once afterwards (e.g. with the
    step's loss) and redo the work outside the block if it is nonzero: then every GEMM is
    exact, as outside the block. The reference path (CPU) is always exact and never counts.
    A check opened inside another one on the same device adds its count to the outer one's
    when it closes (a device op, no sync)."""
    outer = getattr(_LOCAL, "check", None)
    _LOCAL.check = check = FoldCheck(device)
    try:
        yield check
    finally:
        _LOCAL.check = outer
        check.open = False
        if outer is not None and outer.device == check.device:
            outer.counter += check.counter


def active_fold_check(device: torch.device) -> FoldCheck | None:
    """The deferred_fold_check() in force on this thread for tensors on `device`, if any."""
    return _for_device(getattr(_LOCAL, "check", None), device)


def _for_device(check: FoldCheck | None, device) -> FoldCheck | None:
    return (check if check is not None and check.open and check.device == canonical_device(device)
            else None)


def resolve_check(check, device) -> FoldCheck | None:
    """`check` as quantize_fold takes it (ACTIVE, a FoldCheck or None) -> the FoldCheck that
    applies to a tensor on `device`, or None (fold exactly, with a readback)."""
    if check is ACTIVE:
        return active_fold_check(device)
    if check is not None and not isinstance(check, FoldCheck):
        raise TypeError(f"check must be fold_check.ACTIVE, a FoldCheck from deferred_fold_check() "
                        f"or None, got {type(check).__name__}")
    return _for_device(check, device)


@contextlib.contextmanager
def watch_chunked_folds() -> Iterator[set]:
    """Inside this block (on this thread, and in the backward passes of the forwards it ran),
    every fold that needed more than one K-chunk adds its layer to the yielded set: the `layer`
    that `folding_for` names (lowbit's FP8 linear passes its `layer` name; under --fold-inexact
    adapt lowbit.train names each QuantLinear by its module name), eagerly and under
    torch.compile alike. lowbit.train watches a redone step this way to move such layers off
    the FP8 path (--fold-inexact adapt)."""
    outer = getattr(_LOCAL, "watch", None)
    _LOCAL.watch = seen = set()
    try:
        yield seen
    finally:
        _LOCAL.watch = outer
        if outer is not None:
            outer |= seen


def active_watch() -> set | None:
    """The watch_chunked_folds() set in force on this thread, if any."""
    return getattr(_LOCAL, "watch", None)


@contextlib.contextmanager
def folding_for(layer, watch: set | None) -> Iterator[None]:
    """The folds inside this block belong to `layer`, and a chunked one is noted in `watch`
    (the set of a watch_chunked_folds() block, carried to another thread if need be). An
    unnamed layer ("" or None) is not noted."""
    before = getattr(_LOCAL, "folding", None)
    _LOCAL.folding = (layer, watch) if watch is not None and layer else None
    try:
        yield
    finally:
        _LOCAL.folding = before


def note_chunks(folded) -> None:
    """Note, for the watch in force, the layer of these FoldedOperands (None skipped) if one of
    them needed more than one K-chunk."""
    folding = getattr(_LOCAL, "folding", None)
    if folding is not None and any(f is not None and len(f.bounds) > 2 for f in folded):
        folding[1].add(folding[0])
