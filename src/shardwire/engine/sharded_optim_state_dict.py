"""``register_optimizer``: a sharded model's optimizer in torch's distributed checkpointing.

An optimizer built from a sharded model's parameters keeps, per parameter, state for this rank's
part of it: per-element tensors shaped like the part (Adam's moments) and 0-dim scalars (its step
count). Torch's checkpointing reads it through ``optimizer.state_dict()`` (``get_state_dict`` renames
its keys to the parameters' names), where, as plain tensors, each rank's parts would pass for whole
replicated tensors. Only the optimizer's own hooks can say otherwise, so the optimizer is registered:

- ``state_dict()`` gives each state tensor as a ``ShardedPart`` of its parameter (a scalar is written
  once, by the parameter's first holder), which DCP saves and reshards and ``full_state_dict=True``
  gathers, like the model's parameters;
- ``load_state_dict()`` takes back parts, and whole state (a full optimizer state dict: each
  per-element tensor is cut to this rank's part);
- before each step, every parameter this rank holds nothing of, in a buffer reduced since the last
  step, gets an empty gradient, so the optimizer keeps (empty) state for it as the ranks holding it
  do. Torch's full state dicts are gathered and distributed value by value, every rank in turn, so
  every rank's state dict must hold the same entries. (An optimizer that is not registered never
  steps such a parameter and keeps no state for it, as shardwire's own checkpoints expect.)
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import nn

from shardwire.engine.flat_param import FlatParam
from shardwire.engine.part_extent import PartExtent
from shardwire.engine.shard import engine_of
from shardwire.engine.sharded_part import ShardGroup, local_part

# Set on a registered optimizer: a second registration would wrap its state twice.
_REGISTERED_ATTR = "_shardwire_registered"


def register_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Let ``optimizer``, built from the parameters of the sharded ``model``, go through
    ``torch.distributed.checkpoint`` (``dcp.save``, ``dcp.load``) and
    ``torch.distributed.checkpoint.state_dict`` (``get_state_dict``, ``set_state_dict``, sharded or
    with ``full_state_dict=True``) at any world size and layout. Call it once, before the first
    step: from then on a rank keeps (empty) state for the parameters it holds nothing of too, so
    that every rank's state dict has the same entries."""
    engine = engine_of(model)
    if getattr(optimizer, _REGISTERED_ATTR, False):
        raise ValueError(f"this {type(optimizer).__name__} is already registered with shardwire.register_optimizer")
    if optimizer.state:
        raise ValueError(
            f"register the {type(optimizer).__name__} before its first step: the ranks that hold nothing of "
            f"a parameter have no state for it by now, and every rank's state dict must hold the same entries"
        )
    group = ShardGroup(engine.flats, engine.layout)
    stepped = {param for param_group in optimizer.param_groups for param in param_group["params"]}
    foreign = [param for param in stepped if param not in group.by_param]
    if foreign:
        raise ValueError(_foreign(optimizer, foreign[0]))
    held_nothing: dict[FlatParam, list[nn.Parameter]] = {}  # by trainable buffer
    for flat in engine.flats:
        for _, param, (start, end) in flat.held_parts():
            if flat.requires_grad and start == end and param in stepped:
                held_nothing.setdefault(flat, []).append(param)
    seen = {flat: flat.reductions for flat in held_nothing}

    def step_everywhere(optimizer, args, kwargs) -> None:
        for flat, params in held_nothing.items():
            if flat.reductions != seen[flat]:
                seen[flat] = flat.reductions
                for param in params:
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)

    def describe(optimizer, state_dict) -> dict:
        params = _params_by_key(optimizer, state_dict["param_groups"])
        state = {}
        for key, values in state_dict["state"].items():
            part = group.by_param.get(params[key])
            if part is None:
                raise ValueError(_foreign(optimizer, params[key]))
            state[key] = {name: _described(group, part, params[key], name, value) for name, value in values.items()}
        return {**state_dict, "state": state}

    def take(optimizer, state_dict) -> dict:
        params = _params_by_key(optimizer, state_dict["param_groups"])
        state = {}
        for key, values in state_dict["state"].items():
            param = params.get(key)
            part = group.by_param.get(param)
            current = optimizer.state.get(param, {})
            state[key] = values if part is None else {
                name: local_part(value, part, f"optimizer state {name!r} of {part.name!r}",
                                 scalar=_is_scalar(value, part, current.get(name)))
                for name, value in values.items()
            }
        return {**state_dict, "state": state}

    optimizer.register_step_pre_hook(step_everywhere)
    optimizer.register_state_dict_post_hook(describe)
    optimizer.register_load_state_dict_pre_hook(take)
    setattr(optimizer, _REGISTERED_ATTR, True)


def _foreign(optimizer: torch.optim.Optimizer, tensor: torch.Tensor) -> str:
    return (f"the {type(optimizer).__name__} holds a tensor of shape {tuple(tensor.shape)} that is not a parameter "
            f"of this sharded model: build it from model.parameters() after shardwire.shard(model)")


def _params_by_key(optimizer: torch.optim.Optimizer, saved_groups: list[dict]) -> dict[Any, nn.Parameter]:
    """The parameter each key of a state dict's ``state`` stands for, by position in the param groups,
    as ``Optimizer.load_state_dict`` matches them (keys are indices, or names under torch's
    ``get_state_dict``)."""
    saved = chain.from_iterable(group["params"] for group in saved_groups)
    return dict(zip(saved, chain.from_iterable(group["params"] for group in optimizer.param_groups)))


def _described(group: ShardGroup, part: PartExtent, param: nn.Parameter, name: str, value: Any) -> Any:
    what = f"optimizer state {name!r} of {part.name!r}"
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return group.part(value, part, scalar=True, what=what)
    if isinstance(value, torch.Tensor) and value.shape == param.shape:
        return group.part(value, part, what=what)
    if value is None:
        return value
    shown = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
             else f"a {type(value).__name__}")
    raise ValueError(
        f"{what} is {shown}; a sharded parameter's optimizer state is saved per element (the shape of this "
        f"rank's part, {tuple(param.shape)}) or as 0-dim tensors, which reshard to any world size"
    )


def _is_scalar(value: Any, part: PartExtent, current: torch.Tensor | None) -> bool:
    """Whether a 0-dim value is a per-parameter scalar rather than whole per-element state, which it
    is too for a 0-dim parameter: there the optimizer's current value (flat, for per-element state)
    tells them apart."""
    if not isinstance(value, torch.Tensor) or value.dim() > 0:
        return False
    return len(part.shape) > 0 or current is None or current.dim() == 0
