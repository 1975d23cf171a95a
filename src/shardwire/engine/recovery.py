"""What a fault-tolerant group that is behind receives from a live peer besides the model
(``shardwire.engine.fault_tolerance``): the optimizer's state, the learning-rate schedule, anything
with ``state_dict`` and ``load_state_dict``. torchft's ``Manager.register_state_dict_fn`` carries it;
this module turns a sharded model's optimizer state into plain tensors for the journey (the peer's
DTensors live on its own process groups) and back into DTensors laid out as this rank's parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardwire.engine.shard import engine_of


def recover_with(model: nn.Module, **stateful: Any) -> None:
    """Name what a recovering group receives besides the model, under ``shard(...,
    fault_tolerance=...)``: ``recover_with(model, optimizer=optimizer, scheduler=scheduler)``. Every
    group names the same keys. An optimizer's state crosses as this rank's shards; other objects as
    their ``state_dict()``. Without fault tolerance it does nothing."""
    quorum = engine_of(model).layout.quorum
    if quorum is None:
        return
    for key, obj in stateful.items():
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"recover_with: {key} has no state_dict() and load_state_dict(); pass an optimizer, "
                            f"a scheduler or another object that has them")
        if isinstance(obj, torch.optim.Optimizer):
            quorum.register(key, lambda obj=obj: _local_optimizer_state(obj),
                            lambda state, obj=obj: _load_optimizer_state(obj, state))
        else:
            quorum.register(key, obj.state_dict, obj.load_state_dict)


def _local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    state = optimizer.state_dict()
    return {"state": {index: {key: _local(value) for key, value in values.items()}
                      for index, values in state["state"].items()},
            "param_groups": state["param_groups"]}


def _local(value: Any) -> Any:
    if isinstance(value, DTensor):
        value = value.to_local()
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a peer's ``_local_optimizer_state``: each tensor shaped as a parameter's shard becomes a
    DTensor laid out as that parameter."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    restored = {}
    for index, values in state["state"].items():
        param = params[index]
        restored[index] = {key: _as_param(value, param) for key, value in values.items()}
    optimizer.load_state_dict({"state": restored, "param_groups": state["param_groups"]})


def _as_param(value: Any, param: torch.Tensor) -> Any:
    if not (isinstance(param, DTensor) and isinstance(value, torch.Tensor)):
        return value
    local = param.to_local()
    if value.shape != local.shape:
        return value  # a scalar such as Adam's step
    return DTensor.from_local(value.to(local.device, local.dtype), param.device_mesh, param.placements,
                              shape=param.shape, stride=param.stride(), run_check=False)
