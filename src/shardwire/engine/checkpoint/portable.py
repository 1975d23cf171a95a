"""Plain state dict files: exporting a checkpoint for use without shardwire, and importing one.

An export holds the unsharded model's ``state_dict()``: the same keys, full tensors, nothing about
shards or world sizes. As a ``torch.save`` file it loads with ``model.load_state_dict(torch.load(f))``;
tied weights (the GPT's embedding and output head) are one tensor under both names, as PyTorch
saves them. safetensors refuses tensors that share memory, so a ``.safetensors`` export stores each
tied weight once, under its first name, and ``safetensors.torch.load_model(model, f)`` restores the
tie; that is the library's documented way of loading shared weights.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import pickle
from collections.abc import Iterator

import safetensors.torch
import torch
from safetensors import safe_open
from torch import nn

from shardwire.engine.checkpoint.consensus import on_every_rank
from shardwire.engine.checkpoint.format import (
    REPLICATED,
    CheckpointError,
    buffer_key,
    buffer_records,
    param_names,
)
from shardwire.engine.checkpoint.load import copy_into_model
from shardwire.engine.checkpoint.reader import CheckpointReader
from shardwire.engine.selection import state_dict_key
from shardwire.engine.shard import engine_of
from shardwire.engine.state_dict import WeightsByUnit, describe
from shardwire.files import OutputRefused, inside_problem, new_output_problem, write_atomically


def export_state_dict(checkpoint: str | os.PathLike, output: str | os.PathLike) -> pathlib.Path:
    """Write the full weights of a checkpoint as a plain state dict file; returns its path.

    ``output`` ending in ``.safetensors`` (in any case) gives a safetensors file, anything else a
    ``torch.save`` file. It runs in one process, with no process group, from a checkpoint of any world
    size; every file it reads is verified against the manifest, and ``output`` appears only once
    complete, never over a file: an ``output`` that exists, or lies inside the checkpoint, is refused
    (``OutputRefused``) before any weight is read. A checkpoint whose weights are not finite (a
    diverged run) is refused.
    """
    if (problem := export_problem(output, checkpoint)) is not None:
        raise OutputRefused(f"{os.fspath(output)} {problem}")
    with weights_in(checkpoint, finite=True) as weights:
        state = weights.state_dict()
    output = pathlib.Path(output)
    if output.name.lower().endswith(".safetensors"):
        data = safetensors.torch.save(_each_tensor_once(state), metadata={"format": "pt"})
    else:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
    write_atomically(output, data, durable=True, new=True)
    return output


def export_problem(output: str | os.PathLike, checkpoint: str | os.PathLike) -> str | None:
    """What stops ``output`` being the new file an export of ``checkpoint`` writes, or None: it lies
    inside the checkpoint (whose files it would change while they are read), exists (a user's file
    is never replaced) or cannot be written. The words follow the path in a message."""
    return inside_problem(output, checkpoint, "exported") or new_output_problem(output)


def import_state_dict(model: nn.Module, path: str | os.PathLike) -> None:
    """Load a plain state dict file (``torch.save`` or safetensors) into a sharded model.

    Every rank must call it and keeps only the slices of its own shards. The file must hold every
    parameter and buffer of the unsharded model with its shape, and nothing else; a tied weight may
    be stored under any of its names. A file that does not fit raises a ``CheckpointError`` on every
    rank and changes nothing.
    """
    engine = engine_of(model)
    path = pathlib.Path(path)
    shards, buffers = on_every_rank(engine, f"importing {path}", lambda: _read_shards(path, engine, model))
    copy_into_model(engine, model, shards, buffers)
    engine.weights_loaded()


def read_state_dict(checkpoint: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The unsharded model's ``state_dict()`` from a checkpoint of any world size, in this process
    (every file read is verified against the manifest)."""
    with weights_in(checkpoint) as weights:
        return weights.state_dict()


