"""Pricing node failures (``shardwire.sim.failures``): restarting from a checkpoint against recovering
the lost group live, the model's limits, Young's interval and cases by hand, and ``--node-mtbf``."""

from __future__ import annotations

import json
import math

import pytest

from shardwire.cli import main
from shardwire.sim import failures
from shardwire.sim.architecture import architecture
from shardwire.sim.failures import FailureRate, price
from shardwire.sim.predict import predict
from shardwire.sim.presets import CLUSTERS, MODELS
from shardwire.sim.specs import SpecError, TrainingSpec, as_dict, parse

FULL = TrainingSpec(micro_batch=4)
HYBRID = TrainingSpec(micro_batch=4, layout="hybrid")
DILOCO = TrainingSpec(micro_batch=4, layout="hybrid", diloco="sync_every=20")
# Small enough that a plan takes a second: 2 nodes of 2 GPUs, one sequence each.
PLAN = ["plan", "--model", "gpt-125m", "--cluster", "{preset: a100-100gbe, gpus_per_node: 2}", "--nodes", "2",
        "--global-batch", "4"]
SIMULATE = ["simulate", "--model", "gpt2-125m", "--cluster", "a100-100gbe", "--nodes", "2"]


def on_nodes(nodes: int, **changes):
    return parse("cluster", {**as_dict(CLUSTERS["a100-100gbe"]), "nodes": nodes, **changes})


def priced(training: TrainingSpec, nodes: int, node_mtbf_h: float):
    return price(predict(MODELS["gpt2-125m"], on_nodes(nodes), training), FailureRate(node_mtbf_h))


