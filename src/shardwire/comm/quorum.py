"""The groups that sync now: a torchft ``Manager`` for this rank (``shardwire.engine.fault_tolerance``).

Every rank of a group holds one; the group's rank 0 runs torchft's manager server, which asks the
lighthouse for each quorum and tells the group's ranks. The averaging of a sync runs on torchft's
process group, remade for each new quorum, between the ranks at this rank's position in the groups
of the quorum; a failure on it is not raised but noted, and makes the quorum's commit vote fail.

A quantized sync (the DiLoCo ``wire``) runs as the engine's quantized all-reduce between nodes
does (``Communicator.all_reduce``), on torchft's process group: each rank sends every other its
slot of the change quantized (an all-to-all), adds up the decoded ones with its own slot exact, and
the averaged slots go round quantized once more (an all-gather), so every group decodes the same
bytes. torchft's own quantized all-reduce needs CUDA and Triton; this one runs wherever the
process group does, with the engine's codec and error feedback.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions
from torch.utils._pytree import tree_leaves

from shardwire.comm.agreement import agreement_values, fingerprint
from shardwire.comm.communicator import Communicator
from shardwire.comm.notice import WaitNotice
from shardwire.comm.quantize import decode, encode
from shardwire.comm.wire import Codec
from shardwire.options import SettingError

if TYPE_CHECKING:  # its settings, from the layer above (torch-free)
    from shardwire.engine.fault_tolerance import FaultTolerance


QUORUM_TIMEOUT = datetime.timedelta(hours=2)
# How often a group asks the lighthouse again for a quorum after the request failed. torchft's manager
# server does not answer its ranks when its request to the lighthouse fails and is not retried, so
# they would wait out QUORUM_TIMEOUT; a link cut for longer than its HTTP/2 keep-alive (60 s, then
# 20 s for the answer) fails the request. Asking again every few seconds brings the group back to
# the syncs soon after its link is.
QUORUM_RETRY = datetime.timedelta(seconds=5)
# How often a group that still waits for a quorum says so: the lighthouse may be gone, or the
# groups it waits for (its --min_replicas) gone or far behind, and the wait is bounded only by
# QUORUM_TIMEOUT.
QUORUM_NOTICE = datetime.timedelta(seconds=60)
# Votes in a row that drop a step or sync no later one replaces (each step of groups meeting at every
# step; the final sync of groups that sync every few steps) before the run stops: past a failure or
# two, the groups' all-reduce fails whichever groups meet (say, groups of different sizes), which no
# retry mends.
MAX_DROPPED = 20
# Where groups meet every few steps, the low bits of torchft's count of a group hold the syncs it
# committed, the high bits its training steps (``Quorum.start``); a count saved before holds its syncs.
_SYNC_BITS = 32


def _transport(host: str, timeout: datetime.timedelta):
    """torchft's HTTP transport of a recovery's state, at ``host`` rather than the host's name (which
    may not resolve on the other nodes)."""
    from torchft.checkpointing import HTTPTransport

    class Transport(HTTPTransport):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # the log says what a recovery received; the server's line per request says nothing more
            self._server.RequestHandlerClass.log_request = lambda handler, *args: None

        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return Transport(timeout=timeout, num_chunks=0)


class QuorumPending:
    """An all-reduce between the groups of a quorum, as ``Communicator``'s ``Pending`` is waited for
    (``wait``: torchft's work's, or a quantized average's future's): a peer's failure is not raised
    but recorded for ``Quorum.commit``."""

    def __init__(self, wait: Callable[[], object] | None):
        self._wait = wait

    def wait(self) -> None:
        if self._wait is not None:
            self._wait()
            self._wait = None


def _one_line(record: logging.LogRecord) -> bool:
    """torchft logs a peer's failure with the traceback of the collective it broke: the groups go
    on (the step or sync is dropped, and the log says so), so one line of it says enough."""
    lines = record.getMessage().splitlines()
    record.msg, record.args = lines[0][:300] if lines else "", ()
    record.exc_info = record.exc_text = record.stack_info = None
    return True


def check_received(own: list[torch.Tensor], received: list[torch.Tensor]) -> None:
    """Refuse a live peer's buffers for a recovering group where they are not shaped as this
    group's: every group must shard the same model the same way, over as many ranks."""
    if len(received) != len(own):
        raise RuntimeError(f"a recovering group holds {len(own)} buffers but a live peer sent {len(received)}: "
                           f"every group must shard the same model the same way")
    for mine, theirs in zip(own, received):
        if theirs.shape != mine.shape:
            raise RuntimeError(f"a recovering group's shard holds {mine.numel()} elements but a live peer's "
                               f"{theirs.numel()}: every group must have as many ranks")