@contextlib.contextmanager
def weights_in(checkpoint: str | os.PathLike, *, finite: bool = False) -> Iterator[WeightsByUnit]:
    """The unsharded weights of a checkpoint of any world size, a flat buffer at a time, read in this
    process while the block runs (every file read is verified against the manifest). With ``finite``
    a weight that is not finite raises a ``CheckpointError`` naming it: a diverged model, which an
    export must not hand on as a trained one."""
    with CheckpointReader(checkpoint) as reader:
        reader.check_complete()  # a file cut short that no part reads is damage all the same
        manifest = reader.manifest
        slots = [(slot, flat.packing.dtype) for flat in manifest.flats for slot in flat.packing.slots]
        tensors, aliases = describe(slots, manifest.buffers, manifest.state_dict_keys)
        parts = _read_parts(reader)
        yield WeightsByUnit(tensors, aliases, list(manifest.state_dict_keys),
                            _finite(parts, checkpoint) if finite else parts)


def _read_parts(reader: CheckpointReader) -> Iterator[dict[str, torch.Tensor]]:
    for flat in reader.manifest.flats:
        yield {slot.names[0]: reader.param_run(flat, reader.weights_key(flat), slot, 0, slot.numel, flat.packing.dtype)
               .view(slot.shape) for slot in flat.packing.slots}
    yield {buffer.name: reader.tensor(REPLICATED, buffer_key(buffer.name), buffer.shape, buffer.dtype)
           for buffer in reader.manifest.buffers}


def _finite(parts: Iterator[dict[str, torch.Tensor]], checkpoint) -> Iterator[dict[str, torch.Tensor]]:
    for part in parts:
        for name, value in part.items():
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise CheckpointError(f"{checkpoint} holds weights that are not finite ({name}): the run diverged "
                                      f"before it was saved; export an earlier checkpoint")
        yield part


def _each_tensor_once(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    unique: dict[int, tuple[str, torch.Tensor]] = {}
    for key, value in state.items():
        unique.setdefault(id(value), (key, value))
    return dict(unique.values())


def _read_shards(path: pathlib.Path, engine, model: nn.Module):
    source = _StateDictFile(path)
    buffers = buffer_records(engine, model)

    def key_of(name: str) -> str | None:  # a state dict's key (as the export writes), or the name itself
        return next((key for key in (state_dict_key(name), name) if key in source.keys()), None)

    named = param_names(engine) | {b.name for b in buffers}
    unexpected = sorted(source.keys() - named - {state_dict_key(name) for name in named})
    if unexpected:
        raise CheckpointError(f"{path}: holds {', '.join(map(repr, unexpected[:3]))}, which this model does not have")
    shards = {}
    for flat in engine.flats:
        tensors = []
        for slot in flat.packing.slots:
            key = next((key for key in map(key_of, slot.names) if key is not None), None)
            if key is None:
                raise CheckpointError(f"{path}: has no {state_dict_key(slot.names[0])!r}")
            tensors.append(source.tensor(key, slot.shape))
        shards[flat.name] = flat.packing.shard_of(tensors, flat.rank)
    missing = [b.name for b in buffers if key_of(b.name) is None]
    if missing:
        raise CheckpointError(f"{path}: has no {state_dict_key(missing[0])!r}")
    return shards, {b.name: source.tensor(key_of(b.name), b.shape) for b in buffers}


class _StateDictFile:
    """A state dict file, read lazily: safetensors by slices, torch.save files memory-mapped."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        if path.is_dir():
            raise CheckpointError(f"{path}: is a directory, and import_state_dict reads one state dict file; load "
                                  f"a shardwire checkpoint with load_checkpoint, or export it first (export_state_dict)")
        if not path.is_file():
            raise CheckpointError(f"{path}: no such file")
        try:
            if path.suffix == ".safetensors":
                self._file = safe_open(str(path), framework="pt", device="cpu")
                self._keys = set(self._file.keys())
            else:
                self._state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (OSError, RuntimeError, pickle.UnpicklingError, safetensors.SafetensorError) as err:
            raise CheckpointError(f"{path}: not a readable state dict file ({err})") from None
        if path.suffix != ".safetensors":
            if not isinstance(self._state, dict) or not all(isinstance(v, torch.Tensor) for v in self._state.values()):
                raise CheckpointError(f"{path}: holds a {type(self._state).__name__}, not a state dict of tensors")
            self._keys = set(self._state)

    def keys(self) -> set[str]:
        return self._keys

    def tensor(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = self._file.get_tensor(key) if self.path.suffix == ".safetensors" else self._state[key]
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: {key!r} has shape {tuple(tensor.shape)}, the model {tuple(shape)}")
        return tensor
