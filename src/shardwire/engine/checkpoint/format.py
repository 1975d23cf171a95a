"""The on-disk format of a checkpoint: its files, its manifest, and the checks that refuse a bad one.

A checkpoint is a directory::

    step_00000400/
        rank_00000.safetensors   rank 0's shard of every flat buffer (its rows of each parameter),
        rank_00001.safetensors   its per-element optimizer state (Adam's moments) laid out like
                                 those shards, the scalar
        ...                      optimizer state (Adam's step count) of the parameters whose first
                                 element it holds, its RNG states and its gradients' error-feedback
                                 residuals (quantized wires); one file per rank. Under
                                 hybrid sharding every group holds the same shards, and only the
                                 first group's ranks save them: a buffer's packing is then cut for
                                 fewer ranks than saved, and the other ranks' files hold RNG states.
                                 Groups that sync every H steps hold models of their own between
                                 syncs, so each group saves its shards and optimizer state (``groups``
                                 of them, group g in the files of ranks g*G onwards), and each rank
                                 also the outer optimizer's state laid out like its shards
        replicated.safetensors   what every rank holds alike: the model's buffers
        manifest.json            written last: each flat buffer's packing, the optimizer's class,
                                 param groups (hyperparameters, parameter names) and which state
                                 each parameter has, the step, the caller's ``extra``, the size and
                                 sha256 of every file above, and the sha256 of its own contents

The manifest describes each flat buffer completely (parameter names, shapes, offsets, dtype, the
world size it was sharded for), so a loader at another world size knows which byte ranges of which
rank files make up its own new shard, and an export needs no model at all. safetensors files can be
read by slice, so a rank reads only the parts of old shards that overlap its new one.

A manifest is untrusted input like any file: reading one checks its own sha256, then every field's
type and range, then that the fields agree (one file per saving rank, each a plain name inside the
checkpoint directory; buffers that pack as recorded); a manifest that fails is refused as a whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import secrets
from collections.abc import Iterator
from itertools import zip_longest

import torch

from shardwire.engine.checkpoint import schema
from shardwire.engine.packing import Packing, ParamSlot
from shardwire.engine.state_dict import TensorRecord
from shardwire.files import CHECKPOINT_FORMAT, CHECKPOINT_MANIFEST, kind_of

FORMAT = CHECKPOINT_FORMAT  # by which the output policy, too, tells a checkpoint (shardwire.files)
# 2: the manifest records its own sha256; 3: optimizer state per parameter; 4: buffers may be
# sharded over fewer ranks than saved (hybrid sharding); 5: groups that saved shards of their own;
# 6: shards hold each parameter's rows (``Packing`` by rows), where earlier ones held equal runs of
# the parameters laid end to end (read as such); 7: each file's modification time as its writer saw
# it, the proof that nothing was written over it since (``ownership.not_a_checkpoint``)
VERSION = 7
MANIFEST = CHECKPOINT_MANIFEST
# A manifest holds about a kilobyte per flat buffer, file and tensor record: a model of tens of
# thousands of units stays under a few MB. A larger file is read no further (it would take seconds
# and gigabytes to parse), and is none of shardwire's.
MAX_MANIFEST_BYTES = 64 << 20
REPLICATED = "replicated.safetensors"

# Kinds of optimizer state. Per-element state has the shape of the parameter's part and is re-sliced
# like the parameters; scalar state (a step count) is the same on every rank and is saved once.
PER_ELEMENT = "per_element"
SCALAR = "scalar"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded; the message names the file and the reason."""


class CheckpointRefused(CheckpointError):
    """A checkpoint, whole and as saved, that is not loaded for what it holds: weights that are not
    finite, groups whose states differ, a schedule or a step no run leaves, another model's. Unlike
    a damaged one, it may be all the user has of its step: a save of that step sets it aside."""


class DirectoryMoved(CheckpointError):
    """The directory a run saves in was moved, removed or replaced under it, so that its next save
    would go where nothing of the run's is: the message says what the run found there."""


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def new_token() -> str:
    """A random token for a temporary name (ranks that share a directory agree on one)."""
    return secrets.token_hex(6)


def temporary_name(name: str, token: str) -> str:
    """The name beside ``name`` of a directory being written or hidden before deletion, so that only
    complete checkpoints ever carry a checkpoint's name."""
    return f"{name}.tmp-{token}"


