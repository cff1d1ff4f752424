"""Token datasets with batches that are pure functions of (seed, step), for exact resume.

    data = load_dataset("tinyshakespeare", tokenizer="bpe", vocab_size=4096)
    x, y = data.get_batch(step, batch_size=16, seq_len=256, seed=0)    # (B, T) each
    for x, y in data.eval_batches("val", batch_size=16, seq_len=256, max_batches=10): ...

The batch of step i depends on nothing but (seed, i): a resumed run draws the same batches
as the run it continues without replaying the steps before, and two processes agree on it.
Each step seeds its own torch.Generator from a hash of (seed, i) and draws B random window
offsets into the split (sampling with replacement, nanoGPT-style; an epoch is therefore a
token count, `tokens_per_epoch`, not a pass over every window).

Tokenized splits are cached as .npy files under `cache_root()/tokens/`, keyed by corpus,
tokenizer and the corpus's content hash, so a second run only reads them back.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
from dataclasses import dataclass, field
from collections.abc import Iterator

import numpy as np
import torch

from lowbit.data.corpora import load_corpus
from lowbit.data.tokenizer import Tokenizer, cache_root, get_tokenizer
from lowbit.files import write_bytes_atomic


@dataclass
class TokenDataset:
    splits: dict[str, torch.Tensor]
    """Split name ("train", "val", optionally "test") -> 1-D token ids (uint16, or int32 for
    vocabularies over 65536); batches come out as int64."""
    tokenizer: Tokenizer
    """Decodes ids back to text; its vocab_size is the model's."""
    meta: dict = field(default_factory=dict)
    """The corpus's metadata (files, bytes, pycode roots) plus the tokenizer's name: log it."""

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash (BLAKE2b) of every split's token ids: two datasets with the same fingerprint
        hold the same tokens. Checkpoints store it, so a resume on other data is refused."""
        digest = hashlib.blake2b(digest_size=16)
        for name in sorted(self.splits):
            tokens = self.splits[name].contiguous()
            digest.update(f"{name}:{tokens.dtype}:{tokens.numel()};".encode())
            digest.update(tokens.view(torch.uint8).numpy())
        return digest.hexdigest()

    @property
    def tokens_per_epoch(self) -> int:
        """Tokens in the train split. Past a few epochs (~4: arXiv 2305.16264) repeated
        tokens are worth much less than new ones; callers warn when a run's
        steps * batch_size * seq_len exceeds ~3x this."""
        return len(self.splits["train"])

    def _split(self, split: str, seq_len: int) -> torch.Tensor:
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}; this dataset has {', '.join(self.splits)}")
        if not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"seq_len must be a positive integer (got {seq_len!r})")
        tokens = self.splits[split]
        if len(tokens) < seq_len + 1:
            raise ValueError(f"seq_len={seq_len} needs at least {seq_len + 1} tokens but the {split} split "
                             f"has {len(tokens)}; use a shorter seq_len or a larger corpus")
        return tokens

    def get_batch(self, step: int, batch_size: int, seq_len: int, seed: int = 0,
                  split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (batch_size, seq_len) int64, for global `step`."""
        tokens = self._split(split, seq_len)
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer (got {batch_size!r})")
        if step < 0:
            raise ValueError(f"step must be >= 0 (got {step})")
        generator = torch.Generator().manual_seed(_step_seed(seed, step))
        offsets = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=generator)  # (B,)
        windows = tokens[offsets[:, None] + torch.arange(seq_len + 1)].long()  # (B, T+1)
        return windows[:, :-1], windows[:, 1:]

    def eval_batches(self, split: str, batch_size: int, seq_len: int,
                     max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The split read in order as non-overlapping windows, batch_size at a time (the last
        batch may be smaller), at most max_batches batches: the same batches on every call."""
        tokens = self._split(split, seq_len)
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer (got {batch_size!r})")
        n_windows = (len(tokens) - 1) // seq_len  # window i covers tokens [i*T, (i+1)*T]
        starts = torch.arange(n_windows) * seq_len  # (W,)
        for i, batch_starts in enumerate(starts.split(batch_size)):
            if max_batches is not None and i >= max_batches:
                return
            windows = tokens[batch_starts[:, None] + torch.arange(seq_len + 1)].long()  # (b, T+1)
            yield windows[:, :-1], windows[:, 1:]


def _step_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (seed, step); hashed so nearby steps are unrelated streams."""
    digest = hashlib.blake2b(f"lowbit-batch:{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def load_dataset(corpus: str = "tinyshakespeare", tokenizer: str | Tokenizer = "bpe", vocab_size: int = 4096,
                 data_dir: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None,
                 max_bytes: int | None = None) -> TokenDataset:
    """Load corpus `corpus` (see lowbit.data.CORPORA), tokenize it with `tokenizer` ("bpe" with
    vocab_size entries, trained on the train split; or "bytes"; or a Tokenizer, e.g. a model's
    BPETokenizer), caching both on disk.

    max_bytes caps every split (see load_corpus), for tests and smoke runs.
    """
    text = load_corpus(corpus, data_dir=data_dir, max_bytes=max_bytes)
    tok = get_tokenizer(tokenizer, text, vocab_size=vocab_size, cache_dir=cache_dir)
    folder = cache_root(cache_dir) / "tokens" / f"{corpus}-{tok.name}-{text.fingerprint[:16]}"
    splits = {}
    for split, split_text in text.splits.items():
        path = folder / f"{split}.npy"
        if not path.is_file():
            buffer = io.BytesIO()
            np.save(buffer, tok.encode_array(split_text))
            write_bytes_atomic(path, buffer.getvalue())
        splits[split] = torch.from_numpy(np.load(path))
    meta = {"corpus": corpus, "tokenizer": tok.name,
            "tokens": {split: len(tokens) for split, tokens in splits.items()}, **text.meta}
    return TokenDataset(splits=splits, tokenizer=tok, meta=meta)
