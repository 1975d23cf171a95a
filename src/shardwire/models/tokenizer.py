"""A Hugging Face tokenizer's directory, as shardwire reads it: loaded as data (the code an
``auto_map`` names never runs), and known by a digest of its files, so that what was trained with it
can tell whether the directory still holds the same tokenizer (a checkpoint records it; ``export``
writes it beside the weights only while it does)."""

from __future__ import annotations

import hashlib
import pathlib
import re

from shardwire.extras import require
from shardwire.models.choice import check_files, custom_code, transformers_notes
from shardwire.models.gpt import PRESETS
from shardwire.sim.huggingface import TOKENIZER_FILES, has_tokenizer


# What a model's directory holds beside its tokenizer: the model's weights, and notes. A tokenizer's
# files are the rest (tokenizer.json, vocab.json, merges.txt, spiece.model, bpe.codes...), every one
# of them, as a file of a kind not listed here may be one a tokenizer reads; config.json among them,
# whose model_type picks the tokenizer's class where its tokenizer_config.json names none.
_NOT_THE_TOKENIZERS = re.compile(r"(generation_config\.json|.*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack)"
                                 r"|.*\.index\.json|readme.*|license.*|.*\.md|\.gitattributes)", re.IGNORECASE)


def add_files(digest: "hashlib._Hash", directory: pathlib.Path, *, every_file: bool = False) -> None:
    """Add the names and contents of the tokenizer's files in ``directory`` to ``digest`` (with
    ``every_file``, of all its files, as earlier versions recorded it): a README added beside a
    model's tokenizer, or its weights trained on, leave the tokenizer the same."""
    for file in sorted(p for p in directory.iterdir() if p.is_file()):
        if not every_file and _NOT_THE_TOKENIZERS.fullmatch(file.name):
            continue
        digest.update(file.name.encode())
        with file.open("rb") as f:  # in pieces: a tokenizer's files can be large
            for piece in iter(lambda: f.read(1 << 20), b""):
                digest.update(piece)


def digest_of(directory: str | pathlib.Path, *, every_file: bool = False) -> str:
    """A sha256 of the tokenizer's files, names and contents (``add_files``)."""
    digest = hashlib.sha256()
    add_files(digest, pathlib.Path(directory), every_file=every_file)
    return digest.hexdigest()


def holds(directory: str | pathlib.Path, recorded: object) -> bool:
    """Whether ``directory`` holds the tokenizer a checkpoint ``recorded`` the digest of: of its
    tokenizer's files, or of all its files, as earlier versions recorded it."""
    return digest_of(directory) == recorded or digest_of(directory, every_file=True) == recorded


def check(directory: str | pathlib.Path, label: str) -> pathlib.Path:
    """``directory`` as a tokenizer's, before any of its files is read: a directory, of regular
    files, whose code (an ``auto_map``) is not needed; raises ``ValueError`` beginning with ``label``
    (how the user gave it: ``--tokenizer DIR``, or the model's own) and saying what is wrong."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{label} is not a directory: give a local Hugging Face tokenizer's directory (as "
                         f"save_pretrained writes it)")
    if not has_tokenizer(str(directory)):
        raise ValueError(f"{label} holds none of a tokenizer's files ({', '.join(TOKENIZER_FILES)}): give a "
                         f"directory a tokenizer's save_pretrained wrote")
    try:
        check_files(directory)
    except ValueError as err:
        raise ValueError(f"{label}: {err}") from None
    if (problem := custom_code(directory / "tokenizer_config.json")) is not None:
        # refused even where transformers would load another class for it: written beside an export,
        # its auto_map would name code the export does not hold
        raise ValueError(f"{label}: {problem}")
    return directory


def load(directory: str | pathlib.Path, label: str):
    """The tokenizer in ``directory`` (``check``ed first); raises ``ValueError`` as ``check`` does, in
    one line: transformers' own message, whole, its lines joined, and what to give."""
    directory = check(directory, label)
    transformers = require("transformers", "a Hugging Face tokenizer")
    try:  # a tokenizer directory is data: the code its auto_map names never runs
        with transformers_notes(label):
            return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True,
                                                              trust_remote_code=False)
    except Exception as err:  # a tokenizer transformers cannot read, however it says so
        problem = custom_code(directory / "config.json")
        if problem is not None:
            raise ValueError(f"{label}: {problem}") from None
        said = " ".join(str(err).split()) or type(err).__name__
        model = directory / "tokenizer.model"
        if "tiktoken" in said and model.is_file() and not _tiktoken_file(model):
            # transformers tries a tokenizer.model it cannot read as SentencePiece as tiktoken's last
            raise ValueError(f"{label}: its tokenizer.model is neither a SentencePiece model nor a tiktoken "
                             f"file: give a directory a tokenizer's save_pretrained wrote") from None
        raise ValueError(f"{label}: transformers cannot read it ({said}): give a directory a tokenizer's "
                         f"save_pretrained wrote") from None


def _tiktoken_file(file: pathlib.Path) -> bool:
    """Whether ``file`` begins as a tiktoken vocabulary does: a line of a base64 token and its rank."""
    try:
        with file.open("rb") as f:
            first = f.read(4096).split(b"\n", 1)[0].split(b" ")
    except OSError:
        return False
    return len(first) == 2 and first[1].isdigit() and bool(re.fullmatch(rb"[A-Za-z0-9+/=]+", first[0]))


def check_vocabulary(tokenizer, vocab_size: int, label: str) -> None:
    """Refuse ``tokenizer`` (``label``: how the user gave it) where it has more ids than the model's
    ``vocab_size``: its ids past the vocabulary index no embedding. Its length counts the tokens added
    to it, which ``tokenizer.vocab_size`` leaves out. Asked before any text is tokenised: the text
    would otherwise be tokenised whole only for the run to refuse the first id past the vocabulary."""
    size = len(tokenizer)
    if size > vocab_size:
        preset = next((name for name, config in PRESETS.items() if config.vocab_size >= size), None)
        or_preset = f", or --model {preset} ({PRESETS[preset].vocab_size:,} ids)" if preset else ""
        raise ValueError(f"{label} has {size:,} ids, but the model's vocabulary has {vocab_size:,}: give a model "
                         f"whose vocabulary holds them, an hf: model with a vocab_size of {size:,} or more{or_preset}; "
                         f"or a tokenizer of at most {vocab_size:,} ids")
