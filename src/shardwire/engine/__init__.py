"""The sharded data-parallel engine: units, flat buffers, the prefetch schedule and its hooks."""

from shardwire.comm.wire import Wire
from shardwire.engine.checkpoint import (
    CheckpointError,
    checkpoint_path,
    export_state_dict,
    import_state_dict,
    load_checkpoint,
    load_latest_checkpoint,
    save_checkpoint,
)
from shardwire.engine.grad import clip_grad_norm_, no_sync
from shardwire.engine.grad_scaler import GradScaler
from shardwire.engine.mixed_precision import MixedPrecision
from shardwire.engine.shard import shard
from shardwire.engine.state_dict import full_state_dict

__all__ = [
    "CheckpointError",
    "GradScaler",
    "MixedPrecision",
    "Wire",
    "checkpoint_path",
    "clip_grad_norm_",
    "export_state_dict",
    "full_state_dict",
    "import_state_dict",
    "load_checkpoint",
    "load_latest_checkpoint",
    "no_sync",
    "save_checkpoint",
    "shard",
]
