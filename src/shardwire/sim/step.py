"""The discrete-event model of one training step, unit by unit, on one representative GPU.

Every GPU runs the same program on the same sizes, so one GPU's timeline is the step's. It has a
compute lane and three communication lanes: all-gathers, reductions (a CUDA stream each under NCCL;
a lane thread each under gloo, see ``shardwire.comm.communicator``) and the scalar all-reduce of the
gradient norm. Collectives of one lane run one after another; the lanes run concurrently and share
the links (``shardwire.sim.events.Link``): an all-gather and a reduce-scatter crossing a NIC at the
same time each get half of it. While a collective runs it takes its level's ``compute_share`` of
the GPU, and the compute lane (a ``shardwire.sim.events.Processor``) runs that much slower: a unit's
compute overlapped with communication for part of its length stretches by that part. While compute
runs it takes each level's ``bandwidth_share`` from the links, and collectives move bytes that much
slower (on CPUs, where the cores that compute are the ones that move the bytes).

The compute lane follows the engine (``shardwire.engine.runtime`` and ``schedule``):

forward    gather the root unit; open the forward pass, which issues the first ``prefetch`` gathers;
           per unit: enter the pass (sliding window: issue the gather ``prefetch`` units ahead),
           wait for the unit's gather, copy it out into parameter order, compute, release it
           (``reshard_after_forward``), except the last ``max(1, prefetch)``, which the backward
           pass gathers as it opens. Then the root's head, and the backward pass opens, issuing its
           first gathers.
backward   the head's backward; per unit in reverse: enter the pass, wait for the gather (none when
           the unit was never released) and copy it out, recompute (activation checkpointing) and
           backward, copy the gradient in rank by rank, start its reduce-scatter and, with more
           than ``REDUCTIONS_IN_FLIGHT`` pending, wait for the oldest (its reduce-scatter: hybrid's
           all-reduce between groups stays in flight); release the unit. Then the root's
           reduce-scatter, and wait for every reduction.
step end   with gradient accumulation, micro-batches before the last skip reductions (``no_sync``),
           unless every micro-batch reduces (``reduce_each_micro_batch``); then the gradient norm's
           scalar all-reduce (clipping) and the optimizer step.

``zero1`` (ZeRO stage 1, which the engine does not run) follows the same schedule with nothing to
gather: each GPU holds the whole model, and gradients are all-reduced over every GPU in one flat
collective a unit at a time, or a bucket at a time once it holds ``reduce_bucket_elements`` (the
last with the rest); after the optimizer step its group all-gathers the updated parameters, which
the next step waits for.

A ``block`` limiter replaces the sliding window: it issues gathers in groups of ``prefetch`` and
issues the next group only when the whole previous one has been consumed, so the first unit of
every group waits for a gather that was issued when the previous unit finished. Hybrid sharding
gathers within the shard group and reduces each unit with a reduce-scatter within it followed by an
all-reduce of the shard between groups, on the same lane; ``hybrid_secondary`` gathers over the
world for forward and within the group for backward. A quantized ``wire`` changes what these
collectives move and adds its kernels to them where their group spans nodes
(``shardwire.sim.costs``); the schedule stays the same.

With ``diloco`` (hybrid groups that train apart, ``shardwire.engine.diloco``) no gradient is
all-reduced between the groups; the step is the average one of the sync's cycle, which carries
``1/H`` of the model's sync: an all-reduce of ``P / (G H)`` elements of each GPU's change with its
peers in the other groups, fp32 or packed by the sync's wire, on a lane of its own. Overlapped
(``fragment_sync_delay`` above 0), it is issued as the step starts and waited for as it ends, so it
costs only what the link cannot carry beside the step; with ``fragment_sync_delay=0`` (the default)
the step waits for it at once. (A fragment's sync is whole and spread over the steps it overlaps,
not cut in H pieces: the average is the same, its collectives' latencies are counted H times.)

How long each unit computes is the compute model's (``shardwire.sim.compute``). Left out: host
overheads, stragglers and jitter; the step is the idealized schedule of the engine on ideal links.
"""

from __future__ import annotations

import collections
import dataclasses
import math

from shardwire.engine.layout_plan import LayoutPlan
from shardwire.engine.limits import REDUCTIONS_IN_FLIGHT
from shardwire.sim import costs
from shardwire.sim.architecture import ROOT, Architecture, UnitCost
from shardwire.sim.compute import backward_s, copy_in_s, copy_out_s, forward_s, optimizer_s
from shardwire.sim.costs import Group, Phase
from shardwire.sim.events import Event, Link, Process, Processor, Simulation
from shardwire.sim.specs import ClusterSpec, SpecError, TrainingSpec


