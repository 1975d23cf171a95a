"""Changes to a sharded model that the engine could not honour are refused with an error that names the
parameter and says what to do, instead of being silently ignored; a second backward through a retained
graph trains as torch does; ranks that ask for different mixed precision are told so before any
collective could mismatch."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from torch import nn

import shardwire
from harness import run_workers
from shardwire.engine.shard import engine_of
from shardwire.models.gpt import GPT, PRESETS, Block, loss_fn

TINY = dataclasses.replace(PRESETS["tiny"], layers=2)


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (4, TINY.seq_len + 1), generator=torch.Generator().manual_seed(seed))


def sharded_gpt(**options) -> nn.Module:
    torch.manual_seed(0)
    return shardwire.shard(GPT(TINY), units=[Block], **options)


def step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
    loss.backward()
    return loss


# ------------------------------------------------ changes after shard: an error at the next forward


def swap_data(model):
    param = dict(model.named_parameters())["blocks.1.mlp.up.weight"]
    param.data = param.data.clone()


def assign_parameter(model):
    model.blocks[1].mlp.up.weight = nn.Parameter(torch.zeros(128, 32))


def assign_tied_parameter(model):
    model.head.weight = nn.Parameter(torch.zeros(TINY.vocab_size, 32))


def delete_parameter(model):
    del model.blocks[0].attn.proj.bias


CHANGES = {
    "data swapped": (swap_data, r"parameter 'blocks\.1\.mlp\.up\.weight' no longer views its unit's shard: its "
                                r"\.data was replaced after shardwire\.shard.*model\.load_state_dict"),
    "parameter assigned": (assign_parameter, r"parameter 'blocks\.1\.mlp\.up\.weight' was replaced by a new "
                                             r"Parameter after shardwire\.shard: .*Change parameters before "
                                             r"sharding.*model\.load_state_dict"),
    "tied parameter assigned": (assign_tied_parameter, r"parameter 'head\.weight' was replaced by a new Parameter"),
    "parameter deleted": (delete_parameter, r"parameter 'blocks\.0\.attn\.proj\.bias' was deleted after"),
    "double": (nn.Module.double, r"parameter 'tok_emb\.weight' was converted to torch\.float64 after "
                                 r"shardwire\.shard.*convert the model before sharding it.*mixed_precision"),
    "half": (nn.Module.half, r"'tok_emb\.weight' was converted to torch\.float16 after shardwire\.shard"),
    "to(bfloat16)": (lambda model: model.to(torch.bfloat16), r"converted to torch\.bfloat16"),
    "to(meta)": (lambda model: model.to("meta"), r"'tok_emb\.weight' was moved to meta after shardwire\.shard.*"
                                                 r"Move or convert the model before sharding it"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_the_engine_would_ignore_is_an_error_at_the_next_forward(change):
    mutate, message = CHANGES[change]
    model = sharded_gpt()
    step(model, tokens(0))  # a step before, and an optimizer built, as in a training loop
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.step()
    mutate(model)
    with pytest.raises(RuntimeError, match=message) as raised:
        model(tokens(1)[:, :-1])
    assert "\n" not in str(raised.value)


def test_what_the_engine_honours_is_no_error():
    """In-place changes of values (a state dict, copy_ under no_grad) and conversions that change
    nothing (to the model's own dtype and device) train on."""
    model = sharded_gpt()
    model.load_state_dict(GPT(TINY).state_dict())  # whole tensors, each rank cutting its part
    with torch.no_grad():
        next(model.parameters()).mul_(0.5)
    model.float().to("cpu").train().requires_grad_(True)
    for _ in range(2):
        step(model, tokens(0))


# ------------------------------------------ mistakes no collective sees: refused before they train wrong


def test_an_optimizer_built_before_shard_is_refused_at_each_step():
    """It holds the parameters shard replaced, which the model no longer trains: every step would do
    nothing. One that took a step before shard (when it was right) is refused after it."""
    torch.manual_seed(0)
    model = GPT(TINY)
    early = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, tokens(0))
    early.step()  # the unsharded model's own step: right then
    shardwire.shard(model, units=[Block])
    step(model, tokens(0))
    with pytest.raises(ValueError, match=r"this AdamW holds \d+ parameter\(s\) that shardwire\.shard replaced in its "
                                         r"model.*Build the optimizer from model\.parameters\(\) after shardwire\.shard"):
        early.step()
    late = torch.optim.AdamW(model.parameters(), lr=1e-2)
    late.step()
    late.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})  # another model's: no concern of shard's
    late.step()


