"""What one engine's checkpoint calls share: the asynchronous save in flight and the directories
this run has claimed.

A save may return before its files are written (``asynchronous``): the next save or load must first
make it visible, so one save is in flight at most. A run claims a checkpoint directory once
(``claim``) and keeps its lock for the life of the process. Both outlive a call and belong to the
model's engine, yet neither is the engine's business: the engine holds the session in one slot
(``Engine.checkpointing``) that only this package reads and writes.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import TYPE_CHECKING

from shardwire.engine.checkpoint.claim import claim

if TYPE_CHECKING:
    from shardwire.engine.checkpoint.save import PendingCheckpoint
    from shardwire.engine.runtime import Engine


@dataclasses.dataclass
class CheckpointSession:
    pending: PendingCheckpoint | None = None  # the asynchronous save being written
    # directories this run owns, resolved, each with its claim file's (device, inode)
    claimed: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    # checkpoints a resume of this run passed over, whole, for what they hold (``CheckpointRefused``),
    # resolved: a save of their step sets them aside, never deleting what may be all the user has of it
    passed_over: set[str] = dataclasses.field(default_factory=set)

    def finish_pending(self) -> None:
        """Make the asynchronous save in flight, if any, visible (every rank must call it)."""
        if self.pending is not None:
            self.pending.wait()

    def claim(self, directory: pathlib.Path, saving: str | None = None) -> None:
        """Own ``directory`` for this run (``claim.claim``), before saving the checkpoint ``saving`` in
        it; a directory claimed already is not claimed again."""
        claim(directory, self.claimed, saving)


def session_of(engine: Engine) -> CheckpointSession:
    """The engine's checkpoint session, made at its first checkpoint call."""
    if engine.checkpointing is None:
        engine.checkpointing = CheckpointSession()
    return engine.checkpointing
