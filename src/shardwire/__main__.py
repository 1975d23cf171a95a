"""``python -m shardwire``. A Ctrl-C while torch and its libraries load (seconds) is held until they
have: one that lands inside a library's import can be swallowed there, leaving a half-made module
that fails later, far from the cause (numpy's ``__getattr__`` recursing). Then it is said as at any
later moment (``cli._interrupted``)."""

import os
import signal
import sys


def _load_entry():
    held = []
    holding = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # not where ignored (nohup, &)
    if holding:
        signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        from shardwire.cli import entry
    finally:
        if holding:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        if "LOCAL_RANK" not in os.environ:  # not a worker (launch.under_launcher), whose launcher says it
            print("interrupted", file=sys.stderr)
        raise SystemExit(130)
    return entry


_load_entry()()
