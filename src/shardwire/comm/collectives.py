"""Asynchronous collectives that carry a name, a deadline and a record of what crossed the wire.

Every collective the engine issues goes through this module, for four reasons:

* one call must work on every supported torch: 2.6 has ``all_gather_into_tensor`` and
  ``reduce_scatter_tensor``, later releases rename them ``*_single`` and deprecate the old names;
* each backend gets the algorithm that is fastest on it. NCCL's own ring collectives are; gloo's are
  not (measured with 64 MiB buffers on 2 and 4 local ranks):

  ==============================  ==============  ==============  ================
  gloo                            2 ranks         4 ranks         bytes on wire
  ==============================  ==============  ==============  ================
  all-gather, gloo's own          137 ms          243 ms          (n-1)/n S
  all-gather, point-to-point      85 ms           130 ms          (n-1)/n S
  reduce-scatter, gloo's own      180 ms          257 ms          2 (n-1)/n S
  reduce-scatter, all-to-all+sum  117 ms          153 ms          (n-1)/n S
  ==============================  ==============  ==============  ================

  gloo's reduce-scatter is an all-reduce underneath (twice the bytes a reduce-scatter needs, which
  matters most on a slow link) and part of it blocks the caller. So on gloo both are built from
  point-to-point messages: each rank sends every other rank exactly the piece it needs;
* a collective that never completes (a dead or diverging rank) must become an error that names the
  rank, the operation and what it carried, never a silent hang;
* the progress bar and the profiler need each collective's size and its issue and completion
  times, taken without a host sync.

Where the work happens mirrors CUDA. There, collectives are issued from a gather stream and a reduce
stream and the record carries CUDA events. On gloo, the point-to-point collectives run on a gather
lane and a reduce lane: one thread each, which issues a collective's messages, waits for them, does
its local copy or sum and stamps its completion, one collective after another. The caller only
queues work, so computation goes on meanwhile. (Only tag-matched point-to-point messages may be
issued from those threads: gloo matches ordinary collectives by the order they are issued in, which
must be the same on every rank, so those stay on the caller's thread.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Point-to-point messages of one collective share a tag, so concurrent collectives between the same
# two ranks never match each other's messages. Every rank issues collectives in the same order, so
# the counters agree; the offset keeps clear of tags other code uses.
_P2P_TAG_BASE = 1 << 20
_p2p_tags = itertools.count()


class CollectiveError(RuntimeError):
    """A collective failed or did not complete in time; the message says which rank, op and tag."""


@dataclasses.dataclass
class CommRecord:
    """One issued collective.

    ``nbytes`` follows nccl-tests: the size of the whole gathered (or scattered) buffer, not of one
    rank's share. ``issued`` and ``done`` are ``time.perf_counter()`` seconds; ``done`` is stamped
    when the transport finishes (CPU), or left ``None`` where completion is only known through
    ``end_event`` (CUDA). ``waited`` is how long the calling thread blocked in ``wait()`` for it: on
    CPU, the part of this collective that computation did not hide.
    """

    op: str
    tag: str
    nbytes: int
    issued: float
    done: float | None = None
    waited: float = 0.0
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


class _LaneWork:
    """A c10d ``Work`` lookalike for a collective that a lane carries out."""

    def __init__(self):
        self._future: torch.futures.Future = torch.futures.Future()
        self._finished = threading.Event()
        self._error: BaseException | None = None

    def get_future(self) -> torch.futures.Future:
        return self._future

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        if not self._finished.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("timed out")
        if self._error is not None:
            raise RuntimeError(str(self._error)) from self._error

    def _complete(self, error: BaseException | None) -> None:
        self._error = error
        self._finished.set()
        if error is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(error)


class _Lane:
    """A thread that carries out queued collectives one after another (see the module docstring)."""

    def __init__(self, name: str):
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, collective: Callable[[], None]) -> _LaneWork:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        work = _LaneWork()
        self._queue.put((collective, work))
        return work

    def _run(self) -> None:
        while True:
            collective, work = self._queue.get()
            try:
                collective()
            except BaseException as err:  # handed to whoever waits on the work
                work._complete(err)
            else:
                work._complete(None)


_gather_lane = _Lane("shardwire-gather")
_reduce_lane = _Lane("shardwire-reduce")


def _next_p2p_tag() -> int:
    return _P2P_TAG_BASE + next(_p2p_tags) % (1 << 30)


class Pending:
    """An issued collective. ``wait()`` blocks until it completes (CPU) or orders the current
    stream after it (CUDA, no host sync), and turns failure or a missed deadline into a
    ``CollectiveError``."""

    __slots__ = ("_works", "_record", "_op", "_tag", "_device", "_timeout", "_keepalive")

    def __init__(self, works, record, op, tag, device, timeout, keepalive):
        self._works = works
        self._record = record
        self._op = op
        self._tag = tag
        self._device = device
        self._timeout = timeout
        # The collective reads or writes these until it completes; hold them until wait().
        self._keepalive = keepalive

    def wait(self) -> None:
        if self._works is None:
            return
        blocked_from = time.perf_counter()
        try:
            for work in self._works:
                if self._device.type == "cpu":
                    work.wait(timeout=self._timeout)
                else:
                    # A CUDA wait with a timeout would block the host; the process group's own
                    # watchdog enforces the deadline there.
                    work.wait()
        except RuntimeError as err:
            rank = dist.get_rank()
            raise CollectiveError(
                f"rank {rank}: {self._op} of {self._tag!r} failed or did not complete within "
                f"{self._timeout.total_seconds():g}s ({err}). Another rank has probably stopped, "
                f"crashed, or is running a different unit: check its log."
            ) from err
        if self._record is not None and self._device.type == "cpu":
            now = time.perf_counter()
            self._record.waited += now - blocked_from
            if self._record.done is None:
                self._record.done = now  # a work without a future: completion as seen here
        self._works = self._keepalive = None


def _issue(op: str, tag: str, nbytes: int, device: torch.device, run: Callable[[], list]) -> tuple[list, CommRecord | None]:
    """Run ``run()`` (which issues the collective and returns its works), recording it if asked."""
    if not _recorders:
        return run(), None
    record = CommRecord(op=op, tag=tag, nbytes=nbytes, issued=time.perf_counter())
    if device.type == "cuda":
        record.start_event = torch.cuda.Event(enable_timing=True)
        record.start_event.record()
    works = run()
    if device.type == "cuda":
        record.end_event = torch.cuda.Event(enable_timing=True)
        for work in works:
            work.wait()  # orders the current (communication) stream after the collective
        record.end_event.record()
    else:
        _stamp_completion(works, record)
    for records, on_issue in _recorders:
        records.append(record)
        if on_issue is not None:
            on_issue(record)
    return works, record


def _stamp_completion(works: list, record: CommRecord) -> None:
    """Set ``record.done`` when the last of ``works`` completes, from the completing thread."""
    remaining = [len(works)]

    def one_done(_future) -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            record.done = time.perf_counter()

    for work in works:
        try:
            future = work.get_future()
        except RuntimeError:
            return  # a work without a future: Pending.wait() stamps completion instead
        future.add_done_callback(one_done)


def _is_gloo(group: dist.ProcessGroup) -> bool:
    return str(dist.get_backend(group)) == "gloo"


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    tag: str,
    timeout: datetime.timedelta,
) -> Pending:
    """Gather every rank's equal-sized ``shard`` into the flat ``output``, in rank order.

    On gloo every rank sends its shard straight to each other rank and receives theirs in place.
    """
    nbytes = output.numel() * output.element_size()
    if _is_gloo(group):
        message_tag = _next_p2p_tag()
        works, record = _issue(
            "all_gather", tag, nbytes, output.device,
            lambda: [_gather_lane.submit(lambda: _exchange_shards(output, shard, group, message_tag, timeout))],
        )
    else:
        works, record = _issue("all_gather", tag, nbytes, output.device,
                               lambda: [_all_gather_flat(output, shard, group=group, async_op=True)])
    return Pending(works, record, "all_gather", tag, output.device, timeout, (output, shard))


def _exchange_shards(output, shard, group, message_tag, timeout) -> None:
    """All-gather by sending this rank's shard to each other rank and receiving theirs in place."""
    me, world, size = dist.get_rank(group), dist.get_world_size(group), shard.numel()
    ops = []
    for peer in range(world):
        if peer != me:
            target = dist.get_global_rank(group, peer)
            ops.append(dist.P2POp(dist.isend, shard, target, group, message_tag))
            ops.append(dist.P2POp(dist.irecv, output.narrow(0, peer * size, size), target, group, message_tag))
    works = dist.batch_isend_irecv(ops) if ops else []
    output.narrow(0, me * size, size).copy_(shard)  # while the network moves the others
    for work in works:
        work.wait(timeout=timeout)


