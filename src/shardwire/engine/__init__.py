"""The sharded data-parallel engine: units, flat buffers, the prefetch schedule and its hooks.

Its API is ``shardwire``'s (``shardwire.shard``, ``shardwire.save_checkpoint``, ...); this package
only holds the modules, and imports none of them itself, so that the simulator can read the
engine's bounds (``shardwire.engine.limits``) without importing torch.
"""
