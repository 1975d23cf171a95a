"""DiLoCo, syncing every H steps across groups (and Streaming DiLoCo): the settings and their checks,
the outer step against a hand-computed reference, H=1 against synchronous training, a quantized sync,
the fragments' schedule, checkpoints taken while a sync is in flight, the training job's option, and
the names before the rename (``Sync``, ``every``, ``overlap``, ``sync=``, ``--sync``, ``sync_now``),
which still work for a release and warn.

Quality over a whole run, against synchronous training at equal tokens: ``benchmarks/sync_quality.py``."""

from __future__ import annotations

import contextlib
import json
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

import shardwire
from harness import run_workers
from shardwire.cli import main
from shardwire.engine.diloco import DiLoCo
from shardwire.engine.layout_plan import LayoutPlan
from shardwire.models.gpt import GPT, PRESETS, Block, loss_fn

# ------------------------------------------------------------------------------------ settings


def test_sync_settings_parse_and_round_trip():
    assert DiLoCo.parse(None) is None and DiLoCo.parse("none") is None
    assert DiLoCo.parse("sync_every=50,fragments=4,wire=int8") == DiLoCo(sync_every=50, fragments=4, wire="int8")
    assert (DiLoCo.parse("sync_every=5, wire=none, fragment_sync_delay=0")
            == DiLoCo(sync_every=5, wire=None, fragment_sync_delay=0))
    for diloco in (DiLoCo(), DiLoCo(sync_every=7, fragments=3, wire=None, outer_lr=0.5, momentum=0.0,
                                    fragment_sync_delay=1)):
        assert DiLoCo.parse(str(diloco)) == diloco
    assert str(DiLoCo()) == "sync_every=20,fragments=1,wire=int4,outer_lr=0.7,momentum=0.9,fragment_sync_delay=0"
    # DiLoCo's outer step on the whole model, waiting for each sync
    assert DiLoCo() == DiLoCo(sync_every=20, fragments=1, wire="int4", outer_lr=0.7, momentum=0.9,
                              fragment_sync_delay=0)
    # "none", the delay's default before it was 0, names the same run
    assert (DiLoCo.parse("sync_every=5,fragment_sync_delay=none") == DiLoCo(sync_every=5, fragment_sync_delay=None)
            == DiLoCo(sync_every=5))


def test_each_fragment_syncs_once_every_h_steps_at_staggered_steps():
    sync = DiLoCo(sync_every=50, fragments=4)
    due = {step: sync.due(step) for step in range(1, 201) if sync.due(step) is not None}
    assert list(due.items())[:4] == [(12, 0), (25, 1), (37, 2), (50, 3)]  # as torchft places them
    for fragment in range(4):
        steps = [step for step, f in due.items() if f == fragment]
        assert len(steps) == 4 and all(b - a == 50 for a, b in zip(steps, steps[1:]))
    assert [step for step in range(1, 61) if DiLoCo(sync_every=20, fragments=1).due(step) is not None] == [20, 40, 60]


@pytest.mark.parametrize("text, message", [
    ("sync_every=0", "diloco sync_every must be a positive integer"),
    ("sync_every=2.5", "diloco sync_every must be a positive integer, got '2.5'"),
    ("sync_every=4,fragments=5", "diloco fragments=5 is more than sync_every=4"),
    ("wire=int2", "diloco wire must be none, 'int8' or 'int4'"),
    ("outer_lr=0", "diloco outer_lr must be a positive number"),
    ("outer_lr=nan", "diloco outer_lr must be a positive number"),
    ("momentum=1", "diloco momentum must be at least 0 and below 1"),
    ("sync_every=8,fragments=2,fragment_sync_delay=5",
     "diloco fragment_sync_delay must be an integer from 0 to sync_every // fragments = 4"),
    ("fast", "diloco 'fast' is not understood"),
    ("sync_every=5,speed=2", "is not understood"),
    ("sync_every=99999999999999999999", "diloco sync_every must be a positive integer of at most 9,007,199,254,740,992"),
    # the user's text of any length is cut short in the message
    ("k" * 100_000 + "=1", "diloco 'kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk...kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk=1' is not"),
    ("outer_lr=x" + "9" * 100_000, "diloco outer_lr must be a positive number of at most 10, got 'x9999"),
], ids=lambda value: value[:40])
def test_bad_sync_settings_are_refused_in_one_line(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as refused:
        DiLoCo.parse(text)
    assert len(str(refused.value)) < 400


@pytest.mark.parametrize("layout, size, world, message", [
    ("full", None, 4, "layout='full' has no groups holding a model of their own: use layout='hybrid'"),
    ("hybrid_secondary", 2, 4, "layout='hybrid_secondary' has no groups"),
])
def test_sync_without_groups_of_their_own_is_refused(layout, size, world, message):
    with pytest.raises(ValueError, match=message):
        LayoutPlan.make(layout, size, world, world, diloco=DiLoCo())
    LayoutPlan.make(layout, size, world, world)
    assert LayoutPlan.make("hybrid", world, world, world, diloco=DiLoCo()).replicated  # one group: Lookahead


def test_the_train_command_refuses_a_bad_sync_before_any_worker_starts():
    for args, message in [
        (["--layout", "hybrid", "--diloco", "every=2,sync_every=3"],
         "error: --diloco sync_every is given twice \\(the last would win silently\\): give it once"),
        (["--diloco", "sync_every=0"], "error: --diloco sync_every must be a positive integer"),
        (["--layout", "full", "--diloco", "sync_every=5"],
         "error: --diloco lets the groups of the hybrid layout"),
    ]:
        with pytest.raises(SystemExit, match=message):
            main(["train", *args])


def test_sync_on_one_process_is_refused_by_shard():
    with pytest.raises(ValueError, match="layout='full' has no groups"):
        shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], diloco="sync_every=5")