@dataclasses.dataclass
class SimulatedCollective:
    """A collective on the simulated timeline: issued when the schedule asks for it, started when its
    lane is free, done when its last phase ends."""

    op: str  # all_gather | reduce_scatter | all_reduce
    unit: str
    nbytes: float
    issued: float
    started: float = 0.0
    done: float = 0.0

    @property
    def busy_s(self) -> float:
        return self.done - self.started


@dataclasses.dataclass(frozen=True)
class Stall:
    """Time the compute lane waited on communication: why, and for which unit."""

    reason: str
    unit: str
    seconds: float


@dataclasses.dataclass
class Timeline:
    step_time_s: float
    compute: dict[str, float]  # forward, backward (with recomputation), optimizer, at the full rate
    compute_slowed_s: float  # how much longer compute took for the collectives running beside it
    comms: list[SimulatedCollective]
    stalls: list[Stall]
    link_busy_s: dict[str, float]
    link_bytes: dict[str, float]  # through one GPU's intra-node links, one node's NICs

    @property
    def compute_time_s(self) -> float:
        return sum(self.compute.values())


# The unit passes a step schedules (units x micro-batches x gathers of a unit), a few events each: a
# published run takes a few thousand; beyond this many, one prediction takes more than seconds.
MAX_UNIT_PASSES = 2**16


def unit_passes(arch: Architecture, training: TrainingSpec) -> int:
    return (len(arch.units) + 1) * training.grad_accum * training.gathers_per_unit


def simulate_step(arch: Architecture, cluster: ClusterSpec, training: TrainingSpec) -> Timeline:
    if (passes := unit_passes(arch, training)) > MAX_UNIT_PASSES:
        raise SpecError(f"{len(arch.units) + 1:,} units x grad_accum {training.grad_accum} x gathers_per_unit "
                        f"{training.gathers_per_unit} is {passes:,} unit passes a step, more than the simulator "
                        f"schedules ({MAX_UNIT_PASSES:,}): give fewer micro-batches of more sequences, or fewer "
                        f"gathers per unit")
    return _Step(arch, cluster, training).run()


def gathered_bytes(unit: UnitCost, training: TrainingSpec) -> int:
    """Bytes of ``unit`` gathered: its blocks' weights in fp8 when fp8 training gathers them so (the
    root, whose head is not an fp8 layer, in the compute dtype)."""
    return unit.params * (training.compute_bytes if unit.name == ROOT else training.gather_bytes)


def layout_plan(cluster: ClusterSpec, training: TrainingSpec) -> LayoutPlan:
    """The engine's plan of the layout simulated (``shardwire.engine.layout_plan``), ``grad_op`` being
    ``full`` kept gathered from forward to backward, and ``zero1`` ``hybrid``'s groups (on one GPU,
    ``full``'s), over which only its masters and optimizer state are split (its collectives are ``zero1``'s own: see
    ``shard_group`` and ``reductions``). A group must also divide a node or be a whole number of
    nodes: the engine runs any divisor, but only these place its collectives on the network's two
    levels."""
    name = {"grad_op": "full", "zero1": "hybrid" if cluster.world > 1 else "full"}.get(training.layout,
                                                                                      training.layout)
    if cluster.world == 1 and name != "full":  # said of the cluster simulated, not of a process group
        raise SpecError(f"layout {training.layout!r} shards within groups and replicates across them, which needs "
                        f"more than one GPU, and the cluster has one: use layout 'full', or give the cluster more "
                        f"nodes or gpus_per_node")
    g, size = cluster.gpus_per_node, training.shard_group_size
    if name != "full" and size is not None and (cluster.world % size or (g % size and size % g)):
        fitting = [d for d in range(1, cluster.world + 1) if cluster.world % d == 0 and (g % d == 0 or d % g == 0)]
        raise SpecError(f"shard_group_size {size} must divide the cluster's {cluster.world} GPUs and either divide a "
                        f"node's {g} or be a multiple of them, so that its collectives fall on the network's two "
                        f"levels: choose one of {', '.join(map(str, fitting))}")
    try:
        return LayoutPlan.make(name, size, cluster.world, g, diloco=training.diloco_settings)
    except ValueError as err:
        raise SpecError(str(err)) from None


