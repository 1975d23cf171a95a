"""Where ranks sit: which share a node (and its fast links), which do not.

Launchers place ranks node by node: torchrun gives node k the ranks k * LOCAL_WORLD_SIZE onwards.
The placement is read by two rules, because the two readers risk different things when it is wrong:

* ``placement`` (a process group's own ranks, for the engine's transport). A subgroup (a hybrid
  layout's shard group or replica group) has the placement of its ranks: a group whose ranks, in
  its own order, fill the nodes it spans equally, node after node, is placed that way. Here the
  placement only decides how fast collectives are, never what they compute, so anything else (an
  uneven launch, a group that interleaves nodes) safely falls back to treating the group as one node.
* ``Placement.launched`` (the whole launch, for ``shardwire bench``). There the placement decides
  which ranks a measurement covers (each node's group, one rank per node): falling back to one node
  would report a different measurement from the one asked for, so a count of ranks per node that
  does not divide the world is refused.

Torch-free, so the transport, the benchmark, the testbed and the simulator can all use it.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Placement:
    """``world`` ranks, ``ranks_per_node`` to a node, node by node."""

    world: int
    ranks_per_node: int

    @classmethod
    def launched(cls, world: int, ranks_per_node: int | None = None) -> Placement:
        """Which of ``world`` ranks share a node: ``ranks_per_node`` when given (to treat one machine's
        processes as several nodes, say), else torchrun's ``LOCAL_WORLD_SIZE``, else a single node.
        A count that does not divide the world is an error, not a fallback to one node."""
        per_node = ranks_per_node if ranks_per_node is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if per_node < 1 or world % per_node:
            raise ValueError(f"{world} ranks do not split into nodes of {per_node} ranks each")
        return cls(world, per_node)

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    def place(self, rank: int) -> tuple[int, int]:
        """(node, index of the rank within its node)."""
        return divmod(rank, self.ranks_per_node)

    def rank(self, node: int, local: int) -> int:
        return node * self.ranks_per_node + local

    def node_members(self) -> list[list[int]]:
        """Each node's ranks."""
        return [[self.rank(node, local) for local in range(self.ranks_per_node)] for node in range(self.nodes)]

    def cross_node_members(self) -> list[int]:
        """One rank per node (each node's first), to measure what crosses between nodes alone."""
        return [self.rank(node, 0) for node in range(self.nodes)]


def placement(members: list[int], ranks_per_node: int) -> Placement:
    """The placement of a group whose ranks are ``members`` (global ranks, in the group's order),
    on nodes of ``ranks_per_node`` global ranks each; one node where they do not fill nodes evenly."""
    world = len(members)
    if ranks_per_node < 1:
        return Placement(world, world)
    nodes = [rank // ranks_per_node for rank in members]
    spanned = list(dict.fromkeys(nodes))
    per_node, uneven = divmod(world, len(spanned))
    if uneven or nodes != [node for node in spanned for _ in range(per_node)]:
        return Placement(world, world)
    return Placement(world, per_node)
