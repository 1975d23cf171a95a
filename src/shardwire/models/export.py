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

The directory appears whole or not at all (``shardwire.files.StagedDirectory``): it is written
beside the target under a temporary name, claimed for its writer, and renamed into place; a target
that exists and is not empty is refused rather than replaced. An export that fails part way (a
checkpoint's weight that is not finite, a diverged run) leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import struct
from collections.abc import Iterator

import torch
from torch import nn

from shardwire.engine.state_dict import TensorRecord, WeightsByUnit
from shardwire.extras import quietly_importing, require
from shardwire.files import StagedDirectory
from shardwire.models import tokenizer as hf_tokenizer
from shardwire.models.choice import (HF_PREFIX, MASTER_DTYPE, config_from_fields, first_line, hf_config,
                                     tokenizer_directory)

# save_pretrained's default: one file up to this size, several past it.
MAX_SHARD_SIZE = 50 * 10**9
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def save_pretrained(model_name: str, weights: WeightsByUnit, directory: str | pathlib.Path | StagedDirectory,
                    max_shard_size: int = MAX_SHARD_SIZE, *, fields: dict | None = None,
                    tokenizer: str | pathlib.Path | bool = True) -> pathlib.Path:
    """Write the ``hf:`` model ``model_name`` with ``weights`` as a ``save_pretrained`` directory, with
    a tokenizer; returns the directory. ``directory`` is a new one, or the stage of one claimed
    earlier (``shardwire train --export-hf`` claims it as the run starts). ``fields``: the config the
    weights were trained with (a checkpoint records it), instead of the one ``model_name`` holds now.
    ``tokenizer``: the directory of the tokenizer the model trained with, True for the model
    directory's own where it holds one, False for none. Raises ``ValueError`` saying what to change
    (``OutputRefused`` for the directory), and leaves nothing behind."""
    stage = directory if isinstance(directory, StagedDirectory) else StagedDirectory(directory, "export directory")
    try:
        with quietly_importing():  # transformers imports torchao, and warns of a config's defaults as it saves
            if not model_name.startswith(HF_PREFIX):
                raise ValueError(f"--model {model_name!r} is not a Hugging Face model: a save_pretrained directory is "
                                 f"for hf: models (export a GPT preset as a .safetensors or .pt file)")
            transformers = require("transformers", "exporting a Hugging Face model")
            config = (config_from_fields(transformers, fields) if fields is not None
                      else hf_config(transformers, model_name[len(HF_PREFIX):])[0])
            try:
                with torch.device("meta"):
                    model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False,
                                                                          dtype=MASTER_DTYPE)
            except Exception as err:  # a config transformers cannot build, however it says so
                raise ValueError(f"{model_name[:200]}: {first_line(err)}") from None
            tensors = _saved(model, weights)
            floating = next((t.dtype for t in tensors if t.dtype.is_floating_point), None)
            if floating is not None:  # as save_pretrained records the dtype it saved
                config.dtype = str(floating).removeprefix("torch.")
            _write_safetensors(stage.path, tensors, weights.parts, max_shard_size)
            config.save_pretrained(stage.path)
            if model.can_generate():
                model.generation_config.save_pretrained(stage.path)
            if tokenizer is True:
                tokenizer = tokenizer_directory(model_name) or False
            if tokenizer is not False:
                hf_tokenizer.load(tokenizer, f"the tokenizer in {tokenizer}").save_pretrained(stage.path)
            return stage.publish()
    except BaseException:
        stage.discard()
        raise


def fit_problem(model: nn.Module, weights: WeightsByUnit) -> str | None:
    """How ``weights`` do not fit ``model`` (built on the meta device), naming the first key and its
    shapes; None where every one of the model's keys is there with its shape, and no other."""
    expected = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    given = {tensor.name: tensor for tensor in weights.tensors}
    for key, shape in expected.items():
        tensor = given.get(weights.aliases.get(key, key))
        if tensor is None:
            return f"they have no {key!r} {list(shape)}"
        if tensor.shape != shape:
            return f"{key!r} is {list(tensor.shape)} in them and {list(shape)} in the model"
    extra = sorted(given.keys() - expected.keys())
    return f"the model has no {extra[0]!r}" if extra else None


def _saved(model, weights: WeightsByUnit) -> list[TensorRecord]:
    """The tensors of ``weights`` that ``save_pretrained`` of ``model`` (on the meta device) would write,
    checked against the model (``fit_problem``)."""
    if (problem := fit_problem(model, weights)) is not None:
        raise ValueError(f"the weights do not fit {type(model).__name__}: {problem}")
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
