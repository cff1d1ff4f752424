"""Writing a file so that a reader sees the old contents or the new, never a part of either: the
one way every file lowbit writes is written (checkpoints, configs, metrics, figures, exported
weights, tokenizers, QTensor files).

The new contents go to a temporary file beside the destination, `.<name>.<pid>.<hex>.tmp`
(unique: two writers, or a user's file of that name, are never clobbered; `TEMP_NAME` matches
it, so a killed write's leftovers can be found), which is fsynced and renamed over the
destination, and the folder is fsynced (the rename lives in its entry). The rename replaces
the directory entry: a destination that is a symlink (a Hugging Face cache snapshot links
every file to a blob) is replaced by the new file, never written through. The file gets the
mode a plain open() gives (0o666 & ~umask; safetensors alone would leave 0600, which a server
running as another user cannot read).

A write that fails (a full disk, a quota, an I/O error) is an OSError that names the
destination and keeps the errno (ENOSPC ...), also where a library wrapped it (torch's zip
writer raises a RuntimeError over it, safetensors its own error with "os error 28" in the
text); the temporary file is removed and the destination stays as it was. Ctrl-C passes as it
is.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
from pathlib import Path
from typing import IO
from collections.abc import Callable, Iterator

__all__ = ["write_atomic", "write_stream_atomic", "write_bytes_atomic", "write_text_atomic",
           "write_safetensors", "naming_errors", "fsync_folder", "TEMP_NAME"]

TEMP_NAME = re.compile(r"^\.(.+)\.\d+\.[0-9a-f]{8}\.tmp$")
"""The temporary files write_atomic writes through (group 1: the destination's name)."""


def write_atomic(path: str | os.PathLike, fill: Callable[[Path], None],
                 replace: Callable[[Path], None] | None = None) -> None:
    """Create `path` by fill(tmp), which fills the fresh file `tmp` beside it (it may write it
    anew, as safetensors does), then rename tmp over path -- or, given `replace`, call
    replace(tmp) to put it in place (a checkpoint rotation). See the module doc."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "xb") as f:      # "x": the umask's mode; mkstemp would give 0600
            mode = os.fstat(f.fileno()).st_mode & 0o777
        fill(tmp)
        os.chmod(tmp, mode)
        fd = os.open(tmp, os.O_RDONLY)  # the bytes reach the disk before the name does
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace is None:
            os.replace(tmp, path)
        else:
            replace(tmp)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if not isinstance(e, Exception):   # Ctrl-C, SystemExit: as they are
            raise
        if isinstance(e, OSError) and e.filename not in (None, str(tmp), tmp):
            raise                           # names a file already (a rename's source or target)
        raise _naming(path, e) from e
    fsync_folder(path.parent)


def write_stream_atomic(path: str | os.PathLike, write: Callable[[IO], None], mode: str = "wb",
                        replace: Callable[[Path], None] | None = None) -> None:
    """write_atomic for a writer of a file object: write(f) on the temporary file opened with
    `mode` ("wb" or "w")."""
    def fill(tmp: Path) -> None:
        with open(tmp, mode) as f:
            write(f)
    write_atomic(path, fill, replace)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    write_atomic(path, lambda tmp: tmp.write_bytes(data))


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text))


def write_safetensors(path: str | os.PathLike, tensors: dict, metadata: dict | None = None) -> None:
    """safetensors' save_file through write_atomic (safetensors reports a full disk as its own
    error with "os error 28" in the text: an OSError naming `path` here)."""
    from safetensors.torch import save_file

    write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


@contextlib.contextmanager
def naming_errors(path: str | os.PathLike) -> Iterator[None]:
    """Inside: an OSError that names no file (what a write, flush or fsync raises: ENOSPC,
    EIO, EDQUOT) is raised again naming `path`, with its errno; one that names a file passes
    as it is. For writes that cannot go through write_atomic (an appended log)."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise _naming(Path(path), e) from e


def _naming(path: Path, error: BaseException) -> OSError:
    """An OSError for `error` that names `path`, with the errno the error carries or states."""
    code = _errno_of(error)
    if code is not None:
        return OSError(code, os.strerror(code), str(path))
    first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    return OSError(None, f"the write failed ({type(error).__name__}"
                         f"{': ' + first if first else ''})", str(path))


def _errno_of(error: BaseException) -> int | None:
    """The errno of an OSError in `error`'s chain (its causes and contexts), else one its
    messages state: "[Errno 28]", Rust's "os error 28" (safetensors), or the C library's own
    words for it ("No space left on device")."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    for e in chain:
        if isinstance(e, OSError) and isinstance(e.errno, int) and e.errno:
            return e.errno
    text = " ".join(str(e) for e in chain)
    found = re.search(r"\[Errno (\d+)\]|os error (\d+)", text)
    if found:
        return int(found[1] or found[2])
    return next((code for code in sorted(errno.errorcode) if os.strerror(code) in text), None)


def fsync_folder(folder: str | os.PathLike) -> None:
    """Make a folder's entries (a rename into it) durable."""
    # The rename itself lives in the directory entry; without this a power loss right after
    # os.replace could bring back the old name. Not all platforms can open a directory.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
