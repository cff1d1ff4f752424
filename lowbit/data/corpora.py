"""Text corpora by name, read from a local data folder; nothing is downloaded.

| name            | train                               | val                        | test             |
| --------------- | ----------------------------------- | -------------------------- | ---------------- |
| tinyshakespeare | first 90% of input.txt              | last 10%                   | -                |
| wikitext2       | wiki.train.raw                      | wiki.valid.raw             | wiki.test.raw    |
| gutenberg       | 13 books                            | 2 held-out books           | -                |
| english         | all 15 books + wiki.train.raw       | wiki.valid.raw             | wiki.test.raw    |
| pycode          | Python sources of this interpreter  | ~2% of files, by path hash | -                |

The data folder is found by `data_root()`: an explicit path, else $LOWBIT_DATA, else
`shared/data` beside the checkout (see shared/data/README.md for its contents and licenses).
Files are decoded as UTF-8, falling back to Latin-1 (one Gutenberg book is Latin-1), and
CRLF / CR line ends become LF (Moby Dick has CRLF).

`pycode` is the Python source of the running interpreter's standard library and installed
packages: hundreds of MB on any machine, for runs longer than the other corpora allow. The
installed packages differ between machines, so the corpus differs too; `Corpus.meta` records
the roots, file counts and bytes that were used, and a file's split depends only on its
relative path, so a file held out on one machine is held out on every machine.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

CORPORA = ("tinyshakespeare", "wikitext2", "gutenberg", "english", "pycode")

# Whole books held out of `gutenberg` for validation (~5% of its bytes). Named rather than
# hashed: with 15 books a hash rule could hold out none, or the 4 MB bible.
GUTENBERG_VAL_BOOKS = ("austen-persuasion.txt", "shakespeare-macbeth.txt")
# A pycode file is held out when its path hash mod 100 falls below this.
PYCODE_VAL_PERCENT = 2
# Separator between documents (books, source files) joined into one split.
DOCUMENT_SEPARATOR = "\n\n"


@dataclass
class Corpus:
    name: str
    splits: dict[str, str]
    """Split name ("train", "val", optionally "test") -> normalized text."""
    meta: dict = field(default_factory=dict)
    """Where the text came from (files, byte counts, pycode's roots); JSON-ready."""

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of every split's name and text: the key of anything cached from this corpus."""
        digest = hashlib.sha256()
        for split in sorted(self.splits):
            digest.update(f"{split}\0{len(self.splits[split])}\0".encode())
            digest.update(self.splits[split].encode("utf-8", errors="surrogatepass"))
        return digest.hexdigest()


def data_root(path: str | os.PathLike | None = None) -> Path:
    """The folder holding the corpora: `path`, else $LOWBIT_DATA, else shared/data beside the
    checkout. Raises FileNotFoundError that says how to point lowbit at the data."""
    if path is not None or os.environ.get("LOWBIT_DATA"):
        source = "the given data directory" if path is not None else "$LOWBIT_DATA"
        root = Path(path if path is not None else os.environ["LOWBIT_DATA"]).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"{source} {str(root)!r} is not a directory; pass --data-dir or set "
                                    f"LOWBIT_DATA to the folder holding tinyshakespeare/, wikitext-2/, ...")
        return root
    # lowbit/data/corpora.py -> lowbit/data/ -> lowbit/ -> checkout -> its parent (shared/).
    beside_checkout = Path(__file__).resolve().parents[3] / "shared" / "data"
    if beside_checkout.is_dir():
        return beside_checkout
    raise FileNotFoundError(f"no data directory found (looked for {beside_checkout}); pass --data-dir "
                            f"or set LOWBIT_DATA to the folder holding tinyshakespeare/, wikitext-2/, ...")