def test_an_optimizer_given_a_module_attribute_is_refused_and_a_sharded_model_is_not_copied():
    """Between uses a module's attribute is a placeholder of the parameter: an optimizer group built
    from it (``model.norm.bias``, muP-style) would never change the model, and a deep copy would
    share its buffers."""
    model = sharded_gpt()
    named = dict(model.named_parameters())
    others = [param for name, param in named.items() if name != "norm.bias"]
    optimizer = torch.optim.AdamW([{"params": others}, {"params": [model.norm.bias], "lr": 0.1}], lr=1e-2)
    step(model, tokens(0))
    with pytest.raises(ValueError, match=r"this AdamW holds 'norm\.bias' as read from a module's attribute of a "
                                         r"sharded model: a placeholder between forwards.*model\.named_parameters\(\)"):
        optimizer.step()
    with pytest.raises(RuntimeError, match=r"a sharded model cannot be copied \(copy\.deepcopy\)"):
        copy.deepcopy(model)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_what_a_user_set_on_a_parameter_is_carried_to_its_dtensor(device):
    """Optimizer-group builders read marks set on parameters (``_no_weight_decay``): each DTensor that
    replaces a parameter keeps them, as DDP keeps the parameter itself, from a meta build too."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(TINY)
    for param in model.parameters():
        if param.dim() < 2:
            param._no_weight_decay = True
    marked = sum(param.dim() < 2 for param in model.parameters())
    shardwire.shard(model, units=[Block], init=model.init_module if device == "meta" else None)
    assert sum(getattr(param, "_no_weight_decay", False) for param in model.parameters()) == marked > 0


class _Gain(nn.Module):
    """A module whose initialisation assigns its parameter anew and marks the new one."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.empty(4))

    def reset_parameters(self):
        self.gain = nn.Parameter(torch.ones(4, device=self.gain.device))
        self.gain._no_weight_decay = True

    def forward(self, x):
        return x * self.gain


def test_a_mark_set_on_a_parameter_the_initialisation_assigned_anew_is_kept():
    """A mark the initialisation set on the parameter it assigned counts, as on a model built on the CPU."""
    with torch.device("meta"):
        model = _Gain()
    model.gain.infshape = (4,)  # set after the build, as on a model built on the CPU: kept too
    shardwire.shard(model, init=lambda module: module.reset_parameters())
    (gain,) = model.parameters()
    assert gain._no_weight_decay and gain.infshape == (4,) and gain.full_tensor().eq(1).all()


