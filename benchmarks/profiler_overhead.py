"""What profiling costs: step time with and without a ``Profiler`` attached, on the same job.

    python benchmarks/profiler_overhead.py --world 2 --model small --batch 8 --blocks 6 --steps 5

One torchrun job alternates blocks of ``--steps`` steps without a profiler and blocks with one
attached (created before the block, closed after it, so "off" blocks pay nothing), ``--blocks``
times each, so drift on a shared machine falls on both alike. A step's time is the slowest rank's;
the overhead is the ratio of the medians, minus one. Target: under 3%.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measure import job_parser, median, run_torchrun, slowest_rank_seconds  # noqa: E402
from systems import TrainingStep  # noqa: E402


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import shardwire
    from shardwire.models.gpt import GPT, PRESETS, Block
    from shardwire.profile.flops import flops_per_token
    from shardwire.profile.profiler import Profiler

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    config = PRESETS[args.model]
    torch.manual_seed(0)
    model = shardwire.shard(GPT(config), units=[Block])
    step = TrainingStep("shardwire", model, config, args.batch)
    optimizer = step.optimizer

    def profiled_step(profiler):
        with profiler.step():
            step()

    for _ in range(3):
        step()
    times = {"off": [], "on": []}
    for _ in range(args.blocks):
        times["off"] += [slowest_rank_seconds(step) for _ in range(args.steps)]
        profiler = Profiler(model, optimizer, tokens_per_step=args.batch * config.seq_len * world,
                            flops=flops_per_token(config.spec()), probe_peak=False)
        times["on"] += [slowest_rank_seconds(lambda: profiled_step(profiler)) for _ in range(args.steps)]
        profiler.close()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def main() -> None:
    parser = job_parser(__doc__.split("\n\n")[0], model="small", batch=8)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    passthrough = ["--model", args.model, "--batch", str(args.batch), "--blocks", str(args.blocks),
                   "--steps", str(args.steps)]
    times = run_torchrun(args.world, __file__, passthrough, threads=max(1, (os.cpu_count() or 1) // args.world))
    off, on = median(times["off"]), median(times["on"])
    print(f"GPT {args.model!r}, {args.world} ranks, {args.batch} sequences per rank, "
          f"{len(times['off'])} steps each way")
    print("| profiler | step time (median) |")
    print("|---|---|")
    print(f"| off | {off * 1e3:.1f} ms |")
    print(f"| on | {on * 1e3:.1f} ms |")
    print(f"overhead: {on / off - 1:+.1%}")


if __name__ == "__main__":
    main()
