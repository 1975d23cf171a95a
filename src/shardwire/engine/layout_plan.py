"""Layouts as a plan: which ranks split a unit's buffer, which hold copies of the same split, and over
which ranks each collective of a step runs; made once from the user's options, without torch, and
read by the engine (its communicators, ``shardwire.engine.layout``), the simulator and its memory
model, the planner and the training loop's start line, so that a layout is described in one place.

The ``W`` ranks of the process group are cut into groups of ``G`` consecutive ranks
(``shard_group_size``; by default the ranks of a node, as launchers place ranks node by node), so
``R = W / G`` groups. Per step, for a model of ``P`` parameters:

``full``              every buffer is split over all ``W`` ranks: each unit is gathered over the
                      world for forward and again for backward, its gradient reduce-scattered over
                      the world. Across nodes that is the parameters three times.
``hybrid``            split over the ``G`` ranks of a group, replicated across the ``R`` groups
                      (FSDP's HYBRID_SHARD, FSDP2's HSDP; MiCS for groups of any size): gathers and
                      reduce-scatters stay within the group, and only each rank's reduced gradient
                      shard is all-reduced with the ranks of its position in the other groups,
                      asynchronously, while backward goes on. Each rank keeps ``1/G`` of the master
                      weights, gradients and optimizer state instead of ``1/W``.
``hybrid_secondary``  ZeRO++'s hpZ: master weights, gradients and optimizer state split over the
                      world, and the forward gather over the world, as ``full``; after a unit's
                      forward each rank keeps its ``1/G`` of the gathered compute-dtype parameters
                      (the secondary shard), and backward gathers from those within the group.

The collectives of a step, and the bytes that leave each node when the groups are the ``N`` nodes
(``c`` and ``r`` the bytes of an element in the compute and the reduction dtype):

====================  ===============================================  =========================
layout                collectives per unit and step                    bytes leaving a node
====================  ===============================================  =========================
full                  gather over W (forward, backward),               P (N-1)/N (2c + r)
                      reduce-scatter over W
hybrid                gather over G (forward, backward),               2 r P (N-1)/N
                      reduce-scatter over G, all-reduce of the shard
                      over R
hybrid_secondary      gather over W (forward), over G (backward),      P (N-1)/N (c + r)
                      reduce-scatter over W
====================  ===============================================  =========================

With a quantized wire (``shardwire.comm.wire``), ``c`` and ``r`` become its bytes per element for
the part that crosses nodes: the gathers, and the partial sums of reductions sent between nodes.
The root is gathered once a step, not twice, since it stays gathered, and so are the units the
backward pass gathers as it opens: the first ``max(1, prefetch)`` of backward's order, the last
blocks (``shardwire.engine.runtime``).

``hybrid`` with ``diloco`` (``shardwire.engine.diloco``) trains each group apart: no gradient is
all-reduced between groups, and every H steps the groups average the change of the parameters
instead: ``2 w P (N-1)/N / H`` bytes leaving a node per step for a sync wire of ``w`` bytes per
element. One group of every rank is allowed then (Lookahead), each rank its own replica group.

Memory per rank (fp32 master weights and their gradients, Adam's two moments, so 16 bytes per
element held; see ``shardwire.sim.memory`` for what a step adds on top): ``16 P / W`` for full,
``16 P / G`` for hybrid, ``16 P / W + c P / G`` for hybrid_secondary (every unit's secondary
shard is held from its forward to its backward).

FSDP2's ``FSDPMeshInfo``/``HSDPMeshInfo`` play this part there; here the plan needs no process
group, so launchers check their options with it before starting a worker, and the simulator reads
the same rules for a cluster that does not exist.
"""

from __future__ import annotations

import dataclasses

from shardwire.engine.diloco import DiLoCo
from shardwire.mappings import shown
from shardwire.options import SettingError

