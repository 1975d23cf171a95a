"""Sharded models and their optimizers through torch's distributed checkpointing (DCP): ``dcp.save`` and
``dcp.load``, and ``torch.distributed.checkpoint.state_dict``, sharded and whole, at other world sizes
and layouts, to and from FSDP2, and into an unsharded model; every value bit-exact.

Starting ranks takes seconds, so the checkpoints chain through two sets of processes: four ranks in
hybrid groups of two save (shardwire, and FSDP2 after loading shardwire's), three ranks load both and
save again, which loads into an unsharded model; the tests below assert on their parts of the results.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

from harness import run_workers
from shardwire.models.gpt import PRESETS

# ---------------------------------------------------------------- models and their steps

TWO_BLOCKS = dataclasses.replace(PRESETS["tiny"], layers=2)  # each value is gathered in turn: few of them


class OddBlock(nn.Module):
    """Parameters of three, two and one dimensions, and an empty one."""

    def __init__(self):
        super().__init__()
        self.cube = nn.Parameter(torch.randn(3, 4, 5))
        self.empty = nn.Parameter(torch.zeros(0, 4))
        self.lin = nn.Linear(5, 5)

    def forward(self, x):
        return self.lin(x) + 0.1 * torch.einsum("ijk,bk->b", self.cube, x)[:, None] + self.empty.sum()


class Odd(nn.Module):
    """A 0-dim parameter in the root unit, and blocks of ``OddBlock``."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.blocks = nn.ModuleList([OddBlock() for _ in range(2)])

    def forward(self, x):
        x = x * self.scale
        for block in self.blocks:
            x = block(x)
        return x


def built(kind: str, seed: int, **options):
    """A sharded model of ``kind`` ("gpt" or "odd") and an AdamW, registered nowhere."""
    import shardwire
    from shardwire.models.gpt import GPT, Block

    torch.manual_seed(seed)
    module, unit = (GPT(TWO_BLOCKS), Block) if kind == "gpt" else (Odd(), OddBlock)
    model = shardwire.shard(module, units=[unit], **options)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, optimizer, rank: int, world: int, steps: int) -> None:
    """``steps`` steps on each rank's two rows of a global batch."""
    from shardwire.models.gpt import loss_fn

    generator = torch.Generator().manual_seed(world)
    rows = slice(2 * rank, 2 * rank + 2)
    for _ in range(steps):
        if isinstance(model, Odd):
            model(torch.randn(2 * world, 5, generator=generator)[rows]).square().mean().backward()
        else:
            tokens = torch.randint(0, 256, (2 * world, 17), generator=generator)[rows]
            loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()


def whole(model, optimizer) -> tuple[dict, dict]:
    """The model's and the optimizer's full state dicts, gathered by torch, as they are now (torch
    gathers DTensors into new tensors and gives plain ones, such as Adam's step, as they are)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return copy.deepcopy(get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True)))


def save(model, optimizer, path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def load(model, optimizer, path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


def same(a, b) -> bool:
    """Equal, bit for bit, with tuples and lists alike (torch's state-dict functions turn one into
    the other)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def refusal(call) -> str:
    try:
        call()
    except (ValueError, RuntimeError) as err:
        return str(err)
    return "accepted"


# ------------------------------------------------------------- four ranks in hybrid groups of two