# ------------------------------------------------------ the names before the rename, for a release

RENAMED = r"the old name goes in the next release"


def test_sync_is_the_old_name_of_diloco_and_warns():
    with pytest.warns(FutureWarning, match=r"shardwire.Sync is renamed shardwire.DiLoCo \(every -> sync_every, "
                                           r"overlap -> fragment_sync_delay\).*" + RENAMED):
        old = shardwire.Sync(every=8, fragments=2, overlap=4, wire=None)
    assert old == DiLoCo(sync_every=8, fragments=2, fragment_sync_delay=4, wire=None) and type(old) is DiLoCo
    with pytest.warns(FutureWarning), pytest.raises(TypeError, match="both every and sync_every"):
        shardwire.Sync(every=8, sync_every=8)


def test_the_keys_every_and_overlap_are_read_as_sync_every_and_fragment_sync_delay_with_a_warning():
    with pytest.warns(FutureWarning, match="diloco every= is renamed sync_every=, overlap= is renamed "
                                           "fragment_sync_delay=.*" + RENAMED):
        assert DiLoCo.parse("every=8,fragments=2,overlap=4") == DiLoCo(sync_every=8, fragments=2, fragment_sync_delay=4)
    with pytest.warns(FutureWarning, match="overlap= is renamed fragment_sync_delay="):
        assert DiLoCo.parse("every=5,overlap=none") == DiLoCo(sync_every=5)  # "none" still means 0
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="diloco fragment_sync_delay must be an integer"):
        DiLoCo.parse("every=8,fragments=2,overlap=5")


def test_shard_takes_sync_as_diloco_with_a_warning_and_refuses_both():
    with pytest.warns(FutureWarning, match=r"shard\(sync=...\) is renamed shard\(diloco=...\)"):
        with pytest.raises(ValueError, match="diloco lets the groups .* every 5 steps; layout='full' has no groups"):
            shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], sync="sync_every=5")
    with pytest.raises(ValueError, match="both diloco= and sync="):
        shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], diloco="sync_every=5", sync="sync_every=5")


def test_sync_now_is_the_old_name_of_diloco_sync_and_warns(monkeypatch):
    import shardwire.engine.grad as grad

    synced = []
    monkeypatch.setattr(grad, "diloco_sync", synced.append)
    with pytest.warns(FutureWarning, match="shardwire.sync_now is renamed shardwire.diloco_sync.*" + RENAMED):
        shardwire.sync_now("model")
    assert synced == ["model"]


_HYBRID_LAUNCH = ["train", "--print-launch", "--nproc", "2", "--layout", "hybrid", "--shard-group-size", "1"]


def test_the_train_command_takes_sync_as_diloco_with_a_warning_and_its_workers_get_the_new_names(capsys):
    with pytest.warns(FutureWarning) as warned:
        assert main([*_HYBRID_LAUNCH, "--sync", "every=4,overlap=2"]) == 0
    messages = [str(w.message) for w in warned]
    assert any(m.startswith("--sync is renamed --diloco") for m in messages), messages
    assert any("every= is renamed sync_every=" in m for m in messages), messages
    command = capsys.readouterr().out
    assert "--diloco sync_every=4,fragments=1,wire=int4,outer_lr=0.7,momentum=0.9,fragment_sync_delay=2" in command
    assert "--sync" not in command and "every=4" not in command.replace("sync_every=4", "")
    for argv, refusal in [(["--sync", "every=0"], "error: --sync sync_every must be"),  # under the name given
                          (["--sync", "3", "--print-config"], "error: --sync '3' is not understood")]:
        with warnings.catch_warnings(record=True) as warned, pytest.raises(SystemExit, match=refusal):
            warnings.simplefilter("always")
            main(["train", *argv])
        assert not warned  # a refusal is its one line alone: the old name's warning is not said before it
    assert "--sync" not in command and "--sync" not in _help(capsys)  # the help speaks of --diloco alone


def _help(capsys) -> str:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    return capsys.readouterr().out


def test_the_old_option_warns_in_one_line_on_stderr_before_any_worker_starts():
    done = subprocess.run([sys.executable, "-m", "shardwire", *_HYBRID_LAUNCH, "--sync", "sync_every=4"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["warning: --sync is renamed --diloco; the old name goes in the next release"]
    assert "--diloco sync_every=4" in done.stdout


def test_a_config_file_key_sync_is_read_as_diloco_with_a_warning(tmp_path, capsys):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"sync": "sync_every=4"}))
    with pytest.warns(FutureWarning, match=f"--config {path}: sync is renamed diloco.*" + RENAMED):
        assert main([*_HYBRID_LAUNCH, "--config", str(path)]) == 0
    assert "--diloco sync_every=4" in capsys.readouterr().out
    path.write_text(json.dumps({"sync": "sync_every=4", "diloco": "sync_every=5"}))
    assert main([*_HYBRID_LAUNCH, "--config", str(path)]) == 2
    assert "sync and diloco set the same option: keep one" in capsys.readouterr().err
    # refused as --sync, the option the key sets under its old name, in the words of what the file holds
    for value, refusal in [("bogus", "error: --sync 'bogus' is not understood"),
                           ("every=5", "error: --sync lets the groups of the hybrid layout train apart and averages "
                                       "them every 5 steps; --layout full has no groups")]:
        path.write_text(json.dumps({"sync": value}))
        with warnings.catch_warnings(record=True) as warned, pytest.raises(SystemExit, match=refusal):
            warnings.simplefilter("always")
            main(["train", "--config", str(path)])
        assert not warned


