"""Quantized collectives: the codec's error bound, error feedback, the wire option's checks, and
collectives that quantize only what crosses nodes, on both transports (the point-to-point one and
torch's collectives, which NCCL runs)."""

from __future__ import annotations

import datetime
import pathlib

import pytest
import torch

import shardwire
from harness import run_workers
from shardwire.comm.quantize import decode, encode
from shardwire.comm.wire import Codec, Wire

TIMEOUT = datetime.timedelta(seconds=60)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [1, 7, 64, 256])
def test_no_element_moves_more_than_half_a_step(bits, block):
    codec = Codec(bits, block)
    generator = torch.Generator().manual_seed(bits * block)
    # rows of very different magnitudes, a zero row, and a length no block divides
    rows = torch.randn(4, 1001, generator=generator) * torch.tensor([[1e-6], [1.0], [1e4], [0.0]])
    packed = encode(codec, rows)
    assert packed.shape == (4, codec.packed_numel(1001)) and packed.dtype == torch.uint8
    decoded = decode(codec, packed, 1001)
    blocks = torch.nn.functional.pad(rows, (0, codec.blocks(1001) * block - 1001)).view(4, -1, block)
    half_step = (blocks.abs().amax(dim=2, keepdim=True) / codec.largest / 2).expand_as(blocks)
    bound = half_step.reshape(4, -1)[:, :1001]
    assert ((rows - decoded).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(decoded[3], rows[3])


def test_bytes_per_element():
    assert Codec(8, 256).packed_numel(512) == 512 + 2 * 4
    assert Codec(4, 256).packed_numel(512) == 256 + 2 * 4
    assert Codec(4, 3).packed_numel(4) == 3 + 2 * 4  # two blocks of 3, padded: 6 nibbles


@pytest.mark.parametrize("bits", [8, 4])
def test_error_feedback_keeps_the_accumulated_error_bounded(bits):
    """What a step's quantization drops is sent by the next: the sum of everything sent differs
    from the sum of the true values by the last residual only, never by an accumulated bias."""
    codec = Codec(bits, 64)
    generator = torch.Generator().manual_seed(bits)
    bias = torch.randn(1, 640, generator=generator) * 1e-3  # below int4's step: lost without feedback
    residual = torch.zeros(1, 640)
    true_total, sent_total, plain_total = torch.zeros(1, 640), torch.zeros(1, 640), torch.zeros(1, 640)
    for _ in range(200):
        values = bias + torch.randn(1, 640, generator=generator)
        true_total += values
        sent_total += decode(codec, encode(codec, values, residual), 640)
        plain_total += decode(codec, encode(codec, values), 640)
    assert torch.allclose(sent_total + residual, true_total, atol=1e-3)
    step = 5.0 / codec.largest  # |values| stays well under 5: no residual exceeds a step
    assert residual.abs().max() <= step
    drift_with, drift_without = (sent_total - true_total).abs().mean(), (plain_total - true_total).abs().mean()
    assert drift_with < drift_without / 5


def test_wire_options_parse_and_bad_ones_say_what_to_do():
    assert Wire.parse(None) == Wire() and not Wire().quantized
    assert Wire.parse("int8") == Wire(params="int8", grads="int8")
    assert Wire.parse("params=int8,grads=int4,block=128") == Wire("int8", "int4", 128)
    assert Wire.parse("grads=int4,error_feedback=off") == Wire(grads="int4", error_feedback=False)
    assert Wire.parse(str(Wire("int8", "int4", 64))) == Wire("int8", "int4", 64)
    for text, message in [
        ("params=int4", "params='int4' is not supported"),
        ("block=0", "positive integer"),
        ("block=-4", "positive integer"),
        ("grads=fp8", "grads must be"),
        ("grads=int4,block=12", "block must be a multiple of 8 with grads=int4"),  # a reduction failed at once
        ("grads=int8,block=6", "block must be a multiple of 4 with grads=int8"),  # on every rank, blaming another
        ("fast", "not understood"),
    ]:
        with pytest.raises(ValueError, match=message):
            Wire.parse(text)
    with pytest.raises(ValueError, match="positive integer"):
        Wire(params="int8", block=0)


# ------------------------------------------------------------------------ quantized collectives


def quantized_collectives(rank, world, torch_collectives):
    import torch.distributed as dist

    from shardwire.comm.communicator import Communicator

    comm = Communicator(dist.group.WORLD, torch.device("cpu"), timeout=TIMEOUT, torch_collectives=torch_collectives)
    comm.prepare_quantized_reductions()
    codec = Codec(8, 16)
    size = 40  # per rank: more than one block, and a partial last one
    generator = torch.Generator().manual_seed(0)
    shards = [torch.randn(size, generator=generator) for _ in range(world)]
    fulls = [torch.randn(size * world, generator=generator) for _ in range(world)]

    with comm.record() as records:
        gathered = torch.empty(size * world)
        comm.all_gather(gathered, shards[rank], tag="ag", codec=codec).wait()
        share = torch.empty(size)
        residual = comm.residual_for(size * world)
        comm.reduce_scatter(share, fulls[rank], tag="rs", average=True, codec=codec, residual=residual).wait()
        summed = fulls[rank][: 3 * size + 1].clone()  # an all-reduce of a length no rank count divides
        comm.all_reduce(summed, tag="ar", op="sum", codec=Codec(4, 16),
                        residual=comm.residual_for(summed.numel(), all_reduce=True)).wait()
    # every rank reads the same decoded shards, its own included; within a node, the shards
    nodes = comm.placement.nodes
    sent = decode(codec, encode(codec, torch.stack(shards)), size) if nodes > 1 else torch.stack(shards)
    assert torch.equal(gathered, sent.reshape(-1))
    exact = torch.stack(fulls).mean(dim=0).view(world, size)[rank]
    step = torch.stack(fulls).abs().max() * world / codec.largest
    assert (share - exact).abs().max() <= step
    if nodes > 1:
        assert residual.shape == (nodes - 1, size) and residual.abs().max() > 0
    truth = torch.stack(fulls)[:, : 3 * size + 1].sum(dim=0)
    assert (summed - truth).abs().max() <= 2 * truth.abs().max() / 7 + 0.1
    everyone = torch.empty(world * summed.numel())
    comm.all_gather(everyone, summed, tag="same everywhere").wait()
    assert all(torch.equal(row, summed) for row in everyone.view(world, -1))
    comm.close()
    return [(r.op, r.nbytes, r.wire_nbytes) for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("torch_collectives", [False, True], ids=["point-to-point", "torch-collectives"])
@pytest.mark.parametrize("per_node", [1, 2])
def test_collectives_quantize_what_crosses_nodes(torch_collectives, per_node):
    records = run_workers(4, quantized_collectives, torch_collectives, env={"LOCAL_WORLD_SIZE": str(per_node)})
    (gather, reduce, reduce_all), *_ = records
    nodes = 4 // per_node

    def reduced_on_wire(codec, slot):  # exact within the node, packed across, in nccl-tests' convention
        return ((per_node - 1) * nodes * slot * 4 + (nodes - 1) * codec.packed_numel(slot)) * 4 // 3

    size, int8, int4 = 40, Codec(8, 16), Codec(4, 16)
    assert gather == ("all_gather", 4 * size * 4, 4 * int8.packed_numel(size))
    assert reduce == ("reduce_scatter", 4 * size * 4, reduced_on_wire(int8, size))
    slot = -(-(3 * size + 1) // 4)
    assert reduce_all == ("all_reduce", (3 * size + 1) * 4,
                          (reduced_on_wire(int4, slot) + 4 * int4.packed_numel(slot)) // 2)


@pytest.mark.slow
def test_nothing_is_quantized_within_one_node():
    (gather, reduce, reduce_all), *_ = run_workers(4, quantized_collectives, False, env={"LOCAL_WORLD_SIZE": "4"})
    assert [r[1] for r in (gather, reduce, reduce_all)] == [r[2] for r in (gather, reduce, reduce_all)]


# ---------------------------------------------------------------------------------- the engine


def _train_with_wire(rank, world, layout, wire, root):
    """Three steps of the checkpoint tests' job with ``wire``, on 2 nodes x 2 ranks: losses, every
    rank's view of its model, bytes per step as sent and uncompressed, and a checkpoint's
    residuals restored into a fresh model."""
    import shardwire
    from shardwire.engine.shard import engine_of
    from shardwire.models.gpt import loss_fn
    from test_checkpoint import make_model, train

    model, optimizer = make_model(seed=0, layout=layout, wire=wire)
    engine = engine_of(model)
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(rank))
    loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    grads = torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters() if p.grad is not None])
    optimizer.zero_grad()
    with engine.record() as records:
        train(model, optimizer, range(3), rank, world)
    full = shardwire.full_state_dict(model)
    held_out = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(1000))
    with torch.no_grad():
        loss = float(loss_fn(model(held_out[:, :-1]), held_out[:, 1:]))
    residuals = {f"{flat.name}/{which}": r.clone() for flat in engine.flats for which, r in flat.residuals.items()}
    path = pathlib.Path(root) / f"{layout}-{wire}"
    shardwire.save_checkpoint(path, model, optimizer, step=3)
    fresh, fresh_optimizer = make_model(seed=1, layout=layout, wire=wire)
    shardwire.load_checkpoint(path, fresh, fresh_optimizer)
    restored = {f"{flat.name}/{which}": r for flat in engine_of(fresh).flats for which, r in flat.residuals.items()}
    ops = ("all_gather", "reduce_scatter", "all_reduce")
    sent = {op: sum(r.wire_nbytes for r in records if r.op == op) for op in ops}
    exact = {op: sum(r.nbytes for r in records if r.op == op) for op in ops}
    shards = {flat.name: flat.shard.clone() for flat in engine.flats}
    return {"grads": grads, "loss": loss, "params": full, "shards": shards, "residuals": residuals,
            "restored": restored, "sent": sent, "exact": exact}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["full", "hybrid", "hybrid_secondary"])
