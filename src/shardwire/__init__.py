"""shardwire: fully sharded data-parallel training that hides its communication on slow networks."""

from shardwire.engine import MixedPrecision, clip_grad_norm_, full_state_dict, no_sync, shard

__all__ = ["MixedPrecision", "clip_grad_norm_", "full_state_dict", "no_sync", "shard"]
__version__ = "0.1.0"
