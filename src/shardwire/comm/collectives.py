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
  point-to-point messages in two steps, across nodes and within them (``topology``), so that each
  node sends every other node exactly what it lacks, once: (N-1)/N of the buffer leaves a node,
  the least any algorithm can send. A ring sends about all of it per node; gloo's
  all-reduce-based reduce-scatter twice that;
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

import atexit
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

from shardwire.comm.topology import topology

# torch's own flat all-gather and reduce-scatter, under whichever name this torch release has
torch_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
torch_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Each point-to-point message is tagged with its collective's number and the slot of the buffer it
# carries, so messages of concurrent collectives between the same two ranks never match each other.
# Every rank issues collectives in the same order, so the numbers agree; the offset keeps clear of
# tags other code uses.
_P2P_TAG_BASE = 1 << 20
_p2p_collectives = itertools.count()

# How long the process waits at exit for a lane's last collective; one stuck on a peer that stopped
# is left behind after this.
_LANE_EXIT_TIMEOUT_S = 5.0


class CollectiveError(RuntimeError):
    """A collective failed or did not complete in time; the message says which rank, op and tag."""


@dataclasses.dataclass
class CommRecord:
    """One issued collective.

    ``nbytes`` follows nccl-tests: the size of the whole gathered (or scattered) buffer, not of one
    rank's share. ``issued`` and ``done`` are ``time.perf_counter()`` seconds; ``done`` is stamped
    when the transport finishes (CPU), or left ``None`` where completion is only known through
    ``end_event`` (CUDA). ``waits`` are the intervals computation spent waiting for it: on CPU
    (start, end) times of the caller blocking in ``wait()``; on CUDA pairs of events recorded on the
    compute stream just before and after it was made to wait, whose gap is exactly the stall.
    """

    op: str
    tag: str
    nbytes: int
    issued: float
    done: float | None = None
    waits: list = dataclasses.field(default_factory=list)
    start_event: torch.cuda.Event | None = None
    end_event: torch.cuda.Event | None = None

    @property
    def waited(self) -> float:
        """Seconds the caller blocked waiting for this collective (CPU records)."""
        return sum(end - start for start, end in self.waits)


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
        # by identity: nested recorders hold equal lists of the same records
        del _recorders[next(i for i, e in enumerate(_recorders) if e is entry)]


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
        # The future first: a waiter woken by the event may go on to end the process, and the lane
        # must not be inside torch's C++ code by then.
        self._error = error
        if error is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(error)
        self._finished.set()


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

    def stop(self, timeout: float) -> None:
        """Let the queued collectives finish, then end the thread (waiting at most ``timeout`` s).

        A daemon thread still inside gloo when the interpreter shuts down aborts the process
        ("terminate called without an active exception"), so lanes are stopped at exit."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            collective, work = item
            try:
                collective()
            except BaseException as err:  # handed to whoever waits on the work
                work._complete(err)
            else:
                work._complete(None)
            # drop the references now: the buffers and the process group are not the lane's to keep
            item = collective = work = None


_gather_lane = _Lane("shardwire-gather")
_reduce_lane = _Lane("shardwire-reduce")


@atexit.register
def _stop_lanes() -> None:
    for lane in (_gather_lane, _reduce_lane):
        lane.stop(timeout=_LANE_EXIT_TIMEOUT_S)


def _next_p2p_tags(world: int) -> int:
    """The first of ``world`` tags reserved for the next point-to-point collective."""
    return _P2P_TAG_BASE + next(_p2p_collectives) * world % (1 << 30)


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
        record, cuda = self._record, self._device.type == "cuda"
        if record is not None:
            blocked_from = time.perf_counter()
            if cuda:
                stall = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                stall[0].record()
        try:
            for work in self._works:
                if cuda:
                    # A CUDA wait with a timeout would block the host; the process group's own
                    # watchdog enforces the deadline there.
                    work.wait()
                else:
                    work.wait(timeout=self._timeout)
        except RuntimeError as err:
            rank = dist.get_rank()
            raise CollectiveError(
                f"rank {rank}: {self._op} of {self._tag!r} failed or did not complete within "
                f"{self._timeout.total_seconds():g}s ({err}). Another rank has probably stopped, "
                f"crashed, or is running a different unit: check its log."
            ) from err
        if record is not None:
            if cuda:
                stall[1].record()
                record.waits.append(stall)
            else:
                now = time.perf_counter()
                record.waits.append((blocked_from, now))
                if record.done is None:
                    record.done = now  # a work without a future: completion as seen here
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

    On gloo: point-to-point, across nodes then within them (see ``_Exchange.all_gather``).
    """
    nbytes = output.numel() * output.element_size()
    if _is_gloo(group):
        exchange = _Exchange(group, timeout)
        works, record = _issue(
            "all_gather", tag, nbytes, output.device,
            lambda: [_gather_lane.submit(lambda: exchange.all_gather(output, shard))],
        )
    else:
        works, record = _issue("all_gather", tag, nbytes, output.device,
                               lambda: [torch_all_gather(output, shard, group=group, async_op=True)])
    return Pending(works, record, "all_gather", tag, output.device, timeout, (output, shard))


