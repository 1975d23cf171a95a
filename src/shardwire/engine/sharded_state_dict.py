"""``model.state_dict()`` and ``model.load_state_dict()`` on a sharded model.

A sharded model keeps its parameters under their own names, each holding this rank's part of the
parameter flattened (see ``FlatParam``), so torch's own ``state_dict()`` already gives each rank's
parts under the model's names. Two hooks make the rest work:

- saving turns each part into a ``ShardedPart``: a DTensor of the parameter's shape whose local
  tensor is the part, which tells torch's distributed checkpointing (DCP, and the
  ``full_state_dict`` option of ``torch.distributed.checkpoint.state_dict``) which boxes of the
  parameter this rank holds; ``torch.save`` stores it as the flat part. The state dict's metadata for
  the model's prefix (``state_dict._metadata``, which ``torch.save`` keeps) records each parameter's
  full shape under ``"shardwire"``: ranks hold consecutive parts, so a parameter is its parts from
  ranks 0, 1, ... concatenated and viewed in that shape (``shardwire.full_state_dict`` does it with
  collectives);
- loading takes those parts back, and whole parameters too: a value with the parameter's full shape
  (a ``full_state_dict``, or an unsharded model's ``state_dict()``) is cut to this rank's part first.

DTensor, which imports sympy, loads with the first state dict, not with every sharded model, most of
which never take one.
"""

from __future__ import annotations

import functools

from torch import nn

from shardwire.engine.flat_param import FlatParam
from shardwire.engine.layout import Layout

METADATA_KEY = "shardwire"


def install(model: nn.Module, flats: list[FlatParam], layout: Layout) -> None:
    shapes = {name: list(slot.shape) for flat in flats for slot in flat.packing.slots for name in slot.names}

    @functools.cache
    def shard_group():
        from shardwire.engine.sharded_part import ShardGroup

        return ShardGroup(flats, layout)

    def describe_parts(module, state_dict, prefix, local_metadata) -> None:
        local_metadata[METADATA_KEY] = {
            "rank": layout.shard.rank,
            "world_size": layout.shard.world,
            "full_shapes": {prefix + name: shape for name, shape in shapes.items()},
        }
        group = shard_group()
        for name, part in group.by_name.items():
            value = state_dict.get(prefix + name)
            if value is not None and not isinstance(value, nn.Parameter):  # keep_vars keeps the parameters
                state_dict[prefix + name] = group.part(value, part)

    def take_parts(module, state_dict, prefix, *_) -> None:
        from shardwire.engine.sharded_part import local_part

        for name, part in shard_group().by_name.items():
            if prefix + name in state_dict:
                state_dict[prefix + name] = local_part(state_dict[prefix + name], part, prefix + name)

    model.register_state_dict_post_hook(describe_parts)
    model.register_load_state_dict_pre_hook(take_parts)