def test_quantized_training_stays_close_and_every_rank_holds_the_same_model(layout, tmp_path):
    """int8 parameters and int4 gradients on 2 nodes x 2 ranks, in each layout: a step's gradients
    within a quantization's error of full precision's, a held-out loss after three steps within
    0.2%, hybrid's replicas identical, fewer bytes sent, and the error-feedback residuals saved and
    restored. (Training quality over a whole run: ``benchmarks/wire_quality.py``.)"""
    wire = "params=int8,grads=int4"
    env = {"LOCAL_WORLD_SIZE": "2"}
    exact = run_workers(4, _train_with_wire, layout, None, str(tmp_path), env=env)
    quantized = run_workers(4, _train_with_wire, layout, wire, str(tmp_path), env=env)
    if layout == "hybrid":  # replicas: the same position in each group holds the same shards
        for rank, replica in ((0, 2), (1, 3)):
            for name, shard in quantized[rank]["shards"].items():
                assert torch.equal(shard, quantized[replica]["shards"][name]), (name, rank, replica)
    for exact_rank, quantized_rank in zip(exact, quantized):
        error = (quantized_rank["grads"] - exact_rank["grads"]).norm() / exact_rank["grads"].norm()
        assert error < 0.25, error  # int4 with blocks of 256: about 0.13 per quantization
        assert abs(quantized_rank["loss"] - exact_rank["loss"]) < 0.002 * exact_rank["loss"]
    for rank in quantized:
        assert rank["residuals"] and rank["residuals"].keys() == rank["restored"].keys()
        for key, residual in rank["residuals"].items():
            assert torch.equal(rank["restored"][key], residual.to(rank["restored"][key].device)), key
        assert not exact[0]["residuals"]
    sent, uncompressed = quantized[0]["sent"], quantized[0]["exact"]
    crossing = {"full": ("all_gather", "reduce_scatter"), "hybrid": ("all_reduce",),
                "hybrid_secondary": ("all_gather", "reduce_scatter")}[layout]
    for op, nbytes in sent.items():  # a reduce-scatter within a node stays exact: 0.71 of it here
        assert (nbytes < 0.75 * uncompressed[op]) if op in crossing else (nbytes == uncompressed[op]), op