class _Exchange:
    """One point-to-point collective on gloo, run on a lane thread.

    Every message carries one slot of the flat buffer (the shard of one rank: ``size`` elements)
    and is tagged with that slot's owner, so each message is matched by tag alone, whatever the
    order in which the two ranks post them.
    """

    def __init__(self, group: dist.ProcessGroup, timeout: datetime.timedelta):
        self.group = group
        self.timeout = timeout
        self.topology = topology(group)
        self.me = dist.get_rank(group)
        self.node, self.local = self.topology.place(self.me)
        self.tags = _next_p2p_tags(self.topology.world)

    def send(self, tensor: torch.Tensor, peer: int, slot: int):
        return dist.isend(tensor, dist.get_global_rank(self.group, peer), self.group, self.tags + slot)

    def recv(self, tensor: torch.Tensor, peer: int, slot: int):
        return dist.irecv(tensor, dist.get_global_rank(self.group, peer), self.group, self.tags + slot)

    def wait(self, works: list) -> None:
        for work in works:
            work.wait(timeout=self.timeout)

    def other_nodes(self) -> list[int]:
        return [n for n in range(self.topology.nodes) if n != self.node]

    def local_peers(self) -> list[int]:
        return [l for l in range(self.topology.ranks_per_node) if l != self.local]

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        """1. Across nodes: send this rank's shard to the rank in the same position on every other
        node, and receive theirs. 2. Within the node: pass every local peer the shards of this
        position (one per node), and receive those of theirs."""
        size, at = shard.numel(), self.topology.rank
        slot = lambda r: output.narrow(0, r * size, size)  # noqa: E731
        slot(self.me).copy_(shard)
        across = []
        for node in self.other_nodes():
            peer = at(node, self.local)
            across += [self.send(shard, peer, self.me), self.recv(slot(peer), peer, peer)]
        within = []
        for local in self.local_peers():
            peer = at(self.node, local)
            within += [self.recv(slot(at(n, local)), peer, at(n, local)) for n in range(self.topology.nodes)]
            within.append(self.send(shard, peer, self.me))
        self.wait(across)
        for local in self.local_peers():
            peer = at(self.node, local)
            within += [self.send(slot(at(n, self.local)), peer, at(n, self.local)) for n in self.other_nodes()]
        self.wait(within)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor) -> None:
        """1. Within the node: collect from every local peer its pieces of the slots owned by ranks
        in this rank's position (one per node) and add them up: the node's partial sums. 2. Across
        nodes: send each such partial sum to the node whose rank owns it, and add up the partial
        sums of this rank's own slot received from every other node."""
        size, at, nodes = output.numel(), self.topology.rank, self.topology.nodes
        piece = lambda r: full.narrow(0, r * size, size)  # noqa: E731
        # this rank's own pieces of the slots whose owners share its position, one per node
        column = full.view(nodes, self.topology.ranks_per_node, size)[:, self.local]
        peers = self.local_peers()
        received = torch.empty(len(peers), nodes, size, dtype=full.dtype, device=full.device)
        within = []
        for i, local in enumerate(peers):
            peer = at(self.node, local)
            within += [self.recv(received[i, n], peer, at(n, self.local)) for n in range(nodes)]
            within += [self.send(piece(at(n, local)), peer, at(n, local)) for n in range(nodes)]
        self.wait(within)
        # Sums accumulate in place in the receive buffers: on CPU these passes over memory cost
        # about as much as the messages.
        partial = _accumulate([*received, column])
        others = self.other_nodes()
        incoming = torch.empty(len(others), size, dtype=full.dtype, device=full.device)
        across = []
        for i, node in enumerate(others):
            peer = at(node, self.local)
            across += [self.send(partial[node], peer, peer), self.recv(incoming[i], peer, self.me)]
        self.wait(across)
        output.copy_(_accumulate([*incoming, partial[self.node]]))


def _accumulate(terms: list[torch.Tensor]) -> torch.Tensor:
    """The sum of ``terms``, in order, added up in place into the first unless it is the only one."""
    total = terms[0]
    for term in terms[1:]:
        total += term
    return total


def reduce_scatter(
    output: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    tag: str,
    timeout: datetime.timedelta,
) -> Pending:
    """Sum the flat ``full`` over ranks and leave this rank's equal share of the sum in ``output``.

    On gloo: point-to-point, within nodes then across them (see ``_Exchange.reduce_scatter``).
    """
    nbytes = full.numel() * full.element_size()
    if _is_gloo(group):
        exchange = _Exchange(group, timeout)
        works, record = _issue(
            "reduce_scatter", tag, nbytes, full.device,
            lambda: [_reduce_lane.submit(lambda: exchange.reduce_scatter(output, full))],
        )
        return Pending(works, record, "reduce_scatter", tag, full.device, timeout, (output, full))
    works, record = _issue(
        "reduce_scatter", tag, nbytes, full.device,
        lambda: [torch_reduce_scatter(output, full, group=group, async_op=True)],
    )
    return Pending(works, record, "reduce_scatter", tag, full.device, timeout, (output, full))


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
