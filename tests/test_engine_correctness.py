"""Sharded training must match unsharded training on the concatenated batch, step for step."""

from __future__ import annotations

import contextlib
import copy
import itertools

import pytest
import torch
import torch.distributed as dist

import shardwire
from harness import CheckpointedGPT, run_workers
from shardwire.models.gpt import GPT, PRESETS, Block, loss_fn

STEPS = 10
LOCAL_BATCH = 2
MAX_NORM = 0.5  # below the tiny model's early gradient norms, so clipping really scales
CONFIGS = [
    dict(reshard_after_forward=reshard, prefetch=prefetch, accumulate=accumulate)
    for reshard, prefetch, accumulate in itertools.product([True, False], [1, 3], [False, True])
]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def global_batches(world: int, micro_batches: int, seed: int = 1):
    """Deterministic token batches for all ranks: rank r's rows are [r*B, (r+1)*B)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = PRESETS["tiny"]
    for _ in range(STEPS):
        yield [torch.randint(0, cfg.vocab_size, (world * LOCAL_BATCH, cfg.seq_len + 1), generator=gen)
               for _ in range(micro_batches)]


def adamw(params):
    # eps above the rounding noise of gradients: elements whose true gradient is ~0 would otherwise
    # get Adam updates of full size in a direction set by noise, and any reordering of a sum (a
    # mean over ranks instead of over one batch) flips them. Measured on world 2 with accumulation:
    # eps=1e-8 gives 1.4e-5 relative error on one LayerNorm bias, eps=1e-6 gives 1.6e-6, SGD 6e-7.
    return torch.optim.AdamW(params, lr=3e-3, eps=1e-6)


def train_reference(model, world, micro_batches, make_optimizer=adamw):
    """Single process, whole global batch: the losses of every micro-batch and the final weights."""
    opt = make_optimizer(model.parameters())
    losses = []
    for batch_list in global_batches(world, micro_batches):
        for tokens in batch_list:
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return losses, model.state_dict()


def train_sharded(model, rank, world, micro_batches, accumulate, make_optimizer=adamw):
    opt = make_optimizer(model.parameters())
    losses = []
    rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    for batch_list in global_batches(world, micro_batches):
        for i, tokens in enumerate(batch_list):
            local = tokens[rows]
            defer = accumulate and i < len(batch_list) - 1
            with shardwire.no_sync(model) if defer else contextlib.nullcontext():
                loss = loss_fn(model(local[:, :-1]), local[:, 1:])
                loss.backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        shardwire.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
    return losses, shardwire.full_state_dict(model)


def compare(rank, world, configs):
    """Each config's worst relative error (losses; weights on rank 0) against the reference."""
    torch.manual_seed(0)
    base = GPT(PRESETS["tiny"])
    references = {mb: train_reference(copy.deepcopy(base), world, mb) for mb in (1, 2)}
    worst = {}
    for config in configs:
        micro_batches = 2 if config["accumulate"] else 1
        shard_args = {key: value for key, value in config.items() if key != "accumulate"}
        model = shardwire.shard(copy.deepcopy(base), units=[Block], **shard_args)
        losses, state = train_sharded(model, rank, world, micro_batches, config["accumulate"])
        ref_losses, ref_state = references[micro_batches]
        errors = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
        if rank == 0:
            assert state.keys() == ref_state.keys()
            errors += [relative_error(state[k], ref_state[k]) for k in ref_state]
        worst[str(config)] = max(errors)
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("world, ranks_per_node", [(1, 1), (2, 2), (3, 3), (4, 4), (4, 2)])
def test_matches_single_process_reference(world, ranks_per_node):
    """(4, 2): four ranks placed as two nodes, so collectives take their two-step paths."""
    per_rank = run_workers(world, compare, CONFIGS, timeout=600, env={"LOCAL_WORLD_SIZE": str(ranks_per_node)})
    for rank, worst in enumerate(per_rank):
        for config, error in worst.items():
            assert error <= 1e-5, f"world {world}, rank {rank}, {config}: relative error {error:.2e}"


LAYOUTS = [
    dict(layout=layout, shard_group_size=size, reshard_after_forward=reshard, prefetch=prefetch,
         activation_checkpointing=checkpointing, accumulate=accumulate)
    for layout in ("hybrid", "hybrid_secondary")
    for size in (2, 4)
    for reshard, prefetch, checkpointing, accumulate in [(True, 1, True, True), (True, 3, False, False),
                                                         (False, 0, False, True)]
]


@pytest.mark.slow
def test_every_layout_matches_single_process_reference():
    """World 4 placed as two nodes of two: hybrid layouts in groups of 2 (the nodes) and of 4 (where
    they equal the full layout), with prefetch, no_sync, activation checkpointing and clipping."""
    per_rank = run_workers(4, compare, LAYOUTS, timeout=900, env={"LOCAL_WORLD_SIZE": "2"})
    for rank, worst in enumerate(per_rank):
        for config, error in worst.items():
            assert error <= 1e-5, f"rank {rank}, {config}: relative error {error:.2e}"


def torch_checkpointed(rank, world):
    """Worst relative error of each way an FSDP2 script applies torch's activation checkpointing
    around its blocks, against the unsharded model: inline, and ``checkpoint_wrapper`` applied
    before sharding (torchtitan's), with a frozen parameter in a block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing, checkpoint_wrapper)

    from shardwire.engine.shard import engine_of

    worst = {}
    for way in ("inline", "wrapper"):
        torch.manual_seed(0)
        base = (CheckpointedGPT(PRESETS["tiny"], list, use_reentrant=False) if way == "inline"
                else GPT(PRESETS["tiny"]))
        base.blocks[0].norm1.weight.requires_grad_(False)
        if way == "wrapper":
            apply_activation_checkpointing(base, checkpoint_wrapper_fn=checkpoint_wrapper,
                                           check_fn=lambda module: isinstance(module, Block))
        ref_losses, ref_state = train_reference(copy.deepcopy(base), world, 1)
        model = shardwire.shard(copy.deepcopy(base), units=[Block])
        losses, state = train_sharded(model, rank, world, 1, accumulate=False)
        errors = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)]
        if rank == 0:
            errors += [relative_error(state[key], ref_state[key]) for key in ref_state]
        # a recomputation stops early, raising inside the unit's forward: the forwards after it still
        # release their units, and a second backward through a retained graph recomputes again
        tokens = next(global_batches(world, 1))[0][rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        assert not engine_of(model).units[0].is_gathered, way
        loss.backward(retain_graph=True)
        loss.backward()
        torch.manual_seed(1)
        fresh = GPT(PRESETS["tiny"]).state_dict()  # keyed as checkpoint_wrapper keys the model's own
        model.load_state_dict(fresh)
        loaded = shardwire.full_state_dict(model)
        if rank == 0:
            assert loaded.keys() == ref_state.keys() and all(torch.equal(loaded[key], fresh[key]) for key in fresh)
        worst[way] = max(errors)
    return worst


def test_torch_activation_checkpointing_around_units_trains_as_the_unsharded_model():
    """Its recomputation in backward calls each unit again, with the parameters backward gathered:
    refused before as a unit called outside the model's forward."""
    for rank, worst in enumerate(run_workers(2, torch_checkpointed, timeout=300)):
        for way, error in worst.items():
            assert error <= 1e-5, f"rank {rank}, {way}: relative error {error:.2e}"