def param_key(flat: str) -> str:
    return f"param/{flat}"


def optim_key(flat: str, state: str) -> str:
    """Per-element optimizer state of a flat buffer's parameters, laid out like its shard."""
    return f"optim/{flat}/{state}"


def scalar_key(param: str, state: str) -> str:
    """Scalar optimizer state of one parameter."""
    return f"optim-scalar/{param}/{state}"


def buffer_key(name: str) -> str:
    return f"buffer/{name}"


def rng_key(device_type: str) -> str:
    return f"rng/{device_type}"


def residual_key(flat: str, reduction: str) -> str:
    return f"residual/{flat}/{reduction}"


def measure_key(flat: str) -> str:
    """This rank's own change of the sync in flight of a flat buffer, squared and summed (what
    ``OuterLoop.metrics`` measures the groups' drift by): one number, the rank's own."""
    return f"outer-measure/{flat}"


def outer_key(flat: str, state: str) -> str:
    """The outer optimizer's state of a flat buffer (sync every H steps), laid out like its shard."""
    return f"outer/{flat}/{state}"


# The outer optimisation's schedule: inner steps done, the step whose sync was issued, the step the
# sync in flight is applied after (``OuterLoop.state``).
OUTER_SCHEDULE = "outer/schedule"
# Between fault-tolerant groups, the quorum's count of the syncs this group committed and of the
# batches they averaged (``Quorum.state``): a group resumed from an older checkpoint than the others'
# is then behind at its first sync and recovers their state, rather than averaging from another anchor.
OUTER_QUORUM = "outer/quorum"


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
    mtime_ns: int | None = None  # as its writer saw it once durable; None before format 7

    @classmethod
    def of(cls, path: pathlib.Path, data: bytes) -> "FileRecord":
        """The record of ``data``, just written durably to ``path``."""
        return cls(path.name, len(data), hashlib.sha256(data).hexdigest(), path.stat().st_mtime_ns)


@dataclasses.dataclass(frozen=True)
class FlatRecord:
    """A flat buffer as saved: its name and its packing at the saving world size."""

    name: str
    packing: Packing


