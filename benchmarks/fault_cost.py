"""What losing a node costs: fault-tolerant groups (``--fault-tolerance``) against torchrun restarting
the whole job from its last checkpoint, on the same DiLoCo run.

    python benchmarks/fault_cost.py --out benchmarks/results/fault-cost/results.json
    shardwire testbed up --nodes 3 --link 100mbit   # as root: or on three emulated nodes
    python benchmarks/fault_cost.py --testbed shardwire --out benchmarks/results/fault-cost/testbed.json

Three groups of one rank train ``--steps`` steps of the ``tiny`` GPT with DiLoCo every ``--every``
steps, on this machine (loopback between them) or a node each of a testbed, each run once without a
fault and once with the worker of the last group killed (``kill -9``) once the job has passed
``--kill-at`` steps; on a testbed, the fault-tolerant groups also once with the last node's link
cut for ``--cut`` seconds after ``--cut-at`` steps:

* ``fault-tolerant``: three ``shardwire train`` jobs meeting at a torchft lighthouse, each with
  ``--max-restarts 1``: the other two train on, and the killed one's restart rejoins with their state;
* ``restart``: one ``shardwire train --nproc 3 --layout hybrid --shard-group-size 1`` job (on a
  testbed, ``shardwire testbed run`` of it) with ``--max-restarts 1`` and a checkpoint every
  ``--save-every`` steps: torchrun restarts every worker, and the job resumes from the newest
  checkpoint.

The time a failure costs is the faulted run's wall time less the same run's without a fault (each
run's time from its start to the last group's exit), and the loss is the final validation loss (of
the global model, on batches that do not depend on the group or seed).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse runs in this process
from torchft.coordination import LighthouseServer  # noqa: E402

from shardwire.testbed import network, spec  # noqa: E402

SHARDWIRE = [sys.executable, "-m", "shardwire"]
HEARTBEAT_MS, JOIN_MS = 2000, 60_000  # the lighthouse's timeouts
LIGHTHOUSE_PORT = 29510  # torchft_lighthouse's


def workers(pattern: str) -> list[int]:
    """The training processes (torchrun's workers run ``python -u -m shardwire train``) whose command
    line matches ``pattern``, oldest first."""
    found = subprocess.run(["pgrep", "-f", f"python.* -u -m shardwire train.*{pattern}"], capture_output=True, text=True)
    return sorted(int(pid) for pid in found.stdout.split())


def last_step(log: pathlib.Path) -> int:
    try:
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, json.JSONDecodeError):
        return 0


def kill(pattern: str):
    """The fault that kills the newest worker whose command line matches ``pattern``."""
    return lambda: os.kill(workers(pattern)[-1], signal.SIGKILL)


def cut(testbed: spec.Testbed, node: int, seconds: float):
    """The fault that cuts ``node``'s link; it returns when and how to connect it again."""
    def fault():
        network.set_link(testbed, node, up=False)
        return time.monotonic() + seconds, lambda: network.set_link(testbed, node, up=True)
    return fault


def run(jobs: list[tuple[list[str], pathlib.Path]], fault_at: int | None, fault) -> dict:
    """Start ``jobs`` ((command, jsonl log) each), call ``fault()`` once the first job's log passes
    ``fault_at`` (and what it returns, ``(when, undo)``, at that time); returns the wall time and each
    job's final validation loss."""
    env = {**os.environ, "RUST_LOG": "warn", "OMP_NUM_THREADS": "1"}
    outputs = [log.with_suffix(".out") for _, log in jobs]
    start = time.monotonic()
    launchers = [subprocess.Popen([*command, "--log-jsonl", str(log)],
                                  stdout=out.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
                 for (command, log), out in zip(jobs, outputs)]
    faulted_at, undo = None, None
    try:
        while any(launcher.poll() is None for launcher in launchers):
            if fault_at is not None and faulted_at is None and last_step(jobs[0][1]) >= fault_at:
                undo = fault()
                faulted_at = last_step(jobs[0][1])
            if undo is not None and time.monotonic() >= undo[0]:
                undo[1]()
                undo = None
            time.sleep(0.1)
    finally:
        if undo is not None:
            undo[1]()
    wall = time.monotonic() - start
    losses = []
    for launcher, out in zip(launchers, outputs):
        text = out.read_text()
        if launcher.returncode != 0:
            raise SystemExit(f"a job failed (exit {launcher.returncode}):\n{text[-3000:]}")
        losses.append(float(re.findall(r"validation loss (\S+)", text)[-1]))
    return {"wall_s": wall, "validation_losses": losses, "fault_after_step": faulted_at}


class Lighthouse:
    """A torchft lighthouse: in this process, or on the testbed's first node (whose nodes reach
    nothing outside it)."""

    def __init__(self, testbed: spec.Testbed | None, log: pathlib.Path):
        if testbed is None:
            self.server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=JOIN_MS,
                                           heartbeat_timeout_ms=HEARTBEAT_MS)
            self.address = self.server.address()
        else:
            self.server = subprocess.Popen(
                [*SHARDWIRE, "testbed", "exec", "--name", testbed.name, "node0", "--", "torchft_lighthouse",
                 "--min_replicas", "1", "--join_timeout_ms", str(JOIN_MS), "--heartbeat_timeout_ms", str(HEARTBEAT_MS)],
                stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": "warn"})
            self.address = f"{testbed.namespace(0)}:{LIGHTHOUSE_PORT}"
            time.sleep(1)
            if self.server.poll() is not None:  # another holds the port
                raise SystemExit(f"the lighthouse on node0 did not start:\n{log.read_text()[-2000:]}")

    def close(self) -> None:
        if isinstance(self.server, subprocess.Popen):
            self.server.kill()
            self.server.wait()
        else:
            self.server.shutdown()


def fault_tolerant(testbed: spec.Testbed | None, common: list[str], logs: pathlib.Path, fault_at, fault) -> dict:
    """Three ``shardwire train`` jobs with ``--fault-tolerance``, on a node each of ``testbed`` (named
    after it) or here (named a, b, c)."""
    lighthouse = Lighthouse(testbed, logs / "lighthouse.out")
    try:
        jobs = []
        for k, name in enumerate("abc"):
            settings = f"lighthouse={lighthouse.address},timeout=10"
            on_node = [*SHARDWIRE, "testbed", "exec", "--name", testbed.name, f"node{k}", "--"] if testbed else []
            if testbed is None:
                settings += f",group={name}"
            jobs.append(([*on_node, *SHARDWIRE, "train", *common, "--nproc", "1", "--fault-tolerance", settings],
                         logs / f"{name}.jsonl"))
        return run(jobs, fault_at, fault)
    finally:
        lighthouse.close()


def restart(testbed: spec.Testbed | None, common: list[str], logs: pathlib.Path, save_every: int, fault_at, fault):
    """One job of three ranks, a DiLoCo group each, that torchrun restarts from its last checkpoint."""
    train = ["train", *common, "--shard-group-size", "1", "--checkpoint-dir", str(logs / "checkpoints"),
             "--save-every", str(save_every)]
    if testbed is None:
        command = [*SHARDWIRE, *train, "--nproc", "3"]
    else:
        command = [*SHARDWIRE, "testbed", "run", "--name", testbed.name, "--max-restarts", "1", "--",
                   "-m", "shardwire", *train]
    return run([(command, logs / "job.jsonl")], fault_at, fault)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=700)
    parser.add_argument("--save-every", type=int, default=200)
    parser.add_argument("--testbed", help="run on this testbed's three nodes (`shardwire testbed up --nodes 3`)")
    parser.add_argument("--cut", type=float, default=60.0, help="seconds a node's link is down (on a testbed)")
    parser.add_argument("--cut-at", type=int, default=400,
                        help="the step after which the link is cut: early enough for the others not to finish "
                             "while it is down")
    parser.add_argument("--methods", default="fault-tolerant,restart", help="which ways to run, comma-separated")
    parser.add_argument("--logs", type=pathlib.Path, help="keep each run's output here (default: discarded)")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    options = parser.parse_args()
    testbed = None
    if options.testbed is not None:
        testbed = spec.Testbed.load(options.testbed)
        if testbed.nodes != 3:
            raise SystemExit(f"{testbed.describe()}: give a testbed of 3 nodes")
    common = ["--model", "tiny", "--steps", str(options.steps), "--log-every", "5", "--layout", "hybrid",
              "--diloco", f"sync_every={options.every}", "--max-restarts", "1"]
    results = {"settings": {key: str(value) if isinstance(value, pathlib.Path) else value
                            for key, value in vars(options).items()},
               "regime": testbed.describe() if testbed else "this machine, loopback", "runs": {}}
    # the first job's log is the one watched; the last group's worker is the one killed
    ft_victim = f"group={testbed.namespace(2) if testbed else 'c'},"
    faults = {"no fault": (None, None), "killed": (options.kill_at, kill(ft_victim))}
    if testbed is not None:
        faults["link cut"] = (options.cut_at, cut(testbed, 2, options.cut))
    methods = options.methods.split(",")
    with tempfile.TemporaryDirectory() as scratch:
        kept = options.logs or pathlib.Path(scratch)
        if "fault-tolerant" in methods:
            for name, (fault_at, fault) in faults.items():
                logs = kept / f"ft-{name.replace(' ', '-')}"
                logs.mkdir(parents=True)
                results["runs"][f"fault-tolerant, {name}"] = fault_tolerant(testbed, common, logs, fault_at, fault)
                print(json.dumps(results["runs"], indent=1), flush=True)
        if "restart" in methods:
            for name, fault in (("no fault", None), ("killed", kill("--shard-group-size 1"))):
                logs = kept / f"restart-{name.replace(' ', '-')}"
                logs.mkdir(parents=True)
                results["runs"][f"restart, {name}"] = restart(testbed, common, logs, options.save_every,
                                                              fault and options.kill_at, fault)
                print(json.dumps(results["runs"], indent=1), flush=True)
    runs = results["runs"]
    for run_name in [name for name in runs if not name.endswith("no fault")]:
        method = run_name.split(",")[0]
        clean, faulted = runs[f"{method}, no fault"], runs[run_name]
        results[f"{run_name}: time lost to the failure (s)"] = faulted["wall_s"] - clean["wall_s"]
        results[f"{run_name}: validation loss against no fault (%)"] = 100 * (
            max(faulted["validation_losses"]) / max(clean["validation_losses"]) - 1)
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({key: value for key, value in results.items() if ":" in key}, indent=1))


if __name__ == "__main__":
    main()
