"""Checkpoints among things they did not make, and manifests that lie: clean-up deletes only what a
save provably made, a manifest is checked (its own sha256, every field's type and range, file names
confined to the checkpoint) before anything uses it, and a newest checkpoint without a manifest does
not stop the next run from resuming and saving that step again.

Starting ranks takes seconds, so every scenario runs in one set of two processes (the ``scenarios``
fixture); each test asserts on its scenario's results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import shutil
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwire
from harness import rewrite_manifest, run_workers
from shardwire.engine.checkpoint import save
from shardwire.engine.checkpoint.claim import CLAIM

pytestmark = pytest.mark.slow


class Net(nn.Module):
    """Two blocks (two flat buffers besides the root's) and a buffer: small, and every kind of state."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x)) * self.scale[0]
        return x


def make_model(seed: int):
    torch.manual_seed(seed)
    model = shardwire.shard(Net())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, optimizer, step: int, rank: int) -> None:
    """A step whose batch depends only on the step number, so a resumed run repeats it exactly."""
    batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + rank))
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def save_step(directory: pathlib.Path, model, optimizer, step: int, keep: int | None = 2):
    shardwire.save_checkpoint(shardwire.checkpoint_path(directory, step), model, optimizer, step=step, keep=keep)


def on_rank_0(rank: int, fn) -> None:
    """File-system set-up done once, seen by every rank before it goes on."""
    if rank == 0:
        fn()
    dist.barrier()


def listing(directory: pathlib.Path) -> list[str]:
    """What a directory holds besides the run's claim on it."""
    return sorted(path.name for path in directory.iterdir() if path.name != CLAIM)


def outcome(load) -> str:
    """What a load did: the step it loaded, or its error's message."""
    try:
        return f"loaded step {load().step}"
    except shardwire.CheckpointError as err:
        return str(err)


@contextlib.contextmanager
def logged_warnings():
    """The warnings logged under ``shardwire`` (``load_latest_checkpoint``'s reasons for skipping)."""
    messages = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("shardwire")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def disk_full(path, data):
    raise OSError(28, "No space left on device")


@contextlib.contextmanager
def crash_while_writing():
    """Every rank's save stops while writing its file, as a process killed there stops: the save's
    temporary directory stays (a save that fails and lives on removes it)."""
    with mock.patch.object(save, "write_durably", disk_full), \
            mock.patch.object(save.PendingCheckpoint, "_discard_staging", lambda self: None):
        yield


# ------------------------------------------------------------------------------------ scenarios


def _user_temporaries(rank, directory):
    """A user's directory named like a save's temporary, and one whose marker names another directory,
    beside a series; a save that crashed leaves a real temporary."""
    def plant():
        (directory / "step_00000001.tmp-0123456789ab").mkdir(parents=True)
        (directory / "step_00000001.tmp-0123456789ab" / "notes.txt").write_text("mine")
        forged = directory / "step_00000002.tmp-aaaaaaaaaaaa"
        forged.mkdir()
        (forged / "made-by-shardwire.json").write_text(json.dumps({"name": "other", "token": "bbbbbbbbbbbb"}))

    on_rank_0(rank, plant)
    model, optimizer = make_model(seed=0)
    with crash_while_writing(), contextlib.suppress(shardwire.CheckpointError):
        save_step(directory, model, optimizer, 1)
    after_crash = listing(directory)
    save_step(directory, model, optimizer, 1)
    return {
        "after crash": after_crash,
        "after save": listing(directory),
        "notes": (directory / "step_00000001.tmp-0123456789ab" / "notes.txt").read_text(),
    }


def _failed_save(rank, directory):
    """A save that fails on a full disk, in a directory with a checkpoint and a user's directory named
    like a temporary: what it wrote goes, the rest stays."""
    model, optimizer = make_model(seed=0)
    save_step(directory, model, optimizer, 1)
    on_rank_0(rank, lambda: (directory / "step_00000002.tmp-0123456789ab").mkdir())
    with mock.patch.object(save, "write_durably", disk_full):
        failed = outcome(lambda: save_step(directory, model, optimizer, 2))
    dist.barrier()  # rank 0 has cleaned up
    return {"failed": failed, "after": listing(directory)}


