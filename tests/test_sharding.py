"""Sharding layouts: what each holds and sends, the checks that refuse a layout that cannot run,
checkpoints across layouts, and the planner naming only layouts the engine runs.

Training parity of every layout against a single process is in ``test_engine_correctness``."""

from __future__ import annotations

import math
import pathlib
import warnings

import pytest
import torch
from safetensors import safe_open

import shardwire
from harness import run_workers
from shardwire.engine.shard import engine_of
from shardwire.engine.diloco import DiLoCo
from shardwire.engine.layout_plan import LayoutPlan
from shardwire.models.gpt import GPT, PRESETS, Block, loss_fn
from test_checkpoint import assert_same, full_optimizer_state, group_settings, make_model, train

LAYOUTS = ("full", "hybrid", "hybrid_secondary")
GROUP = 2  # world 4 placed as two nodes of two ranks


# ----------------------------------------------------------------------------- refused layouts


@pytest.mark.parametrize("layout, size, world, message", [
    ("hybrid", 3, 4, "shard_group_size=3 does not divide the 4 ranks of the process group: choose one of 1, 2, 4"),
    ("hybrid_secondary", 8, 4, "shard_group_size=8 does not divide"),
    ("hybrid", None, 1, "layout='hybrid' shards within groups and replicates across them, which needs more "
                        "than one rank"),
    ("full", 2, 4, "layout='full' splits every buffer over all 4 ranks of the process group, so "
                   "shard_group_size=2 contradicts it"),
    ("zero3", None, 4, "layout must be one of 'full', 'hybrid', 'hybrid_secondary', got 'zero3'"),
    ("hybrid", 0, 4, "shard_group_size must be a positive integer"),
    ("hybrid", 2.0, 4, "shard_group_size must be a positive integer"),
])
def test_a_layout_that_cannot_run_is_refused_saying_why(layout, size, world, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LayoutPlan.make(layout, size, world, ranks_per_node=world)


def test_group_size_defaults_to_the_ranks_of_a_node():
    assert LayoutPlan.make("hybrid", None, 8, ranks_per_node=4).group == 4
    assert LayoutPlan.make("hybrid_secondary", 2, 8, ranks_per_node=4).group == 2
    assert LayoutPlan.make("full", None, 8, ranks_per_node=4).group == 8
    assert LayoutPlan.make("hybrid", None, 8, ranks_per_node=4, one_group=True).group == 8  # a fault-tolerant job


@pytest.mark.parametrize("layout, size, diloco, split, backward, across, kept, full", [
    ("full", None, None, 8, 8, False, False, True),
    ("hybrid", 4, None, 4, 4, True, False, False),
    ("hybrid", 4, "sync_every=20", 4, 4, False, False, False),  # the groups sync every H steps instead
    ("hybrid", 8, None, 8, 8, False, False, True),  # one group: the full layout
    ("hybrid", 8, "sync_every=20", 8, 8, False, False, False),  # one group with DiLoCo: Lookahead
    ("hybrid_secondary", 2, None, 8, 2, False, True, False),
    ("hybrid_secondary", 8, None, 8, 8, False, False, True),
])
def test_a_plan_says_what_each_collective_spans(layout, size, diloco, split, backward, across, kept, full):
    """The table of shardwire.engine.layout_plan, as the engine and the simulator read it."""
    plan = LayoutPlan.make(layout, size, 8, ranks_per_node=4, diloco=DiLoCo.parse(diloco))
    assert (plan.split_over, plan.backward_gather_over, plan.reduces_across_groups, plan.keeps_secondary,
            plan.as_full) == (split, backward, across, kept, full)


def test_diloco_needs_the_hybrid_layout():
    with pytest.raises(ValueError, match=r"diloco lets the groups of the hybrid layout train apart"):
        LayoutPlan.make("full", None, 8, ranks_per_node=4, diloco=DiLoCo.parse("sync_every=20"))


def test_hybrid_on_one_rank_is_refused_before_any_collective():
    with pytest.raises(ValueError, match="needs more than one rank"):
        shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], layout="hybrid")


# --------------------------------------------------------------- what each layout holds and sends


def _one_step(model) -> None:
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()