class _Spare(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.spare = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def test_a_parameter_no_backward_reaches_is_reduced_as_zeros_and_said_once():
    """Every rank reduces a unit's whole buffer; one that no rank used gets zeros where torch leaves
    None, which weight decay would move: that is said, once for each parameter."""
    torch.manual_seed(0)
    model = shardwire.shard(_Spare())
    with pytest.warns(UserWarning, match=r"parameter\(s\) 'spare\.weight', 'spare\.bias' got no gradient in a "
                                         r"backward on rank 0: this rank adds zeros to their average"):
        model(torch.randn(2, 4)).sum().backward()
    grads = {name: param.grad.full_tensor() for name, param in model.named_parameters()}
    assert not grads["spare.weight"].any() and grads["used.weight"].any()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        model(torch.randn(2, 4)).sum().backward()


@pytest.mark.parametrize("add, named", [
    (lambda model: model.blocks.__setitem__(1, Block(TINY)), "'blocks.1.norm1.weight'"),
    (lambda model: model.blocks.insert(0, Block(TINY)), "'blocks.0.norm1.weight'"),  # no registration hook sees it
    (lambda model: setattr(model, "pos_emb", nn.Embedding(TINY.seq_len, 32)), "'pos_emb.weight'"),
    (lambda model: (model.blocks[0].add_module("adapter", nn.Sequential()),
                    model.blocks[0].adapter.append(nn.Linear(32, 32))), "'blocks.0.adapter.0.weight'"),
], ids=["block replaced", "block inserted", "root module replaced", "module added inside one added"])
def test_a_module_with_parameters_of_its_own_added_after_shard_is_refused(add, named):
    """Its parameters would be neither gathered nor reduced: each rank would train its own copy."""
    model = sharded_gpt()
    add(model)
    with pytest.raises(RuntimeError, match=rf"parameter\(s\) {named}.* of this sharded GPT came with a module added "
                                           rf"after shardwire\.shard.*Replace or add modules before sharding"):
        step(model, tokens(0))


def test_a_module_without_parameters_added_after_shard_trains_on():
    model = sharded_gpt()
    model.blocks[0].mlp.act = nn.Identity()  # no parameters: every rank computes what it assigns
    step(model, tokens(0))


# ------------------------------------------------------- backward twice through a retained graph


def two_losses(model, batch):
    """Two losses on one forward: autograd runs backward twice through the same graph."""
    logits = model(batch[:, :-1])
    return loss_fn(logits, batch[:, 1:]), logits.float().square().mean()


def backward_twice(model, batch):
    first, second = two_losses(model, batch)
    first.backward(retain_graph=True)
    second.backward()


def assert_same_grads(model, reference):
    """One rank: each parameter's rows are all of it."""
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad.to_local(), expected[name].grad, rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize("options", [{}, {"reshard_after_forward": False}, {"activation_checkpointing": True},
                                     {"prefetch": 0}])
def test_backward_twice_through_a_retained_graph_adds_gradients_as_torch_does(options):
    torch.manual_seed(0)
    reference = GPT(TINY)
    model = shardwire.shard(copy.deepcopy(reference), units=[Block], **options)
    for _ in range(2):  # the first step records the order, the second prefetches along it
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
            backward_twice(m, tokens(0))
        assert_same_grads(model, reference)
    step(model, tokens(1))  # and it trains on


@dataclasses.dataclass
class Carried:
    """A dataclass, which torch's pytree does not look into: the engine cannot see the tensor in it."""

    hidden: torch.Tensor


class HiddenBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return Carried(torch.tanh(self.linear(x)))


class HiddenStack(nn.Module):
    """Blocks whose outputs the engine cannot look into, stay gathered from forward to backward and
    are announced by nothing; a head in the root unit, which backward reaches first."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([HiddenBlock() for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x).hidden
        return self.head(x)


@pytest.mark.parametrize("frozen", [False, True])
def test_backward_twice_reaches_units_with_hidden_outputs_and_frozen_ones(frozen):
    torch.manual_seed(0)
    reference = HiddenStack()
    if frozen:
        reference.blocks[1].requires_grad_(False)
    model = shardwire.shard(copy.deepcopy(reference))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    for m in (model, reference):
        out = m(x)
        out.square().mean().backward(retain_graph=True)
        out.sin().sum().backward()
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert torch.allclose(param.grad.to_local(), expected[name].grad, atol=1e-6), name
    assert not any(unit.is_gathered for unit in engine_of(model).units)


def retained_graph_parity(rank, world, options):
    """Two backward passes through one forward of this rank's half of the batch, then an SGD step, three
    times; the largest difference from an unsharded model doing the same on the whole batch (rank 0)."""
    torch.manual_seed(0)
    reference = GPT(TINY)
    model = shardwire.shard(copy.deepcopy(reference), units=[Block], **options)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference)]
    rows = slice(rank * 2, rank * 2 + 2)
    for seed in range(3):
        for m, optimizer, batch in zip((model, reference), optimizers, (tokens(seed)[rows], tokens(seed))):
            backward_twice(m, batch)
            optimizer.step()
            optimizer.zero_grad()
    state = shardwire.full_state_dict(model)
    if rank == 0:
        return max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"activation_checkpointing": True, "reshard_after_forward": False}])
def test_backward_twice_on_two_ranks_trains_like_one_process(options):
    worst = run_workers(2, retained_graph_parity, options)[0]
    assert worst < 1e-5, worst


# ----------------------------------------------------------------------------- across ranks


def differing_mixed_precision(rank, world):
    """shard with rank 1's mixed precision unlike rank 0's, then a model converted on every rank after
    shard: the errors each rank raises."""
    errors = []
    with pytest.raises(ValueError) as raised:
        sharded_gpt(mixed_precision="bf16" if rank == 0 else None)
    errors.append(str(raised.value))
    model = sharded_gpt(mixed_precision="bf16")
    step(model, tokens(0)[rank * 2: rank * 2 + 2])
    model.double()
    with pytest.raises(RuntimeError) as raised:
        model(tokens(1)[:, :-1])
    errors.append(str(raised.value))
    return errors


def differing_schedules(rank, world):
    """shard with rank 1's prefetch, reshard_after_forward or units unlike rank 0's, and with a
    process group rank 1 is not in: the errors each rank raises (rank 0 is not told of the last)."""
    errors = []
    for options in ({"prefetch": 1 + rank}, {"reshard_after_forward": rank == 0}):
        with pytest.raises(ValueError) as raised:
            sharded_gpt(**options)
        errors.append(str(raised.value))
    with pytest.raises(ValueError) as raised:
        torch.manual_seed(0)
        shardwire.shard(GPT(TINY), units=[Block] if rank == 0 else [Block, nn.Embedding])
    errors.append(str(raised.value))
    alone = torch.distributed.new_group([0])
    if rank == 1:
        with pytest.raises(ValueError) as raised:
            sharded_gpt(process_group=alone)
        errors.append(str(raised.value))
    return errors


@pytest.mark.slow
def test_ranks_with_different_schedules_or_units_are_told_which_asked_for_what():
    for rank, errors in enumerate(run_workers(2, differing_schedules)):
        assert errors[:3] == [
            "ranks asked for different schedules (rank 0: prefetch=1, reshard_after_forward=True; rank 1: prefetch=2, "
            "reshard_after_forward=True): pass the same prefetch and reshard_after_forward on every rank",
            "ranks asked for different schedules (rank 0: prefetch=2, reshard_after_forward=True; rank 1: prefetch=2, "
            "reshard_after_forward=False): pass the same prefetch and reshard_after_forward on every rank",
            "rank 0's model has 2 units and rank 1's has 4: pass the same units on every rank, and build the same "
            "model (same config, same code) before sharding",
        ]
        assert errors[3:] == ([] if rank == 0 else [
            "this rank is not in process_group (torch.distributed.new_group gives the ranks outside a group a "
            "placeholder): call shard only on the group's own ranks"])


class _SmallParameter(nn.Module):
    """A block with a parameter of one row: of two ranks, one holds none of it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bias = nn.Parameter(torch.randn(1))

    def forward(self, x):
        return self.lin(x) + self.bias


def infinity_norm(rank, world):
    torch.manual_seed(0)
    model = shardwire.shard(nn.Sequential(_SmallParameter(), _SmallParameter()), units=[_SmallParameter])
    model(torch.randn(4, 6, generator=torch.Generator().manual_seed(1))).square().sum().backward()
    before = [param.grad.full_tensor() for param in model.parameters()]
    norm = shardwire.clip_grad_norm_(model, 1.0, norm_type=float("inf")).full_tensor().item()
    return norm, before, [param.grad.full_tensor() for param in model.parameters()]


@pytest.mark.slow
def test_the_infinity_norm_counts_ranks_that_hold_none_of_a_parameter():
    """torch's infinity norm has no largest value of no rows, and fails on the rank that holds none."""
    for norm, before, after in run_workers(2, infinity_norm):
        largest = max(grad.abs().max().item() for grad in before)
        assert norm == largest > 1.0
        for old, new in zip(before, after):
            torch.testing.assert_close(new, old / (largest + 1e-6))


@pytest.mark.slow
def test_ranks_with_different_mixed_precision_are_told_which_asked_for_what():
    for precision, converted in run_workers(2, differing_mixed_precision):
        assert precision == (
            "ranks asked for different mixed precision (rank 0: param_dtype=torch.bfloat16, "
            "reduce_dtype=torch.float32; rank 1: param_dtype=None, reduce_dtype=None): pass the same "
            "mixed_precision on every rank"
        )
        assert converted.startswith("parameter 'tok_emb.weight' was converted to torch.float64 after shardwire.shard")


def test_mixed_precision_names_only_dtypes_units_can_compute_and_reduce_in():
    with pytest.raises(ValueError, match=r"MixedPrecision\(param_dtype=torch.int8\) is not a dtype units can "
                                         r"compute in: use one of torch.float32, torch.bfloat16"):
        shardwire.MixedPrecision(torch.int8)
    with pytest.raises(ValueError, match=r"reduce_dtype=torch.float8_e4m3fn\) is not a dtype units can reduce"):
        shardwire.MixedPrecision(torch.bfloat16, torch.float8_e4m3fn)
