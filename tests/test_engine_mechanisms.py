"""Each engine mechanism, observed on real gloo ranks: what is gathered, when, and how much."""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

import shardwire
from harness import run_workers
from shardwire.comm.communicator import Pending
from shardwire.comm.errors import CollectiveError, ScheduleMismatchError
from shardwire.engine.shard import engine_of
from shardwire.models.gpt import GPT, PRESETS, Block, loss_fn

pytestmark = pytest.mark.slow

SIX_LAYERS = dataclasses.replace(PRESETS["tiny"], layers=6)
BLOCKS = [f"blocks.{i}" for i in range(6)]


def tokens(rank, step, cfg=SIX_LAYERS, batch=2):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)


def train_step(model, opt, rank, step):
    batch = tokens(rank, step, model.config)
    loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def sharded_gpt(cfg=SIX_LAYERS, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = shardwire.shard(GPT(cfg), units=[Block], **kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


# ------------------------------------------------------------------------ 1. flat buffers, views


def flat_buffers(rank, world):
    torch.manual_seed(0)
    reference = GPT(SIX_LAYERS)
    model = shardwire.shard(copy.deepcopy(reference), units=[Block])
    owned = dict(model.named_parameters())
    expected = dict(reference.named_parameters())  # the tied head once, as torch lists it
    assert list(owned) == list(expected)
    assert all(owned[name].shape == param.shape for name, param in expected.items())
    flats = engine_of(model).flats

    def rows(params):  # each parameter's rows of a rank, padded as DTensor's Shard(0) splits them
        return sum(-(-p.shape[0] // world) * p[0].numel() for p in params)

    assert flats[1].shard.numel() == rows(reference.blocks[0].parameters())
    # the tied head is stored once: the root holds the two embeddings and the final norm
    root = [reference.tok_emb.weight, reference.pos_emb.weight, reference.norm.weight, reference.norm.bias]
    assert flats[0].shard.numel() == rows(root)
    for flat in flats:  # each parameter a DTensor over this rank's rows, a view of the unit's shard
        for _, param, held in flat.held_parts():
            assert param.to_local().numel() == held.numel and param.placements == (Shard(0),)
            assert param.to_local().data_ptr() == flat.shard[held.at:].data_ptr()

    seen = {}

    def inspect(block, args):
        assert [name for name, _ in block.named_parameters()] == [
            name for name, _ in reference.blocks[2].named_parameters()]
        views = [block.norm1.weight, block.attn.qkv.weight, block.mlp.up.weight, block.mlp.down.bias]
        seen["storages"] = {v.untyped_storage().data_ptr() for v in views}
        seen["tied"] = model.head.weight is model.tok_emb.weight

    model.blocks[2].register_forward_pre_hook(inspect)
    batch = tokens(rank, 0)
    model(batch[:, :-1]).sum().backward()
    assert len(seen["storages"]) == 1, "all of a unit's parameters must be views of one buffer"
    assert seen["tied"]
    assert model.blocks[2].mlp.up.weight.device.type == "meta", "released parameters must not alias memory"
    return True


def test_units_are_shards_of_padded_rows_and_parameters_are_dtensors_over_one_buffer():
    run_workers(3, flat_buffers)


# --------------------------------------------------------- 2, 4. collectives per unit and step


def collective_counts(rank, world, reshard, prefetch):
    model, opt = sharded_gpt(reshard_after_forward=reshard, prefetch=prefetch)
    train_step(model, opt, rank, 0)  # the recording step
    counts = {}
    with engine_of(model).comm.record() as records:
        for step in (1, 2):
            train_step(model, opt, rank, step)
        with shardwire.no_sync(model):
            batch = tokens(rank, 3)
            loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
    for r in records:
        counts[(r.tag, r.op)] = counts.get((r.tag, r.op), 0) + 1
    return counts


@pytest.mark.parametrize("reshard, prefetch", [(True, 2), (True, 0), (True, 3), (False, 2)])
def test_one_collective_per_unit_per_use(reshard, prefetch):
    counts = run_workers(2, collective_counts, reshard, prefetch)[0]
    # two synchronised steps plus one no_sync step (whose forward and backward gather, never reduce)
    # and each forward compares the collectives of the step before across ranks
    expected = {("<root>", "all_gather"): 3, ("<root>", "reduce_scatter"): 2, ("order check", "all_gather"): 3}
    for block in BLOCKS:
        expected[(block, "all_gather")] = 3 * (2 if reshard else 1)
        expected[(block, "reduce_scatter")] = 2
    # backward opens with the last max(1, prefetch) blocks: they stay gathered from their forward
    for block in BLOCKS[len(BLOCKS) - max(1, prefetch):]:
        expected[(block, "all_gather")] = 3
    assert counts == expected


# ------------------------------------------------------------ 3. prefetch window, memory bound


def window_trace(rank, world, prefetch):
    model, opt = sharded_gpt(prefetch=prefetch)
    engine = engine_of(model)
    train_step(model, opt, rank, 0)
    events, peak = [], [0]

    def sample(_record=None):
        # a unit is gathered while its gathered buffer, or its copy in parameter order, has storage
        # (``FlatParam.free`` resizes both to 0)
        blocks = [u for u in engine.units if any(t.untyped_storage().nbytes() for f in u.flats
                                                 for t in (f._gathered, f._by_param))]
        peak[0] = max(peak[0], len(blocks))

    def on_issue(record):
        events.append(("gather", record.tag) if record.op == "all_gather" else ("reduce", record.tag))
        sample()

    def on_start(block, args):
        events.append(("run", f"blocks.{list(model.blocks).index(block)}"))
        sample()

    for block in model.blocks:
        block.register_forward_pre_hook(on_start)
    with engine.comm.record(on_issue=on_issue):
        for step in (1, 2):
            events.clear()
            train_step(model, opt, rank, step)
    return peak[0], events


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
def test_prefetch_is_a_sliding_window_bounded_by_prefetch_plus_one(prefetch):
    peak, events = run_workers(2, window_trace, prefetch)[0]
    assert peak == min(prefetch + 1, len(BLOCKS)), "the window must be used, and never exceeded"
    forward = events[: events.index(("run", BLOCKS[-1])) + 1]
    block_gathers = [tag for kind, tag in forward if kind == "gather" and tag in BLOCKS]
    assert block_gathers == BLOCKS, "forward gathers each block once, in order"
    # Sliding: after the first `prefetch` blocks were issued up front, exactly one more gather is
    # issued as each block starts (a block-and-flush limiter would issue them in bursts).
    if prefetch:
        for k in range(len(BLOCKS) - prefetch):
            run_k = forward.index(("run", BLOCKS[k]))
            assert forward[run_k - 1] == ("gather", BLOCKS[k + prefetch])


# ---------------------------------------------------- 3. order changes and diverging ranks


class ReorderableGPT(GPT):
    """A GPT whose blocks run in ``self.order``: a model whose execution order can change."""

    order: list[int] | None = None

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1])
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for i in self.order or range(len(self.blocks)):
            x = self.blocks[i](x)
        return self.head(self.norm(x))


def reorder_run(rank, world):
    torch.manual_seed(0)
    base = ReorderableGPT(SIX_LAYERS)
    reference = copy.deepcopy(base)
    model = shardwire.shard(copy.deepcopy(base), units=[Block], prefetch=2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    orders = [None, None, [5, 4, 3, 2, 1, 0], [5, 4, 3, 2, 1, 0], [0, 2, 4], None]
    worst = 0.0
    for step, order in enumerate(orders):
        model.order = reference.order = order
        global_batch = torch.cat([tokens(r, step) for r in range(world)])
        ref_loss = loss_fn(reference(global_batch[:, :-1]), global_batch[:, 1:])
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = train_step(model, opt, rank, step).detach()
        dist.all_reduce(loss)
        worst = max(worst, abs(loss.item() / world - ref_loss.item()) / ref_loss.item())
    recorded = [u.name for u in engine_of(model)._order["forward"]]
    return worst, recorded


def test_a_changed_order_is_recorded_again_and_training_stays_exact():
    worst, recorded = run_workers(2, reorder_run)[0]
    assert worst < 1e-5
    assert recorded == BLOCKS  # the last step ran the natural order again


def diverging_ranks(rank, world):
    torch.manual_seed(0)
    model = shardwire.shard(ReorderableGPT(SIX_LAYERS), units=[Block])
    model.order = [0, 1, 2, 3, 4, 5] if rank == 0 else [0, 2, 1, 3, 4, 5]
    batch = tokens(rank, 0)
    try:
        model(batch[:, :-1])
    except ScheduleMismatchError as err:
        return str(err)
    return "no error"


def test_ranks_running_different_units_get_an_error_naming_them():
    messages = run_workers(2, diverging_ranks)
    for message in messages:
        assert "rank 0 would forward 'blocks.1'" in message
        assert "rank 1 would forward 'blocks.2'" in message


def diverging_later(rank, world):
    """Rank 1 swaps two blocks in step 3, long after the order was recorded and checked."""
    torch.manual_seed(0)
    model = shardwire.shard(ReorderableGPT(SIX_LAYERS), units=[Block], timeout=30.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = time.monotonic()
    try:
        for step in range(5):
            model.order = [0, 2, 1, 3, 4, 5] if rank == 1 and step == 3 else None
            train_step(model, opt, rank, step)
    except ScheduleMismatchError as err:
        return step, str(err), time.monotonic() - start
    return "no error"


def test_a_rank_leaving_the_order_in_a_later_step_gets_a_schedule_mismatch_error():
    for step, message, elapsed in run_workers(2, diverging_later):
        assert step == 3
        # rank 0 prefetches blocks.3 as planned; rank 1, off the plan, checks with the others first
        assert "rank 0 is running all_gather of 'blocks.3'" in message
        assert "rank 1 is running all_gather of 'unit order check'" in message
        assert elapsed < 30, "raised well within the timeout, not by it"


# -------------------------------------------------------------- 5. asynchronous reduce-scatter


def reduction_trace(rank, world):
    model, opt = sharded_gpt(prefetch=2)
    train_step(model, opt, rank, 0)
    events = []

    def announce_backward(i):
        def hook(module, args, output):
            def on_grad(grad):
                landed = next(model.blocks[i + 1].parameters()).grad is not None if i + 1 < 6 else None
                events.append(("backward", f"blocks.{i}", landed))
            output.register_hook(on_grad)
        return hook

    for i, block in enumerate(model.blocks):
        block.register_forward_hook(announce_backward(i))
    with engine_of(model).comm.record(on_issue=lambda r: events.append((r.op, r.tag, None))):
        train_step(model, opt, rank, 1)
    return events


def test_each_reduce_scatter_starts_when_its_unit_ends_and_overlaps_the_next_backward():
    events = run_workers(2, reduction_trace)[0]
    for k in range(5, 0, -1):
        issued = events.index(("reduce_scatter", f"blocks.{k}", None))
        previous_backward = next(i for i, e in enumerate(events) if e[:2] == ("backward", f"blocks.{k - 1}"))
        assert issued < previous_backward, f"blocks.{k}'s reduce-scatter must start before blocks.{k - 1}'s backward"
        landed = events[previous_backward][2]
        assert landed is False, f"blocks.{k}'s gradient must still be in flight while blocks.{k - 1} computes"


class Gate:
    """A collective's work that completes only once ``inner`` has (None: a collective already done,
    as a group of one's is) and ``opened`` is set, noting in ``shut`` whether it gave up waiting for
    ``opened``."""

    def __init__(self, inner, opened: threading.Event, shut: list):
        self.inner, self.opened, self.shut = inner, opened, shut

    def wait(self, timeout=None):
        if self.inner is not None:
            self.inner.wait(timeout=timeout)
        self.shut.append(not self.opened.wait(timeout=20))


def replication_held_to_the_end(rank, world):
    """Hybrid groups of one rank, whose all-reduces between the groups cannot start until backward
    has passed blocks.1: a backward that waited for one of them would find the gate shut."""
    model, opt = sharded_gpt(layout="hybrid", shard_group_size=1)
    train_step(model, opt, rank, 0)
    across = engine_of(model).layout.replicate
    opened, shut = threading.Event(), []
    all_reduce = across.all_reduce

    def gated(tensor, *, after=None, **kwargs):
        if after is not None:
            after = Pending(across, None, "reduce_scatter", "gate", work=Gate(after._work, opened, shut))
        return all_reduce(tensor, after=after, **kwargs)

    def open_when_backward_reaches(module, args, output):
        output.register_hook(lambda grad: opened.set())

    model.blocks[0].register_forward_hook(open_when_backward_reaches)
    across.all_reduce = gated
    loss = train_step(model, opt, rank, 1)
    return shut, loss.item()


def test_hybrids_all_reduce_between_groups_stays_in_flight_through_backward():
    """Only reduce-scatters, which hold a unit's whole gradient, are bounded in flight: the all-reduce
    of a shard between groups that follows holds only the shard, so backward never waits for one, on
    a link between groups however slow."""
    for shut, loss in run_workers(2, replication_held_to_the_end):
        assert shut and not any(shut), "backward waited for an all-reduce between groups"
        assert math.isfinite(loss)


# ---------------------------------------------------------------------- 6. mixed precision


def mixed_precision_run(rank, world):
    torch.manual_seed(0)
    base = GPT(SIX_LAYERS)
    full = shardwire.shard(copy.deepcopy(base), units=[Block])
    half = shardwire.shard(copy.deepcopy(base), units=[Block], mixed_precision="bf16")
    dtypes = {}
    def note_compute_dtype(block, args):
        dtypes["compute"] = block.mlp.up.weight.dtype

    half.blocks[0].register_forward_pre_hook(note_compute_dtype)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (full, half)]
    losses = {}
    for name, model, opt in (("fp32", full, opts[0]), ("bf16", half, opts[1])):
        with engine_of(model).comm.record() as records:
            losses[name] = [train_step(model, opt, rank, step).item() for step in range(5)]
        dtypes[name + " shards"] = {p.dtype for p in model.parameters()}
        block = next(r for r in records if r.tag == "blocks.0" and r.op == "all_gather")
        reduce = next(r for r in records if r.tag == "blocks.0" and r.op == "reduce_scatter")
        dtypes[name + " bytes"] = (block.nbytes, reduce.nbytes)
    return losses, dtypes


class FeatureModel(torch.nn.Module):
    """A model fed floating-point features (not token ids), returning what its first layer saw."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, features, *, scale):
        seen = (features.dtype, scale.dtype)
        for layer in self.layers:
            features = layer(features) * scale
        return features, seen


def float_inputs(rank, world, cast):
    torch.manual_seed(0)
    policy = shardwire.MixedPrecision(torch.bfloat16, torch.float32, cast_forward_inputs=cast)
    model = shardwire.shard(FeatureModel(), mixed_precision=policy)
    try:
        out, seen = model(torch.randn(4, 8), scale=torch.tensor(0.5))
    except RuntimeError as err:
        return "error", str(err)
    out.float().sum().backward()
    return seen, out.dtype


def test_float_forward_inputs_are_cast_to_the_compute_dtype_unless_the_policy_says_not():
    seen, dtype = run_workers(2, float_inputs, True)[0]
    assert seen == (torch.bfloat16, torch.bfloat16) and dtype == torch.bfloat16
    outcome, message = run_workers(1, float_inputs, False)[0]
    assert outcome == "error" and "dtype" in message  # fp32 features meet bf16 weights


def test_bf16_computes_in_bf16_gathers_half_the_bytes_and_keeps_fp32_masters():
    losses, dtypes = run_workers(2, mixed_precision_run)[0]
    assert dtypes["compute"] == torch.bfloat16
    assert dtypes["bf16 shards"] == {torch.float32}
    gather32, reduce32 = dtypes["fp32 bytes"]
    gather16, reduce16 = dtypes["bf16 bytes"]
    assert gather16 * 2 == gather32 and reduce16 == reduce32  # bf16 gathers, fp32 reduce-scatters
    for a, b in zip(losses["fp32"], losses["bf16"]):
        assert abs(a - b) / a < 2e-2


# ------------------------------------------------------------------ 8. activation checkpointing


def checkpointing_run(rank, world):
    results = {}
    for checkpointing in (False, True):
        model, opt = sharded_gpt(activation_checkpointing=checkpointing)
        calls = [0]
        model.blocks[3].mlp.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))
        losses = [train_step(model, opt, rank, step).item() for step in range(3)]
        results[checkpointing] = (losses, shardwire.full_state_dict(model), calls[0])
    return results


def test_activation_checkpointing_recomputes_and_changes_nothing_else():
    results = run_workers(2, checkpointing_run)[0]
    (plain_losses, plain_state, plain_calls), (ckpt_losses, ckpt_state, ckpt_calls) = results[False], results[True]
    assert plain_calls == 3 and ckpt_calls == 6  # every forward of a checkpointed unit runs again in backward
    assert plain_losses == ckpt_losses
    assert all(torch.equal(plain_state[k], ckpt_state[k]) for k in plain_state)


# ------------------------------------------------------------------------------- bad input


def stuck_peer(rank, world):
    model, opt = sharded_gpt(timeout=2.0)
    train_step(model, opt, rank, 0)
    if rank == 1:
        time.sleep(8)  # never joins the second step
        return "slept"
    start = time.monotonic()
    try:
        train_step(model, opt, rank, 1)
    except CollectiveError as err:
        return str(err), time.monotonic() - start
    return "no error"


def test_a_stuck_collective_becomes_an_error_naming_rank_and_unit():
    message, elapsed = run_workers(2, stuck_peer)[0]
    # the first collective of the second step: the comparison of the first step's collectives
    assert message.startswith("rank 0: all_gather of 'order check'")
    assert "did not complete within 2s" in message
    assert elapsed < 6


def different_models(rank, world, field):
    cfg = dataclasses.replace(SIX_LAYERS, **({field: 64 if field == "hidden" else 5} if rank == 1 else {}))
    try:
        shardwire.shard(GPT(cfg), units=[Block])
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("field, detail", [
    ("hidden", "rank 1's model differs from rank 0's: unit '<root>' has different parameter names or shapes"),
    ("layers", "rank 0's model has 6 units and rank 1's has 5: pass the same units on every rank, and build the same "
               "model"),
])
def test_ranks_with_different_models_are_refused(field, detail):
    for message in run_workers(2, different_models, field):
        assert detail in message


def test_a_collectives_failure_says_what_the_library_said_without_its_source_location():
    from shardwire.comm.errors import without_source_locations
    said = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
            "15000ms for recv operation to complete")
    assert without_source_locations(said) == "Timed out waiting 15000ms for recv operation to complete"
    assert without_source_locations("rank [1] of [a.py:3]") == "rank [1] of [a.py:3]"  # only a C++ source's
