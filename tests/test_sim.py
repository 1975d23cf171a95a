"""The simulator's pieces against hand-computed answers: specs, FLOPs, collective costs, the
discrete-event core, the step schedule and the memory model."""

import dataclasses
import math

import pytest

from shardwire.engine.limits import REDUCTIONS_IN_FLIGHT
from shardwire.sim import costs
from shardwire.sim.architecture import architecture
from shardwire.sim.costs import Group
from shardwire.sim.explain import unit_budgets
from shardwire.sim.events import Link, Simulation
from shardwire.sim.memory import GIB, USABLE_FRACTION, estimate_memory
from shardwire.sim.predict import predict, sweep
from shardwire.sim.presets import CLUSTERS, MODELS
from shardwire.sim.step import reduction_phases
from shardwire.sim.specs import ClusterSpec, LinkSpec, ModelSpec, SpecError, TrainingSpec, parse

GPT = ModelSpec(name="gpt", layers=4, hidden=256, heads=4, vocab=1000, seq_len=128)


def cluster(nodes=2, gpus=4, *, intra=100.0, inter=10.0, latency_us=0.0, tflops=100.0, algorithm="hierarchical",
            memory_gb=80.0):
    return ClusterSpec(nodes=nodes, gpus_per_node=gpus, peak_tflops=tflops, gpu_memory_gb=memory_gb,
                       intra_node=LinkSpec(intra, latency_us), inter_node=LinkSpec(inter, latency_us),
                       algorithm=algorithm)


# ------------------------------------------------------------------------------------ specs


def test_specs_name_missing_and_unknown_keys():
    with pytest.raises(SpecError, match="missing key.*hidden"):
        parse("model", {"layers": 2, "heads": 2, "vocab": 10, "seq_len": 8})
    with pytest.raises(SpecError, match=r"unknown key\(s\) 'hiden' \(did you mean hidden\?\); known keys"):
        parse("model", {"layers": 2, "hiden": 2, "hidden": 4, "heads": 2, "vocab": 10, "seq_len": 8})
    with pytest.raises(SpecError, match="inter_node: missing key.*busbw_GBps"):
        parse("cluster", {"nodes": 1, "gpus_per_node": 1, "peak_tflops": 1, "gpu_memory_gb": 1,
                          "intra_node": {"busbw_GBps": 1}, "inter_node": {"latency_us": 1}})


@pytest.mark.parametrize("kind, data, message", [
    ("model", {**dataclasses.asdict(GPT), "hidden": 250}, "multiple of heads"),
    ("model", {**dataclasses.asdict(GPT), "layers": 0}, "layers must be positive"),
    ("model", {**dataclasses.asdict(GPT), "kind": "encoder"}, "kind must be one of"),
    ("model", {**dataclasses.asdict(GPT), "decoder_seq_len": 10}, "'encoder-decoder' only"),
    ("training", {"micro_batch": -1}, "micro_batch must be positive"),
    ("training", {"grad_accum": 257}, "grad_accum 257 is more micro-batches than the simulator steps through"),
    ("cluster", {**dataclasses.asdict(cluster()), "matmul_efficiency": 1.5}, r"matmul_efficiency .* \(0, 1\]"),
    ("training", {"fp8_all_gather": True}, "fp8_all_gather .* needs precision fp8"),
    ("training", {"reduce_precision": "fp8"}, "reduce_precision must be one of fp32, bf16, fp16"),
    ("training", {"layout": "grad_op", "reshard_after_forward": True}, "cannot be true"),
    ("training", {"layout": "zero1", "reshard_after_forward": True}, "layout 'zero1' keeps parameters gathered"),
    ("training", {"reduce_bucket_elements": 1000}, "reduce_bucket_elements applies to layout 'zero1'"),
    ("training", {"layout": "zero1", "reduce_bucket_elements": 0}, "reduce_bucket_elements must be positive"),
    ("training", {"layout": "zero1", "reduce_bucket_elements": 10**16}, "more than any model's gradient"),
    ("training", {"layout": "zero1", "gathers_per_unit": 6}, "gathers_per_unit set how parameters are gathered, and "
                                                             "layout 'zero1' gathers none"),
    ("training", {"layout": "zero1", "precision": "fp8", "fp8_all_gather": True}, "fp8_all_gather set how"),
    ("training", {"prefetch": 1.5}, "prefetch must be a whole number"),
    ("model", {**dataclasses.asdict(GPT), "seq_len": 1e308}, r"seq_len must be a whole number, got 1e\+308$"),
    ("training", {"activation_checkpointing": "yes"}, "true or false"),
    ("cluster", {**dataclasses.asdict(cluster()), "inter_node": {"busbw_GBps": 0}}, "busbw_GBps must be positive"),
    # NaN and infinity would never let a transfer finish: refused while parsing, before any simulation
    ("cluster", {**dataclasses.asdict(cluster()), "inter_node": {"busbw_GBps": math.nan}},
     "busbw_GBps must be positive and finite, got nan"),
    ("cluster", {**dataclasses.asdict(cluster()), "peak_tflops": math.inf}, "peak_tflops must be positive and finite"),
    ("cluster", {**dataclasses.asdict(cluster()), "intra_node": {"busbw_GBps": 1, "latency_us": math.nan}},
     "latency_us must be at least 0 and finite"),
    # an explicit 0 is refused, not taken for the default
    ("model", {**dataclasses.asdict(GPT), "ffn_hidden": 0}, "ffn_hidden must be positive"),
    ("model", {**dataclasses.asdict(GPT), "kv_heads": 0}, "kv_heads must be positive"),
    ("model", {**dataclasses.asdict(MODELS["t5-3b"]), "decoder_layers": 0}, "decoder_layers must be positive"),
    ("model", {**dataclasses.asdict(MODELS["t5-3b"]), "decoder_seq_len": 0}, "decoder_seq_len must be positive"),
])
def test_specs_reject_impossible_values(kind, data, message):
    with pytest.raises(SpecError, match=message):
        parse(kind, data)


