"""shardwire: fully sharded data-parallel training that hides its communication on slow networks."""

import importlib

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
__version__ = "0.1.0"


def __getattr__(name: str):
    """The engine's API, imported on first use: commands that never train (``shardwire simulate``,
    ``shardwire --help``) then start without importing torch."""
    if name in __all__:
        return getattr(importlib.import_module("shardwire.engine"), name)
    raise AttributeError(f"module 'shardwire' has no attribute {name!r}")
