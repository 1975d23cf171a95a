"""Starting a shardwire command as several local processes through torch's elastic launcher.

``shardwire train --nproc 4`` re-runs itself as ``torchrun --standalone --nproc-per-node 4 -m
shardwire train ...``: the workers are ordinary torchrun workers, so the same command also runs
unchanged under a user's own ``torchrun --nnodes ... --nproc-per-node ... -m shardwire train``.
``host_memory_per_worker`` says how much of this machine each local worker can have, so that a
command refuses more workers than it holds before starting any.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import logging
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from shardwire.placement import launch_ranks_per_node

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# The status of a worker that stopped the job with a message of its own (``error: ...``), as the
# command line's refusals end: its launcher adds nothing to that line.
REFUSED = 2
# The status of a shardwire worker whose collective failed (a peer stopped, hung or crashed, or a
# link broke), which said what it waited for in one line: unlike a refusal, a restart
# (``--max-restarts``) may not meet it again. Beside another worker's failure it is that failure's
# consequence, not named. Another program's workers (``testbed run`` of a script) may exit 3 for
# reasons of their own: their statuses are read as they are (``ours``).
COLLECTIVE_FAILED = 3
# What a worker process takes before it holds any data: Python with torch imported is about 220 MB
# resident; no worker comes in under this.
_WORKER_FOOTPRINT = 128 << 20
# torchrun's variables a worker reads its place in the world from.
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# Set for the workers ``launch_local`` starts: their launcher checked the job and said what it noted.
_NOTED_BY_LAUNCHER = "SHARDWIRE_NOTED_BY_LAUNCHER"
# How long a worker whose line another worker says first leaves its launcher to stop it: torchrun's
# agent looks at its workers every 0.1 s, and stops the rest (SIGTERM) once one has failed.
_LAUNCHERS_STOP_S = 2.0
# Set beside the OMP_NUM_THREADS a node's command was given for the whole node (``shardwire testbed
# exec``): that value, for the ranks the command starts on the node to share (``share_node_threads``).
NODE_THREADS = "SHARDWIRE_NODE_THREADS"


def under_launcher() -> bool:
    """True inside a worker started by torchrun (or any launcher that sets torchrun's variables)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def leave_it_to_the_launcher() -> None:
    """In a worker, wait a moment for the launcher to stop it before it says its own line, where
    another worker says why the job stops: the same refusal (all ranks read the same data), or the
    failure this worker only waited on. The user then reads one line. A launcher that does not stop
    it (the failed rank on another node, whose own agent saw it) lets it say its line after all."""
    if under_launcher():
        time.sleep(_LAUNCHERS_STOP_S)


def tells_the_user() -> bool:
    """Whether this process is the one that says what the job's settings are like (a model config's
    oddities, which every process meets as it reads the config): the command itself, and under a
    launcher of the user's, rank 0; never the workers ``launch_local`` started, whose launcher said
    it before starting them. Said once, however many ranks read the same config."""
    if not under_launcher():
        return True
    return _NOTED_BY_LAUNCHER not in os.environ and os.environ.get("RANK", "0") == "0"


def share_node_threads() -> None:
    """Give this worker its part of its node's compute threads, where they were set for the whole
    node (``NODE_THREADS``): that many over the node's ranks (torchrun's ``LOCAL_WORLD_SIZE``, or
    SLURM's tasks per node: ``shardwire.placement.launch_ranks_per_node``), at least one.

    torchrun passes an OMP_NUM_THREADS it finds set to every worker as it is (it sets 1 only where
    none is set), and so does ``launch_local``: without this, each of a node's ranks would take the
    node's whole share. An OMP_NUM_THREADS that is no longer the value set beside it was the user's
    choice, and stands. Called before torch is imported: its OpenMP reads the variable as it loads."""
    share = os.environ.pop(NODE_THREADS, None)
    world = os.environ.get("WORLD_SIZE", "1")
    if share is None or os.environ.get("OMP_NUM_THREADS") != share or not (share.isdigit() and world.isdigit()):
        return
    local = launch_ranks_per_node(max(1, int(world)))
    os.environ["OMP_NUM_THREADS"] = str(max(1, int(share) // max(1, local)))


def launcher_problem() -> str | None:
    """What makes torchrun's variables in this environment a world no worker can join, or None.
    Left in a shell by another job, ``WORLD_SIZE=2 RANK=5`` would have a command wait out its
    timeout for peers that never come; a launcher never sets them so."""
    values = {}
    for name in _LAUNCHER_VARIABLES:
        text = os.environ.get(name)
        if text is None:
            continue
        if not (text.isascii() and text.isdigit() and len(text) < 10):
            return (f"{name}={text[:40]!r} in the environment is not a count of ranks: torchrun sets it; unset it "
                    f"(left from another job?) or launch with torchrun")
        values[name] = int(text)
    remedy = ("(torchrun's variables, left from another job?): unset them to start local workers, or launch with "
              "torchrun")
    for size in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        if values.get(size) == 0:
            return f"the environment sets {size}=0, which no launch gives {remedy}"
    # each rank below its count, and a node's ranks no more than the world's
    for low, high, equal in (("RANK", "WORLD_SIZE", False), ("LOCAL_RANK", "LOCAL_WORLD_SIZE", False),
                             ("LOCAL_RANK", "WORLD_SIZE", False), ("LOCAL_WORLD_SIZE", "WORLD_SIZE", True)):
        if low in values and high in values and values[low] >= values[high] + equal:
            return f"the environment sets {low}={values[low]} and {high}={values[high]}, which no launch gives {remedy}"
    if values.get("WORLD_SIZE", 1) > 1:  # the ranks meet at MASTER_ADDR:MASTER_PORT, which torchrun sets
        if not os.environ.get("MASTER_ADDR"):
            return f"the environment sets WORLD_SIZE={values['WORLD_SIZE']} but no MASTER_ADDR {remedy}"
        port = os.environ.get("MASTER_PORT", "")
        if not (port.isascii() and port.isdigit() and len(port) < 6 and int(port) <= 65535):
            return f"MASTER_PORT={port[:40]!r} in the environment is not a port, 0 to 65535 {remedy}"
    return None


def die_with_launcher() -> None:
    """End this worker when the process that started it dies, however it dies.

    A launcher killed with SIGKILL cannot stop its workers, and they would train on, holding GPUs
    and ports. Linux can send a child a signal when its parent exits (``PR_SET_PDEATHSIG``); torch's
    elastic agent starts each worker as its own child, so this ties each worker to its agent. A
    worker whose parent is already gone (it died before the call) leaves at once."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        return  # not allowed here (a sandbox): nothing is lost but this safety net
    if os.getppid() != parent:
        os._exit(1)


def end_process(status: int) -> NoReturn:
    """End this process with ``status`` once its Python work is done, without the interpreter's
    own teardown.

    torch's C++ threads outlive the Python code that used them: gloo finishes each collective on
    a thread of its own and lets go of the collective's tensors and callbacks there a moment after
    the caller has returned from it, and ``destroy_process_group`` does not wait for those threads.
    One that needs the GIL once the interpreter has begun to tear itself down is ended by Python
    inside a C++ destructor, and the process aborts ("terminate called without an active
    exception", status -6) after a run that succeeded; its launcher then stops the job as failed
    (pytorch/pytorch#179291). So the process does what Python's shutdown does for Python code
    (waits for its other threads, runs the exit handlers, flushes its streams) and then ends at
    once, before the teardown those threads race. Its status is decided: a stop signal that comes
    now is ignored, where it would raise inside an exit handler (torch's, with a traceback) or end
    the process without a word, after all it was asked was done."""
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
    threading._shutdown()  # as Python's own shutdown: thread pools told to stop, then every thread joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None: started without it (>&-)
            with contextlib.suppress(OSError, ValueError):  # a reader gone (| head), a stream closed
                stream.flush()
    os._exit(status)


class UntilClosed:
    """A text stream that is ``stream`` until a write or flush of it fails (a reader gone, ``| head``;
    a full disk), and the null device after: ``said`` is called once, with the error, and what it
    raises reaches the writer (``OutputLost``, where the output was the command's result). Python
    ignores SIGPIPE, so such a write raises wherever it happens, which would end a run that has only
    lost its reader; and a failed write leaves its text in the buffer, to fail again at each flush and
    as the process ends."""

    def __init__(self, stream, said: Callable[[OSError], None] | None = None):
        self._stream = stream
        self._said = said
        self._ended = False

    def __getattr__(self, name):  # isatty, fileno, encoding: the stream's own
        return getattr(self._stream, name)

    def write(self, text: str) -> int:
        if self._ended:
            return len(text)
        try:
            return self._stream.write(text)
        except OSError as err:
            self._end(err)
            return len(text)

    def flush(self) -> None:
        if self._ended:
            return
        try:
            self._stream.flush()
        except OSError as err:
            self._end(err)

    def _end(self, err: OSError) -> None:
        """The null device under the stream's descriptor too, for what its buffer holds and for the
        processes this one starts."""
        self._ended = True
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self._stream.fileno())
        os.close(null)
        if self._said is not None:
            self._said(err)


class Closed:
    """The standard output of a process started without one (``>&-``, where Python's is None): the null
    device holds its descriptor, so that no file the command opens takes it and receives what is
    printed, and every write fails as on a closed descriptor, for ``UntilClosed`` to say so."""

    def __init__(self):
        self._null = open(os.devnull, "w")

    def __getattr__(self, name):  # fileno, isatty, encoding: the null device's
        return getattr(self._null, name)

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "it was closed as the command started (>&-)")

    def flush(self) -> None:
        pass


class OutputLost(OSError):
    """A command's standard output could not be written (a full disk, a reader gone): what it printed
    is incomplete, so it ends with a failure's status, and says why unless the reader left (``| head``,
    where the missing rest is what was asked for)."""

    @classmethod
    def raised(cls, err: OSError) -> NoReturn:
        """``UntilClosed``'s ``said`` for a command's result."""
        raise cls(err.errno, err.strerror or str(err))


def rendezvous_options(nnodes: int, nproc_per_node: int, endpoint: str, job_id: str) -> list[str]:
    """torchrun's options for ``nnodes`` nodes of ``nproc_per_node`` workers that meet at the c10d
    rendezvous at ``endpoint`` (host:port) under the name ``job_id``."""
    return [f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job_id}"]


def torchrun_command(nnodes: int, nproc_per_node: int, argv: list[str], *, max_restarts: int = 0) -> str:
    """The command that runs ``python -m shardwire <argv>`` as ``nproc_per_node`` workers on each of
    ``nnodes`` nodes: the same on every node, the nodes meeting at a c10d rendezvous on the first
    one (``HEAD_ADDRESS``, for the launcher or the user to fill in), so no node needs a rank of its
    own and a restarted node rejoins. One node meets no other: it runs as printed (``--standalone``)."""
    torchrun = ["torchrun", "--standalone", f"--nproc-per-node={nproc_per_node}"] if nnodes == 1 else [
        "torchrun", *rendezvous_options(nnodes, nproc_per_node, "HEAD_ADDRESS:29500", "shardwire")]
    if max_restarts:
        torchrun.append(f"--max-restarts={max_restarts}")
    return shlex.join([*torchrun, "-m", "shardwire", *argv])


class Stopped(KeyboardInterrupt):
    """The launcher and its workers were stopped by a signal: Ctrl-C's SIGINT, or a scheduler's
    SIGTERM, a closed terminal's SIGHUP. A ``KeyboardInterrupt``, handled as Ctrl-C is, that says
    which, for the words and the status (128 + its number, as a shell reports a process it ended)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def signals_held():
    """Within it, Ctrl-C, SIGTERM and SIGHUP are held, then raised as ``Stopped`` once it is left: what
    imports torch and its libraries (seconds) runs in it. A ``KeyboardInterrupt`` that lands inside a
    library's import can be swallowed there (a bare ``except:``), leaving the command to run on as if
    never stopped, or leave a half-made module that fails later, far from the cause (numpy's
    ``__getattr__`` recursing). A signal ignored (nohup) stays ignored; a worker holds Ctrl-C alone, as
    its launcher ends it by SIGTERM and says what that stopped."""
    held: list[int] = []
    before = {signum: signal.getsignal(signum) for signum in stop_signals()}
    holding = [signum for signum, handler in before.items() if handler not in (signal.SIG_IGN, None)]
    for signum in holding:
        signal.signal(signum, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for signum in holding:
            signal.signal(signum, before[signum])
    if held:
        raise stopping(held[0])


def stop_signals() -> tuple[int, ...]:
    """The signals that stop this process as Ctrl-C does: Ctrl-C's, and a scheduler's SIGTERM and a
    closed terminal's SIGHUP, but in a worker, whose launcher ends it by SIGTERM, Ctrl-C's alone."""
    return (signal.SIGINT,) if under_launcher() else (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stopping(signum: int) -> Stopped:
    """The stop by ``signum``, now under way: from here on this process ignores the other signals
    that would stop it (``stop_signals``). A second one, a moment later (a terminal's Ctrl-C reaches
    a wrapper such as ``timeout`` too, which passes it on), would break off what the stop says and
    tidies with a traceback. Called in the main thread, as a signal's handler is."""
    for other in stop_signals():
        signal.signal(other, signal.SIG_IGN)
    return Stopped(signum)


def stopped(err: KeyboardInterrupt) -> tuple[str, int]:
    """What to call a stop (``interrupted`` for Ctrl-C), and the status to end with."""
    signum = getattr(err, "signum", signal.SIGINT)
    said = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    return said, 128 + signum


def launch_local(nproc: int, argv: list[str], *, max_restarts: int = 0) -> int:
    """Run ``python -m shardwire <argv>`` as ``nproc`` local workers; returns the exit status. Ctrl-C
    (or SIGTERM, SIGHUP) stops the workers and raises ``Stopped`` here, for the command to say what
    its job leaves behind."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if nproc < 1:
        print(f"error: --nproc must be at least 1, got {nproc}", file=sys.stderr)
        return 2
    # One compute thread per core and worker, unless the user chose: torchrun would otherwise
    # force 1 and warn.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # torchft's manager (--fault-tolerance) logs every quorum at INFO; the progress line says what
    # each sync did, and its warnings and errors still show.
    os.environ.setdefault("RUST_LOG", "warn")
    if max_restarts:
        # Restarted workers must not share the launcher's rendezvous store: they would read the
        # addresses of the workers they replace and fail to connect (pytorch/pytorch#135712).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    config = parse_args(["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
                         "-m", "shardwire"])
    # Set the workers' arguments after parsing: torchrun's parser would otherwise read them too
    # (and take `--nproc` for an abbreviation of its own `--nproc-per-node`).
    config.training_script_args = argv
    said = quiet_agent(ours=True)
    os.environ[_NOTED_BY_LAUNCHER] = "1"  # inherited by the workers
    handlers = {signum: signal.getsignal(signum) for signum in (*stop_signals(), signal.SIGQUIT)}
    try:
        with restarting_failures_only(said):
            run(config)  # its agent sets handlers of its own, which raise its SignalException
    except SignalException as err:
        raise stopping(int(err.sigval)) from None
    except ChildFailedError as err:
        return failed_workers(err, ours=True)
    except WorkersRefused:
        return REFUSED  # a worker said why, in one line
    finally:
        os.environ.pop(_NOTED_BY_LAUNCHER, None)
        for signum, handler in handlers.items():  # the agent's no longer: the command's, or stopping's
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, handler)
    return 0


class WorkersRefused(Exception):
    """The workers stopped the job with a refusal of their own (``REFUSED``), which said why: a restart
    would meet it again."""


@contextlib.contextmanager
def restarting_failures_only(said: _AgentLog):
    """Let torch's elastic agent restart failed workers (``--max-restarts``), but not workers that
    refused the job: a diverged run resumed from its last good checkpoint with the same settings
    diverges again, setting aside another copy of the checkpoint each time, and data that changed
    under the run is still changed. The agent restarts whatever the exit status, so its restart is
    wrapped, in this process (where the agent runs) and for the launch only: after a refusal it stops
    the workers and raises ``WorkersRefused``."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    restart = SimpleElasticAgent._restart_workers

    def unless_refused(agent, worker_group):
        if said.refused:
            agent._stop_workers(worker_group)
            raise WorkersRefused
        said.restarting()
        return restart(agent, worker_group)

    SimpleElasticAgent._restart_workers = unless_refused
    try:
        yield
    finally:
        SimpleElasticAgent._restart_workers = restart


def quiet_agent(*, ours: bool) -> _AgentLog:
    """Keep torch's elastic agent, run in this process, to its errors and its restarts: its warnings
    narrate its shutdown (a signal received, each worker sent one), and its line for a failed worker
    repeats what the worker, or ``failed_workers``'s line, says once (``_AgentLog``, returned: it
    knows how the workers failed; ``ours``: whether they are shardwire's, whose statuses say more)."""
    for name in list(logging.root.manager.loggerDict):  # each sets its own level as torch makes it
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    agent = logging.getLogger("torch.distributed.elastic.agent.server.api")
    agent.setLevel(logging.INFO)  # where it says it restarts the workers
    said = _AgentLog(ours)
    for logger in (agent, logging.getLogger("torch.distributed.elastic.multiprocessing.api")):
        for old in [f for f in logger.filters if isinstance(f, _AgentLog)]:
            logger.removeFilter(old)
        logger.addFilter(said)
    return said


class _AgentLog(logging.Filter):
    """What shardwire says of the agent's log: its errors, but not its line for a failed worker (the
    worker's own message, or ``failed_workers``'s line, says it once) nor its traceback for an exit
    barrier the node that held it left (that node failed, and the job's line names it; formatting the
    traceback also imports torch._dynamo, seconds in which the job's SIGTERM lands in the log's
    handler). A restart of the workers (``--max-restarts``), which it says at INFO, is said as a note
    naming the rank that failed first and how: the restarted workers then say where they resume."""

    def __init__(self, ours: bool):
        super().__init__()
        self._ours = ours
        self._failed: tuple[int, int] | None = None  # (rank, exit status) of the failure logged last
        self._statuses: set[int] = set()  # the exit statuses of the failures since the workers started

    @property
    def refused(self) -> bool:
        """Whether the workers' failure is a refusal: a worker's, with the rest stopped."""
        return _refused(self._statuses, self._ours)

    def restarting(self) -> None:
        """The workers start again: their failures are behind them."""
        self._statuses.clear()

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if text.startswith("failed (exitcode"):
            self._failed = (record.args[1], record.args[0])
            self._statuses.add(record.args[0])
            return False
        if "will restart worker group" in text and "attempts left" in text:
            if self.refused:  # not restarted: restarting_failures_only stops them
                return False
            left, most = record.args[2], record.args[3]
            named = ""
            if self._failed is not None:
                rank, status = self._failed
                above = "; any message it gave is above" if _ending_signal(status) is None and status > 0 else ""
                named = f": rank {rank} ({_how_it_ended(status, self._ours)}){above}"
            print(f"note: worker processes failed{named}; starting them again (--max-restarts: restart "
                  f"{most - left + 1} of {most})", file=sys.stderr, flush=True)
            return False
        return record.levelno >= logging.ERROR and not text.startswith("Error waiting on exit barrier")


def failed_workers(err, *, ours: bool) -> int:
    """The status of a job whose workers failed (torch's ``ChildFailedError``): a worker's refusal,
    which said why in one line, as it is; any other failure in one line naming the ranks that failed
    and how (an exit status, or the signal that ended one, which leaves no message of its own). The
    ranks the launcher stopped with SIGTERM once one had failed are not named; where every rank ended
    by SIGTERM, the one sent it from outside the run is the one the launcher found ended first.
    Shardwire's workers (``ours``) whose collective failed (``COLLECTIVE_FAILED``) said so: beside
    another failure they are not named; where one was found first, the ranks the launcher then
    stopped are, as a rank that hung or lost its link is among them."""
    statuses = {failure.exitcode for failure in err.failures.values()}
    if _refused(statuses, ours):
        return REFUSED  # a worker said why, in one line, and the agent stopped the rest
    ended = {rank: failure.exitcode for rank, failure in sorted(err.failures.items())}
    # The agent records the workers it finds ended before those it then stops.
    first_rank, first = next(iter(err.failures.items()))
    if ours and first.exitcode == COLLECTIVE_FAILED:
        waited = [rank for rank, status in ended.items() if status == COLLECTIVE_FAILED]
        stopped = [rank for rank, status in ended.items() if status != COLLECTIVE_FAILED]
        rest = (f"; the launcher then stopped {_ranks(stopped)}, whose collectives had not failed: a rank that hung "
                f"or lost its link is among them" if stopped else "")
        print(f"error: worker processes failed: a collective failed on {_ranks(waited)} (said above){rest}",
              file=sys.stderr)
        return 1
    consequences = (-signal.SIGTERM, COLLECTIVE_FAILED) if ours else (-signal.SIGTERM,)
    failed = {rank: status for rank, status in ended.items() if status not in consequences}
    if not failed:
        # the first was sent SIGTERM from outside the run
        rest = "; the launcher then stopped the rest" if len(ended) > 1 else ""
        print(f"error: worker processes failed: rank {first_rank} (ended by SIGTERM, sent from outside the run)"
              f"{rest}", file=sys.stderr)
        return 1
    named = ", ".join(f"rank {rank} ({_how_it_ended(status, ours)})" for rank, status in failed.items())
    stopped = "; the launcher then stopped the rest" if -signal.SIGTERM in statuses else ""
    said = sum(_ending_signal(status) is None and status > 0 for status in failed.values())
    above = "" if not said else "; any message it gave is above" if said == 1 else "; any messages they gave are above"
    print(f"error: worker processes failed: {named}{stopped}{above}", file=sys.stderr)
    return 1


def _refused(statuses: set[int], ours: bool) -> bool:
    """Whether workers that ended with ``statuses`` stopped the job with a refusal: a worker's, the
    rest stopped by the agent or (``ours``) failing in the collectives it left."""
    return REFUSED in statuses and statuses <= {REFUSED, -signal.SIGTERM, *([COLLECTIVE_FAILED] if ours else [])}


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _ending_signal(status: int) -> str | None:
    """The signal a worker's exit ``status`` says ended it: killed by it (negative), or, having
    handled it, leaving with the status a shell gives (128 + its number: 130 for Ctrl-C); None for
    an exit of the worker's own."""
    number = -status if status < 0 else status - 128 if status > 128 else None
    try:
        return None if number is None else signal.Signals(number).name
    except ValueError:
        return f"signal {number}" if status < 0 else None


def _how_it_ended(status: int, ours: bool) -> str:
    """A worker's exit status in words: its exit code, or the signal that ended it (SIGKILL: the
    system's out-of-memory killer, or a user's ``kill -9``)."""
    name = _ending_signal(status)
    if ours and status == COLLECTIVE_FAILED:
        return f"exit {status}: a collective failed"
    if name is None:
        return f"exit {status}"
    if status > 0:
        return f"stopped by {name}, exit {status}"
    return f"killed by {name}" + (": out of memory, or kill -9" if name == "SIGKILL" else "")


def host_memory_per_worker(local_workers: int) -> int:
    """An equal share of this machine's memory for each of ``local_workers`` worker processes, less
    what each process itself takes; raises ``ValueError`` where that leaves nothing (``--nproc
    100000`` would start a hundred thousand processes)."""
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if local_workers * _WORKER_FOOTPRINT >= machine:
        raise ValueError(f"{local_workers:,} workers take over {local_workers * _WORKER_FOOTPRINT / 2**30:.3g} GiB "
                         f"before holding any data, more than this machine's {machine / 2**30:.3g} GiB")
    return machine // local_workers - _WORKER_FOOTPRINT