@dataclasses.dataclass
class Manifest:
    step: int | None
    world_size: int
    flats: list[FlatRecord]
    buffers: list[TensorRecord]
    state_dict_keys: list[str]  # the unsharded model's, in order, as names: what an export writes (as its keys)
    # {"class": name, "param_groups": [hyperparameters + parameter names],
    #  "state": {parameter name: {state key: {"kind", "dtype"}}}}
    optimizer: dict | None
    extra: object
    files: list[FileRecord]
    # groups whose ranks saved shards of their own (group g: the files of ranks g * G onwards, for
    # buffers packed for G ranks): 1 where every group holds the same (sync every H steps: each)
    groups: int = 1
    version: int = VERSION  # of the format it was written in

    def to_json(self) -> str:
        body = {
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
            "groups": self.groups,
        }
        # "format" first, indented by one: ``shardwire.files.checkpoint_problem`` tells a checkpoint by
        # these first bytes, without reading (or trusting) the rest
        return json.dumps({**body, "sha256": _body_sha256(body)}, indent=1)

    @classmethod
    def read(cls, directory: pathlib.Path) -> "Manifest":
        """The manifest of the checkpoint in ``directory``, checked whole (see ``from_json``); a
        ``CheckpointError`` naming the file and what is wrong with it otherwise."""
        path = directory / MANIFEST
        if not directory.is_dir():
            raise CheckpointError(_not_a_directory(directory))
        if not path.is_file():
            what = "not a regular file" if os.path.lexists(path) else "missing"
            raise CheckpointError(f"{path}: {what}; {directory} is not a complete shardwire checkpoint")
        try:
            with path.open("rb") as f:
                data = f.read(MAX_MANIFEST_BYTES + 1)
            if len(data) > MAX_MANIFEST_BYTES:
                raise CheckpointError(f"{path}: larger than {MAX_MANIFEST_BYTES:,} bytes, more than any manifest "
                                      f"holds; {directory} is not a shardwire checkpoint")
            raw = json.loads(data)
        except (OSError, ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
            raise CheckpointError(f"{path}: unreadable manifest ({type(err).__name__}: {err})") from None
        try:
            return cls.from_json(raw)
        except ValueError as err:
            raise CheckpointError(f"{path}: invalid manifest: {err}") from None

    @classmethod
    def from_json(cls, raw) -> "Manifest":
        """A parsed manifest, every value checked before use: its own sha256 (version 2), then each
        field's type and range, then that the fields agree with each other; a ``ValueError`` saying
        what is wrong otherwise."""
        if not isinstance(raw, dict):
            raise ValueError(f"a JSON {type(raw).__name__}, not an object")
        if raw.get("format") != FORMAT:
            raise ValueError(f"format is {schema.shown(raw.get('format'))}, not {FORMAT!r}")
        version = raw.get("version")
        if type(version) is not int or version not in _READABLE_VERSIONS:
            raise ValueError(f"format version {schema.shown(version)}; this shardwire reads versions "
                             f"{', '.join(map(str, _READABLE_VERSIONS))}")
        if version != 1:
            body = {key: value for key, value in raw.items() if key != "sha256"}
            if schema.sha256(raw.get("sha256"), "sha256") != _body_sha256(body):
                raise ValueError("its contents differ from the sha256 it records: the manifest is corrupted")
        keys = (*_KEYS, "sha256") if version != 1 else _KEYS
        raw = schema.fields(raw, "the manifest", (*keys, "groups") if version >= 5 else keys)
        step = None if raw["step"] is None else schema.integer(raw["step"], "step")
        world_size = schema.integer(raw["world_size"], "world_size", minimum=1)
        groups = schema.integer(raw["groups"], "groups", minimum=1) if version >= 5 else 1
        files = _files_from_json(raw["files"], world_size, version)
        flats = [_flat_from_json(flat, f"flats[{i}]", world_size, version)
                 for i, flat in enumerate(schema.array(raw["flats"], "flats"))]
        schema.unique([flat.name for flat in flats], "the flat buffers' names")
        buffers = [_buffer_from_json(buffer, f"buffers[{i}]")
                   for i, buffer in enumerate(schema.array(raw["buffers"], "buffers"))]
        state_dict_keys = [schema.string(key, f"state_dict_keys[{i}]")
                           for i, key in enumerate(schema.array(raw["state_dict_keys"], "state_dict_keys"))]
        names = [name for flat in flats for slot in flat.packing.slots for name in slot.names]
        names += [buffer.name for buffer in buffers]
        schema.unique(names, "the parameter and buffer names")
        if sorted(schema.unique(state_dict_keys, "state_dict_keys")) != sorted(names):
            raise ValueError("state_dict_keys are not the names of the parameters and buffers it describes")
        if version >= 3:
            _check_optimizer(raw["optimizer"], flats)
        if any(groups * flat.packing.world_size > world_size for flat in flats):
            raise ValueError(f"groups is {groups}, more than the {world_size} saving ranks hold for its flat buffers")
        return cls(step, world_size, flats, buffers, state_dict_keys, raw["optimizer"], raw["extra"], files,
                   groups=groups, version=version)


def _not_a_directory(path: pathlib.Path) -> str:
    """Why ``path``, which is not a directory, holds no checkpoint, and what to give instead: a
    checkpoint is the directory its save wrote, and a file in one (its manifest, a rank's shard) is
    named by that directory."""
    if not path.exists():
        return f"{path}: no such checkpoint directory"
    if (path.parent / MANIFEST).is_file():
        return (f"{path} is {kind_of(path)} of a checkpoint, not a checkpoint directory: give the checkpoint that "
                f"holds it, {path.parent}")
    return (f"{path} is {kind_of(path)}, not a checkpoint directory: give a directory a save wrote (a step_00000400 "
            f"under `shardwire train --checkpoint-dir`)")


# Version 1 manifests (before a manifest recorded its own sha256) are read with every other check;
# the optimizer state of versions 1 and 2 (kept per flat buffer) is not read.
_READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, VERSION)
_KEYS = ("format", "version", "step", "world_size", "flats", "buffers", "state_dict_keys", "optimizer", "extra",
         "files")