def reduce_scatter(
    output: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    tag: str,
    timeout: datetime.timedelta,
) -> Pending:
    """Sum the flat ``full`` over ranks and leave this rank's equal share of the sum in ``output``.

    On gloo each rank sends every other rank that rank's piece of ``full`` and adds up the pieces it
    receives.
    """
    nbytes = full.numel() * full.element_size()
    if _is_gloo(group):
        message_tag = _next_p2p_tag()
        works, record = _issue(
            "reduce_scatter", tag, nbytes, full.device,
            lambda: [_reduce_lane.submit(lambda: _exchange_pieces(output, full, group, message_tag, timeout))],
        )
        return Pending(works, record, "reduce_scatter", tag, full.device, timeout, (output, full))
    works, record = _issue(
        "reduce_scatter", tag, nbytes, full.device,
        lambda: [_reduce_scatter_flat(output, full, group=group, async_op=True)],
    )
    return Pending(works, record, "reduce_scatter", tag, full.device, timeout, (output, full))


def _exchange_pieces(output, full, group, message_tag, timeout) -> None:
    """Reduce-scatter by sending each rank its piece of ``full`` and summing the pieces received."""
    me, world, size = dist.get_rank(group), dist.get_world_size(group), output.numel()
    pieces = torch.empty(world, size, dtype=full.dtype, device=full.device)
    ops = []
    for peer in range(world):
        if peer != me:
            target = dist.get_global_rank(group, peer)
            ops.append(dist.P2POp(dist.isend, full.narrow(0, peer * size, size), target, group, message_tag))
            ops.append(dist.P2POp(dist.irecv, pieces[peer], target, group, message_tag))
    works = dist.batch_isend_irecv(ops) if ops else []
    pieces[me].copy_(full.narrow(0, me * size, size))
    for work in works:
        work.wait(timeout=timeout)
    torch.sum(pieces, dim=0, out=output)


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
    works, record = _issue(
        "all_reduce", tag, nbytes, tensor.device,
        lambda: [dist.all_reduce(tensor, op=op, group=group, async_op=True)],
    )
    return Pending(works, record, "all_reduce", tag, tensor.device, timeout, (tensor,))
