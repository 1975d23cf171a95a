"""A process that used gloo ends after gloo's worker threads have let go of Python's tensors.

gloo carries out each of torch's collectives on a worker thread of its process group
(``pt_gloo_runloop``), which drops its reference to the collective's tensors a moment after the
caller's ``wait`` has returned, or later still for a collective nobody waited for. torch keeps a
tensor's Python object alive while C++ holds the tensor, so when that reference is the last one,
dropping it takes the GIL. Once the interpreter has begun to finalize, a thread that takes the GIL
is ended where it stands, here inside a C++ destructor, and the process aborts with "terminate
called without an active exception" (pytorch/pytorch#179291). A script whose last act is a
collective (``Profiler.save``, a checkpoint, ``dcp.save``) meets it about once in a few hundred
runs on a loaded machine, after its work is done and reported.

The exit handler registered here runs before finalization, when a thread may still take the GIL:
it gives the GIL up until every gloo worker thread has been seen asleep at a few looks in a row
(state ``S`` in ``/proc``: waiting for work, or for nothing else Python holds), within a bound
that a collective stuck on a lost peer cannot stretch. ``shardwire`` commands end the same way
before leaving by ``os._exit`` (``launch.end_process``), so they never reach finalization at all.
"""

from __future__ import annotations

import atexit
import os
import time

WORKER_THREAD = "pt_gloo_runloop"
LOOKS = 3  # asleep at this many looks in a row: settled
LOOK_INTERVAL_S = 0.002
BOUND_S = 2.0


def settle_gloo_at_exit() -> None:
    """Have the process wait, at exit, for gloo's worker threads to settle (registered once)."""
    atexit.unregister(_settle)
    atexit.register(_settle)


def _settle() -> None:
    deadline = time.monotonic() + BOUND_S
    asleep = 0
    while asleep < LOOKS and time.monotonic() < deadline:
        time.sleep(LOOK_INTERVAL_S)  # the GIL is free meanwhile, for a worker whose tensor needs it
        asleep = asleep + 1 if _workers_asleep() else 0


def _workers_asleep() -> bool:
    """Whether no gloo worker thread of this process is running or waiting to run (always true
    where ``/proc`` cannot say: the looks then only wait)."""
    try:
        threads = os.listdir("/proc/self/task")
    except OSError:
        return True
    for thread in threads:
        try:
            with open(f"/proc/self/task/{thread}/stat") as stat:
                fields = stat.read()
        except OSError:  # the thread ended meanwhile
            continue
        name, _, rest = fields.partition("(")[2].rpartition(")")
        if name == WORKER_THREAD and rest.split()[0] != "S":
            return False
    return True
