from shardwire.cli import entry

entry()
