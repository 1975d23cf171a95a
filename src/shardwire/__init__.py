"""shardwire: fully sharded data-parallel training that hides its communication on slow networks."""

import importlib

# The public API, each name with the module that defines it: imported on first use, so that
# commands that never train (``shardwire simulate``, ``shardwire --help``) start without torch.
_API = {
    "CheckpointError": "shardwire.engine.checkpoint",
    "DiLoCo": "shardwire.engine.diloco",
    "FaultTolerance": "shardwire.engine.fault_tolerance",
    "GradScaler": "shardwire.engine.grad_scaler",
    "MixedPrecision": "shardwire.engine.mixed_precision",
    "Sync": "shardwire.engine.diloco",  # renamed DiLoCo: warns, for a release
    "Wire": "shardwire.comm.wire",
    "checkpoint_path": "shardwire.engine.checkpoint",
    "clip_grad_norm_": "shardwire.engine.grad",
    "diloco_sync": "shardwire.engine.grad",
    "export_state_dict": "shardwire.engine.checkpoint",
    "full_state_dict": "shardwire.engine.state_dict",
    "global_model": "shardwire.engine.grad",
    "import_state_dict": "shardwire.engine.checkpoint",
    "load_checkpoint": "shardwire.engine.checkpoint",
    "load_latest_checkpoint": "shardwire.engine.checkpoint",
    "no_sync": "shardwire.engine.grad",
    "recover_with": "shardwire.engine.recovery",
    "register_optimizer": "shardwire.engine.sharded_optim_state_dict",
    "save_checkpoint": "shardwire.engine.checkpoint",
    "shard": "shardwire.engine.shard",
    "sync_now": "shardwire.engine.grad",  # renamed diloco_sync: warns, for a release
}
__all__ = list(_API)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'shardwire' has no attribute {name!r}")
