"""``python -m shardwire``. A Ctrl-C (or a SIGTERM, a SIGHUP) while torch and its libraries load
(seconds) is held until they have: one that lands inside a library's import can be swallowed there,
leaving a half-made module that fails later, far from the cause (numpy's ``__getattr__``
recursing). Then it is said as at any later moment (``cli._interrupted``). A worker holds Ctrl-C
alone: its launcher ends it by SIGTERM, and says what that stopped."""

import os
import signal
import sys


def _load_entry():
    worker = "LOCAL_RANK" in os.environ  # launch.under_launcher, without importing it yet
    default = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL, signal.SIGHUP: signal.SIG_DFL}
    held, holding = [], [signum for signum, handler in default.items()  # not where ignored (nohup, &)
                         if signal.getsignal(signum) is handler and not (worker and signum != signal.SIGINT)]
    for signum in holding:
        signal.signal(signum, lambda signum, frame: held.append(signum))
    try:
        from shardwire.cli import entry
    finally:
        for signum in holding:
            signal.signal(signum, default[signum])
    if held:
        from shardwire.launch import Stopped, stopped

        said, status = stopped(Stopped(held[0]))
        if not worker:  # a worker's launcher says it
            print(said, file=sys.stderr)
        raise SystemExit(status)
    return entry


_load_entry()()