@pytest.mark.slow
def test_within_one_node_a_quantized_wire_changes_nothing(tmp_path):
    exact = run_workers(2, _train_with_wire, "full", None, str(tmp_path))
    quantized = run_workers(2, _train_with_wire, "full", "int8", str(tmp_path))
    for key, value in exact[0]["params"].items():
        assert torch.equal(quantized[0]["params"][key], value), key
    assert not quantized[0]["residuals"] and quantized[0]["sent"] == quantized[0]["exact"]


def test_a_quantized_wire_for_integer_parameters_is_refused():
    model = torch.nn.Linear(4, 4)
    model.register_parameter("steps", torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False))
    with pytest.raises(ValueError, match="parameter 'steps' is int64, which wire params='int8' cannot quantize"):
        shardwire.shard(model, wire="int8")
    with pytest.raises(ValueError, match="params='int4' is not supported"):
        shardwire.shard(torch.nn.Linear(4, 4), wire="params=int4")


def _different_wires(rank, world):
    import shardwire
    from shardwire.models.gpt import GPT, PRESETS, Block

    shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], wire="int8" if rank == 0 else None)


@pytest.mark.slow
def test_ranks_asking_for_different_wires_are_told_before_any_group_is_made():
    errors = run_workers(2, _different_wires, expect_errors=True)
    assert all("ranks [1] asked for a different wire than rank 0" in str(error) for error in errors)


def _bf16_accumulating(rank, world, wire):
    import shardwire
    from shardwire.models.gpt import GPT, PRESETS, Block, loss_fn

    torch.manual_seed(0)
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], mixed_precision="bf16", wire=wire)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(rank))
    with shardwire.no_sync(model):
        loss_fn(model(tokens[:2, :-1]), tokens[:2, 1:]).backward()
    loss_fn(model(tokens[2:, :-1]), tokens[2:, 1:]).backward()
    shardwire.clip_grad_norm_(model, 1.0)
    return torch.cat([p.grad.to_local().float().reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.mark.slow
def test_a_quantized_wire_with_bf16_and_accumulated_gradients():
    """bf16 gathers and reductions, a no_sync micro-batch, then clipping: the accumulated gradients
    cross the nodes quantized once, within a quantization's error of the unquantized run's."""
    env = {"LOCAL_WORLD_SIZE": "1"}
    exact = run_workers(2, _bf16_accumulating, None, env=env)
    quantized = run_workers(2, _bf16_accumulating, "int8", env=env)
    for a, b in zip(exact, quantized):
        assert (b - a).norm() < 0.05 * a.norm()