def _held_and_sent(rank, world):
    """Per layout: the state bytes this rank holds at the step's peak (shards, gradients, Adam's
    moments, secondary shards) beside the README's bound, and the collectives of one step."""
    results = {}
    for layout in LAYOUTS:
        torch.manual_seed(0)
        # prefetch 0: backward's first gathers, which consume secondary shards, wait for backward
        model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], layout=layout, prefetch=0)
        engine = engine_of(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _one_step(model)  # records the order
        optimizer.step()
        optimizer.zero_grad()
        secondary = []

        def at_backward_start(phase, unit, edge, flats=engine.flats):
            if (phase, unit, edge) == ("backward", None, "start"):  # every unit's secondary shard kept
                secondary.append(sum(f._secondary.nbytes for f in flats if f._secondary is not None))

        engine.add_listener(at_backward_start)
        with engine.record() as records:
            _one_step(model)
        optimizer.step()
        held = sum(t.to_local().nbytes for p in model.parameters() for t in (p, p.grad, *optimizer.state[p].values())
                   if t is not None and t.dim() > 0) + secondary[0]
        over = GROUP if layout == "hybrid" else world

        def rows(units, ranks):  # elements a rank holds at most: each parameter's rows, a ``ranks``-th rounded up
            return sum(math.ceil(p.shape[0] / ranks) * math.prod(p.shape[1:]) for unit in units
                       for f in unit.flats for p in f.params)

        bound = 16 * rows([engine.root, *engine.units], over)
        if layout == "hybrid_secondary":
            bound += 4 * rows(engine.units, GROUP)  # fp32: the compute dtype here
        ops = {}
        for record in records:
            if record.tag not in ("grad norm", "order check"):
                ops.setdefault(record.op, []).append(record.nbytes)
        results[layout] = {"held": held, "bound": bound, "ops": ops,
                           "shards": [flat.shard.numel() for flat in engine.flats],
                           "buffers": [flat.packing.padded_numel for flat in engine.flats]}
    return results


@pytest.fixture(scope="module")
def held_and_sent():
    return run_workers(4, _held_and_sent, env={"LOCAL_WORLD_SIZE": str(GROUP)})[0]


@pytest.mark.slow
def test_each_layout_holds_no_more_than_its_memory_formula(held_and_sent):
    for layout, result in held_and_sent.items():
        assert 0.9 * result["bound"] <= result["held"] <= result["bound"], layout
    assert held_and_sent["hybrid"]["held"] > 1.8 * held_and_sent["full"]["held"]  # a group's share, not the world's


@pytest.mark.slow
def test_each_layout_issues_the_collectives_it_promises(held_and_sent):
    """One step of 3 blocks and the root, each one buffer: bytes as ``shardwire.engine.layout``
    says, over the ranks it says (a shard is the buffer over the ranks that split it)."""
    full, hybrid, secondary = (held_and_sent[layout] for layout in LAYOUTS)
    for result in (full, hybrid, secondary):
        buffers = result["buffers"]
        # the root and the last block (with prefetch 0 backward opens with it alone) once
        gathered = [*buffers, *buffers[1:-1]]
        assert sorted(result["ops"]["all_gather"]) == sorted(4 * n for n in gathered)
        assert sorted(result["ops"]["reduce_scatter"]) == sorted(4 * n for n in buffers)
    assert full["shards"] == [n // 4 for n in full["buffers"]]
    assert secondary["shards"] == [n // 4 for n in secondary["buffers"]]
    assert hybrid["shards"] == [n // GROUP for n in hybrid["buffers"]]
    # only hybrid all-reduces between groups: each rank's reduced shard, with the other group's rank
    assert "all_reduce" not in full["ops"] and "all_reduce" not in secondary["ops"]
    assert sorted(hybrid["ops"]["all_reduce"]) == sorted(4 * n for n in hybrid["shards"])


# ------------------------------------------------------------------ checkpoints across layouts


def _save_hybrid(rank, world, root):
    model, optimizer = make_model(seed=0, layout="hybrid")
    train(model, optimizer, range(3), rank, world)
    optimizer.param_groups[1]["lr"] = 5e-4
    shardwire.save_checkpoint(pathlib.Path(root) / "hybrid", model, optimizer, step=3)
    return {"params": shardwire.full_state_dict(model), "optimizer": full_optimizer_state(model, optimizer),
            "groups": group_settings(optimizer)}


def _load_as(rank, world, path, layout):
    model, optimizer = make_model(seed=7, layout=layout)
    info = shardwire.load_checkpoint(path, model, optimizer)
    return {"info": (info.step, info.world_size), "params": shardwire.full_state_dict(model),
            "optimizer": full_optimizer_state(model, optimizer), "groups": group_settings(optimizer)}


@pytest.mark.slow
def test_a_hybrid_checkpoint_loads_in_any_layout_and_world(tmp_path):
    """Saved hybrid on 2 nodes x 2 ranks, by the first group's ranks only; loaded full at 3 ranks and
    hybrid at 2 nodes x 1 rank (each rank a whole replica): every weight, moment, step count and
    param group exactly."""
    saved = run_workers(4, _save_hybrid, str(tmp_path), env={"LOCAL_WORLD_SIZE": "2"})[0]
    path = tmp_path / "hybrid"
    with safe_open(str(path / "rank_00002.safetensors"), framework="pt") as second_group:
        assert not any(key.startswith(("param/", "optim")) for key in second_group.keys())
    cases = [run_workers(3, _load_as, str(path), "full")[0],
             run_workers(2, _load_as, str(path), "hybrid", env={"LOCAL_WORLD_SIZE": "1"})[0]]
    for loaded in cases:
        assert loaded["info"] == (3, 4)
        assert loaded["groups"] == saved["groups"]
        assert_same(loaded["params"], saved["params"])
        assert_same(loaded["optimizer"], saved["optimizer"])



# ------------------------------------------------------------- the planner names what runs


def _plans_run(rank, world, calls):
    for shard_args in calls:
        torch.manual_seed(0)
        model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], **shard_args)
        _one_step(model)
    return len(calls)


@pytest.mark.slow
def test_every_configuration_the_planner_can_name_runs(monkeypatch):
    """Every candidate of a plan for 2 nodes x 2 GPUs, as ``shard(...)`` arguments on 4 ranks placed
    so, and as ``shardwire train`` options checked as its workers would be under torchrun."""
    import argparse

    from shardwire.cli import train as train_command
    from shardwire.options import config_from
    from shardwire.training.config import TrainConfig
    from shardwire.sim.planner import candidate_settings, runnable
    from shardwire.sim.presets import CLUSTERS
    from shardwire.sim.specs import TrainingSpec, as_dict, parse

    cluster = parse("cluster", {**as_dict(CLUSTERS["a100-100gbe"]), "nodes": 2, "gpus_per_node": 2})
    candidates = candidate_settings(4, cluster, TrainingSpec(limiter="block", reduce_precision="bf16"))
    assert {t.layout for t in candidates} == {"full", "grad_op", "hybrid", "hybrid_secondary"}
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    for t in candidates:
        assert (t.limiter, t.reduce_precision) == ("sliding", "fp32")  # what the engine runs
        options, shard_args = runnable(t, cluster)
        train_command._validate(config_from(parser.parse_args(options), TrainConfig), {})  # exits otherwise
        if shard_args not in calls:
            calls.append(shard_args)
    assert run_workers(4, _plans_run, calls, env={"LOCAL_WORLD_SIZE": "2"})[0] == len(calls)


def _different_layouts(rank, world):
    try:
        shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], layout="hybrid" if rank == 0 else "full")
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.slow
def test_ranks_asking_for_different_layouts_are_told_before_any_group_is_made():
    for message in run_workers(2, _different_layouts, timeout=60, env={"LOCAL_WORLD_SIZE": "1"}):
        assert "ranks asked for different layouts (rank 0: layout='hybrid' in groups of 1; " \
               "rank 1: layout='full' in groups of 2)" in message


