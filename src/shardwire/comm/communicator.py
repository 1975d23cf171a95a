"""``Communicator``: the transport of one process group, for the engine and for ``shardwire bench``.

Everything a process group's collectives need lives on its communicator, never in module state, so
two process groups in one process can issue collectives in any interleaving:

* where the work runs. On CUDA, a gather stream and a reduce stream of high priority: a collective is
  issued synchronously on its stream, after the stream has waited for the compute stream (torch 2.8
  and later launch the NCCL kernel on that stream; earlier releases on their own NCCL stream, which
  that stream then waits for), and an event after it tells the compute stream when its result may
  be used. No host synchronization is ever needed. On gloo, a gather lane and a reduce lane
  (threads, see ``lanes``) run the point-to-point algorithms of ``exchange``, which beat gloo's own
  collectives; other collectives go through torch's asynchronous ones;
* memory lifetime across streams, as FSDP2 keeps it: a ``Pending`` holds every tensor its collective
  touches (and those its input was made from: ``holding``) until ``wait()`` has made the compute
  stream wait for the collective, so a tensor the compute stream made is freed, and its memory
  reused, only in the compute stream's order after the collective; a tensor a side stream made
  returns to that stream, whose later work is queued after the collective anyway. (``record_stream``
  would tie a block to the side stream until the GPU, not the host, got there: with the host running
  ahead, memory would not be bounded by the collectives in flight.) Every ``Pending`` must be waited
  for before its tensors are dropped;
* a tag space for the point-to-point messages, drawn by rank 0 when the communicator is made, so
  two communicators over one group do not match each other's messages;
* the deadline. On gloo, ``Pending.wait`` turns a collective that does not complete within it into a
  ``CollectiveError`` naming the rank, the operation and its tag, and says a wait that has lasted
  ``LONG_WAIT`` while it lasts: a peer gone or a link cut is otherwise ten silent minutes (the
  default deadline, as NCCL's). On NCCL the process group's own timeout applies (its watchdog aborts
  the job), so create the group with the same ``timeout``;
* agreement between ranks: on gloo every point-to-point collective first checks that all ranks are
  running the same one, so a rank that leaves the common order becomes a ``ScheduleMismatchError``
  rather than mixed-up buffers or an abort inside gloo; ``verify_order`` compares, once per step, a
  running hash of every collective issued, without a host synchronization on CUDA, which catches a
  divergence in what the collectives carry (NCCL does not check it) a step or two later; ranks
  that diverge in the number or sizes of NCCL collectives meet the process group's timeout;
* records of what crossed the wire (``record``), stamped by a ``Clock`` without synchronizing.

One rank of a large world runs in one process on torch's fake process group (backend ``fake``,
``torch.testing._internal.distributed.fake_pg``), whose collectives complete at once, in that process:
the tests and ``benchmarks/large_world.py`` run the engine so as a rank of 64. It gets no case of its
own, so that it runs what a real group runs, and needs none: it is not gloo, so it takes torch's
collectives, NCCL's path, on either device (the side streams on CUDA, ``Levels`` for quantized
reductions), while the point-to-point path, whose messages a fake group would leave unwritten, is
gloo's alone; and every check of agreement between ranks compares all-gathered values, which a fake
all-gather writes as this rank's input in every rank's slot (torch's NOTE [FakeProcessGroup
collective semantics]), so the checks see ranks that agree with this one, as a correct job's do,
and never read memory nobody wrote.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import secrets
import sys
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

from shardwire.comm.clock import Clock
from shardwire.comm.errors import CollectiveError, ScheduleMismatchError, without_source_locations
from shardwire.comm.exchange import Exchange, encode_header
from shardwire.comm.groups import placement_of
from shardwire.comm.lanes import Lane
from shardwire.comm.levels import Levels
from shardwire.comm.notice import WaitNotice
from shardwire.comm.quantize import decode, encode
from shardwire.comm.records import CommRecord
from shardwire.comm.settle import settle_gloo_at_exit
from shardwire.comm.wire import Codec

# torch's own flat all-gather and reduce-scatter, under whichever name this torch release has
torch_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
torch_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# A communicator's point-to-point tags: (space << _TAG_BITS) + offset, with its space drawn from
# [1, 2**_TAG_BITS) by rank 0, which keeps clear of the small tags other code uses and within int32.
_TAG_BITS = 15

OnIssue = Callable[[CommRecord], None]

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}

# How long the training waits for a collective on gloo before it says so (once for each wait): one
# that lasts this long is stuck, or moves far more than a step's bytes over a slow link (a
# checkpoint's gather), and either is worth a line; a deadline under it is its own notice.
LONG_WAIT = datetime.timedelta(seconds=60)


@dataclasses.dataclass
class _OrderCheck:
    """One comparison (``verify_order``, ``refuse_later``), read once ``ready`` (None: at once) has
    completed; where it differs, ``refusal`` is raised, else the schedule's mismatch in ``label``."""

    label: str
    differs: torch.Tensor
    ready: object = None
    refusal: str | None = None