def test_specs_resolve_defaults_and_accept_whole_floats():
    model = parse("model", {"layers": 2.0, "hidden": 64, "heads": 4, "vocab": 10, "seq_len": 8})
    assert model.layers == 2 and model.ffn_hidden == 256 and model.kv_heads == 4
    assert parse("training", {"layout": "grad_op"}).reshards is False
    assert parse("training", {}).reshards is True


def test_stated_parameter_count_is_checked():
    with pytest.raises(SpecError, match="params says"):
        architecture(dataclasses.replace(GPT, params=10**9), 2)


# ------------------------------------------------------------------------------------ FLOPs


def test_gpt_flops_are_six_times_parameters_plus_attention():
    """Forward and backward of a GPT: 6 x (parameters doing matmuls) + 12 L h s per token."""
    arch = architecture(GPT, 2)
    h, s, L = GPT.hidden, GPT.seq_len, GPT.layers
    matmul_params = L * 12 * h * h + GPT.vocab * h  # blocks + the tied head
    assert 3 * arch.forward_flops == pytest.approx(s * (6 * matmul_params + 12 * L * h * s))


def test_t5_flops_are_the_documents_formula():
    """The T5 document's appendix: 96 (54 B s h^2 + 12 B s^2 h) + 6 B s h V per step, with
    activation checkpointing (two forwards and a backward), for one sequence length s."""
    model = dataclasses.replace(MODELS["t5-11b"], decoder_seq_len=512, params=None)
    p = predict(model, cluster(1, 1), TrainingSpec(micro_batch=1, activation_checkpointing=True))
    s, h, V = 512, model.hidden, model.vocab
    document = 96 * (54 * s * h**2 + 12 * s**2 * h) + 6 * s * h * V
    assert p.hardware_flops_per_gpu == pytest.approx(document, rel=1e-9)


def test_activation_bytes_match_korthikanti_without_dropout():
    """32 h bytes per token and layer for a GPT in 16-bit (34 h less the dropout masks); eager
    attention adds the softmax output, 2 a s bytes."""
    flash = architecture(GPT, 2).units[0]
    eager = architecture(dataclasses.replace(GPT, attention="eager"), 2).units[0]
    h, s, a = GPT.hidden, GPT.seq_len, GPT.heads
    assert flash.activation_bytes == 32 * h * s
    assert eager.activation_bytes - flash.activation_bytes == 2 * a * s * s
    assert flash.boundary_bytes == 2 * h * s


# -------------------------------------------------------------------------------------- costs


