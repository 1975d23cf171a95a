"""``model.state_dict()`` and ``model.load_state_dict()`` on a sharded model.

A sharded model keeps its parameters under their own names, each holding this rank's part of the
parameter flattened (see ``FlatParam``), so torch's own ``state_dict()`` already gives each rank's
parts under the model's names, and ``load_state_dict()`` of such parts, at the same world size, copies
them into the flat shards. Two hooks make the rest work:

- saving records, in the state dict's metadata for the model's prefix (``state_dict._metadata``,
  which ``torch.save`` keeps), each parameter's full shape under ``"shardwire"``. Ranks hold
  consecutive parts, so a parameter is its parts from ranks 0, 1, ... concatenated and viewed in that
  shape (``shardwire.full_state_dict`` does it with collectives);
- loading accepts whole parameters too: a value with the parameter's full shape (a
  ``full_state_dict``, or an unsharded model's ``state_dict()``) is cut to this rank's part first.
"""

from __future__ import annotations

from torch import nn

from shardwire.engine.flat_param import FlatParam

METADATA_KEY = "shardwire"


def install(model: nn.Module, flats: list[FlatParam], rank: int, world_size: int) -> None:
    shapes = {name: list(slot.shape) for flat in flats for slot in flat.packing.slots for name in slot.names}

    def record_full_shapes(module, state_dict, prefix, local_metadata) -> None:
        local_metadata[METADATA_KEY] = {
            "rank": rank,
            "world_size": world_size,
            "full_shapes": {prefix + name: shape for name, shape in shapes.items()},
        }

    def cut_whole_parameters(module, state_dict, prefix, *_) -> None:
        for flat in flats:
            for slot, _, (start, end) in flat.held_parts():
                for name in slot.names:
                    value = state_dict.get(prefix + name)
                    if value is not None and tuple(value.shape) == slot.shape:
                        state_dict[prefix + name] = value.reshape(-1)[start:end]

    model.register_state_dict_post_hook(record_full_shapes)
    model.register_load_state_dict_pre_hook(cut_whole_parameters)
