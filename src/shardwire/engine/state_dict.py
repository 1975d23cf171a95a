"""The unsharded weights of a sharded model under their original names: gathered from the live
model (``full_state_dict``), or read from a checkpoint (``checkpoint.export_state_dict``), both
assembled by ``assemble``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from shardwire.engine.packing import ParamSlot
from shardwire.engine.shard import engine_of


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather the full parameters (master precision, on the CPU) and the buffers on rank 0.

    Every rank must call it (it gathers one unit at a time, so no rank ever holds more than one
    unit's full flat buffer, and its copy in parameter order, on its device). Rank 0 gets a dict keyed like the unsharded model's
    ``state_dict()`` — tied parameters under each of their names, as PyTorch does — that loads into
    the unsharded model; other ranks get an empty dict.
    """
    engine = engine_of(model)

    def gathered():
        for flat in engine.flats:
            packing = flat.packing
            full = torch.empty(packing.padded_numel, dtype=flat.shard.dtype, device=flat.shard.device)
            engine.layout.shard.all_gather(full, flat.shard.detach(), tag=f"state dict {flat.name}").wait()
            by_param = full if packing.ordered_alike else torch.empty_like(full)
            packing.copy_out(full, by_param)
            yield from zip(packing.slots, packing.views(by_param))

    if engine.comm.rank != 0:
        for _ in gathered():  # every rank takes part in each gather; only rank 0 keeps the values
            pass
        return {}
    on_host = ((slot, value.cpu()) for slot, value in gathered())
    return assemble(on_host, engine.state_dict_keys, lambda key: model.get_buffer(key).detach().cpu().clone())


def assemble(params: Iterable[tuple[ParamSlot, torch.Tensor]], keys: Sequence[str],
             buffer: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with ``keys`` (the unsharded model's, in its order) from each parameter's slot
    and whole value, taken one at a time, and ``buffer(key)`` for the keys no slot names. A tied
    parameter is one tensor under each of its names, as PyTorch keeps it."""
    values: dict[str, torch.Tensor] = {}
    for slot, value in params:
        values.update(dict.fromkeys(slot.names, value.clone()))
    return {key: values[key] if key in values else buffer(key) for key in keys}
