"""fp16 loss scaling on a sharded model: every rank skips, or takes, each step together."""

from __future__ import annotations

import dataclasses

import torch

import shardwire
from harness import run_workers
from shardwire.models.gpt import GPT, PRESETS, Block, loss_fn

TINY = dataclasses.replace(PRESETS["tiny"], layers=2)


def scaled_steps(rank, world):
    torch.manual_seed(0)
    model = shardwire.shard(GPT(TINY), units=[Block], mixed_precision="fp16")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = shardwire.GradScaler(model, init_scale=1024.0)
    outcomes = []
    for step in range(3):
        before = [p.to_local().clone() for p in model.parameters()]
        tokens = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len + 1), generator=torch.Generator().manual_seed(step))
        scaler.scale(loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).float()).backward()
        if step == 1 and rank == 1:
            next(model.parameters()).grad.to_local()[0] = float("inf")  # an overflow in one rank's rows only
        scaler.unscale_(optimizer)
        shardwire.clip_grad_norm_(model, 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        moved = any(not torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))
        outcomes.append((moved, scaler.get_scale()))
    return outcomes


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    per_rank = run_workers(2, scaled_steps)
    assert per_rank[0] == per_rank[1], "ranks must agree on every step and on the scale"
    (took0, scale0), (took1, scale1), (took2, scale2) = per_rank[0]
    assert took0 and took2 and not took1
    assert scale1 == scale0 / 2 and scale2 == scale1
