"""``shardwire bench``: the collective benchmark, kept apart from the transport in ``shardwire.comm``."""
