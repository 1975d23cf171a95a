"""The groups that sync now: a torchft ``Manager`` for this rank (``shardwire.engine.fault_tolerance``).

Every rank of a group holds one; the group's rank 0 runs torchft's manager server, which asks the
lighthouse for each quorum and tells the group's ranks. The averaging of a sync runs on torchft's
process group, remade for each new quorum, between the ranks at this rank's position in the groups
of the quorum; a failure on it is not raised but noted, and makes the quorum's commit vote fail.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from shardwire.comm.communicator import Communicator

if TYPE_CHECKING:  # its settings, from the layer above (torch-free)
    from shardwire.engine.fault_tolerance import FaultTolerance


QUORUM_TIMEOUT = datetime.timedelta(hours=2)


def _transport(host: str, timeout: datetime.timedelta):
    """torchft's HTTP transport of a recovery's state, at ``host`` rather than the host's name (which
    may not resolve on the other nodes)."""
    from torchft.checkpointing import HTTPTransport

    class Transport(HTTPTransport):
        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return Transport(timeout=timeout, num_chunks=0)


class QuorumPending:
    """An all-reduce between the groups of a quorum, as ``Communicator``'s ``Pending`` is waited for:
    ``wait()`` never raises (torchft records the failure for ``Quorum.commit``)."""

    def __init__(self, work):
        self._work = work

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None


class Quorum:
    """This rank's view of the fault-tolerant groups: ``start`` a sync, ``all_reduce`` in it, ``commit``."""

    def __init__(self, settings: FaultTolerance, group: Communicator):
        """``group``: the ranks of this group (the job), which share a store for torchft's manager."""
        try:
            import torchft
        except ImportError:
            raise ImportError("fault tolerance needs torchft: pip install 'shardwire[ft]'") from None
        for name in ("torchft", "torchft_quorums", "torchft_commits"):  # the log's sync field says what they say
            logging.getLogger(name).setLevel(logging.ERROR)
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
        self._manager = torchft.Manager(
            pg=across, load_state_dict=None, state_dict=None, min_replica_size=settings.min_groups,
            use_async_quorum=True, timeout=timeout, connect_timeout=timeout,
            # The lighthouse bounds the wait for a quorum (its heartbeat and join timeouts); a group
            # that joins waits there for the live groups' next sync, however far apart syncs are.
            quorum_timeout=QUORUM_TIMEOUT,
            rank=group.rank, world_size=group.world, store_addr=host, store_port=port, replica_id=settings.group,
            lighthouse_addr=settings.lighthouse, hostname=settings.host,
            checkpoint_transport=_transport(settings.host, timeout),
            init_sync=False,  # every group starts from the same seed; a late one is recovered at its first sync
        )
        self.participants = 0  # groups in the current quorum
        self.recovered = False  # whether this group is behind: it receives the others' state at ``commit``

    def register(self, key: str, state_dict: Callable[[], object], load_state_dict: Callable[[object], None]) -> None:
        """What a group that is behind receives from a live peer at its position, under ``key``."""
        self._manager.register_state_dict_fn(key, load_state_dict, state_dict)

    def start(self) -> None:
        """Agree with the lighthouse on the groups of this sync. A group that is behind fetches the
        registered state of a live peer at its position meanwhile, takes part in the sync's
        all-reduces with nothing of its own, and loads that state at ``commit``."""
        self._manager.start_quorum()
        self._manager.wait_quorum()
        self.participants = self._manager.num_participants()
        self.recovered = not self._manager.is_participating()

    @property
    def world(self) -> int:
        return max(self.participants, 1)

    def all_reduce(self, tensor: torch.Tensor, *, tag: str, op: str = "avg", codec=None, residual=None,
                   after=None) -> QuorumPending:
        """The average of ``tensor`` over the groups of the quorum taking part (a recovering group's
        is zeroed and not counted). In fp32: ``codec`` and ``residual`` are not carried (see the module
        ``shardwire.engine.fault_tolerance``)."""
        if op != "avg":
            raise ValueError(f"a quorum averages: op must be 'avg', got {op!r}")
        if after is not None:
            after.wait()
        return QuorumPending(self._manager.allreduce(tensor))

    def commit(self) -> bool:
        """Whether every group of the quorum completed the sync (all vote the same): if not, the sync
        is dropped everywhere. A recovering group loads the state it received first."""
        return self._manager.should_commit()

    def verify_order(self, what: str) -> None:
        """Nothing to compare: a quorum carries only its syncs, in the schedule every group shares."""

    def residual_for(self, numel: int, *, all_reduce: bool = False) -> None:
        return None  # nothing is quantized between the groups