def _prune_among_strangers(rank, directory):
    """keep=1 in a series that also holds a user's directory named like an older checkpoint, with a
    manifest.json of its own, one without any, a checkpoint the user then exported into, and two
    directories holding a copy of its manifest: made step 3's, beside files of the user's under the
    names it lists, and beside a copy of its files (a manifest of step 2 under step 4's name)."""
    def plant():
        (directory / "step_00000000").mkdir(parents=True)
        (directory / "step_00000000" / "manifest.json").write_text('{"my": "notes"}')
        (directory / "step_00000001").mkdir()
        (directory / "step_00000001" / "data.bin").write_bytes(b"\0" * 8)

    on_rank_0(rank, plant)
    model, optimizer = make_model(seed=0)
    save_step(directory, model, optimizer, 2, keep=1)
    on_rank_0(rank, lambda: (directory / "step_00000002" / "exported.pt").write_bytes(b"the user's"))

    def forge():
        saved = directory / "step_00000002"
        for name in ("step_00000003", "step_00000004"):
            (directory / name).mkdir()
            shutil.copy(saved / "manifest.json", directory / name)
        for record in json.loads((saved / "manifest.json").read_text())["files"]:
            (directory / "step_00000003" / record["name"]).write_bytes(b"the user's")
            shutil.copy(saved / record["name"], directory / "step_00000004")
        rewrite_manifest(directory / "step_00000003", lambda manifest: manifest.update(step=3))  # of its step

    on_rank_0(rank, forge)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for step in (5, 6):
            save_step(directory, model, optimizer, step, keep=1)
    return {"after": listing(directory), "warned": [str(w.message) for w in warned],
            "export": (directory / "step_00000002" / "exported.pt").read_bytes(),
            "forged": (directory / "step_00000003" / "rank_00000.safetensors").read_bytes()}


BAD_MANIFESTS = {
    "parent": lambda m: m["files"][0].update(name="../x"),
    "absolute": lambda m: m["files"][1].update(name="/etc/hostname"),
    "negative step": lambda m: m.update(step=-1),
    "string step": lambda m: m.update(step="3"),
    "world size 0": lambda m: m.update(world_size=0),
}


def _bad_manifests(rank, directory):
    """For each damage, a series whose newest checkpoint's manifest has it (resealed, so only the
    damage itself can refuse it), and one whose manifest was edited without resealing."""
    model, optimizer = make_model(seed=0)
    base = directory / "base"
    save_step(base, model, optimizer, 1)
    train_step(model, optimizer, 1, rank)
    save_step(base, model, optimizer, 2)
    cases = {**BAD_MANIFESTS, "edited": None}

    def damage():
        for name, change in cases.items():
            shutil.copytree(base, directory / name)
            newest = shardwire.checkpoint_path(directory / name, 2)
            if change is None:
                rewrite_manifest(newest, lambda m: m.update(extra={"epoch": 99}), reseal=False)
            else:
                rewrite_manifest(newest, change)

    on_rank_0(rank, damage)
    results = {}
    for name in cases:
        series = directory / name
        refused = outcome(lambda: shardwire.load_checkpoint(shardwire.checkpoint_path(series, 2), model, optimizer))
        with logged_warnings() as skipped:
            latest = outcome(lambda: shardwire.load_latest_checkpoint(series, model, optimizer))
        results[name] = {"load_checkpoint": refused, "load_latest_checkpoint": latest, "skipped": skipped}
    return results


def _step_unlike_name(rank, directory):
    """A newest checkpoint whose manifest (resealed) records another step than its name."""
    model, optimizer = make_model(seed=0)
    for step in (1, 2):
        save_step(directory, model, optimizer, step)
    on_rank_0(rank, lambda: rewrite_manifest(shardwire.checkpoint_path(directory, 2), lambda m: m.update(step=7)))
    with logged_warnings() as skipped:
        latest = outcome(lambda: shardwire.load_latest_checkpoint(directory, model, optimizer))
    return {"load_latest_checkpoint": latest, "skipped": skipped}