def fsdp2(world: int, seed: int):
    """The GPT under FSDP2 on gloo, its blocks sharded as shardwire's units, and an AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from shardwire.models.gpt import GPT

    torch.manual_seed(seed)
    model = GPT(TWO_BLOCKS)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _in_hybrid_groups(rank, world, root):
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    from torch.distributed.tensor import DTensor

    import shardwire
    from shardwire.models.gpt import GPT, MLP

    hybrid = {"layout": "hybrid", "shard_group_size": 2}
    out = {}
    model, optimizer = built("gpt", 0, **hybrid)
    train(model, optimizer, rank, world, 2)
    save(model, optimizer, f"{root}/gpt4")
    out["gpt"] = whole(model, optimizer)
    gathered = shardwire.full_state_dict(model)  # on rank 0
    out["gathered by shardwire"] = rank != 0 or same(out["gpt"][0], gathered)
    value = model.state_dict()["blocks.0.attn.qkv.weight"]
    param = dict(model.named_parameters())["blocks.0.attn.qkv.weight"]
    moment = optimizer.state[param]["exp_avg"]
    out["value"] = [(type(t) is DTensor, tuple(t.shape), tuple(t.to_local().shape), tuple(map(str, t.placements)))
                    for t in (value, param, moment)]

    # whole state dicts back in (set_state_dict with full_state_dict=True) after another step, and the
    # checkpoint into a new model of the same layout
    train(model, optimizer, rank, world, 1)
    whole_model, whole_optimizer = copy.deepcopy(out["gpt"])  # torch distributes the values in place
    set_state_dict(model, optimizer, model_state_dict=whole_model, optim_state_dict=whole_optimizer,
                   options=StateDictOptions(full_state_dict=True))
    out["whole back in"] = same(whole(model, optimizer), out["gpt"])
    again, again_optimizer = built("gpt", 1, **hybrid)
    load(again, again_optimizer, f"{root}/gpt4")
    out["same layout"] = same(whole(again, again_optimizer), out["gpt"])

    odd, odd_optimizer = built("odd", 0, **hybrid)
    train(odd, odd_optimizer, rank, world, 2)
    save(odd, odd_optimizer, f"{root}/odd4")
    out["odd"] = whole(odd, odd_optimizer)

    # FSDP2 loads shardwire's checkpoint, takes a step, and saves its own
    theirs, their_optimizer = fsdp2(world, seed=3)
    load(theirs, their_optimizer, f"{root}/gpt4")
    out["fsdp2 loads shardwire's"] = same(whole(theirs, their_optimizer), out["gpt"])
    train(theirs, their_optimizer, rank, world, 1)
    save(theirs, their_optimizer, f"{root}/fsdp2")
    out["fsdp2"] = whole(theirs, their_optimizer)

    torch.manual_seed(7)
    other = shardwire.shard(GPT(TWO_BLOCKS), units=[MLP])  # its MLPs are its units, over all ranks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shardwire.register_optimizer(model, optimizer)
    out["registration"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    out["refusals"] = {
        "other layout": refusal(lambda: other.load_state_dict(model.state_dict())),
        "fsdp2 values": refusal(lambda: model.load_state_dict(theirs.state_dict())),
    }
    dcp.save({"model": other.state_dict()}, checkpoint_id=f"{root}/units")
    out["units"] = shardwire.full_state_dict(other)
    return out


@pytest.fixture(scope="module")
def in_hybrid_groups(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    return root, run_workers(4, _in_hybrid_groups, str(root))


@pytest.mark.slow
def test_parameters_gradients_and_optimizer_state_are_dtensors_as_fsdp2_places_them(in_hybrid_groups):
    """In hybrid groups of two: whole shape, half the rows on every rank, replicated across groups (the
    gradients' placement is the engine tests')."""
    for out in in_hybrid_groups[1]:
        assert out["value"] == [(True, (96, 32), (48, 32), ("R", "S(0)"))] * 3


@pytest.mark.slow
def test_torch_gathers_what_shardwire_gathers_and_sets_it_back(in_hybrid_groups):
    results = in_hybrid_groups[1]
    for out in results:
        assert out["gathered by shardwire"] and out["whole back in"] and out["same layout"]
        assert same(out["gpt"], results[0]["gpt"])
    model, optimizer = results[0]["gpt"]
    assert len(optimizer["state"]) == len(model) - 1  # every parameter, the tied one once
    assert all(set(state) == {"step", "exp_avg", "exp_avg_sq"} for state in optimizer["state"].values())


@pytest.mark.slow
def test_fsdp2_loads_a_shardwire_checkpoint(in_hybrid_groups):
    assert all(out["fsdp2 loads shardwire's"] for out in in_hybrid_groups[1])


@pytest.mark.slow
def test_a_checkpoint_holds_every_element_once(in_hybrid_groups):
    """The issue's loss: every rank's part saved as if replicated, one kept. Each tensor's chunks now
    cover it exactly, the groups' copies once (DCP refuses overlaps and gaps too)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    root, results = in_hybrid_groups
    saved = FileSystemReader(root / "gpt4").read_metadata().state_dict_metadata
    model, optimizer = results[0]["gpt"]
    values = {**{f"model.{k}": v for k, v in model.items()},
              **{f"optim.state.{k}.{n}": v for k, state in optimizer["state"].items() for n, v in state.items()}}
    for name, value in values.items():
        chunks = saved[name]
        assert isinstance(chunks, TensorStorageMetadata) and chunks.size == value.shape
        assert sum(math.prod(chunk.sizes) for chunk in chunks.chunks) == value.numel(), name


@pytest.mark.slow
def test_what_load_state_dict_cannot_reshard_is_refused_naming_dcp(in_hybrid_groups):
    refusals = in_hybrid_groups[1][0]["refusals"]
    assert "torch.distributed.checkpoint.load" in refusals["other layout"]
    assert "DTensor placed (Shard(dim=0),)" in refusals["fsdp2 values"]


