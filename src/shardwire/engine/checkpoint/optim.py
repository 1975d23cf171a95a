"""How an optimizer's state maps onto a checkpoint, and back at any world size.

A sharded model's parameters are its flat shards, so an optimizer built from ``model.parameters()``
keeps its state per shard. A state tensor with the shard's shape (Adam's moments) is per element: it
is saved with the shard and re-sliced exactly like the parameters when the world size changes. A
0-dim tensor (Adam's step count) is the same on every rank and is saved once. Anything else has no
meaning for another slicing of the buffer and is refused when saving, so a checkpoint never holds
state it could not restore. The hyperparameters of each param group (including the learning rate a
scheduler set) go into the manifest, with the names of the flat buffers the group holds.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable

import torch

from shardwire.engine.checkpoint import schema
from shardwire.engine.checkpoint.format import (
    PER_ELEMENT,
    REPLICATED,
    SCALAR,
    CheckpointError,
    dtype_name,
    optim_key,
    parse_dtype,
)
from shardwire.engine.checkpoint.reader import CheckpointReader
from shardwire.engine.flat_param import FlatParam
from shardwire.engine.runtime import Engine


@dataclasses.dataclass
class OptimizerSnapshot:
    record: dict  # for the manifest: the optimizer's class and its param groups
    kinds: dict[str, dict[str, dict]]  # flat name -> state key -> {"kind", "dtype"}
    per_element: dict[str, torch.Tensor]  # file key -> this rank's slice
    scalars: dict[str, torch.Tensor]  # file key -> value (the same on every rank)


def group_flats(engine: Engine, optimizer: torch.optim.Optimizer) -> list[list[FlatParam]]:
    """For each param group, the flat buffers whose shards it holds."""
    flats = {id(flat.shard): flat for flat in engine.flats}
    groups = []
    for group in optimizer.param_groups:
        held = []
        for param in group["params"]:
            if id(param) not in flats:
                raise CheckpointError(
                    f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not a shard of "
                    f"this model: build the optimizer from model.parameters() after shardwire.shard(model)"
                )
            held.append(flats[id(param)])
        groups.append(held)
    return groups


def capture(
    engine: Engine, optimizer: torch.optim.Optimizer, copy: Callable[[torch.Tensor], torch.Tensor]
) -> OptimizerSnapshot:
    """This rank's optimizer state, each tensor passed through ``copy`` (a copy to host memory)."""
    snapshot = OptimizerSnapshot({"class": type(optimizer).__qualname__, "param_groups": []}, {}, {}, {})
    for group, flats in zip(optimizer.param_groups, group_flats(engine, optimizer)):
        hyperparameters = {key: value for key, value in group.items() if key != "params"}
        try:
            json.dumps(hyperparameters)
        except TypeError as err:
            raise CheckpointError(
                f"the optimizer's hyperparameters cannot be saved ({err}): checkpoints store them as "
                f"numbers, strings, booleans and lists"
            ) from None
        snapshot.record["param_groups"].append({**hyperparameters, "params": [flat.name for flat in flats]})
        for flat in flats:
            kinds = snapshot.kinds[flat.name] = {}
            for key, value in optimizer.state.get(flat.shard, {}).items():
                kind = _kind(flat.name, key, value, flat.shard.shape)
                kinds[key] = {"kind": kind, "dtype": dtype_name(value.dtype)}
                target = snapshot.per_element if kind == PER_ELEMENT else snapshot.scalars
                target[optim_key(flat.name, key)] = copy(value)
    return snapshot


def _kind(flat: str, key: str, value, shard_shape: torch.Size) -> str:
    if isinstance(value, torch.Tensor) and value.shape == shard_shape:
        return PER_ELEMENT
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return SCALAR
    what = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
    raise CheckpointError(
        f"optimizer state {key!r} of {flat!r} is {what}; checkpoints hold per-element state (the shard's "
        f"shape, {tuple(shard_shape)}) and 0-dim tensors, which can be re-sliced for any world size"
    )


def read_state_dict(
    reader: CheckpointReader, engine: Engine, optimizer: torch.optim.Optimizer, rank: int
) -> dict:
    """This rank's optimizer state at the current world size, as ``optimizer.load_state_dict`` takes it."""
    saved = reader.manifest.optimizer
    where = reader.directory
    if saved is None:
        raise CheckpointError(f"{where} holds no optimizer state (it was saved without an optimizer)")
    if saved["class"] != type(optimizer).__qualname__:
        raise CheckpointError(
            f"{where} holds the state of a {saved['class']} optimizer, not of a {type(optimizer).__qualname__}"
        )
    saved_groups = [group["params"] for group in saved["param_groups"]]
    current_groups = [[flat.name for flat in flats] for flats in group_flats(engine, optimizer)]
    if saved_groups != current_groups:
        raise CheckpointError(
            f"{where}: the optimizer's param groups held the flat buffers {saved_groups} when saved, and "
            f"hold {current_groups} now"
        )
    records = {record.name: record for record in reader.manifest.flats}
    layouts = {flat.name: flat.layout for flat in engine.flats}
    state, param_groups, index = {}, [], 0
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups):
        ids = []
        for name in saved_group["params"]:
            start, stop = layouts[name].shard_range(rank)
            values = {}
            for key, spec in records[name].optimizer_state.items():
                file_key, dtype = optim_key(name, key), parse_dtype(spec["dtype"])
                if spec["kind"] == PER_ELEMENT:
                    values[key] = reader.flat_range(records[name], file_key, start, stop, dtype)
                else:
                    values[key] = reader.tensor(REPLICATED, file_key, (), dtype)
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