def test_collective_bytes_and_latency_by_algorithm():
    S, N, g = 8e6, 4, 8
    c = cluster(N, g, latency_us=10.0, algorithm="hierarchical")
    inter, intra = costs.all_gather_phases(S, Group(N, g), c)
    assert inter.flows == (("inter", S * 3 / 4),) and inter.latency_s == pytest.approx(3 * 10e-6)
    assert intra.flows == (("intra", S * 7 / 8),) and intra.latency_s == pytest.approx(7 * 10e-6)
    assert [p.flows[0][0] for p in costs.reduce_scatter_phases(S, Group(N, g), c)] == ["intra", "inter"]

    (ring,) = costs.all_gather_phases(S, Group(N, g), dataclasses.replace(c, algorithm="ring"))
    assert dict(ring.flows) == {"inter": S * 31 / 32, "intra": S * 31 / 32}
    assert ring.latency_s == pytest.approx(31 * 10e-6)


    assert costs.all_gather_phases(S, Group(1, 1), c) == []


def test_all_reduce_is_reduce_scatter_then_all_gather_and_groups_side_by_side_add_up():
    c = cluster(4, 8)
    phases = costs.all_reduce_phases(1e6, Group(4, 1, copies=8), c)
    assert sum(b for p in phases for _, b in p.flows) == pytest.approx(8 * 2 * 1e6 * 3 / 4)
    # With the network to itself: bytes over capacity plus latencies.
    assert costs.isolated_s(phases, c) == pytest.approx(8 * 2 * 1e6 * 3 / 4 / 10e9)


# ---------------------------------------------------------------------------- discrete events


def test_link_shares_its_capacity_equally():
    sim = Simulation()
    link = Link(sim, capacity=100.0)
    first = link.transfer(100.0)  # alone it would take 1 s
    later = []
    sim.at(0.5, lambda: later.append(link.transfer(100.0)))
    sim.run()
    # 0-0.5 s: first moves 50 alone; then both at 50/s: first ends at 1.5 s, the second has 50 left
    # and ends at 2.0 s alone.
    assert first.time == pytest.approx(1.5)
    assert later[0].time == pytest.approx(2.0)
    assert link.busy_s == pytest.approx(2.0)


def test_processes_wait_for_events_and_timeouts():
    sim = Simulation()
    gate = sim.event()
    log = []

    def waiter():
        yield gate
        log.append(("gate", sim.now))
        yield sim.timeout(2.0)
        log.append(("done", sim.now))

    sim.start(waiter())
    sim.at(3.0, gate.succeed)
    sim.run()
    assert log == [("gate", 3.0), ("done", 5.0)]


# ------------------------------------------------------------------------------- step schedule


def test_without_communication_the_step_is_its_compute():
    """Without a memory bandwidth only FLOPs take time: matrix multiplies at the default 70% of
    peak, three times over (four for the recomputed blocks), and flash attention at 50%, computing
    half of each causal score matrix, its backward 2.5 times its forward."""
    fast = cluster(2, 4, intra=1e12, inter=1e12)
    p = predict(GPT, fast, TrainingSpec(micro_batch=4, activation_checkpointing=True))
    arch = architecture(GPT, 2)
    recomputed = sum(u.forward_flops for u in arch.units)  # checkpointing recomputes the blocks
    flops = 4 * (3 * arch.forward_flops + recomputed)
    assert p.hardware_flops_per_gpu == flops
    matmuls = 4 * (4 * sum(m.flops for u in arch.units for m in u.matmuls) + 3 * arch.root.matmuls[0].flops)
    attention = 4 * (1 + 2.5 + 1) * sum(a.flops / 2 for u in arch.units for a in u.attention)
    assert p.compute_time_s == pytest.approx(matmuls / (100e12 * 0.7) + attention / (100e12 * 0.5))
    assert p.step_time_s == pytest.approx(p.compute_time_s, rel=1e-3)


def test_without_compute_the_step_is_the_bytes_over_the_link():
    """With compute free, gathers and reductions keep the one shared link busy: the step lasts
    as long as all their bytes take (plus the tiny intra-node part)."""
    slow = cluster(4, 1, inter=1.0, tflops=1e9)  # one GPU per node: everything crosses the NIC
    training = TrainingSpec(micro_batch=1, precision="fp32")
    p = predict(GPT, slow, training)
    arch = architecture(GPT, 4)
    units, opening = arch.params - arch.root.params, sum(u.params for u in arch.units[-training.prefetch:])
    # forward and backward gathers of every unit but the last `prefetch` (backward opens with them,
    # still gathered), the root's gather, every reduction: 4 bytes each
    wire = (2 * units - opening + arch.root.params + arch.params) * 4 * 3 / 4
    assert p.step_time_s == pytest.approx(wire / 1e9, rel=0.01)
    assert p.timeline.link_busy_s["inter"] == pytest.approx(p.step_time_s, rel=0.01)


