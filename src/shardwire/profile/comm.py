"""Summaries of one step's collectives: how long communication was in flight, how much of it compute
waited for, and how many bytes it moved."""

from __future__ import annotations

import dataclasses

from shardwire.comm.clock import Clock
from shardwire.comm.records import CommRecord
from shardwire.profile import intervals


@dataclasses.dataclass(frozen=True)
class CommSummary:
    busy_s: float  # time with at least one collective in flight
    # the part of it the training waited through (the thread on CPU, the compute stream on CUDA): never
    # more than busy_s, as the profile's exposed comm (``shardwire.profile.analysis``)
    exposed_s: float
    nbytes: int  # bytes of the buffers collectives produced or consumed (nccl-tests' sizes)
    wire_nbytes: int  # the same buffers as they travelled: smaller where a wire quantized them
    count: int

    @classmethod
    def of(cls, records: list[CommRecord], clock: Clock) -> "CommSummary":
        """Summarise the records of a step that has been waited for (on CUDA: its events are complete)."""
        spans = [span for span in (r.span(clock) for r in records) if span is not None]
        stalls = [(clock.seconds(start), clock.seconds(end)) for r in records for start, end in r.stalls]
        return cls(
            busy_s=intervals.total(spans),
            exposed_s=intervals.covered(stalls, spans),
            nbytes=sum(r.nbytes for r in records),
            wire_nbytes=sum(r.wire_nbytes for r in records),
            count=len(records),
        )
