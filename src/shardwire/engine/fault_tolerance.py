"""Fault-tolerant groups: a lost node costs its share of the work, not the run.

Under DiLoCo (``shardwire.engine.diloco``) the groups already train apart between syncs, so a group
that is gone only needs to be left out of the next average, and a group that comes back only needs
what the others agreed on. With ``FaultTolerance`` each group is a job of its own (one torchrun per
node, its ranks sharding the model among themselves), and the groups meet at every sync through
torchft (pytorch/torchft), the ecosystem's answer to the same problem: a *lighthouse* (a small
server, ``torchft_lighthouse``, on any machine every group can reach) forms a quorum of the groups
that are alive at each sync, and each group's ranks all-reduce their shard's change with the ranks
at the same position in the other groups of that quorum (torchft's reconfigurable process group,
one per position, made anew for each new quorum). A group that died, hangs or is cut off stops
sending heartbeats and is left out of the next quorum; one that fails during a sync makes the whole
quorum discard that sync (torchft's ``should_commit`` vote), and every group keeps its own
parameters and progress, to be averaged at the next sync: no step is lost either way.

A group that starts late (its workers restarted by torchrun, a new machine given the same command)
asks for a quorum at its first training step (at its next sync where its checkpoint holds the sync
due at its step: ``OuterLoop.join``); the lighthouse waits for the live groups to reach
their next sync (up to its ``--join_timeout_ms``), and in that quorum the new group, being behind,
receives from a live peer at its position what the groups agree on: the anchor and outer momentum
of its shard, the schedule's step, and whatever was registered with ``shardwire.recover_with`` (the
optimizer's state, the learning-rate schedule). It takes part in that sync with no change of its
own and leaves it holding the same model as the others. Syncing in fragments, the groups of each
quorum first agree on the fragment it syncs (the one their schedule has come to), so that a group
that joins meets the others at whichever comes; it receives the anchor of every fragment and
trains on from those. The syncs' participants and what a recovery received are logged.

Without DiLoCo the groups meet at every step instead, and average each gradient shard as hybrid's
groups do (fault-tolerant HSDP, ``shardwire.engine.step_quorum``): a failure drops the step it
struck, for every group, and a group that comes back receives the others' parameters with the rest.

A sync may run behind the steps (``fragment_sync_delay``): its commit vote is taken where it is
applied, and a sync the vote drops undoes its eager outer step, keeping the group's progress; a
checkpoint saved while one is in flight applies it first (its vote belongs to this quorum). A
sync's change, or a step's gradient shard, travels as ``DiLoCo.wire`` (or the layout's
``wire`` for gradients) says, quantized by shardwire's codec (``shardwire.comm.quorum``), as between
the groups of one job on several nodes.

Torch-free, so that the launcher checks the settings before starting a worker.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import urllib.parse

from shardwire.mappings import shown
from shardwire.options import MAX_TIMEOUT_S, SettingError, setting_error, settings_fields

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable, read where no lighthouse is given


@dataclasses.dataclass(frozen=True)
class FaultTolerance:
    """Where the groups meet, and how long a sync waits for one (see the module's docstring).

    ``lighthouse``: the torchft lighthouse's address (``http://host:port``; default: the
    ``TORCHFT_LIGHTHOUSE`` variable). ``group``: this group's name, the same across its restarts
    (default: the ``SHARDWIRE_GROUP`` variable, else the host's name). ``min_groups``: the fewest
    groups a sync may average. ``timeout``: seconds a sync's all-reduce and commit vote may take
    before the sync is dropped (the groups go on; the lighthouse leaves a silent group out of the
    next quorum after its heartbeat timeout). ``host``:
    the name or address at which the other groups reach this one (a recovery's transfer; default:
    the host's name, which must resolve to it on the other nodes)."""

    lighthouse: str | None = None
    group: str | None = None
    min_groups: int = 1
    timeout: float = 60.0
    host: str | None = None

    def __post_init__(self):
        lighthouse = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not lighthouse:
            raise setting_error("fault_tolerance", f"needs the lighthouse's address: give lighthouse=http://HOST:PORT "
                                                   f"(start one with torchft_lighthouse) or set {LIGHTHOUSE_ENV}")
        if "://" not in lighthouse:
            lighthouse = f"http://{lighthouse}"
        object.__setattr__(self, "lighthouse", lighthouse)
        if (problem := _address_problem(lighthouse)) is not None:  # refused now, not after a timeout
            raise setting_error("fault_tolerance", f"lighthouse {shown(lighthouse)} {problem}: give "
                                                   f"lighthouse=http://HOST:PORT")
        group = self.group or os.environ.get("SHARDWIRE_GROUP") or os.uname().nodename
        # the name of its directory of checkpoints, beside the other groups': "." or ".." would be another's
        if (not isinstance(group, str) or not group.replace("-", "").replace("_", "").replace(".", "").isalnum()
                or not group.strip(".")):
            given = ("group" if self.group else "$SHARDWIRE_GROUP" if os.environ.get("SHARDWIRE_GROUP") else
                     "group (the host's name, with neither group= nor $SHARDWIRE_GROUP)")
            raise setting_error("fault_tolerance", f"{given} must be a name of letters, digits, '-', '_' and '.', "
                                                   f"not dots alone, got {shown(group)}")
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "host", self.host or os.uname().nodename)
        if type(self.min_groups) is not int or self.min_groups < 1:
            raise setting_error("fault_tolerance", f"min_groups must be a positive integer, got {self.min_groups!r}")
        if not (isinstance(self.timeout, (int, float)) and 0 < self.timeout <= MAX_TIMEOUT_S):
            raise setting_error("fault_tolerance", f"timeout must be a positive number of seconds, at most "
                                                   f"{MAX_TIMEOUT_S:,} (a year), got {self.timeout!r}")

    @classmethod
    def parse(cls, text: FaultTolerance | str | None) -> FaultTolerance | None:
        """None or "none": none; a ``FaultTolerance``; or the command line's form, comma-separated
        ``key=value`` pairs of its fields, e.g. "lighthouse=http://head:29510,group=node-3"."""
        if text is None or isinstance(text, FaultTolerance):
            return text
        if not isinstance(text, str):
            raise TypeError(f"fault_tolerance must be None, a string or a shardwire.FaultTolerance, "
                            f"got {type(text).__name__}")
        if not fault_tolerance_asked(text):
            return None
        fields, _ = settings_fields(
            text, _FIELD_TYPES, setting="fault_tolerance",
            remedy=f"use 'none', or key=value pairs of {', '.join(_FIELD_TYPES)}, e.g. "
                   f"'lighthouse=http://head:29510,group=node-3'",
            bad_value=lambda key, value: f"{key} must be a number, got {value}",
            twice=lambda key: f"{key} is given twice (the last would win silently): give it once")
        return cls(**fields)

    def __str__(self) -> str:
        return (f"lighthouse={self.lighthouse},group={self.group},min_groups={self.min_groups},timeout={self.timeout:g},"
                f"host={self.host}")


def fault_tolerance_asked(value) -> bool:
    """Whether ``value``, ``--fault-tolerance`` as given or as a checkpoint or profile recorded it,
    asks for fault tolerance. Only that sets what a run is: where the groups' lighthouse is (a
    restarted one is often at another address) and how long they wait change nothing it trains."""
    return isinstance(value, FaultTolerance) or (isinstance(value, str) and value.strip() not in ("none", ""))


def check_fault_tolerance(fault_tolerance: FaultTolerance | None, diloco, layout: str, shard_group_size: int | None,
                          world: int) -> None:
    """A ``ValueError`` where ``fault_tolerance`` cannot run: it carries the hybrid layout's
    reductions between jobs (DiLoCo's syncs, or each step's gradients), each job (its ``world``
    ranks) one group."""
    if fault_tolerance is None:
        return
    if layout != "hybrid":
        raise SettingError("fault tolerance carries the reductions between the groups of the hybrid layout: give "
                           "{hybrid} (with {diloco}=... the groups meet every H steps, without it at every step)",
                           hybrid=("layout", "hybrid"), diloco=("diloco",))
    if shard_group_size not in (None, world):
        raise SettingError(f"under fault tolerance each launched job is one group, but {{size}} cuts the job's "
                           f"{world} ranks into several: launch one job per group, and leave {{name}} out",
                           size=("shard_group_size", shard_group_size), name=("shard_group_size",))


_FIELD_TYPES = {"lighthouse": str, "group": str, "min_groups": int, "timeout": float, "host": str}
# One label of a host name, as /etc/hosts takes it.
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def _address_problem(url: str) -> str | None:
    """What keeps ``url`` from being a lighthouse's address, or None."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # a port past 65535 raises
    except ValueError as err:
        return f"is not an address ({err})"
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        return "is not an http:// address of a host and port"
    try:
        ipaddress.ip_address(parts.hostname)
    except ValueError:  # a name, then: letters, digits, hyphens, underscores; not a dotted quad out of range
        labels = parts.hostname.rstrip(".").split(".")
        if not all(_LABEL.fullmatch(label) for label in labels) or all(label.isdigit() for label in labels):
            return f"names no host ({shown(parts.hostname)} is neither an IP address nor a host name)"
    return None