def test_a_checkpoint_that_records_sync_resumes_and_reports_only_what_changed():
    from shardwire.training.config import TrainConfig, changed_settings, training_settings

    def saved_before_the_rename(config: TrainConfig, sync: str) -> dict:
        settings = training_settings(config)
        del settings["diloco"]
        return {**settings, "sync": sync}

    config = TrainConfig(layout="hybrid", diloco="sync_every=4,fragments=2")
    assert changed_settings(saved_before_the_rename(config, "every=4,fragments=2,overlap=0"), config) == {}
    assert (changed_settings(saved_before_the_rename(config, "every=8"), config)
            == {"diloco": ("every=8", config.diloco)})
    assert changed_settings(saved_before_the_rename(TrainConfig(), "none"), TrainConfig()) == {}


def test_the_simulator_reads_the_spec_key_sync_as_diloco_with_a_warning():
    from shardwire.sim.specs import SpecError, parse

    with pytest.warns(FutureWarning, match="training: sync is renamed diloco.*" + RENAMED):
        spec = parse("training", {"layout": "hybrid", "sync": "sync_every=5"})
    assert spec.diloco == "sync_every=5" and spec.diloco_settings == DiLoCo(sync_every=5)
    with pytest.warns(FutureWarning, match="every= is renamed sync_every="):
        spec = parse("training", {"layout": "hybrid", "diloco": "every=5,overlap=1"})
    assert spec.diloco == str(DiLoCo(sync_every=5, fragment_sync_delay=1))  # kept, and written, under the new names
    with pytest.raises(SpecError, match="sync and diloco are the same key"):
        parse("training", {"layout": "hybrid", "sync": "sync_every=5", "diloco": "sync_every=5"})


# ----------------------------------------------------------------------------- the outer step

TOKENS = 33  # PRESETS["tiny"] has 32 positions


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, TOKENS), generator=torch.Generator().manual_seed(100 * step + rank))


def _group_model(model) -> dict[str, torch.Tensor]:
    """This rank's group's model, as each flat buffer's parameters end to end (``full_state_dict``
    gives rank 0's)."""
    from shardwire.engine.shard import engine_of

    engine, model_of_group = engine_of(model), {}
    for flat in engine.flats:
        full = torch.empty(flat.packing.padded_numel, dtype=flat.shard.dtype)
        engine.layout.shard.all_gather(full, flat.shard.detach(), tag="test").wait()
        by_param = torch.empty_like(full)
        flat.packing.copy_out(full, by_param)
        model_of_group[flat.name] = torch.cat([view.reshape(-1) for view in flat.packing.views(by_param)])
    return model_of_group


def _sgd_steps(model, optimizer, rank: int, steps: range, after_step=None) -> None:
    for step in steps:
        tokens = _batch(rank, step)
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(step)


def _outer_steps_by_hand(rank, world):
    """Two groups of one rank, SGD inside, a sync every 2 steps without overlap: each rank's shards
    before each sync, and after it."""
    from shardwire.engine.shard import engine_of

    torch.manual_seed(0)
    sync = DiLoCo(sync_every=2, fragments=1, wire=None, fragment_sync_delay=0, outer_lr=0.7, momentum=0.9)
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], layout="hybrid", shard_group_size=1, diloco=sync)
    flats = engine_of(model).flats
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initial = [flat.shard.clone() for flat in flats]
    before, after = [], []

    def record(step):
        if (step + 1) % 2 == 0:
            before.append([flat.shard.clone() for flat in flats])
            engine_of(model).outer.before_forward()  # as the training forward after a due step does
            after.append([flat.shard.clone() for flat in flats])

    _sgd_steps(model, optimizer, rank, range(4), record)
    return initial, before, after


@pytest.mark.slow
def test_the_outer_step_is_nesterov_sgd_on_the_averaged_change():
    (initial, before0, after0), (_, before1, after1) = run_workers(2, _outer_steps_by_hand)
    anchor = [tensor.clone() for tensor in initial]
    momentum = [torch.zeros_like(tensor) for tensor in initial]
    for sync in range(2):
        for i in range(len(anchor)):
            change = ((anchor[i] - before0[sync][i]) + (anchor[i] - before1[sync][i])) / 2
            momentum[i] = 0.9 * momentum[i] + change
            anchor[i] = anchor[i] - 0.7 * (change + 0.9 * momentum[i])
            assert not torch.equal(before0[sync][i], before1[sync][i])  # the groups trained apart
            torch.testing.assert_close(after0[sync][i], anchor[i], rtol=1e-6, atol=1e-7)
            assert torch.equal(after0[sync][i], after1[sync][i])  # and agree after the sync


def _sgd_run(rank, world, sync):
    torch.manual_seed(0)
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], layout="hybrid", shard_group_size=1, diloco=sync)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _sgd_steps(model, optimizer, rank, range(3))
    shardwire.diloco_sync(model)
    return shardwire.full_state_dict(model) if rank == 0 else None


@pytest.mark.slow
def test_a_sync_every_step_with_outer_lr_1_and_no_momentum_is_synchronous_training():
    """Averaging the parameters after each SGD step is SGD on the averaged gradient."""
    synchronous = run_workers(2, _sgd_run, None)[0]
    averaged = run_workers(2, _sgd_run, DiLoCo(sync_every=1, fragments=1, wire=None, outer_lr=1.0, momentum=0.0,
                                               fragment_sync_delay=0))[0]
    for key, value in synchronous.items():
        torch.testing.assert_close(averaged[key], value, rtol=1e-5, atol=1e-6)


