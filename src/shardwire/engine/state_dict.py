"""The unsharded weights of a sharded model under their original names, a unit at a time: gathered
from the live model (``weights_by_unit``, ``full_state_dict``), or read from a checkpoint
(``checkpoint.portable``). A writer that takes them a unit at a time (``shardwire.models.export``)
never holds the whole model."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from shardwire.engine.packing import ParamSlot
from shardwire.engine.selection import state_dict_key
from shardwire.engine.shard import engine_of


@dataclasses.dataclass(frozen=True)
class TensorRecord:
    """What one tensor of the state dict is, known before its values: a checkpoint's manifest records
    its buffers so, and a writer lays out its files from them."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass
class WeightsByUnit:
    """The unsharded state dict in parts, one per flat buffer and a last one of the buffers.

    ``tensors`` says, before any value comes, every tensor the parts will bring, in the order they
    bring them (a tied parameter once, under its first name); ``aliases`` maps each other name of a
    tied parameter to that first name; ``keys`` are the unsharded model's state dict, in order, as
    names (``selection.state_dict_names``; ``state_dict()`` gives them its keys).
    ``parts`` must be read to the end (on every rank, where they come from a live model)."""

    tensors: list[TensorRecord]
    aliases: dict[str, str]
    keys: list[str]
    parts: Iterator[dict[str, torch.Tensor]]

    def take_part(self) -> None:
        """Read the parts to the end, keeping nothing: what a rank other than 0 does, whose gathers
        the parts of rank 0 need."""
        for _ in self.parts:
            pass

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All of it at once, keyed like the unsharded model's ``state_dict()``: a tied parameter is
        one tensor under each of its names, as PyTorch keeps it."""
        values: dict[str, torch.Tensor] = {}
        for part in self.parts:
            values.update(part)
        values.update({alias: values[name] for alias, name in self.aliases.items()})
        return {state_dict_key(name): values[name] for name in self.keys}


def describe(slots: Iterable[tuple[ParamSlot, torch.dtype]], buffers: Iterable[TensorRecord], keys: Sequence[str]
             ) -> tuple[list[TensorRecord], dict[str, str]]:
    """The ``tensors`` and ``aliases`` of a ``WeightsByUnit`` whose parts bring each slot's parameter
    (in slot order), then the buffers among ``keys``."""
    tensors = [TensorRecord(slot.names[0], slot.shape, dtype) for slot, dtype in slots]
    aliases = {alias: slot.names[0] for slot, _ in slots for alias in slot.names[1:]}
    named = {tensor.name for tensor in tensors} | aliases.keys()
    return tensors + [buffer for buffer in buffers if buffer.name in keys and buffer.name not in named], aliases


def weights_by_unit(model: nn.Module) -> WeightsByUnit:
    """The sharded ``model``'s full weights (master precision, on the CPU) a unit at a time, and its
    buffers, on rank 0; every rank must read the parts, which gather one unit at a time (no rank
    holds more than one unit's full buffer, and its copy in parameter order, on its device); other
    ranks' parts are empty."""
    engine = engine_of(model)
    slots = [(slot, flat.shard.dtype) for flat in engine.flats for slot in flat.packing.slots]
    buffers = [TensorRecord(name, tuple(buffer.shape), buffer.dtype) for name, buffer in model.named_buffers()]
    tensors, aliases = describe(slots, buffers, engine.state_dict_keys)
    return WeightsByUnit(tensors, aliases, list(engine.state_dict_keys), _gathered(model, engine, tensors))


def _gathered(model: nn.Module, engine, tensors: list[TensorRecord]) -> Iterator[dict[str, torch.Tensor]]:
    # the ranks whose shards it gathers compare what they did before (the weights each loaded): in
    # hybrid layouts the ranks of one group alone may call it
    engine.layout.shard.verify_order("what came before this state dict", now=True)
    mine = engine.comm.rank == 0  # every rank takes part in each gather; only rank 0 keeps the values
    for flat in engine.flats:
        packing = flat.packing
        full = torch.empty(packing.padded_numel, dtype=flat.shard.dtype, device=flat.shard.device)
        engine.layout.shard.all_gather(full, flat.shard.detach(), tag=f"state dict {flat.name}").wait()
        by_param = full if packing.ordered_alike else torch.empty_like(full)
        packing.copy_out(full, by_param)
        yield {slot.names[0]: value.cpu().clone()
               for slot, value in zip(packing.slots, packing.views(by_param))} if mine else {}
    params = {slot.names[0] for flat in engine.flats for slot in flat.packing.slots}
    yield {t.name: model.get_buffer(t.name).detach().cpu().clone() for t in tensors
           if t.name not in params} if mine else {}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather the full parameters (master precision, on the CPU) and the buffers on rank 0.

    Every rank must call it (it gathers one unit at a time: ``weights_by_unit``). Rank 0 gets a dict
    keyed like the unsharded model's ``state_dict()``, tied parameters under each of their names, as
    PyTorch does, that loads into the unsharded model; other ranks get an empty dict.
    """
    weights = weights_by_unit(model)
    if engine_of(model).comm.rank == 0:
        return weights.state_dict()
    weights.take_part()
    return {}