def _series_in_a_file(rank, world, directory):
    model, optimizer = make_model(seed=0)
    (pathlib.Path(directory) / "notes.txt").write_text("the user's")
    return outcome(lambda: shardwire.load_latest_checkpoint(pathlib.Path(directory) / "notes.txt", model, optimizer))


def test_a_series_named_by_a_file_is_one_line_and_the_file_is_kept(tmp_path):
    """``load_latest_checkpoint`` of a file: a ``CheckpointError`` naming it, not the claim's
    FileExistsError."""
    assert run_workers(1, _series_in_a_file, str(tmp_path)) == [f"claiming {tmp_path / 'notes.txt'} failed on rank 0: "
                                                                   f"{tmp_path / 'notes.txt'} is a file; give it a "
                                                                   f"directory"]
    assert (tmp_path / "notes.txt").read_text() == "the user's"


def _series_of_another_model(rank, world, directory):
    model, optimizer = make_model(seed=0)
    for step in (1, 2, 3):
        shardwire.save_checkpoint(shardwire.checkpoint_path(directory, step), model, optimizer, step=step).wait()
    other = shardwire.shard(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2)))
    return outcome(lambda: shardwire.load_latest_checkpoint(directory, other))


def test_a_series_of_another_models_checkpoints_says_its_reason_once(tmp_path):
    """Every checkpoint of another model fails alike: the refusal says the reason once, with the
    remedy, rather than once per checkpoint in one long line."""
    said, = run_workers(1, _series_of_another_model, str(tmp_path))
    newest = tmp_path / "step_00000003"
    assert said.startswith(f"no checkpoint in {tmp_path} can be loaded: all 3 (step_00000001 to step_00000003) "
                           f"fail as the newest does: loading checkpoint {newest} failed on rank 0: {newest} was "
                           f"saved from a different model: "), said
    assert said.endswith("; load it into the model it was saved from") and said.count("different model") == 1, said


