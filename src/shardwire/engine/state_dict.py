"""``full_state_dict``: the unsharded weights of a sharded model, under their original names."""

from __future__ import annotations

import torch
from torch import nn

from shardwire.engine.shard import engine_of


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather the full parameters (master precision, on the CPU) and the buffers on rank 0.

    Every rank must call it (it gathers one unit at a time, so no rank ever holds more than one
    unit's full flat buffer on its device). Rank 0 gets a dict keyed like the unsharded model's
    ``state_dict()`` — tied parameters under each of their names, as PyTorch does — that loads into
    the unsharded model; other ranks get an empty dict.
    """
    engine = engine_of(model)
    rank = engine.comm.rank
    params: dict[str, torch.Tensor] = {}
    for flat in engine.flats:
        full = torch.empty(flat.layout.padded_numel, dtype=flat.shard.dtype, device=flat.shard.device)
        engine.sharding.shard.all_gather(full, flat.shard.detach(), tag=f"state dict {flat.name}").wait()
        if rank == 0:
            for slot, view in zip(flat.layout.slots, flat.layout.views(full.cpu())):
                value = view.clone()
                params.update(dict.fromkeys(slot.names, value))
    if rank != 0:
        return {}
    state = {}
    for key in engine.state_dict_keys:
        state[key] = params[key] if key in params else model.get_buffer(key).detach().cpu().clone()
    return state
