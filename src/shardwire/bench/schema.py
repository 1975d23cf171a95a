"""The name and version of the format ``shardwire bench --json`` writes (``report`` documents
it). Kept apart, importing nothing, so that the simulator, which must not import torch, checks the
same name that the bench writes."""

SCHEMA = "shardwire.bench/1"
