"""What node failures cost a run: a restart from the last checkpoint, or live recovery of the lost group.

A node fails on average every ``node_mtbf_h`` hours (its mean time between failures, MTBF, which
the user gives), independently of the others, so a job on ``N`` nodes meets a failure every
``M = node_mtbf_h / N`` hours (the job's MTBF). What a failure costs depends on how the job
survives it; either way the price is the goodput, the fraction of the cluster's time that yields
kept steps, and a kept step costs the cluster ``step / goodput`` seconds (the effective step).
Both are expectations to first order in the failure rate (a failure during a recovery is not
counted); a goodput at or below 0, failures faster than the job recovers, is 0: no step is kept.

**Restart from a checkpoint** (every layout: ``torchrun --max-restarts`` with ``shardwire train
--checkpoint-dir``). Every node stops, relaunches its workers, meets the others at the rendezvous
and reads its part of the last checkpoint, ``D = RELAUNCH_S + C / STORAGE_GBps`` for ``C`` bytes
per node; then every node does again the steps since that checkpoint, on average half a cycle of
``tau`` seconds of steps and a save of ``W = C / STORAGE_GBps``. Failures take ``(D + (tau + W) /
2) / M`` of the time, and saves ``W / (tau + W)`` of the rest::

    goodput = tau / (tau + W) x (1 - (D + (tau + W) / 2) / M)

Unless the interval is given, it is the one that maximises this to that order, Young's (1974),
``tau = sqrt(2 W M)``, in whole steps (Daly 2006 refines it where ``tau`` is not short against
``M``).

**Live recovery** (``--fault-tolerance``, ``shardwire.engine.fault_tolerance``: layout hybrid with
DiLoCo, a group per node). A failure costs the lost group its steps since its last sync (``H / 2``
steps of ``t`` on average: it takes the others' state instead), its relaunch, the wait for the
others' next sync, where the lighthouse lets it in (``H / 2F`` steps on average, syncing in ``F``
fragments), and the transfer of its recovery state, ``R`` bytes at its node's ``inter_node`` rate
(torchft sends it over HTTP, which may not reach that rate). Each other group waits for the
lighthouse's heartbeat timeout, loses the sync the failure dropped (a fragment's: ``sync / F``; its
progress is kept for the next) and waits at the returning group's first sync for its transfer: each
at its bound, as the failure may have struck just before a sync or within one. In node-seconds per
failure, for a node's MTBF ``m`` (failures come ``N / m`` a second, over ``N`` nodes' time)::

    L = ((H / 2) (1 + 1 / F) t + RELAUNCH_S + R / link) + (N - 1) (HEARTBEAT_S + sync / F + R / link)
    goodput = 1 - L / m

Under fault tolerance the sync's change crosses as the DiLoCo wire says, as it does between the
groups of one job; no checkpoint is saved, the live groups holding the state.

Without DiLoCo the groups of the hybrid layout meet at every step (fault-tolerant HSDP,
``shardwire.engine.step_quorum``): the failure drops the step it struck for every group, the lost
group relaunches, waits for the others' next step (half a step on average) and adds nothing of its
own to that step, and the recovery carries its parameters too::

    L = ((5 / 2) t + RELAUNCH_S + R / link) + (N - 1) (HEARTBEAT_S + t + R / link)

Not priced there: each step's round trip to the lighthouse for its quorum and its commit vote
(milliseconds on a LAN), and the overlap the all-reduce between groups loses by waiting for its
reduce-scatter on the host (the engine chains the two within a job).

Torch-free, as the rest of the simulator.
"""

from __future__ import annotations

import dataclasses
import math

from shardwire.sim import costs
from shardwire.sim.predict import Prediction
from shardwire.sim.specs import ClusterSpec, SpecError, TrainingSpec
from shardwire.sim.step import layout_plan, sync_phases

# An assumption, not a measurement: the seconds from a failure to every worker stepping again,
# short of reading the checkpoint (torchrun's agents see the failure, start every worker anew:
# Python and torch imports, the CUDA context and NCCL's communicators; the rendezvous; making the
# model). BENCHMARKS.md ("A lost group") saw about 9 s for the tiny GPT on CPU, with no CUDA or
# NCCL to start; a GPU job is assumed to take a minute. A node that does not come back (its
# hardware replaced) is not priced.
RELAUNCH_S = 60.0
# An assumption, not a measurement: the GB/s at which one node writes its part of a checkpoint and
# reads it back, about what one client of a shared file system moves. A checkpoint a restarted
# node reads is on storage every node sees (docs/checkpoints.md), assumed to serve every node at
# this rate at once; local NVMe alone would be several times faster.
STORAGE_GBps = 1.0
# torchft's lighthouse leaves a group out of the next quorum once it has been silent for this long:
# ``torchft_lighthouse --heartbeat_timeout_ms``, 5000 by default (torchft 0.2.0).
HEARTBEAT_S = 5.0

