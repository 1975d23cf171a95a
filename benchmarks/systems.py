"""The training systems the benchmarks compare, each wrapping the same GPT the way its users would.

shardwire and PyTorch FSDP2 (``fully_shard``) shard the same units (the transformer blocks, plus the
root) with the same reshard policy; DDP replicates the model and all-reduces gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import shardwire
from shardwire.models.gpt import Block

SYSTEMS = ("shardwire", "fsdp2", "ddp")


def wrap(system: str, model: nn.Module, *, reshard: bool = True, prefetch: int = 2) -> nn.Module:
    if system == "shardwire":
        return shardwire.shard(model, units=[Block], reshard_after_forward=reshard, prefetch=prefetch)
    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        device = next(model.parameters()).device
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh)
        return model
    if system == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")


def clip(system: str, model: nn.Module, max_norm: float) -> torch.Tensor:
    if system == "shardwire":
        return shardwire.clip_grad_norm_(model, max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
