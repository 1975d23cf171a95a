"""Why a step takes what it takes: each kind of unit's compute against the communication it needs.

With a window of prefetched gathers, a unit's communication hides behind computation as long as
it takes less time than the computation it overlaps. In forward that is the unit's all-gather
against its forward; in backward, its all-gather (when resharded after forward) and its reduction,
which share the links, against its recomputation and backward. Setting the two side by side per
kind of unit (the encoder's and decoder's blocks of a T5 differ) shows which side binds, and the
compute lane's waits, by reason, show where the bound costs time.
"""

from __future__ import annotations

import dataclasses

from shardwire.sim import costs
from shardwire.sim.compute import backward_s, forward_s
from shardwire.sim.architecture import UnitCost
from shardwire.sim.predict import Prediction
from shardwire.sim.specs import ClusterSpec, TrainingSpec
from shardwire.sim.step import backward_gather_group, gather_phases, reduction_phases, shard_group

# Below this share of the step, exposed communication is noise and the step is compute-bound.
HIDDEN_SHARE = 0.05
# Below this, the slowdown of compute by overlapped communication is not worth a word in the verdict.
NOTABLE_SLOWDOWN = 0.005


@dataclasses.dataclass(frozen=True)
class UnitBudget:
    """Per unit of one kind: seconds of compute, and of communication with the network to itself."""

    kind: str
    count: int
    forward_s: float
    gather_s: float
    backward_s: float  # recomputation and backward
    backward_comm_s: float  # the backward's all-gather (if any) and the reduction

    @property
    def forward_bound(self) -> bool:
        return self.gather_s > self.forward_s

    @property
    def backward_bound(self) -> bool:
        return self.backward_comm_s > self.backward_s


def unit_budgets(p: Prediction) -> list[UnitBudget]:
    cluster, training = p.cluster, p.training
    group, backward_group = shard_group(cluster, training), backward_gather_group(cluster, training)
    kinds: dict[str, list] = {}
    for unit in p.arch.units:
        kinds.setdefault(unit.name.split(".")[0], []).append(unit)
    budgets = []
    for kind, units in kinds.items():
        unit = max(units, key=lambda u: u.params)
        gather = costs.isolated_s(gather_phases(unit, group, cluster, training), cluster)
        reduce = _reduction_s(unit, cluster, training)
        regather = costs.isolated_s(gather_phases(unit, backward_group, cluster, training), cluster)
        backward_comm = reduce + (regather if training.reshards else 0.0)
        budgets.append(UnitBudget(kind, len(units), forward_s(unit, cluster, training), gather,
                                  backward_s(unit, cluster, training), backward_comm))
    return budgets


def _reduction_s(unit: UnitCost, cluster: ClusterSpec, training: TrainingSpec) -> float:
    """Seconds of reducing ``unit``'s gradient alone on the network: its collectives, or under
    ``zero1``'s buckets its share of its bucket's all-reduce (a bucket holds whole units: one
    smaller than ``unit`` holds it alone)."""
    bucket = max(training.reduce_bucket_elements or 0, unit.params)
    phases = reduction_phases(bucket, cluster, training)
    return unit.params / bucket * sum(costs.isolated_s(collective, cluster) for _, _, collective in phases)


def slowdown_text(p: Prediction) -> str:
    """What the collectives running beside compute cost it, as the report and the planner say it."""
    return f"compute slowed {100 * p.compute_slowdown:.0f}% by overlapped communication"


def verdict(p: Prediction) -> str:
    """One sentence: what binds the step, and where it costs time."""
    share = p.exposed_comm_s / p.step_time_s
    slowed = f"; {slowdown_text(p)}" if p.compute_slowdown >= NOTABLE_SLOWDOWN else ""
    if share < HIDDEN_SHARE:
        return (f"compute-bound: communication hides behind compute (exposed {100 * share:.1f}% "
                f"of the step){slowed}")
    reason, seconds = next(iter(p.exposed_by_reason.items()))
    needs = []
    for b in unit_budgets(p):
        if b.forward_bound:
            needs.append(f"{b.kind} units need {format_ms(b.gather_s)} of all-gather per "
                         f"{format_ms(b.forward_s)} of forward")
        if b.backward_bound:
            needs.append(f"{b.kind} units need {format_ms(b.backward_comm_s)} of communication per "
                         f"{format_ms(b.backward_s)} of backward")
    because = "; ".join(needs) or "no unit's communication outlasts its compute, but it is issued too late to hide"
    return (f"communication-bound: {100 * share:.0f}% of the step waits on communication, most of it "
            f"on {reason} ({seconds:.3g} s): {because}{slowed}")


def format_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"
