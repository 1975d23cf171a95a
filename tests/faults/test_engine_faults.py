"""The engine refuses what it cannot run correctly, with an error that says what to do, instead of
training wrong or failing deep inside autograd."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import shardwire
from harness import run_workers
from shardwire.models.gpt import GPT, PRESETS, Block, loss_fn

TINY = dataclasses.replace(PRESETS["tiny"], layers=2)


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (2, TINY.seq_len + 1), generator=torch.Generator().manual_seed(seed))


def test_sharding_part_of_a_sharded_model_is_refused():
    model = shardwire.shard(GPT(TINY), units=[Block])
    with pytest.raises(ValueError, match="this Block is part of a model that is already sharded"):
        shardwire.shard(model.blocks[0])
    with pytest.raises(ValueError, match="this model is already sharded"):
        shardwire.shard(model)


def different_values(rank, world):
    torch.manual_seed(rank)  # every rank builds the same model with its own random values
    model = shardwire.shard(GPT(TINY), units=[Block])
    return shardwire.full_state_dict(model)  # rank 0's half of each buffer beside rank 1's


@pytest.mark.slow
def test_every_rank_starts_from_rank_0s_values():
    full = run_workers(2, different_values)[0]
    torch.manual_seed(0)
    for name, value in GPT(TINY).state_dict().items():
        assert torch.equal(full[name], value), name


class Opaque:
    """A result type torch's pytree does not know."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class StructuredBlock(torch.nn.Module):
    """A linear layer whose output comes wrapped: ``wrap(hidden)``."""

    def __init__(self, wrap):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.wrap = wrap

    def forward(self, x):
        return self.wrap(self.linear(x))


class StructuredModel(torch.nn.Module):
    """Two such blocks, each block's output turned back into a tensor by ``unwrap``."""

    def __init__(self, wrap, unwrap):
        super().__init__()
        self.blocks = torch.nn.ModuleList([StructuredBlock(wrap), StructuredBlock(wrap)])
        self.unwrap = unwrap

    def forward(self, x):
        for block in self.blocks:
            x = self.unwrap(block(x))
        return x


def test_a_unit_output_that_cannot_be_looked_into_is_refused_naming_the_unit():
    model = shardwire.shard(StructuredModel(Opaque, lambda out: out.tensor))
    with pytest.raises(TypeError, match="unit 'blocks.0' returned a Opaque, which shardwire cannot look into"):
        model(torch.randn(2, 4))
    with torch.no_grad():  # nothing needs a gradient: nothing to look for
        assert model(torch.randn(2, 4)).shape == (2, 4)


def test_namedtuple_and_dataclass_like_outputs_are_walked():
    from collections import namedtuple

    Out = namedtuple("Out", ["hidden", "aux"])

    def wrap(hidden):
        return Out(hidden, {"scale": 2.0, "extra": [hidden * 2]})

    model = shardwire.shard(StructuredModel(wrap, lambda out: out.hidden + out.aux["extra"][0]))
    model(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_backward_through_a_replaced_forward_is_a_clear_error():
    model = shardwire.shard(GPT(TINY), units=[Block])
    first, second = tokens(0), tokens(1)
    loss1 = loss_fn(model(first[:, :-1]), first[:, 1:])
    loss2 = loss_fn(model(second[:, :-1]), second[:, 1:])
    with pytest.raises(RuntimeError, match="a forward of this sharded model that a later forward replaced"):
        (loss1 + loss2).backward()
    # the model still trains afterwards
    loss = loss_fn(model(first[:, :-1]), first[:, 1:])
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
