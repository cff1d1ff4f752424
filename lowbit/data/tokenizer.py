"""Tokenizers trained locally: byte-level BPE (the `tokenizers` package) or raw UTF-8 bytes.

`get_tokenizer("bpe", corpus, vocab_size)` trains a GPT-2-style byte-level BPE on (the first
BPE_SAMPLE_CHARS characters of) the corpus's train split, once: the result is cached under
`cache_root()/tokenizers/`, keyed by corpus name, vocabulary size and a hash of the training
text, and written atomically so concurrent processes never read a half-written file.
Byte-level BPE is lossless: decode(encode(s)) == s for every string.

`get_tokenizer("bytes")` needs no training: ids are the UTF-8 bytes (vocab 256). Decoding a
sequence cut in the middle of a multi-byte character replaces the broken bytes with U+FFFD.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from collections.abc import Iterator, Sequence

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from lowbit.data.corpora import Corpus
from lowbit.files import write_bytes_atomic

TOKENIZERS = ("bpe", "bytes")
# BPE merges are learned from at most this much of the train split (pycode's is ~220M).
# Training on 32M characters took 8 s on 2 CPU cores (pycode, vocab 4096); encoding the
# whole split afterwards is the slow part (~1.5 MB/s there, ~2.5 min for pycode), once.
BPE_SAMPLE_CHARS = 32 * 2**20
# Texts longer than this are encoded in pieces, in parallel (see encode_array).
ENCODE_CHUNK_CHARS = 2**20


def cache_root(path: str | os.PathLike | None = None) -> Path:
    """Where tokenizers and tokenized corpora are cached: `path`, else $LOWBIT_CACHE, else
    ~/.cache/lowbit."""
    if path is None:
        path = os.environ.get("LOWBIT_CACHE") or Path.home() / ".cache" / "lowbit"
    return Path(path).expanduser()


def encode_chunks(text: str, chunk_chars: int = ENCODE_CHUNK_CHARS) -> Iterator[str]:
    """Pieces of `text`, each about chunk_chars long, cut just before a newline that follows a
    non-space character. Byte-level BPE's pre-tokenizer (the GPT-2 regex) never lets a
    pre-token run from a non-space into whitespace, so there is a pre-token boundary at each
    cut: encoding the pieces separately gives exactly the ids of encoding the whole text."""
    start = 0
    while start < len(text):
        cut = text.find("\n", start + chunk_chars)
        while cut != -1 and text[cut - 1].isspace():
            cut = text.find("\n", cut + 1)
        if cut == -1:
            cut = len(text)
        yield text[start:cut]
        start = cut


class ByteTokenizer:
    """ids = UTF-8 bytes."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """A trained byte-level BPE (a `tokenizers.Tokenizer`) with lowbit's small interface."""

    def __init__(self, tokenizer: HFTokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        # The name keys the tokenized-corpus cache, so it hashes the tokenizer itself: a
        # retrained tokenizer that differs in any merge gets new token files.
        digest = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:12]
        self.name = f"bpe{self.vocab_size}-{digest}"

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def encode_array(self, text: str) -> np.ndarray:
        """encode(text) as an array; long texts go in newline-aligned pieces through the
        tokenizer's parallel batch encoder, with the same ids (see encode_chunks)."""
        dtype = np.uint16 if self.vocab_size <= 2**16 else np.int32
        pieces = self.tokenizer.encode_batch(list(encode_chunks(text)))
        arrays = [np.asarray(piece.ids, dtype=dtype) for piece in pieces]
        return np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    @classmethod
    def load(cls, path: Path) -> BPETokenizer:
        return cls(HFTokenizer.from_file(str(path)))


Tokenizer = ByteTokenizer | BPETokenizer


def train_bpe(text: str, vocab_size: int) -> BPETokenizer:
    """Byte-level BPE with `vocab_size` entries (the 256 byte symbols plus learned merges)."""
    tokenizer = HFTokenizer(models.BPE())
    # add_prefix_space=False: the text is encoded exactly as given, so decode(encode(s)) == s.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(encode_chunks(text, 2**16), trainer=trainer)
    return BPETokenizer(tokenizer)


def get_tokenizer(kind: str, corpus: Corpus | None = None, vocab_size: int = 4096,
                  cache_dir: str | os.PathLike | None = None) -> Tokenizer:
    """"bytes", or "bpe" trained on corpus's train split (loaded from the cache when there);
    a Tokenizer given instead of a name is returned as it is."""
    if not isinstance(kind, str):
        return kind
    if kind == "bytes":
        return ByteTokenizer()
    if kind != "bpe":
        raise ValueError(f"unknown tokenizer {kind!r}; known tokenizers: {', '.join(TOKENIZERS)}")
    if corpus is None:
        raise ValueError("the bpe tokenizer is trained on a corpus: pass corpus=load_corpus(name)")
    if not isinstance(vocab_size, int) or not 256 <= vocab_size <= 2**31 - 1:
        raise ValueError(f"vocab_size must be an integer >= 256 (the byte alphabet) (got {vocab_size!r})")
    sample = corpus.splits["train"][:BPE_SAMPLE_CHARS]
    sample_hash = hashlib.sha256(sample.encode("utf-8", errors="surrogatepass")).hexdigest()[:16]
    path = cache_root(cache_dir) / "tokenizers" / f"{corpus.name}-bpe{vocab_size}-{sample_hash}.json"
    if path.is_file():
        return BPETokenizer.load(path)
    tokenizer = train_bpe(sample, vocab_size)
    write_bytes_atomic(path, tokenizer.tokenizer.to_str().encode())
    return tokenizer