def test_prefetch_hides_gathers_and_a_block_limiter_leaves_bubbles():
    balanced = cluster(2, 8, inter=2.0)
    times = {}
    for prefetch, limiter in ((0, "sliding"), (2, "block"), (2, "sliding")):
        t = TrainingSpec(micro_batch=8, prefetch=prefetch, limiter=limiter)
        times[prefetch, limiter] = predict(GPT, balanced, t).step_time_s
    assert times[0, "sliding"] > times[2, "block"] > times[2, "sliding"]


def test_on_demand_gathers_are_fully_exposed():
    """Prefetch 0: every all-gather is waited for in full."""
    c = cluster(2, 4, inter=1.0)
    p = predict(GPT, c, TrainingSpec(micro_batch=1, prefetch=0))
    gathers = [r for r in p.timeline.comms if r.op == "all_gather"]
    waited = sum(s.seconds for s in p.timeline.stalls if "all-gather" in s.reason)
    assert waited == pytest.approx(sum(r.busy_s for r in gathers), rel=1e-6)


def test_grad_op_gathers_once_per_unit_and_hybrid_gathers_inside_the_node():
    c = cluster(2, 4)
    ops = {}
    for layout in ("full", "grad_op", "hybrid"):
        p = predict(GPT, c, TrainingSpec(layout=layout))
        ops[layout] = [r.op for r in p.timeline.comms]
    units = GPT.layers
    # the root and the last two units (prefetch 2: backward opens with them) once, the others twice
    assert ops["full"].count("all_gather") == 2 * units - 1
    assert ops["grad_op"].count("all_gather") == units + 1
    assert ops["hybrid"].count("all_reduce") == units + 1 + 1  # each unit, the root, the norm
    hybrid = predict(GPT, c, TrainingSpec(layout="hybrid"))
    gather = next(r for r in hybrid.timeline.comms if r.op == "all_gather")
    assert gather.busy_s == pytest.approx(gather.nbytes * 3 / 4 / 100e9)  # intra-node only


def test_zero1_all_reduces_each_gradient_over_every_gpu_and_gathers_only_the_updated_parameters():
    """zero1 (ZeRO-1; DDP in groups of 1): nothing is gathered for compute; each unit's gradient is
    all-reduced over the world in one flat ring, whose latency the units of a bucket share; after the
    optimizer step the group all-gathers the updated parameters; every GPU holds the whole model and
    gradient, and its group's part of the masters and optimizer state."""
    c = cluster(2, 4, latency_us=10.0, algorithm="ring")
    arch = architecture(GPT, 2)
    training = TrainingSpec(layout="zero1")
    p = predict(GPT, c, training)
    assert p.training.reshards is False
    gathers = [r for r in p.timeline.comms if r.op == "all_gather"]
    assert [r.unit for r in gathers if r.busy_s > 0] == ["updated parameters"]
    updated = gathers[-1]
    assert updated.nbytes == 2 * arch.params and updated.started >= p.timeline.compute["optimizer"]
    reduced = [r for r in p.timeline.comms if r.op == "all_reduce" and r.unit != "gradient norm"]
    assert len(reduced) == GPT.layers + 1
    unit = arch.units[0]

    latency = sum(ph.latency_s for _, _, phases in reduction_phases(unit.params, c, training) for ph in phases)
    assert latency == pytest.approx(2 * 7 * 10e-6)  # reduce-scatter and all-gather over 8 GPUs
    # buckets of two blocks: the four blocks in two all-reduces, the root (half a bucket) in a last one
    bucketed = predict(GPT, c, TrainingSpec(layout="zero1", reduce_bucket_elements=2 * unit.params))
    sizes = [r.nbytes / 4 for r in bucketed.timeline.comms if r.op == "all_reduce" and r.unit != "gradient norm"]
    assert sizes == [2 * unit.params, 2 * unit.params, arch.root.params]
    # a bucket smaller than a unit holds it alone: one all-reduce of it, as explained per unit
    small = predict(GPT, c, TrainingSpec(layout="zero1", reduce_bucket_elements=1))
    unbucketed = predict(GPT, c, TrainingSpec(layout="zero1"))
    assert [b.backward_comm_s for b in unit_budgets(small)] == [b.backward_comm_s for b in unit_budgets(unbucketed)]
    whole = predict(GPT, c, TrainingSpec(layout="zero1", reduce_bucket_elements=10 * arch.params))
    assert [r.nbytes / 4 for r in whole.timeline.comms if r.op == "all_reduce" and r.unit != "gradient norm"] == [
        arch.params]  # one bucket, one latency
    memory = estimate_memory(arch, c, training)  # groups of a node's 4 GPUs
    assert memory.gathered_parameters == 2 * arch.params
    assert memory.optimizer_state == 8 * arch.params / 4 and memory.parameter_shards == 4 * arch.params / 4
    assert memory.unit_gradients == 2 * max(u.params for u in arch.units) + 4 * arch.params
    ddp = estimate_memory(arch, c, TrainingSpec(layout="zero1", shard_group_size=1))
    assert ddp.optimizer_state == 8 * arch.params


