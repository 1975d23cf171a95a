"""The simulator's quantized wire against the engine's semantics, computed by hand: bytes across
nodes for every layout and wire, the kernels' time, error feedback's memory, a wire within one node
changing nothing, and the planner choosing and printing a wire."""

import dataclasses
import json
import re

import pytest

from shardwire.cli import main
from shardwire.comm.wire import DEFAULT_BLOCK, Wire
from shardwire.sim import costs
from shardwire.sim.architecture import architecture
from shardwire.sim.costs import INTER, INTRA, Group
from shardwire.sim.planner import HYBRID_WIRES, WIRES, candidate_settings, plan
from shardwire.sim.predict import predict
from shardwire.sim.specs import ClusterSpec, LinkSpec, ModelSpec, SpecError, TrainingSpec, parse

# Every shard a multiple of the block on 8 GPUs in nodes of 4 (units: 12 h^2 + 2 h = 6145 x 2048
# parameters; root: (V + 1) h = 512 x 2048), so bytes per element are exactly 1 + 4/B and 1/2 + 4/B.
MODEL = ModelSpec(name="aligned", layers=2, hidden=1024, heads=8, vocab=1023, seq_len=128)
B = DEFAULT_BLOCK
INT8, INT4 = 1 + 4 / B, 0.5 + 4 / B
BF16, FP32 = 2, 4


def cluster(nodes=2, gpus=4, *, inter=10.0, intra=100.0, tflops=100.0, algorithm="hierarchical", quantize=None):
    return ClusterSpec(nodes=nodes, gpus_per_node=gpus, peak_tflops=tflops, gpu_memory_gb=80.0,
                       intra_node=LinkSpec(intra), inter_node=LinkSpec(inter), algorithm=algorithm,
                       quantize_gelems=quantize)


def sizes():
    arch = architecture(MODEL, 2)
    return arch.params, arch.root.params, arch.params - arch.root.params


def opening_units():
    """The parameters of the units backward opens with (the last ``prefetch``, 2): gathered once a
    step, resharding or not."""
    return sum(u.params for u in architecture(MODEL, 2).units[-TrainingSpec().prefetch:])


# ------------------------------------------------------------------------------------ the spec


def test_wire_is_a_training_key_parsed_as_the_engine_parses_it():
    assert TrainingSpec().wire == "none" and not TrainingSpec().wire_format.quantized
    assert parse("training", {"wire": "int8"}).wire_format.grad_codec.bits == 8
    t = parse("training", {"wire": "params=int8,grads=int4,block=128,error_feedback=off"})
    assert (t.wire_format.params, t.wire_format.grads, t.wire_format.block) == ("int8", "int4", 128)


@pytest.mark.parametrize("wire", ["int4", "params=int4", "grads=int2", "params=int8,block=0", "fast"])
def test_a_bad_wire_is_a_spec_error_with_the_engines_message(wire):
    with pytest.raises(ValueError) as engine:
        Wire.parse(wire)
    with pytest.raises(SpecError) as simulator:
        parse("training", {"wire": wire})
    assert str(simulator.value) == f"training: {engine.value}"


def test_a_block_larger_than_any_shard_is_refused():
    with pytest.raises(SpecError, match=re.escape("block must be a positive integer (elements per scale) of at most "
                                                  "1,073,741,824, got 2000000000")):
        parse("training", {"wire": "grads=int8,block=2000000000"})


def test_quantization_rate_has_a_range():
    base = dataclasses.asdict(cluster())
    assert parse("cluster", {**base, "quantize_gelems": 0.4}).quantize_gelems == 0.4
    with pytest.raises(SpecError, match="quantize_gelems must be positive"):
        parse("cluster", {**base, "quantize_gelems": 0})
    with pytest.raises(SpecError, match="quantize_gelems 1e-09 is under 0.0001 .* billions of elements per second"):
        parse("cluster", {**base, "quantize_gelems": 1e-9})


# ------------------------------------------------------------------------- bytes across nodes


def inter_bytes_by_hand(layout, reshard, params_bytes, grads_bytes, nodes=2):
    """Bytes through one node's NICs per step, hierarchical collectives: a gather over the world
    moves (N-1)/N of the unit's bytes, quantized or not; a reduce-scatter over the world (N-1)/N of
    the gradient's; hybrid gathers and reduce-scatters within the node and all-reduces between the
    groups, 2 (N-1)/N."""
    P, root, units = sizes()
    f = (nodes - 1) / nodes
    if layout == "hybrid":
        return 2 * f * P * grads_bytes
    world_gathers = root + units  # hpZ: forward only
    if layout == "full" and reshard:
        world_gathers += units - opening_units()  # backward opens with the last units, still gathered
    return f * (world_gathers * params_bytes + P * grads_bytes)


