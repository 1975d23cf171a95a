"""Training data: pre-tokenised ids read through a memory map, batches that are slices of them, and
ids the model's vocabulary lacks refused before any worker starts."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from harness import save_tokenizer
from shardwire.cli import main
from shardwire.training.data import ByteCorpus, TokenCorpus, load_corpus


@pytest.mark.parametrize("suffix, dtype", [(".bin", np.uint16), (".bin", np.uint32), (".npy", np.uint32)])
def test_token_ids_round_trip_through_a_memory_map(tmp_path, suffix, dtype):
    ids = (np.arange(50_000) * 7919 % 70_000 if dtype == np.uint32 else np.arange(50_000) % 65_000).astype(dtype)
    path = tmp_path / f"tokens{suffix}"
    ids.tofile(path) if suffix == ".bin" else np.save(path, ids)
    corpus = load_corpus(str(path), seq_len=64, bin_dtype=np.dtype(dtype).name)
    assert isinstance(corpus, TokenCorpus) and isinstance(corpus.ids, np.memmap)
    assert corpus.num_tokens == len(ids)
    batch = corpus.batch(3, global_batch=4, seq_len=64, seed=1)
    assert batch.shape == (4, 65) and batch.dtype == torch.int64
    train = ids[: len(corpus.splits["train"])]
    for row in batch.numpy():  # each row is a window of the training split
        start = int(np.flatnonzero(train == row[0])[0])
        assert np.array_equal(train[start : start + 65], row)
    assert torch.equal(batch, corpus.batch(3, global_batch=4, seq_len=64, seed=1))  # a function of the step


def test_text_stays_bytes():
    assert isinstance(load_corpus(None, seq_len=64), ByteCorpus)


def test_an_id_past_the_vocabulary_is_refused_before_any_worker_starts(tmp_path):
    path = tmp_path / "tokens.bin"
    ids = np.full(20_000, 7, dtype=np.uint16)
    ids[12_345] = 300  # the byte-level GPT has 256 ids
    ids.tofile(path)
    with pytest.raises(SystemExit, match="holds token id 300 at position 12,345, but the model's vocabulary has 256"):
        main(["train", "--model", "small", "--data", str(path)])


def test_a_bin_of_another_element_type_is_refused_with_the_option_to_give(tmp_path):
    path = tmp_path / "tokens.bin"
    np.full(20_001, 7, dtype=np.uint16).tofile(path)  # 40,002 bytes: not whole uint32 ids
    with pytest.raises(SystemExit, match="holds 40,002 bytes, not a whole number of uint32 ids.*--token-dtype"):
        main(["train", "--data", str(path), "--token-dtype", "uint32"])
    np.full(40_000, 7, dtype=np.uint16).tofile(path)  # read as uint32: ids of 7 * 65,537
    with pytest.raises(SystemExit, match="holds token id 458759 at position 0.*not uint32, give --token-dtype"):
        main(["train", "--data", str(path), "--token-dtype", "uint32"])


def test_ids_must_be_a_flat_unsigned_array(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, np.zeros((10, 10), dtype=np.float32))
    with pytest.raises(SystemExit, match="holds a 2-d float32 array: token ids are a flat array of unsigned"):
        main(["train", "--data", str(path)])


def test_uint32_ids_read_as_uint16_are_refused(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, 61_000, dtype=np.uint32).tofile(path)  # ids under 65,536: every high half is 0
    with pytest.raises(SystemExit, match=r"looks like uint32 ids read as uint16 \(every second id of its first "
                                         r"120,000 is 0\): give --token-dtype uint32"):
        main(["train", "--model", "small", "--data", str(path)])
    assert load_corpus(str(path), 32, bin_dtype="uint32").num_tokens == 60_000


def test_uint16_ids_as_sparse_as_uint32_ones_are_read_from_the_npy_the_refusal_writes(tmp_path):
    """uint16 ids every second of which is 0 look like uint32 ids to the check, whatever
    --token-dtype says: the refusal's own conversion, run as written, gives a file that reads them."""
    ids = np.zeros(20_000, dtype=np.uint16)
    ids[::2] = np.arange(1, 10_001)
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    with pytest.raises(SystemExit) as refusal:
        main(["train", "--model", "tiny", "--data", str(path), "--token-dtype", "uint16"])
    conversion, converted = re.search(r"write them as \.npy, whose header names their type: (.*), and give --data "
                                      r"(\S+)$", str(refusal.value)).groups()
    eval(conversion, {"numpy": np})
    assert np.array_equal(load_corpus(converted, 32).ids, ids)


