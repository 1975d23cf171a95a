"""``model.load_state_dict()`` on a sharded model: whole tensors in, this rank's rows kept.

A sharded model's parameters are DTensors of their full shapes (``FlatParam``), so torch's own
``state_dict()`` already gives what FSDP2's does, and DCP saves, loads and reshards it. Loading takes
a state dict of the same DTensors as it is (``set_model_state_dict`` distributes whole tensors so),
and a whole parameter too, as an unsharded model's ``state_dict()`` holds it: a plain tensor of the
parameter's full shape is cut to this rank's rows first, as ``distribute_tensor`` would cut it, with
no collective; under ``assign=True`` as well, copied into the flat buffer all the same. A DTensor placed otherwise (another layout's, another mesh's) would need collectives
that a load hook cannot run in step on every rank, so it is refused, naming DCP, which reshards.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, _DTensorSpec, _TensorMeta

from shardwire.engine.flat_param import FlatParam
from shardwire.engine.packing import Held
from shardwire.engine.selection import state_dict_key


def install(model: nn.Module, flats: list[FlatParam]) -> None:
    named = {name: (param, held) for flat in flats for slot, param, held in flat.held_parts() for name in slot.names}
    params = {state_dict_key(name): held for name, held in named.items()}  # as the state dicts loaded key them

    def take_rows(module, state_dict, prefix, local_metadata, *_) -> None:
        taken = {prefix + key: local_rows(state_dict[prefix + key], param, held, prefix + key)
                 for key, (param, held) in params.items() if prefix + key in state_dict}  # any refusal first
        if local_metadata.get("assign_to_params_buffers", False):
            # ``assign=True`` (FSDP2's load of a model made on the meta device) would put a new parameter
            # in the module, which the flat buffer it trains and saves never sees: its rows are copied
            # in, and the parameter assigned is the one the module holds
            for key, value in taken.items():
                param = params[key.removeprefix(prefix)][0]
                if isinstance(value, DTensor) and value.shape == param.shape:
                    if value._local_tensor.shape != param._local_tensor.shape:
                        raise ValueError(f"{key} holds {tuple(value._local_tensor.shape)} on this rank, where this "
                                         f"sharded model holds {tuple(param._local_tensor.shape)} of it: load DTensor "
                                         f"state dicts with torch.distributed.checkpoint.load, which reshards them")
                    with torch.no_grad():
                        param._local_tensor.copy_(value._local_tensor)
                    taken[key] = param
        state_dict.update(taken)

    model.register_load_state_dict_pre_hook(take_rows)
    owners: dict[nn.Module, set[str]] = {}  # each module holding a sharded parameter, by the prefixes of its names
    for name in named:
        owner, _, _ = name.rpartition(".")
        if owner:
            owners.setdefault(model.get_submodule(owner), set()).add(owner + ".")
    for owner, prefixes in owners.items():
        owner.register_load_state_dict_pre_hook(functools.partial(_refuse_a_part, prefixes=sorted(prefixes)))


def _refuse_a_part(module, state_dict, prefix, *_, prefixes: list[str]) -> None:
    """Refuse ``load_state_dict`` called on a part of a sharded model (``module``, or a module
    above it, not the whole): only the whole model's load cuts whole tensors to this rank's rows,
    and tells the engine that its ranks loaded weights (which they must all do alike, and which
    restarts DiLoCo's outer optimisation). Through the whole model (or a module wrapping it, as
    ``torch.compile`` does), the prefix ends with the module's own name."""
    if any(prefix.endswith(own) for own in prefixes):
        return
    own = next((own for own in prefixes if own.endswith(prefix)), prefixes[0])
    part = own[:len(own) - len(prefix)].rstrip(".") if own.endswith(prefix) else own.rstrip(".")  # the module loaded
    raise ValueError(f"load_state_dict of a part of a sharded model ({part}) does not load it: load the part's keys "
                     f"under their whole names ({part}.*) into the whole sharded model, with "
                     f"model.load_state_dict(state, strict=False)")


def local_rows(value: Any, param: DTensor, held: Held, what: str) -> Any:
    """``value`` as ``param`` holds it, ``held`` being this rank's part: a DTensor placed as ``param``
    as it is, a whole tensor (plain, or a DTensor replicated on every rank) cut to this rank's rows,
    anything else as it is (for ``load_state_dict``'s own checks to refuse)."""
    if isinstance(value, DTensor):
        if value.device_mesh == param.device_mesh and value.placements == param.placements:
            return value
        if _held_alike(value, param):  # FSDP2's DTensor of these rows on its own mesh of these ranks
            return part_of(param, value._local_tensor.contiguous())
        if not all(p.is_replicate() for p in value.placements):
            raise ValueError(
                f"{what} is a DTensor placed {value.placements} on {value.device_mesh}, and this sharded model "
                f"holds it placed {param.placements} on {param.device_mesh}: load DTensor state dicts with "
                f"torch.distributed.checkpoint.load into the model's state dict, which reshards them"
            )
        value = value.to_local()
    if not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return value
    return distributed_like(value, param, held)


def _held_alike(value: DTensor, param: DTensor) -> bool:
    """Whether ``value`` holds on this rank the rows ``param`` holds: placed alike (rows split as
    ``Shard(0)`` splits them) on a mesh of the same ranks in the same order, one that is another
    object or names its dimensions otherwise (FSDP2's default mesh names none; the model's names them
    by the layout)."""
    mine, theirs = param.device_mesh, value.device_mesh
    return (value.placements == param.placements and value.shape == param.shape
            and theirs.device_type == mine.device_type and torch.equal(theirs.mesh, mine.mesh))


def distributed_like(whole: torch.Tensor, param: DTensor, held: Held) -> DTensor:
    """The whole tensor ``whole`` placed as ``param`` is: this rank's part of it (``held``; a copy, so
    that the whole can be freed), with no collective."""
    local = param._local_tensor
    part = whole.reshape(-1)[held.start : held.end]
    return part_of(param, part.to(dtype=local.dtype, device=local.device, copy=True))


def part_of(param: DTensor, rows: torch.Tensor) -> DTensor:
    """A DTensor placed as ``param`` whose local tensor is ``rows`` (this rank's part of a tensor of
    ``param``'s shape, in any dtype, flat or shaped), moved to ``param``'s device."""
    local = param._local_tensor
    spec = _DTensorSpec(param._spec.mesh, param._spec.placements,
                        tensor_meta=_TensorMeta(param.shape, param.stride(), rows.dtype))
    return DTensor(rows.to(local.device).view(local.shape), spec, requires_grad=False)
