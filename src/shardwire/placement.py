"""Where ranks sit: which share a node (and its fast links), which do not.

Launchers place ranks node by node: torchrun gives node k the ranks k * LOCAL_WORLD_SIZE onwards, and
SLURM's srun, with its default block distribution, gives each node consecutive tasks (SLURM_PROCID).
``launch_ranks_per_node`` is the one reading of the launch's ranks per node: torchrun's
``LOCAL_WORLD_SIZE``; else, in a task of a SLURM job step of as many tasks as the world has ranks (a
script started by ``srun`` that makes its process group from SLURM_PROCID and SLURM_NTASKS), SLURM's
tasks per node; else the whole world as one node. The placement is read by two rules, because the
two readers risk different things when it is wrong:

* ``placement`` (a process group's own ranks, for the engine's transport). A subgroup (a hybrid
  layout's shard group or replica group) has the placement of its ranks: a group whose ranks, in
  its own order, fill the nodes it spans equally, node after node, is placed that way. Here the
  placement only decides how fast collectives are, never what they compute, so anything else (an
  uneven launch, a group that interleaves nodes) safely falls back to treating the group as one node.
* ``Placement.launched`` (the whole launch, for ``shardwire bench``). There the placement decides
  which ranks a measurement covers (each node's group, one rank per node): falling back to one node
  would report a different measurement from the one asked for, so a count of ranks per node that
  does not divide the world, or a SLURM step not placed evenly, node by node, is refused.

Torch-free, so the transport, the benchmark, the testbed and the simulator can all use it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

# What srun tells every task of a job step alike: the step's count of tasks and its tasks on each
# node. A batch script runs in no step: the job's variables it holds (SLURM_NTASKS,
# SLURM_TASKS_PER_NODE) describe the tasks srun would start, not the processes the script starts itself.
_SLURM_TASKS, _SLURM_PER_NODE = "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE"
# One entry of SLURM's per-node counts: a count, and "(xN)" for N consecutive nodes with it.
_SLURM_ENTRY = re.compile(r"(\d+)(?:\(x(\d+)\))?")


@dataclasses.dataclass(frozen=True)
class Placement:
    """``world`` ranks, ``ranks_per_node`` to a node, node by node."""

    world: int
    ranks_per_node: int

    @classmethod
    def launched(cls, world: int, ranks_per_node: int | None = None) -> Placement:
        """Which of ``world`` ranks share a node: ``ranks_per_node`` when given (to treat one machine's
        processes as several nodes, say), else the launch's (``launch_ranks_per_node``). A count that
        does not divide the world, or a SLURM step whose tasks are not spread evenly, node by node,
        is an error, not a fallback to one node."""
        if ranks_per_node is not None:
            per_node = ranks_per_node
        elif (per_node := _launched(world, os.environ)) is None:
            raise ValueError(f"SLURM's job step does not place its {world} ranks evenly on nodes, node by node "
                             f"({_slurm_layout(os.environ)})")
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


def launch_ranks_per_node(world: int, environ: Mapping[str, str] | None = None) -> int:
    """The launch's ranks per node, for a world of ``world`` ranks: torchrun's ``LOCAL_WORLD_SIZE``
    where it is set; else, where this process is a task of a SLURM job step of ``world`` tasks,
    SLURM's tasks per node; else ``world``, one node. A step whose tasks are not spread evenly,
    node by node (``2(x3),1``, or a cyclic distribution), is one node here, the lenient rule
    (``Placement.launched`` refuses it instead). ``environ`` defaults to the process's.

    Every rank must come to the same count, or they would form different groups and wait for each
    other: so it reads only what the launcher tells all its ranks alike (never a rank's own
    SLURM_PROCID, which processes a task starts itself all inherit)."""
    per_node = _launched(world, os.environ if environ is None else environ)
    return world if per_node is None else per_node


def _launched(world: int, environ: Mapping[str, str]) -> int | None:
    """``launch_ranks_per_node``'s count, None for a SLURM step of this world not placed evenly."""
    if "LOCAL_WORLD_SIZE" in environ:
        return int(environ["LOCAL_WORLD_SIZE"])
    if _count(environ.get(_SLURM_TASKS)) != world or _SLURM_PER_NODE not in environ:
        return world  # not a SLURM step, or another world's (torchrun's workers in an srun step, say)
    counts = _slurm_counts(environ[_SLURM_PER_NODE])
    distribution = environ.get("SLURM_DISTRIBUTION", "block").split(":")[0].split(",")[0]
    if (not counts or len(set(counts)) > 1 or counts[0] < 1 or sum(counts) != world
            or distribution != "block"):
        return None
    return counts[0]


def _count(text: str | None) -> int | None:
    return int(text) if text is not None and text.isascii() and text.isdigit() else None


def _slurm_counts(text: str) -> list[int]:
    """SLURM's tasks on each node, node by node, from its form of them (``4``, ``4(x2)``,
    ``2(x3),1``: a count, and ``(xN)`` for N consecutive nodes with that count); empty where the
    text is not in that form."""
    counts = []
    for entry in text.split(","):
        if (match := _SLURM_ENTRY.fullmatch(entry.strip())) is None:
            return []
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def _slurm_layout(environ: Mapping[str, str]) -> str:
    """The SLURM variables that placed the step's tasks, as set, for a message."""
    shown = [_SLURM_PER_NODE] + (["SLURM_DISTRIBUTION"] if "SLURM_DISTRIBUTION" in environ else [])
    return ", ".join(f"{name}={environ[name]}" for name in shown)


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