def read_text(path: Path) -> str:
    """A text file as str: UTF-8 (BOM dropped), else Latin-1; newlines normalized to LF."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")  # never fails: every byte is a Latin-1 character
    return text.replace("\r\n", "\n").replace("\r", "\n")


def load_corpus(name: str, data_dir: str | os.PathLike | None = None, max_bytes: int | None = None) -> Corpus:
    """Corpus `name` (see CORPORA) from the data folder.

    max_bytes, for tests and smoke runs, cuts every split to its first max_bytes characters
    (= bytes for these nearly all-ASCII texts); pycode also stops reading files once a split
    holds that many bytes. None keeps everything. pycode needs no data folder.
    """
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; known corpora: {', '.join(CORPORA)}")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive number of bytes or None (got {max_bytes})")
    if name == "pycode":
        corpus = _pycode(max_bytes)
    else:
        root = data_root(data_dir)
        corpus = {"tinyshakespeare": _tinyshakespeare, "wikitext2": _wikitext2,
                  "gutenberg": _gutenberg, "english": _english}[name](root)
    for split, text in corpus.splits.items():
        if max_bytes is not None:
            corpus.splits[split] = text[:max_bytes]
        if not corpus.splits[split]:
            raise ValueError(f"corpus {name!r} has an empty {split} split; check the files under "
                             f"its data folder")
    corpus.meta["max_bytes"] = max_bytes
    corpus.meta["chars"] = {split: len(text) for split, text in corpus.splits.items()}
    return corpus


def _require_file(root: Path, relative: str, corpus: str) -> Path:
    path = root / relative
    if not path.is_file():
        raise FileNotFoundError(f"corpus {corpus!r} needs {path}, which does not exist; pass --data-dir or "
                                f"set LOWBIT_DATA to a folder holding {relative} (see shared/data/README.md)")
    return path


def _tinyshakespeare(root: Path) -> Corpus:
    path = _require_file(root, "tinyshakespeare/input.txt", "tinyshakespeare")
    text = read_text(path)
    cut = int(len(text) * 0.9)  # nanoGPT's split: the last 10% is validation
    return Corpus("tinyshakespeare", {"train": text[:cut], "val": text[cut:]}, {"files": [str(path)]})


def _wikitext_splits(root: Path, corpus: str) -> dict[str, str]:
    files = {"train": "wiki.train.raw", "val": "wiki.valid.raw", "test": "wiki.test.raw"}
    return {split: read_text(_require_file(root, f"wikitext-2/{name}", corpus))
            for split, name in files.items()}


def _wikitext2(root: Path) -> Corpus:
    return Corpus("wikitext2", _wikitext_splits(root, "wikitext2"), {"folder": str(root / "wikitext-2")})


def _gutenberg_books(root: Path, corpus: str) -> list[Path]:
    folder = root / "gutenberg" / "gutenberg"
    books = sorted(folder.glob("*.txt"))
    if not books:
        raise FileNotFoundError(f"corpus {corpus!r} needs the Gutenberg books in {folder}, which has no "
                                f".txt files; pass --data-dir or set LOWBIT_DATA (see shared/data/README.md)")
    return books


def _gutenberg(root: Path) -> Corpus:
    books = _gutenberg_books(root, "gutenberg")
    val = [b for b in books if b.name in GUTENBERG_VAL_BOOKS]
    train = [b for b in books if b.name not in GUTENBERG_VAL_BOOKS]
    splits = {"train": DOCUMENT_SEPARATOR.join(read_text(b) for b in train),
              "val": DOCUMENT_SEPARATOR.join(read_text(b) for b in val)}
    meta = {"folder": str(books[0].parent), "train_books": [b.name for b in train],
            "val_books": [b.name for b in val]}
    return Corpus("gutenberg", splits, meta)


def _english(root: Path) -> Corpus:
    books = _gutenberg_books(root, "english")
    wiki = _wikitext_splits(root, "english")
    train = DOCUMENT_SEPARATOR.join([read_text(b) for b in books] + [wiki["train"]])
    meta = {"books": [b.name for b in books], "wikitext": str(root / "wikitext-2")}
    return Corpus("english", {"train": train, "val": wiki["val"], "test": wiki["test"]}, meta)


def pycode_roots() -> list[tuple[str, Path]]:
    """(label, folder) of the running interpreter's standard library and site-packages.
    purelib and platlib share the label "site-packages", so a file's relative path, and so
    its split, does not depend on which of the two a platform installs it in."""
    paths = sysconfig.get_paths()
    roots: list[tuple[str, Path]] = []
    for label, key in (("stdlib", "stdlib"), ("site-packages", "purelib"), ("site-packages", "platlib")):
        path = Path(paths[key]).resolve()
        if path.is_dir() and path not in [root for _, root in roots]:
            roots.append((label, path))
    return roots


def _path_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def pycode_files() -> list[tuple[str, Path, str]]:
    """(relative path, path, split) of every .py file under pycode_roots(), in corpus order.

    The order is by a hash of the relative path: deterministic for a given set of files, and
    a byte cap then samples across packages instead of taking the alphabetical head. The
    split ("val" for ~PYCODE_VAL_PERCENT% of files) hashes the relative path alone.
    """
    roots = pycode_roots()
    root_paths = {root for _, root in roots}
    files = []
    for label, root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            # Skip caches, and other roots nested inside this one (a venv inside stdlib, or
            # an interpreter-wide site-packages this interpreter does not import from).
            dirnames[:] = sorted(d for d in dirnames
                                 if d not in ("__pycache__", "site-packages", "dist-packages")
                                 and Path(dirpath, d).resolve() not in root_paths)
            for filename in sorted(filenames):
                if filename.endswith(".py"):
                    path = Path(dirpath, filename)
                    relative = f"{label}/{path.relative_to(root).as_posix()}"
                    split = "val" if _path_hash("split:" + relative) % 100 < PYCODE_VAL_PERCENT else "train"
                    files.append((relative, path, split))
    files.sort(key=lambda item: (_path_hash("order:" + item[0]), item[0]))
    return files


def _pycode(max_bytes: int | None) -> Corpus:
    texts: dict[str, list[str]] = {"train": [], "val": []}
    sizes = {"train": 0, "val": 0}
    skipped = 0
    for _, path, split in pycode_files():
        if max_bytes is not None and sizes[split] >= max_bytes:
            if all(size >= max_bytes for size in sizes.values()):
                break
            continue
        source = _read_source(path)
        if source is None:
            skipped += 1
            continue
        texts[split].append(source[0])
        sizes[split] += source[1]
    meta = {
        "roots": {str(root): label for label, root in pycode_roots()},
        "python": sys.version.split()[0],
        "files": {split: len(parts) for split, parts in texts.items()},
        "bytes": dict(sizes),
        "skipped_files": skipped,
    }
    return Corpus("pycode", {split: DOCUMENT_SEPARATOR.join(parts) for split, parts in texts.items()}, meta)


def _read_source(path: Path) -> tuple[str, int] | None:
    """A Python file's (text, size in bytes), or None when it is unreadable, binary or not UTF-8."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if b"\0" in raw:
        return None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None  # PEP 263 encodings other than UTF-8 are rare; dropping them keeps it simple
    return text.replace("\r\n", "\n").replace("\r", "\n"), len(raw)