def _accumulating_run(rank, world, how):
    """Three steps of two micro-batches each by two groups of one rank syncing every 2 steps, the
    first micro-batch under no_sync or not, zeroing the gradients as ``how`` says: the warnings
    said."""
    torch.manual_seed(0)
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], layout="hybrid", shard_group_size=1,
                            diloco=DiLoCo(sync_every=2, fragments=1, wire=None, fragment_sync_delay=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(3):
            tokens = _batch(rank, step)
            if how == "zero before backward":
                optimizer.zero_grad()
            with shardwire.no_sync(model) if "without no_sync" not in how else contextlib.nullcontext():
                loss_fn(model(tokens[:1, :-1]), tokens[:1, 1:]).backward()
            loss_fn(model(tokens[1:, :-1]), tokens[1:, 1:]).backward()
            optimizer.step()
            if how != "zero before backward":
                optimizer.zero_grad(set_to_none="zeros kept" not in how)
    return [str(warning.message) for warning in said if "no_sync" in str(warning.message)]


@pytest.mark.parametrize("how, warned", [
    ("without no_sync", [1, 0]), ("zeros kept, without no_sync", [1, 0]), ("no_sync", [0, 0]),
    ("zeros kept", [0, 0]), ("zero before backward", [0, 0])])
def test_micro_batches_accumulated_outside_no_sync_under_diloco_are_said_once(how, warned):
    """Each backward outside no_sync is an inner step: a step's micro-batches accumulated outside it
    sync that many times as often, between micro-batches. Said once, by rank 0; not where the
    gradients were zeroed between two steps, however (set to None, in place, or before the
    backward)."""
    said = run_workers(2, _accumulating_run, how)
    assert [len(messages) for messages in said] == warned, said
    if warned[0]:
        assert said[0] == ["this backward adds to the gradients of the one before it, outside no_sync: under DiLoCo "
                           "each is an inner step, and the syncs come every sync_every=2 backward passes rather than "
                           "steps, between micro-batches; if they are micro-batches of one step, run all but each "
                           "step's last backward under shardwire.no_sync(model)"]


# --------------------------------------------------------------- the quantized sync, fragments


def _streaming_run(rank, world, sync, precision):
    """Eight Adam steps of two groups (two nodes of one rank each, so the sync's wire quantizes) with
    a micro-batch under no_sync and clipping: the syncs each buffer sent, by step; what crossed
    the nodes; the model after sync_now, and its residuals."""
    from shardwire.engine.shard import engine_of

    torch.manual_seed(0)
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], layout="hybrid", shard_group_size=1,
                            diloco=sync, mixed_precision=precision)
    engine = engine_of(model)
    initial = _group_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    sent = {}
    for step in range(8):
        with engine.record() as records:
            tokens = _batch(rank, step)
            with shardwire.no_sync(model):
                loss_fn(model(tokens[:1, :-1]), tokens[:1, 1:]).backward()
            loss_fn(model(tokens[1:, :-1]), tokens[1:, 1:]).backward()
            shardwire.clip_grad_norm_(model, 1.0)
            optimizer.step()
            optimizer.zero_grad()
        sent[step] = [(r.tag.removesuffix(" (sync)"), r.nbytes, r.wire_nbytes) for r in records
                      if r.tag.endswith("(sync)")]
    shardwire.diloco_sync(model)
    residuals = {flat.name: flat.residuals.get("sync") for flat in engine.flats}
    return sent, initial, _group_model(model), residuals, sorted(engine.outer.metrics())


@pytest.mark.slow
def test_streaming_fragments_sync_each_unit_once_per_h_steps_and_a_quantized_sync_stays_close():
    env = {"LOCAL_WORLD_SIZE": "1"}  # two nodes: what crosses between the groups is quantized
    exact = run_workers(2, _streaming_run, DiLoCo(sync_every=4, fragments=2, wire=None), "bf16", env=env)
    quantized = run_workers(2, _streaming_run, DiLoCo(sync_every=4, fragments=2, wire="int4"), "bf16", env=env)
    (sent, initial, trained, _, measured), (sent_q, _, trained_q, residuals_q, measured_q) = exact[0], quantized[0]
    # the drift from an int4 average read 0: its error counted as the groups agreeing
    assert measured == ["drift", "outer_grad_norm"] and measured_q == ["outer_grad_norm"]
    # The forwards after steps 2, 4 and 6 issue syncs (after step 8, sync_now syncs everything):
    # fragment 0 (the root and blocks.1, units dealt in turn) after steps 2 and 6, fragment 1 after 4.
    by_step = {step: sorted(tag for tag, _, _ in records) for step, records in sent.items() if records}
    assert by_step == {2: ["<root>", "blocks.1"], 4: ["blocks.0", "blocks.2"], 6: ["<root>", "blocks.1"]}
    assert all(nbytes == wire for records in sent.values() for _, nbytes, wire in records)  # fp32 as it is
    assert all(wire < 0.14 * nbytes for records in sent_q.values() for _, nbytes, wire in records)  # int4
    assert all(residual is not None and residual.abs().max() > 0 for residual in residuals_q.values())
    for name, value in trained.items():  # int4 changes with error feedback, against exact ones
        assert (trained_q[name] - value).norm() <= 0.1 * (value - initial[name]).norm(), name
    for rank in (exact, quantized):  # one model after sync_now
        assert all(torch.equal(rank[1][2][name], value) for name, value in rank[0][2].items())


# ---------------------------------------------------------------------------------- checkpoints