def _unreachable(settings: FaultTolerance, waited: datetime.timedelta) -> str:
    return (f"fault tolerance: cannot reach the lighthouse at {settings.lighthouse} within "
            f"{waited.total_seconds():g} s: "
            f"start torchft_lighthouse there, or give the address this node reaches it at "
            f"(--fault-tolerance lighthouse=HOST:PORT)")


class Quorum:
    """This rank's view of the fault-tolerant groups: ``start`` a sync, ``all_reduce`` in it, ``commit``."""

    def __init__(self, settings: FaultTolerance, group: Communicator):
        """``group``: the ranks of this group (the job), which share a store for torchft's manager."""
        try:
            import torchft
            from torchft.coordination import LighthouseClient
        except ImportError:
            raise ImportError("fault tolerance needs torchft: pip install 'shardwire[ft]'") from None
        for name in ("torchft", "torchft_quorums", "torchft_commits"):  # the log's sync field says what they say
            logging.getLogger(name).setLevel(logging.ERROR)
        for name in ("torchft.manager", "torchft.process_group"):
            logging.getLogger(name).addFilter(_one_line)
        # A recovery's tensors arrive in a read-only buffer; loading copies them into this group's.
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                                module=r"torch\.distributed\._serialization")
        timeout = datetime.timedelta(seconds=settings.timeout)
        across = (torchft.ProcessGroupGloo(timeout=timeout) if group.device.type == "cpu"
                  else torchft.ProcessGroupNCCL(timeout=timeout))
        # The group's own store, served by its rank 0: a launcher's may be gone (torchrun's restarts)
        # or absent (a group of one rank). Rank 0 names it by the address the other groups reach
        # (the lighthouse passes it on to them, to meet across groups); its group's ranks reach it
        # where they reach their launcher's rank 0.
        host = settings.host if group.rank == 0 else os.environ.get("MASTER_ADDR", "localhost")
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if group.rank == 0 else None
        port = group.all_gather_values([self._store.port if self._store is not None else 0],
                                       tag="fault tolerance store")[0][0]
        self.settings = settings
        self._device = group.device
        # Rank 0's manager talks to the lighthouse, the others to rank 0's: where rank 0 cannot reach
        # it, every rank says so alike, instead of the others failing on a manager that went away.
        # Rank 0 tries within half the time the others wait for its answer (--timeout), as torchft's
        # client retries past its bound by up to half of it: rank 0's answer, not the others' timeout,
        # says what is wrong.
        reach, reached = min(timeout, group.timeout / 2), [1]
        if group.rank == 0:
            try:
                LighthouseClient(settings.lighthouse, connect_timeout=reach)
            except RuntimeError:
                reached = [0]
        if not group.all_gather_values(reached, tag="fault tolerance lighthouse")[0][0]:
            raise ConnectionError(_unreachable(settings, reach))
        self._across = across
        # Where a quantized average runs on the CPU, one at a time, while the step goes on (gloo and
        # the codec's kernels release the GIL), as torchft's own all-reduce runs behind it.
        self._behind = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwire-quorum")
        try:
            self._manager = torchft.Manager(
                pg=across, load_state_dict=None, state_dict=None, min_replica_size=settings.min_groups,
                use_async_quorum=True, timeout=timeout, connect_timeout=timeout,
                # The lighthouse bounds the wait for a quorum (its heartbeat and join timeouts); a group
                # that joins waits there for the live groups' next sync, however far apart syncs are.
                quorum_timeout=QUORUM_TIMEOUT, quorum_retries=QUORUM_TIMEOUT // QUORUM_RETRY - 1,
                rank=group.rank, world_size=group.world, store_addr=host, store_port=port, replica_id=settings.group,
                lighthouse_addr=settings.lighthouse, hostname=settings.host,
                checkpoint_transport=_transport(settings.host, timeout),
                init_sync=False,  # every group starts from the same seed; a late one is recovered at its first sync
            )
        except RuntimeError as err:  # torchft's traceback, where one line says what to check
            if settings.lighthouse not in str(err):
                raise
            raise ConnectionError(_unreachable(settings, timeout)) from None
        self.participants = 0  # groups in the current quorum whose states it averages
        # Groups in the current quorum, those behind that recover in it included, and the most in any
        # quorum of this process: a last quorum of fewer groups than an earlier one ended apart.
        self.met = self.most_met = 0
        self.recovered = False  # whether this group is behind: it receives the others' state at ``commit``
        # Since the last ``take_metrics``: what failures cost this rank, for the log.
        self._waited_s = 0.0  # waiting for quorums and commit votes
        self._received_bytes = 0  # the others' state received in recoveries
        self._dropped = 0  # votes that dropped their sync or step
        self._recovered = 0  # quorums in which this group received the others' state
        self._rounded: list[torch.Tensor] = []  # the error feedback this sync's quantization updated
        self._registered: set[str] = set()  # the keys of what a recovering group receives
        self._attending: list[Callable[[], None]] = []  # run at each quorum, before anything is averaged in it
        self._when = ""  # when the groups meet (``meets``)
        # the group's rank 0 says when a quorum is long in coming; the others would say the same
        self._notice = WaitNotice(QUORUM_NOTICE, self._say_waiting) if group.rank == 0 else None

    def register(self, key: str, state_dict: Callable[[], object], load_state_dict: Callable[[object], None]) -> None:
        """What a group that is behind receives from a live peer at its position, under ``key``."""
        def load(state: object) -> None:
            self._received_bytes += sum(leaf.nbytes for leaf in tree_leaves(state) if isinstance(leaf, torch.Tensor))
            load_state_dict(state)

        def state() -> object:
            if self._device.type == "cuda":  # torchft's thread copies it: the kernels that wrote it go first
                torch.cuda.synchronize(self._device)
            return state_dict()

        self._registered.add(key)
        self._manager.register_state_dict_fn(key, load, state)

    def meets(self, when: str) -> None:
        """Say when the groups meet (``"at every step"``): groups that meet at other times would run
        other collectives at their first meeting, so at the job's first quorum they compare this
        first."""
        self._when = when

    def attend(self, meet: Callable[[], None]) -> None:
        """Run ``meet`` at every quorum, once it is formed and before anything is averaged in it, so
        that what it exchanges (``agree``) comes in the same order in every group."""
        self._attending.append(meet)

    def start(self, steps: int | None = None) -> None:
        """Agree with the lighthouse on the groups of this sync. A group that is behind fetches the
        registered state of a live peer at its position meanwhile, takes part in the sync's
        all-reduces with nothing of its own, and loads that state at ``commit``.

        Behind means with a lower count than the others: the syncs or steps this group committed,
        or, where groups meet every few steps (DiLoCo), ``steps``, the training steps it has done,
        and then its syncs committed (``_SYNC_BITS``). Syncs alone miss a group restarted from a
        checkpoint saved between two syncs after the others dropped the sync it was lost in: it
        counts as many syncs as they do, with fewer steps, and would average its change with theirs
        and train on behind their schedule. Steps alone miss a sync one group kept and another
        dropped (each group votes for its own ranks): at equal steps, the one that dropped it."""
        start = time.perf_counter()
        self._rounded = []
        if steps is not None:  # torchft adds 1 at each commit, and a group behind takes the others' count
            syncs = self._manager.current_step() & ((1 << _SYNC_BITS) - 1)
            self._manager.load_state_dict({"step": steps << _SYNC_BITS | syncs,
                                           "batches_committed": self._manager.batches_committed()})
        waiting = self._notice.waiting(f"group {self.settings.group!r}") if self._notice else contextlib.nullcontext()
        with waiting:
            self._manager.start_quorum()
            self._manager.wait_quorum()
        self._waited_s += time.perf_counter() - start
        self.participants = self._manager.num_participants()
        self.recovered = not self._manager.is_participating()
        if not self.failed:
            self.met = self.member[1]
            self.most_met = max(self.most_met, self.met)
        if self.step == 0:  # the job's first quorum, in every group of it alike
            self._compare_when()
        for meet in self._attending:
            meet()

    def _compare_when(self) -> None:
        when = agreement_values(fingerprint(self._when))
        if self.agree(when) != when and not self.failed:
            raise SettingError(f"the other fault-tolerant groups meet at other times than this one, which meets "
                               f"{self._when}: give every group the same {{diloco}}, or none", diloco=("diloco",))

    def _say_waiting(self, waited: float, what: str) -> None:
        print(f"warning: fault tolerance: {what} has waited {waited:.0f} s for a quorum from "
              f"the lighthouse at {self.settings.lighthouse}: a group that joins waits for the others' next sync, but "
              f"the lighthouse may be down, or the groups it needs (min_groups, the lighthouse's --min_replicas) gone; "
              f"it waits up to {QUORUM_TIMEOUT.total_seconds() / 3600:g} h", file=sys.stderr, flush=True)

    @property
    def step(self) -> int:
        """The quorum's count (``start``), the same in every group of it (one behind takes it)."""
        return self._manager.current_step()

    @property
    def failed(self) -> bool:
        """Whether a failure struck this quorum: its vote will drop what was done in it."""
        return self._manager.errored() is not None

    @property
    def member(self) -> tuple[int, int]:
        """This group's place among every group of the quorum, those behind included, and their
        count: the same on each of its ranks (the process group at each position spans the groups
        in one order). Only while the quorum has not ``failed``."""
        return self._across.parent.rank(), self._across.size()

    @property
    def world(self) -> int:
        return max(self.participants, 1)

    def agree(self, values: list[int]) -> list[int]:
        """The largest of each of ``values`` (counts from 0, under 2^24) that the groups of the quorum
        taking part give, which every group then acts on: a recovering group's are not counted (it
        learns the others'); where the quorum fails, this group's own (the sync is dropped at
        ``commit`` anyway)."""
        tensor = torch.tensor([value + 1.0 for value in values], device=self._device)
        self._manager.allreduce(tensor, reduce_op=dist.ReduceOp.MAX).wait()
        agreed = [int(value) - 1 for value in tensor.tolist()]
        return agreed if min(agreed) >= 0 and not self._manager.errored() else list(values)

    def all_reduce(self, tensor: torch.Tensor, *, tag: str, op: str = "avg", codec: Codec | None = None,
                   residual: torch.Tensor | None = None, after=None) -> QuorumPending:
        """The average of ``tensor`` over the groups of the quorum taking part (a recovering group's
        is zeroed and not counted). With ``codec``, quantized both ways (see the module's
        docstring); ``residual`` (from ``residual_for``) feeds back what quantizing lost. It runs
        behind the call, as torchft's all-reduce does (in it on CUDA); ``wait`` for the result."""
        if op != "avg":
            raise ValueError(f"a quorum averages: op must be 'avg', got {op!r}")
        if after is not None:
            after.order_current_stream()
        if codec is None:
            return QuorumPending(self._manager.allreduce(tensor).wait)
        if self._manager.errored() is not None:
            return QuorumPending(None)
        if self._device.type != "cpu":  # on CUDA it runs in the call, on the step's stream
            self._average_quantized(tensor, codec, residual)
            return QuorumPending(None)
        return QuorumPending(self._behind.submit(self._average_quantized, tensor, codec, residual).result)

    def _average_quantized(self, tensor: torch.Tensor, codec: Codec, residual: torch.Tensor | None) -> None:
        """``Communicator.all_reduce``'s quantized average between nodes, over the groups of the
        quorum. ``residual``'s two rows hold, by element of ``tensor``, what quantizing the slots
        sent to others lost and what quantizing the averaged slot this rank owns lost: kept by
        element, not by slot, as each new quorum deals the slots anew."""
        if self._manager.errored() is not None:  # an average before it failed: the sync is dropped anyway
            return
        pg = self._across
        if (failed := pg.errored()) is not None:  # aborted after a timeout: the commit vote fails
            self._manager.report_error(failed)
            return
        rank, world = pg.parent.rank(), pg.size()
        flat, numel = tensor.view(-1), tensor.numel()
        if not self._manager.is_participating():  # behind: its change and its rounding are not the others'
            flat.zero_()
            if residual is not None:
                residual.zero_()
        if world == 1:
            return
        size = -(-numel // world)
        slots = F.pad(flat, (0, size * world - numel)).view(world, size)
        others = [peer for peer in range(world) if peer != rank]
        lost = None if residual is None else F.pad(residual, (0, size * world - numel)).view(2, world, size)
        sent_lost = None if lost is None else lost[0, others]
        packed = torch.zeros(world, codec.packed_numel(size), dtype=torch.uint8, device=flat.device)
        packed[others] = encode(codec, slots[others], sent_lost)
        received = torch.empty_like(packed)
        if not self._collective(lambda: pg.alltoall_base(received, packed, [], [], AllToAllOptions()).wait()):
            return
        mine = decode(codec, received[others], size).sum(dim=0).add_(slots[rank])
        mine.div_(self._manager.num_participants())
        mine_lost = None if lost is None else lost[1, rank : rank + 1]
        packed = encode(codec, mine.view(1, -1), mine_lost)
        gathered = [torch.empty_like(packed.view(-1)) for _ in range(world)]
        if not self._collective(lambda: pg.allgather([gathered], [packed.view(-1)], AllgatherOptions()).wait()):
            return
        decode(codec, torch.stack(gathered), size, out=slots)
        flat.copy_(slots.view(-1)[:numel])
        if lost is not None:
            lost[0, others] = sent_lost
            residual.copy_(lost.view(2, -1)[:, :numel])
            self._rounded.append(residual)

    def _collective(self, run: Callable[[], object]) -> bool:
        """Run one of torchft's collectives; a peer's failure in it is noted, as torchft's all-reduce
        notes it (the commit vote then fails), and False returned."""
        try:
            run()
        except (RuntimeError, OSError) as err:
            self._manager.report_error(err)
            return False
        return True

    def commit(self) -> bool:
        """Whether every group of the quorum completed the sync (all vote the same): if not, the sync
        is dropped everywhere. A recovering group loads the state it received first."""
        start = time.perf_counter()
        try:
            committed = self._manager.should_commit()
        finally:
            self._waited_s += time.perf_counter() - start
        self._recovered += self.recovered  # the others' state is loaded at the vote, kept or not
        if not committed:  # a dropped sync forgets its rounding, as a group starting afresh has none
            self._dropped += 1
            for residual in self._rounded:
                residual.zero_()
        self._rounded = []
        if self.recovered and self._registered <= {"shardwire"}:
            warnings.warn("this fault-tolerant group received the others' model but no optimizer state, and trains "
                          "on with its own: name the optimizer with shardwire.recover_with(model, optimizer=...)",
                          stacklevel=2)
        return committed

    def state(self) -> list[int]:
        """torchft's count of the syncs or steps this group committed (with, where it meets every few
        steps, the steps it had done at its last sync: ``start``) and of the batches they averaged,
        for a checkpoint: the lighthouse takes a group with fewer for one that is behind."""
        saved = self._manager.state_dict()
        return [saved["step"], saved["batches_committed"]]

    def load_state(self, state: list[int] | None) -> None:
        """Restore ``state`` (None: a checkpoint saved without fault tolerance; counted from 0)."""
        step, batches = state or (0, 0)
        self._manager.load_state_dict({"step": step, "batches_committed": batches})

    def take_metrics(self) -> dict[str, float]:
        """The groups of the last quorum (none before the first), and what failures cost this rank
        since the last call: the syncs or steps ``dropped`` and those in which it ``recovered`` the
        others' state, ``wait_s``, the seconds spent waiting for quorums and commit votes (for the
        lighthouse to leave a lost group out, for a sync that fails to time out), and
        ``recovery_bytes``, the bytes of the others' state received."""
        found = {"groups": self.participants} if self.participants else {}  # none before this process met one
        found.update(dropped=self._dropped, recovered=self._recovered, wait_s=self._waited_s,
                     recovery_bytes=self._received_bytes)
        self._waited_s, self._received_bytes, self._dropped, self._recovered = 0.0, 0, 0, 0
        return found

    def join(self) -> None:
        """Nothing to wait for here: each all-reduce is waited for where its result is read."""

    def verify_order(self, what: str) -> None:
        """Nothing to compare: a quorum carries only its syncs or steps, in the order every group shares."""

    def residual_for(self, numel: int, *, all_reduce: bool = False) -> torch.Tensor:
        """A zeroed error-feedback residual for a quantized sync of ``numel`` elements: two rows
        by element (see ``_average_quantized``), as the groups are nodes of their own."""
        return torch.zeros(2, numel, device=self._device)
