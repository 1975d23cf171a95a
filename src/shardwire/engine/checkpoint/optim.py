"""How an optimizer's state maps onto a checkpoint, and back at any world size.

An optimizer built from a sharded model's parameters keeps its state per parameter: DTensors placed
as the parameter (Adam's moments: per element), which hold this rank's rows of it, and plain 0-dim
tensors (Adam's step count: scalar), the same on every rank. Each rank saves its rows of the
per-element state laid out like the shard they belong to (zeros where a parameter has no such
state), and a loader at another world size re-slices them exactly like the parameters; a scalar is
saved by the rank holding the parameter's first element. Anything else has no meaning for another
slicing and is refused when saving, so a checkpoint never holds state it could not restore.

The manifest records the optimizer's class, each param group's hyperparameters (including the
learning rate a scheduler set) with the names of the parameters it holds, and which state each
parameter has: a loaded parameter gets exactly the state it had, on every rank, as in training,
where every rank steps every parameter (its rows may be none).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardwire.engine.checkpoint import schema
from shardwire.engine.checkpoint.format import (
    PER_ELEMENT,
    SCALAR,
    CheckpointError,
    dtype_name,
    optim_key,
    parse_dtype,
    scalar_key,
)
from shardwire.engine.checkpoint.reader import CheckpointReader
from shardwire.engine.flat_param import FlatParam
from shardwire.engine.packing import Held, ParamSlot
from shardwire.engine.sharded_state_dict import part_of
from shardwire.engine.runtime import Engine


@dataclasses.dataclass(frozen=True)
class _Held:
    """A parameter an optimizer holds: its buffer, its slot, its DTensor, and what this rank holds."""

    flat: FlatParam
    slot: ParamSlot
    param: nn.Parameter
    part: Held

    @property
    def name(self) -> str:
        return self.slot.names[0]


@dataclasses.dataclass
class OptimizerSnapshot:
    record: dict  # for the manifest: the optimizer's class and its param groups
    state: dict[str, dict[str, dict]]  # parameter name -> state key -> {"kind", "dtype"}, of this rank
    tensors: dict[str, torch.Tensor]  # file key -> tensor, for this rank's file


def held_by_groups(engine: Engine, optimizer: torch.optim.Optimizer) -> list[list[_Held]]:
    """For each param group, the parameters of the model it holds."""
    placed = {
        id(param): _Held(flat, slot, param, held)
        for flat in engine.flats for slot, param, held in flat.held_parts()
    }
    groups = []
    for group in optimizer.param_groups:
        held = []
        for param in group["params"]:
            if id(param) not in placed:
                raise CheckpointError(
                    f"the optimizer holds a tensor of shape {tuple(param.shape)} that is not a parameter of this "
                    f"model: build the optimizer from model.parameters() after shardwire.shard(model)"
                )
            held.append(placed[id(param)])
        groups.append(held)
    return groups


def capture(
    engine: Engine, optimizer: torch.optim.Optimizer, copy: Callable[[torch.Tensor], torch.Tensor] | None
) -> OptimizerSnapshot:
    """This rank's optimizer state, each scalar passed through ``copy`` (a copy to host memory); with
    ``copy`` None, only what the manifest records (a rank whose shards another rank saves)."""
    snapshot = OptimizerSnapshot({"class": type(optimizer).__qualname__, "param_groups": []}, {}, {})
    for group, held in zip(optimizer.param_groups, held_by_groups(engine, optimizer)):
        hyperparameters = {key: value for key, value in group.items() if key != "params"}
        try:
            json.dumps(hyperparameters)
        except TypeError as err:
            raise CheckpointError(
                f"the optimizer's hyperparameters cannot be saved ({err}): checkpoints store them as "
                f"numbers, strings, booleans and lists"
            ) from None
        snapshot.record["param_groups"].append({**hyperparameters, "params": [entry.name for entry in held]})
        for entry in held:
            _capture_param(snapshot, entry, optimizer.state.get(entry.param, {}), copy)
    return snapshot


def _capture_param(snapshot: OptimizerSnapshot, entry: _Held, state: dict, copy) -> None:
    held, flat = entry.part, entry.flat
    first = flat.packing.first_holder(entry.slot) == flat.rank  # this rank holds its first element
    for key, value in state.items():
        kind = _kind(entry.name, key, value, entry.param)
        snapshot.state.setdefault(entry.name, {})[key] = {"kind": kind, "dtype": dtype_name(value.dtype)}
        if copy is None:
            continue
        if kind == SCALAR:
            if first:
                snapshot.tensors[scalar_key(entry.name, key)] = copy(value)
            continue
        file_key = optim_key(flat.name, key)
        if file_key not in snapshot.tensors:
            snapshot.tensors[file_key] = torch.zeros(flat.packing.shard_numel, dtype=value.dtype)
        laid_out = snapshot.tensors[file_key]
        if laid_out.dtype != value.dtype:
            raise CheckpointError(
                f"optimizer state {key!r} is {dtype_name(value.dtype)} for {entry.name!r} and "
                f"{dtype_name(laid_out.dtype)} for another parameter of its buffer {flat.name!r}"
            )
        laid_out[held.at : held.at + held.numel].copy_(value.to_local().detach().reshape(-1))


def _kind(param: str, key: str, value, placed: DTensor) -> str:
    """Per-element state is a DTensor placed as the parameter is; scalar state a plain 0-dim tensor."""
    if isinstance(value, DTensor) and value.shape == placed.shape and value.placements == placed.placements:
        return PER_ELEMENT
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() == 0:
        return SCALAR
    what = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
    raise CheckpointError(
        f"optimizer state {key!r} of {param!r} is {what}; checkpoints hold per-element state (a DTensor placed "
        f"as the parameter, {tuple(placed.shape)}) and plain 0-dim tensors, which can be re-sliced for any "
        f"world size"
    )


def merged_state(per_rank: list[dict[str, dict[str, dict]]]) -> dict[str, dict[str, dict]]:
    """The state each parameter has, from every rank's ``OptimizerSnapshot.state``: a rank that holds
    nothing of a parameter has no state for it, and ranks that hold parts of it agree."""
    merged: dict[str, dict[str, dict]] = {}
    for rank, state in enumerate(per_rank):
        for name, keys in state.items():
            known = merged.setdefault(name, keys)
            if known != keys:
                raise CheckpointError(
                    f"ranks hold different optimizer state for {name!r} (rank {rank}: {sorted(keys)}, an "
                    f"earlier rank: {sorted(known)}): every rank must step the same parameters"
                )
    return merged


def read_state_dict(
    reader: CheckpointReader, engine: Engine, optimizer: torch.optim.Optimizer, saving_group: int = 0
) -> dict:
    """This rank's optimizer state at the current world size, as ``optimizer.load_state_dict`` takes it,
    from the state that group ``saving_group`` saved (``Manifest.groups``)."""
    manifest, where = reader.manifest, reader.directory
    saved = manifest.optimizer
    if saved is None:
        raise CheckpointError(f"{where} holds no optimizer state (it was saved without an optimizer)")
    if manifest.version < 3:
        raise CheckpointError(
            f"{where} was written in checkpoint format {manifest.version}, which kept optimizer state per "
            f"flat buffer; this shardwire reads its model but not its optimizer: load it with optimizer=None "
            f"and start the optimizer afresh"
        )
    if saved["class"] != type(optimizer).__qualname__:
        raise CheckpointError(
            f"{where} holds the state of optimizer class {saved['class']}, not {type(optimizer).__qualname__}: "
            f"resume with the optimizer it was saved with"
        )
    held = held_by_groups(engine, optimizer)
    saved_groups = [group["params"] for group in saved["param_groups"]]
    current_groups = [[entry.name for entry in group] for group in held]
    if saved_groups != current_groups:
        raise CheckpointError(f"{where}: {_group_difference(saved_groups, current_groups)}")
    records = {record.name: record for record in manifest.flats}
    state, param_groups, index = {}, [], 0
    for saved_group, group, entries in zip(saved["param_groups"], optimizer.param_groups, held):
        ids = []
        for entry in entries:
            values = _read_param_state(reader, records[entry.flat.name], entry, saved["state"].get(entry.name, {}),
                                       saving_group)
            if values:
                state[index] = values
            ids.append(index)
            index += 1
        hyperparameters = {
            key: _hyperparameter(where, key, value, group.get(key))
            for key, value in saved_group.items() if key != "params"
        }
        param_groups.append({**hyperparameters, "params": ids})
    return {"state": state, "param_groups": param_groups}


def _read_param_state(reader: CheckpointReader, record, entry: _Held, keys: dict, saving_group: int) -> dict:
    held, saved = entry.part, record.packing.slots[entry.flat.packing.slots.index(entry.slot)]
    if keys and entry.slot.replicated and reader.manifest.version < 6:
        raise CheckpointError(
            f"{reader.directory} was written in checkpoint format {reader.manifest.version}, which does not say which "
            f"optimizer state of the 0-dim parameter {entry.name!r} is per element; this shardwire reads its model "
            f"but not its optimizer: load it with optimizer=None and start the optimizer afresh"
        )
    values = {}
    for key, spec in keys.items():
        dtype = parse_dtype(spec["dtype"])
        if spec["kind"] == PER_ELEMENT:
            rows = reader.param_run(record, optim_key(record.name, key), saved, held.start, held.end, dtype,
                                    saving_group)
            values[key] = part_of(entry.param, rows)
        else:
            first_holder = record.packing.first_holder(saved)  # at the saving world size
            values[key] = reader.tensor(reader.shard_file(record, first_holder, saving_group),
                                        scalar_key(entry.name, key), (), dtype)
    return values


def _group_difference(saved: list[list[str]], current: list[list[str]]) -> str:
    if len(saved) != len(current):
        return f"the optimizer had {len(saved)} param groups when saved and has {len(current)} now"
    i, old, new = next((i, old, new) for i, (old, new) in enumerate(zip(saved, current)) if old != new)
    moved = next((name for name in (*old, *new) if (name in old) != (name in new)), None)
    detail = f"{moved!r} is in it only {'when saved' if moved in old else 'now'}" if moved else "in another order"
    return f"param group {i} holds other parameters than when saved: {detail}"


def _hyperparameter(where: pathlib.Path, key: str, saved, current):
    """A saved hyperparameter as the optimizer takes it. It must be the kind of value the optimizer
    holds now (a number for a number, a list as long for a tuple), or the first step would fail on a
    string learning rate, or worse, run with it; JSON turned tuples (Adam's betas) into lists, which
    get the optimizer's type back."""
    if not schema.fits(saved, current):
        raise CheckpointError(
            f"{where}: the optimizer's {key!r} was saved as {schema.shown(saved)}, which cannot stand for its "
            f"current {schema.shown(current)}"
        )
    return tuple(saved) if isinstance(current, tuple) else saved
