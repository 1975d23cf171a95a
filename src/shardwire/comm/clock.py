"""Timestamps taken without synchronizing anything, turned into seconds only once they are complete.

On CPU a stamp is ``time.perf_counter()``. On CUDA it is an event recorded on a stream, so it marks
the moment the GPU reaches that point of the stream, not the moment the host queued it; reading it as
seconds needs the event to have completed (``ready``), which the caller arranges (after a step has
been waited for, or after ``torch.cuda.synchronize``) instead of the clock blocking to get it.
"""

from __future__ import annotations

import time

import torch

Stamp = "float | torch.cuda.Event"


class Clock:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.origin = self.stamp()

    def stamp(self, stream: "torch.cuda.Stream | None" = None):
        """Now, on the host (CPU) or on ``stream`` (CUDA; default: the device's current stream)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def seconds(self, stamp) -> float:
        """``stamp`` as seconds since this clock's origin; any stamp of the same device will do."""
        if self.cuda:
            return self.origin.elapsed_time(stamp) / 1e3
        return stamp - self.origin

    def ready(self, stamp) -> bool:
        """True once ``stamp`` can be read without waiting."""
        return stamp.query() if self.cuda else True
