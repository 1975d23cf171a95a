from shardwire.cli import entry

raise SystemExit(entry())
