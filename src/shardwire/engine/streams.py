"""Where the engine issues its collectives: side streams on CUDA, the calling thread on CPU.

On CUDA, all-gathers and reduce-scatters are issued from their own streams so that neither waits
behind compute kernels queued before it, and they are ordered against compute with stream waits and
events only (``Pending.wait`` makes the compute stream wait), never with a host synchronisation. On
CPU the transport (gloo) already runs collectives on its own threads, so both contexts are no-ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class CommStreams:
    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._gather = torch.cuda.Stream(device)
            self._reduce = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def gathering(self) -> Iterator[None]:
        """Issue an all-gather after everything queued so far (so it sees the optimizer's updates
        to the shards, and memory freed by compute is safe to reuse)."""
        if not self._cuda:
            yield
            return
        self._gather.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._gather):
            yield

    @contextlib.contextmanager
    def reducing(self, produced_on_compute: torch.Tensor | None = None) -> Iterator[None]:
        """Issue (or land) a reduce-scatter after the compute that produced its gradient.

        ``produced_on_compute`` is marked as used by the reduce stream, so the allocator does not hand
        its memory to a compute kernel while the reduce-scatter still reads it.
        """
        if not self._cuda:
            yield
            return
        self._reduce.wait_stream(torch.cuda.current_stream())
        if produced_on_compute is not None:
            produced_on_compute.record_stream(self._reduce)
        with torch.cuda.stream(self._reduce):
            yield

    def join(self) -> None:
        """Make compute wait for every landed reduction (the optimizer reads the gradients next)."""
        if self._cuda:
            torch.cuda.current_stream().wait_stream(self._reduce)