LAYOUTS = ("full", "hybrid", "hybrid_secondary")


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    """A layout of ``world`` ranks in groups of ``group`` (``make`` checks them): ``name`` is one of
    ``LAYOUTS``; ``diloco``: the groups train apart and sync every H steps (hybrid only)."""

    name: str
    world: int
    group: int
    diloco: bool = False

    @classmethod
    def make(cls, name: str, shard_group_size: int | None, world: int, ranks_per_node: int, *,
             diloco: DiLoCo | None = None, one_group: bool = False) -> LayoutPlan:
        """The plan of ``name`` over ``world`` ranks, ``ranks_per_node`` on each node (a group's
        default size), with ``diloco``'s syncs between its groups, or a ``ValueError`` saying what
        contradicts what. ``one_group``: every rank is one group whatever the nodes (a
        fault-tolerant job: each job is a group of its own)."""
        if name not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {shown(name)}")
        group = world if one_group else _group_size(name, shard_group_size, world, ranks_per_node)
        if diloco is not None and name != "hybrid":  # one group of all ranks is Lookahead: allowed
            raise SettingError(
                f"{{diloco}} lets the groups of the hybrid layout train apart and averages them every "
                f"{diloco.sync_every} steps; {{given}} has no groups holding a model of their own: use {{hybrid}}",
                diloco=("diloco",), given=("layout", name), hybrid=("layout", "hybrid"))
        return cls(name, world, group, diloco is not None)

    @property
    def groups(self) -> int:
        """``R``: the groups, each holding the whole model under ``hybrid``."""
        return self.world // self.group

    @property
    def grouped(self) -> bool:
        """Whether the layout has groups to name (``hybrid``, ``hybrid_secondary``); ``full``'s one
        group is the world."""
        return self.name != "full"

    @property
    def split_over(self) -> int:
        """The ranks a unit's master weights, gradients and optimizer state are split over, which its
        forward gather and its reduce-scatter span: a group's under ``hybrid``, else the world's."""
        return self.group if self.name == "hybrid" else self.world

    @property
    def backward_gather_over(self) -> int:
        """The ranks backward gathers a unit from: a group's secondary shards under ``hybrid_secondary``."""
        return self.group if self.name == "hybrid_secondary" else self.split_over

    @property
    def replicated(self) -> bool:
        """Whether each rank's shards have copies on the ranks of its position in other groups (or,
        under DiLoCo with one group, a replica group of its own): ``hybrid``'s second dimension."""
        return self.name == "hybrid" and (self.groups > 1 or self.diloco)

    @property
    def reduces_across_groups(self) -> bool:
        """Whether each reduced gradient shard is all-reduced between the groups at every step:
        ``hybrid`` with several groups, unless they sync every H steps instead."""
        return self.name == "hybrid" and self.groups > 1 and not self.diloco

    @property
    def keeps_secondary(self) -> bool:
        """Whether forward keeps a group's part of each gathered unit for backward (hpZ's secondary shard)."""
        return self.backward_gather_over < self.split_over

    @property
    def as_full(self) -> bool:
        """Whether it runs as ``full`` does: one group of every rank, nothing kept apart."""
        return self.split_over == self.world and not (self.replicated or self.keeps_secondary)


def _group_size(name: str, shard_group_size: int | None, world: int, ranks_per_node: int) -> int:
    """``G``: the world under ``full``, else ``shard_group_size`` or a node's ranks, a divisor of the world."""
    if shard_group_size is not None and (type(shard_group_size) is not int or shard_group_size < 1):
        raise ValueError(
            f"shard_group_size must be a positive integer (ranks per shard group), got {shard_group_size!r}"
        )
    if name == "full":
        if shard_group_size not in (None, world):
            raise SettingError(
                f"{{full}} splits every buffer over all {world} ranks of the process group, so {{size}} "
                f"contradicts it: leave it out, or use {{hybrid}} or {{secondary}} to shard within groups of "
                f"{shard_group_size}",
                full=("layout", "full"), size=("shard_group_size", shard_group_size), hybrid=("layout", "hybrid"),
                secondary=("layout", "hybrid_secondary"))
        return world
    if world == 1:
        raise SettingError(
            "{given} shards within groups and replicates across them, which needs more than one rank; this "
            "process group has one: use {full} (or launch more ranks)", given=("layout", name), full=("layout", "full"))
    size = ranks_per_node if shard_group_size is None else shard_group_size
    if world % size:
        divisors = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        raise SettingError(f"{{size}} does not divide the {world} ranks of the process group: choose one of {divisors}",
                           size=("shard_group_size", size))
    return size
