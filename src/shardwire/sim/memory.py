"""Peak memory per GPU of a sharded step, by what holds it, and whether it fits.

With ``P`` parameters sharded over ``s`` GPUs (the world; the shard group for hybrid sharding),
compute dtype of ``c`` bytes, reduction dtype of ``r`` bytes, ``m`` sequences per micro-batch:

    parameter shards       4 P / s          fp32 masters (the optimizer updates these)
    gradient shards        4 P / s          fp32
    optimizer state        8 P / s          Adam's two moments, fp32
    secondary shards       c P_units / G    ``hybrid_secondary`` with resharding: every unit's
                                            share of its group of ``G``, kept from its forward to
                                            its backward (``P_units``: the units' parameters)
    gathered parameters    c P_root + g k P_unit   the root stays gathered; k units are gathered at
                           once: prefetch + 1 with a sliding window, prefetch (at least 1) with a
                           block limiter, and never more than the model's units (the engine
                           gathers ahead no further than the last); without resharding after
                           forward, every unit by the end of forward; one more while a unit's
                           gather over more than one GPU is copied out into parameter order
                           (``shardwire.engine.packing``); g = c, or 1 byte when fp8 training
                           gathers its weights in fp8
    unit gradients         c P_unit         the flat gradient a unit's backward produces; plus r P
                           when micro-batches accumulate unsharded gradients (``no_sync``), not
                           when each micro-batch reduces its own, and always under ``zero1``,
                           which all-reduces the whole gradient in place
    communication buffers  (REDUCTIONS_IN_FLIGHT + 1) r P_unit   gradients being reduce-scattered
    error feedback         4 (N_g - 1) P_g / n_g   with a wire that quantizes gradients and keeps
                           error feedback on: for every unit's buffer and each of its reductions of
                           ``P_g`` elements over ``n_g`` GPUs on ``N_g > 1`` nodes, what quantizing
                           the partial sums a GPU sends across nodes lost, in fp32 (``(N-1) P / W``
                           for ``full`` over W GPUs on N nodes); an all-reduce between hybrid groups
                           keeps one more slot, for its result (``N_g P_g / n_g``)
    outer state            8 P / s + (4 + 4 + 4) P / (s F)   sync every H steps: the anchor and
                           the outer momentum of the shards, fp32, and while one of the F fragments
                           syncs, its change (fp32) and, overlapped (``fragment_sync_delay`` above
                           0), the shards its eager step gave and, between fault-tolerant groups,
                           the shards from before it, to undo it if the quorum drops the sync
                           (``shardwire.engine.outer.OuterState``: each the shards' fp32 masters,
                           held from the sync's send to its application, D steps later)
    activations            m (kept + the root's + one unit's full activations + logits), where
                           kept is every unit's boundary with activation checkpointing, every
                           unit's full activations without (under a selective policy, the
                           boundary and the part of the rest it does not recompute); the root's (the head's input, an
                           encoder-decoder's encoder output) are kept either way, as the root is
                           not recomputed (see ``shardwire.sim.architecture``)

Under ``zero1`` nothing is gathered, as every GPU holds every unit (gathered parameters: ``c P``,
kept from step to step), and ``s`` is its group, over which the masters and optimizer state are
split. ``P_unit`` is the largest unit. Before the first step the model is made on the meta device a unit
at a time (``shardwire.engine.materialize``), which holds, in fp32, the parameter shards made so far,
the root unit whole and the unit being made whole (``construction``: 4 P / s + 4 (P_root + P_unit)).
A configuration fits when the step's total and its construction are each within ``USABLE_FRACTION``
of the GPU's memory: the rest goes to the CUDA context, the communication library's own buffers and
the caching allocator's fragmentation.
"""

from __future__ import annotations

import dataclasses

from shardwire.engine.limits import REDUCTIONS_IN_FLIGHT
from shardwire.sim.architecture import Architecture
from shardwire.sim.specs import ClusterSpec, TrainingSpec
from shardwire.sim.step import error_feedback_elements, layout_plan

