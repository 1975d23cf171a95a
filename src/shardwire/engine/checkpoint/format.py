"""The on-disk format of a checkpoint: its files, its manifest, and the checks that refuse a bad one.

A checkpoint is a directory::

    step_00000400/
        rank_00000.safetensors   rank 0's shard of every flat buffer, its per-element optimizer
        rank_00001.safetensors   state (Adam's moments) and its RNG states; one file per rank
        ...
        replicated.safetensors   what every rank holds alike: the model's buffers and the scalar
                                 optimizer state (Adam's step count)
        manifest.json            written last: each flat buffer's layout, the optimizer's class and
                                 hyperparameters, the step, the caller's ``extra``, and the size and
                                 sha256 of every file above

The manifest describes each flat buffer completely (parameter names, shapes, offsets, dtype, the
world size it was sharded for), so a loader at another world size knows which byte ranges of which
rank files make up its own new shard, and an export needs no model at all. safetensors files can be
read by slice, so a rank reads only the parts of old shards that overlap its new one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import re
import secrets
from collections.abc import Iterator
from itertools import zip_longest

import torch

from shardwire.engine.layout import FlatLayout, ParamSlot

FORMAT = "shardwire-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
REPLICATED = "replicated.safetensors"

# A directory being written, or hidden before deletion, has a temporary name beside its final one,
# so only complete checkpoints ever carry a checkpoint's name.
_TEMPORARY = re.compile(r".+\.tmp-[0-9a-f]{12}")

# Kinds of optimizer state. Per-element state has the shard's shape and is re-sliced like the
# parameters; scalar state (a step count) is the same on every rank and is saved once.
PER_ELEMENT = "per_element"
SCALAR = "scalar"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded; the message names the file and the reason."""


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def new_token() -> str:
    """A random token for a temporary name (ranks that share a directory agree on one)."""
    return secrets.token_hex(6)


def temporary_name(name: str, token: str) -> str:
    return f"{name}.tmp-{token}"


def is_temporary(name: str) -> bool:
    return _TEMPORARY.fullmatch(name) is not None


def param_key(flat: str) -> str:
    return f"param/{flat}"


def optim_key(flat: str, state: str) -> str:
    return f"optim/{flat}/{state}"


def buffer_key(name: str) -> str:
    return f"buffer/{name}"


def rng_key(device_type: str) -> str:
    return f"rng/{device_type}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclasses.dataclass(frozen=True)
class FileRecord:
    name: str
    nbytes: int
    sha256: str

    @classmethod
    def of(cls, name: str, data: bytes) -> "FileRecord":
        return cls(name, len(data), hashlib.sha256(data).hexdigest())


@dataclasses.dataclass(frozen=True)
class FlatRecord:
    """A flat buffer as saved: its layout at the saving world size, and for each key of its optimizer
    state the kind (``PER_ELEMENT`` or ``SCALAR``) and dtype; ``None`` when no optimizer holds it."""

    name: str
    layout: FlatLayout
    optimizer_state: dict[str, dict[str, str]] | None


@dataclasses.dataclass(frozen=True)
class BufferRecord:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass
class Manifest:
    step: int | None
    world_size: int
    flats: list[FlatRecord]
    buffers: list[BufferRecord]
    state_dict_keys: list[str]  # the unsharded model's, in order: what an export writes
    optimizer: dict | None  # {"class": name, "param_groups": [hyperparameters + flat names]}
    extra: object
    files: list[FileRecord]

    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "flats": [_flat_to_json(flat) for flat in self.flats],
            "buffers": [
                {"name": b.name, "shape": list(b.shape), "dtype": dtype_name(b.dtype)} for b in self.buffers
            ],
            "state_dict_keys": self.state_dict_keys,
            "optimizer": self.optimizer,
            "extra": self.extra,
            "files": [dataclasses.asdict(f) for f in self.files],
        }, indent=1)

    @classmethod
    def read(cls, directory: pathlib.Path) -> "Manifest":
        """The manifest of the checkpoint in ``directory``; a ``CheckpointError`` naming the file
        and what is wrong with it otherwise."""
        path = directory / MANIFEST
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: no such checkpoint directory")
        if not path.is_file():
            raise CheckpointError(f"{path}: missing; {directory} is not a complete shardwire checkpoint")
        try:
            raw = json.loads(path.read_text())
            if not isinstance(raw, dict):
                raise ValueError(f"a JSON {type(raw).__name__}, not an object")
            if raw.get("format") != FORMAT:
                raise ValueError(f"format is {raw.get('format')!r}, not {FORMAT!r}")
            if raw.get("version") != VERSION:
                raise ValueError(f"format version {raw.get('version')!r}; this shardwire reads version {VERSION}")
            world_size = raw["world_size"]
            return cls(
                step=raw["step"],
                world_size=world_size,
                flats=[_flat_from_json(flat, world_size) for flat in raw["flats"]],
                buffers=[BufferRecord(b["name"], tuple(b["shape"]), parse_dtype(b["dtype"])) for b in raw["buffers"]],
                state_dict_keys=raw["state_dict_keys"],
                optimizer=raw["optimizer"],
                extra=raw["extra"],
                files=[FileRecord(**f) for f in raw["files"]],
            )
        except (ValueError, KeyError, TypeError) as err:  # JSONDecodeError is a ValueError
            raise CheckpointError(f"{path}: unreadable manifest ({type(err).__name__}: {err})") from None