@pytest.mark.slow
def test_register_optimizer_is_no_longer_needed_and_says_so(in_hybrid_groups):
    (warning,) = in_hybrid_groups[1][0]["registration"]
    assert warning.startswith("FutureWarning: shardwire.register_optimizer is no longer needed")


# ------------------------------------------------------------------ three ranks, all sharded


def _at_three_ranks(rank, world, root, odd_whole):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    import shardwire

    out = {}
    model, optimizer = built("gpt", 1)
    load(model, optimizer, f"{root}/gpt4")
    out["gpt"] = whole(model, optimizer)
    train(model, optimizer, rank, world, 1)
    save(model, optimizer, f"{root}/gpt3")
    out["trained"] = whole(model, optimizer)

    model, optimizer = built("gpt", 2)
    load(model, optimizer, f"{root}/fsdp2")
    out["fsdp2"] = whole(model, optimizer)

    odd, odd_optimizer = built("odd", 1)
    load(odd, odd_optimizer, f"{root}/odd4")
    out["odd"] = whole(odd, odd_optimizer)
    odd, odd_optimizer = built("odd", 2)
    set_state_dict(odd, odd_optimizer, model_state_dict=odd_whole[0], optim_state_dict=odd_whole[1],
                   options=StateDictOptions(full_state_dict=True))
    out["odd whole"] = whole(odd, odd_optimizer)

    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    theirs, _ = fsdp2(world, 7)
    model, _ = built("gpt", 8)
    model.load_state_dict(theirs.state_dict())  # FSDP2's DTensors of these rows, on a mesh of its own
    out["fsdp2's state dict"] = (shardwire.full_state_dict(model),
                                 get_model_state_dict(theirs, options=StateDictOptions(full_state_dict=True)))

    model, _ = built("gpt", 5)  # its blocks are its units
    state = model.state_dict()
    dcp.load({"model": state}, checkpoint_id=f"{root}/units")
    model.load_state_dict(state)
    out["units"] = shardwire.full_state_dict(model)
    return out


@pytest.fixture(scope="module")
def at_three_ranks(in_hybrid_groups):
    root, four = in_hybrid_groups
    return root, four[0], run_workers(3, _at_three_ranks, str(root), four[0]["odd"])


@pytest.mark.slow
def test_three_ranks_load_what_hybrid_groups_saved(at_three_ranks):
    _, four, three = at_three_ranks
    for out in three:
        assert same(out["gpt"], four["gpt"])
        assert same(out["odd"], four["odd"]) and same(out["odd whole"], four["odd"])


@pytest.mark.slow
def test_shardwire_loads_an_fsdp2_checkpoint(at_three_ranks):
    _, four, three = at_three_ranks
    assert all(same(out["fsdp2"], four["fsdp2"]) for out in three)


@pytest.mark.slow
def test_fsdp2s_own_state_dict_loads_where_its_rows_are_the_models(at_three_ranks):
    """FSDP2's ``state_dict()``: DTensors placed as the model's, on a mesh of the same ranks that
    names no dimension; refused before as placed otherwise."""
    _, _, three = at_three_ranks
    loaded, fsdp2_whole = three[0]["fsdp2's state dict"]
    assert same(loaded, fsdp2_whole)


@pytest.mark.slow
def test_parts_cut_another_way_load_through_dcp(at_three_ranks):
    """What ``load_state_dict`` refuses (parts of another layout), DCP reshards: a checkpoint of the GPT
    sharded by its MLPs over four ranks loads into one sharded by its blocks over three."""
    _, four, three = at_three_ranks
    assert same(three[0]["units"], four["units"])


@pytest.mark.slow
def test_a_checkpoint_loads_into_an_unsharded_model(at_three_ranks, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from shardwire.models.gpt import GPT

    root, _, three = at_three_ranks
    dcp_to_torch_save(root / "gpt3", tmp_path / "model.pt")
    unsharded = GPT(TWO_BLOCKS)
    unsharded.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True)["model"])
    assert same(unsharded.state_dict(), three[0]["trained"][0])


def _round_trip(rank, world, root):
    model, optimizer = built("gpt", seed=0)
    train(model, optimizer, rank, world, steps=2)
    save(model, optimizer, f"{root}/checkpoint")
    other, other_optimizer = built("gpt", seed=1)
    train(other, other_optimizer, rank, world, steps=1)  # state of its own, which loading replaces
    load(other, other_optimizer, f"{root}/checkpoint")
    return same(whole(model, optimizer), whole(other, other_optimizer))


@pytest.mark.slow
def test_a_model_and_its_optimizer_come_back_from_dcp_as_saved(tmp_path):
    assert run_workers(2, _round_trip, str(tmp_path)) == [True, True]