LAYOUTS = [("full", True), ("grad_op", False), ("hybrid", True), ("hybrid", False), ("hybrid_secondary", True)]
WIRE_BYTES = {"none": (BF16, FP32), "int8": (INT8, INT8), "params=int8,grads=int4": (INT8, INT4),
              "grads=int4": (BF16, INT4)}


@pytest.mark.parametrize("wire", list(WIRE_BYTES))
@pytest.mark.parametrize("layout, reshard", LAYOUTS)
def test_bytes_across_nodes_follow_the_wire(layout, reshard, wire):
    t = TrainingSpec(layout=layout, reshard_after_forward=reshard, wire=wire)
    p = predict(MODEL, cluster(), t)
    expected = inter_bytes_by_hand(layout, reshard, *WIRE_BYTES[wire])
    assert p.timeline.link_bytes[INTER] == pytest.approx(expected, rel=1e-12)


def test_full_sharding_on_two_nodes_int8_params_int4_grads():
    """The formula per node: P (N-1)/N (2 (1 + 4/B) + 1/2 + 4/B), the root gathered once (it stays
    gathered), the units twice (forward and, resharded, backward) but the last two, which backward
    opens with, once."""
    P, root, units = sizes()
    gathered = 2 * units - opening_units() + root
    p = predict(MODEL, cluster(), TrainingSpec(wire="params=int8,grads=int4"))
    assert p.timeline.link_bytes[INTER] == pytest.approx(gathered / 2 * INT8 + P / 2 * INT4)
    # Within the node, gathers move the packed bytes too; the reduce-scatter's first step is exact.
    assert p.timeline.link_bytes[INTRA] == pytest.approx(gathered * INT8 * 3 / 4 + P * FP32 * 3 / 4)


def test_quantized_reduce_scatter_is_hierarchical_and_the_gather_follows_the_algorithm():
    """The engine's quantized reduce-scatter is two steps on any transport (shardwire.comm.levels);
    its all-gather of packed bytes is the transport's own (a ring under NCCL)."""
    P, root, units = sizes()
    ring = predict(MODEL, cluster(algorithm="ring"), TrainingSpec(wire="params=int8,grads=int4"))
    gathers = (2 * units - opening_units() + root) * INT8 * 7 / 8  # (n-1)/n of the packed buffer
    assert ring.timeline.link_bytes[INTER] == pytest.approx(gathers + P * INT4 / 2)


def test_kernels_sit_on_the_lane_before_and_after_the_transfer():
    c = cluster(quantize=2.0)
    codec = TrainingSpec(wire="int8").wire_format.grad_codec
    phases = costs.quantized_reduce_scatter_phases(8 * 1024, 4, Group(2, 4), c, codec)
    assert [dict(p.flows) for p in phases] == [{INTRA: 8 * 1024 * 4 * 3 / 4}, {}, {INTER: 8 * 1024 * INT8 / 2}, {}]
    assert phases[1].latency_s == phases[3].latency_s == pytest.approx(1024 / 2e9)  # one slot each way
    encode, *transfer, decode = costs.quantized_all_gather_phases(8 * 1024, Group(2, 4), c, codec)
    assert [dict(p.flows) for p in transfer] == [{INTER: 8 * 1024 * INT8 / 2}, {INTRA: 8 * 1024 * INT8 * 3 / 4}]
    assert (encode.flows, decode.flows) == ((), ())
    assert (encode.latency_s, decode.latency_s) == pytest.approx((1024 / 2e9, 8 * 1024 / 2e9))  # a shard; all


# ------------------------------------------------------------------------------------ kernels


def test_within_one_node_a_wire_changes_nothing():
    """The engine quantizes only collectives whose group spans nodes: on one node, none."""
    c = cluster(nodes=1, quantize=0.001)
    for layout in ("full", "grad_op"):
        exact = predict(MODEL, c, TrainingSpec(layout=layout))
        for wire in WIRES[1:]:
            quantized = predict(MODEL, c, TrainingSpec(layout=layout, wire=wire))
            assert quantized.step_time_s == exact.step_time_s
            assert quantized.comm_s == exact.comm_s
            assert quantized.timeline.link_bytes == exact.timeline.link_bytes
            assert quantized.memory.parts == exact.memory.parts


