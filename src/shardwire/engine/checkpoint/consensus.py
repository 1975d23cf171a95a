"""Ranks agreeing on the outcome of each phase of a save or a load.

Ranks write and read different files, so one rank can fail where the others succeed: a full disk, a
corrupted shard only it reads. If it simply raised, the others would wait for it in their next
collective until the timeout, or, worse, go on training a model that was only partly loaded. So each
phase ends with every rank sharing its outcome, and if any rank failed, every rank raises the same
error, which names each failed rank and its reason.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TypeVar

from shardwire.engine.checkpoint.format import CheckpointError, CheckpointRefused, DirectoryMoved
from shardwire.engine.runtime import Engine

T = TypeVar("T")


def all_gather_json(value, engine: Engine, *, tag: str) -> list:
    """Every rank's JSON-serializable ``value``, in rank order."""
    payload = json.dumps(value).encode()
    lengths = [row[0] for row in engine.comm.all_gather_values([len(payload)], tag=f"{tag} (sizes)")]
    padded = payload.ljust(max(lengths), b"\0")
    rows = engine.comm.all_gather_values(padded, tag=tag)
    return [json.loads(bytes(row[:length])) for row, length in zip(rows, lengths)]


def on_every_rank(engine: Engine, what: str, fn: Callable[[], T]) -> T:
    """``fn()``'s result, once it has succeeded on every rank; otherwise the same ``CheckpointError``
    on every rank, naming ``what`` failed, on which ranks and why."""
    error = None
    try:
        result = fn()
    except Exception as err:  # whatever it is, the other ranks must hear of it or they would hang
        error = err
    said = None if error is None else [_describe(error), _kind(error)]
    ranks_by_reason: dict[str, list[int]] = {}
    kinds = set()  # of the errors of the ranks that failed
    for rank, found in enumerate(all_gather_json(said, engine, tag=what)):
        if found is not None:
            reason, kind = found
            ranks_by_reason.setdefault(reason, []).append(rank)
            kinds.add(kind)
    if ranks_by_reason:
        detail = "; ".join(
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {reason}"
            for reason, ranks in ranks_by_reason.items()
        )
        kind = _KINDS[kinds.pop()] if len(kinds) == 1 and None not in kinds else CheckpointError
        raise kind(f"{what} failed on {detail}") from error
    return result


# The kinds of failure every rank raises as such where every rank that failed met it: a checkpoint
# refused for what it holds (a resume sets it aside), a directory moved under its run.
_KINDS = (CheckpointRefused, DirectoryMoved)


def _kind(error: Exception) -> int | None:
    """The index in ``_KINDS`` of ``error``'s kind, or None."""
    return next((index for index, kind in enumerate(_KINDS) if isinstance(error, kind)), None)


def _describe(error: Exception) -> str:
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