HOUR_S = 3600.0
# A node's MTBF beyond this (a hundred thousand years) is no failure rate: the bound keeps every
# time finite.
MAX_NODE_MTBF_H = 1e9
# More steps between checkpoints than any run takes.
MAX_SAVE_EVERY = 10**12


@dataclasses.dataclass(frozen=True)
class FailureRate:
    """How often a node fails (``node_mtbf_h``: a node's mean time between failures, in hours),
    and the steps between checkpoints when they are given (``save_every``; None: Young's interval)."""

    node_mtbf_h: float
    save_every: int | None = None

    def __post_init__(self):
        if not 0 < self.node_mtbf_h < math.inf:  # NaN fails this too
            raise SpecError(f"--node-mtbf must be positive and finite, got {self.node_mtbf_h:g}: give a node's mean "
                            f"time between failures in hours")
        if self.node_mtbf_h > MAX_NODE_MTBF_H:
            raise SpecError(f"--node-mtbf {self.node_mtbf_h:g} is over {MAX_NODE_MTBF_H:,.0f} hours, a hundred "
                            f"thousand years: give a node's mean time between failures in hours")
        if self.save_every is not None and not 1 <= self.save_every <= MAX_SAVE_EVERY:
            raise SpecError(f"--save-every must be from 1 to {MAX_SAVE_EVERY:,} (steps between checkpoints, more than "
                            f"any run takes), got {self.save_every}")


@dataclasses.dataclass(frozen=True)
class Survival:
    """A way of surviving node failures: the step without them, and the goodput with them."""

    step_time_s: float
    goodput: float

    @property
    def effective_step_time_s(self) -> float:
        """What a kept step costs the cluster's time (infinite where no step is kept)."""
        return self.step_time_s / self.goodput if self.goodput > 0 else math.inf


@dataclasses.dataclass(frozen=True)
class Restart(Survival):
    """Restart from the last checkpoint: saved every ``save_every`` steps (by Young's interval
    where ``young``), ``checkpoint_bytes`` per node, ``save_s`` to write them, ``restart_s`` from a
    failure to stepping again."""

    save_every: int
    young: bool
    checkpoint_bytes: float
    save_s: float
    restart_s: float

    @property
    def interval_s(self) -> float:
        """Seconds of steps between checkpoints."""
        return self.save_every * self.step_time_s


@dataclasses.dataclass(frozen=True)
class LiveRecovery(Survival):
    """Live recovery of the lost group: ``recovery_bytes`` sent to it over its node's link; the
    seconds a failure costs it (``lost_group_s``) and each other group (``other_group_s``)."""

    recovery_bytes: float
    lost_group_s: float
    other_group_s: float


@dataclasses.dataclass(frozen=True)
class FailureCosts:
    """One configuration under a failure rate: by restart, and by live recovery where shardwire can
    recover that way (else ``no_live_recovery`` says why)."""

    rate: FailureRate
    nodes: int
    restart: Restart
    live_recovery: LiveRecovery | None
    no_live_recovery: str | None

    @property
    def job_mtbf_h(self) -> float:
        return job_mtbf_s(self.rate.node_mtbf_h, self.nodes) / HOUR_S


def price(p: Prediction, rate: FailureRate) -> FailureCosts:
    """What failures at ``rate`` cost the configuration ``p`` predicts, each way it can survive them."""
    blocker = why_no_live_recovery(p.cluster, p.training)
    live = None
    if blocker is None:
        live = live_recovery(p, rate.node_mtbf_h)
    return FailureCosts(rate, p.cluster.nodes, restart(p, rate), live, blocker)


def restart(p: Prediction, rate: FailureRate) -> Restart:
    """Restarting every node from the last checkpoint, saved every ``rate.save_every`` steps, or at
    Young's interval."""
    mtbf_s = job_mtbf_s(rate.node_mtbf_h, p.cluster.nodes)
    saved = checkpoint_bytes(p)
    save_s = saved / (STORAGE_GBps * 1e9)
    restart_s = RELAUNCH_S + save_s  # reading it back is as fast as writing it
    every = rate.save_every or max(1, round(young_interval_s(save_s, mtbf_s) / p.step_time_s))
    goodput = restart_goodput(every * p.step_time_s, save_s, restart_s, mtbf_s)
    return Restart(p.step_time_s, goodput, every, rate.save_every is None, saved, save_s, restart_s)


