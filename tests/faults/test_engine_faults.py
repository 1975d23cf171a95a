"""The engine refuses what it cannot run correctly, with an error that says what to do, instead of
training wrong or failing deep inside autograd; what it can run, such as units returning objects it
cannot look into, it trains right."""

from __future__ import annotations

import collections
import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

import shardwire
from harness import run_workers
from shardwire.engine.shard import engine_of
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


# ----------------------------------------------------- units returning anything train right


@dataclasses.dataclass
class Hidden:
    """A dataclass, which torch's pytree does not look into."""

    state: torch.Tensor
    extra: dict


class Opaque:
    """A plain object."""

    def __init__(self, state: torch.Tensor):
        self.state = state


Pair = collections.namedtuple("Pair", ["state", "scale"])

# How a unit wraps its output, and how the next one unwraps it: where the engine sees the tensors (a
# namedtuple, a dict) and where it does not (a dataclass, a plain object).
WRAPS = {
    "dataclass": (lambda h: Hidden(h, {"twice": 2 * h}), lambda out: out.state + out.extra["twice"]),
    "object": (Opaque, lambda out: out.state),
    "namedtuple": (lambda h: Pair(h, 2.0), lambda out: out.state * out.scale),
    "dict": (lambda h: {"state": h, "steps": 1}, lambda out: out["state"]),
}
HIDDEN = {"dataclass", "object"}


class StructuredBlock(torch.nn.Module):
    def __init__(self, wrap):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.wrap = wrap

    def forward(self, x):
        return self.wrap(torch.tanh(self.linear(x)))


class StructuredModel(torch.nn.Module):
    """An input layer (the root unit's), then three blocks whose outputs come wrapped; the model
    unwraps each for the next and returns the last one as it comes."""

    def __init__(self, kind: str):
        super().__init__()
        wrap, self.unwrap = WRAPS[kind]
        self.embed = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList([StructuredBlock(wrap) for _ in range(3)])

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks[:-1]:
            x = self.unwrap(block(x))
        return self.blocks[-1](x)


def fit(model, batches, rows) -> torch.Tensor:
    """SGD on the ``rows`` of each batch; each step's loss."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses = []
    for x, target in batches:
        loss = torch.nn.functional.mse_loss(model.unwrap(model(x[rows])), target[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def structured_parity(rank, world):
    """Each kind of output trained sharded on this rank's half of each batch and unsharded on all of
    it, also with activation checkpointing and with a frozen middle block: (case, whether each unit was
    still gathered after its forward, worst loss and weight differences) on rank 0."""
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 4, generator=gen), torch.randn(4, 8, generator=gen)) for _ in range(3)]
    rows = slice(rank * 2, rank * 2 + 2)
    cases = [(kind, {}) for kind in WRAPS]
    cases += [("object", {"activation_checkpointing": True}), ("dataclass", {"frozen": True})]
    results = []
    for kind, options in cases:
        torch.manual_seed(0)
        base = StructuredModel(kind)
        if options.get("frozen"):
            base.blocks[1].requires_grad_(False)
        reference = copy.deepcopy(base)
        checkpointing = options.get("activation_checkpointing", False)
        model = shardwire.shard(copy.deepcopy(base), activation_checkpointing=checkpointing)
        units = engine_of(model).units
        kept = []
        for unit in units:  # after the engine's post-forward
            unit.module.register_forward_hook(lambda *_, unit=unit: kept.append(unit.is_gathered))
        with torch.no_grad():
            model(batches[0][0][rows])
        assert kept == [False] * 3, "no backward can come: each unit is released after its forward"
        kept.clear()
        expected_losses = fit(reference, batches, slice(None))
        losses = fit(model, batches, rows)
        assert not any(unit.is_gathered for unit in units), "backward released every unit"
        dist.all_reduce(losses, op=dist.ReduceOp.AVG)
        state = shardwire.full_state_dict(model)
        if rank == 0:
            expected = reference.state_dict()
            worst = max((state[k] - expected[k]).abs().max().item() for k in expected)
            results.append((kind, options, kept, (losses - expected_losses).abs().max().item(), worst))
    return results


@pytest.mark.slow
def test_units_returning_any_object_train_like_a_single_process():
    """A unit's output the engine cannot look into is a leaf: its unit stays gathered from forward to
    backward (released after forward where the engine sees every tensor, except, once the first
    backward recorded the order, the last two units, which backward opens with), and training matches."""
    for kind, options, kept, loss_error, weight_error in run_workers(2, structured_parity)[0]:
        case = f"{kind} {options}"
        hidden = kind in HIDDEN
        expected = [hidden] * 3 + [hidden, True, True] * 2  # three steps of three units
        assert kept == expected, f"{case}: each unit after its forward, still gathered: {kept}"
        assert loss_error < 1e-5 and weight_error < 1e-5, f"{case}: loss {loss_error:.1e}, weights {weight_error:.1e}"


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