def test_hybrid_layouts_follow_the_engine_in_groups_of_any_size():
    """hybrid_secondary gathers over the world for forward and within the group for backward, and
    keeps a secondary shard per unit; hybrid in groups smaller than a node all-reduces between the
    groups, several of them on every node at once; a group must fit the nodes."""
    c = cluster(2, 4)
    units = GPT.layers
    hpz = predict(GPT, c, TrainingSpec(layout="hybrid_secondary"))
    gathers = [r for r in hpz.timeline.comms if r.op == "all_gather"]
    assert len(gathers) == 2 * units - 1
    assert [r.op for r in hpz.timeline.comms].count("all_reduce") == 1  # the norm only
    for backward in gathers[units + 1:]:  # within the node: at its links' rate, sharing them with reductions
        assert backward.nbytes * 3 / 4 / 100e9 <= backward.busy_s < backward.nbytes * 3 / 4 / 10e9
    arch = architecture(GPT, 2)
    full = estimate_memory(arch, c, TrainingSpec())
    assert hpz.memory.parameter_shards == full.parameter_shards
    assert hpz.memory.secondary_shards == pytest.approx(2 * sum(u.params for u in arch.units) / 4)
    pairs = predict(GPT, c, TrainingSpec(layout="hybrid", shard_group_size=2))
    assert pairs.memory.parameter_shards == pytest.approx(4 * arch.params / 2)
    assert [r.op for r in pairs.timeline.comms].count("all_reduce") == units + 1 + 1
    for bad in (3, 16):
        with pytest.raises(SpecError, match=f"shard_group_size {bad} must divide the cluster's 8 GPUs and either "):
            predict(GPT, c, TrainingSpec(layout="hybrid", shard_group_size=bad))
    with pytest.raises(SpecError, match="choose one of 1, 2, 4, 8, 24$"):  # 3, 6 and 12 divide 24, not a node's 8
        predict(GPT, cluster(3, 8), TrainingSpec(layout="zero1", shard_group_size=16))
    with pytest.raises(SpecError, match="shard_group_size applies to layout 'hybrid', 'hybrid_secondary' and 'zero1', not 'full'"):
        TrainingSpec(shard_group_size=2)


def test_gradient_accumulation_reduces_once():
    p = predict(GPT, cluster(), TrainingSpec(grad_accum=3))
    ops = [r.op for r in p.timeline.comms]
    assert ops.count("reduce_scatter") == GPT.layers + 1
    # per micro-batch: the root and the last two units (backward opens with them) once
    assert ops.count("all_gather") == 3 * (2 * GPT.layers - 1)


def test_sweep_scaling_efficiency_is_per_gpu_throughput_against_one_node():
    s = sweep(GPT, cluster(2, 4, inter=1.0), TrainingSpec(micro_batch=2), "nodes", [2, 4])
    one = s.reference
    assert one.cluster.nodes == 1 and one not in s.points
    for p, efficiency in zip(s.points, s.scaling_efficiency, strict=True):
        assert efficiency == pytest.approx(one.step_time_s / p.step_time_s)
    assert 0 < s.scaling_efficiency[1] < s.scaling_efficiency[0] < 1
    with pytest.raises(SpecError, match="cannot sweep 'hidden'"):
        sweep(GPT, cluster(), TrainingSpec(), "hidden", [1])


