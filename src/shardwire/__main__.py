"""``python -m shardwire``: the ``shardwire`` command (``shardwire.cli.entry``), whose modules load
with Ctrl-C held (``launch.signals_held``). A worker loads them as its launcher starts it, where
Ctrl-C reaches the launcher and every worker at once: raised inside an import, it was a traceback."""

import sys

from shardwire.launch import Stopped, signals_held, stopped, under_launcher


def _entry():
    try:
        with signals_held():
            from shardwire.cli import entry
    except Stopped as err:
        said, status = stopped(err)
        if not under_launcher():  # a worker's launcher says it
            print(said, file=sys.stderr)
        raise SystemExit(status) from None
    return entry


_entry()()
