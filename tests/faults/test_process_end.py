"""A command's process ends as Python's shutdown ends it (its threads waited for, thread pools
told to stop, its exit handlers run, its output flushed) and then at once, before the teardown that
torch's C++ threads race; a script that used shardwire on gloo ends after gloo's threads have let
go of its tensors."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from shardwire.launch import COLLECTIVE_FAILED, REFUSED

ENDING = textwrap.dedent("""
    import atexit, concurrent.futures, pathlib, sys, threading, time
    from shardwire.launch import end_process

    def late():
        time.sleep(0.3)
        print("the thread's line", end="")

    atexit.register(lambda: pathlib.Path(sys.argv[1]).write_text("exit handler ran"))
    threading.Thread(target=late).start()
    pool = concurrent.futures.ThreadPoolExecutor(1)  # kept: its idle worker waits to be told to stop
    pool.submit(time.sleep, 0)
    sys.stdout.write("buffered, ")  # no newline: still in the stream's buffer
    end_process(int(sys.argv[2]))
    print("never reached")
""")


@pytest.mark.parametrize("status", [0, 3])
def test_the_process_ends_with_its_status_after_its_threads_exit_handlers_and_output(tmp_path, status):
    marker = tmp_path / "marker"
    done = subprocess.run([sys.executable, "-c", ENDING, str(marker), str(status)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == status, done.stderr
    assert done.stdout == "buffered, the thread's line"
    assert marker.read_text() == "exit handler ran"


SIGNALLED_AS_IT_ENDS = textwrap.dedent("""
    import atexit, os, signal, sys, time
    from shardwire.launch import end_process

    def handler():  # as torch's exit handlers run, the signal comes
        os.kill(os.getpid(), int(sys.argv[1]))
        time.sleep(0.2)
        print("exit handler ran")

    atexit.register(handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    end_process(0)
""")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_as_the_process_ends_leaves_its_status(signum):
    """Its work done and its status decided: the signal raised inside an exit handler (Ctrl-C, with
    a traceback) or ended the process without a word (SIGTERM, SIGHUP)."""
    done = subprocess.run([sys.executable, "-c", SIGNALLED_AS_IT_ENDS, str(int(signum))], capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "exit handler ran\n", "")


@pytest.mark.parametrize("argv, status, line", [
    (["--help"], 0, None),
    (["train", "--steps", "0"], 2, "error: --steps must be at least 1, got 0"),
    (["no-such-command"], 2, "error: argument COMMAND: invalid choice"),
])
def test_the_command_leaves_with_the_status_its_refusals_and_help_promise(argv, status, line):
    done = subprocess.run([sys.executable, "-m", "shardwire", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == status, done.stderr
    if line is not None:
        assert done.stderr.startswith(line) and done.stderr.count("\n") == 1, done.stderr


LEFT_IN_GLOO = textwrap.dedent("""
    import torch, torch.distributed as dist
    import shardwire
    from shardwire.models.gpt import GPT, PRESETS, Block

    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block])
    tensor = torch.ones(50_000_000)
    dist.all_reduce(tensor, async_op=True)  # not waited for: gloo's thread holds the last reference
    del tensor
    print("leaving")
""")


def test_a_script_ends_cleanly_while_gloos_thread_still_holds_its_tensor():
    """Without the wait at exit (``comm.settle``) this ends in "terminate called without an active
    exception" nearly every time: the thread lets go of the tensor during finalization."""
    done = subprocess.run([sys.executable, "-c", LEFT_IN_GLOO], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "leaving\n"), done.stderr


SIGNAL_WHILE_LOADING = textwrap.dedent("""
    import builtins, os, runpy, signal, sys

    load, sent = builtins.__import__, []

    def interrupted_import(name, *args, **kwargs):
        if name == os.environ["LANDS_IN"] and not sent:  # the signal lands while the command's modules load,
            sent.append(name)
            try:
                os.kill(os.getpid(), int(os.environ["SIGNAL"]))
            except BaseException:  # in a library that swallows what is raised there
                pass
        return load(name, *args, **kwargs)

    builtins.__import__ = interrupted_import
    sys.argv = ["shardwire", "train", "--model", "tiny", "--steps", "2"]
    if os.environ["ENTRY"] == "module":
        runpy.run_module("shardwire", run_name="__main__")
    else:  # the shardwire command installed as a console script
        from shardwire.cli import entry
        entry()
""")