def test_a_changed_preset_gets_the_sizes_its_changes_give():
    """A preset's key and value heads, MLP width and head width that followed its heads and width
    follow the changes (a GPT given more heads became grouped-query attention, fewer were refused);
    those it sets itself (Llama 2 70B's 8 key and value heads, its MLP) stay."""
    from shardwire.sim.inputs import load_model

    def sizes(text: str) -> tuple[int, int, int, int]:
        model = load_model(text)
        return model.heads, model.kv_heads, model.ffn_hidden, model.head_width

    assert sizes("{preset: gpt-1.3b, heads: 32}") == (32, 32, 8192, 64)
    assert sizes("{preset: gpt-1.3b, heads: 8}") == (8, 8, 8192, 256)
    assert sizes("{preset: gpt-1.3b, hidden: 4096, params: null}") == (16, 16, 16384, 256)
    assert sizes("{preset: llama2-70b, heads: 32, params: null}") == (32, 8, 28672, 256)


def test_a_presets_published_count_checks_its_own_sizes_not_changed_ones():
    """The count a preset states is of its own sizes: a change of them is not held to it, while a
    count the changes give is checked."""
    from shardwire.sim.inputs import load_model

    assert architecture(load_model("{preset: llama2-7b, layers: 64}"), 2).params == pytest.approx(13.2e9, rel=0.01)
    with pytest.raises(SpecError, match="its sizes make 13,214,683,136 parameters but params says 6,700,000,000"):
        architecture(load_model("{preset: llama2-7b, layers: 64, params: 6.7e9}"), 2)


def test_a_sweep_of_nodes_one_node_cannot_run_has_no_efficiency_and_no_refusal():
    """Hybrid groups of two nodes' GPUs: every point swept runs, the 1-node reference cannot."""
    s = sweep(GPT, cluster(2, 4), TrainingSpec(layout="hybrid", shard_group_size=8), "nodes", [2, 4])
    assert [p.cluster.nodes for p in s.points] == [2, 4]
    assert s.reference is None and s.scaling_efficiency is None


# ------------------------------------------------------------------------------------- memory


def test_memory_model_by_hand():
    c = cluster(2, 4)  # 8 GPUs
    t = TrainingSpec(micro_batch=2, prefetch=1, precision="bf16", reduce_precision="fp32",
                     activation_checkpointing=True)
    arch = architecture(GPT, 2)
    m = estimate_memory(arch, c, t)
    P, unit = arch.params, arch.units[0].params
    assert m.parameter_shards + m.gradient_shards + m.optimizer_state == pytest.approx(16 * P / 8)
    # prefetch 1 + the running unit, and the running unit's gather while it is copied out
    assert m.gathered_parameters == 2 * (arch.root.params + 3 * unit)
    assert m.unit_gradients == 2 * unit
    assert m.communication_buffers == (REDUCTIONS_IN_FLIGHT + 1) * 4 * unit
    kept = GPT.layers * arch.units[0].boundary_bytes + arch.root.activation_bytes
    assert m.activations == 2 * (kept + arch.units[0].activation_bytes + arch.logits_bytes)
    assert m.usable == USABLE_FRACTION * 80 * GIB
    # made on the meta device before the step: fp32 shards, the root and one unit whole in fp32
    assert m.construction == 4 * P / 8 + 4 * (arch.root.params + unit) < m.total == m.peak


def test_a_model_too_large_to_make_does_not_fit_whatever_its_step_needs():
    """The root (embeddings, head) is made whole on every GPU: with a vocabulary large against the
    blocks, making the model can need more than the step."""
    wide = dataclasses.replace(GPT, vocab=4_000_000, seq_len=16)
    training = TrainingSpec(micro_batch=1, precision="bf16")
    m = estimate_memory(architecture(wide, 2), cluster(8, 8, memory_gb=4), training)
    assert m.total < m.usable < m.construction == m.peak  # 2.6 and 3.9 GiB against 3.7 usable
    assert not m.fits and m.shortfall == pytest.approx(m.construction - m.usable)
def test_memory_grows_without_resharding_or_checkpointing_and_reports_the_shortfall():
    c = cluster(2, 4, memory_gb=0.02)
    base = estimate_memory(architecture(GPT, 2), c, TrainingSpec(micro_batch=2))
    kept = estimate_memory(architecture(GPT, 2), c, TrainingSpec(micro_batch=2, reshard_after_forward=False))
    full = estimate_memory(architecture(GPT, 2), c, TrainingSpec(micro_batch=2, activation_checkpointing=True))
    assert kept.gathered_parameters > base.gathered_parameters
    assert full.activations < base.activations
    assert not base.fits and base.shortfall == pytest.approx(base.total - base.usable)


