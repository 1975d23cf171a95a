"""What losing a node costs: fault-tolerant groups (``--fault-tolerance``) against torchrun restarting
the whole job from its last checkpoint, on the same DiLoCo run.

    python benchmarks/fault_cost.py --out benchmarks/results/fault-cost/results.json

Three groups of one rank train ``--steps`` steps of the ``tiny`` GPT with DiLoCo every ``--every``
steps, on this machine (loopback between them), each run once without a fault and once with the
worker of the last group killed (``kill -9``) once the job has passed ``--kill-at`` steps:

* ``fault-tolerant``: three ``shardwire train`` jobs meeting at a torchft lighthouse, each with
  ``--max-restarts 1``: the other two train on, and the killed one's restart rejoins with their state;
* ``restart``: one ``shardwire train --nproc 3 --layout hybrid --shard-group-size 1`` job with
  ``--max-restarts 1`` and a checkpoint every ``--save-every`` steps: torchrun restarts every worker,
  and the job resumes from the newest checkpoint.

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


def run(jobs: list[tuple[list[str], pathlib.Path]], kill_at: int | None, victim) -> dict:
    """Start ``jobs`` ((arguments, jsonl log) each), kill the process ``victim(launchers)`` names once
    the first job's log passes ``kill_at``; returns the wall time and each job's final validation loss."""
    env = {**os.environ, "RUST_LOG": "warn", "OMP_NUM_THREADS": "1"}
    outputs = [log.with_suffix(".out") for _, log in jobs]
    start = time.monotonic()
    launchers = [subprocess.Popen([sys.executable, "-m", "shardwire", "train", *args, "--log-jsonl", str(log)],
                                  stdout=out.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
                 for (args, log), out in zip(jobs, outputs)]
    killed_at = None
    while any(launcher.poll() is None for launcher in launchers):
        if kill_at is not None and killed_at is None and last_step(jobs[0][1]) >= kill_at:
            os.kill(victim(launchers), signal.SIGKILL)
            killed_at = last_step(jobs[0][1])
        time.sleep(0.1)
    wall = time.monotonic() - start
    losses = []
    for launcher, out in zip(launchers, outputs):
        text = out.read_text()
        if launcher.returncode != 0:
            raise SystemExit(f"a job failed (exit {launcher.returncode}):\n{text[-3000:]}")
        losses.append(float(re.findall(r"validation loss (\S+)", text)[-1]))
    return {"wall_s": wall, "validation_losses": losses, "killed_after_step": killed_at}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=700)
    parser.add_argument("--save-every", type=int, default=200)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    options = parser.parse_args()
    common = ["--model", "tiny", "--steps", str(options.steps), "--log-every", "5", "--layout", "hybrid",
              "--diloco", f"sync_every={options.every}", "--max-restarts", "1"]
    results = {"settings": vars(options) | {"out": str(options.out)}, "runs": {}}
    with tempfile.TemporaryDirectory() as scratch:
        scratch = pathlib.Path(scratch)
        for fault in (False, True):
            lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60_000,
                                          heartbeat_timeout_ms=2000)
            try:
                jobs = [([*common, "--nproc", "1", "--fault-tolerance",
                          f"lighthouse={lighthouse.address()},group={name},timeout=10"],
                         scratch / f"ft-{fault}-{name}.jsonl") for name in ("a", "b", "c")]
                # the first job's log is the one watched; the last group's worker is killed
                results["runs"][f"fault-tolerant, {'killed' if fault else 'no fault'}"] = run(
                    jobs, options.kill_at if fault else None, lambda launchers: workers("group=c,")[0])
            finally:
                lighthouse.shutdown()
            checkpoints = scratch / f"ckpt-{fault}"
            job = ([*common, "--nproc", "3", "--shard-group-size", "1", "--checkpoint-dir", str(checkpoints),
                    "--save-every", str(options.save_every)], scratch / f"restart-{fault}.jsonl")
            results["runs"][f"restart, {'killed' if fault else 'no fault'}"] = run(
                [job], options.kill_at if fault else None, lambda launchers: workers("--shard-group-size 1")[-1])
            print(json.dumps(results["runs"], indent=1), flush=True)
    runs = results["runs"]
    for method in ("fault-tolerant", "restart"):
        clean, faulted = runs[f"{method}, no fault"], runs[f"{method}, killed"]
        results[f"{method}: time lost to the failure (s)"] = faulted["wall_s"] - clean["wall_s"]
        results[f"{method}: validation loss against no fault (%)"] = 100 * (
            max(faulted["validation_losses"]) / max(clean["validation_losses"]) - 1)
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({key: value for key, value in results.items() if ":" in key}, indent=1))


if __name__ == "__main__":
    main()