def live_recovery(p: Prediction, node_mtbf_h: float) -> LiveRecovery:
    """Recovering the lost group from a live one, for ``p`` as fault tolerance runs it: meeting at
    each sync under DiLoCo, else at every step (the module's docstring)."""
    diloco = p.training.diloco_settings
    received = recovery_bytes(p)
    transfer_s = received / (p.cluster.inter_node.busbw_GBps * 1e9)
    if diloco is None:  # the step struck is dropped everywhere; the lost group waits for the next, and adds nothing
        lost_group_s = 2.5 * p.step_time_s + RELAUNCH_S + transfer_s
        dropped_s = p.step_time_s
    else:
        lost_group_s = diloco.sync_every / 2 * (1 + 1 / diloco.fragments) * p.step_time_s + RELAUNCH_S + transfer_s
        # a dropped sync is a fragment's: ``_sync`` is the step's share, 1/H of all the fragments' syncs
        dropped_s = diloco.sync_every / diloco.fragments * costs.isolated_s(_sync(p), p.cluster)
    other_group_s = HEARTBEAT_S + dropped_s + transfer_s
    goodput = live_goodput(lost_group_s, other_group_s, p.cluster.nodes, node_mtbf_h * HOUR_S)
    return LiveRecovery(p.step_time_s, goodput, received, lost_group_s, other_group_s)


def job_mtbf_s(node_mtbf_h: float, nodes: int) -> float:
    """Seconds between failures of any of ``nodes`` nodes that fail independently."""
    return node_mtbf_h * HOUR_S / nodes


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's checkpoint interval, the seconds of steps between saves that waste the least time to
    first order: saving more often costs ``save_s`` more often, less often loses more per failure."""
    return math.sqrt(2 * save_s * mtbf_s)


def restart_goodput(interval_s: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """The goodput of restarting from checkpoints saved after every ``interval_s`` of steps, for a
    job that fails every ``mtbf_s`` (the module's docstring)."""
    cycle = interval_s + save_s
    return max(0.0, interval_s / cycle * (1 - (restart_s + cycle / 2) / mtbf_s))


def live_goodput(lost_group_s: float, other_group_s: float, nodes: int, node_mtbf_s: float) -> float:
    """The goodput of recovering live, one group per node, each failing every ``node_mtbf_s``: a
    failure costs the lost group ``lost_group_s`` and each of the others ``other_group_s``."""
    return max(0.0, 1 - (lost_group_s + (nodes - 1) * other_group_s) / node_mtbf_s)


def checkpoint_bytes(p: Prediction) -> float:
    """Bytes one node writes at each checkpoint and reads back at a restart: its GPUs' shards of the
    fp32 parameters and of Adam's moments and, under DiLoCo, of the anchor and outer momentum
    (docs/checkpoints.md: each rank's file holds its shards and their per-element optimizer state)."""
    memory = p.memory
    return p.cluster.gpus_per_node * (memory.parameter_shards + memory.optimizer_state + _outer_bytes(p))


def recovery_bytes(p: Prediction) -> float:
    """Bytes a recovering group's node receives from a live one: its GPUs' shards of Adam's moments
    (``shardwire train`` names the optimizer to recover) and, under DiLoCo, of the anchor and outer
    momentum (the sync that brings the group back sets the parameters to the anchor), else of the
    parameters. For the tiny GPT under DiLoCo, 16 bytes a parameter is 0.741 MB, of the 0.754 MB
    BENCHMARKS.md saw received."""
    sent = _outer_bytes(p) if p.training.diloco_settings is not None else p.memory.parameter_shards
    return p.cluster.gpus_per_node * (p.memory.optimizer_state + sent)


def _outer_bytes(p: Prediction) -> float:
    """DiLoCo's anchor and outer momentum on one GPU: each an fp32 copy of its shard, as its
    parameter shard is (``shardwire.engine.outer``); none without DiLoCo."""
    return 2 * p.memory.parameter_shards if p.training.diloco_settings is not None else 0.0


def _sync(p: Prediction) -> list[costs.Phase]:
    """The phases of the share of a sync each step carries (one ``H``-th of it)."""
    _, phases = sync_phases(p.arch.params, p.cluster, p.training)
    return phases


def why_no_live_recovery(cluster: ClusterSpec, training: TrainingSpec) -> str | None:
    """Why fault tolerance cannot run ``training`` on ``cluster`` as a group per node (as
    ``shardwire.engine.fault_tolerance.check_fault_tolerance`` refuses it), or None where it can."""
    if training.layout != "hybrid":
        return (f"layout {training.layout} needs every node at every step; live recovery (--fault-tolerance) needs "
                f"layout hybrid, whose groups each hold the model")
    if cluster.nodes == 1:
        return "one node is one group, with no live group to recover from"
    if (group := layout_plan(cluster, training).group) != cluster.gpus_per_node:
        return (f"--fault-tolerance runs a group per node here: give groups of a node's {cluster.gpus_per_node} GPUs, "
                f"not {group}")
    return None