def test_t5_3b_preset_batch_takes_the_memory_t5_11b_takes_at_batch_50():
    """The document maximizes every batch and reports 11B's: 50. T5-3B (batch not stated) gets
    the largest batch that needs no more memory on one node than T5-11B at 50."""
    from shardwire.sim.presets import TRAININGS

    one_node = dataclasses.replace(CLUSTERS["ibm-a100-ethernet"], nodes=1)

    def memory(model, training, batch):
        t = dataclasses.replace(TRAININGS[training], micro_batch=batch)
        return estimate_memory(architecture(MODELS[model], 2), one_node, t).total

    limit = memory("t5-11b", "ibm-t5-11b-batch50-sliding", 50)
    batch = TRAININGS["ibm-t5-3b"].micro_batch
    assert memory("t5-3b", "ibm-t5-3b", batch) <= limit < memory("t5-3b", "ibm-t5-3b", batch + 1)


def test_presets_are_consistent():
    for model in MODELS.values():
        assert model.params is None or math.isclose(architecture(model, 2).params, model.params, rel_tol=0.05)
    for c in CLUSTERS.values():  # a node's NICs together at most match one GPU's NVLink (Grand Teton)
        assert c.inter_node.busbw_GBps <= c.intra_node.busbw_GBps
        # no more channels: the NICs set them, and a ring across nodes runs through the NVLinks too
        assert c.inter_node.compute_share <= c.intra_node.compute_share


# ------------------------------------------------------------------------------ compute model


def gpu(**changes) -> ClusterSpec:
    """One GPU of 100 TFLOP/s and 1000 GB/s, kernels at their peaks, and the changes."""
    base = dict(nodes=1, gpus_per_node=1, peak_tflops=100.0, gpu_memory_gb=80.0, intra_node=LinkSpec(1.0),
                inter_node=LinkSpec(1.0), memory_bandwidth_GBps=1000.0, matmul_efficiency=1.0,
                attention_efficiency=1.0, memory_efficiency=1.0)
    return ClusterSpec(**{**base, **changes})