def _flat_to_json(flat: FlatRecord) -> dict:
    layout = flat.layout
    return {
        "name": flat.name,
        "dtype": dtype_name(layout.dtype),
        "world_size": layout.world_size,
        "numel": layout.numel,
        "padded_numel": layout.padded_numel,
        "slots": [{"names": list(s.names), "shape": list(s.shape), "offset": s.offset} for s in layout.slots],
        "optimizer_state": flat.optimizer_state,
    }


def _flat_from_json(raw: dict, world_size: int) -> FlatRecord:
    slots = tuple(ParamSlot(tuple(s["names"]), tuple(s["shape"]), s["offset"]) for s in raw["slots"])
    layout = FlatLayout(slots, parse_dtype(raw["dtype"]), raw["world_size"])
    packed = FlatLayout.pack([(s.names, s.shape) for s in slots], layout.dtype, layout.world_size)
    if (packed != layout or layout.world_size != world_size or layout.numel != raw["numel"]
            or layout.padded_numel != raw["padded_numel"]):
        raise ValueError(f"the layout of flat buffer {raw['name']!r} is inconsistent")
    return FlatRecord(raw["name"], layout, raw["optimizer_state"])


def param_names(engine) -> set[str]:
    """The names of the sharded parameters, every name of a tied one included."""
    return {name for flat in engine.flats for slot in flat.layout.slots for name in slot.names}


def buffer_records(engine, model: torch.nn.Module) -> list[BufferRecord]:
    """The model's persistent buffers (those in its ``state_dict``), which every rank holds whole."""
    params = param_names(engine)
    return [
        BufferRecord(key, tuple(buffer.shape), buffer.dtype)
        for key in engine.state_dict_keys if key not in params
        for buffer in [model.get_buffer(key)]
    ]


def first_difference(saved: Manifest, flats: list[FlatRecord], buffers: list[BufferRecord]) -> str | None:
    """How the model that wrote ``saved`` differs from one with ``flats`` and ``buffers`` (the first
    difference, in words), or None when they match: same flat buffers, holding the same parameters
    (names, shapes, order) in the same dtypes, and the same buffers."""
    return next(_differences(saved, flats, buffers), None)


def _differences(saved: Manifest, flats: list[FlatRecord], buffers: list[BufferRecord]) -> Iterator[str]:
    for i, (old, new) in enumerate(zip_longest(saved.flats, flats)):
        if old is None or new is None:
            yield (f"the checkpoint has {len(saved.flats)} flat buffers (one per unit and dtype) and this "
                   f"model {len(flats)}: were its units chosen differently?")
            return
        if old.name != new.name:
            yield f"flat buffer {i} is {old.name!r} in the checkpoint and {new.name!r} in this model"
            return
        if old.layout.dtype != new.layout.dtype:
            yield (f"flat buffer {old.name!r} is {dtype_name(old.layout.dtype)} in the checkpoint and "
                   f"{dtype_name(new.layout.dtype)} in this model")
        for a, b in zip_longest(old.layout.slots, new.layout.slots):
            if a is None:
                yield f"{b.names[0]!r} (in flat buffer {old.name!r}) is not in the checkpoint"
            elif b is None:
                yield f"the checkpoint's {a.names[0]!r} (in flat buffer {old.name!r}) is not in this model"
            elif a.names != b.names:
                yield (f"flat buffer {old.name!r} holds {', '.join(a.names)} in the checkpoint where this "
                       f"model has {', '.join(b.names)}")
            elif a.shape != b.shape:
                yield f"{a.names[0]!r} has shape {a.shape} in the checkpoint and {b.shape} in this model"
    old_buffers = {b.name: b for b in saved.buffers}
    new_buffers = {b.name: b for b in buffers}
    for name in sorted(old_buffers.keys() ^ new_buffers.keys()):
        where = "the checkpoint" if name in old_buffers else "this model"
        yield f"buffer {name!r} exists only in {where}"
    for name in sorted(old_buffers.keys() & new_buffers.keys()):
        a, b = old_buffers[name], new_buffers[name]
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            yield (f"buffer {name!r} is {dtype_name(a.dtype)}{list(a.shape)} in the checkpoint and "
                   f"{dtype_name(b.dtype)}{list(b.shape)} in this model")