def _body_sha256(body: dict) -> str:
    """The sha256 of a manifest's fields serialized canonically (sorted keys, no whitespace): a
    checksum of the values, which JSON parsing and serializing give back exactly, floats included."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _flat_to_json(flat: FlatRecord) -> dict:
    packing = flat.packing
    return {
        "name": flat.name,
        "dtype": dtype_name(packing.dtype),
        "world_size": packing.world_size,
        "numel": packing.numel,
        "padded_numel": packing.padded_numel,
        "slots": [{"names": list(s.names), "shape": list(s.shape), "offset": s.offset} for s in packing.slots],
    }


def _files_from_json(raw, world_size: int, version: int) -> list[FileRecord]:
    """The file records, which must be exactly one per saving rank and the replicated file."""
    records = []
    keys = ("name", "nbytes", "sha256", "mtime_ns") if version >= 7 else ("name", "nbytes", "sha256")
    for i, record in enumerate(schema.array(raw, "files")):
        record = schema.fields(record, f"files[{i}]", keys)
        records.append(FileRecord(
            schema.plain_name(record["name"], f"files[{i}].name"),
            schema.integer(record["nbytes"], f"files[{i}].nbytes"),
            schema.sha256(record["sha256"], f"files[{i}].sha256"),
            schema.integer(record["mtime_ns"], f"files[{i}].mtime_ns", minimum=-2**63) if version >= 7 else None,
        ))
    if len(records) != world_size + 1:
        raise ValueError(f"files lists {len(records)} files, where a checkpoint saved by {world_size} ranks has "
                         f"{world_size + 1}")
    expected = {rank_file(rank) for rank in range(world_size)} | {REPLICATED}
    names = schema.unique([record.name for record in records], "files")
    unexpected = [name for name in names if name not in expected]
    if unexpected:
        raise ValueError(
            f"files lists {unexpected[0]!r}, which is not a file of a checkpoint saved by {world_size} ranks"
        )
    return records


def _flat_from_json(raw, what: str, world_size: int, version: int) -> FlatRecord:
    keys = ("name", "dtype", "world_size", "numel", "padded_numel", "slots")
    raw = schema.fields(raw, what, keys if version >= 3 else (*keys, "optimizer_state"))
    name = schema.string(raw["name"], f"{what}.name")
    slots = tuple(
        _slot_from_json(slot, f"{what}.slots[{i}]")
        for i, slot in enumerate(schema.array(raw["slots"], f"{what}.slots"))
    )
    dtype = _dtype_from_json(raw["dtype"], f"{what}.dtype")
    packing = Packing(slots, dtype, schema.integer(raw["world_size"], f"{what}.world_size", minimum=1),
                      by_rows=version >= 6)
    pack = Packing.pack if packing.by_rows else Packing.end_to_end
    packed = pack([(s.names, s.shape) for s in slots], packing.dtype, packing.world_size)
    if (packed != packing or world_size % packing.world_size or (version < 4 and packing.world_size != world_size)
            or packing.numel != schema.integer(raw["numel"], f"{what}.numel")
            or packing.padded_numel != schema.integer(raw["padded_numel"], f"{what}.padded_numel")):
        raise ValueError(f"the packing of flat buffer {name!r} is inconsistent")
    return FlatRecord(name, packing)


def _slot_from_json(raw, what: str) -> ParamSlot:
    raw = schema.fields(raw, what, ("names", "shape", "offset"))
    names = tuple(
        schema.string(name, f"{what}.names[{i}]") for i, name in enumerate(schema.array(raw["names"], f"{what}.names"))
    )
    if not names:
        raise ValueError(f"{what}.names is empty")
    shape = _shape_from_json(raw["shape"], f"{what}.shape")
    return ParamSlot(names, shape, schema.integer(raw["offset"], f"{what}.offset"))


def _buffer_from_json(raw, what: str) -> TensorRecord:
    raw = schema.fields(raw, what, ("name", "shape", "dtype"))
    return TensorRecord(
        schema.string(raw["name"], f"{what}.name"),
        _shape_from_json(raw["shape"], f"{what}.shape"),
        _dtype_from_json(raw["dtype"], f"{what}.dtype"),
    )


def _shape_from_json(raw, what: str) -> tuple[int, ...]:
    return tuple(schema.integer(n, f"{what}[{i}]") for i, n in enumerate(schema.array(raw, what)))


def _dtype_from_json(raw, what: str) -> torch.dtype:
    try:
        return parse_dtype(schema.string(raw, what))
    except ValueError:
        raise ValueError(f"{what} is {schema.shown(raw)}, not a torch dtype") from None


def _check_optimizer(raw, flats: list[FlatRecord]) -> None:
    """The optimizer record names a class and param groups holding parameters of this checkpoint (by
    first name), each in one group, and the kind and dtype of each state key of parameters they hold.
    Its hyperparameters are checked against the optimizer they are loaded into
    (``optim.read_state_dict``)."""
    if raw is None:
        return
    raw = schema.fields(raw, "optimizer", ("class", "param_groups", "state"))
    schema.string(raw["class"], "optimizer.class")
    params = {slot.names[0] for flat in flats for slot in flat.packing.slots}
    held = []
    for i, group in enumerate(schema.array(raw["param_groups"], "optimizer.param_groups")):
        what = f"optimizer.param_groups[{i}]"
        group = schema.fields(group, what, ("params",), open_ended=True)
        held += [schema.string(name, f"{what}.params[{j}]")
                 for j, name in enumerate(schema.array(group["params"], f"{what}.params"))]
    schema.unique(held, "optimizer.param_groups' params")
    strangers = [name for name in held if name not in params]
    if strangers:
        raise ValueError(f"the optimizer holds {strangers[0]!r}, which is not a parameter of the checkpoint")
    for name, keys in schema.fields(raw["state"], "optimizer.state", (), open_ended=True).items():
        if name not in held:
            raise ValueError(f"optimizer.state has state of {name!r}, which no param group holds")
        for key, spec in schema.fields(keys, f"optimizer.state[{name!r}]", (), open_ended=True).items():
            spec = schema.fields(spec, f"optimizer.state[{name!r}][{key!r}]", ("kind", "dtype"))
            schema.one_of(spec["kind"], f"optimizer.state[{name!r}][{key!r}].kind", (PER_ELEMENT, SCALAR))
            _dtype_from_json(spec["dtype"], f"optimizer.state[{name!r}][{key!r}].dtype")


def param_names(engine) -> set[str]:
    """The names of the sharded parameters, every name of a tied one included."""
    return {name for flat in engine.flats for slot in flat.packing.slots for name in slot.names}


def buffer_records(engine, model: torch.nn.Module) -> list[TensorRecord]:
    """The model's persistent buffers (those in its ``state_dict``), which every rank holds whole."""
    params = param_names(engine)
    return [
        TensorRecord(key, tuple(buffer.shape), buffer.dtype)
        for key in engine.state_dict_keys if key not in params
        for buffer in [model.get_buffer(key)]
    ]