USABLE_FRACTION = 0.92
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU at the step's peak, by category, and the bytes a step may use."""

    parameter_shards: float
    gradient_shards: float
    optimizer_state: float
    secondary_shards: float
    gathered_parameters: float
    unit_gradients: float
    communication_buffers: float
    error_feedback: float
    outer_state: float
    activations: float
    usable: float
    construction: float  # the peak while the model is made, before the step (not part of its total)

    @property
    def parts(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("usable", "construction")}

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def peak(self) -> float:
        """The most the job holds at once: its step's total, or its construction where that is more."""
        return max(self.total, self.construction)

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable

    @property
    def shortfall(self) -> float:
        """Bytes over the usable memory (0 when it fits)."""
        return max(0.0, self.peak - self.usable)


def activation_bytes(arch: Architecture, training: TrainingSpec) -> float:
    """What a micro-batch's forward keeps for its backward, at its peak (``activations`` above):
    with checkpointing each block's input and, under a selective policy, what it does not recompute."""
    dropped = training.recomputed
    kept = sum(u.activation_bytes - dropped * (u.activation_bytes - u.boundary_bytes) for u in arch.units)
    working = max((u.activation_bytes for u in arch.units), default=0.0)
    return training.micro_batch * (kept + arch.root.activation_bytes + working + arch.logits_bytes)


def estimate_memory(arch: Architecture, cluster: ClusterSpec, training: TrainingSpec) -> MemoryEstimate:
    P = arch.params
    plan = layout_plan(cluster, training)
    shard_over = plan.split_over
    c, r = training.compute_bytes, training.reduce_bytes
    largest = max((u.params for u in arch.units), default=0)

    if training.reshards:
        gathered_units = _units_gathered_at_once(training, len(arch.units)) * largest
    else:
        gathered_units = sum(u.params for u in arch.units)
    zero1 = training.layout == "zero1"  # the whole model and its gradient on every GPU
    if shard_over > 1 and not zero1:  # the gather of the unit being copied out, beside its copy
        gathered_units += largest

    accumulated = r * P if zero1 or (training.grad_accum > 1 and not training.reduce_each_micro_batch) else 0.0
    outer = 0.0
    if (diloco := training.diloco_settings) is not None:
        delayed = diloco.fragment_sync_delay > 0
        in_flight = 4  # the change being averaged
        if delayed:  # the shards the eager step gave and, between fault-tolerant groups, those before it
            in_flight += 8 if training.fault_tolerance else 4
        outer = 8 * P / shard_over + in_flight * P / shard_over / diloco.fragments
    secondary = 0.0
    if plan.keeps_secondary and training.reshards:
        secondary = c * sum(u.params for u in arch.units) / plan.group

    activations = activation_bytes(arch, training)

    return MemoryEstimate(
        parameter_shards=4 * P / shard_over,
        gradient_shards=4 * P / shard_over,
        optimizer_state=8 * P / shard_over,
        secondary_shards=secondary,
        gathered_parameters=c * arch.root.params + training.gather_bytes * gathered_units,
        unit_gradients=c * largest + accumulated,
        communication_buffers=(REDUCTIONS_IN_FLIGHT + 1) * r * largest,
        error_feedback=4 * sum(error_feedback_elements(u.params, cluster, training) for u in (arch.root, *arch.units)),
        outer_state=outer,
        activations=activations,
        usable=USABLE_FRACTION * cluster.gpu_memory_gb * GIB,
        construction=4 * P / shard_over + 4 * (arch.root.params + largest),
    )


def _units_gathered_at_once(training: TrainingSpec, units: int) -> int:
    """The most units a resharding step holds gathered: the running one and ``prefetch`` ahead with a
    sliding window, a group of ``prefetch`` (at least 1) with a block limiter; no more than the model
    has, as the engine's window stops at the last unit (``shardwire.engine.schedule.Pass``)."""
    window = training.prefetch + 1 if training.limiter == "sliding" else max(training.prefetch, 1)
    return min(window, units)