def run(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_young_interval_and_goodputs_by_hand():
    # sqrt(2 x 50 s x 36,000 s) = sqrt(3.6e6)
    assert failures.young_interval_s(50, 36_000) == pytest.approx(1897.367, rel=1e-6)
    # 3,600 / 3,660 of the time between saves, of what a failure's 120 + 3,660 / 2 s leave of 36,000
    assert failures.restart_goodput(3600, 60, 120, 36_000) == pytest.approx(0.9303279, rel=1e-6)
    # a failure costs the lost node 100 s and each of the 4 others 10 s, once in 36,000 s of each node
    assert failures.live_goodput(100, 10, 5, 36_000) == pytest.approx(1 - 140 / 36_000)
    assert failures.job_mtbf_s(10, 4) == 9000
    assert failures.restart_goodput(60, 60, 120, 100) == 0  # failures faster than a restart keep nothing


def test_young_interval_loses_the_least():
    save_s, restart_s, mtbf_s = 30.0, 90.0, 50_000.0
    best = failures.young_interval_s(save_s, mtbf_s)
    kept = failures.restart_goodput(best, save_s, restart_s, mtbf_s)
    for other in (best / 2, best * 0.9, best * 1.1, best * 2):
        assert failures.restart_goodput(other, save_s, restart_s, mtbf_s) < kept


def test_nodes_that_never_fail_cost_nothing():
    mtbfs = (10, 1000, failures.MAX_NODE_MTBF_H)
    costs = [priced(DILOCO, 4, mtbf) for mtbf in mtbfs]
    for way in ("restart", "live_recovery"):
        goodputs = [getattr(c, way).goodput for c in costs]
        assert goodputs[0] < goodputs[1] < goodputs[2] == pytest.approx(1, abs=1e-5)
    never = costs[-1]
    assert never.restart.effective_step_time_s == pytest.approx(never.restart.step_time_s, rel=1e-5)
    assert never.live_recovery.effective_step_time_s == pytest.approx(never.live_recovery.step_time_s, rel=1e-5)


@pytest.mark.parametrize("training", [FULL, HYBRID], ids=["full", "hybrid"])
def test_more_nodes_fail_more_often_and_a_restart_keeps_less(training):
    costs = [priced(training, nodes, 500) for nodes in (2, 8, 32)]
    assert costs[0].job_mtbf_h == 250 and costs[2].job_mtbf_h == pytest.approx(500 / 32)
    goodputs = [c.restart.goodput for c in costs]
    assert goodputs[0] > goodputs[1] > goodputs[2]


def test_live_recovery_beats_a_restart_when_failures_are_frequent():
    """It keeps more of the cluster's time at the same step (the sync crosses as the DiLoCo wire
    says under fault tolerance too), so it costs less per kept step, by more as failures come more
    often."""
    rare, frequent = priced(DILOCO, 16, 100_000), priced(DILOCO, 16, 2)
    for costs in (rare, frequent):
        assert costs.live_recovery.goodput > costs.restart.goodput
        assert costs.live_recovery.step_time_s == costs.restart.step_time_s
        assert costs.live_recovery.effective_step_time_s < costs.restart.effective_step_time_s
    gain = [c.restart.effective_step_time_s / c.live_recovery.effective_step_time_s for c in (rare, frequent)]
    assert 1 < gain[0] < gain[1]


def test_what_a_checkpoint_and_a_recovery_move_comes_from_the_memory_model():
    params = architecture(MODELS["gpt2-125m"], 2).params
    full = predict(MODELS["gpt2-125m"], on_nodes(2), FULL)  # 8 of 16 GPUs' shards per node
    assert failures.checkpoint_bytes(full) == pytest.approx((4 + 8) * params / 2)
    diloco = predict(MODELS["gpt2-125m"], on_nodes(2), DILOCO)  # a group per node: the whole model
    assert failures.checkpoint_bytes(diloco) == pytest.approx((4 + 8 + 8) * params)
    assert failures.recovery_bytes(diloco) == pytest.approx((8 + 8) * params)
    tiny = predict(MODELS["tiny"], on_nodes(3, gpus_per_node=1), TrainingSpec(layout="hybrid", diloco="sync_every=5"))
    assert failures.recovery_bytes(tiny) == 16 * 46_304  # BENCHMARKS.md's lost group received 0.754 MB


@pytest.mark.parametrize("cluster, training, why", [
    (on_nodes(2), FULL, "layout full needs every node at every step"),
    (on_nodes(1), DILOCO, "one node is one group"),
    (on_nodes(1), HYBRID, "one node is one group"),
    (on_nodes(2), TrainingSpec(layout="hybrid", shard_group_size=4, diloco="sync_every=20"),
     "give groups of a node's 8 GPUs, not 4"),
])
def test_live_recovery_only_where_fault_tolerance_runs(cluster, training, why):
    assert why in failures.why_no_live_recovery(cluster, training)
    costs = price(predict(MODELS["gpt2-125m"], cluster, training), FailureRate(100))
    assert costs.live_recovery is None and why in costs.no_live_recovery


def test_groups_meeting_at_every_step_lose_a_step_and_recover_the_parameters_too():
    """Fault-tolerant HSDP (hybrid without DiLoCo): a failure drops the step it struck for every
    group, the lost group waits half a step for the others' next, adds nothing to that one, and
    receives its shards of the parameters and Adam's moments (12 bytes a parameter, a node's GPUs
    holding the whole model)."""
    p = predict(MODELS["gpt2-125m"], on_nodes(2), HYBRID)
    assert failures.why_no_live_recovery(p.cluster, p.training) is None
    params = architecture(MODELS["gpt2-125m"], 2).params
    assert failures.recovery_bytes(p) == pytest.approx((4 + 8) * params)
    live = price(p, FailureRate(10)).live_recovery
    transfer_s = failures.recovery_bytes(p) / (p.cluster.inter_node.busbw_GBps * 1e9)
    assert live.step_time_s == p.step_time_s
    assert live.lost_group_s == pytest.approx(2.5 * p.step_time_s + failures.RELAUNCH_S + transfer_s)
    assert live.other_group_s == pytest.approx(failures.HEARTBEAT_S + p.step_time_s + transfer_s)


def test_fragments_recover_live_sooner_and_lose_a_fragments_sync():
    """Syncing in F fragments, a lost group rejoins at the next fragment's sync (H / 2F steps away on
    average, not H / 2), and a failure drops a fragment's sync, not the whole model's."""
    recoveries = {}
    for fragments in (1, 4):
        training = TrainingSpec(layout="hybrid", diloco=f"sync_every=20,fragments={fragments}")
        priced_ = price(predict(MODELS["gpt2-125m"], on_nodes(2), training), FailureRate(100))
        assert priced_.no_live_recovery is None
        recoveries[fragments] = live = priced_.live_recovery
        fixed = failures.RELAUNCH_S + live.recovery_bytes / (on_nodes(2).inter_node.busbw_GBps * 1e9)
        assert live.lost_group_s == pytest.approx(10 * (1 + 1 / fragments) * live.step_time_s + fixed)
    dropped = {f: r.other_group_s - failures.HEARTBEAT_S for f, r in recoveries.items()}
    assert dropped[4] < dropped[1]


def test_a_given_interval_is_kept_and_costs_more_than_young():
    young, given = (priced(FULL, 8, 100).restart,
                    price(predict(MODELS["gpt2-125m"], on_nodes(8), FULL), FailureRate(100, save_every=10)).restart)
    assert young.young and not given.young and given.save_every == 10
    assert given.goodput < young.goodput


def test_simulate_prices_failures_as_computed_by_hand(capsys):
    status, out, _ = run(capsys, *SIMULATE, "--node-mtbf", "100", "--json")
    doc = json.loads(out)
    restart, step = doc["failures"]["restart"], doc["step_time_s"]
    params = architecture(MODELS["gpt2-125m"], 2).params
    save_s = 12 * params / 2 / 1e9  # full sharding: 8 of the 16 GPUs' fp32 parameters and moments, at 1 GB/s
    mtbf_s = 100 * 3600 / 2
    every = round(math.sqrt(2 * save_s * mtbf_s) / step)
    cycle = every * step + save_s
    goodput = every * step / cycle * (1 - (60 + save_s + cycle / 2) / mtbf_s)
    assert status == 0 and doc["failures"]["job_mtbf_h"] == 50
    assert restart["save_every"] == every and restart["young"]
    assert restart["save_s"] == pytest.approx(save_s) and restart["restart_s"] == pytest.approx(60 + save_s)
    assert restart["goodput"] == pytest.approx(goodput, rel=1e-9)
    assert restart["effective_step_time_s"] == pytest.approx(step / goodput, rel=1e-9)
    assert doc["failures"]["live_recovery"] is None and "layout full needs" in doc["failures"]["no_live_recovery"]
    status, out, _ = run(capsys, *SIMULATE, "--node-mtbf", "100")
    assert status == 0
    assert "failures  a node lost every 100 h on average: the job's 2 nodes, one every 50 h" in out
    assert f"restart from checkpoint  goodput {100 * goodput:.3f}%, effective step {step / goodput:.4g} s; " \
           f"a checkpoint every {every:,} steps" in out


def test_failures_faster_than_a_restart_keep_no_step(capsys):
    status, out, _ = run(capsys, *SIMULATE, "--node-mtbf", "0.001", "--json")
    restart = json.loads(out)["failures"]["restart"]
    assert status == 0 and restart["goodput"] == 0 and restart["effective_step_time_s"] is None
    status, out, _ = run(capsys, *SIMULATE, "--node-mtbf", "0.001")
    assert "goodput 0: failures come faster than the job recovers, no step is kept" in out


def test_a_checkpoint_interval_longer_than_failures_allow_is_named_as_the_cause(capsys):
    """A job failing every 12.5 h, restarting in a minute, saving every 42 h: its goodput 0 was said
    to be failures faster than the job recovers, where saving more often is the remedy."""
    status, out, _ = run(capsys, *SIMULATE, "--node-mtbf", "25", "--save-every", "10000000")
    said = ("goodput 0: each failure costs a restart and half a checkpoint interval of steps done again, more than "
            "the time between failures; no step is kept (a smaller --save-every keeps some)")
    assert status == 0 and said in out, out
    status, out, _ = run(capsys, *SIMULATE, "--node-mtbf", "0.001", "--save-every", "10000000")
    assert "goodput 0: failures come faster than the job recovers" in out, out  # no interval would keep a step


def test_plan_prices_its_choice_and_the_diloco_one(capsys):
    status, out, _ = run(capsys, *PLAN, "--node-mtbf", "5", "--json")
    doc = json.loads(out)
    best, diloco = doc["best"]["failures"], doc["diloco"]["failures"]
    assert status == 0 and "failures" not in doc["runner_up"]
    assert doc["best"]["training"]["layout"] == "hybrid"  # groups of a node's GPUs: they meet at every step
    for costs in (best, diloco):
        assert costs["live_recovery"]["goodput"] > costs["restart"]["goodput"]
    assert diloco["assumptions"] == {"relaunch_s": 60, "storage_GBps": 1, "heartbeat_s": 5}
    status, out, _ = run(capsys, *PLAN, "--node-mtbf", "5", "--save-every", "1000")
    tail = out.splitlines()[-7:]
    assert status == 0 and tail[1] == "failures  a node lost every 5 h on average: the job's 2 nodes, one every 2.5 h"
    assert tail[2].startswith("  best    restart from checkpoint  goodput ") and "every 1,000 steps" in tail[2]
    assert tail[3].startswith("          live recovery            goodput ") and "sent to it" in tail[3]
    assert tail[4].startswith("  diloco  restart from checkpoint  goodput ")
    assert tail[5].startswith("          live recovery            goodput ") and "sent to it" in tail[5]
    assert tail[6].startswith("  assumed   a restart relaunches in 60 s")
    status, out, _ = run(capsys, *PLAN)
    assert status == 0 and "failures" not in out


@pytest.mark.parametrize("command", [PLAN, SIMULATE], ids=["plan", "simulate"])
@pytest.mark.parametrize("options, message", [
    (["--node-mtbf", "0"], "--node-mtbf must be positive and finite, got 0: give a node's mean time between failures"),
    (["--node-mtbf", "-3"], "--node-mtbf must be positive and finite, got -3"),
    (["--node-mtbf", "nan"], "--node-mtbf must be positive and finite, got nan"),
    (["--node-mtbf", "inf"], "--node-mtbf must be positive and finite, got inf"),
    (["--node-mtbf", "1e10"], "--node-mtbf 1e+10 is over 1,000,000,000 hours"),
    (["--node-mtbf", "5", "--save-every", "0"], "--save-every must be from 1 to 1,000,000,000,000"),
    (["--save-every", "100"], "--save-every sets the checkpoints of --node-mtbf's pricing: give --node-mtbf HOURS"),
])
def test_bad_failure_rates_say_what_to_give(capsys, command, options, message):
    status, out, err = run(capsys, *command, *options)
    assert status == 2 and out == "" and err == f"error: {err.removeprefix('error: ').splitlines()[0]}\n"
    assert message in err


def test_a_sweep_is_not_priced(capsys):
    status, out, err = run(capsys, *SIMULATE, "--sweep", "nodes=1,2", "--node-mtbf", "5")
    assert status == 2 and out == ""
    assert err == "error: --node-mtbf prices the failures of one configuration: leave out --sweep\n"


def test_a_failure_rate_is_checked_where_it_is_made():
    with pytest.raises(SpecError, match="--node-mtbf must be positive"):
        FailureRate(math.nan)
