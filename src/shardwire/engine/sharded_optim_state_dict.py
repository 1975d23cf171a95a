"""``register_optimizer``: no longer needed, kept for a release so that scripts calling it still run.

A sharded model's parameters are DTensors of their full shapes, as FSDP2's are, so an optimizer's
state for them is too: torch's distributed checkpointing (``get_state_dict``, ``set_state_dict``,
``dcp.save``, ``dcp.load``) saves, gathers and reshards it with no registration.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from shardwire.engine.shard import engine_of


def register_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Does nothing but warn: an optimizer of a sharded model needs no registration."""
    engine_of(model)
    warnings.warn(
        "shardwire.register_optimizer is no longer needed and does nothing: a sharded model's parameters are "
        "DTensors, so get_state_dict and DCP read their optimizer state as they read FSDP2's. Remove the call; "
        "it will be removed in a later release",
        FutureWarning,
        stacklevel=2,
    )
