"""The sharded data-parallel engine: units, flat buffers, the prefetch schedule and its hooks.

Its API is imported on first use, each name from the submodule that holds it: the simulator reads
the engine's bounds (``shardwire.engine.limits``) without importing torch, which importing this
package would otherwise do.
"""

import importlib
import sys
import types

_SUBMODULES = {
    "CheckpointError": "shardwire.engine.checkpoint",
    "GradScaler": "shardwire.engine.grad_scaler",
    "MixedPrecision": "shardwire.engine.mixed_precision",
    "Wire": "shardwire.comm.wire",
    "checkpoint_path": "shardwire.engine.checkpoint",
    "clip_grad_norm_": "shardwire.engine.grad",
    "export_state_dict": "shardwire.engine.checkpoint",
    "full_state_dict": "shardwire.engine.state_dict",
    "import_state_dict": "shardwire.engine.checkpoint",
    "load_checkpoint": "shardwire.engine.checkpoint",
    "load_latest_checkpoint": "shardwire.engine.checkpoint",
    "no_sync": "shardwire.engine.grad",
    "save_checkpoint": "shardwire.engine.checkpoint",
    "shard": "shardwire.engine.shard",
}

__all__ = list(_SUBMODULES)


def __getattr__(name: str):
    """Import the submodule holding ``name`` on first use."""
    if name in _SUBMODULES:
        return getattr(importlib.import_module(_SUBMODULES[name]), name)
    raise AttributeError(f"module 'shardwire.engine' has no attribute {name!r}")


class _Engine(types.ModuleType):
    """This package, keeping its API's names: importing a submodule binds it on the package under
    its own name, and ``shard`` the function shares its name with the module that holds it."""

    def __setattr__(self, name: str, value) -> None:
        if not (name in _SUBMODULES and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Engine