class Pending:
    """An issued collective. ``wait()`` makes the training wait for it: blocks the calling thread
    until it completes (CPU), or orders the current stream after it (CUDA, no host sync); a failure
    or a missed deadline becomes a ``CollectiveError``."""

    __slots__ = ("_comm", "_record", "_op", "_tag", "_work", "_done", "_tensors")

    def __init__(self, comm: "Communicator", record: CommRecord | None, op: str, tag: str, *, work=None, done=None,
                 tensors: Sequence[torch.Tensor] = ()):
        self._comm = comm
        self._record = record
        self._op = op
        self._tag = tag
        self._work = work  # CPU: something with wait(timeout)
        self._done = done  # CUDA: an event after the collective on its stream
        self._tensors = tensors  # kept alive until the training has waited (see the module docstring)

    def order_current_stream(self) -> None:
        """Make what the current stream runs next come after this collective, without ending it: on
        CUDA the stream waits for its event and the tensors it holds stay held until ``wait`` (another
        stream may still read them); elsewhere this waits for it."""
        if self._done is not None:
            torch.cuda.current_stream(self._comm.device).wait_event(self._done)
        else:
            self.wait()

    def wait(self) -> None:
        comm, record = self._comm, self._record
        if comm is None:
            return
        stall_start = comm.clock.stamp() if record is not None else None
        if self._done is not None:
            torch.cuda.current_stream(comm.device).wait_event(self._done)
        else:
            try:
                with comm.waiting_for(self._op, self._tag):
                    self._work.wait(timeout=comm.timeout)
            except ScheduleMismatchError as err:
                raise ScheduleMismatchError(f"rank {dist.get_rank()}: {err}") from None
            except RuntimeError as err:
                raise CollectiveError(
                    f"rank {dist.get_rank()}: {self._op} of {self._tag!r} failed or did not complete "
                    f"within {comm.timeout.total_seconds():g}s ({without_source_locations(str(err))}). Another "
                    f"rank has probably stopped, crashed, or is running a different unit: check its log."
                ) from err
        if record is not None:
            stall_end = comm.clock.stamp()
            record.stalls.append((stall_start, stall_end))
            if record.end is None:
                record.end = stall_end  # a work without a future: completion as seen here
        self._comm = self._work = self._done = self._tensors = None


