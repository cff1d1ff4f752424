"""lowbit.data: corpora from shared/data, local tokenizers and their caches, resumable batches."""

from pathlib import Path

import numpy as np
import pytest
import torch

import lowbit.data.tokenizer as tokenizer_module
from lowbit.data import (
    CORPORA,
    BPETokenizer,
    ByteTokenizer,
    data_root,
    get_tokenizer,
    load_corpus,
    load_dataset,
    pycode_files,
)
from lowbit.data.corpora import GUTENBERG_VAL_BOOKS, read_text
from lowbit.data.tokenizer import encode_chunks

from conftest import missing_data

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason=missing_data(f"needs the corpora in {DATA}"))


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Every test caches into its own folder, never into ~/.cache/lowbit."""
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LOWBIT_DATA", raising=False)


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory):
    """tinyshakespeare with a 1024-entry BPE, trained once for the tests that only read it."""
    return load_dataset("tinyshakespeare", "bpe", vocab_size=1024, cache_dir=tmp_path_factory.mktemp("cache"))


# --- corpora ------------------------------------------------------------------------------

def test_data_root_default_env_and_argument(tmp_path, monkeypatch):
    assert data_root() == DATA  # shared/data beside the checkout
    monkeypatch.setenv("LOWBIT_DATA", str(tmp_path))
    assert data_root() == tmp_path
    assert data_root(DATA) == DATA  # an explicit path wins over the environment


def test_missing_data_dir_says_how_to_fix(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="--data-dir or set LOWBIT_DATA"):
        data_root(tmp_path / "nowhere")
    monkeypatch.setenv("LOWBIT_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"\$LOWBIT_DATA .*nowhere.* is not a directory"):
        load_corpus("tinyshakespeare")


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tinyshakespeare/input\.txt, which does not exist"):
        load_corpus("tinyshakespeare", data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"wikitext-2/wiki\.train\.raw"):
        load_corpus("wikitext2", data_dir=tmp_path)


def test_unknown_corpus_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown corpus 'shakespear'; known corpora: " + ", ".join(CORPORA)):
        load_corpus("shakespear")
    with pytest.raises(ValueError, match="unknown corpus"):
        load_dataset("nope")


def test_tinyshakespeare_holds_out_the_last_tenth():
    corpus = load_corpus("tinyshakespeare")
    full = read_text(DATA / "tinyshakespeare" / "input.txt")
    assert corpus.splits["train"] + corpus.splits["val"] == full
    assert len(corpus.splits["val"]) == len(full) - int(0.9 * len(full))
    assert corpus.splits["train"].startswith("First Citizen:")


def test_wikitext2_uses_its_own_splits():
    corpus = load_corpus("wikitext2")
    assert set(corpus.splits) == {"train", "val", "test"}
    assert corpus.splits["val"].startswith(" \n = Homarus gammarus = ")
    assert len(corpus.splits["train"]) > 9 * len(corpus.splits["val"])
    assert corpus.splits["val"] not in corpus.splits["train"]


def test_gutenberg_holds_out_whole_books_and_reads_latin1_and_crlf():
    corpus = load_corpus("gutenberg")
    assert corpus.meta["val_books"] == sorted(GUTENBERG_VAL_BOOKS)
    assert not set(corpus.meta["train_books"]) & set(GUTENBERG_VAL_BOOKS)
    assert len(corpus.meta["train_books"]) == 13  # 15 books in the folder
    macbeth = read_text(DATA / "gutenberg" / "gutenberg" / "shakespeare-macbeth.txt")
    assert macbeth in corpus.splits["val"] and macbeth[:2000] not in corpus.splits["train"]
    train = corpus.splits["train"]
    assert "\r" not in train  # Moby Dick's CRLF line ends are normalized
    assert "Cæsar" in train and "Brunetière" in train  # Latin-1 bytes decoded, not replaced
    assert "\ufffd" not in train


def test_english_is_gutenberg_plus_wikitext_evaluated_on_wikitext():
    english, wiki = load_corpus("english"), load_corpus("wikitext2")
    assert english.splits["val"] == wiki.splits["val"] and english.splits["test"] == wiki.splits["test"]
    assert english.splits["train"].endswith(wiki.splits["train"])
    assert "Call me Ishmael" in english.splits["train"]


def test_pycode_is_capped_split_by_file_and_records_its_sources():
    corpus = load_corpus("pycode", max_bytes=50_000)
    assert set(corpus.splits) == {"train", "val"}
    assert all(0 < len(text) <= 50_000 for text in corpus.splits.values())
    assert corpus.meta["files"]["train"] >= 1 and corpus.meta["files"]["val"] >= 1
    assert "stdlib" in corpus.meta["roots"].values() and corpus.meta["python"]
    files = pycode_files()
    assert len({relative for relative, _, _ in files}) == len(files)
    assert {split for _, _, split in files} == {"train", "val"}
    # The first val file in corpus order opens the val split and appears nowhere in train.
    first_val = next(path for _, path, split in files if split == "val")
    head = read_text(first_val)[:300]
    assert corpus.splits["val"].startswith(head) and head not in corpus.splits["train"]
    # Deterministic, and a larger cap extends the same file sequence.
    again = load_corpus("pycode", max_bytes=50_000)
    assert again.splits == corpus.splits
    larger = load_corpus("pycode", max_bytes=80_000)
    assert larger.splits["train"].startswith(corpus.splits["train"])


def test_max_bytes_must_be_positive():
    with pytest.raises(ValueError, match="max_bytes must be a positive number"):
        load_corpus("tinyshakespeare", max_bytes=0)


# --- tokenizers ---------------------------------------------------------------------------

ROUND_TRIP = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n  indented\ttab  ",
    "Cæsar, my Lord; Brunetière, Coppée, Barrès -- Lemaître\n",  # from the Latin-1 books
    "def f(x):\n    return x ** 2  # ünïcödé 日本語 🎉\r\n",
    "",
    " ",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_bpe_round_trips(shakespeare, text):
    tokenizer = shakespeare.tokenizer
    assert isinstance(tokenizer, BPETokenizer) and tokenizer.vocab_size == 1024
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_bytes_round_trip(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert max(ids, default=0) < 256 and tokenizer.decode(ids) == text
    assert tokenizer.encode_array(text).tolist() == ids


def test_chunked_encoding_gives_the_ids_of_whole_text_encoding(shakespeare):
    tokenizer = shakespeare.tokenizer
    text = load_corpus("tinyshakespeare").splits["val"][:30_000] + "\n\n  end \n word\n"
    chunks = list(encode_chunks(text, 500))
    assert len(chunks) > 30 and "".join(chunks) == text
    pieces = [tokenizer.encode(chunk) for chunk in chunks]
    assert [i for piece in pieces for i in piece] == tokenizer.encode(text)


def test_bpe_compresses_and_is_cached(tmp_path, monkeypatch):
    corpus = load_corpus("tinyshakespeare")
    first = get_tokenizer("bpe", corpus, vocab_size=512)
    files = list((tmp_path / "cache" / "tokenizers").glob("tinyshakespeare-bpe512-*.json"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("the cached tokenizer should have been reused")

    monkeypatch.setattr(tokenizer_module, "train_bpe", no_training)
    second = get_tokenizer("bpe", corpus, vocab_size=512)
    assert second.name == first.name and files[0].stat().st_mtime_ns == mtime
    sample = corpus.splits["val"][:5000]
    assert len(first.encode(sample)) < 0.6 * len(sample.encode())  # 0.52 seen with 512 entries


def test_tokenizer_errors():
    corpus = load_corpus("tinyshakespeare", max_bytes=10_000)
    with pytest.raises(ValueError, match="unknown tokenizer 'wordpiece'; known tokenizers: bpe, bytes"):
        get_tokenizer("wordpiece", corpus)
    with pytest.raises(ValueError, match="vocab_size must be an integer >= 256"):
        get_tokenizer("bpe", corpus, vocab_size=100)


# --- datasets and batches -----------------------------------------------------------------

def test_tokenized_corpus_is_cached(tmp_path, monkeypatch):
    data = load_dataset("tinyshakespeare", "bpe", vocab_size=512)
    token_files = sorted((tmp_path / "cache" / "tokens").rglob("*.npy"))
    assert [f.name for f in token_files] == ["train.npy", "val.npy"]
    mtimes = [f.stat().st_mtime_ns for f in token_files]
    assert np.load(token_files[0]).dtype == np.uint16

    def fail(*args, **kwargs):
        raise AssertionError("the second load should read the caches, not train or encode")

    monkeypatch.setattr(tokenizer_module, "train_bpe", fail)
    monkeypatch.setattr(BPETokenizer, "encode_array", fail)
    again = load_dataset("tinyshakespeare", "bpe", vocab_size=512)
    assert [f.stat().st_mtime_ns for f in token_files] == mtimes
    for split in ("train", "val"):
        assert torch.equal(again.splits[split], data.splits[split])
    assert again.meta["tokenizer"] == data.meta["tokenizer"]


def test_dataset_decodes_back_to_the_corpus(shakespeare):
    corpus = load_corpus("tinyshakespeare")
    for split in ("train", "val"):
        assert shakespeare.tokenizer.decode(shakespeare.splits[split].tolist()) == corpus.splits[split]
    assert shakespeare.tokens_per_epoch == len(shakespeare.splits["train"])
    assert shakespeare.vocab_size == 1024


def test_bytes_dataset():
    data = load_dataset("tinyshakespeare", "bytes")
    assert data.vocab_size == 256
    assert data.tokens_per_epoch == len(load_corpus("tinyshakespeare").splits["train"].encode())


def test_batch_of_a_step_depends_only_on_seed_and_step(shakespeare, tmp_path):
    other = load_dataset("tinyshakespeare", "bpe", vocab_size=1024, cache_dir=tmp_path / "other")
    assert torch.equal(other.splits["train"], shakespeare.splits["train"])
    # Drawn in different orders, by different instances: the same batch for each step.
    forward = {step: shakespeare.get_batch(step, 4, 32, seed=7) for step in range(6)}
    backward = {step: other.get_batch(step, 4, 32, seed=7) for step in reversed(range(6))}
    for step in range(6):
        assert torch.equal(forward[step][0], backward[step][0])
        assert torch.equal(forward[step][1], backward[step][1])
    resumed = other.get_batch(1000, 4, 32, seed=7)  # no steps drawn before it
    assert torch.equal(resumed[0], shakespeare.get_batch(1000, 4, 32, seed=7)[0])
    assert not torch.equal(forward[0][0], forward[1][0])
    assert not torch.equal(forward[0][0], shakespeare.get_batch(0, 4, 32, seed=8)[0])
    # Global RNG state plays no part.
    torch.manual_seed(123)
    assert torch.equal(shakespeare.get_batch(3, 4, 32, seed=7)[0], forward[3][0])


def test_batch_shapes_and_targets_are_shifted_inputs(shakespeare):
    x, y = shakespeare.get_batch(0, 5, 16)
    assert x.shape == y.shape == (5, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    tokens = shakespeare.splits["train"].long()
    for row_x, row_y in zip(x, y):
        windows = tokens.unfold(0, 17, 1)  # every (T+1)-window of the split
        assert (windows == torch.cat([row_x, row_y[-1:]])).all(dim=1).any()
    x_val, _ = shakespeare.get_batch(0, 2, 16, split="val")
    assert x_val.max() < shakespeare.vocab_size


def test_eval_batches_read_the_split_in_order(shakespeare):
    val = shakespeare.splits["val"].long()
    batches = list(shakespeare.eval_batches("val", batch_size=3, seq_len=64))
    n_windows = (len(val) - 1) // 64
    assert len(batches) == -(-n_windows // 3)
    x = torch.cat([b[0] for b in batches]).reshape(-1)
    y = torch.cat([b[1] for b in batches]).reshape(-1)
    assert torch.equal(x, val[: n_windows * 64]) and torch.equal(y, val[1: n_windows * 64 + 1])
    limited = list(shakespeare.eval_batches("val", batch_size=3, seq_len=64, max_batches=2))
    assert len(limited) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(limited, batches))


def test_batch_errors(shakespeare):
    n_val = len(shakespeare.splits["val"])
    with pytest.raises(ValueError, match=f"needs at least {n_val + 1} tokens but the val split has {n_val}"):
        shakespeare.get_batch(0, 2, n_val, split="val")
    with pytest.raises(ValueError, match="seq_len=.* use a shorter seq_len or a larger corpus"):
        next(shakespeare.eval_batches("val", 2, n_val))
    with pytest.raises(ValueError, match="unknown split 'test'; this dataset has train, val"):
        shakespeare.get_batch(0, 2, 8, split="test")
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        shakespeare.get_batch(0, 0, 8)

