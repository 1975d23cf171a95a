"""``shardwire testbed run``: a torchrun job across the emulated nodes, one launcher per node.

Each node runs ``torchrun --nnodes N --nproc-per-node R --rdzv-backend c10d --rdzv-endpoint
<node0>:29400 CMD...`` inside its namespace, exactly as a job starts on a real cluster, with gloo
(and NCCL) told to use the node's link. (No ``--node-rank``: the c10d rendezvous numbers the nodes
itself, and torchrun ignores it there with a warning.) torchrun runs in ``shardwire.testbed.node``,
so that a node whose worker failed adds at most one line to the worker's own, not torchrun's
traceback. Their output is streamed with a node prefix. The job ends when every node has finished;
if one node fails, or the user interrupts, the other nodes are stopped (torchrun first, so it can
end its workers; then anything left of the job).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO

from shardwire.launch import NODE_THREADS, REFUSED, rendezvous_options
from shardwire.testbed.network import cut_off, in_namespace, leftovers, links_down
from shardwire.testbed.spec import NODE_INTERFACE, Testbed, TestbedFailure, testbed_command

RDZV_PORT = 29400  # torchrun's default for c10d; every namespace has its own ports
STOP_GRACE_S = 10.0
POLL_S = 0.1
LINKS_POLL_S = 2.0  # how often a running job's links are read, to say one that went down or came up


def node_command(testbed: Testbed, node: int, nproc_per_node: int, command: list[str], job_id: str,
                 max_restarts: int = 0) -> list[str]:
    return in_namespace(testbed.namespace(node), [
        sys.executable, "-m", "shardwire.testbed.node",  # torchrun, ending in one line (node.py)
        *rendezvous_options(testbed.nodes, nproc_per_node, f"{testbed.address(0)}:{RDZV_PORT}", job_id),
        # Said outright, not left to torchrun to infer: which node hosts the rendezvous store, and
        # each node's address for the workers' MASTER_ADDR.
        f"--rdzv-conf=is_host={int(node == 0)}", f"--local-addr={testbed.address(node)}",
        f"--max-restarts={max_restarts}",
        "--", *command,  # the job, read by node.py apart from torchrun's options
    ])


def node_environment(testbed: Testbed, nproc_per_node: int | None = None) -> dict[str, str]:
    """The caller's environment, with collectives bound to the node's link and, unless the user
    chose, compute threads for each rank's share of this machine's cores, which all the nodes share:
    cores / all ranks, or for a command ``exec`` runs on one node (``nproc_per_node`` unknown), the
    node's share, cores / nodes, which the ranks of a shardwire command that starts several (``shardwire
    train --nproc 2``, ``torchrun --nproc-per-node 2 -m shardwire ...``) divide among themselves
    (``shardwire.launch.share_node_threads``: torchrun would give each the whole share).

    A node that took every core for its own would oversubscribe them (a ``shardwire train`` worker
    takes cores / its node's ranks): GNU OpenMP's threads spin at the end of each parallel region
    unless their process's threads outnumber the cores, so each node's threads spun on the cores the
    other nodes computed on, and two fault-tolerant groups' steps on two cores took 3-4 times as long
    (docs/benchmarks/fault-tolerance.md)."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME=NODE_INTERFACE, NCCL_SOCKET_IFNAME=NODE_INTERFACE)
    env.pop(NODE_THREADS, None)
    if "OMP_NUM_THREADS" not in env:
        threads = str(max(1, (os.cpu_count() or 1) // (testbed.nodes * (nproc_per_node or 1))))
        env["OMP_NUM_THREADS"] = threads
        if nproc_per_node is None:
            env[NODE_THREADS] = threads
    return env


def run_job(testbed: Testbed, nproc_per_node: int, command: list[str], *, max_restarts: int = 0,
            out: IO[str] | None = None) -> int:
    """Run ``command`` (torchrun's script and arguments) on every node; returns the job's exit status:
    0, the first failing node's status (128 + N for a node killed by signal N), or 130 when
    interrupted. A worker that fails restarts every node's workers, ``max_restarts`` times at most,
    as torchrun does across a cluster."""
    out = out or sys.stdout
    started = time.time()  # a link cut since is named if the job fails
    job_id = f"{testbed.name}-{os.getpid()}-{time.monotonic_ns()}"
    env = node_environment(testbed, nproc_per_node)
    if max_restarts:  # see launch.launch_local
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    lock = threading.Lock()
    nodes, streams = [], []
    try:
        for k in range(testbed.nodes):
            proc = subprocess.Popen(node_command(testbed, k, nproc_per_node, command, job_id, max_restarts), env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            nodes.append(proc)
            streams.append(threading.Thread(target=_stream, args=(proc.stdout, f"[node{k}] ", out, lock), daemon=True))
            streams[-1].start()
        return _wait(testbed, nodes, out, lock, started, _Links(testbed, restarts=max_restarts > 0))
    except KeyboardInterrupt:
        with lock:
            print("interrupted: stopping the nodes", file=out, flush=True)
        return 130
    finally:
        _stop(nodes)
        for thread in streams:
            thread.join(timeout=STOP_GRACE_S)


def _wait(testbed: Testbed, nodes: list[subprocess.Popen], out: IO[str], lock: threading.Lock, started: float,
          links: _Links) -> int:
    while True:
        links.say_changes(out, lock)
        statuses = [proc.poll() for proc in nodes]
        failed = [(k, status) for k, status in enumerate(statuses) if status not in (None, 0)]
        if failed:
            # a node's refusal before the failures it caused elsewhere (collectives it left), seen in one poll
            k, status = min(failed, key=lambda node: node[1] != REFUSED)
            with lock:
                print(f"node{k} failed (exit {status}){cut_off(testbed, started)}: stopping the other nodes",
                      file=out, flush=True)
            return status if status > 0 else 128 - status
        if all(status == 0 for status in statuses):
            return 0
        time.sleep(POLL_S)


class _Links:
    """Says a node cut off from the switch while the job runs (``testbed link``, or ``ip link`` on its
    switch port: ``links_down``), and connected again: a node cut off leaves the job silent until its
    collectives' deadline (shardwire train's, ten minutes by default), and where the job restarts
    (``restarts``), its rendezvous waits as long again for the node (torch's c10d join timeout)."""

    def __init__(self, testbed: Testbed, *, restarts: bool):
        self._testbed = testbed
        self._restarts = restarts
        self._down: set[int] = set()  # a link down as the job starts is said at the first read
        self._read_at = -math.inf

    def say_changes(self, out: IO[str], lock: threading.Lock) -> None:
        if time.monotonic() - self._read_at < LINKS_POLL_S:
            return
        self._read_at = time.monotonic()
        down = self._read()
        if down is None:
            return
        restart = " and a restart's rendezvous up to 600s more" if self._restarts else ""
        said = [f"node{node}'s link is down: the job waits for it, its collectives until they time out (600s by "
                f"default: shardwire train's --timeout){restart}, unless "
                f"`{testbed_command('link', self._testbed.name, f'node{node}', 'up')}` connects it again"
                for node in sorted(down - self._down)]
        said += [f"node{node}'s link is up again" for node in sorted(self._down - down)]
        self._down = down
        with lock:
            for line in said:
                print(line, file=out, flush=True)

    def _read(self) -> set[int] | None:
        """The nodes cut off now, or None where the links cannot be read (the testbed removed under
        the job: its failure says so)."""
        try:
            return set(links_down(self._testbed))
        except TestbedFailure:
            return None


def _stream(pipe: IO[bytes], prefix: str, out: IO[str], lock: threading.Lock) -> None:
    for line in pipe:
        with lock:
            out.write(prefix + line.decode(errors="replace"))
            out.flush()


def _stop(nodes: list[subprocess.Popen]) -> None:
    """Stop what is still running: torchrun gets SIGTERM and time to end its workers (which run in
    sessions of their own); whatever is left of each node's process tree is then killed."""
    running = [proc for proc in nodes if proc.poll() is None]
    trees = {proc.pid: _descendants(proc.pid) for proc in running}
    for proc in running:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for process in (process for tree in trees.values() for process in tree):
        if _alive(process):
            with contextlib.suppress(ProcessLookupError):
                os.kill(process[0], signal.SIGKILL)


def stop_leftovers(testbed: Testbed) -> list[tuple[int, str]]:
    """Stop what a job or link check that was killed left running on the nodes (``leftovers``), as
    ``run_job`` stops its nodes: SIGTERM, time to end, then whatever is left of their trees is
    killed. Call it holding the testbed (``running``): no live job's processes are among them.
    Returns what was stopped."""
    found = leftovers(testbed.name)
    trees = [((pid, stat[1]), _descendants(pid)) for pid, _ in found if (stat := _stat(pid)) is not None]
    for (pid, _), _ in trees:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(_alive(process) for process, _ in trees):
        time.sleep(POLL_S)
    for process, below in trees:
        for pid, started in [process, *below]:
            if _alive((pid, started)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    return found


def _alive(process: tuple[int, int]) -> bool:
    """Whether the process (pid, start time) still runs: the same process, not one given its pid since."""
    stat = _stat(process[0])
    return stat is not None and stat[1] == process[1]


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a process, from /proc; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # after the command name, which is in parentheses and may hold anything
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[19])


def _descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, start time) of every process below ``pid``, from the parent links in /proc."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))):
            children.setdefault(stat[0], []).append((int(entry), stat[1]))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child[0])
    return found