def test_a_manifest_larger_than_any_is_refused_unread(tmp_path):
    """A manifest past the bound (a sparse file of gigabytes, a forged one) is refused before it is
    read, rather than parsed for seconds in gigabytes of memory."""
    from shardwire.engine.checkpoint.format import MAX_MANIFEST_BYTES, Manifest

    checkpoint = tmp_path / "step_00000001"
    checkpoint.mkdir()
    with (checkpoint / "manifest.json").open("wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)
    with pytest.raises(shardwire.CheckpointError, match=f"manifest.json: larger than {MAX_MANIFEST_BYTES:,} bytes, "
                                                        f"more than any manifest holds"):
        Manifest.read(checkpoint)


def _run_saving_steps_1_and_2(rank, directory):
    """The first run: checkpoints at steps 1 and 2; returns the state at step 2."""
    model, optimizer = make_model(seed=0)
    for step in (1, 2):
        train_step(model, optimizer, step, rank)
        save_step(directory, model, optimizer, step)
    return shardwire.full_state_dict(model)


def _next_run(rank, directory):
    """A run resuming from the newest good checkpoint and saving step 2 again; the warnings of its save."""
    model, optimizer = make_model(seed=1)
    with logged_warnings() as skipped:
        resumed = shardwire.load_latest_checkpoint(directory, model, optimizer).step
    train_step(model, optimizer, 2, rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_step(directory, model, optimizer, 2)
    return {
        "skipped": skipped,
        "resumed": resumed,
        "state": shardwire.full_state_dict(model),
        "warnings": [str(w.message) for w in caught],
    }


def _incomplete_newest(rank, directory):
    """A newest checkpoint that lost its manifest (nothing proves a save made what is left): the next
    run resumes from step 1, sets the remains aside whole, and saves step 2 in their place."""
    uninterrupted = _run_saving_steps_1_and_2(rank, directory)
    newest = shardwire.checkpoint_path(directory, 2)
    files = listing(newest)
    on_rank_0(rank, lambda: (newest / "manifest.json").unlink())
    run = _next_run(rank, directory)
    aside = [name for name in listing(directory) if name.startswith("step_00000002.")]
    model, optimizer = make_model(seed=2)
    return {
        **run,
        "uninterrupted": uninterrupted,
        "files": files,
        "after": listing(directory),
        "set aside holds": listing(directory / aside[0]) if aside else None,
        "then resumes": outcome(lambda: shardwire.load_latest_checkpoint(directory, model, optimizer)),
    }


def _incomplete_made_by_a_save(rank, directory):
    """A newest checkpoint that a save made but never completed (its temporary directory got the
    checkpoint's name, as a rename that is not atomic can leave it): the next run replaces it."""
    _run_saving_steps_1_and_2(rank, directory)
    model, optimizer = make_model(seed=0)
    with crash_while_writing(), contextlib.suppress(shardwire.CheckpointError):
        save_step(directory, model, optimizer, 3)
    newest = shardwire.checkpoint_path(directory, 3)
    on_rank_0(rank, lambda: next(directory.glob("step_00000003.tmp-*")).rename(newest))
    before = listing(directory)
    model, optimizer = make_model(seed=1)
    resumed = outcome(lambda: shardwire.load_latest_checkpoint(directory, model, optimizer))
    train_step(model, optimizer, 3, rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_step(directory, model, optimizer, 3, keep=None)
    return {
        "before": before,
        "resumed": resumed,
        "warnings": [str(w.message) for w in caught],
        "after": listing(directory),
        "then resumes": outcome(lambda: shardwire.load_latest_checkpoint(directory, model, optimizer)),
    }


SCENARIOS = {
    "user temporaries": _user_temporaries,
    "failed save": _failed_save,
    "prune": _prune_among_strangers,
    "bad manifests": _bad_manifests,
    "step unlike name": _step_unlike_name,
    "incomplete newest": _incomplete_newest,
    "incomplete made by a save": _incomplete_made_by_a_save,
}


def _all_scenarios(rank, world, root):
    """Each scenario in a directory of its own; one that raises is reported and the others still run
    (on code without these fixes, each test then fails on its own scenario)."""
    results = {}
    for name, scenario in SCENARIOS.items():
        try:
            results[name] = scenario(rank, pathlib.Path(root) / name)
        except Exception as err:  # every call in a scenario either is collective or is followed by one
            results[name] = {"error": f"{type(err).__name__}: {err}"}
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> dict:
    return run_workers(2, _all_scenarios, str(tmp_path_factory.mktemp("faults")))[0]


def result(scenarios: dict, name: str) -> dict:
    assert "error" not in scenarios[name], scenarios[name]["error"]
    return scenarios[name]


# ---------------------------------------------------------------------------------------- tests


def test_clean_up_leaves_a_users_directory_named_like_a_temporary(scenarios):
    outcome = result(scenarios, "user temporaries")
    users = ["step_00000001.tmp-0123456789ab", "step_00000002.tmp-aaaaaaaaaaaa"]
    leftover = [name for name in outcome["after crash"] if name not in users]
    assert len(leftover) == 1 and leftover[0].startswith("step_00000001.tmp-")  # the crashed save's
    assert outcome["after save"] == sorted([*users, "step_00000001"])  # its leftover deleted, nothing else
    assert outcome["notes"] == "mine"


def test_a_save_that_fails_and_lives_on_leaves_nothing_of_itself(scenarios):
    outcome = result(scenarios, "failed save")
    assert "No space left on device" in outcome["failed"]
    assert outcome["after"] == ["step_00000001", "step_00000002.tmp-0123456789ab"]  # the user's stays


def test_prune_deletes_only_complete_checkpoints(scenarios):
    # The user's step_00000000 (a manifest.json of its own) and step_00000001 (none) are not counted,
    # not deleted; nor is checkpoint 2, once the user exported into it, nor the copies of its manifest
    # in 3 (beside the user's files) and 4 (of another step): keep=1 deletes checkpoint 5.
    outcome = result(scenarios, "prune")
    assert outcome["after"] == [f"step_0000000{step}" for step in (0, 1, 2, 3, 4, 6)]
    assert outcome["export"] == b"the user's" and outcome["forged"] == b"the user's"
    for kept in ("step_00000002 also holds what no save wrote (exported.pt)",
                 "step_00000003/rank_00000.safetensors holds 10 bytes where its manifest records",
                 "step_00000004 holds the manifest of step 2, not of the step its name says"):
        assert any("kept" in message and kept in message for message in outcome["warned"]), (kept, outcome["warned"])
    assert not any("step_00000000" in message for message in outcome["warned"])  # the user's own manifest.json


@pytest.mark.parametrize("case, reason", [
    ("parent", "files[0].name is '../x', not a plain file name inside the checkpoint directory"),
    ("absolute", "files[1].name is '/etc/hostname', not a plain file name inside the checkpoint directory"),
])
def test_a_file_name_outside_the_checkpoint_is_refused_and_skipped(scenarios, case, reason):
    check_refused_and_skipped(result(scenarios, "bad manifests")[case], reason)


@pytest.mark.parametrize("case, reason", [
    ("negative step", "step is -1, not an integer >= 0"),
    ("string step", "step is '3', not an integer >= 0"),
    ("world size 0", "world_size is 0, not an integer >= 1"),
])
def test_a_wrong_type_or_range_is_refused_and_skipped(scenarios, case, reason):
    check_refused_and_skipped(result(scenarios, "bad manifests")[case], reason)


def test_a_manifest_unlike_its_checksum_is_refused_and_skipped(scenarios):
    check_refused_and_skipped(
        result(scenarios, "bad manifests")["edited"],
        "invalid manifest: its contents differ from the sha256 it records: the manifest is corrupted",
    )


def check_refused_and_skipped(case: dict, reason: str) -> None:
    assert "step_00000002/manifest.json: invalid manifest: " in case["load_checkpoint"]
    assert reason in case["load_checkpoint"]
    assert case["load_latest_checkpoint"] == "loaded step 1"
    assert len(case["skipped"]) == 1 and "cannot resume from" in case["skipped"][0]
    assert reason in case["skipped"][0]


def test_a_checkpoint_whose_step_is_not_its_names_is_skipped(scenarios):
    outcome = result(scenarios, "step unlike name")
    assert outcome["load_latest_checkpoint"] == "loaded step 1"
    assert len(outcome["skipped"]) == 1
    assert "step_00000002: its manifest records step 7, its name step 2" in outcome["skipped"][0]


def test_an_incomplete_newest_checkpoint_does_not_stop_the_next_run(scenarios):
    outcome = result(scenarios, "incomplete newest")
    assert outcome["resumed"] == 1
    assert len(outcome["skipped"]) == 1 and "step_00000002/manifest.json: missing" in outcome["skipped"][0]
    # The step saved again equals the first run's, so the resumed run repeated it exactly.
    assert outcome["state"].keys() == outcome["uninterrupted"].keys()
    assert all(torch.equal(outcome["state"][k], outcome["uninterrupted"][k]) for k in outcome["state"])
    aside = [name for name in outcome["after"] if name.startswith("step_00000002.set-aside-")]
    assert outcome["after"] == sorted(["step_00000001", "step_00000002", *aside]) and len(aside) == 1
    assert outcome["set aside holds"] == [name for name in outcome["files"] if name != "manifest.json"]
    assert len(outcome["warnings"]) == 1 and f"as {aside[0]}" in outcome["warnings"][0]
    assert outcome["then resumes"] == "loaded step 2"


def test_an_incomplete_checkpoint_a_save_made_is_replaced(scenarios):
    outcome = result(scenarios, "incomplete made by a save")
    assert outcome["before"] == ["step_00000001", "step_00000002", "step_00000003"]
    assert outcome["resumed"] == "loaded step 2"
    assert outcome["warnings"] == []  # provably a save's: replaced, not set aside
    assert outcome["after"] == ["step_00000001", "step_00000002", "step_00000003"]
    assert outcome["then resumes"] == "loaded step 3"


@pytest.mark.parametrize("make", [lambda path: os.mkfifo(path), lambda path: path.symlink_to("/dev/zero")],
                         ids=["fifo", "link to a device"])
def test_a_manifest_that_is_not_a_regular_file_is_named_so_unread(tmp_path, make):
    """It was said to be missing, where the user sees one."""
    from shardwire.engine.checkpoint.format import Manifest

    make(tmp_path / "manifest.json")
    with pytest.raises(shardwire.CheckpointError, match=f"{tmp_path / 'manifest.json'}: not a regular file; "
                                                        f"{tmp_path} is not a complete shardwire checkpoint"):
        Manifest.read(tmp_path)


@pytest.mark.parametrize("make", [lambda path: os.mkfifo(path), lambda path: path.symlink_to("/dev/zero")],
                         ids=["fifo", "link to a device"])
def test_a_rank_file_that_is_not_a_regular_file_is_named_so_unread(tmp_path, make):
    """It was said to be missing, where the user sees one."""
    from shardwire.engine.checkpoint.portable import read_state_dict

    torch.manual_seed(0)
    model = shardwire.shard(nn.Linear(4, 4))
    path = shardwire.checkpoint_path(tmp_path, 1)
    shardwire.save_checkpoint(path, model, step=1).wait()
    rank_file = path / "rank_00000.safetensors"
    size = rank_file.stat().st_size
    rank_file.unlink()
    make(rank_file)
    kind = "a FIFO" if rank_file.is_fifo() else "a character device"
    with pytest.raises(shardwire.CheckpointError, match=f"{rank_file}: is {kind}, where the manifest lists a file "
                                                        f"of {size} bytes; the checkpoint is damaged"):
        read_state_dict(path)


def _groups_resume_a_checkpoint_forged_apart(rank, world, root, files, key, forge):
    """Two groups of one rank that sync every 2 steps save at steps 2 and 3; then, in the rank files
    ``files`` of step 3, ``forge`` (``("add", x)`` or ``("set", values)``) changes ``key`` and the
    files and manifest are re-hashed, as a forger would. Returns what loading step 3 by name raised
    and the step a resume of the series took."""
    from safetensors.torch import load_file, save_file

    from shardwire.engine.checkpoint.format import FileRecord
    from shardwire.engine.diloco import DiLoCo
    from shardwire.models.gpt import GPT, PRESETS, Block, loss_fn

    def build():
        model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block], layout="hybrid", shard_group_size=1,
                                diloco=DiLoCo(sync_every=2))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    torch.manual_seed(0)
    model, optimizer = build()
    for step in (1, 2, 3):
        tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(10 * step + rank))
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step > 1:
            shardwire.save_checkpoint(shardwire.checkpoint_path(root, step), model, optimizer, step=step)
    forged = shardwire.checkpoint_path(root, 3)
    if rank == 0:
        for index in files:
            file = forged / f"rank_{index:05d}.safetensors"
            tensors = load_file(file)
            how, value = forge
            tensors[key] = tensors[key] + value if how == "add" else torch.tensor(value)
            save_file(tensors, file)

        def rehash(manifest):
            manifest["files"] = [dataclasses.asdict(FileRecord.of(forged / record["name"],
                                                                  (forged / record["name"]).read_bytes()))
                                 for record in manifest["files"]]

        rewrite_manifest(forged, rehash)
    dist.barrier()
    model, optimizer = build()
    try:
        shardwire.load_checkpoint(forged, model, optimizer)
        refused = None
    except shardwire.CheckpointError as err:
        refused = str(err)
    return refused, shardwire.load_latest_checkpoint(root, model, optimizer).step


