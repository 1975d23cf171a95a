"""Summaries of one step's collectives: how long communication was in flight, how much of it compute
waited for, and how many bytes it moved."""

from __future__ import annotations

import dataclasses

from shardwire.comm.collectives import CommRecord
from shardwire.profile import intervals


@dataclasses.dataclass(frozen=True)
class CommSummary:
    busy_s: float  # time with at least one collective in flight
    exposed_s: float  # time the compute thread was blocked waiting for one (CPU)
    nbytes: int  # bytes of the buffers collectives produced or consumed (nccl-tests' sizes)
    count: int

    @classmethod
    def of(cls, records: list[CommRecord]) -> "CommSummary":
        """Summarise completed records (on CUDA, after the step's events have completed)."""
        spans = []
        for r in records:
            if r.end_event is not None:
                spans.append((0.0, r.start_event.elapsed_time(r.end_event) / 1e3))
            elif r.done is not None:
                spans.append((r.issued, r.done))
        # CUDA collectives of one process group run one after another, so their durations add up;
        # CPU ones overlap freely and are measured as the union of their spans.
        cuda = any(r.end_event is not None for r in records)
        busy = sum(end - start for start, end in spans) if cuda else intervals.total(spans)
        return cls(
            busy_s=busy,
            exposed_s=sum(r.waited for r in records),
            nbytes=sum(r.nbytes for r in records),
            count=len(records),
        )
