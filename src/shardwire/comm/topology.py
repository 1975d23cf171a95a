"""Where the ranks of a process group sit: which share a node (and its fast links), which do not.

Launchers place ranks node by node: torchrun gives node k the ranks k * LOCAL_WORLD_SIZE onwards.
The engine's point-to-point collectives use this to send each byte across the slow inter-node link
only once per node. A subgroup (a hybrid layout's shard group or replica group) has the placement
of its ranks: a group whose ranks, in its own order, fill the nodes it spans equally, node after
node, is placed that way. The placement only decides how fast collectives are, never what they
compute, so anything else (an uneven launch, a group that interleaves nodes) safely falls back to
treating the group as one node.
"""

from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Topology:
    world: int
    ranks_per_node: int

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    def place(self, rank: int) -> tuple[int, int]:
        """(node, index of the rank within its node)."""
        return divmod(rank, self.ranks_per_node)

    def rank(self, node: int, local: int) -> int:
        return node * self.ranks_per_node + local


def topology(group: dist.ProcessGroup) -> Topology:
    """The placement of ``group``'s ranks, from torchrun's ``LOCAL_WORLD_SIZE`` ranks per node of
    the default group."""
    members = dist.get_process_group_ranks(group)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return placement(members, per_node)


def placement(members: list[int], ranks_per_node: int) -> Topology:
    """The placement of a group whose ranks are ``members`` (global ranks, in the group's order),
    on nodes of ``ranks_per_node`` global ranks each."""
    world = len(members)
    if ranks_per_node < 1:
        return Topology(world, world)
    nodes = [rank // ranks_per_node for rank in members]
    spanned = list(dict.fromkeys(nodes))
    per_node, uneven = divmod(world, len(spanned))
    if uneven or nodes != [node for node in spanned for _ in range(per_node)]:
        return Topology(world, world)
    return Topology(world, per_node)