def _checkpoint_mid_interval(rank, world, root, group_size):
    """Two groups, a sync every 4 steps in 2 fragments with overlap: save after step 3 (fragment 0's
    sync in flight), train on; then resume from the checkpoint into a fresh model and train on alike."""
    from shardwire.engine.shard import engine_of

    def build(seed):
        torch.manual_seed(seed)
        model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], layout="hybrid", shard_group_size=group_size,
                                diloco=DiLoCo(sync_every=4, fragments=2, wire=None, fragment_sync_delay=2))
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)

    def train(model, optimizer, steps):
        group = rank // group_size
        for step in steps:
            tokens = _batch(group, step)[rank % group_size :: group_size]  # the group's batch, split in it
            loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad()

    path = pathlib.Path(root) / f"groups-of-{group_size}"
    model, optimizer = build(0)
    train(model, optimizer, range(3))
    in_flight = engine_of(model).outer.in_flight is not None
    engine_of(model).outer.metrics()  # those of the syncs before the checkpoint
    shardwire.save_checkpoint(path, model, optimizer, step=3)
    saved = _group_model(model)
    train(model, optimizer, range(3, 7))
    uninterrupted = _group_model(model), engine_of(model).outer.metrics()
    model, optimizer = build(1)
    shardwire.load_checkpoint(path, model, optimizer)
    restored = _group_model(model)
    train(model, optimizer, range(3, 7))
    return in_flight, saved, uninterrupted, restored, (_group_model(model), engine_of(model).outer.metrics()), str(path)


