"""The communicators of a layout: which process groups carry each of a step's collectives.

What a layout splits over which ranks is its plan (``shardwire.engine.layout_plan``, torch-free, the
one description the simulator reads too); this module makes the plan's groups into communicators,
once every rank agrees on the settings that shape their collectives, and places parameters on them
as DTensors (``mesh``, ``placements``), as FSDP2 places them.
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
from shardwire.engine.diloco import DiLoCo
from shardwire.engine.fault_tolerance import FaultTolerance
from shardwire.engine.layout_plan import LAYOUTS, LayoutPlan
from shardwire.engine.mixed_precision import DTYPES, MixedPrecision

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement


@dataclasses.dataclass(frozen=True)
class Layout:
    """The communicators of a layout. Where two roles fall on the same ranks they are one object."""

    plan: LayoutPlan
    world: Communicator  # every rank: set-up, agreement checks, checkpoints
    shard: Communicator  # splits each buffer: gathers and reduce-scatters
    replicate: Communicator | None = None  # hybrid: all-reduces each gradient shard between groups
    secondary: Communicator | None = None  # hybrid_secondary: backward gathers from secondary shards
    diloco: DiLoCo | None = None  # hybrid: the groups train apart and sync every H steps over replicate
    quorum: Quorum | None = None  # fault-tolerant groups: syncs (diloco) or gradients (per step) average over it

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
    def reducing(self) -> list[Communicator | Quorum]:
        """The communicators that carry gradient reductions (the end of backward waits for them; a
        sync in flight on ``replicate`` runs on past it)."""
        return [comm for comm in (self.shard, self.gradient_replicas) if comm is not None]

    @property
    def gradient_replicas(self) -> Communicator | Quorum | None:
        """Where each reduced gradient shard is all-reduced between the groups at every step:
        ``replicate``, or the quorum of fault-tolerant groups (``shardwire.engine.step_quorum``),
        unless the groups sync every H steps instead."""
        if self.diloco is not None:
            return None
        return self.quorum if self.quorum is not None else self.replicate

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
    def build(cls, plan: LayoutPlan, wire: Wire, diloco: DiLoCo | None, policy: MixedPrecision,
              group: dist.ProcessGroup, device: torch.device, timeout: datetime.timedelta,
              fault_tolerance: FaultTolerance | None = None) -> Layout:
        """The communicators of ``plan`` over the ranks of ``group``, able to carry ``wire``'s
        quantized reductions and ``diloco``'s syncs, between the jobs of ``fault_tolerance``'s groups
        where given (``check_fault_tolerance``). Every rank creates them in the same order, once all
        ranks agree on what their collectives will carry: the layout, the wire, DiLoCo's settings and
        the mixed-precision ``policy``."""
        world = Communicator(group, device, timeout=timeout)
        _check_same_settings_on_all_ranks(world, plan, wire, diloco, policy)
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
        built = dataclasses.replace(_communicators(plan, world, device, timeout), diloco=diloco, quorum=quorum)
        if wire.grads is not None:
            for comm in built.communicators:
                comm.prepare_quantized_reductions()
        elif diloco is not None and diloco.codec is not None and quorum is None:
            built.replicate.prepare_quantized_reductions()
        return built


def _communicators(plan: LayoutPlan, world: Communicator, device: torch.device,
                   timeout: datetime.timedelta) -> Layout:
    """A communicator for each of the plan's groups, one object where two fall on the same ranks."""
    group = world.group
    if plan.as_full:
        return Layout(plan, world, world)
    if device.type == "cuda" and group is not dist.group.WORLD:
        raise ValueError(
            f"layout={plan.name!r} over a process group other than the default one is not supported on "
            f"NCCL (its subgroups split the default communicator, which every rank must join): shard "
            f"over the default group, or use layout='full'"
        )
    within = (world if plan.group == plan.world
              else Communicator(groups.blocks(group, plan.group, device, timeout), device, timeout=timeout))
    if plan.replicated:
        across = Communicator(groups.columns(group, plan.group, device, timeout), device, timeout=timeout)
        return Layout(plan, world, within, replicate=across)
    return Layout(plan, world, world, secondary=within)


def _check_same_settings_on_all_ranks(world: Communicator, plan: LayoutPlan, wire: Wire,
                                      diloco: DiLoCo | None, policy: MixedPrecision) -> None:
    """Ranks asking for different layouts would wait for each other in different group creations
    until the timeout, and ranks with different wires, DiLoCo settings or mixed precision would exchange
    messages of different sizes or dtypes, or at different steps, which no backend reports clearly
    (gloo aborts): compare every setting that shapes the collectives first, in one small all-gather,
    and say which rank asked for what."""
    if world.world == 1:
        return
    precision = [DTYPES.index(policy.param_dtype), DTYPES.index(policy.reduce_dtype)]
    rows = world.all_gather_values([LAYOUTS.index(plan.name), plan.group, zlib.crc32(str(wire).encode()),
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
