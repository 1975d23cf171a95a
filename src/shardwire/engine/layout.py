"""Layouts: which ranks split a unit's buffer, and which hold copies of the same split.

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
all-reduced between groups, and every H steps the ``replicate`` communicator averages the change
of the parameters instead: ``2 w P (N-1)/N / H`` bytes leaving a node per step for a sync wire of
``w`` bytes per element.

Memory per rank (fp32 master weights and their gradients, Adam's two moments, so 16 bytes per
element held; see ``shardwire.sim.memory`` for what a step adds on top): ``16 P / W`` for full,
``16 P / G`` for hybrid, ``16 P / W + c P / G`` for hybrid_secondary (every unit's secondary
shard is held from its forward to its backward).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import zlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from shardwire.comm import groups
from shardwire.comm.communicator import Communicator
from shardwire.comm.quorum import Quorum
from shardwire.comm.wire import Wire
from shardwire.engine.mixed_precision import DTYPES, MixedPrecision
from shardwire.engine.diloco import DiLoCo
from shardwire.engine.fault_tolerance import FaultTolerance
from shardwire.options import SettingError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement

LAYOUTS = ("full", "hybrid", "hybrid_secondary")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The communicators of a layout. Where two roles fall on the same ranks they are one object."""

    name: str  # one of LAYOUTS
    world: Communicator  # every rank: set-up, agreement checks, checkpoints
    shard: Communicator  # splits each buffer: gathers and reduce-scatters
    replicate: Communicator | None = None  # hybrid: all-reduces each gradient shard between groups
    secondary: Communicator | None = None  # hybrid_secondary: backward gathers from secondary shards
    diloco: DiLoCo | None = None  # hybrid: the groups train apart and sync every H steps over replicate
    quorum: Quorum | None = None  # fault-tolerant groups: diloco's syncs average over it, not replicate

    @property
    def across_groups(self) -> Communicator | Quorum | None:
        """What a DiLoCo sync averages over: the quorum of fault-tolerant groups, else ``replicate``."""
        return self.quorum if self.quorum is not None else self.replicate

    @property
    def communicators(self) -> list[Communicator]:
        found = [self.world, self.shard, self.replicate, self.secondary]
        return list({id(c): c for c in found if c is not None}.values())

    @property
    def checked_every_step(self) -> list[Communicator]:
        """The communicators whose collectives every step's forward compares across ranks: all of
        them, except under DiLoCo those that span the groups (they carry a collective every H steps,
        and are compared when a sync is issued), so that no step waits on the link between groups."""
        if self.diloco is None:
            return self.communicators
        spanning = (self.world, self.replicate)
        return [comm for comm in self.communicators if comm is self.shard or all(comm is not c for c in spanning)]

    @property
    def reducing(self) -> list[Communicator]:
        """The communicators that carry gradient reductions (the end of backward waits for them; a
        sync in flight on ``replicate`` runs on past it)."""
        return [comm for comm in (self.shard, self.gradient_replicas) if comm is not None]

    @property
    def gradient_replicas(self) -> Communicator | None:
        """Where each reduced gradient shard is all-reduced between the groups at every step:
        ``replicate``, unless the groups sync every H steps instead."""
        return self.replicate if self.diloco is None else None

    @property
    def writes_shards(self) -> bool:
        """Whether this rank saves its shards in a checkpoint: each group holds the same ones, and
        the first group's ranks write them."""
        return self.replicate is None or self.replicate.rank == 0

    @functools.cached_property
    def mesh(self) -> DeviceMesh:
        """The DTensor mesh a parameter is placed on, as FSDP2 places it: the shard group's ranks, and
        under ``hybrid`` a 2-D mesh of the groups (``replicate``) by the ranks of a group (``shard``),
        FSDP2's HSDP mesh. It creates no process group: its dimensions are the layout's own groups,
        so a DTensor operation on the parameters (a norm's sum) runs over exactly the ranks that
        split them."""
        from torch.distributed.device_mesh import DeviceMesh

        device_type = self.shard.device.type
        if self.replicate is None:
            return DeviceMesh.from_group(self.shard.group, device_type, mesh_dim_names=("shard",))
        ranks = torch.tensor(dist.get_process_group_ranks(self.world.group)).view(self.replicate.world,
                                                                                  self.shard.world)
        return DeviceMesh.from_group([self.replicate.group, self.shard.group], device_type, mesh=ranks,
                                     mesh_dim_names=("replicate", "shard"))

    def placements(self, replicated: bool = False) -> tuple[Placement, ...]:
        """How a parameter is placed on ``mesh``: split by rows over the shard group (``Shard(0)``),
        or whole on every rank for a ``replicated`` (0-dim) one; under ``hybrid`` the same in
        every group (``Replicate()``), which holds between syncs too, when the groups' values part:
        each group computes on its own model then, as the mesh's collectives stay within the group."""
        from torch.distributed.tensor import Replicate, Shard

        within = Replicate() if replicated else Shard(0)
        return (within,) if self.replicate is None else (Replicate(), within)

    @classmethod
    def build(cls, layout: str, size: int, wire: Wire, diloco: DiLoCo | None, policy: MixedPrecision,
              group: dist.ProcessGroup, device: torch.device, timeout: datetime.timedelta,
              fault_tolerance: FaultTolerance | None = None) -> Layout:
        """The communicators of ``layout`` with shard groups of ``size`` (from ``group_size``), able to
        carry ``wire``'s quantized reductions and ``diloco``'s syncs (checked by ``check_diloco``),
        between the jobs of ``fault_tolerance``'s groups where given (``check_fault_tolerance``).
        Every rank creates them in the same order, once all ranks agree on what their collectives will carry: the
        layout, the wire, DiLoCo's settings and the mixed-precision ``policy``."""
        world = Communicator(group, device, timeout=timeout)
        _check_same_settings_on_all_ranks(world, layout, size, wire, diloco, policy)
        if wire.grads is not None and device.type == "cuda" and group is not dist.group.WORLD:
            raise ValueError(
                f"wire grads={wire.grads!r} over a process group other than the default one is not supported on "
                f"NCCL (its reductions make subgroups of the nodes, which split the default communicator): shard "
                f"over the default group, or leave gradients unquantized"
            )
        if (diloco is not None and diloco.codec is not None and device.type == "cuda"
                and group is not dist.group.WORLD):
            raise ValueError(
                f"diloco wire={diloco.wire!r} over a process group other than the default one is not supported on NCCL "
                f"(its all-reduce makes subgroups of the nodes, as quantized gradients do): shard over the default "
                f"group, or use diloco with wire=none"
            )
        quorum = None if fault_tolerance is None else Quorum(fault_tolerance, world)
        built = dataclasses.replace(_communicators(layout, size, world, device, timeout, diloco is not None),
                                    diloco=diloco, quorum=quorum)
        if wire.grads is not None:
            for comm in built.communicators:
                comm.prepare_quantized_reductions()
        elif diloco is not None and diloco.codec is not None and quorum is None:
            built.replicate.prepare_quantized_reductions()
        return built


