"""docs/development.md's "Adding to the house", followed: a wire format added where its checklist
says, and nowhere else, reaches the options, the codec, the engine's collectives and the simulator.

The format is int2 gradients (one level either side of 0 per block: far too coarse to train with,
which makes its effect plain). The checklist's first step, its name and bits in ``comm/wire.py``,
is made here by patching that module's two tables; its integers pack whole into bytes, so the
second step (``comm/quantize.py``) has nothing to do."""

from __future__ import annotations

import pytest
import torch

from harness import run_workers
from shardwire.comm import wire
from shardwire.comm.quantize import decode, encode
from shardwire.comm.wire import DEFAULT_BLOCK, Codec, Wire
from shardwire.sim.costs import INTER
from shardwire.sim.predict import predict
from shardwire.sim.specs import TrainingSpec, parse
from test_sim_wire import BF16, MODEL, cluster, inter_bytes_by_hand

INT2 = 0.25 + 4 / DEFAULT_BLOCK  # bytes per element: four integers to a byte, and a block's fp32 scale


def add_int2(setattr, setitem) -> None:
    """The checklist's step 1, as an edit of ``comm/wire.py`` would make it."""
    setattr(wire, "GRAD_FORMATS", (*wire.GRAD_FORMATS, "int2"))
    setitem(wire._BITS, "int2", 2)


@pytest.fixture
def int2(monkeypatch):
    add_int2(monkeypatch.setattr, monkeypatch.setitem)


def test_the_options_and_their_messages_offer_it(int2):
    assert Wire.parse("grads=int2").grad_codec == Codec(2, DEFAULT_BLOCK)
    assert parse("training", {"wire": "grads=int2"}).wire_format.grads == "int2"
    with pytest.raises(ValueError, match="grads must be None, 'int8', 'int4' or 'int2', got 'int3'"):
        Wire.parse("grads=int3")


@pytest.mark.parametrize("block", [1, 7, DEFAULT_BLOCK])
def test_its_codec_packs_four_to_a_byte_and_moves_no_element_more_than_half_a_step(int2, block):
    codec = Codec(2, block)  # any block packs (the wire asks whole 4-byte words of a reduction's blocks)
    rows = torch.randn(3, 1001, generator=torch.Generator().manual_seed(block)) * torch.tensor([[1e-3], [1.0], [0.0]])
    packed = encode(codec, rows)
    assert packed.shape[1] == codec.packed_numel(1001) == -(-codec.blocks(1001) * block // 4) + 4 * codec.blocks(1001)
    blocks = torch.nn.functional.pad(rows, (0, codec.blocks(1001) * block - 1001)).view(3, -1, block)
    half_step = (blocks.abs().amax(dim=2, keepdim=True) / 2).expand_as(blocks).reshape(3, -1)[:, :1001]
    assert ((decode(codec, packed, 1001) - rows).abs() <= half_step * (1 + 1e-6)).all()


@pytest.mark.parametrize("layout, reshard", [("full", True), ("hybrid", True)])
def test_the_simulator_prices_its_bytes(int2, layout, reshard):
    predicted = predict(MODEL, cluster(), TrainingSpec(layout=layout, reshard_after_forward=reshard, wire="grads=int2"))
    assert predicted.timeline.link_bytes[INTER] == pytest.approx(inter_bytes_by_hand(layout, reshard, BF16, INT2))


def _train_with_int2(rank, world, layout, grads, root):
    """``test_wire``'s three steps with ``grads`` quantized, in a worker where int2 was added."""
    from test_wire import _train_with_wire

    add_int2(setattr, dict.__setitem__)
    return _train_with_wire(rank, world, layout, None if grads is None else f"grads={grads}", root)


@pytest.mark.slow
def test_the_engine_sends_it_between_nodes(tmp_path):
    """On 2 nodes x 2 ranks, full sharding: the reduce-scatter crosses nodes in int2, fewer bytes
    than int4 (its first step, within the node, stays exact), and its gradients are further from
    full precision's than int4's, as one level against seven (0.45 against 0.10 here)."""
    env = {"LOCAL_WORLD_SIZE": "2"}
    runs = {grads: run_workers(4, _train_with_int2, "full", grads, str(tmp_path / str(grads)), env=env)
            for grads in (None, "int4", "int2")}
    exact = runs[None][0]

    def error(grads):
        return float((runs[grads][0]["grads"] - exact["grads"]).norm() / exact["grads"].norm())

    assert error("int4") < error("int2") < 1.0
    sent = {grads: runs[grads][0]["sent"]["reduce_scatter"] for grads in runs}
    assert sent["int2"] < sent["int4"] < sent[None]
    assert all(rank["loss"] == rank["loss"] for rank in runs["int2"])  # finite: trained, not broken
