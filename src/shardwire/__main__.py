"""``python -m shardwire``: the ``shardwire`` command (``shardwire.cli.entry``)."""

from shardwire.cli import entry

entry()
