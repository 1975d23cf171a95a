"""The host's time per training step as one rank of a large world: 8 to 64 ranks on torch's fake process
group, in this one process, on the CPU and, where there is one, on a GPU.

    python benchmarks/large_world.py --worlds 8 16 32 64 --per-node 4 --steps 30 --rounds 5 \
        --json benchmarks/results/large_world.json

A fake group completes each collective at once, here, so a step's time is the host's: the engine's
work, the model's (its kernels run, on the CPU, or launched, on a GPU), and what torch's fake
collectives do, which is to copy this rank's input into every rank's slot, a loop over the world that
a real backend leaves to the network. That last is timed apart and taken out: "host" is a step's time
less the time inside torch's collectives called by the training thread (and CUDA's autograd thread)
and, on the CPU, less the time the training thread waits for the collectives that the
communicator's lanes run beside it (the quantized ones, whose fake collectives run there).

The step is the tests' (``tests/fake_world.py``: a GPT sharded with bf16 compute, fused AdamW,
clipping), run as the last rank, ``--per-node`` ranks to a node so that every world spans nodes. For
each device, layout and wire, each world in turn (in reverse order every other round, so that drift on
a shared machine falls on every world alike): shard, ``--warmup`` steps, then ``--steps`` timed ones.
On CUDA each timed step starts with the GPU idle (synchronized before it, not after), so its time is
the host's issuing it. Figures are medians over the timed steps of every round (the JSON adds the
host time's quartiles); one intra-op thread.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from fake_world import LAYOUTS, TORCH_COLLECTIVES, WIRES, Training, fake_world  # noqa: E402
from shardwire.comm import communicator  # noqa: E402
from shardwire.models.gpt import PRESETS  # noqa: E402


@contextlib.contextmanager
def timed_apart(device: torch.device) -> Iterator[dict[str, float]]:
    """Seconds, since they were last zeroed, spent inside torch's collectives by the threads a step
    waits on (the training thread, CUDA's autograd thread; not the CPU's lanes, which run beside it)
    and, on the CPU, by the training thread waiting for collectives (``Pending.wait``: on a fake
    group, for those a lane runs). On CUDA a wait only orders a stream, and is the engine's host work."""
    spent = {"collectives_s": 0.0, "waits_s": 0.0}

    def timing(key: str, function: Callable) -> Callable:
        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                if not threading.current_thread().name.startswith("shardwire-"):  # a lane
                    spent[key] += time.perf_counter() - start

        return timed

    targets = [(module, name, "collectives_s") for module, name, _ in TORCH_COLLECTIVES]
    if device.type == "cpu":
        targets.append((communicator.Pending, "wait", "waits_s"))
    with contextlib.ExitStack() as stack:
        for owner, name, key in targets:
            stack.enter_context(mock.patch.object(owner, name, timing(key, getattr(owner, name))))
        yield spent


def measure(device: torch.device, world: int, per_node: int, layout: str, wire: str | None, args) -> dict:
    """Seconds of each timed step, of its calls of torch's collectives, and (CPU) of its waits."""
    times: dict[str, list[float]] = {"step_s": [], "collectives_s": [], "waits_s": []}
    with fake_world(world, per_node, world - 1):
        training = Training.start(device, layout, wire, config=PRESETS[args.model], batch=args.batch)
        for _ in range(args.warmup):
            training.step()
        with timed_apart(device) as spent:
            for _ in range(args.steps):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                spent.update(dict.fromkeys(spent, 0.0))
                start = time.perf_counter()
                training.step()
                times["step_s"].append(time.perf_counter() - start)
                for key, seconds in spent.items():
                    times[key].append(seconds)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--per-node", type=int, default=4)
    parser.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--devices", nargs="+", default=["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if any(world % args.per_node or world // args.per_node < 2 for world in args.worlds):
        parser.error(f"every world must be two or more nodes of --per-node {args.per_node} ranks")

    cases = list(itertools.product(args.devices, LAYOUTS, WIRES))
    runs: dict[tuple, dict[str, list[float]]] = {}
    for round_ in range(args.rounds):
        worlds = args.worlds if round_ % 2 == 0 else args.worlds[::-1]
        for (device, layout, wire), world in itertools.product(cases, worlds):
            measured = measure(torch.device(device), world, args.per_node, layout, wire, args)
            run = runs.setdefault((device, layout, wire, world), {key: [] for key in measured})
            for key, values in measured.items():
                run[key].extend(values)

    results = []
    for (device, layout, wire, world), run in runs.items():
        run["host_s"] = [step - inside - waits for step, inside, waits
                         in zip(run["step_s"], run["collectives_s"], run["waits_s"])]
        results.append({"device": device, "layout": layout, "wire": str(wire or "none"), "world": world,
                        "per_node": args.per_node, "steps": len(run["host_s"]),
                        **{key: statistics.median(values) for key, values in run.items()},
                        "host_quartiles_s": statistics.quantiles(run["host_s"], n=4)})
    machine = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
               "gpu": torch.cuda.get_device_name(0) if "cuda" in args.devices else None}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "machine": machine, "results": results}, f, indent=1)

    first, last = args.worlds[0], args.worlds[-1]
    print(f"GPT {args.model!r}, {args.batch} sequences, last rank, {args.per_node} ranks per node; median ms per "
          f"step of {args.steps} x {args.rounds} rounds: host (whole step, inside torch's collectives, "
          f"waiting for the lanes)")
    header = " | ".join(f"{world} ranks" for world in args.worlds)
    print(f"| device | layout | wire | {header} | host {last} / {first} |")
    print("|---|---|---|" + "---|" * (len(args.worlds) + 1))
    by_case = {(r["device"], r["layout"], r["wire"], r["world"]): r for r in results}
    for device, layout, wire in cases:
        row = [by_case[device, layout, str(wire or "none"), world] for world in args.worlds]
        cells = " | ".join(f"{r['host_s'] * 1e3:.2f} ({r['step_s'] * 1e3:.2f}, {r['collectives_s'] * 1e3:.2f}, "
                           f"{r['waits_s'] * 1e3:.2f})" for r in row)
        print(f"| {device} | {layout} | {wire or 'none'} | {cells} | {row[-1]['host_s'] / row[0]['host_s']:.2f} |")


if __name__ == "__main__":
    main()
