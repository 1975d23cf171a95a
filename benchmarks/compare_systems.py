"""shardwire vs PyTorch FSDP2 vs DDP on one GPT, batch and world size: step time, memory, bytes.

    python benchmarks/compare_systems.py --worlds 2 4 --model 30m --batch 2 --steps 10 --repeats 2

Each (system, world) runs in fresh torchrun workers, so memory and network counters belong to that
system alone, and the systems take turns ``--repeats`` times so that drift on a shared machine
falls on all of them alike. Per configuration it reports the median step time over every timed
step of every repeat (a step's time is the slowest rank's), tokens per second, the bytes each rank
received per step over the interface the ranks talk through (``lo`` for local runs), and training
memory: the largest rank's peak resident memory during steps, less its resident memory before the
model was built, measured in a separate pass whose allocator returns freed memory at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measure import MEMORY_PASS_ENV, PeakRSS, median, net_bytes, run_torchrun  # noqa: E402
from systems import SYSTEMS, TrainingStep, wrap  # noqa: E402


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from shardwire.models.gpt import GPT, PRESETS

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    baseline = PeakRSS().current()
    torch.manual_seed(0)
    config = PRESETS[args.model]
    model = wrap(args.system, GPT(config), reshard=args.reshard, prefetch=args.prefetch)
    step = TrainingStep(args.system, model, config, args.batch)

    def slowest(value: float) -> float:
        value = torch.tensor(value, dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value.item()

    if args.measure == "memory":
        with PeakRSS() as rss:  # from the first step on: optimizer state appears there
            for _ in range(args.warmup + 2):
                step()
        result = {"memory_mib": slowest(rss.peak - baseline) / 2**20}
    else:
        for _ in range(args.warmup):
            step()
        times = []
        dist.barrier()
        bytes_before = net_bytes(args.interface)
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(slowest(time.perf_counter() - start))
        dist.barrier()
        received = net_bytes(args.interface) - bytes_before
        result = {
            "step_times_s": times,
            # the counter sees every rank's traffic; barriers and the timing all-reduce add a few KiB
            "bytes_per_step_per_rank": received / args.steps / world,
            "tokens_per_step": args.batch * world * config.seq_len,
        }
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


@dataclasses.dataclass
class Row:
    system: str
    world: int
    step_times: list
    bytes_per_step: float
    tokens_per_step: int
    memory_mib: float = 0.0

    @property
    def median_s(self) -> float:
        return median(self.step_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--measure", choices=["time", "memory"], default="time", help=argparse.SUPPRESS)
    # on one machine the hybrid layouts have a single group: they are full sharding
    parser.add_argument("--systems", nargs="+", default=["shardwire", "fsdp2", "ddp"], choices=SYSTEMS)
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--model", default="30m")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--reshard", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--interface", default="lo")
    parser.add_argument("--json", help="write all measurements here")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    passthrough = ["--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--prefetch", str(args.prefetch), "--interface", args.interface,
                   "--reshard" if args.reshard else "--no-reshard"]
    rows: dict[tuple[str, int], Row] = {}
    for world in args.worlds:
        threads = max(1, (os.cpu_count() or 1) // world)
        for _ in range(args.repeats):
            for system in args.systems:
                result = run_torchrun(world, __file__, ["--system", system, *passthrough], threads=threads)
                row = rows.setdefault((system, world), Row(system, world, [], 0.0, result["tokens_per_step"]))
                row.step_times += result["step_times_s"]
                row.bytes_per_step = max(row.bytes_per_step, result["bytes_per_step_per_rank"])
        for system in args.systems:
            result = run_torchrun(world, __file__, ["--system", system, "--measure", "memory", *passthrough],
                                  threads=threads, env=MEMORY_PASS_ENV)
            rows[(system, world)].memory_mib = result["memory_mib"]
    print(report(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": [dataclasses.asdict(r) | {"median_s": r.median_s}
                                                     for r in rows.values()]}, f, indent=1)


def report(rows: dict, args) -> str:
    lines = [
        f"GPT {args.model!r}, {args.batch} sequences per rank, "
        f"{'reshard' if args.reshard else 'keep'} after forward, prefetch {args.prefetch}; "
        f"{args.steps} timed steps x {args.repeats} repeats",
        "",
        "| world | system | step time (median) | tokens/s | vs FSDP2 | training memory / rank | received / rank / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for (system, world), row in sorted(rows.items(), key=lambda kv: (kv[0][1], SYSTEMS.index(kv[0][0]))):
        fsdp2 = rows.get(("fsdp2", world))
        ratio = f"{row.median_s / fsdp2.median_s:.2f}" if fsdp2 else "-"
        lines.append(
            f"| {world} | {system} | {row.median_s * 1e3:.0f} ms | {row.tokens_per_step / row.median_s:,.0f} "
            f"| {ratio} | {row.memory_mib:.0f} MiB | {row.bytes_per_step / 2**20:.1f} MiB |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