def group_size(layout: str, shard_group_size: int | None, world: int, ranks_per_node: int) -> int:
    """The ranks a shard spans in a process group of ``world`` ranks (``ranks_per_node`` on each
    node: the default), or a ``ValueError`` saying what contradicts what. It needs no process group,
    so launchers check their options with it before starting a worker."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    if shard_group_size is not None and (type(shard_group_size) is not int or shard_group_size < 1):
        raise ValueError(
            f"shard_group_size must be a positive integer (ranks per shard group), got {shard_group_size!r}"
        )
    if layout == "full":
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
            "process group has one: use {full} (or launch more ranks)", given=("layout", layout), full=("layout", "full"))
    size = ranks_per_node if shard_group_size is None else shard_group_size
    if world % size:
        divisors = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        raise SettingError(f"{{size}} does not divide the {world} ranks of the process group: choose one of {divisors}",
                           size=("shard_group_size", size))
    return size


def check_diloco(diloco: DiLoCo | None, layout: str, size: int, world: int) -> None:
    """A ``ValueError`` where ``diloco`` cannot run: it averages the groups of the ``hybrid`` layout
    (one group of all ranks is Lookahead: the outer step over one optimizer's steps). Launchers check
    their options with it before starting a worker."""
    if diloco is None:
        return
    if layout != "hybrid":
        raise SettingError(
            f"{{diloco}} lets the groups of the hybrid layout train apart and averages them every "
            f"{diloco.sync_every} steps; {{given}} has no groups holding a model of their own: use {{hybrid}}",
            diloco=("diloco", str(diloco)), given=("layout", layout), hybrid=("layout", "hybrid"))


def _communicators(layout: str, size: int, world: Communicator, device: torch.device,
                   timeout: datetime.timedelta, diloco: bool) -> Layout:
    """``diloco``: the groups sync every H steps, so a hybrid layout of one group keeps its (one-rank)
    groups across, where otherwise it is the full layout."""
    group = world.group
    if layout == "full" or (size == world.world and not diloco):
        return Layout(layout, world, world)
    if device.type == "cuda" and group is not dist.group.WORLD:
        raise ValueError(
            f"layout={layout!r} over a process group other than the default one is not supported on "
            f"NCCL (its subgroups split the default communicator, which every rank must join): shard "
            f"over the default group, or use layout='full'"
        )
    within = (world if size == world.world
              else Communicator(groups.blocks(group, size, device, timeout), device, timeout=timeout))
    if layout == "hybrid":
        across = Communicator(groups.columns(group, size, device, timeout), device, timeout=timeout)
        return Layout(layout, world, within, replicate=across)
    return Layout(layout, world, world, secondary=within)


def _check_same_settings_on_all_ranks(world: Communicator, layout: str, size: int, wire: Wire,
                                      diloco: DiLoCo | None, policy: MixedPrecision) -> None:
    """Ranks asking for different layouts would wait for each other in different group creations
    until the timeout, and ranks with different wires, DiLoCo settings or mixed precision would exchange
    messages of different sizes or dtypes, or at different steps, which no backend reports clearly
    (gloo aborts): compare every setting that shapes the collectives first, in one small all-gather,
    and say which rank asked for what."""
    if world.world == 1:
        return
    precision = [DTYPES.index(policy.param_dtype), DTYPES.index(policy.reduce_dtype)]
    rows = world.all_gather_values([LAYOUTS.index(layout), size, zlib.crc32(str(wire).encode()),
                                    zlib.crc32(str(diloco).encode()), *precision], tag="settings check")
    if any(row[:2] != rows[0][:2] for row in rows):
        asked = "; ".join(f"rank {r}: layout={LAYOUTS[code]!r} in groups of {n}"
                          for r, (code, n, *_) in enumerate(rows))
        raise ValueError(f"ranks asked for different layouts ({asked}): pass the same layout and "
                         f"shard_group_size on every rank")
    differing = [r for r, row in enumerate(rows) if row[2] != rows[0][2]]
    if differing:
        raise ValueError(f"ranks {differing} asked for a different wire than rank 0 (rank {world.rank} asked for "
                         f"wire={str(wire)!r}): pass the same wire on every rank")
    differing = [r for r, row in enumerate(rows) if row[3] != rows[0][3]]
    if differing:
        raise ValueError(f"ranks {differing} asked for different DiLoCo settings than rank 0 (rank {world.rank} "
                         f"asked for diloco={str(diloco)!r}): pass the same diloco on every rank")
    if any(row[4:] != rows[0][4:] for row in rows):
        asked = "; ".join(f"rank {r}: param_dtype={DTYPES[param]}, reduce_dtype={DTYPES[reduce]}"
                          for r, (*_, param, reduce) in enumerate(rows))
        raise ValueError(f"ranks asked for different mixed precision ({asked}): pass the same mixed_precision "
                         f"on every rank")