def _load_in_groups_of_one(rank, world, path):
    torch.manual_seed(1)
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], layout="hybrid", shard_group_size=1,
                            diloco=DiLoCo(sync_every=4, fragments=2, wire=None, fragment_sync_delay=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    shardwire.load_checkpoint(path, model, optimizer)
    return _group_model(model)


@pytest.mark.slow
def test_a_checkpoint_saved_while_a_sync_is_in_flight_resumes_exactly_and_reshards_within_groups(tmp_path):
    results = run_workers(4, _checkpoint_mid_interval, str(tmp_path), 2)
    for in_flight, saved, (uninterrupted, measured), restored, (resumed, remeasured), path in results:
        assert in_flight
        for key, value in saved.items():
            assert torch.equal(restored[key], value), key
        for key, value in uninterrupted.items():
            assert torch.equal(resumed[key], value), key
        # the sync in flight at the checkpoint is measured after the resume as without it
        assert measured.keys() == {"outer_grad_norm", "drift"} and remeasured == measured
    # rank 2 leads the second group, whose model differs from the first's between syncs
    assert any(not torch.equal(results[2][1][key], value) for key, value in results[0][1].items())
    # The same checkpoint in groups of one rank: each group gets its own model back.
    reloaded = run_workers(2, _load_in_groups_of_one, path)
    for group, (leader, mine) in enumerate(zip((results[0], results[2]), reloaded)):
        for key, value in leader[1].items():
            assert torch.equal(mine[key], value), (group, key)


# ------------------------------------------------------------------------- simulator and planner


def _sync_prediction(sync: str, *, inter_gbps: float = 10.0):
    from shardwire.sim.predict import predict
    from shardwire.sim.specs import ClusterSpec, LinkSpec, ModelSpec, parse

    model = ModelSpec(name="aligned", layers=2, hidden=1024, heads=8, vocab=1023, seq_len=128)
    cluster = ClusterSpec(nodes=2, gpus_per_node=4, peak_tflops=100.0, gpu_memory_gb=80.0,
                          intra_node=LinkSpec(100.0), inter_node=LinkSpec(inter_gbps), algorithm="hierarchical")
    return predict(model, cluster, parse("training", {"layout": "hybrid", "micro_batch": 2, "diloco": sync}))


def test_the_simulator_sends_1_over_h_of_a_sync_per_step_and_exposes_it_only_without_overlap():
    synchronous = _sync_prediction("none")
    every = {h: _sync_prediction(f"sync_every={h},fragments=1,wire=none") for h in (5, 20)}
    params = synchronous.arch.params
    # hybrid's all-reduce of fp32 gradient shards between 2 nodes: 2 x 4 P / 2 leave each node
    assert synchronous.timeline.link_bytes["inter"] == pytest.approx(4 * params)
    for h, p in every.items():  # the same all-reduce of the change, 1/H of it per step
        assert p.timeline.link_bytes["inter"] == pytest.approx(4 * params / h)
        assert p.memory.outer_state == pytest.approx(8 * params / 4 + 4 * params / 4)  # anchor, momentum, change
    int4 = _sync_prediction("sync_every=20,fragments=1,wire=int4")
    assert int4.timeline.link_bytes["inter"] < 0.14 * every[20].timeline.link_bytes["inter"]
    # a slow link: overlapped, the sync hides behind the step; blocking, the step waits for it
    overlapped = _sync_prediction("sync_every=5,fragment_sync_delay=4", inter_gbps=0.01)
    blocking = _sync_prediction("sync_every=5", inter_gbps=0.01)
    assert overlapped.exposed_by_reason.get("sync between groups (not overlapped)", 0) == 0
    assert blocking.exposed_by_reason["sync between groups (not overlapped)"] > 0
    assert blocking.step_time_s > overlapped.step_time_s


def test_a_sync_the_simulator_cannot_run_is_a_spec_error():
    from shardwire.sim.specs import SpecError, parse

    with pytest.raises(SpecError, match="diloco applies to layout 'hybrid'"):
        parse("training", {"layout": "full", "diloco": "sync_every=5"})
    with pytest.raises(SpecError, match="diloco sync_every must be a positive integer"):
        parse("training", {"layout": "hybrid", "diloco": "sync_every=0"})
    with pytest.raises(SpecError, match="fault_tolerance carries the reductions between the groups of layout 'hybrid'"):
        parse("training", {"layout": "full", "fault_tolerance": True})


def test_a_sync_behind_the_steps_between_fault_tolerant_groups_holds_one_more_copy_of_its_fragment():
    """The shards from before the eager step, fp32, while the sync is in flight: only where it runs
    behind the steps (``test_large_world`` holds the engine to it)."""
    from shardwire.sim.architecture import architecture
    from shardwire.sim.memory import estimate_memory
    from shardwire.sim.specs import ClusterSpec, LinkSpec, ModelSpec, parse

    model = ModelSpec(name="aligned", layers=2, hidden=1024, heads=8, vocab=1023, seq_len=128)
    cluster = ClusterSpec(nodes=2, gpus_per_node=4, peak_tflops=100.0, gpu_memory_gb=80.0,
                          intra_node=LinkSpec(100.0), inter_node=LinkSpec(1.0))

    def outer(diloco, fault_tolerance):
        training = parse("training", {"layout": "hybrid", "diloco": diloco, "fault_tolerance": fault_tolerance})
        return estimate_memory(architecture(model, training.compute_bytes), cluster, training).outer_state

    params = architecture(model, 2).params
    behind = "sync_every=8,fragments=2,fragment_sync_delay=1"
    assert outer(behind, False) == pytest.approx(8 * params / 4 + 8 * params / 4 / 2)
    assert outer(behind, True) == pytest.approx(8 * params / 4 + 12 * params / 4 / 2)
    assert outer("sync_every=8,fragments=2", True) == outer("sync_every=8,fragments=2", False)


@pytest.mark.slow
def test_the_planner_offers_sync_beside_its_choice_with_the_caveat_and_exact_leaves_out_what_is_lossy(capsys):
    args = ["plan", "--model", "gpt-1.3b", "--cluster", "h100-100gbe", "--nodes", "2", "--global-batch", "64"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["best"]["training"]["diloco"] == "none"  # the choice trains as synchronous training does
    synced = result["diloco"]
    assert synced["training"]["diloco"] == "sync_every=20" and synced["training"]["layout"] == "hybrid"
    assert synced["step_time_s"] < result["best"]["step_time_s"]
    assert synced["bytes_per_step"]["inter_node"] < result["best"]["bytes_per_step"]["inter_node"] / 3
    assert "--diloco sync_every=20" in synced["run"]["command"]
    assert any("changes the optimisation" in note for note in synced["notes"])
    assert main(args) == 0
    printed = capsys.readouterr().out.split("\nor diloco ")[1]
    assert "note: DiLoCo (sync_every=20) changes the optimisation" in printed and "diloco='sync_every=20'" in printed
    assert "--diloco sync_every=20" in printed
    assert main([*args, "--exact"]) == 0
    exact = capsys.readouterr().out
    assert "sync" not in exact and "diloco" not in exact and "int8" not in exact and "int4" not in exact


# ---------------------------------------------------------------------------------- the train job


@pytest.mark.slow
def test_the_train_job_syncs_with_accumulation_bf16_profiling_and_checkpoints(tmp_path, capfd):
    """Two groups of one rank, micro-batches under no_sync, bf16, clipping, the profiler and
    checkpoints every 3 steps; then a resumed run to step 8."""
    job = ["train", "--nproc", "2", "--model", "tiny", "--layout", "hybrid", "--shard-group-size", "1",
           "--diloco", "sync_every=4,fragments=2", "--grad-accum", "2", "--precision", "bf16", "--log-every", "3",
           "--eval-batches", "1", "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "3"]
    assert main([*job, "--steps", "6", "--profile", "--run-dir", str(tmp_path / "run")]) == 0
    out = capfd.readouterr().out
    assert ("layout hybrid (2 groups of 1, diloco sync_every=4,fragments=2,wire=int4,outer_lr=0.7,momentum=0.9,"
            "fragment_sync_delay=0)" in out)
    assert "validation loss" in out
    profile = json.loads((tmp_path / "run" / "profile.json").read_text())
    synced = [step["step"] for step in profile["steps"]
              if (step["ranks"][0] if isinstance(step["ranks"], list) else step["ranks"]["0"])["all_reduce_bytes"] > 8]
    assert synced == [2, 4]  # the forwards after steps 2 and 4 sent a fragment each (0-based steps)
    manifest = json.loads((tmp_path / "ckpt" / "step_00000006" / "manifest.json").read_text())
    assert manifest["groups"] == 2 and manifest["version"] == 7
    assert main([*job, "--steps", "8"]) == 0
    assert "resuming from" in capfd.readouterr().out


def _loaded_weights_then_sync_now(rank, world):
    """Weights loaded after ``shard`` are the anchor (a sync of groups that did not move moves
    nothing, whatever the outer step); and after ``sync_now`` the next forward sends nothing."""
    from shardwire.engine.shard import engine_of

    torch.manual_seed(0)
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], layout="hybrid", shard_group_size=1,
                            diloco=DiLoCo(sync_every=2, fragments=1, wire=None, outer_lr=0.7, momentum=0.9))
    torch.manual_seed(1)
    model.load_state_dict(GPT(PRESETS["tiny"]).state_dict())
    loaded = _group_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the groups' models do not move
    outer = engine_of(model).outer
    sends = []
    send = outer._send
    outer._send = lambda *args, **kwargs: (sends.append(outer.steps), send(*args, **kwargs))
    for step in range(3):  # the third forward sends the sync due after step 2
        tokens = _batch(rank, step)
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    after = _group_model(model)
    unmoved = all(torch.equal(after[name], value) for name, value in loaded.items())
    for step in range(3, 4):  # step 4 is due: sync_now after it leaves the next forward nothing to send
        tokens = _batch(rank, step)
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    shardwire.diloco_sync(model)
    sent_by_sync_now = len(sends)
    tokens = _batch(rank, 4)
    model(tokens[:, :-1])
    return unmoved, sends[:1], len(sends) - sent_by_sync_now


@pytest.mark.slow
def test_weights_loaded_after_shard_are_the_anchor_and_sync_now_leaves_nothing_due():
    for unmoved, first_sync, sent_after_sync_now in run_workers(2, _loaded_weights_then_sync_now,
                                                                 env={"LOCAL_WORLD_SIZE": "1"}):
        assert unmoved, "a sync of groups that did not move changed the loaded weights"
        assert first_sync == [2]
        assert sent_after_sync_now == 0


def _imported_weights_then_sync(rank, world, path):
    """Weights imported from a file after ``shard`` are the anchor: a sync of groups that did not
    move leaves them as imported."""
    torch.manual_seed(0)
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], layout="hybrid", shard_group_size=1,
                            diloco="sync_every=1")
    shardwire.import_state_dict(model, path)
    _sgd_steps(model, torch.optim.SGD(model.parameters(), lr=0.0), rank, range(2))
    shardwire.diloco_sync(model)
    imported = torch.load(path)
    return [name for name, value in shardwire.full_state_dict(model).items() if not torch.equal(value, imported[name])]