@pytest.mark.slow
@pytest.mark.parametrize("entry, lands_in", [("module", "torch"), ("module", "shardwire.cli"), ("script", "torch")])
@pytest.mark.parametrize("signum, said", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "stopped by SIGTERM"),
                                          (signal.SIGHUP, "stopped by SIGHUP")])
def test_a_signal_while_the_modules_load_is_one_line_once_they_have(signum, said, entry, lands_in):
    """Not a KeyboardInterrupt inside a library's import, which can swallow it and leave a
    half-made module behind, the command running on; and a SIGTERM there ended the command with no
    word. Alike as ``python -m shardwire`` (as a launcher starts its workers, whom Ctrl-C reaches
    with it) and as the installed ``shardwire``."""
    done = subprocess.run([sys.executable, "-c", SIGNAL_WHILE_LOADING], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SIGNAL": str(int(signum)), "ENTRY": entry, "LANDS_IN": lands_in})
    assert (done.returncode, done.stderr, done.stdout) == (128 + signum, f"{said}\n", "")


def test_a_sigterm_once_the_command_runs_is_one_line():
    """Before a launcher's agent takes the signal over, and in commands with none (simulate, plan)."""
    job = subprocess.Popen([sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--steps", "100000",
                            "--eval-batches", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        job.send_signal(signal.SIGTERM)
        _, errors = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 128 + signal.SIGTERM and errors.splitlines()[-1].startswith("stopped by SIGTERM"), errors


def _plan_signalled(plan: str) -> str:
    """A program that runs ``shardwire plan`` with its work replaced by ``plan`` (the source of a
    ``plan`` function, which sends the signal numbered in $SIGNAL), as the command line runs it."""
    return textwrap.dedent("""
        import os, signal, sys, threading, time
        import shardwire.cli.plan as command
    """) + textwrap.dedent(plan) + textwrap.dedent("""
        command.plan = plan
        sys.argv = ["shardwire", "plan", "--model", "gpt-1.3b", "--cluster", "h100-100gbe", "--nodes", "4",
                    "--global-batch", "64"]
        from shardwire.cli import entry
        entry()
    """)


def _run_signalled(plan: str, signum: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _plan_signalled(plan)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SIGNAL": str(int(signum))})


SIGNAL_TWICE = """
    def twice():
        os.kill(os.getpid(), int(os.environ["SIGNAL"]))
        time.sleep(0.3)  # as the command ends
        os.kill(os.getpid(), int(os.environ["SIGNAL"]))

    def plan(*args, **kwargs):
        threading.Thread(target=twice).start()
        time.sleep(60)
"""


@pytest.mark.parametrize("signum, said", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "stopped by SIGTERM")])
def test_a_second_signal_as_the_command_stops_changes_nothing(signum, said):
    """A terminal's Ctrl-C reaches a wrapper such as ``timeout`` too, which passes it on: a second
    signal a moment after the first broke off the stop with a traceback."""
    done = _run_signalled(SIGNAL_TWICE, signum)
    assert (done.returncode, done.stderr) == (128 + signum, f"{said}\n")


SIGNAL_IN_A_FINALIZER = """
    class Dropped:
        def __del__(self):
            os.kill(os.getpid(), int(os.environ["SIGNAL"]))
            time.sleep(0.2)  # the stop's handler runs here, where Python drops what it raises

    def plan(*args, **kwargs):
        Dropped()
        time.sleep(5)
        print("ran on")
        return 0
"""


@pytest.mark.parametrize("signum, said", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "stopped by SIGTERM")])
def test_a_signal_that_lands_in_a_finalizer_still_stops_the_command(signum, said):
    """A stop raised inside a ``__del__`` is dropped by Python, with a traceback: the command ran on
    to status 0, ignoring every later stop signal."""
    done = _run_signalled(SIGNAL_IN_A_FINALIZER, signum)
    assert (done.returncode, done.stdout, done.stderr) == (128 + signum, "", f"{said}\n")


