"""Sharded checkpoints: every rank writes its own shards, a checkpoint appears only when complete, and
it loads at any world size.

``format`` is the on-disk format and the manifest; ``save`` and ``load`` the collective operations;
``reader`` verified reading and re-slicing; ``optim`` the optimizer's state; ``series`` a directory of
checkpoints by step; ``portable`` plain state dict files for use without shardwire; ``claim`` one
run's ownership of a directory and ``session`` what an engine's checkpoint calls share (the save in
flight, the directories claimed).
"""

from shardwire.engine.checkpoint.format import CheckpointError
from shardwire.engine.checkpoint.load import CheckpointInfo, load_checkpoint, load_latest_checkpoint
from shardwire.engine.checkpoint.portable import export_state_dict, import_state_dict
from shardwire.engine.checkpoint.save import PendingCheckpoint, save_checkpoint
from shardwire.engine.checkpoint.series import checkpoint_path, list_checkpoints

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "PendingCheckpoint",
    "checkpoint_path",
    "export_state_dict",
    "import_state_dict",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest_checkpoint",
    "save_checkpoint",
]