def test_a_matrix_multiply_takes_its_flops_and_its_bytes():
    """The additive roofline: a square 4096 multiply is nearly all FLOPs, a skinny one (64 columns)
    nearly all bytes; backward runs two of each."""
    from shardwire.sim.architecture import Matmul, UnitCost
    from shardwire.sim.compute import backward_s, forward_s

    t = TrainingSpec(micro_batch=2)
    reached = {}
    for m, k, n in ((4096, 4096, 4096), (4096, 4096, 64)):
        unit = UnitCost("root", 0, 0.0, 0.0, 0.0, matmuls=(Matmul(m // 2, k, n),))
        flops_s, bytes_s = 2 * m * k * n / 100e12, 2 * (m * k + k * n + m * n) / 1000e9
        assert forward_s(unit, gpu(), t) == pytest.approx(flops_s + bytes_s)
        assert backward_s(unit, gpu(), t) == pytest.approx(2 * (flops_s + bytes_s))
        reached[n] = flops_s / forward_s(unit, gpu(), t)  # the fraction of peak it runs at
    assert reached[4096] > 0.9 and reached[64] < 0.5


def test_kernels_run_at_their_dtypes_peak_and_fp8_pays_for_its_casts():
    """fp8 multiplies run at their peak's share of the efficiency bf16 ones reach (twice the peak at
    0.8 of the share: 1.6 times as fast), and fp8 pays for its casts."""
    from shardwire.sim.architecture import Matmul, UnitCost
    from shardwire.sim.compute import FP8_MATMUL_RELATIVE, forward_s

    unit = UnitCost("block.0", 0, 0.0, 0.0, 0.0, matmuls=(Matmul(1024, 1024, 1024),))
    free_memory = dict(memory_bandwidth_GBps=None)
    bf16 = forward_s(unit, gpu(**free_memory), TrainingSpec())
    assert forward_s(unit, gpu(fp32_tflops=25.0, **free_memory), TrainingSpec(precision="fp32")) == 4 * bf16
    fp8 = TrainingSpec(precision="fp8")
    fp8_s = bf16 / 2 / FP8_MATMUL_RELATIVE
    assert forward_s(unit, gpu(fp8_tflops=200.0, **free_memory), fp8) == pytest.approx(fp8_s)
    with pytest.raises(SpecError, match="precision fp8 needs fp8 tensor cores"):
        forward_s(unit, gpu(), fp8)
    # with memory: 1-byte inputs, and each input read twice and written once in fp8 (weight too,
    # unless gathered in fp8)
    rows = k = n = 1024
    matmul_bytes = rows * k + k * n + 2 * rows * n
    casts = (rows * k + k * n) * (2 * 2 + 1)
    assert forward_s(unit, gpu(fp8_tflops=200.0), fp8) == pytest.approx(fp8_s + (matmul_bytes + casts) / 1000e9)
    gathered = TrainingSpec(precision="fp8", fp8_all_gather=True)
    assert forward_s(unit, gpu(fp8_tflops=200.0), gathered) == pytest.approx(
        fp8_s + (matmul_bytes + rows * k * 5) / 1000e9)


def test_attention_and_memory_bound_work():
    """Fused causal attention computes half its scores, backward 2.5 times forward; eager attention
    pays for materialized scores; compile moves fewer bytes than eager PyTorch."""
    from shardwire.sim.compute import backward_s, forward_s

    arch = architecture(GPT, 2)
    block = arch.units[0]
    (attention,) = block.attention
    no_matmuls = dataclasses.replace(block, matmuls=(), elementwise_bytes=0.0, fused_bytes=0.0)
    assert forward_s(no_matmuls, gpu(), TrainingSpec()) == pytest.approx(attention.flops / 2 / 100e12)
    assert backward_s(no_matmuls, gpu(), TrainingSpec()) == pytest.approx(2.5 * attention.flops / 2 / 100e12)
    eager = architecture(dataclasses.replace(GPT, attention="eager"), 2).units[0]
    assert forward_s(eager, gpu(), TrainingSpec()) > forward_s(block, gpu(), TrainingSpec())
    elementwise = dataclasses.replace(block, matmuls=(), attention=())
    assert forward_s(elementwise, gpu(), TrainingSpec()) == pytest.approx(block.elementwise_bytes / 1000e9)
    assert block.fused_bytes < block.elementwise_bytes
    rms = architecture(dataclasses.replace(GPT, norm="rmsnorm"), 2).units[0]
    assert rms.elementwise_bytes - block.elementwise_bytes == GPT.seq_len * 2 * 2 * (18 - 2) * GPT.hidden


def test_each_micro_batch_reduces_when_asked_and_keeps_no_unsharded_gradient():
    c = cluster()
    accumulating = predict(GPT, c, TrainingSpec(grad_accum=3))
    reducing = predict(GPT, c, TrainingSpec(grad_accum=3, reduce_each_micro_batch=True))
    assert [r.op for r in reducing.timeline.comms].count("reduce_scatter") == 3 * (GPT.layers + 1)
    arch = architecture(GPT, 2)
    assert accumulating.memory.unit_gradients - reducing.memory.unit_gradients == 4 * arch.params
    assert reducing.step_time_s > accumulating.step_time_s


def test_fp8_gathers_move_a_byte_per_weight():
    c = dataclasses.replace(cluster(), fp8_tflops=200.0)
    bf16 = predict(GPT, c, TrainingSpec(precision="fp8"))
    fp8 = predict(GPT, c, TrainingSpec(precision="fp8", fp8_all_gather=True))
    gathers = [(a.nbytes, b.nbytes, a.unit) for a, b in zip(bf16.timeline.comms, fp8.timeline.comms, strict=True)
               if a.op == "all_gather"]
    assert all(b == (a if unit == "root" else a / 2) for a, b, unit in gathers)
    assert fp8.memory.gathered_parameters < bf16.memory.gathered_parameters


@pytest.mark.parametrize("name", ["COLLECTIVES", "CollectiveLibrary", "P4D_LINE_GBPS", "P4D_SMDDP"])
def test_the_collective_libraries_moved_to_specs_are_found_in_presets_for_a_release(name):
    from shardwire import renamed
    from shardwire.sim import presets, specs

    with pytest.warns(renamed.RenamedWarning, match=f"shardwire.sim.presets.{name} is now shardwire.sim.specs.{name}"):
        assert getattr(presets, name) is getattr(specs, name)