@pytest.mark.parametrize("statuses, line", [
    ({0: -signal.SIGKILL, 1: -signal.SIGTERM},
     "rank 0 (killed by SIGKILL: out of memory, or kill -9); the launcher then stopped the rest"),
    ({0: 1, 1: -signal.SIGTERM}, "rank 0 (exit 1); the launcher then stopped the rest; any message it gave is above"),
    ({0: -signal.SIGSEGV, 1: 1}, "rank 0 (killed by SIGSEGV), rank 1 (exit 1); any message it gave is above"),
    ({0: 130, 1: -signal.SIGTERM}, "rank 0 (stopped by SIGINT, exit 130); the launcher then stopped the rest"),
    # the agent records first the worker it found ended, then those it stopped
    ({1: -signal.SIGTERM, 0: -signal.SIGTERM}, "rank 1 (ended by SIGTERM, sent from outside the run); the launcher "
                                               "then stopped the rest"),
    ({0: -signal.SIGTERM}, "rank 0 (ended by SIGTERM, sent from outside the run)"),
    # a worker whose collective failed when its peer was killed: the kill's consequence
    ({0: -signal.SIGKILL, 1: COLLECTIVE_FAILED}, "rank 0 (killed by SIGKILL: out of memory, or kill -9)"),
    # found first, a collective that failed: the ranks the launcher then stopped (a stopped one ignores
    # SIGTERM, and is killed) hold the one that hung
    ({0: COLLECTIVE_FAILED, 1: -signal.SIGKILL, 2: COLLECTIVE_FAILED},
     "a collective failed on ranks 0, 2 (said above); the launcher then stopped rank 1, whose collectives had not "
     "failed: a rank that hung or lost its link is among them"),
    ({0: COLLECTIVE_FAILED, 1: -signal.SIGTERM}, "a collective failed on rank 0 (said above); the launcher then "
     "stopped rank 1, whose collectives had not failed: a rank that hung or lost its link is among them"),
])
def test_workers_that_failed_are_named_with_how_they_ended(statuses, line, capsys):
    """A worker killed by a signal says nothing itself: the line names the signal, and says a message
    is above only where a worker that failed could write one; the ranks the launcher stopped once one
    failed are not the failure."""
    from types import SimpleNamespace

    from shardwire.launch import failed_workers
    failed = SimpleNamespace(failures={rank: SimpleNamespace(exitcode=code) for rank, code in statuses.items()})
    assert failed_workers(failed, ours=True) == 1
    assert capsys.readouterr().err == f"error: worker processes failed: {line}\n"


def test_another_programs_exit_3_is_its_own(capsys):
    """``testbed run`` of a script: its workers' exit 3 is theirs, not a collective that failed, and
    is named as it is."""
    from types import SimpleNamespace

    from shardwire.launch import failed_workers
    statuses = {0: COLLECTIVE_FAILED, 1: -signal.SIGTERM}
    failed = SimpleNamespace(failures={rank: SimpleNamespace(exitcode=code) for rank, code in statuses.items()})
    assert failed_workers(failed, ours=False) == 1
    assert capsys.readouterr().err == ("error: worker processes failed: rank 0 (exit 3); the launcher then stopped "
                                       "the rest; any message it gave is above\n")


def _log_failures(said, statuses: dict[int, int]) -> None:
    """Each failure as the agent logs the first it finds each time it looks."""
    for rank, code in statuses.items():
        said.filter(logging.LogRecord("agent", logging.ERROR, __file__, 0, "failed (exitcode: %s) local_rank: %s",
                                      (code, rank), None))


def test_a_collective_that_failed_is_restarted_and_a_refusal_is_not():
    """The agent logs the first failure it finds, and restarts unless it is a refusal: a hung peer
    made the others' collective fail, which ended the run as a refusal, never restarted. (A worker
    whose collective failed waits for its launcher before it ends: a refusal that made it fail is
    found first.)"""
    from shardwire.launch import _AgentLog
    said = _AgentLog(ours=True)
    _log_failures(said, {1: COLLECTIVE_FAILED})
    assert not said.refused
    said.restarting()
    _log_failures(said, {0: REFUSED})
    assert said.refused


def test_a_refusal_beside_a_collective_that_failed_ends_the_job_as_one(capsys):
    from types import SimpleNamespace

    from shardwire.launch import failed_workers
    statuses = {1: COLLECTIVE_FAILED, 0: REFUSED}
    failed = SimpleNamespace(failures={rank: SimpleNamespace(exitcode=code) for rank, code in statuses.items()})
    assert failed_workers(failed, ours=True) == REFUSED and capsys.readouterr().err == ""  # its own line said it