@pytest.mark.parametrize("files, key, forge, reason", [
    ((1,), "outer/blocks.0/anchor", ("add", 0.5),
     "its groups saved different anchors (the model they last agreed on): group 0's and group 1's differ"),
    ((1,), "outer/<root>/momentum", ("add", 0.5),
     "its groups saved different outer momentum: group 0's and group 1's differ"),
    ((1,), "outer/schedule", ("set", [3, 2, -1]),
     "its groups saved different places in the outer steps' schedule: group 0's and group 1's differ"),
    # a resume then issued, one at a time, every sync due over 2**62 steps
    ((0, 1), "outer/schedule", ("set", [2 ** 62, 3, -1]),
     "its outer schedule records 4611686018427387904 inner steps done and syncs issued to step 3"),
], ids=["anchor", "momentum", "schedule", "schedule-far-ahead"])
def test_a_checkpoint_whose_groups_saved_unlike_outer_states_is_refused_and_skipped(tmp_path, files, key, forge,
                                                                                    reason):
    """It resumed each group from its own: every sync after averaged changes from two models, and the
    run ended with the groups reported synced while they held different models; or the groups waited
    for a sync the other never sent, until the timeout."""
    for refused, resumed in run_workers(2, _groups_resume_a_checkpoint_forged_apart, str(tmp_path), files, key, forge,
                                        env={"LOCAL_WORLD_SIZE": "1"}):
        assert "step_00000003" in refused and reason in refused, refused
        assert resumed == 2