@pytest.mark.slow
def test_training_on_token_ids_lowers_the_loss(tmp_path):
    path = tmp_path / "tokens.bin"
    text = (b"the quick brown fox jumps over the lazy dog. " * 2000)
    np.frombuffer(text, dtype=np.uint8).astype(np.uint16).tofile(path)
    done = subprocess.run([sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--steps", "30",
                           "--nproc", "1", "--eval-batches", "1", "--data", str(path)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"data: {path}, 90,000 uint16 token ids" in done.stdout  # the start line says how it read them
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", done.stdout).groups())
    assert last < first


@pytest.fixture
def tokenizer_dir(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    save_tokenizer(tmp_path / "tokenizer")
    return tmp_path / "tokenizer"


def test_text_is_tokenised_once_into_ids_beside_it(tmp_path, tokenizer_dir):
    import transformers

    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"{i}.txt").write_text("the quick brown fox jumps over the lazy dog " * (200 + i))
    corpus = load_corpus(str(texts), seq_len=16, tokenizer=str(tokenizer_dir))
    assert isinstance(corpus, TokenCorpus)
    cache = pathlib.Path(corpus.name)
    assert cache.parent == tmp_path and cache.name.startswith("texts.tokens-") and cache.suffix == ".npy"
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    first = tokenizer((texts / "0.txt").read_text(), add_special_tokens=False)["input_ids"]
    assert list(corpus.ids[: len(first) + 1]) == [*first, tokenizer.eos_token_id]
    written = cache.stat().st_mtime_ns
    again = load_corpus(str(texts), seq_len=16, tokenizer=str(tokenizer_dir))
    assert again.name == corpus.name and cache.stat().st_mtime_ns == written  # read, not tokenised again


def test_a_texts_own_line_ends_are_tokenised_as_they_are(tmp_path, tokenizer_dir):
    """\r\n and \r were read as \n (Python's text mode), and trained on as ids the tokenizer never gives."""
    import transformers

    text = "the quick\r\nbrown fox\rjumps over\n" * 3000
    (tmp_path / "crlf.txt").write_bytes(text.encode())
    corpus = load_corpus(str(tmp_path / "crlf.txt"), seq_len=16, tokenizer=str(tokenizer_dir))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    assert list(corpus.ids) == [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]


@pytest.mark.slow
def test_text_is_read_as_utf8_whatever_the_locale(tmp_path, tokenizer_dir):
    """Under LC_ALL=C each character of several bytes was read as U+FFFD, and the ids cached."""
    import transformers

    text = "the quick \u00fcn\u00efc\u00f8d\u00e9 fox \u65e5\u672c \U0001f600 jumps\n" * 500
    (tmp_path / "utf8.txt").write_bytes(text.encode())
    done = subprocess.run([sys.executable, "-c", "import sys; from shardwire.training.data import tokenized; "
                           "print(tokenized(sys.argv[1], sys.argv[2]))", str(tmp_path / "utf8.txt"), str(tokenizer_dir)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    ids = np.load(done.stdout.strip()).tolist()
    assert ids == [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]


def test_text_is_tokenised_in_pieces_whose_ids_are_the_whole_texts(tokenizer_dir):
    """A text is given to the tokenizer a piece at a time (memory bounded whatever its size), cut only
    where a byte-level BPE splits the whole text too, each piece between the last word of the one
    before (this tokenizer adds a space before the first word it is given) and the first of the one
    after: blank lines, indents and trailing spaces, runs of line ends, \r\n and \r, and characters
    of several bytes all tokenise as they would whole."""
    import io

    import transformers

    from shardwire.training.data import _ids_by_piece, _text_pieces

    lines = ["def fox(x):", "    return x  ", "", "", "the quick brown fox\u00e9\u4e2d", " jumps", "\tover",
             "lazy dogs.", "\n", "end\r", "crlf\r\n", "\r"]
    text = "\n".join(lines[i * 7 % len(lines)] for i in range(400))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    for size in (16, 64, 1000):
        pieces = list(_text_pieces(io.StringIO(text), size))
        assert len(pieces) > 1 and "".join(pieces) == text
        assert [i for ids in _ids_by_piece(tokenizer, pieces) for i in ids] == whole
    # no line start within 16 pieces: cut at a word's start; none either: not cut, whatever the length
    for text in ("x" + "l" * 301 + " end" * 40, "\t" + " " * 300 + "y z" * 30, "a b " * 90):
        pieces = list(_text_pieces(io.StringIO(text), 16))
        assert len(pieces) > 1 and "".join(pieces) == text
        assert [i for ids in _ids_by_piece(tokenizer, pieces) for i in ids] == tokenizer(
            text, add_special_tokens=False)["input_ids"]
    assert list(_text_pieces(io.StringIO("x" * 100), 4)) == ["x" * 100]
    assert list(_text_pieces(io.StringIO("\t" + " " * 99), 4)) == ["\t" + " " * 99]


MEASURES_TOKENISING = """
import resource, sys
from shardwire.models import tokenizer
from shardwire.training.data import tokenized
tokenizer.load(sys.argv[2], "--tokenizer")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tokenized(sys.argv[1], sys.argv[2])
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.slow
def test_tokenising_a_text_takes_memory_of_its_size_not_of_the_tokenizers_working(tmp_path, tokenizer_dir):
    """A file given whole to the tokenizer took 230 times its size (a 141 MB text: 32 GB, and the
    run was killed); tokenised a piece at a time, it takes its ids and one piece's working."""
    text = tmp_path / "text.txt"
    line = "the quick brown fox jumps over the lazy dog, then 12345 more\n"
    text.write_text(line * (8_000_000 // len(line)))
    done = subprocess.run([sys.executable, "-c", MEASURES_TOKENISING, str(text), str(tokenizer_dir)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) < 20 * text.stat().st_size


def test_a_tokenizer_needs_a_directory_and_a_text_corpus(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("x" * 50_000)
    with pytest.raises(SystemExit, match="--tokenizer /no/such/tokenizer is not a directory"):
        main(["train", "--data", str(text), "--tokenizer", "/no/such/tokenizer"])
    ids = tmp_path / "ids.bin"
    ids.write_bytes(bytes(200_000))
    with pytest.raises(SystemExit, match="--tokenizer tokenises a text corpus: give --data a text file"):
        main(["train", "--data", str(ids), "--tokenizer", str(tmp_path)])


def test_a_tokenizer_directory_transformers_cannot_read_is_named_in_one_whole_line(tmp_path):
    transformers = pytest.importorskip("transformers")
    text = tmp_path / "text.txt"
    text.write_text("x" * 50_000)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as refused:
        main(["train", "--data", str(text), "--tokenizer", str(empty)])
    assert str(refused.value) == (
        f"error: --tokenizer {empty} holds none of a tokenizer's files (tokenizer.json, tokenizer_config.json, "
        f"tokenizer.model, vocab.json): give a directory a tokenizer's save_pretrained wrote")
    (empty / "tokenizer_config.json").write_text("{}")  # nothing to build the tokenizer from
    with pytest.raises(SystemExit) as refused:
        main(["train", "--data", str(text), "--tokenizer", str(empty)])
    with pytest.raises(Exception) as theirs:
        transformers.AutoTokenizer.from_pretrained(empty, local_files_only=True)
    assert str(refused.value) == (f"error: --tokenizer {empty}: transformers cannot read it "  # all of its message
                                  f"({' '.join(str(theirs.value).split())}): give a directory a tokenizer's "
                                  f"save_pretrained wrote")


def test_a_tokenizer_model_of_neither_kind_is_named_so_not_a_package_to_install(tmp_path):
    pytest.importorskip("transformers")
    text = tmp_path / "text.txt"
    text.write_text("x" * 50_000)
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer.model").write_bytes(np.random.default_rng(0).bytes(5_000))
    with pytest.raises(SystemExit) as refused:
        main(["train", "--data", str(text), "--tokenizer", str(directory)])
    assert str(refused.value) == (f"error: --tokenizer {directory}: its tokenizer.model is neither a SentencePiece "
                                  f"model nor a tiktoken file: give a directory a tokenizer's save_pretrained wrote")


def test_a_corpus_says_a_long_name_cut_short():
    """The start-of-run line printed a --data path of 3,000 characters whole."""
    described = ByteCorpus(bytes(range(256)) * 64, "d" * 3000 + "/corpus.txt", seq_len=16).description
    assert len(described) < 200 and described.endswith("/corpus.txt, 0.0M bytes as tokens")
