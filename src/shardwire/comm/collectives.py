"""Asynchronous collectives that carry a name, a deadline and a record of what crossed the wire.

Every collective the engine issues goes through this module, for three reasons:

* one call must work on every supported torch: 2.6 has ``all_gather_into_tensor`` and
  ``reduce_scatter_tensor``, later releases rename them ``*_single`` and deprecate the old names;
* a collective that never completes (a dead or diverging rank) must become an error that names the
  rank, the operation and what it carried, never a silent hang;
* the progress bar and the profiler need each collective's size and its issue and completion times,
  taken without a host sync: on CPU the transport's own thread stamps completion through the work's
  future; on CUDA the record carries events on the stream the collective ran on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective failed or did not complete in time; the message says which rank, op and tag."""


@dataclasses.dataclass
class CommRecord:
    """One issued collective.

    ``nbytes`` follows nccl-tests: the size of the whole gathered (or scattered) buffer, not of one
    rank's share. ``issued`` and ``done`` are ``time.perf_counter()`` seconds; ``done`` is stamped by
    the transport when the operation finishes (CPU), or left ``None`` where completion is only known
    through ``end_event`` (CUDA).
    """

    op: str
    tag: str
    nbytes: int
    issued: float
    done: float | None = None
    start_event: torch.cuda.Event | None = None
    end_event: torch.cuda.Event | None = None


_recorders: list[tuple[list[CommRecord], Callable[[CommRecord], None] | None]] = []


@contextlib.contextmanager
def record_collectives(
    on_issue: Callable[[CommRecord], None] | None = None,
) -> Iterator[list[CommRecord]]:
    """Collect a ``CommRecord`` for every collective issued inside the block.

    ``on_issue`` is called right after each collective is issued, while the caller's state is
    exactly as the collective left it (tests use it to sample memory at its peak).
    """
    records: list[CommRecord] = []
    entry = (records, on_issue)
    _recorders.append(entry)
    try:
        yield records
    finally:
        _recorders.remove(entry)


class Pending:
    """An issued collective. ``wait()`` blocks until it completes (CPU) or orders the current
    stream after it (CUDA, no host sync), and turns failure or a missed deadline into a
    ``CollectiveError``."""

    __slots__ = ("_work", "_record", "_op", "_tag", "_device", "_timeout", "_keepalive", "_finish")

    def __init__(self, work, record, op, tag, device, timeout, keepalive, finish=None):
        self._work = work
        self._record = record
        self._op = op
        self._tag = tag
        self._device = device
        self._timeout = timeout
        # The collective reads or writes these until it completes; hold them until wait().
        self._keepalive = keepalive
        self._finish = finish  # work left to do once the transport is done (e.g. copy out a share)

    def wait(self) -> None:
        if self._work is None:
            return
        try:
            if self._device.type == "cpu":
                self._work.wait(timeout=self._timeout)
            else:
                # A CUDA wait with a timeout would block the host; the process group's own
                # watchdog enforces the deadline there.
                self._work.wait()
        except RuntimeError as err:
            rank = dist.get_rank()
            raise CollectiveError(
                f"rank {rank}: {self._op} of {self._tag!r} failed or did not complete within "
                f"{self._timeout.total_seconds():g}s ({err}). Another rank has probably stopped, "
                f"crashed, or is running a different unit: check its log."
            ) from err
        if self._record is not None and self._record.done is None and self._device.type == "cpu":
            self._record.done = time.perf_counter()  # a transport without futures: as seen here
        if self._finish is not None:
            self._finish()
        self._work = self._keepalive = self._finish = None


def _issue(op: str, tag: str, nbytes: int, device: torch.device, run) -> tuple[object, CommRecord | None]:
    if not _recorders:
        return run(), None
    record = CommRecord(op=op, tag=tag, nbytes=nbytes, issued=time.perf_counter())
    if device.type == "cuda":
        record.start_event = torch.cuda.Event(enable_timing=True)
        record.start_event.record()
    work = run()
    if device.type == "cuda":
        record.end_event = torch.cuda.Event(enable_timing=True)
        work.wait()  # orders the current (communication) stream after the collective
        record.end_event.record()
    else:
        try:
            future = work.get_future()
        except RuntimeError:
            pass  # no future on this work: Pending.wait() stamps completion instead
        else:
            future.add_done_callback(lambda _: setattr(record, "done", time.perf_counter()))
    for records, on_issue in _recorders:
        records.append(record)
        if on_issue is not None:
            on_issue(record)
    return work, record


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    tag: str,
    timeout: datetime.timedelta,
) -> Pending:
    """Gather every rank's equal-sized ``shard`` into the flat ``output``, in rank order."""
    nbytes = output.numel() * output.element_size()
    work, record = _issue(
        "all_gather", tag, nbytes, output.device,
        lambda: _all_gather_flat(output, shard, group=group, async_op=True),
    )
    return Pending(work, record, "all_gather", tag, output.device, timeout, (output, shard))


def reduce_scatter(
    output: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    tag: str,
    timeout: datetime.timedelta,
) -> Pending:
    """Sum the flat ``full`` over ranks and leave this rank's equal share of the sum in ``output``.

    On gloo this is an all-reduce of ``full`` (which it overwrites) and a copy of the share when the
    wait completes. Gloo's own reduce-scatter is an all-reduce too, moving the same bytes, but it
    runs part of that synchronously on the calling thread and takes twice as long: for 64 MiB on 2
    ranks, 115 ms of which 51 ms block the caller, against 51 ms fully in the background.
    """
    nbytes = full.numel() * full.element_size()
    if str(dist.get_backend(group)) == "gloo":
        start = dist.get_rank(group) * output.numel()
        share = full.narrow(0, start, output.numel())
        work, record = _issue(
            "reduce_scatter", tag, nbytes, full.device,
            lambda: dist.all_reduce(full, group=group, async_op=True),
        )
        return Pending(work, record, "reduce_scatter", tag, full.device, timeout, (full,),
                       finish=lambda: output.copy_(share))
    work, record = _issue(
        "reduce_scatter", tag, nbytes, full.device,
        lambda: _reduce_scatter_flat(output, full, group=group, async_op=True),
    )
    return Pending(work, record, "reduce_scatter", tag, full.device, timeout, (output, full))


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    tag: str,
    timeout: datetime.timedelta,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> Pending:
    """Reduce ``tensor`` in place over ranks."""
    nbytes = tensor.numel() * tensor.element_size()
    work, record = _issue(
        "all_reduce", tag, nbytes, tensor.device,
        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True),
    )
    return Pending(work, record, "all_reduce", tag, tensor.device, timeout, (tensor,))