@pytest.mark.slow
def test_weights_imported_after_shard_are_the_anchor(tmp_path):
    torch.manual_seed(1)
    torch.save(GPT(PRESETS["tiny"]).state_dict(), tmp_path / "weights.pt")
    for moved in run_workers(2, _imported_weights_then_sync, tmp_path / "weights.pt", env={"LOCAL_WORLD_SIZE": "1"}):
        assert moved == []


def _loads_and_saves_around_syncs(rank, world, directory):
    """A checkpoint saved at a multiple of sync_every, read as its global model (another number of
    groups, an export), against the model every group agrees on then; weights loaded inside
    ``global_model``, and each group's own loaded between syncs."""
    from shardwire.engine.checkpoint.portable import read_state_dict

    torch.manual_seed(0)
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], layout="hybrid", shard_group_size=1,
                            diloco="sync_every=2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _sgd_steps(model, optimizer, rank, range(2))
    shardwire.save_checkpoint(directory, model, step=2).wait()
    with shardwire.global_model(model):
        agreed = shardwire.full_state_dict(model)
    saved = read_state_dict(directory)  # what an export of it writes
    saved_is_synced = all(torch.equal(saved[name], value) for name, value in agreed.items())

    torch.manual_seed(1)
    new = GPT(PRESETS["tiny"]).state_dict()
    with shardwire.global_model(model):
        model.load_state_dict(new)
    kept = all(torch.equal(value, new[name]) for name, value in shardwire.full_state_dict(model).items())

    _sgd_steps(model, optimizer, rank, range(2, 3))
    model.load_state_dict(model.state_dict())  # each group's own model: no global one
    try:
        _sgd_steps(model, optimizer, rank, range(3, 6))  # the third forward sends the sync due after two steps
        refused = None
    except ValueError as err:
        refused = str(err)
    return saved_is_synced, kept, refused


@pytest.mark.slow
def test_a_checkpoint_at_a_sync_holds_it_and_loads_are_every_groups_or_refused(tmp_path):
    for saved_is_synced, kept, refused in run_workers(2, _loads_and_saves_around_syncs, str(tmp_path / "checkpoint"),
                                                      env={"LOCAL_WORLD_SIZE": "1"}):
        assert saved_is_synced, "the checkpoint's global model is the one before the sync due at its step"
        assert kept, "weights loaded inside global_model were replaced by the groups' own at its end"
        assert refused is not None and refused.startswith("the groups hold different weights to sync from")


def _trained_saving(rank, world, diloco, directory):
    """Eight steps, saved at steps 4 and 8 (sync steps) where ``directory`` is given, then diloco_sync."""
    torch.manual_seed(0)
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], layout="hybrid", shard_group_size=1, diloco=diloco)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    save = None if directory is None else (
        lambda step: step + 1 in (4, 8) and shardwire.save_checkpoint(f"{directory}/{step + 1}", model, optimizer,
                                                                      step=step + 1).wait())
    _sgd_steps(model, optimizer, rank, range(8), after_step=save)
    shardwire.diloco_sync(model)
    return shardwire.full_state_dict(model)


@pytest.mark.slow
@pytest.mark.parametrize("diloco", ["sync_every=2", "sync_every=2,fragments=2,fragment_sync_delay=1"])
def test_a_run_that_saves_at_its_syncs_trains_as_one_that_does_not(diloco, tmp_path):
    env = {"LOCAL_WORLD_SIZE": "1"}
    unsaved = run_workers(2, _trained_saving, diloco, None, env=env)[0]
    saved = run_workers(2, _trained_saving, diloco, str(tmp_path), env=env)[0]
    assert all(torch.equal(saved[name], value) for name, value in unsaved.items())


# ------------------------------------------------------- DiLoCo against an independent reference

def _diloco_run(rank, world, group_size, steps, every):
    """AdamW inside groups of ``group_size`` ranks, the default outer step every ``every`` steps, no
    quantization: the global model after ``steps`` steps and ``sync_now``, and that sync's metrics."""
    from shardwire.engine.shard import engine_of

    torch.manual_seed(0)
    sync = DiLoCo(sync_every=every, wire=None)
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], layout="hybrid", shard_group_size=group_size,
                            diloco=sync)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _sgd_steps(model, optimizer, rank, range(steps))
    outer = engine_of(model).outer
    outer.metrics()  # those of the syncs before: the next call's are sync_now's alone
    shardwire.diloco_sync(model)
    metrics = outer.metrics()
    return shardwire.full_state_dict(model), metrics


