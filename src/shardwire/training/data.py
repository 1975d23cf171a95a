"""Training data: text as bytes (a corpus every Python installation has), or pre-tokenised ids,
and batches that depend only on the step.

The default corpus is the ``.py`` files of the standard library: present wherever shardwire runs, so
the main job needs no download. A pre-tokenised corpus is a flat array of token ids, read through a
memory map and never loaded whole: a flat ``.bin`` (nanoGPT's uint16, or uint32 for vocabularies
past 65,536: a ``.bin`` has no header, so the run says which) or a ``.npy`` of any unsigned integer
dtype (its header says which). Batches are a pure function of (seed, step):
every rank can compute the global batch and keep its own rows, a run's data position is its step
number, and a resumed run sees exactly the batches an uninterrupted one would have.

Fault-tolerant groups, whose number changes during a run, read by position instead
(``windows``): the train split cut into sequences, taken epoch by epoch in an order drawn from the
seed, the positions dealt among the groups (``shardwire.training.deal``).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import io
import math
import os
import pathlib
import re
import shlex
import sysconfig
import tokenize
import weakref
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from shardwire.files import LEADS_NOWHERE, WriteFailed, inside_problem, write_atomically
from shardwire.mappings import cut
from shardwire.models import tokenizer as hf_tokenizer

VALIDATION_FRACTION = 0.01


TOKEN_SUFFIXES = (".bin", ".npy")
# The files of a --data directory read as its text, whatever lies beside them.
TEXT_SUFFIXES = (".py", ".txt", ".md")
BIN_DTYPES = ("uint16", "uint32")
# What every .npy file begins with (numpy.lib.format.MAGIC_PREFIX).
_NPY_MAGIC = b"\x93NUMPY"
# Token ids checked against the vocabulary at once: bounded memory whatever the corpus's size.
_CHECK_CHUNK = 1 << 24
# The characters of text a tokenizer is given at once (``_text_pieces``).
_TOKENISED_AT_ONCE = 1 << 18
# The most characters of a neighbouring piece given as a piece's context (``_ids_by_piece``).
_CONTEXT = 256
# How text becomes ids, in the name of the ids' cache: ids an earlier way made (a text's \r\n read
# as \n, or read in the locale's encoding) are not taken for this way's.
_TOKENISING = b"utf-8, line ends as written"
# The bytes at each end of the data that its fingerprint (``identity``) reads, and the blocks (their
# count and bytes) it samples evenly between them: about 6 MiB read at any size.
_FINGERPRINT_BYTES = 1 << 20
_SAMPLED_BLOCKS, _SAMPLED_BYTES = 64, 1 << 16
# The largest seed of the weights and batches: torch's generators take 64-bit seeds.
MAX_SEED = 2**64 - 1


def load_corpus(path: str | None, seq_len: int, tokenizer: str | None = None,
                bin_dtype: str = "uint16", memory: int | None = None,
                tokenizer_label: str | None = None, vocab_size: int | None = None) -> "ByteCorpus | TokenCorpus":
    """The corpus ``path`` names: pre-tokenised ids for ``.bin`` (of ``bin_dtype``) and ``.npy``
    files; text tokenised by the Hugging Face tokenizer in the directory ``tokenizer`` (see
    ``tokenized``; refused where it has more ids than ``vocab_size``, the model's, to which every
    batch of ids is held); else text as bytes, refused where it needs more than ``memory`` bytes."""
    if tokenizer is not None:
        if path is not None and path.endswith(TOKEN_SUFFIXES):
            raise ValueError("--tokenizer tokenises a text corpus: give --data a text file or directory")
        return TokenCorpus.load(str(tokenized(path, tokenizer, tokenizer_label, vocab_size)), seq_len,
                                text=path or "the default corpus", vocab_size=vocab_size)
    if path is not None and path.endswith(TOKEN_SUFFIXES):
        return TokenCorpus.load(path, seq_len, bin_dtype, vocab_size=vocab_size)
    return ByteCorpus.load(path, seq_len, memory)


def tokenized(path: str | None, tokenizer_dir: str, label: str | None = None,
              vocab_size: int | None = None) -> pathlib.Path:
    """The ids of the text at ``path`` under the tokenizer in ``tokenizer_dir``, tokenised once, with a
    progress bar, into a ``.npy`` beside the data (the default corpus's in ``_cache_directory``), named
    for both (a digest of the tokenizer's files and the texts' sizes and times), so a changed tokenizer
    or text is tokenised again. Documents are joined with the tokenizer's end-of-text id where it has
    one. ``label``: how the user gave the tokenizer, for messages (``--tokenizer DIR`` by default).
    A tokenizer with more ids than ``vocab_size`` is refused first, cached ids or not: nothing is
    tokenised into a file beside the user's text for a run that cannot train on it, and the answer
    does not depend on whether an earlier run left ids there."""
    from tqdm import tqdm

    label = label or f"--tokenizer {tokenizer_dir}"
    reader = hf_tokenizer.load(tokenizer_dir, label)
    if vocab_size is not None:
        hf_tokenizer.check_vocabulary(reader, vocab_size, label)
    directory = pathlib.Path(tokenizer_dir)
    files, name = _text_files(path)
    digest = hashlib.sha256(_TOKENISING)
    hf_tokenizer.add_files(digest, directory)
    for file in files:
        stat = file.stat()
        digest.update(f"{file}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    beside = pathlib.Path(path).resolve() if path is not None else _cache_directory() / "stdlib"
    cache = pathlib.Path(f"{beside}.tokens-{digest.hexdigest()[:12]}.npy")
    if cache.exists():
        try:
            _read_ids(cache)
            return cache
        except ValueError:  # damaged (a full disk, a copy cut short): it is ours to make again
            pass
    separator = [] if reader.eos_token_id is None else [reader.eos_token_id]
    dtype = np.uint16 if len(reader) <= 1 << 16 else np.uint32
    pieces = []
    with tqdm(total=sum(file.stat().st_size for file in files), desc=f"tokenising {name}", unit="B",
              unit_scale=True) as bar:
        for file in files:
            before = bar.n
            # UTF-8 whatever the locale (whose encoding would turn each other character into U+FFFD), and
            # newline="": the text's own line ends, \r\n and \r too, as the tokenizer would be given them
            with open(file, "rb") as raw, io.TextIOWrapper(raw, "utf-8", errors="replace", newline="") as text:
                for ids in _ids_by_piece(reader, _text_pieces(text)):
                    pieces.append(np.asarray(ids, dtype=dtype))
                    bar.update(before + raw.tell() - bar.n)
            pieces.append(np.asarray(separator, dtype=dtype))
    ids = np.concatenate(pieces)
    array = io.BytesIO()
    np.save(array, ids)
    # whole or absent, and each rank's own temporary file: the ranks of a torchrun job tokenise at once
    try:
        write_atomically(cache, array.getvalue())
    except WriteFailed as err:  # not skipped: the run reads the ids from this file, memory-mapped
        full = err.errno in (errno.ENOSPC, errno.EDQUOT)
        elsewhere = "with room" if full else "this process can write in"
        remedy = (f"set XDG_CACHE_HOME to a directory {elsewhere}" if path is None
                  else f"copy the text to a directory {elsewhere}")
        raise ValueError(f"--tokenizer: the ids of {name} go to {cache}, which could not be written: "
                         f"{err.strerror}; {'free space there, or ' if full else ''}{remedy}") from None
    return cache


def _text_pieces(text: io.TextIOBase, size: int = _TOKENISED_AT_ONCE) -> Iterator[str]:
    """The text of ``text`` in pieces of about ``size`` characters, for a tokenizer to take one at a
    time (``_ids_by_piece``): memory bounded by the piece, whatever the file's size (a tokenizer holds
    far more for each character it is given than the character: 230 bytes for a byte-level BPE), and
    Ctrl-C heard between pieces. A piece ends at a line end followed by a word, where tokenizers that
    split words at any white space (byte-level BPE: GPT-2's, Llama 3's) split the whole text too; a
    text with none within 16 pieces, at the last word's start. One with neither (a run of white space
    or of one word, megabytes long) is not cut inside it: a token's text cut there would be tokenised
    on both sides."""
    buffer = ""
    while chunk := text.read(size):
        buffer += chunk
        cut = _last_line_start(buffer)
        if cut == 0 and len(buffer) >= 16 * size:
            cut = _last_word_start(buffer)
        if cut:
            yield buffer[:cut]
            buffer = buffer[cut:]
    if buffer:
        yield buffer


def _ids_by_piece(reader, pieces: Iterable[str]) -> Iterator[list[int]]:
    """The ids of each of ``pieces``, as tokenising their text whole gives them. A tokenizer decides
    at the ends of what it is given otherwise than inside it (a space or a SentencePiece "▁" added
    before the first word, a run of white space taken whole at the end), so each piece is given
    between the last word of the one before and the first word of the one after, and keeps the ids
    whose text starts within it (by the offsets a fast tokenizer gives). The ids are the whole
    text's where the tokenizer splits words at any white space; one whose words run across line
    ends (SentencePiece's, split at spaces only) may differ in a word at a cut, as tokenising a text
    line by line does. A tokenizer without offsets (a slow one) is given each piece alone."""
    before, pieces = "", iter(pieces)
    piece = next(pieces, None)
    while piece is not None:
        after = next(pieces, None)
        left = _last_word(before[-_CONTEXT:])
        right = re.match(r"\s*\S*", (after or "")[:_CONTEXT]).group()
        try:
            encoded = reader(left + piece + right, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:  # a slow tokenizer: no offsets to tell the piece's ids from its context's
            yield reader(piece, add_special_tokens=False)["input_ids"]
        else:
            start, end = len(left), len(left) + len(piece)
            yield [i for i, (first, _) in zip(encoded["input_ids"], encoded["offset_mapping"]) if start <= first < end]
        before, piece = piece, after


def _last_line_start(text: str) -> int:
    """The position after the last line end of ``text`` that a character other than white space
    follows, or 0 where none does."""
    end = len(text) - 1  # the character after the line end must be in ``text``
    while (at := text.rfind("\n", 0, end)) >= 0:
        if not text[at + 1].isspace():
            return at + 1
        end = at
    return 0


def _last_word_start(text: str) -> int:
    """The position of the last character of ``text`` other than white space that white space
    precedes, or 0 where none is."""
    match = re.search(r"\s\S*\Z", text.rstrip())
    return match.start() + 1 if match else 0


def _last_word(text: str) -> str:
    """The end of ``text`` from the start of its last word (what follows white space), or all of it."""
    match = re.search(r"(?<=\s)\S+\s*$", text)
    return text[match.start():] if match else text


def _cache_directory() -> pathlib.Path:
    """Where ids of the default corpus go, which has no directory of the user's beside it:
    ``$XDG_CACHE_HOME/shardwire`` (``~/.cache/shardwire``)."""
    directory = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "shardwire"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _splits(data, name: str, unit: str, seq_len: int) -> dict:
    """The train and validation splits of ``data``, the last ``VALIDATION_FRACTION`` validating."""
    check_length(len(data), name, unit, seq_len)
    split = int(len(data) * (1 - VALIDATION_FRACTION))
    return {"train": data[:split], "val": data[split:]}


def check_length(length: int, name: str, unit: str, seq_len: int) -> None:
    """Refuse a corpus of ``length`` ``unit`` whose validation split holds no sequence of ``seq_len``."""
    if length - int(length * (1 - VALIDATION_FRACTION)) <= seq_len + 1:
        needed = math.ceil((seq_len + 2) / VALIDATION_FRACTION)
        raise ValueError(
            f"corpus {name} has only {length:,} {unit if length != 1 else unit[:-1]}: its validation split "
            f"({VALIDATION_FRACTION:.0%}) "
            f"must hold a sequence of {seq_len + 1} {unit}, so give it at least {needed:,} {unit}"
        )


def check_default_corpus(seq_len: int) -> None:
    """``check_length`` of the default corpus, from its files' sizes: reading them takes a while."""
    files, name = _text_files(None)
    check_length(sum(file.stat().st_size for file in files), name, "bytes", seq_len)


class DataChanged(RuntimeError):
    """The data changed under a run that reads it; its message names the file and what to do."""


_RESTORE = "restore it, and run again"


def identity(size: int, read: Callable[[int, int], bytes], name: str, tokens: int) -> dict:
    """What a checkpoint records of the data it was trained on, to name a resume on other data: its
    name, its length in tokens and fingerprints of its ``size`` bytes (``read(offset, count)``):
    ``sampled``, of its size, its first and last ``_FINGERPRINT_BYTES`` and ``_SAMPLED_BLOCKS``
    blocks spread evenly between (cheap at any size: another corpus, or an edit in place at the
    same size, is told, up to about 4 MiB wholly, and beyond unless the edit falls between the
    blocks), and ``fingerprint``, of its size and ends alone, which checkpoints written before
    ``sampled`` record."""
    ends = f"{size}:".encode() + read(0, _FINGERPRINT_BYTES) + read(max(0, size - _FINGERPRINT_BYTES),
                                                                      _FINGERPRINT_BYTES)
    fingerprint = hashlib.sha256(ends)
    sampled = fingerprint.copy()
    for block in range(1, _SAMPLED_BLOCKS + 1):
        sampled.update(read(size * block // (_SAMPLED_BLOCKS + 1), _SAMPLED_BYTES))
    return {"name": name, "tokens": tokens, "fingerprint": fingerprint.hexdigest()[:16],
            "sampled": sampled.hexdigest()[:16]}


def data_change(recorded: object, now: dict, tokenizer: str | None = None) -> str | None:
    """How the data ``now`` differs from what a checkpoint ``recorded`` (``identity``), for the resume
    line (which names a changed ``--data`` itself); None where they match, or where the checkpoint
    records none. ``tokenizer``: how the tokenizer that made the ids changed since, where it did: the
    ids of the same text then differ for that reason."""
    if not isinstance(recorded, dict):
        return None
    kind = "sampled" if "sampled" in recorded else "fingerprint"  # an older checkpoint's, of the ends alone
    if recorded.get(kind) == now[kind]:
        return None
    tokens = recorded.get("tokens")
    length = ("same length" if tokens == now["tokens"] else
              f"{tokens:,} -> {now['tokens']:,} tokens" if isinstance(tokens, int) else f"{now['tokens']:,} tokens")
    if tokenizer is not None:
        return f"{tokenizer}, and with it the ids of {now['name']} ({length})"
    if recorded.get("name") != now["name"]:
        return f"the data ({length})"
    return f"the contents of {now['name']} ({length})"


class _IdFile:
    """A token file's ids read by rows with ``pread``, not through the memory map: a file cut short
    while a run reads it then gives a short read, which ``DataChanged`` names in one line, where a
    memory map's read past the end kills the process with SIGBUS and no message. One ``fstat`` per
    batch (a microsecond beside a step) also names a file rewritten in place, at another size or at
    the same (its modification time)."""

    def __init__(self, file: pathlib.Path, ids: np.memmap):
        self._file = file
        self._fd = os.open(file, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)
        self._dtype = ids.dtype
        self._offset = ids.offset
        stat = os.fstat(self._fd)
        self._size, self._written = stat.st_size, stat.st_mtime_ns

    def check_unchanged(self) -> None:
        """Raise ``DataChanged`` where the file no longer has the size or the modification time it had
        when the run opened it."""
        stat = os.fstat(self._fd)
        if (stat.st_size, stat.st_mtime_ns) != (self._size, self._written):
            raise DataChanged(self._changed(stat.st_size))

    def read(self, start: int, count: int) -> np.ndarray:
        """``count`` ids from id ``start`` on."""
        width = self._dtype.itemsize
        data = os.pread(self._fd, count * width, self._offset + start * width)
        if len(data) < count * width:
            raise DataChanged(self._changed(os.fstat(self._fd).st_size))
        return np.frombuffer(data, dtype=self._dtype)

    def past_vocabulary(self, token: int, vocab_size: int) -> DataChanged:
        """A batch read holds ``token``, which the file did not hold when the run checked it."""
        return DataChanged(f"{self._file} changed while the run read it: it now holds token id {token:,}, past the "
                           f"model's vocabulary of {vocab_size:,} (rewritten in place): {_RESTORE}")

    def _changed(self, size: int) -> str:
        if size == self._size:
            return (f"{self._file} changed while the run read it: its modification time changed since the run "
                    f"started (rewritten in place, or touched: the run cannot tell which): {_RESTORE}")
        return (f"{self._file} changed while the run read it: it holds {size:,} bytes, {self._size:,} when the run "
                f"started (cut short, or rewritten in place): {_RESTORE}")


class _Sequences:
    """What both corpora read their sequences by: a split's rows of ``seq_len + 1`` tokens (inputs and
    shifted targets) starting where each reader says, in ``_read`` of each kind of storage."""

    splits: dict

    def batch(self, step: int, global_batch: int, seq_len: int, *, seed: int = 0, split: str = "train",
              rows: slice = slice(None)) -> torch.Tensor:
        """The global batch's ``rows`` (a rank's share; by default all), read without the others."""
        return self._read(_starts(len(self.splits[split]), global_batch, seq_len, seed, step, split)[rows], seq_len,
                          split)

    def windows(self, positions: list[int], seq_len: int, *, seed: int) -> torch.Tensor:
        """The train split's sequences at ``positions`` of its epochs (see the module's docstring)."""
        return self._read(epoch_starts(positions, len(self.splits["train"]), seq_len, seed), seq_len, "train")

    def _read(self, starts: list[int], seq_len: int, split: str) -> torch.Tensor:
        raise NotImplementedError


class TokenCorpus(_Sequences):
    """Pre-tokenised ids, memory-mapped to check them, read by rows (``_IdFile``) to train on."""

    def __init__(self, file: pathlib.Path, ids: np.memmap, seq_len: int, text: str | None = None,
                 vocab_size: int | None = None):
        self.name = str(file)
        self.ids = ids
        self.splits = _splits(ids, f"{text}, tokenised," if text else self.name, "tokens", seq_len)
        self._starts = {"train": 0, "val": len(self.splits["train"])}  # where each split begins, in ids
        self._file = _IdFile(file, ids)
        # the ids a batch may hold, where the model's vocabulary is given: one past it was written since
        # the run checked the file, and would end it in an IndexError inside the embedding
        self.vocab_size = vocab_size
        with file.open("rb") as f:
            self.identity = identity(os.fstat(f.fileno()).st_size,
                                     lambda offset, count: os.pread(f.fileno(), count, offset), text or self.name,
                                     len(ids))

    @classmethod
    def load(cls, path: str, seq_len: int, bin_dtype: str = "uint16", text: str | None = None,
             vocab_size: int | None = None) -> TokenCorpus:
        """The ids in ``path``; ``text``: the text a tokenizer made them of, named in messages and in the
        data's identity in place of the cache it wrote; ``vocab_size``: the model's, which every batch
        read is held to."""
        file = pathlib.Path(path)
        if not file.exists():
            raise FileNotFoundError(f"data path {path} {_missing(file)}: pass a .bin or .npy file of token ids")
        return cls(file, _read_ids(file, bin_dtype), seq_len, text, vocab_size)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def description(self) -> str:
        count = f"{self.num_tokens / 1e6:.1f}M" if self.num_tokens >= 100_000 else f"{self.num_tokens:,}"
        return f"{cut(self.name)}, {count} {self.ids.dtype} token ids"

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a corpus with an id the model's vocabulary does not have, naming the first one."""
        for start in range(0, len(self.ids), _CHECK_CHUNK):
            chunk = np.asarray(self.ids[start:start + _CHECK_CHUNK])
            if chunk.max(initial=0) >= vocab_size:
                at = start + int(np.argmax(chunk >= vocab_size))
                hint = (f" (or, if the .bin's ids are not {self.ids.dtype}, give --token-dtype)"
                        if self.name.endswith(".bin") else "")
                raise ValueError(f"{self.name} holds token id {int(self.ids[at])} at position {at:,}, but the model's "
                                 f"vocabulary has {vocab_size:,} ids: tokenise for this model, or pick a model "
                                 f"whose vocabulary covers it{hint}")

    def _read(self, starts: list[int], seq_len: int, split: str) -> torch.Tensor:
        begin = self._starts[split]
        self._file.check_unchanged()
        rows = np.stack([self._file.read(begin + s, seq_len + 1) for s in starts])
        if self.vocab_size is not None and rows.size and (token := int(rows.max())) >= self.vocab_size:
            raise self._file.past_vocabulary(token, self.vocab_size)
        return torch.from_numpy(rows.astype(np.int64))


def _width_held(ids: np.ndarray) -> int:
    """The width in bytes of the ids a ``.bin`` read as ``ids``' type seems to hold: its own, or wider
    where little-endian ids of a wider type (uint32, or 64 bits), of a vocabulary under half its width,
    are being read as narrower ones. The high half of each wide id, the second of every two narrow ids
    or the last two of every four, is then 0, which token data of any real text never is. Wider types
    are asked first: 64-bit ids read as uint16 also have every second id 0."""
    head = np.asarray(ids[: min(len(ids), _CHECK_CHUNK)])
    for width in (8, 4):
        parts = width // ids.dtype.itemsize
        if parts > 1 and len(head) >= 8 * parts:
            wide = head[: len(head) // parts * parts].reshape(-1, parts)
            if not wide[:, parts // 2:].any() and wide[:, : parts // 2].any():
                return width
    return ids.dtype.itemsize


def _wide_ids_refused(file: pathlib.Path, ids: np.ndarray) -> None:
    """Refuse a ``.bin`` of wider ids than ``ids``' type reads it as (``_width_held``), saying what to
    do: for uint32 ids, give ``--token-dtype uint32`` (or, for uint16 ids that sparse, write a
    ``.npy``); for 64-bit ids, which ``--token-dtype`` does not take, convert them. 64-bit ids are
    named as such read at either width: told to read them as uint32, a run once trained on them
    with every second id 0."""
    width = _width_held(ids)
    if width == ids.dtype.itemsize:
        return
    checked = f"its first {min(len(ids), _CHECK_CHUNK):,}"
    if width == 4:  # uint16 ids can be this sparse too: a .npy's header says which they are, unguessed
        npy = file.with_suffix(".uint16.npy")
        raise ValueError(f"{file} looks like uint32 ids read as uint16 (every second id of {checked} is 0): give "
                         f"--token-dtype uint32; if they are uint16 ids, write them as .npy, whose header names their "
                         f"type: numpy.save({str(npy)!r}, numpy.fromfile({str(file)!r}, numpy.uint16)), and give "
                         f"--data {shlex.quote(str(npy))}")
    zeros = (f"every second id of {checked} is 0" if ids.dtype.itemsize == 4 else
             f"the last two of every four ids of {checked} are 0")
    converted = file.with_suffix(".uint32.bin")
    raise ValueError(f"{file} looks like 64-bit ids read as {ids.dtype} ({zeros}), and "
                     f"--token-dtype takes {' or '.join(BIN_DTYPES)}: convert them, e.g. with numpy.fromfile("
                     f"{str(file)!r}, numpy.int64).astype(numpy.uint32).tofile({str(converted)!r}), and give "
                     f"--data {converted} --token-dtype uint32")


def _read_ids(file: pathlib.Path, bin_dtype: str = "uint16") -> np.ndarray:
    """The token ids in ``file``, memory-mapped: a flat ``.bin`` of ``bin_dtype``, or a ``.npy``
    whose header says its type. Raises ``ValueError`` naming the file where it holds no such ids."""
    if not file.is_file():
        raise ValueError(f"{file} is not a regular file: pass a .bin or .npy file of token ids")
    if file.suffix == ".bin":
        size, width = file.stat().st_size, np.dtype(bin_dtype).itemsize
        if not size:
            raise ValueError(f"{file} is empty: write its token ids again (a .bin holds them flat, nanoGPT's way)")
        if size % width:
            raise ValueError(f"{file} holds {size:,} bytes, not a whole number of {bin_dtype} ids: is it "
                             f"another element type (--token-dtype)?")
        ids = np.memmap(file, dtype=bin_dtype, mode="r")
        _wide_ids_refused(file, ids)
        return ids
    try:
        with file.open("rb") as f:
            head = f.read(len(_NPY_MAGIC))
        ids = np.load(file, mmap_mode="r") if head == _NPY_MAGIC else None  # never a pickle: allow_pickle stays False
    except (ValueError, OSError, EOFError, tokenize.TokenError) as err:  # TokenError: a header cut short
        raise ValueError(f"{file} is not a readable .npy file ({str(err).splitlines()[0][:200]}): write it "
                         f"again with numpy.save") from None
    if head != _NPY_MAGIC:  # numpy would take it for a pickle, and suggest loading it unsafely
        raise ValueError(f"{file} is not a NumPy .npy array file (it does not begin with the header numpy.save "
                         f"writes): a .npy holds token ids saved by numpy.save, a .bin flat ids, and a file of any "
                         f"other name is read as text")
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind != "u":
        shape = f"a {ids.ndim}-d {ids.dtype} array" if isinstance(ids, np.ndarray) else "no array"
        raise ValueError(f"{file} holds {shape}: token ids are a flat array of unsigned integers (uint16 or uint32)")
    return ids


_FEISTEL_ROUNDS = 4  # the rounds a Feistel network needs to be a strong pseudorandom permutation (Luby-Rackoff)


def epoch_starts(positions: list[int], length: int, seq_len: int, seed: int) -> list[int]:
    """Where the sequence at each of ``positions`` of a split's epochs starts: the split of
    ``length`` cut into ``(length - 1) // seq_len`` sequences of ``seq_len + 1`` (each one's last
    token the next one's first, as its target), each epoch a permutation of them drawn from the seed
    and the epoch's number. The permutation is a Feistel network over the next even power of two,
    walked until it lands among the sequences: a bijection computed a position at a time, in
    constant memory whatever the corpus's size (a shuffled index of 50M sequences would take 400 MB
    in every worker)."""
    count = (length - 1) // seq_len
    bits = max(2, (count - 1).bit_length())
    half = (bits + bits % 2) // 2
    mask = (1 << half) - 1
    found = []
    for position in positions:
        epoch, index = divmod(position, count)
        key = _mix(seed ^ _mix(epoch))
        while True:  # cycle-walking: under 4 rounds of the network on average, its domain under 4 x count
            left, right = index >> half, index & mask
            for round_ in range(_FEISTEL_ROUNDS):
                left, right = right, left ^ (_mix(key ^ (round_ << 56) ^ right) & mask)
            index = left << half | right
            if index < count:
                break
        found.append(index * seq_len)
    return found


_MASK64 = 2**64 - 1


def _mix(value: int) -> int:
    """SplitMix64's finaliser: 64 bits well stirred, for the epoch order's keys and rounds."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _starts(length: int, global_batch: int, seq_len: int, seed: int, step: int, split: str) -> list[int]:
    # a generator's seed is 64 bits: the largest --seed and step wrap around rather than overflow
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step * 2 + (split == "val")) % 2**64)
    return torch.randint(0, length - seq_len - 1, (global_batch,), generator=gen).tolist()


@functools.cache
def _standard_library_files() -> tuple[list[pathlib.Path], str]:
    """The default corpus's files: listed once per process, and without entering site-packages,
    where the installed packages (torch's tens of thousands of files among them) would make the walk
    take seconds."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [name for name in subdirectories if name != "site-packages"]
        files += [pathlib.Path(directory, name) for name in names if name.endswith(".py")]
    return sorted(files), f"the standard library's .py files ({root})"


def _text_files(path: str | None) -> tuple[list[pathlib.Path], str]:
    """The text files ``path`` names (a file, or every ``.py``/``.txt``/``.md`` file under a
    directory; None: the standard library's ``.py`` files), and a name for them."""
    if path is None:
        return _standard_library_files()
    root = pathlib.Path(path)
    if not root.exists():
        raise FileNotFoundError(f"data path {path} {_missing(root)}: pass a text file or a directory of them")
    if root.is_file():
        return [root], str(root)
    if not root.is_dir():  # a device or a FIFO would be read without end
        raise ValueError(f"data path {path} is neither a regular file nor a directory: pass a text file or a "
                         f"directory of them")
    return sorted(p for p in root.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()), str(root)


def read_as_text_problem(path: str, data: str | None, data_is: str, *, directory: bool) -> str | None:
    """What stops an output at ``path`` (a ``directory``, or a file) lying in the --data directory
    ``data`` (``data_is``: its words for it), or None: a run's text is every text file under it, so a
    file named as text, or a directory's (an exported tokenizer's merges.txt), written there changes
    the data, and the run's resume is refused for a changed corpus. Other files are never read."""
    if data is None or not os.path.isdir(data) or not (directory or path.endswith(TEXT_SUFFIXES)):
        return None
    return inside_problem(path, data, what=f"{data_is}, whose {', '.join(TEXT_SUFFIXES)} files are read as text")


class ByteCorpus(_Sequences):
    def __init__(self, data: bytes, name: str, seq_len: int):
        self.name = name
        self.splits = _splits(torch.frombuffer(bytearray(data), dtype=torch.uint8), name, "bytes", seq_len)
        self.identity = identity(len(data), lambda offset, count: data[offset:offset + count], name, len(data))

    @classmethod
    def load(cls, path: str | None, seq_len: int, memory: int | None = None) -> ByteCorpus:
        """The bytes of ``path`` (a file, or every ``.py``/``.txt``/``.md`` file under a directory),
        or of the standard library's ``.py`` files when ``path`` is None, for sequences of ``seq_len``;
        refused before reading where they need more than ``memory`` bytes (text is read whole, then
        copied into a tensor: twice its size)."""
        files, name = _text_files(path)
        size = sum(p.stat().st_size for p in files)
        if memory is not None and 2 * size > memory:
            raise ValueError(f"corpus {name} holds {size:,} bytes of text, read whole twice over, more than a "
                             f"worker here can hold ({memory / 2**30:.3g} GiB): write its ids to a .bin, which is "
                             f"memory-mapped, or give less text")
        data = b"".join(p.read_bytes() for p in files)
        if not data:
            what = "is empty" if len(files) == 1 else "holds no .py, .txt or .md file with any text"
            raise ValueError(f"data path {path} {what}: give it a text file or a directory of them")
        return cls(data, name, seq_len)

    @property
    def num_tokens(self) -> int:
        return sum(split.numel() for split in self.splits.values())

    @property
    def description(self) -> str:
        return f"{cut(self.name)}, {self.num_tokens / 1e6:.1f}M bytes as tokens"

    def check_vocab(self, vocab_size: int) -> None:
        if vocab_size < 256:
            raise ValueError(f"a text corpus is read as bytes, ids 0 to 255, but the model's vocabulary has "
                             f"{vocab_size} ids")

    def _read(self, starts: list[int], seq_len: int, split: str) -> torch.Tensor:
        data = self.splits[split]
        return torch.stack([data[s : s + seq_len + 1] for s in starts]).long()


def _missing(path: pathlib.Path) -> str:
    """Why ``path``, which does not exist as far as a reader can tell, cannot be read."""
    if path.is_symlink():
        return LEADS_NOWHERE
    return "does not exist"