def shard_group(cluster: ClusterSpec, training: TrainingSpec) -> Group:
    """The GPUs a unit's parameters are gathered from: the world, or a group under hybrid sharding;
    one GPU under ``zero1``, where each holds them whole."""
    if training.layout == "zero1":
        return Group(1, 1)
    return _block(layout_plan(cluster, training).split_over, cluster)


def backward_gather_group(cluster: ClusterSpec, training: TrainingSpec) -> Group:
    """The GPUs backward gathers a unit from: the group's secondary shards under ``hybrid_secondary``."""
    if training.layout == "zero1":
        return Group(1, 1)
    return _block(layout_plan(cluster, training).backward_gather_over, cluster)


def optimizer_group(cluster: ClusterSpec, training: TrainingSpec) -> Group:
    """The GPUs the optimizer state is split over, which the gradient norm is summed over: the
    gathers' group, or ``zero1``'s groups."""
    return _block(layout_plan(cluster, training).split_over, cluster)


def _block(size: int, cluster: ClusterSpec) -> Group:
    """A group of ``size`` consecutive GPUs."""
    g = cluster.gpus_per_node
    return Group(1, size) if size <= g else Group(size // g, g)


def _column(size: int, cluster: ClusterSpec) -> Group:
    """The GPUs at one position of every group of ``size``: on each node, as many such groups run
    at once as there are positions."""
    g = cluster.gpus_per_node
    if size <= g:
        return Group(cluster.nodes, g // size, copies=size)
    return Group(cluster.world // size, 1, copies=g)


def gather_phases(unit: UnitCost, group: Group, cluster: ClusterSpec, training: TrainingSpec) -> list[Phase]:
    """The phases of gathering ``unit`` over ``group``: in the compute dtype, or packed by the wire's
    parameter codec where the group spans nodes; a block unit in ``gathers_per_unit`` collectives one
    after another, each of its share of the bytes and each paying the whole latency (the root's
    embedding and head are a module or two: one collective)."""
    pieces = 1 if unit.name == ROOT else training.gathers_per_unit
    codec = costs.crossing_nodes(training.wire_format.param_codec, group)
    if codec is None:
        return pieces * costs.all_gather_phases(gathered_bytes(unit, training) / pieces, group, cluster)
    return pieces * costs.quantized_all_gather_phases(unit.params / pieces, group, cluster, codec)


def reductions(params: int, cluster: ClusterSpec, training: TrainingSpec) -> list[tuple[str, float, Group]]:
    """The collectives that reduce a gradient of ``params`` elements, in order, as (op, elements,
    group): a reduce-scatter over the shard group and, under hybrid sharding with several groups,
    an all-reduce of each GPU's shard with its peers in the other groups (unless they sync every H
    steps instead); under ``zero1``, an all-reduce of the whole over every GPU."""
    plan = layout_plan(cluster, training)
    if training.layout == "zero1":
        return [("all_reduce", params, _block(cluster.world, cluster))]
    steps = [("reduce_scatter", params, _block(plan.split_over, cluster))]
    if plan.reduces_across_groups:
        steps.append(("all_reduce", params / plan.group, _column(plan.group, cluster)))
    return steps


def reduction_phases(params: int, cluster: ClusterSpec,
                     training: TrainingSpec) -> list[tuple[str, float, list[Phase]]]:
    """The collectives that reduce a gradient of ``params`` elements (a unit's, or under ``zero1``
    a bucket's: ``reductions``) as (op, bytes in the reduce dtype, phases): exact, or quantized by
    the wire's gradient codec where their group spans nodes."""
    r = training.reduce_bytes
    steps = []
    for op, numel, group in reductions(params, cluster, training):
        codec = costs.crossing_nodes(training.wire_format.grad_codec, group)
        if codec is None:
            exact = costs.reduce_scatter_phases if op == "reduce_scatter" else costs.all_reduce_phases
            phases = exact(numel * r, group, cluster)
        else:
            quantized = (costs.quantized_reduce_scatter_phases if op == "reduce_scatter"
                         else costs.quantized_all_reduce_phases)
            phases = quantized(numel, r, group, cluster, codec)
        steps.append((op, numel * r, phases))
    return steps


def sync_group(cluster: ClusterSpec, training: TrainingSpec) -> Group | None:
    """The GPUs a sync averages over: each GPU's peers at its position in the other groups (the
    engine's ``replicate`` communicator; one GPU where one group holds them all, Lookahead); None
    without DiLoCo."""
    if training.diloco_settings is None:
        return None
    return _column(layout_plan(cluster, training).group, cluster)


def sync_phases(params: float, cluster: ClusterSpec, training: TrainingSpec) -> tuple[float, list[Phase]] | None:
    """The sync one step carries on average, as (bytes in fp32, phases): one GPU's change of its
    shard of the model's ``params``, ``1/H`` of it, all-reduced with its peers in the other groups,
    packed by the sync's wire where they are on other nodes; None without DiLoCo."""
    group = sync_group(cluster, training)
    if group is None:
        return None
    diloco = training.diloco_settings
    numel = params / layout_plan(cluster, training).group / diloco.sync_every
    codec = costs.crossing_nodes(diloco.codec, group)
    if codec is None:
        return 4 * numel, costs.all_reduce_phases(4 * numel, group, cluster)
    return 4 * numel, costs.quantized_all_reduce_phases(numel, 4, group, cluster, codec)


def error_feedback_elements(params: int, cluster: ClusterSpec, training: TrainingSpec) -> int:
    """The fp32 elements of error feedback one GPU keeps for a buffer of ``params``: for each of its
    reductions whose gradients the wire quantizes across nodes, a slot per other node of the group
    (the partial sums it sends), and for an all-reduce one more (its result, which it gathers
    quantized), as ``Communicator.residual_for`` allocates them; and the same for the all-reduce of
    its sync, where the sync's wire quantizes it."""
    wire = training.wire_format
    synced = sync_group(cluster, training)
    kept = 0
    if synced is not None and costs.crossing_nodes(training.diloco_settings.codec, synced) is not None:
        kept = synced.nodes * math.ceil(params / layout_plan(cluster, training).group / synced.size)  # the sync's
    if not wire.error_feedback:
        return kept
    return kept + sum((group.nodes - 1 + (op == "all_reduce")) * math.ceil(numel / group.size)
                      for op, numel, group in reductions(params, cluster, training)
                      if costs.crossing_nodes(wire.grad_codec, group) is not None)


class _Lane:
    """Collectives of one lane, one after another, each through its phases, each phase holding its
    level's share of the compute while it runs."""

    def __init__(self, sim: Simulation, links: dict[str, Link], processor: Processor, cluster: ClusterSpec,
                 records: list[SimulatedCollective]):
        self._sim = sim
        self._links = links
        self._processor = processor
        self._cluster = cluster
        self._records = records
        self._queue: collections.deque = collections.deque()
        self._wake: Event | None = None
        sim.start(self._run())

    def submit(self, op: str, unit: str, nbytes: float, phases: list[Phase], after: Event | None = None) -> Event:
        """Queue a collective; with ``after``, it starts no sooner than that event."""
        done = self._sim.event()
        record = SimulatedCollective(op, unit, nbytes, issued=self._sim.now)
        self._records.append(record)
        self._queue.append((record, phases, done, after))
        if self._wake is not None:
            wake, self._wake = self._wake, None
            wake.succeed()
        return done

    def _run(self) -> Process:
        while True:
            if not self._queue:
                self._wake = self._sim.event()
                yield self._wake
                continue
            record, phases, done, after = self._queue.popleft()
            if after is not None and not after.happened:
                yield after
            record.started = self._sim.now
            for phase in phases:
                share = costs.compute_share(self._cluster, phase)
                self._processor.hold(share)
                if phase.latency_s > 0:
                    yield self._sim.timeout(phase.latency_s)
                yield self._sim.all_of(self._links[level].transfer(b) for level, b in phase.flows)
                self._processor.release(share)
            record.done = self._sim.now
            done.succeed()


class _Window:
    """Which gathers a pass issues ahead: the engine's sliding window, or a block-and-flush limiter."""

    def __init__(self, order: list[UnitCost], depth: int, block: bool, gather):
        self._order = order
        self._depth = depth
        self._block = block
        self._gather = gather
        self._issued = self._entered = self._consumed = 0
        self._issue_upto(depth)

    def enter(self) -> None:
        """The next unit in order starts: a sliding window issues the gather ``depth`` units ahead."""
        self._entered += 1
        if not self._block:
            self._issue_upto(self._entered + self._depth)

    def consumed(self) -> None:
        """The running unit's computation ended: a block limiter issues the next group once the
        whole previous group is consumed."""
        self._consumed += 1
        if self._block and self._consumed == self._issued:
            self._issue_upto(self._issued + self._depth)

    def _issue_upto(self, count: int) -> None:
        while self._issued < min(count, len(self._order)):
            self._gather(self._order[self._issued])
            self._issued += 1


class _Step:
    def __init__(self, arch: Architecture, cluster: ClusterSpec, training: TrainingSpec):
        self.arch = arch
        self.cluster = cluster
        self.training = training
        self.sim = Simulation()
        self.links = {level: Link(self.sim, cap) for level, cap in costs.capacities_Bps(cluster).items()}
        self.comms: list[SimulatedCollective] = []
        self.stalls: list[Stall] = []
        self.compute = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self.processor = Processor(self.sim)
        # reduce-scatters, and hybrid's all-reduces between groups that follow them, have lanes of
        # their own, as in the engine (its shard and replicate communicators)
        self._gathers, self._reductions, self._replicas, self._scalars, self._syncs = (
            _Lane(self.sim, self.links, self.processor, cluster, self.comms) for _ in range(5))
        self._gathered: dict[str, Event] = {}
        self._bucketed = 0  # gradient elements waiting for their bucket's all-reduce (zero1)
        self._shard_group = shard_group(cluster, training)
        self._backward_group = backward_gather_group(cluster, training)

        every = (arch.root, *arch.units)
        self._forward_s = {u.name: forward_s(u, cluster, training) for u in every}
        self._backward_s = {u.name: backward_s(u, cluster, training) for u in every}
        # the engine's copies of a gathered unit, and of a gradient before its reduce-scatter
        self._copy_out_s = {u.name: copy_out_s(u, self._shard_group.size, cluster, training) for u in every}
        self._copy_in_s = {u.name: copy_in_s(u, self._shard_group.size, cluster, training) for u in every}
        self._optimizer_group = optimizer_group(cluster, training)
        self._optimizer_s = optimizer_s(arch.params / self._optimizer_group.size, cluster)

    def run(self) -> Timeline:
        done = self.sim.start(self._step())
        self.sim.run()
        assert done.happened, "the step's program stopped on an event that never happened"
        return Timeline(
            step_time_s=done.time,
            compute=self.compute,
            compute_slowed_s=self.processor.slowed_s,
            comms=self.comms,
            stalls=self.stalls,
            link_busy_s={level: link.busy_s for level, link in self.links.items()},
            link_bytes={level: link.moved for level, link in self.links.items()},
        )

    # ------------------------------------------------------------------------------- the program

    def _step(self) -> Process:
        synced = sync_phases(self.arch.params, self.cluster, self.training)
        if synced is not None:  # issued as the forward starts (the engine's root pre-forward)
            sync = self._syncs.submit("all_reduce", "sync", *synced)
            if self.training.diloco_settings.fragment_sync_delay == 0:
                yield from self._wait(sync, "sync between groups (not overlapped)", "")
        last = self.training.grad_accum - 1
        for micro in range(self.training.grad_accum):
            yield from self._micro_batch(sync=micro == last or self.training.reduce_each_micro_batch)
        norm = self._scalars.submit("all_reduce", "gradient norm", 4.0,  # over the ranks that split buffers
                                    costs.scalar_all_reduce_phases(self._optimizer_group, self.cluster))
        yield from self._wait(norm, "gradient-norm all-reduce", "")
        if synced is not None:
            yield from self._wait(sync, "sync backlog", "")  # the link carries less than 1/H of the model a step
        yield from self._compute("optimizer", self._optimizer_s)
        if self.training.layout == "zero1":  # each GPU's updated part, to every GPU of its group
            nbytes = self.arch.params * self.training.compute_bytes
            updated = self._gathers.submit("all_gather", "updated parameters", nbytes,
                                           costs.all_gather_phases(nbytes, self._optimizer_group, self.cluster))
            yield from self._wait(updated, "updated parameters' all-gather", "")

    def _micro_batch(self, *, sync: bool) -> Process:
        root, units = self.arch.root, list(self.arch.units)
        depth, block = self.training.prefetch, self.training.limiter == "block"
        reshard = self.training.reshards
        released = len(units) - max(1, depth)  # the backward pass gathers the others as it opens

        ready = self._gather(root)
        forward = _Window(units, depth, block, self._gather)
        yield from self._wait(ready, "root all-gather", root.name)
        yield from self._compute("forward", self._copy_out_s[root.name])
        in_forward: dict[str, Event] = {}  # each unit's gather in forward: one kept for backward is not copied again
        for i, unit in enumerate(units):
            forward.enter()
            in_forward[unit.name] = self._gather(unit)
            yield from self._wait(in_forward[unit.name], "forward all-gathers", unit.name)
            yield from self._compute("forward", self._copy_out_s[unit.name] + self._forward_s[unit.name])
            if reshard and i < released:
                self._release(unit)
            forward.consumed()
        yield from self._compute("forward", self._forward_s[root.name])

        backward = _Window(units[::-1], depth, block, self._gather_for_backward)
        yield from self._compute("backward", self._backward_s[root.name])
        pending: collections.deque[list[Event]] = collections.deque()  # each reduction's collectives
        landing: list[list[Event]] = []
        for unit in reversed(units):
            backward.enter()
            gathered = self._gather_for_backward(unit)
            yield from self._wait(gathered, "backward all-gathers", unit.name)
            copies = ((self._copy_out_s[unit.name] if gathered is not in_forward[unit.name] else 0.0)
                      + (self._copy_in_s[unit.name] if sync else 0.0))
            yield from self._compute("backward", self._backward_s[unit.name] + copies)
            if sync and (reduction := self._reduce(unit)) is not None:
                pending.append(reduction)
                while len(pending) > REDUCTIONS_IN_FLIGHT:
                    oldest = pending.popleft()
                    yield from self._wait(oldest[0], "reduction backlog", unit.name)
                    landing.append(oldest)
            self._release(unit)
            backward.consumed()
        if sync:
            yield from self._compute("backward", self._copy_in_s[root.name])
            pending.append(self._reduce(root, last=True))
        for reduction in (*landing, *pending):
            yield from self._wait(reduction[-1], "final reductions", root.name)
        self._release(root)

    # -------------------------------------------------------------------------------- its pieces

    def _gather(self, unit: UnitCost, group: Group | None = None) -> Event:
        """Start gathering ``unit`` (over ``group``; default: the shard group) unless it is gathered
        or being gathered (``Unit.gather``)."""
        if unit.name not in self._gathered:
            nbytes = gathered_bytes(unit, self.training)
            phases = gather_phases(unit, group or self._shard_group, self.cluster, self.training)
            self._gathered[unit.name] = self._gathers.submit("all_gather", unit.name, nbytes, phases)
        return self._gathered[unit.name]

    def _gather_for_backward(self, unit: UnitCost) -> Event:
        return self._gather(unit, self._backward_group)

    def _release(self, unit: UnitCost) -> None:
        self._gathered.pop(unit.name, None)

    def _reduce(self, unit: UnitCost, *, last: bool = False) -> list[Event] | None:
        """Start reducing ``unit``'s gradient: an event for each of its collectives, in order. The
        backlog bound waits for the first (the reduce-scatter that holds the unit's gradient), the
        end of backward for the last. Under ``zero1`` with ``reduce_bucket_elements``, gradients
        wait in a bucket until it holds that many elements, or the step's ``last`` is in: None until
        then, and one all-reduce of the bucket after."""
        self._bucketed += unit.params
        bucket = self.training.reduce_bucket_elements
        if bucket is not None and self._bucketed < bucket and not last:
            return None
        params, self._bucketed = self._bucketed, 0
        events: list[Event] = []
        for op, nbytes, phases in reduction_phases(params, self.cluster, self.training):
            lane = self._replicas if op == "all_reduce" else self._reductions
            events.append(lane.submit(op, unit.name, nbytes, phases, after=events[-1] if events else None))
        return events

    def _compute(self, kind: str, seconds: float) -> Process:
        """``seconds`` of compute, at the rate collectives in flight leave it, taking each level's
        ``bandwidth_share`` from the collectives meanwhile."""
        if seconds > 0:
            self.compute[kind] += seconds
            for level, link in self.links.items():
                link.slow(costs.level_spec(self.cluster, level).bandwidth_share)
            yield self.processor.run(seconds)
            for link in self.links.values():
                link.slow(0.0)

    def _wait(self, event: Event, reason: str, unit: str) -> Process:
        if not event.happened:
            since = self.sim.now
            yield event
            if self.sim.now > since:
                self.stalls.append(Stall(reason, unit, self.sim.now - since))
