"""Where a step went: one rank's breakdown of a step, and the same figures across ranks.

Definitions (all by interval arithmetic over one step's spans):

* compute: the training thread's time in the step that is not spent waiting for a collective
  (on CUDA: the compute stream's time outside its stalls on communication);
* forward / backward / clip / optimizer: the compute inside each phase; ``other`` is the rest of
  the compute (the loss, zero_grad, the user's own code inside the step);
* copy: the part of forward and backward spent copying each unit's gathered parameters out into
  the order its modules read them in, and each gradient back in rank by rank for its reduction
  (``shardwire.engine.packing``; none at world 1 or for a unit of one parameter);
* wait: the time compute spent waiting for collectives;
* comm: the time at least one collective was in flight (per operation: all_gather, reduce_scatter,
  all_reduce);
* exposed comm: the part of comm during which compute was not running;
* overlap ratio: the share of comm hidden behind compute, ``1 - exposed / comm``.

forward + backward + clip + optimizer + other + wait is the step's time exactly (copy is a part of
forward and backward); a profile whose ``other`` is large has phases the profiler did not see.
"""

from __future__ import annotations

import dataclasses
import statistics

from shardwire.profile import intervals

PHASES = ("forward", "backward", "clip", "optimizer")
OPS = ("all_gather", "reduce_scatter", "all_reduce")
FIGURES = (
    "step_s", *(f"{p}_s" for p in PHASES), "other_s", "copy_s", "wait_s", "comm_s",
    *(f"{op}_s" for op in OPS), "exposed_comm_s", "overlap_ratio", *(f"{op}_bytes" for op in OPS),
    *(f"{op}_wire_bytes" for op in OPS),
)


@dataclasses.dataclass
class StepTimeline:
    """One step on one rank, in seconds since the profile's origin (taken after a barrier, so ranks
    share it to within the barrier's skew): what the recorder makes of a step, what a profile's
    timeline holds, and what its figures are computed from (``breakdown``)."""

    step: int
    start: float
    end: float
    phases: list[tuple[str, str | None, float, float]]  # (phase, unit or None, start, end)
    comms: list[tuple[str, str, int, int, float, float]]  # (op, tag, nbytes, wire_nbytes, start, end)
    waits: list[tuple[str, float, float]]  # (tag waited for, start, end)


def breakdown(timeline: StepTimeline) -> dict[str, float]:
    """The figures of one step on one rank."""
    window = (timeline.start, timeline.end)
    waits = intervals.merge((start, end) for _, start, end in timeline.waits)
    compute = intervals.subtract([window], waits)
    figures = {"step_s": timeline.end - timeline.start, "wait_s": intervals.total(waits)}
    named = 0.0
    for phase in PHASES:
        spans = [(start, end) for p, unit, start, end in timeline.phases if p == phase and unit is None]
        figures[f"{phase}_s"] = intervals.covered(spans, compute)
        named += figures[f"{phase}_s"]
    figures["other_s"] = max(0.0, figures["step_s"] - figures["wait_s"] - named)
    figures["copy_s"] = intervals.covered([(start, end) for p, _, start, end in timeline.phases if p == "copy"],
                                          compute)
    comm = intervals.clip([(start, end) for *_, start, end in timeline.comms], window)
    figures["comm_s"] = intervals.total(comm)
    hidden = intervals.covered(comm, compute)
    figures["exposed_comm_s"] = figures["comm_s"] - hidden
    figures["overlap_ratio"] = hidden / figures["comm_s"] if figures["comm_s"] > 0 else 1.0
    for op in OPS:
        mine = [c for c in timeline.comms if c[0] == op]
        figures[f"{op}_s"] = intervals.total(intervals.clip([(s, e) for *_, s, e in mine], window))
        figures[f"{op}_bytes"] = float(sum(c[2] for c in mine))  # nccl-tests' sizes
        figures[f"{op}_wire_bytes"] = float(sum(c[3] for c in mine))  # as sent: smaller on a quantized wire
    return figures


def across_ranks(per_rank: list[dict[str, float]]) -> dict:
    """Every rank's figures of one step, their min / median / max over the ranks, and the slowest rank."""
    stats = {
        name: {
            "min": min(r[name] for r in per_rank),
            "median": statistics.median(r[name] for r in per_rank),
            "max": max(r[name] for r in per_rank),
        }
        for name in FIGURES
    }
    slowest = max(range(len(per_rank)), key=lambda r: per_rank[r]["step_s"])
    return {"ranks": per_rank, "figures": stats, "slowest_rank": slowest}


def typical(steps: list[dict]) -> int:
    """The index of the step whose slowest rank took closest to the median over steps of that time:
    one measured step to stand for them all."""
    step_s = statistics.median(s["figures"]["step_s"]["max"] for s in steps)
    return min(range(len(steps)), key=lambda i: abs(steps[i]["figures"]["step_s"]["max"] - step_s))


def summarised(steps: list, warmup_steps: int) -> int:
    """The first of ``steps`` a profile's summary stands for: the one after the warmup (compilation,
    allocation, the first gathers), unless the run took no more steps than that."""
    return 0 if warmup_alone(steps, warmup_steps) else warmup_steps


def warmup_alone(steps: list, warmup_steps: int) -> bool:
    """Whether ``steps`` are all of the warmup, which a summary then stands for: times no later step
    takes."""
    return len(steps) <= warmup_steps


def over_steps(steps: list[dict]) -> dict:
    """The median over steps of each per-step statistic, how often each rank was the slowest, and
    the typical step's slowest rank's own figures. Those, not the largest value of each part (each
    from whichever rank had it), say where the step went: a rank's parts add up to its step."""
    summary = {
        name: {stat: statistics.median(s["figures"][name][stat] for s in steps) for stat in ("min", "median", "max")}
        for name in FIGURES
    }
    counts: dict[int, int] = {}
    for s in steps:
        counts[s["slowest_rank"]] = counts.get(s["slowest_rank"], 0) + 1
    straggler = max(counts, key=counts.get)
    lag = statistics.median(s["figures"]["step_s"]["max"] - s["figures"]["step_s"]["median"] for s in steps)
    step = steps[typical(steps)]
    return {
        "figures": summary,
        "slowest_rank": {"rank": straggler, "share_of_steps": counts[straggler] / len(steps),
                         "median_lag_s": lag},
        "typical_step": {"slowest_rank": step["slowest_rank"], "figures": step["ranks"][step["slowest_rank"]]},
    }