def test_on_a_fast_network_the_kernels_make_a_quantized_wire_slower():
    """Links a million times faster than the kernels: the lanes are busy with encode and decode
    alone, each gather for its shard and every shard (1/n + 1 of the unit's elements), each
    reduce-scatter for the N-1 slots it sends and receives."""
    rate = 1.0  # billion elements a second
    c = cluster(inter=1e9, intra=1e9, quantize=rate)
    P, root, units = sizes()
    exact = predict(MODEL, c, TrainingSpec())
    quantized = predict(MODEL, c, TrainingSpec(wire="int8"))
    assert quantized.step_time_s > exact.step_time_s
    gathered = 2 * units - opening_units() + root
    assert quantized.comm_s["all_gather"] == pytest.approx(gathered * (1 + 1 / 8) / (rate * 1e9), rel=1e-3)
    assert quantized.comm_s["reduce_scatter"] == pytest.approx(P * 2 * (2 - 1) / 8 / (rate * 1e9), rel=1e-3)
    best = plan(MODEL, c, 8, TrainingSpec()).best
    assert best.training.wire == "none"


def test_unpriced_kernels_are_free_and_the_report_says_so(capsys):
    status = main(["simulate", "--model", "gpt2-125m", "--cluster", "{preset: a100-100gbe, quantize_gelems: null}",
                   "--nodes", "2", "--training", "{wire: int8}"])
    out, _ = capsys.readouterr()
    assert status == 0
    assert "note: quantization kernels not priced: the cluster gives no quantize_gelems" in out


# ------------------------------------------------------------------------------------- memory


@pytest.mark.parametrize("layout, wire, elements", [
    ("full", "int8", lambda P: (2 - 1) * P / 8),  # (N-1)/W of the parameters
    ("hybrid_secondary", "params=int8,grads=int4", lambda P: P / 8),
    # the all-reduce between groups, of a shard of P/4 over 2 GPUs: a slot for the other node's and
    # one for the result, which it gathers quantized too (Communicator.residual_for)
    ("hybrid", "int8", lambda P: 2 * P / 8),
    ("full", "params=int8", lambda P: 0),  # gradients exact
    ("full", "grads=int8,error_feedback=off", lambda P: 0),
])
def test_error_feedback_keeps_a_residual_per_slot_sent_across_nodes(layout, wire, elements):
    P, _, _ = sizes()
    m = predict(MODEL, cluster(), TrainingSpec(layout=layout, wire=wire)).memory
    exact = predict(MODEL, cluster(), TrainingSpec(layout=layout)).memory
    assert m.error_feedback == pytest.approx(4 * elements(P))
    assert m.total - exact.total == pytest.approx(m.error_feedback)


# -------------------------------------------------------------------------- report and planner


def run(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_the_report_shows_the_wire_and_the_bytes_it_moves(capsys):
    argv = ["simulate", "--model", "gpt2-125m", "--cluster", "a100-100gbe", "--nodes", "2"]
    status, out, _ = run(capsys, *argv, "--training", "{wire: 'params=int8,grads=int4'}")
    training = next(line for line in out.splitlines() if line.startswith("training"))
    assert status == 0 and "wire params=int8,grads=int4" in training
    assert "GB per step through each node's NICs" in out
    _, quantized, _ = run(capsys, *argv, "--training", "{wire: 'params=int8,grads=int4'}", "--json")
    _, exact, _ = run(capsys, *argv, "--json")
    quantized, exact = json.loads(quantized), json.loads(exact)
    assert quantized["training"]["wire"] == "params=int8,grads=int4"
    assert quantized["bytes_per_step"]["inter_node"] < exact["bytes_per_step"]["inter_node"] / 3
    status, _, err = run(capsys, *argv, "--training", "{wire: int2}")
    assert status == 2 and "wire 'int2' is not understood" in err


def test_the_planner_quantizes_across_a_slow_network_and_prints_the_wire(capsys):
    status, out, _ = run(capsys, "plan", "--model", "gpt-350m", "--cluster",
                         "{preset: a100-100gbe, inter_node: {busbw_GBps: 1}}", "--nodes", "2", "--global-batch", "64")
    lines = out.split("runner-up")[0].splitlines()
    best, run_line, shard_line = (next(line for line in lines if line.lstrip().startswith(start))
                                  for start in ("best", "run:", "or:"))
    wire = run_line.split(" --wire ")[1]
    assert status == 0 and wire in {*WIRES[1:], *HYBRID_WIRES[1:]} and best.endswith(f"wire {wire}")
    assert f"wire={wire!r}" in shard_line
    assert "  wire none " in out  # why: the exact wire, slower


def test_the_planner_tries_wires_only_across_nodes():
    one, two = cluster(nodes=1), cluster(nodes=2)
    assert {t.wire for t in candidate_settings(4, one, TrainingSpec())} == {"none"}
    candidates = candidate_settings(4, two, TrainingSpec())
    assert {t.wire for t in candidates if t.layout != "hybrid"} == set(WIRES)
    assert {t.wire for t in candidates if t.layout == "hybrid"} == set(HYBRID_WIRES)  # its gathers stay in nodes