# ---------------------------------------------- layout's name before the rename, kept for a release


def test_shard_takes_sharding_as_layout_with_a_warning_and_refuses_both():
    with pytest.warns(FutureWarning, match=r"shard\(sharding=...\) is renamed shard\(layout=...\); the old name goes"):
        with pytest.raises(ValueError, match="layout='hybrid' shards within groups and replicates across them"):
            shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], sharding="hybrid")
    for layout in ("hybrid", "full"):  # "full" is layout's default: given, it is refused all the same
        with pytest.raises(ValueError, match="shard\\(\\) got both layout= and sharding=, its old name: give layout= alone"):
            shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], layout=layout, sharding="hybrid")


def test_the_warning_for_an_old_keyword_points_at_the_callers_line():
    with pytest.warns(FutureWarning) as caught, pytest.raises(ValueError):
        shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], sharding="bogus")
    assert caught[0].filename == __file__


@pytest.mark.parametrize("argv", [["--sharding", "hybrid", "--layout", "full"], ["--layout", "full", "--sharding", "hybrid"]])
def test_an_option_given_under_its_old_and_new_name_is_refused_in_one_line(argv, capsys):
    from shardwire.cli import main
    with warnings.catch_warnings(record=True) as warned:  # the line refused, no warning of the old name before it
        warnings.simplefilter("always")
        with pytest.raises(SystemExit):
            main(["train", "--print-config", *argv])
    assert not warned
    assert capsys.readouterr().err.splitlines() == [
        "error: --sharding and --layout are the same option (--sharding is its name before a rename): give "
        "--layout alone (see shardwire train --help)"]


def test_the_train_option_config_key_and_spec_key_sharding_are_read_as_layout_with_a_warning(tmp_path, capsys):
    from shardwire.cli import main
    from shardwire.sim.specs import parse
    from shardwire.training.config import TrainConfig, changed_settings, training_settings

    launch = ["train", "--print-launch", "--nproc", "2", "--shard-group-size", "1"]
    with pytest.warns(FutureWarning, match="--sharding is renamed --layout"):
        assert main([*launch, "--sharding", "hybrid"]) == 0
    assert "--layout hybrid" in capsys.readouterr().out
    path = tmp_path / "job.json"
    path.write_text('{"sharding": "hybrid"}')
    with pytest.warns(FutureWarning, match="sharding is renamed layout"):
        assert main([*launch, "--config", str(path)]) == 0
    assert "--layout hybrid" in capsys.readouterr().out
    with pytest.warns(FutureWarning, match="training: sharding is renamed layout"):
        assert parse("training", {"sharding": "hybrid"}).layout == "hybrid"
    config = TrainConfig(layout="hybrid")
    recorded = {**{k: v for k, v in training_settings(config).items() if k != "layout"}, "sharding": "hybrid"}
    assert changed_settings(recorded, config) == {}  # a checkpoint saved before the rename resumes as it was
