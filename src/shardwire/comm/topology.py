"""Where the ranks of a process group sit: which share a node (and its fast links), which do not.

Launchers place ranks node by node: torchrun gives node k the ranks k * LOCAL_WORLD_SIZE onwards.
The engine's point-to-point collectives use this to send each byte across the slow inter-node link
only once per node. The placement only decides how fast they are, never what they compute, so
anything unexpected (a subgroup, an uneven launch) safely falls back to treating the group as one node.
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
    """The placement of ``group``'s ranks: torchrun's ``LOCAL_WORLD_SIZE`` ranks per node for the
    world group, one node otherwise."""
    world = dist.get_world_size(group)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if group is dist.group.WORLD and 0 < per_node < world and world % per_node == 0:
        return Topology(world, per_node)
    return Topology(world, world)
