"""The sharded data-parallel engine: units, flat buffers, the prefetch schedule and its hooks."""

from shardwire.engine.grad import clip_grad_norm_, no_sync
from shardwire.engine.mixed_precision import MixedPrecision
from shardwire.engine.shard import shard
from shardwire.engine.state_dict import full_state_dict

__all__ = ["MixedPrecision", "clip_grad_norm_", "full_state_dict", "no_sync", "shard"]
