"""Per-thread state of the FP8 folds: deferred fold checks, chunked-fold watches and fold
observers.

A deferred fold check (`deferred_fold_check(device)`) lets the fused Triton folds of a
training step run without host syncs: each operand is folded with one power-of-two factor
per row, and the values that leaves inexact are counted on the device, in the check's
counter, instead of being read back and re-folded in K-chunks. Whoever opened the check reads
the count once (with the step's loss) and redoes the step outside it if it is nonzero.
A watch (`watch_chunked_folds()`) collects the names of the layers whose exact folds needed
K-chunks (lowbit.train moves them off the FP8 path under --fold-inexact adapt).
An observer (`observe_folds(observer)`) is told, for every fold, its layer, its operand ("X",
"W" or "dY") and how many values it left inexact (`lowbit bench folds` counts them per layer
and operand). The layer is the one `folding_for` names and the operand the one
`folding_operand` names: the caller says both, nothing is inferred from who called.

All three are per thread: a fold on another thread (an evaluation, a rollout) stays exact,
unwatched and unobserved. Autograd runs CUDA backward passes on its own threads, so the
quantized linear's forward takes the check, watch and observer in force and hands them to its
backward explicitly. lowbit.dispatch.quantize_fold is the one place that reads them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

__all__ = ["ACTIVE", "FoldCheck", "deferred_fold_check", "active_fold_check", "resolve_check",
           "watch_chunked_folds", "active_watch", "folding_for", "note_chunks",
           "canonical_device", "FoldObserver", "observe_folds", "active_observer",
           "folding_operand", "fold_observation"]


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


class _PerThread(threading.local):
    """The check, watch, observer, folding_for() and folding_operand() in force, per thread (see
    the module doc); a backward that runs after its forward's check has closed folds exactly.
    The class attributes are every thread's defaults: reading a missing attribute of a
    threading.local raises internally, which every fold would pay for."""

    check = watch = folding = observer = None
    operand = ""


_LOCAL = _PerThread()
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
def folding_for(layer, watch: set | None, observer: FoldObserver | None = None) -> Iterator[None]:
    """The folds inside this block belong to `layer`: a chunked one is noted in `watch` (the set
    of a watch_chunked_folds() block, carried to another thread if need be), and each one is
    reported to `observer` (an observe_folds() observer, carried likewise). An unnamed layer
    ("" or None) is not noted in the watch; the observer sees it as ""."""
    before = getattr(_LOCAL, "folding", None)
    _LOCAL.folding = (layer or "", watch if layer else None, observer)
    try:
        yield
    finally:
        _LOCAL.folding = before


def note_chunks(folded) -> None:
    """Note, for the watch in force, the layer of these FoldedOperands (None skipped) if one of
    them needed more than one K-chunk."""
    folding = getattr(_LOCAL, "folding", None)
    if (folding is not None and folding[1] is not None
            and any(f is not None and len(f.bounds) > 2 for f in folded)):
        folding[1].add(folding[0])


# ---- fold observers --------------------------------------------------------------------------

FoldObserver = Callable[[str, str, torch.Tensor], None]
"""observer(layer, operand, inexact_values), called once per fold (see observe_folds)."""


@contextlib.contextmanager
def observe_folds(observer: FoldObserver) -> Iterator[FoldObserver]:
    """Inside this block (on this thread, and in the backward passes of the forwards it ran),
    every FP8 fold calls `observer(layer, operand, inexact_values)` once:
    - layer: the name `folding_for` gives the fold (lowbit's FP8 linear passes its `layer`,
      in its forward and its backward alike); "" for an unnamed layer;
    - operand: the role `folding_operand` gives it, "X", "W" or "dY" (lowbit.ops.gemms names
      each operand it folds); "" if none was given;
    - inexact_values: a one-element int64 tensor on the operand's device, the values this fold
      left inexact. Only a one-K-chunk fold under a deferred fold check leaves any (a row past
      the window); exact folds report 0. Nothing is read back: the observer may add the
      tensors up and read them once (a host sync on CUDA) when it likes.
    The fold's count still goes to the deferred fold check in force, as without an observer.
    An observer opened inside another replaces it until it closes."""
    outer = getattr(_LOCAL, "observer", None)
    _LOCAL.observer = observer
    try:
        yield observer
    finally:
        _LOCAL.observer = outer


def active_observer() -> FoldObserver | None:
    """The observe_folds() observer in force on this thread, if any (what a forward hands its
    backward, as it hands the check and the watch)."""
    return getattr(_LOCAL, "observer", None)


class folding_operand:  # noqa: N801 -- used as a context manager, like the functions above
    """`with folding_operand("X"):` the folds inside this block are of that operand, its role
    in its layer's GEMMs ("X", "W" or "dY"), as observe_folds' observer is told. (A class, not
    a generator: every FP8 fold enters one, and a training step is host-bound on such Python.)"""

    __slots__ = ("operand", "before")

    def __init__(self, operand: str) -> None:
        self.operand = operand

    def __enter__(self) -> None:
        self.before = getattr(_LOCAL, "operand", "")
        _LOCAL.operand = self.operand

    def __exit__(self, *exc) -> None:
        _LOCAL.operand = self.before


def fold_observation() -> tuple[FoldObserver, str, str] | None:
    """(observer, layer, operand) for the next fold, or None when none observes it: inside a
    folding_for() block its observer (the forward's, carried to the backward) and layer,
    elsewhere this thread's observe_folds() observer and layer ""."""
    folding = getattr(_LOCAL, "folding", None)
    observer, layer = (folding[2], folding[0]) if folding is not None else (active_observer(), "")
    if observer is None:
        return None
    return observer, layer, getattr(_LOCAL, "operand", "")
