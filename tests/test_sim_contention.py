"""The simulator's contention model: collectives in flight take their level's share of compute, and
compute takes its share of their bandwidth."""

import pytest

from shardwire.sim.events import Link, Processor, Simulation
from shardwire.sim.planner import plan
from shardwire.sim.predict import predict
from shardwire.sim.presets import CLUSTERS, MODELS, TRAININGS
from shardwire.sim.report import prediction_json, prediction_text
from shardwire.sim.specs import SpecError, TrainingSpec, as_dict, parse

GPT = MODELS["gpt2-350m"]


def with_shares(cluster_name: str, nodes: int, intra: float, inter: float, bandwidth: float = 0.0):
    cluster = as_dict(CLUSTERS[cluster_name])
    cluster["intra_node"]["compute_share"] = intra
    cluster["inter_node"]["compute_share"] = inter
    cluster["intra_node"]["bandwidth_share"] = cluster["inter_node"]["bandwidth_share"] = bandwidth
    return parse("cluster", {**cluster, "nodes": nodes})


def run_job(seconds: float, holds: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(end, slowed_s) of one job of ``seconds`` started at 0, beside ``holds`` of (start, end, share)."""
    sim = Simulation()
    processor = Processor(sim)
    for start, end, share in holds:
        sim.at(start, lambda s=share: processor.hold(s))
        sim.at(end, lambda s=share: processor.release(s))
    done = processor.run(seconds)
    sim.run()
    return done.time, processor.slowed_s


def test_a_job_stretches_over_the_part_it_overlaps_a_holder():
    # Half a second at half the rate does 0.25 s of work; the other 0.75 s run at full rate.
    end, slowed = run_job(1.0, [(0.0, 0.5, 0.5)])
    assert end == pytest.approx(1.25)
    assert slowed == pytest.approx(0.25)


def test_holders_leave_each_other_their_share_of_what_is_left():
    end, _ = run_job(1.0, [(0.0, 10.0, 0.5), (0.0, 10.0, 0.5)])
    assert end == pytest.approx(4.0)  # a quarter of the rate throughout
    alone, slowed = run_job(1.0, [])
    assert (alone, slowed) == (pytest.approx(1.0), 0.0)


def test_a_holder_after_the_job_changes_nothing():
    end, slowed = run_job(1.0, [(2.0, 3.0, 0.9)])
    assert (end, slowed) == (pytest.approx(1.0), 0.0)


@pytest.mark.parametrize("nodes", [1, 4])
def test_the_step_is_compute_plus_its_slowdown_plus_exposed_communication(nodes):
    p = predict(GPT, with_shares("a100-100gbe", nodes, 0.3, 0.2), TrainingSpec(micro_batch=4))
    assert p.compute_slowed_s > 0
    assert p.step_time_s == pytest.approx(p.compute_time_s + p.compute_slowed_s + p.exposed_comm_s, rel=1e-9)


def test_no_share_no_slowdown_and_more_share_more_slowdown():
    training = TrainingSpec(micro_batch=4)
    shares = [0.0, 0.1, 0.3, 0.6]
    steps = [predict(GPT, with_shares("a100-100gbe", 4, s, s), training) for s in shares]
    assert steps[0].compute_slowed_s == 0.0
    slowed = [p.compute_slowed_s for p in steps]
    assert slowed == sorted(slowed) and slowed[-1] > slowed[1] > 0
    assert [p.compute_time_s for p in steps] == pytest.approx([steps[0].compute_time_s] * len(shares))


def test_each_level_slows_compute_only_while_its_collectives_run():
    """Two nodes of one GPU never use the intra-node level; one node never uses the network."""
    training = TrainingSpec(micro_batch=4)
    across = predict(GPT, parse("cluster", {**as_dict(with_shares("a100-100gbe", 2, 0.5, 0.0)), "gpus_per_node": 1}),
                     training)
    within = predict(GPT, with_shares("a100-100gbe", 1, 0.0, 0.5), training)
    assert across.compute_slowed_s == 0.0 and within.compute_slowed_s == 0.0


def test_a_slowed_link_moves_bytes_at_its_reduced_rate_until_restored():
    sim = Simulation()
    link = Link(sim, capacity=1.0)
    done = link.transfer(1.0)
    link.slow(0.5)  # half a byte in the first second, the other half at full rate
    sim.at(1.0, lambda: link.slow(0.0))
    sim.run()
    assert done.time == pytest.approx(1.5)


def test_compute_slows_communication_by_its_bandwidth_share():
    """Full sharding on slow links: collectives take longer while compute runs, so more of them is
    left exposed and the step grows; with no compute share, the compute itself is untouched."""
    training = TrainingSpec(micro_batch=4)
    free, taken = (predict(GPT, with_shares("a100-100gbe", 4, 0.0, 0.0, share), training) for share in (0.0, 0.5))
    assert taken.comm_s["all_gather"] > free.comm_s["all_gather"]
    assert taken.step_time_s > free.step_time_s and taken.exposed_comm_s > free.exposed_comm_s
    assert taken.compute_time_s == free.compute_time_s and taken.compute_slowed_s == 0.0


def test_report_and_json_say_how_much_compute_slowed():
    p = predict(GPT, with_shares("a100-100gbe", 4, 0.3, 0.2), TrainingSpec(micro_batch=4))
    text = prediction_text(p)
    assert f"compute slowed {100 * p.compute_slowdown:.0f}% by overlapped communication" in text
    doc = prediction_json(p)
    assert doc["compute_slowed_s"] == p.compute_slowed_s and doc["compute_slowdown"] == p.compute_slowdown


@pytest.mark.slow
def test_the_planner_chooses_differently_when_communication_slows_compute():
    """On p4d nodes, gathering each unit again for backward keeps gathers in flight most of the step:
    free, resharding after forward wins; taking the preset's SMs, gathering each unit once per step
    wins."""
    model, batch = MODELS["gpt-125m"], 512
    contended_cluster = parse("cluster", {**as_dict(CLUSTERS["a100-efa-400"]), "nodes": 4})
    free = plan(model, with_shares("a100-efa-400", 4, 0.0, 0.0), batch, TRAININGS["default"])
    contended = plan(model, contended_cluster, batch, TRAININGS["default"])
    assert free.best.training.reshards
    assert not contended.best.training.reshards
    # Run on the contended cluster, the choice made without contention is slower than the new one.
    assert predict(model, contended_cluster, free.best.training).step_time_s > contended.best.step_time_s


@pytest.mark.parametrize("share, message", [(1.0, "over 0.99"), (-0.1, "at least 0")])
def test_a_share_outside_its_range_is_refused(share, message):
    with pytest.raises(SpecError, match=message):
        with_shares("a100-100gbe", 2, 0.0, share)


def test_a_selective_policy_recomputes_and_keeps_in_between():
    model, cluster = MODELS["llama3.1-8b"], CLUSTERS["h100-ib-400"]
    points = [predict(model, cluster, TrainingSpec(micro_batch=1, **kwargs)) for kwargs in (
        {}, {"activation_checkpointing": True, "recompute_fraction": 0.4}, {"activation_checkpointing": True})]
    backward = [p.timeline.compute["backward"] for p in points]
    activations = [p.memory.activations for p in points]
    assert backward[0] < backward[1] < backward[2]
    assert activations[0] > activations[1] > activations[2]
    with pytest.raises(SpecError, match="recompute_fraction applies with activation_checkpointing"):
        TrainingSpec(recompute_fraction=0.5)
