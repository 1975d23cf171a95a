"""What the model's own parameters cost the optimizer: one step over the per-parameter DTensors a
sharded model exposes against one step over one plain tensor per flat buffer (the same memory),
beside the whole training step, in one job.

    python benchmarks/optimizer_step.py --world 2 --model 30m --batch 2 --repeats 15

Each rank shards the GPT and runs a training step to make gradients. Then, ``--repeats`` times in
turn, it times ``AdamW.step()`` with PyTorch's default implementation for CPU tensors (a loop over
tensors), with ``foreach=True`` and with ``fused=True``, once over ``model.parameters()`` (each
parameter a DTensor over this rank's rows in its unit's shard, every operation dispatched through
DTensor) and once over one leaf per flat buffer viewing the same shard (what an optimizer held
before parameters kept their names), and a whole training step (forward, backward, clipping, fused
AdamW). A time is the slowest rank's; figures are medians.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measure import job_parser, median, run_torchrun, slowest_rank_seconds  # noqa: E402
from systems import TrainingStep  # noqa: E402

IMPLEMENTATIONS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import shardwire
    from shardwire.engine.shard import engine_of
    from shardwire.models.gpt import GPT, PRESETS, Block, loss_fn

    dist.init_process_group("gloo")
    config = PRESETS[args.model]
    torch.manual_seed(0)
    model = shardwire.shard(GPT(config), units=[Block])
    per_parameter = list(model.parameters())
    per_buffer = [nn.Parameter(flat.shard) for flat in engine_of(model).flats]  # the same storage
    train_step = TrainingStep("shardwire", model, config, args.batch)

    for _ in range(2):
        train_step()
    gen = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, config.vocab_size, (args.batch, config.seq_len + 1), generator=gen)
    loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    for param in per_buffer:
        param.grad = torch.randn_like(param) * 1e-3
    optimizers = {
        (layout, name): torch.optim.AdamW(params, lr=1e-9, **kwargs)  # updates too small to matter
        for layout, params in (("per parameter", per_parameter), ("per buffer", per_buffer))
        for name, kwargs in IMPLEMENTATIONS.items()
    }
    for optimizer in optimizers.values():
        optimizer.step()  # creates its state
    times: dict[str, list[float]] = {"training step": []}
    for _ in range(args.repeats):
        for (layout, name), optimizer in optimizers.items():
            times.setdefault(f"{layout}|{name}", []).append(slowest_rank_seconds(optimizer.step))
        grads = [p.grad for p in per_parameter]
        times["training step"].append(slowest_rank_seconds(train_step))
        for param, grad in zip(per_parameter, grads):
            param.grad = grad
    if dist.get_rank() == 0:
        counts = {"per parameter": len(per_parameter), "per buffer": len(per_buffer)}
        with open(args.out, "w") as f:
            json.dump({"times": times, "tensors": counts}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = job_parser(__doc__.split("\n\n")[0], model="30m", batch=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="also write the raw times here")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    passthrough = ["--model", args.model, "--batch", str(args.batch), "--repeats", str(args.repeats)]
    result = run_torchrun(args.world, __file__, passthrough, threads=max(1, (os.cpu_count() or 1) // args.world))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    times, counts = result["times"], result["tensors"]
    step = median(times["training step"])
    print(f"GPT {args.model!r}, {args.world} ranks, {args.batch} sequences per rank, {args.repeats} repeats; "
          f"training step (median): {step * 1e3:.0f} ms")
    print(f"| AdamW | per parameter ({counts['per parameter']} tensors) | per buffer ({counts['per buffer']} "
          f"tensors) | difference, share of the training step |")
    print("|---|---|---|---|")
    for name in IMPLEMENTATIONS:
        mine, theirs = median(times[f"per parameter|{name}"]), median(times[f"per buffer|{name}"])
        print(f"| {name} | {mine * 1e3:.1f} ms | {theirs * 1e3:.1f} ms | {(mine - theirs) / step:+.2%} |")


if __name__ == "__main__":
    main()