def test_a_directory_moved_under_a_run_is_claimed_again(tmp_path):
    """`mv ckpt ckpt-moved` during a run: it saved on into a new ckpt that no claim guarded. Moved
    again, it is said to be again (the second warning, of the same words, was not shown)."""
    model, optimizer = make_model(0)
    save_step(tmp_path / "ckpt", model, optimizer, 1)
    (tmp_path / "ckpt").rename(tmp_path / "moved")
    with pytest.warns(UserWarning, match="ckpt was moved or removed while this run saved in it: the run claims it "
                                         "again and saves step_00000002 there and what follows"):
        save_step(tmp_path / "ckpt", model, optimizer, 2)
    assert (tmp_path / "ckpt" / CLAIM).exists() and listing(tmp_path / "ckpt") == ["step_00000002"]
    assert listing(tmp_path / "moved") == ["step_00000001"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_step(tmp_path / "ckpt", model, optimizer, 3)  # claimed: nothing to say
    (tmp_path / "ckpt").rename(tmp_path / "moved-again")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("default")  # as a command shows them: a repeated warning once
        save_step(tmp_path / "ckpt", model, optimizer, 4)
    assert [str(w.message).split(":")[0] for w in said] == [f"{tmp_path / 'ckpt'} was moved or removed while this run "
                                                             f"saved in it"]


def test_a_directory_replaced_under_a_run_is_not_saved_into(tmp_path):
    """`mv ckpt moved; cp -a other ckpt` during a run: the copied claim file passed for the run's own,
    and --keep deleted the other series' checkpoints; a file put at its name was met by advice to
    resume from a directory that no longer held the run's checkpoints."""
    model, optimizer = make_model(0)
    save_step(tmp_path / "other", model, optimizer, 7)
    save_step(tmp_path / "ckpt", model, optimizer, 1)
    (tmp_path / "ckpt").rename(tmp_path / "moved")
    shutil.copytree(tmp_path / "other", tmp_path / "ckpt")  # its claim file with it
    with pytest.raises(shardwire.CheckpointError, match=r"ckpt was moved or removed while this run saved in it, and "
                                                        r"the checkpoints it saved are where it went; it now holds "
                                                        r"checkpoints this run did not save \(step_00000007, ...\)"):
        save_step(tmp_path / "ckpt", model, optimizer, 2, keep=1)
    assert listing(tmp_path / "ckpt") == ["step_00000007"]
    shutil.rmtree(tmp_path / "ckpt")
    (tmp_path / "ckpt").write_text("precious")
    with pytest.raises(shardwire.CheckpointError, match="something else now has its name, which is left as it is"):
        save_step(tmp_path / "ckpt", model, optimizer, 2)
    assert (tmp_path / "ckpt").read_text() == "precious"


def test_a_directory_turned_into_a_link_to_another_series_is_not_saved_into(tmp_path):
    """`mv ckpt moved; ln -s other ckpt` during a run (or a --checkpoint-dir link pointed elsewhere):
    the run claimed the link's target afresh, saved there and --keep deleted its series."""
    model, optimizer = make_model(0)
    other_model, other_optimizer = make_model(1)  # another run's series, its claim file left as it ended
    save_step(tmp_path / "other", other_model, other_optimizer, 7)
    save_step(tmp_path / "ckpt", model, optimizer, 1)
    (tmp_path / "ckpt").rename(tmp_path / "moved")
    (tmp_path / "ckpt").symlink_to(tmp_path / "other")
    with pytest.raises(shardwire.CheckpointError, match=r"it now holds checkpoints this run did not save "
                                                        r"\(step_00000007, ...\)"):
        save_step(tmp_path / "ckpt", model, optimizer, 2, keep=1)
    assert listing(tmp_path / "other") == ["step_00000007"]
