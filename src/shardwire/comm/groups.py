"""Subgroups of the default process group: where a group's ranks sit on nodes, the groups of ranks
that share a node or sit on different nodes, and the subgroups a hybrid sharding layout splits a
group into (the default group itself is ``shardwire.worker``'s)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from shardwire.placement import Placement, launch_ranks_per_node, placement


def placement_of(group: dist.ProcessGroup, ranks_per_node: int | None = None) -> Placement:
    """The placement of ``group``'s ranks, on nodes of ``ranks_per_node`` global ranks, by default
    the launch's ranks per node of the default group (torchrun's or SLURM's:
    ``launch_ranks_per_node``; the lenient rule: see ``shardwire.placement``)."""
    members = dist.get_process_group_ranks(group)
    per_node = launch_ranks_per_node(dist.get_world_size()) if ranks_per_node is None else ranks_per_node
    return placement(members, per_node)


def intra_node_group(launched: Placement) -> dist.ProcessGroup:
    """The group of this rank's node. Every rank must call it (each node gets its own group)."""
    group, _ = dist.new_subgroups_by_enumeration(launched.node_members())
    return group


def inter_node_group(launched: Placement) -> dist.ProcessGroup | None:
    """The group of each node's first rank; None on other ranks. Every rank must call it.

    Every rank makes a group (that of its position on every node), so that every process holds as
    many groups as the others: torch names a group its members make alone (``_own_group``) by its
    ranks and the count of groups the process holds, and a group of some ranks only would give the
    next such group one name on them and another on the rest, which then wait for each other."""
    columns = [[launched.rank(node, local) for node in range(launched.nodes)]
               for local in range(launched.ranks_per_node)]
    group, _ = dist.new_subgroups_by_enumeration(columns)
    return group if dist.get_rank() in launched.cross_node_members() else None


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
    a subgroup there). torch orders a new group's ranks ascending unless told not to (``sort_ranks``,
    which torch 2.11 lacks), so it is told only where ``ranks`` are in another order."""
    options = {"device_id": device} if device.type == "cuda" else {}
    if ranks != sorted(ranks):
        options["sort_ranks"] = False
    return dist.new_group(ranks, timeout=timeout, use_local_synchronization=True, **options)
