"""The two ways a collective fails: it did not complete, or the ranks were not running the same one."""

import re

# Where in its sources a C++ library raised what it says ("[/__w/pytorch/pytorch/third_party/gloo/gloo/
# transport/tcp/unbound_buffer.cc:78] Timed out ..."): of use to its own developers, not to the user.
_SOURCE_LOCATION = re.compile(r"\[[^\[\]\s]+\.(?:cc|cpp|h|hpp):\d+\]\s*")


def without_source_locations(message: str) -> str:
    """``message`` without the source locations a C++ library puts before what it says."""
    return _SOURCE_LOCATION.sub("", message)


# What a transport says when the process at the other end of a connection is gone (killed, crashed,
# its machine lost): gloo's TCP pairs and the store's sockets, as the system names the loss.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")


def peer_lost(err: BaseException) -> bool:
    """Whether ``err``, raised by a torch collective called outside shardwire's transport (a loss
    averaged over ranks, a divergence check), says that another rank's process is gone: one whose
    own failure the launcher names."""
    return isinstance(err, RuntimeError) and any(words in str(err) for words in _PEER_GONE)


# How gloo and the store say a wait ran past its timeout ("Timed out waiting 15000ms", "Socket Timeout").
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)


class CollectiveError(RuntimeError):
    """A collective failed or did not complete in time; the message says which rank, op and tag."""


def failed_collective(err: BaseException) -> bool:
    """Whether ``err``, raised by a torch collective called outside shardwire's transport (the
    gradient norm's all-reduce, a benchmark's operations), is the collective failing: torch's
    distributed errors, a peer gone, a link cut past the timeout (``_TIMED_OUT``). Not memory
    run out, a device's fault or a bug, which say themselves. (torch is imported here, not with the
    module: the command line reads this module before it knows whether its command needs torch.)"""
    import torch.distributed as dist

    if isinstance(err, CollectiveError) or not isinstance(err, RuntimeError):
        return False
    return isinstance(err, dist.DistError) or peer_lost(err) or _TIMED_OUT.search(str(err)) is not None


def collective_failed(err: BaseException, what: str) -> CollectiveError:
    """The one line that says ``what`` (a collective outside shardwire's transport) failed with
    ``err``: on which rank, torch's words without their source locations, and where to look."""
    import torch.distributed as dist  # as ``failed_collective`` imports torch

    said = " ".join(without_source_locations(str(err)).split())
    shown = said if len(said) <= 300 else f"{said[:300]}..."
    return CollectiveError(f"rank {dist.get_rank()}: {what} failed ({shown}). Another rank has probably stopped or "
                           f"crashed, or its link is down: check its log.")


class ScheduleMismatchError(CollectiveError):
    """Ranks issued different collectives at the same point (rank-dependent control flow around units)."""


# What a ScheduleMismatchError asks of the training, after naming what each rank was about to run.
SAME_SCHEDULE = ("Every rank must run the same units in the same order in each step, and its backward reach every "
                 "unit it ran (no rank-dependent control flow around units: a head one rank's loss skips, a layer one "
                 "rank drops, are weighed by zero instead).")
