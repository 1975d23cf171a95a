"""What a communicator remembers of the collectives it issued, for the progress bar and the profiler."""

from __future__ import annotations

import dataclasses

from shardwire.comm.clock import Clock


@dataclasses.dataclass
class CommRecord:
    """One issued collective.

    ``nbytes`` follows nccl-tests: the size of the whole gathered (or scattered) buffer, not of one
    rank's share. ``wire_nbytes`` is the same buffer as it travels, in the same convention:
    ``nbytes`` unless the collective was quantized (``shardwire.comm.wire``), smaller if it was
    (``Communicator.wire_nbytes``). ``start`` and ``end`` are ``Clock`` stamps of when the collective
    ran: on CUDA, events on the stream that runs it, placed right before and after it; on CPU, the
    moments the transport began and finished it (``end`` stays ``None`` until then). ``stalls`` are
    the intervals the training waited for it, as pairs of stamps: on CPU the training thread
    blocking in ``wait()``, on CUDA the compute stream held back by it, whose gap is exactly the
    stall.
    """

    op: str
    tag: str
    nbytes: int
    wire_nbytes: int
    start: object = None
    end: object = None
    stalls: list = dataclasses.field(default_factory=list)

    def span(self, clock: Clock) -> tuple[float, float] | None:
        """(start, end) in ``clock``'s seconds; None on CPU while the collective has not run to its
        end. On CUDA both stamps exist from the start and must have completed (``Clock.ready``)."""
        if self.start is None or self.end is None:
            return None
        return clock.seconds(self.start), clock.seconds(self.end)

