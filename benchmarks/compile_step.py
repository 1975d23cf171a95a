"""What compiling the units gains: a training step's time with ``shard(compile=True)`` and without.

    python benchmarks/compile_step.py --world 2 --model small --batch 8 --warmup 3 --steps 40 \
        --json benchmarks/results/compile_step.json

One torchrun job shards two copies of the GPT, one eager and one with each block compiled, and runs
their training steps in turn (eager, compiled, eager, ...): ``--warmup`` pairs, then ``--steps``
timed pairs, so drift on a shared machine falls on both alike. A step is the benchmarks'
``TrainingStep`` (forward, backward, clipping, AdamW); its time is the slowest rank's; figures are
medians and interquartile ranges, and the speed-up is also taken pair by pair (the median of each
pair's compiled / eager), which cancels the load that the two steps of a pair share. The first step
of each is reported on its own: the compiled model's includes compiling, from an empty inductor cache.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measure import job_parser, median, run_torchrun, slowest_rank_seconds  # noqa: E402
from systems import TrainingStep  # noqa: E402

RUNS = {"eager": False, "compiled": True}


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import shardwire
    from shardwire.models.gpt import GPT, PRESETS, Block

    dist.init_process_group("gloo")
    config = PRESETS[args.model]
    steps = {}
    for name, compiled in RUNS.items():
        torch.manual_seed(0)
        model = shardwire.shard(GPT(config), units=[Block], compile=compiled)
        steps[name] = TrainingStep("shardwire", model, config, args.batch)
    times: dict[str, list[float]] = {name: [] for name in RUNS}
    first = {name: slowest_rank_seconds(step) for name, step in steps.items()}
    for _ in range(args.warmup - 1):
        for step in steps.values():
            step()
    for _ in range(args.steps):
        for name, step in steps.items():
            times[name].append(slowest_rank_seconds(step))
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"times": times, "first step": first}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = job_parser(__doc__.split("\n\n")[0], model="small", batch=8)
    parser.add_argument("--warmup", type=int, default=3, help="steps of each before the timed ones; the first compiles")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", help="also write the raw times here")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the first step compiles")
    passthrough = ["--model", args.model, "--batch", str(args.batch), "--warmup", str(args.warmup),
                   "--steps", str(args.steps)]
    with tempfile.TemporaryDirectory() as cache:
        result = run_torchrun(args.world, __file__, passthrough, threads=max(1, (os.cpu_count() or 1) // args.world),
                              env={"TORCHINDUCTOR_CACHE_DIR": cache})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    times, first = result["times"], result["first step"]
    print(f"GPT {args.model!r}, {args.world} ranks, {args.batch} sequences per rank, {args.steps} steps each, "
          f"alternating, after {args.warmup} warm-up steps")
    print("| units | step time (median) | interquartile range | first step |")
    print("|---|---|---|---|")
    for name in RUNS:
        low, _, high = statistics.quantiles(times[name], n=4)
        print(f"| {name} | {median(times[name]) * 1e3:.1f} ms | {low * 1e3:.0f}-{high * 1e3:.0f} ms | "
              f"{first[name]:.1f} s |")
    pairs = [compiled / eager for eager, compiled in zip(times["eager"], times["compiled"])]
    print(f"compiled / eager: {median(times['compiled']) / median(times['eager']):.3f} (medians), "
          f"{median(pairs):.3f} (median of the pairs)")


if __name__ == "__main__":
    main()
