"""Corpora read from a local folder, locally trained tokenizers, and resumable token batches."""

from lowbit.data.corpora import CORPORA, Corpus, data_root, load_corpus, pycode_files, pycode_roots, read_text
from lowbit.data.dataset import TokenDataset, load_dataset
from lowbit.data.tokenizer import (
    TOKENIZERS,
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    cache_root,
    get_tokenizer,
    train_bpe,
)

__all__ = [
    "CORPORA",
    "TOKENIZERS",
    "Corpus",
    "TokenDataset",
    "Tokenizer",
    "BPETokenizer",
    "ByteTokenizer",
    "data_root",
    "cache_root",
    "load_corpus",
    "load_dataset",
    "get_tokenizer",
    "train_bpe",
    "pycode_files",
    "pycode_roots",
    "read_text",
]