class Communicator:
    """The transport of one process group on one device. Every rank of the group must create its
    communicators in the same order, and issue each communicator's collectives in the same order."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        *,
        timeout: datetime.timedelta,
        torch_collectives: bool = False,
        ranks_per_node: int | None = None,
    ):
        """``torch_collectives``: run torch's collectives on gloo too, instead of the point-to-point
        ones (NCCL always runs torch's). ``ranks_per_node``: the global ranks a node holds, where
        they are not the launch's (``shardwire bench --ranks-per-node`` treats one machine's
        processes as several nodes, and its quantized wire must cross them as it would real ones)."""
        self.group = group
        self.device = device
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.placement = placement_of(group, ranks_per_node)
        self.clock = Clock(device)
        self._cuda = device.type == "cuda"
        gloo = str(dist.get_backend(group)) == "gloo"
        if gloo:
            settle_gloo_at_exit()
        self._point_to_point = gloo and not torch_collectives
        self._levels: Levels | None = None  # see prepare_quantized_reductions
        # A group of one moves nothing: its all-gathers, reduce-scatters and all-reduces are local
        # copies, with no library called (see _by_itself). Its gather's copy casts, so a caller
        # gathers its shard without casting it first, and its reduce-scatter may be in place: each
        # is one pass over the memory.
        self.alone = self.world == 1
        if self._cuda:
            # high priority: a collective's kernels start ahead of queued compute kernels
            self._gather_stream = torch.cuda.Stream(device, priority=-1)
            self._reduce_stream = torch.cuda.Stream(device, priority=-1)
        self._gather_lane = Lane("shardwire-gather")
        self._reduce_lane = Lane("shardwire-reduce")
        self._tag_space = self._draw_tag_space() if self._point_to_point and self.world > 1 else 1
        self._numbered = 0  # point-to-point collectives issued, which numbers their tags
        self._recorders: list[tuple[list[CommRecord], OnIssue | None]] = []
        self._order_hash = 0  # of the collectives issued since the last verify_order
        self._order_checks: deque[_OrderCheck] = deque()
        self._notice: WaitNotice | None = None  # made at the first wait that may be long (waiting_for)

    def waiting_for(self, op: str, tag: str) -> contextlib.AbstractContextManager:
        """A wait for ``op`` of ``tag`` on the calling thread, said once it has lasted ``LONG_WAIT``,
        where the deadline is longer."""
        if self.timeout <= LONG_WAIT:
            return contextlib.nullcontext()
        if self._notice is None:
            self._notice = WaitNotice(LONG_WAIT, self._say_waiting, repeat=False)
        return self._notice.waiting(f"rank {dist.get_rank()}: {op} of {tag!r}")

    def _say_waiting(self, waited: float, what: str) -> None:
        print(f"warning: {what} has waited {waited:.0f}s for the other ranks: one may have stopped, or lost its "
              f"link; it fails at {self.timeout.total_seconds():g}s", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------------------ collectives

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, *, tag: str, codec: Codec | None = None) -> Pending:
        """Gather every rank's equal-sized ``shard`` into the flat ``output``, in rank order. With
        ``codec``, where the group spans nodes, the shards travel quantized and every rank, this one
        included, reads the decoded values: all ranks hold the same ``output``. A group of one (only)
        takes ``shard`` in another dtype than ``output``'s, and casts it on its way."""
        nbytes = output.numel() * output.element_size()
        if self.alone:
            return self._by_itself("gather", "all_gather", tag, nbytes, (output, shard), lambda: output.copy_(shard))
        codec = self._across_nodes(codec)
        if codec is not None:
            wire_nbytes = self.wire_nbytes("all_gather", shard.numel(), shard.element_size(), codec)
            if self._point_to_point:
                exchange = self._exchange("all_gather", tag)
                body = functools.partial(self._gather_quantized, codec, output, shard, exchange.all_gather)
                return self._on_lane(self._gather_lane, "all_gather", tag, nbytes, body, wire_nbytes=wire_nbytes)
            body = functools.partial(self._gather_quantized, codec, output, shard, self._torch_gather)
            return self._compound("gather", "all_gather", tag, nbytes, (output, shard), body, wire_nbytes=wire_nbytes)
        if self._point_to_point:
            exchange = self._exchange("all_gather", tag)
            return self._on_lane(self._gather_lane, "all_gather", tag, nbytes,
                                 lambda: exchange.all_gather(output, shard))
        return self._on_stream(
            "gather", "all_gather", tag, nbytes, (output, shard),
            lambda async_op: torch_all_gather(output, shard, group=self.group, async_op=async_op),
        )

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, *, tag: str, average: bool = False,
                       holding: Sequence[torch.Tensor] = (), codec: Codec | None = None,
                       residual: torch.Tensor | None = None) -> Pending:
        """Sum (with ``average``: average) the flat ``full`` over ranks and leave this rank's equal
        share of the result in ``output``. The average is taken inside the collective (NCCL's
        ``AVG``, or a division of the one-slot result on gloo), never as an extra pass over ``full``.
        ``holding``: tensors ``full`` was made from where reductions run, kept alive with it. A group
        of one (only) takes ``output`` as ``full`` itself: its share is the whole, reduced in place.

        With ``codec``, where the group spans nodes, the partial sums that cross nodes travel
        quantized (``residual``, from ``residual_for``: error feedback) and are added up in fp32;
        within a node the sums stay exact (``shardwire.comm.levels``)."""
        nbytes = full.numel() * full.element_size()
        if self.alone:
            return self._by_itself("reduce", "reduce_scatter", tag, nbytes, (output, full, *holding),
                                   lambda: output.copy_(full))
        codec = self._across_nodes(codec)
        if codec is not None:
            wire_nbytes = self.wire_nbytes("reduce_scatter", output.numel(), full.element_size(), codec)
            reduce = self._quantized_reduce_scatter(tag, codec, average, residual)
            body = functools.partial(reduce, output, full)
            if self._point_to_point:
                return self._on_lane(self._reduce_lane, "reduce_scatter", tag, nbytes, body, wire_nbytes=wire_nbytes)
            return self._compound("reduce", "reduce_scatter", tag, nbytes, (output, full, *holding), body,
                                  wire_nbytes=wire_nbytes)
        if self._point_to_point:
            exchange = self._exchange("reduce_scatter", tag)
            return self._on_lane(self._reduce_lane, "reduce_scatter", tag, nbytes,
                                 lambda: exchange.reduce_scatter(output, full, average=average))
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        return self._on_stream(
            "reduce", "reduce_scatter", tag, nbytes, (output, full, *holding),
            lambda async_op: torch_reduce_scatter(output, full, op=op, group=self.group, async_op=async_op),
        )

    def all_reduce(self, tensor: torch.Tensor, *, tag: str, op: str = "sum", after: Pending | None = None,
                   codec: Codec | None = None, residual: torch.Tensor | None = None) -> Pending:
        """Reduce ``tensor`` in place over ranks: ``op`` is "sum", "avg" or "max". With ``after`` (a
        collective of another communicator), it starts once that one has completed, without the
        training waiting for it on CUDA and gloo (on another CPU backend the call waits for it):
        hybrid sharding all-reduces a gradient shard between groups as soon as the reduce-scatter
        within the group has produced it.

        With ``codec`` (sums and averages), where the group spans nodes: a quantized reduce-scatter
        (see ``reduce_scatter``) and a quantized all-gather of its result, so every rank ends with
        the same decoded values. ``residual`` (from ``residual_for(..., all_reduce=True)``) feeds
        back the errors of both: the partial sums' rows, then the row of the result this rank owns
        (without it, values below half a step of their block would be lost at every call)."""
        if op not in _REDUCE_OPS:
            raise ValueError(f"op must be one of {', '.join(_REDUCE_OPS)}, got {op!r}")
        nbytes = tensor.numel() * tensor.element_size()
        if self.alone:
            return self._by_itself("reduce", "all_reduce", tag, nbytes, (tensor,), lambda: None, after)
        codec = self._across_nodes(codec) if op != "max" else None
        if codec is not None:
            size = -(-tensor.numel() // self.world)
            wire_nbytes = self.wire_nbytes("all_reduce", size, tensor.element_size(), codec)
            partials, result = (None, None) if residual is None else (residual[:-1], residual[-1:])
            reduce = self._quantized_reduce_scatter(tag, codec, op == "avg", partials)
            gather = self._exchange("all_reduce", tag).all_gather if self._point_to_point else self._torch_gather
            body = functools.partial(self._all_reduce_quantized, codec, tensor, reduce, gather, result)
            if self._point_to_point:
                return self._on_lane(self._reduce_lane, "all_reduce", tag, nbytes, body, after=after,
                                     wire_nbytes=wire_nbytes)
            return self._compound("reduce", "all_reduce", tag, nbytes, (tensor,), body, after=after,
                                  wire_nbytes=wire_nbytes)
        if self._point_to_point:
            exchange = self._exchange("all_reduce", tag)
            return self._on_lane(self._reduce_lane, "all_reduce", tag, nbytes,
                                 lambda: exchange.all_reduce(tensor, op=op), after=after)
        return self._on_stream(
            "reduce", "all_reduce", tag, nbytes, (tensor,),
            lambda async_op: dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=self.group, async_op=async_op),
            after=after,
        )

    def broadcast(self, tensor: torch.Tensor, *, tag: str) -> Pending:
        """Overwrite ``tensor`` on every rank with rank 0's."""
        nbytes = tensor.numel() * tensor.element_size()
        source = dist.get_global_rank(self.group, 0)
        return self._on_stream(
            "gather", "broadcast", tag, nbytes, (tensor,),
            lambda async_op: dist.broadcast(tensor, src=source, group=self.group, async_op=async_op),
        )

    def all_gather_values(self, values: Sequence[int], *, tag: str) -> list[list[int]]:
        """Every rank's ``values`` (integers, as many on every rank), in rank order. It reads the
        result on the host: for set-up and checks outside the steady state of training."""
        mine = torch.tensor(list(values), dtype=torch.int64).to(self.device)
        everyone = torch.empty(self.world * len(values), dtype=torch.int64, device=self.device)
        self.all_gather(everyone, mine, tag=tag).wait()
        return everyone.view(self.world, len(values)).tolist()

    def prepare_quantized_reductions(self) -> None:
        """Make the process groups a quantized ``reduce_scatter`` or ``all_reduce`` needs where
        torch's collectives carry it (``Levels``: NCCL, or ``torch_collectives``). Every rank of the
        group calls it, in the same order as any other group creation."""
        if not self._point_to_point and self.placement.nodes > 1 and self._levels is None:
            self._levels = Levels.of(self.group, self.placement, self.device, self.timeout)

    def residual_for(self, numel: int, *, all_reduce: bool = False) -> torch.Tensor | None:
        """A zeroed error-feedback residual for quantized reductions of ``numel`` elements here (a
        reduce-scatter's input, or with ``all_reduce`` an all-reduce's tensor): one fp32 row of a
        slot per other node, since only partial sums that cross nodes are quantized, and for an
        all-reduce one more, for the result. None where the group is one node."""
        if self.placement.nodes == 1:
            return None
        rows = self.placement.nodes - 1 + all_reduce
        return torch.zeros(rows, -(-numel // self.world), device=self.device)

    # ------------------------------------------------------------------- quantized collectives

    def quantizes(self, codec: Codec | None) -> bool:
        """Whether collectives given ``codec`` quantize here: only where the group spans nodes
        (within a node bytes stay exact)."""
        return codec is not None and self.placement.nodes > 1

    def _across_nodes(self, codec: Codec | None) -> Codec | None:
        return codec if self.quantizes(codec) else None

    def _gather_quantized(self, codec: Codec, output: torch.Tensor, shard: torch.Tensor,
                          gather_bytes: Callable[[torch.Tensor, torch.Tensor], None],
                          residual: torch.Tensor | None = None) -> None:
        packed = encode(codec, shard.view(1, -1), residual)
        gathered = torch.empty(self.world, packed.shape[1], dtype=torch.uint8, device=shard.device)
        gather_bytes(gathered.view(-1), packed.view(-1))
        decode(codec, gathered, shard.numel(), out=output.view(self.world, -1))

    def _torch_gather(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        torch_all_gather(output, shard, group=self.group)

    def _quantized_reduce_scatter(self, tag: str, codec: Codec, average: bool, residual: torch.Tensor | None
                                  ) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """The two steps of a quantized reduce-scatter into ``output`` from ``full``, as a function
        of those two, by the transport of this communicator."""
        if self._point_to_point:
            exchange = self._exchange("reduce_scatter", tag)
            return functools.partial(exchange.reduce_scatter, average=average, codec=codec, residual=residual)
        if self._levels is None:
            raise RuntimeError("call prepare_quantized_reductions() on every rank before a quantized "
                               "reduction over torch's collectives")
        return functools.partial(self._levels.reduce_scatter, codec, average=average, residual=residual)

    def _all_reduce_quantized(self, codec: Codec, tensor: torch.Tensor,
                              reduce: Callable[[torch.Tensor, torch.Tensor], None],
                              gather_bytes: Callable[[torch.Tensor, torch.Tensor], None],
                              residual: torch.Tensor | None) -> None:
        """A quantized reduce-scatter of ``tensor`` (padded to a slot per rank), then a quantized
        all-gather of the slots (``residual``: the error feedback of this rank's), back into ``tensor``."""
        flat, numel = tensor.view(-1), tensor.numel()
        size = -(-numel // self.world)
        padded = torch.nn.functional.pad(flat, (0, size * self.world - numel))
        slot = torch.empty(size, dtype=tensor.dtype, device=tensor.device)
        reduce(slot, padded)
        self._gather_quantized(codec, padded, slot, gather_bytes, residual)
        flat.copy_(padded[:numel])

    def wire_nbytes(self, op: str, slot_numel: int, element_size: int, codec: Codec | None) -> int:
        """The size of ``op`` ("all_gather", "reduce_scatter" or "all_reduce") with slots of
        ``slot_numel`` elements, as it travels here with ``codec``: in nccl-tests' convention (the
        buffer whose (n-1)/n a rank sends, twice that for an all-reduce), so that its ratio to the
        uncompressed size is the ratio of the bytes sent. Within a node slots travel exact, across
        nodes packed; a reduction packs only the partial sums that cross nodes."""
        exact = self.world * slot_numel * element_size
        codec = self._across_nodes(codec)
        if codec is None or self.world == 1:
            return exact
        gathered = self.world * codec.packed_numel(slot_numel)
        nodes, per_node = self.placement.nodes, self.placement.ranks_per_node
        sent = (per_node - 1) * nodes * slot_numel * element_size + (nodes - 1) * codec.packed_numel(slot_numel)
        reduced = sent * self.world // (self.world - 1)
        return {"all_gather": gathered, "reduce_scatter": reduced, "all_reduce": (reduced + gathered) // 2}[op]

    # ------------------------------------------------------------------ streams and their order

    @contextlib.contextmanager
    def gather_stream(self) -> Iterator[None]:
        """Run the block where all-gathers run (CUDA: the gather stream, after everything queued so
        far on the current stream, so an all-gather sees the optimizer's last update and memory the
        compute stream freed is safe to reuse). A no-op on CPU."""
        with self._side("gather", ()):
            yield

    @contextlib.contextmanager
    def reduce_stream(self, uses: Sequence[torch.Tensor] = ()) -> Iterator[None]:
        """Run the block where reductions run, after the compute that produced ``uses``. Those are
        recorded to that stream (their memory is not reused until the GPU is past the block): for
        tensors the block reads that no ``Pending`` will hold."""
        with self._side("reduce", uses):
            yield

    def join(self) -> None:
        """Make the current stream wait for everything queued where reductions run (CUDA)."""
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._reduce_stream)

    @contextlib.contextmanager
    def _side(self, which: str, uses: Sequence[torch.Tensor], after: Pending | None = None) -> Iterator[None]:
        if not self._cuda:
            yield
            return
        stream = self._gather_stream if which == "gather" else self._reduce_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None and after._done is not None:
            stream.wait_event(after._done)
        for tensor in uses:
            tensor.record_stream(stream)
        with torch.cuda.stream(stream):
            yield

    # ------------------------------------------------------------------------ rank agreement

    def verify_order(self, label: str, *, now: bool = False) -> None:
        """Compare across ranks the collectives each issued since the last call, and raise
        ``ScheduleMismatchError`` if they differ.

        Each rank all-gathers a running hash of (op, tag) of those collectives, 8 bytes. On CPU the
        comparison is read at once. On CUDA it is copied to pinned host memory without a sync and
        read by a later call once its event has completed, so a divergence is reported a step or two
        after it happened, and the step itself never waits for the host; ``now`` waits for it and
        for every comparison before it, all read after the all-gather, so that every rank raises
        at the same point (before what writes the model's values out: a state dict, a checkpoint)."""
        if not now:
            self._raise_if_diverged()
        if self.world > 1:
            value, self._order_hash = self._order_hash, 0
            mine = torch.full((1,), value, dtype=torch.int64, device=self.device)
            everyone = torch.empty(self.world, dtype=torch.int64, device=self.device)
            self.all_gather(everyone, mine, tag="order check").wait()
            self._read_later(label, (everyone != everyone[0]).any(), now=now)
        elif now:
            self._raise_if_diverged(wait=True)

    def note(self, event: str) -> None:
        """Count ``event``, something every rank must do alike that issues no collective (weights
        loaded into the model), among what the next ``verify_order`` compares: a rank alone that did
        it holds other values than the others, which no collective would ever tell."""
        self._order_hash = zlib.crc32(f"note {event}".encode(), self._order_hash)

    def refuse_later(self, differs: torch.Tensor, refusal: str) -> None:
        """Raise ``ValueError(refusal)`` once ``differs``, a device boolean every rank computed alike
        (from a collective's result), reads true: read as ``verify_order``'s comparisons are, without
        waiting (on CUDA a step or two later), so that every rank refuses alike."""
        self._read_later("", differs, refusal)

    def _read_later(self, label: str, differs: torch.Tensor, refusal: str | None = None, *,
                    now: bool = False) -> None:
        if self._cuda:
            on_host = torch.empty((), dtype=torch.bool, pin_memory=True)
            on_host.copy_(differs, non_blocking=True)
            self._order_checks.append(_OrderCheck(label, on_host, self.clock.stamp(), refusal))
        else:
            self._order_checks.append(_OrderCheck(label, differs, refusal=refusal))
        self._raise_if_diverged(wait=now)

    def _raise_if_diverged(self, *, wait: bool = False) -> None:
        """Raise the first comparison read true among those that can be read (``wait``: all of
        them, waiting for each)."""
        while self._order_checks and (wait or self._order_checks[0].ready is None
                                      or self.clock.ready(self._order_checks[0].ready)):
            check = self._order_checks.popleft()
            if check.ready is not None:
                check.ready.synchronize()
            if bool(check.differs):
                self._order_checks.clear()
                if check.refusal is not None:
                    raise ValueError(check.refusal)
                raise ScheduleMismatchError(
                    f"rank {dist.get_rank()}: ranks issued different collectives, or loaded weights "
                    f"(load_state_dict) on some ranks and not others, in {check.label}. Every rank must run the "
                    f"same units in the same order in each step (no rank-dependent control flow around units), "
                    f"and load the same weights (each rank keeps its own rows of what it loads)."
                )

    # -------------------------------------------------------------------------------- records

    @contextlib.contextmanager
    def record(self, on_issue: OnIssue | None = None) -> Iterator[list[CommRecord]]:
        """Collect a ``CommRecord`` for every collective issued inside the block. ``on_issue`` is
        called right after each collective is issued, while the caller's state is exactly as the
        collective left it (tests use it to sample memory at its peak)."""
        records: list[CommRecord] = []
        entry = (records, on_issue)
        self._recorders.append(entry)
        try:
            yield records
        finally:
            # by identity: nested recorders hold equal lists of the same records
            del self._recorders[next(i for i, e in enumerate(self._recorders) if e is entry)]

    def close(self) -> None:
        """Let the lanes finish their queued collectives and stop them."""
        self._gather_lane.stop()
        self._reduce_lane.stop()

    # ------------------------------------------------------------------------------- issuing

    def _draw_tag_space(self) -> int:
        space = torch.tensor([secrets.randbelow((1 << _TAG_BITS) - 1) + 1 if self.rank == 0 else 0])
        dist.broadcast(space, src=dist.get_global_rank(self.group, 0), group=self.group)
        return int(space)

    def _exchange(self, op: str, tag: str) -> Exchange:
        per_collective = self.world + 1  # a tag per slot, and the header's
        offset = self._numbered % ((1 << _TAG_BITS) // per_collective) * per_collective
        self._numbered += 1
        return Exchange(self.group, self.placement, (self._tag_space << _TAG_BITS) + offset,
                        self.timeout, encode_header(op, tag))

    def _by_itself(self, which: str, op: str, tag: str, nbytes: int, tensors: Sequence[torch.Tensor],
                   body: Callable[[], object], after: Pending | None = None) -> Pending:
        """Run a group of one's collective, ``body`` (its local copy, or nothing), where that
        collective would run: on CUDA on its side stream, which keeps the streams' order; on the CPU
        at once on the calling thread, where a lane's hand-off and a point-to-point exchange with no
        peer would cost more than the copy."""
        if self._cuda:
            return self._on_side(which, op, tag, nbytes, tensors, body, after, None)
        if after is not None:
            after.wait()
        record = self._issued(op, tag, nbytes, None)
        with record_function(f"shardwire::{op}({tag})"):
            if record is not None:
                record.start = time.perf_counter()
            body()
            if record is not None:
                record.end = time.perf_counter()
        self._announce(record)
        return Pending(None, record, op, tag)

    def _issued(self, op: str, tag: str, nbytes: int, wire_nbytes: int | None) -> CommRecord | None:
        """Note a collective about to be issued; its record if anyone is recording."""
        self._order_hash = zlib.crc32(f"{op} {tag}".encode(), self._order_hash)
        if not self._recorders:
            return None
        return CommRecord(op, tag, nbytes, nbytes if wire_nbytes is None else wire_nbytes)

    def _announce(self, record: CommRecord | None) -> None:
        if record is not None:
            for records, on_issue in self._recorders:
                records.append(record)
                if on_issue is not None:
                    on_issue(record)

    def _on_lane(self, lane: Lane, op: str, tag: str, nbytes: int, body: Callable[[], None],
                 after: Pending | None = None, wire_nbytes: int | None = None) -> Pending:
        record = self._issued(op, tag, nbytes, wire_nbytes)
        prior = None if after is None else after._work  # taken now: the training may wait on it meanwhile

        def run() -> None:
            if prior is not None:
                prior.wait(timeout=self.timeout)
            if record is not None:
                record.start = time.perf_counter()
            body()
            if record is not None:
                record.end = time.perf_counter()

        with record_function(f"shardwire::{op}({tag})"):
            work = lane.submit(run)
        self._announce(record)
        return Pending(self, record, op, tag, work=work)

    def _on_stream(self, which: str, op: str, tag: str, nbytes: int, tensors: Sequence[torch.Tensor],
                   issue: Callable[[bool], object], after: Pending | None = None) -> Pending:
        """Issue a torch collective: synchronously on its side stream (CUDA), else asynchronously."""
        if self._cuda:
            return self._on_side(which, op, tag, nbytes, tensors, lambda: issue(False), after, None)
        record = self._issued(op, tag, nbytes, None)
        with record_function(f"shardwire::{op}({tag})"):
            if after is not None:
                after.wait()
            if record is not None:
                record.start = time.perf_counter()
            work = issue(True)
            if record is not None:
                work.get_future().add_done_callback(lambda _: setattr(record, "end", time.perf_counter()))
        self._announce(record)
        return Pending(self, record, op, tag, work=work)

    def _compound(self, which: str, op: str, tag: str, nbytes: int, tensors: Sequence[torch.Tensor],
                  body: Callable[[], None], after: Pending | None = None, wire_nbytes: int | None = None) -> Pending:
        """Issue a collective made of several torch collectives and kernels (a quantized one): on
        its side stream (CUDA), else on its lane, where it runs them synchronously."""
        if self._cuda:
            return self._on_side(which, op, tag, nbytes, tensors, body, after, wire_nbytes)
        lane = self._gather_lane if which == "gather" else self._reduce_lane
        return self._on_lane(lane, op, tag, nbytes, body, after=after, wire_nbytes=wire_nbytes)

    def _on_side(self, which: str, op: str, tag: str, nbytes: int, tensors: Sequence[torch.Tensor],
                 body: Callable[[], None], after: Pending | None, wire_nbytes: int | None) -> Pending:
        """Run ``body`` on the side stream ``which``, between two events that time it (CUDA)."""
        record = self._issued(op, tag, nbytes, wire_nbytes)
        with record_function(f"shardwire::{op}({tag})"), self._side(which, (), after):
            stream = torch.cuda.current_stream(self.device)
            if record is not None:
                record.start = self.clock.stamp(stream)
            body()
            if record is not None:
                done = record.end = self.clock.stamp(stream)
            else:
                done = torch.cuda.Event()
                done.record(stream)
        self._announce(record)
        return Pending(self, record, op, tag, done=done, tensors=tensors)
