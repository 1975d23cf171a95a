"""A trained model written where its own ecosystem reads it.

A Hugging Face model (``--model hf:...``) becomes a ``save_pretrained`` directory: its weights as
safetensors, ``config.json``, and the tokenizer of its directory where it has one, so that
``AutoModelForCausalLM.from_pretrained(directory)`` (and ``AutoTokenizer``) load it as any other.

The weights come a unit at a time (``shardwire.engine.state_dict.WeightsByUnit``: gathered from the
live model, or read from a checkpoint), and are written as they come, so the exporting process
never holds the whole model. That works because a safetensors file begins with a header of every
tensor's name, dtype, shape and place in the file, which the model's description gives before any
value: the files are laid out first (split past ``max_shard_size`` as ``save_pretrained`` splits
them, with ``model.safetensors.index.json`` naming each tensor's file) and each tensor written to
its place when it arrives. A tied parameter is written once, under its first name, as
``save_pretrained`` writes it.

The directory appears whole or not at all: it is written beside the target under a temporary name
and renamed into place, and a target that exists and is not empty is refused rather than replaced.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator

import torch

from shardwire.engine.state_dict import TensorRecord, WeightsByUnit
from shardwire.extras import require
from shardwire.models.choice import HF_PREFIX, hf_config, tokenizer_directory

# save_pretrained's default: one file up to this size, several past it.
MAX_SHARD_SIZE = 50 * 10**9
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def save_pretrained(model_name: str, weights: WeightsByUnit, directory: str | pathlib.Path,
                    max_shard_size: int = MAX_SHARD_SIZE) -> pathlib.Path:
    """Write the ``hf:`` model ``model_name`` with ``weights`` as a ``save_pretrained`` directory, with
    its tokenizer where its directory has one; returns the directory. Raises ``ValueError`` saying
    what to change, before anything is written."""
    if not model_name.startswith(HF_PREFIX):
        raise ValueError(f"--model {model_name!r} is not a Hugging Face model: a save_pretrained directory is "
                         f"for hf: models (export a GPT preset as a .safetensors or .pt file)")
    directory = pathlib.Path(directory)
    check_new_directory(directory)
    transformers = require("transformers", "exporting a Hugging Face model")
    config, _ = hf_config(transformers, model_name[len(HF_PREFIX):])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    tensors = _saved(model, weights)
    floating = next((t.dtype for t in tensors if t.dtype.is_floating_point), None)
    if floating is not None:  # as save_pretrained records the dtype it saved
        config.dtype = str(floating).removeprefix("torch.")
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".partial"))
    try:
        _write_safetensors(staging, tensors, weights.parts, max_shard_size)
        config.save_pretrained(staging)
        if model.can_generate():
            model.generation_config.save_pretrained(staging)
        tokenizer = tokenizer_directory(model_name)
        if tokenizer is not None:
            transformers.AutoTokenizer.from_pretrained(
                tokenizer, local_files_only=True, trust_remote_code=False).save_pretrained(staging)
        staging.rename(directory)  # replaces an empty directory, atomically
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def _saved(model, weights: WeightsByUnit) -> list[TensorRecord]:
    """The tensors of ``weights`` that ``save_pretrained`` of ``model`` (on the meta device) would write,
    checked against the model: every one of its keys, with its shape, and no other."""
    expected = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    given = {tensor.name: tensor for tensor in weights.tensors}
    for key, shape in expected.items():
        tensor = given.get(weights.aliases.get(key, key))
        if tensor is None:
            raise ValueError(f"the weights do not fit {type(model).__name__}: they have no {key!r} {shape}")
        if tensor.shape != shape:
            raise ValueError(f"the weights do not fit {type(model).__name__}: {key!r} is {tensor.shape} in them "
                             f"and {shape} in the model")
    extra = sorted(given.keys() - expected.keys())
    if extra:
        raise ValueError(f"the weights do not fit {type(model).__name__}: it has no {extra[0]!r}")
    ignored = [re.compile(pattern) for pattern in getattr(model, "_keys_to_ignore_on_save", None) or ()]
    return [tensor for tensor in weights.tensors if not any(pattern.search(tensor.name) for pattern in ignored)]


def _write_safetensors(directory: pathlib.Path, tensors: list[TensorRecord],
                       parts: Iterator[dict[str, torch.Tensor]], max_shard_size: int) -> None:
    """Write ``tensors`` as the parts bring them into safetensors files laid out beforehand: one file
    up to ``max_shard_size`` bytes, past it several and their index."""
    files: list[list[TensorRecord]] = [[]]
    sizes = [0]
    for tensor in tensors:
        nbytes = _nbytes(tensor)
        if files[-1] and sizes[-1] + nbytes > max_shard_size:
            files.append([])
            sizes.append(0)
        files[-1].append(tensor)
        sizes[-1] += nbytes
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)])
    place = {tensor.name: i for i, file in enumerate(files) for tensor in file}
    writers = [_FileWriter(directory / name, file) for name, file in zip(names, files)]
    for part in parts:
        for name, value in part.items():
            if name in place:
                writers[place[name]].write(name, value)
    for writer in writers:
        writer.close()
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(sizes)},
                 "weight_map": {tensor.name: names[place[tensor.name]] for tensor in tensors}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


class _FileWriter:
    """One safetensors file: its header written first, from what its tensors are; each tensor's
    bytes written when it arrives, in the order the header places them."""

    def __init__(self, path: pathlib.Path, tensors: list[TensorRecord]):
        self._path = path
        self._order = [tensor.name for tensor in tensors]
        self._expected = {tensor.name: tensor for tensor in tensors}
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for tensor in tensors:
            header[tensor.name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                                   "data_offsets": [offset, offset + _nbytes(tensor)]}
            offset += _nbytes(tensor)
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._file = path.open("wb")
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, name: str, value: torch.Tensor) -> None:
        expected = self._expected[name]
        if not self._order or self._order[0] != name or tuple(value.shape) != expected.shape \
                or value.dtype != expected.dtype:
            raise RuntimeError(f"{name!r} came out of order or unlike its description, writing {self._path.name}")
        self._order.pop(0)
        self._file.write(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        if not self._order:
            self.close()

    def close(self) -> None:
        if self._order:
            raise RuntimeError(f"{self._path.name} is missing {self._order[0]!r}: the weights ended before it")
        self._file.close()


def _nbytes(tensor: TensorRecord) -> int:
    return math.prod(tensor.shape) * tensor.dtype.itemsize


def check_new_directory(directory: pathlib.Path) -> None:
    """``directory`` can take an export: absent, or an empty directory (nothing of the user's in it)."""
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise ValueError(f"{directory} exists and is not a directory: give a new directory to export to")
    if directory.is_dir() and any(directory.iterdir()):
        raise ValueError(f"{directory} is not empty: give a new directory to export to (nothing is overwritten)")