def _diloco_reference(world, group_size, steps, every):
    """DiLoCo written out on whole models in one process: one model and one AdamW per group, each
    group's loss the mean over its ranks' batches, and every ``every`` steps (and at the end) the
    averaged change applied to the anchor by Nesterov SGD at the defaults (lr 0.7, momentum 0.9),
    every group restarting from it. Returns the final model and, for the last sync, the norm of
    the averaged change and the groups' drift from it."""
    torch.manual_seed(0)
    anchor = GPT(PRESETS["tiny"])
    groups = [GPT(PRESETS["tiny"]) for _ in range(world // group_size)]
    for model in groups:
        model.load_state_dict(anchor.state_dict())
    optimizers = [torch.optim.AdamW(model.parameters(), lr=3e-3) for model in groups]
    momentum = [torch.zeros_like(p) for p in anchor.parameters()]

    def outer_step():
        changes = [[a.detach() - p.detach() for a, p in zip(anchor.parameters(), model.parameters())]
                   for model in groups]
        averaged = [sum(parts) / len(groups) for parts in zip(*changes)]
        with torch.no_grad():
            for a, m, change in zip(anchor.parameters(), momentum, averaged):
                m.mul_(0.9).add_(change)
                a.sub_(change + 0.9 * m, alpha=0.7)
            for model in groups:
                model.load_state_dict(anchor.state_dict())
        norm = sum(c.square().sum() for c in averaged).sqrt().item()
        drift = (sum(sum((c - a).square().sum() for c, a in zip(own, averaged)) for own in changes)
                 / len(groups)).sqrt().item()
        return norm, drift

    for step in range(steps):
        for g, (model, optimizer) in enumerate(zip(groups, optimizers)):
            ranks = range(g * group_size, (g + 1) * group_size)
            sum(loss_fn(model(_batch(r, step)[:, :-1]), _batch(r, step)[:, 1:]) for r in ranks).div(group_size).backward()
            optimizer.step()
            optimizer.zero_grad()
        if (step + 1) % every == 0 and step + 1 < steps:
            outer_step()
    return anchor.state_dict(), outer_step()


@pytest.mark.slow
@pytest.mark.parametrize("world, group_size", [(2, 1), (3, 1), (2, 2)])
def test_diloco_matches_an_independent_reference_with_one_or_several_groups(world, group_size):
    """Two and three groups (DiLoCo), and one group of two ranks (Lookahead), against the reference
    above: the same model after 7 steps with a sync every 3 and the final one, and the same norm of
    the final sync's averaged change and drift (none for one group)."""
    (model, metrics), *_ = run_workers(world, _diloco_run, group_size, 7, 3)
    expected, (norm, drift) = _diloco_reference(world, group_size, 7, 3)
    for key, value in expected.items():
        torch.testing.assert_close(model[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert metrics["outer_grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert metrics["drift"] == pytest.approx(drift, rel=1e-3, abs=1e-6)
    assert (drift > 0) == (world > group_size)


def _resumed_elsewhere(rank, world, path, group_size, sync):
    torch.manual_seed(1)  # other initial weights: the loaded ones must replace them
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], layout="hybrid" if sync else "full",
                            shard_group_size=group_size if sync else None, diloco=sync)
    shardwire.load_checkpoint(path, model)
    return shardwire.full_state_dict(model)


def _saved_between_syncs(rank, world, path, quantized):
    """Two groups of one rank; 5 steps with a sync every 3 (and int4 on the sync's wire where
    ``quantized``): saved at step 5, between syncs, then weights loaded into the model. Returns the
    global model at the save, each group's own, and the sync residual's largest value after the
    load."""
    from shardwire.engine.shard import engine_of

    torch.manual_seed(0)
    sync = DiLoCo(sync_every=3, wire="int4" if quantized else None)
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], layout="hybrid", shard_group_size=1, diloco=sync)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _sgd_steps(model, optimizer, rank, range(5))
    with shardwire.global_model(model):
        anchor = shardwire.full_state_dict(model)
    own = _group_model(model)
    shardwire.save_checkpoint(path, model, optimizer, step=5)
    model.load_state_dict(model.state_dict())  # weights loaded: the outer loop starts again
    residual = max((flat.residuals["sync"].abs().max().item() for flat in engine_of(model).flats
                    if "sync" in flat.residuals), default=0.0)
    return anchor, own, residual


@pytest.mark.slow
def test_another_number_of_groups_or_no_sync_resumes_the_global_model_and_loading_weights_clears_the_residual(
        tmp_path):
    path = str(tmp_path / "step_5")
    (anchor, own0, residual0), (_, own1, residual1) = run_workers(2, _saved_between_syncs, path, True,
                                                                  env={"LOCAL_WORLD_SIZE": "1"})
    assert any(not torch.equal(own0[name], own1[name]) for name in own0), "the groups trained apart"
    assert residual0 == residual1 == 0.0, "the sync's quantization residual outlived the loaded weights"
    one_group = run_workers(2, _resumed_elsewhere, path, 2, DiLoCo(sync_every=3))[0]
    without_sync = run_workers(2, _resumed_elsewhere, path, None, None)[0]
    for key, value in anchor.items():
        torch.testing.assert_close(one_group[key], value, rtol=0, atol=0, msg=key)
        torch.testing.assert_close(without_sync[key], value, rtol=0, atol=0, msg=key)
