"""Measurements shared by the benchmarks: peak resident memory, bytes on a network interface, a
step's time on the slowest rank, worker launching, and ``shardwire train`` jobs whose losses the
quality benchmarks compare. All of them observe the processes from outside the systems being
compared, so every system is measured the same way."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading


def net_bytes(interface: str = "lo") -> int:
    """Bytes received so far on ``interface`` of this network namespace (each byte sent between two
    local processes is received exactly once)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == interface:
                return int(counters.split()[0])
    raise ValueError(f"no network interface {interface!r} in /proc/net/dev")


class PeakRSS:
    """Samples this process's resident memory in a background thread; ``peak`` is the most seen."""

    def __init__(self, interval_s: float = 0.002):
        self._interval = interval_s
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.peak = self.current()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def current(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self.current())

    def __enter__(self) -> "PeakRSS":
        self.peak = self.current()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.current())


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


# glibc keeps freed memory for reuse once big blocks have been freed (its mmap threshold grows), so
# resident memory stops following live tensors. Memory passes pin the threshold: every allocation of
# 64 KiB or more is mapped on its own and returned to the system when freed.
MEMORY_PASS_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def slowest_rank_seconds(fn) -> float:
    """Run ``fn()`` on every rank, started together after a barrier; the slowest rank's seconds."""
    import time

    import torch
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def job_parser(description: str, *, model: str, batch: int) -> argparse.ArgumentParser:
    """The options of a benchmark that runs itself as a torchrun job (``run_torchrun``): the hidden
    ones its workers get, the number of ranks, the GPT preset and the sequences per rank."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--model", default=model)
    parser.add_argument("--batch", type=int, default=batch)
    return parser


def run_torchrun(nproc: int, script: str, args: list[str], *, threads: int, env: dict | None = None,
                 launcher: list[str] | None = None) -> dict:
    """Run ``script --worker ...`` on ``nproc`` local ranks and return the JSON its rank 0 wrote.

    ``launcher`` replaces the local torchrun (the emulated cluster passes its own)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), **(env or {}))
        cmd = launcher or [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        subprocess.run([*cmd, script, "--worker", "--out", out, *args], check=True, env=env)
        with open(out) as f:
            return json.load(f)


_STEP = re.compile(r"^step\s+(\d+)/\d+ .*?loss ([\d.]+)(?:.*?val ([\d.]+))?")
_DONE = re.compile(r"^done: .*validation loss ([\d.]+)")


def train_on_nodes(nodes: int, ranks: int, train_args: list[str], *, what: str) -> str:
    """Run ``shardwire train TRAIN_ARGS`` as ``nodes`` torchrun launchers of ``ranks`` ranks each, on
    this machine (each launcher a node to torchrun, meeting on a free local port; one intra-op thread
    a rank), and return the first node's output. ``what`` names the run in the error if any fails."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(ranks),
             "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
             "-m", "shardwire", "train", *train_args],
            stdout=subprocess.PIPE if node == 0 else subprocess.DEVNULL, text=True, env=env)
        for node in range(nodes)
    ]
    output, _ = launchers[0].communicate()
    if any(launcher.wait() != 0 for launcher in launchers):
        raise RuntimeError(f"the run {what} failed:\n{output[-2000:]}")
    return output


def losses(output: str) -> tuple[dict[int, float], dict[int, float], float | None]:
    """From ``shardwire train``'s output: the training loss and the validation loss of each progress
    line, by step, and the final validation loss of its ``done`` line (None without one)."""
    train_loss, val_loss, final = {}, {}, None
    for line in output.splitlines():
        if match := _STEP.match(line):
            train_loss[int(match.group(1))] = float(match.group(2))
            if match.group(3):
                val_loss[int(match.group(1))] = float(match.group(3))
        elif match := _DONE.match(line):
            final = float(match.group(1))
    return train_loss, val_loss, final


def write_report(out_dir: str, stem: str, record: dict, text: str, plot) -> None:
    """``record`` as ``stem.json``, the table ``text`` as ``stem.md`` and ``plot(path)``'s figure as
    ``stem.png`` in ``out_dir``; then print the table."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(record, f, indent=1)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(text + "\n")
    plot(os.path.join(out_dir, f"{stem}.png"))
    print(text)