def first_difference(saved: Manifest, flats: list[FlatRecord], buffers: list[TensorRecord]) -> str | None:
    """How the model that wrote ``saved`` differs from one with ``flats`` and ``buffers`` (the first
    difference, in words), or None when they match: same flat buffers, holding the same parameters
    (names, shapes, order) in the same dtypes, and the same buffers."""
    return next(_differences(saved, flats, buffers), None)


def _differences(saved: Manifest, flats: list[FlatRecord], buffers: list[TensorRecord]) -> Iterator[str]:
    for i, (old, new) in enumerate(zip_longest(saved.flats, flats)):
        if old is None or new is None:
            saved_names, names = [f.name for f in saved.flats], [f.name for f in flats]
            only = ([f"this model's {n!r} is not in the checkpoint" for n in names if n not in saved_names]
                    + [f"the checkpoint's {n!r} is not in this model" for n in saved_names if n not in names])
            yield (f"the checkpoint has {len(saved.flats)} flat buffers (one per unit and dtype) and this model "
                   f"{len(flats)}{f' ({only[0]})' if only else ''}: a model of another size, or units chosen "
                   f"differently")
            return
        if old.name != new.name:
            yield f"flat buffer {i} is {old.name!r} in the checkpoint and {new.name!r} in this model"
            return
        if old.packing.dtype != new.packing.dtype:
            yield (f"flat buffer {old.name!r} is {dtype_name(old.packing.dtype)} in the checkpoint and "
                   f"{dtype_name(new.packing.dtype)} in this model")
        for a, b in zip_longest(old.packing.slots, new.packing.slots):
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
