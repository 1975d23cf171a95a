"""Process groups: joining the launcher's world, or making a one-process world when there is none;
where a group's ranks sit on nodes; the groups of ranks that share a node, or sit on different
nodes; and the subgroups a hybrid sharding layout splits a group into."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from shardwire.placement import Placement, placement


def backend_for(device: torch.device) -> str:
    """The backend torch.distributed uses for tensors on ``device``: NCCL for CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def ensure_initialized(device: torch.device, timeout: datetime.timedelta | None = None) -> None:
    """Initialize the default process group if nobody has.

    Under torchrun (or any launcher that sets ``WORLD_SIZE`` and the rendezvous variables) this joins
    that world; a plain ``python script.py`` gets a world of one, so single-process runs need no
    distributed set-up at all. On CUDA the group is bound to ``device`` (``device_id``), which also
    becomes the current device: NCCL would otherwise set itself up on whatever device is current,
    cuda:0 on every rank.
    """
    if dist.is_initialized():
        return
    backend = backend_for(device)
    kwargs = {} if timeout is None else {"timeout": timeout}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(backend, **kwargs)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)


def check_backend_serves(group: dist.ProcessGroup, device: torch.device) -> None:
    """Fail early, with advice, when the group's backend cannot move tensors on ``device``."""
    backend = str(dist.get_backend(group))
    if device.type == "cpu" and backend == "nccl":
        raise ValueError(
            "the process group uses NCCL, which only moves CUDA tensors, but the model is on the "
            "CPU: move the model to its GPU (model.to(f'cuda:{local_rank}')) or use the gloo backend"
        )
    if device.type == "cuda" and backend == "gloo":
        raise ValueError(
            "the process group uses gloo but the model is on CUDA: initialize it with "
            "backend='nccl' (or 'cpu:gloo,cuda:nccl')"
        )


def placement_of(group: dist.ProcessGroup) -> Placement:
    """The placement of ``group``'s ranks, from torchrun's ``LOCAL_WORLD_SIZE`` ranks per node of
    the default group (the lenient rule: see ``shardwire.placement``)."""
    members = dist.get_process_group_ranks(group)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return placement(members, per_node)


def intra_node_group(launched: Placement) -> dist.ProcessGroup:
    """The group of this rank's node. Every rank must call it (each node gets its own group)."""
    group, _ = dist.new_subgroups_by_enumeration(launched.node_members())
    return group


def inter_node_group(launched: Placement) -> dist.ProcessGroup | None:
    """The group of each node's first rank; None on other ranks. Every rank must call it."""
    ranks = launched.cross_node_members()
    group = dist.new_group(ranks)
    return group if dist.get_rank() in ranks else None


def blocks(group: dist.ProcessGroup, size: int, device: torch.device,
           timeout: datetime.timedelta) -> dist.ProcessGroup:
    """This rank's block when ``group`` is cut into blocks of ``size`` consecutive ranks. With ranks
    placed node by node and ``size`` the ranks of a node, the blocks are the nodes."""
    members, me = dist.get_process_group_ranks(group), dist.get_rank(group)
    start = me // size * size
    return _own_group(members[start:start + size], device, timeout)


def columns(group: dist.ProcessGroup, size: int, device: torch.device,
            timeout: datetime.timedelta) -> dist.ProcessGroup:
    """The group of the ranks at this rank's position in every block of ``size`` (see ``blocks``):
    with blocks that are nodes, one rank per node."""
    members, me = dist.get_process_group_ranks(group), dist.get_rank(group)
    return _own_group(members[me % size::size], device, timeout)


def _own_group(ranks: list[int], device: torch.device, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A group of ``ranks`` (global ranks, in the group's order), created by its members
    (``use_local_synchronization``). On gloo no rank waits for groups it is not in; on NCCL with a
    default group bound to a device, torch splits the default communicator, which every rank of the
    job joins: all ranks must create their groups together (``shard`` refuses hybrid layouts over
    a subgroup there)."""
    options = {"device_id": device} if device.type == "cuda" else {}
    return dist.new_group(ranks, timeout=timeout, use_local_synchronization=True, sort_ranks=False, **options)
