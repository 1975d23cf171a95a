"""Sharded checkpoints: exact round trips, resharding to other world sizes, resumed training equal to
uninterrupted training, asynchronous saves, crashes during a save, and refusing bad files."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import pathlib
import shutil
from unittest import mock

import pytest
import safetensors.torch
import torch
from torch.distributed.tensor import DTensor

import shardwire
from harness import run_workers
from shardwire.engine.checkpoint import list_checkpoints, save
from shardwire.engine.checkpoint.claim import CLAIM
from shardwire.engine.shard import engine_of
from shardwire.models.gpt import GPT, PRESETS, Block, GPTConfig, loss_fn

pytestmark = pytest.mark.slow

LOCAL_BATCH = 2
OTHER_MODEL = GPTConfig(seq_len=32, layers=3, hidden=48, heads=2)


def make_model(seed: int, config=PRESETS["tiny"], **shard_args):
    """The GPT and AdamW in two param groups: matrices decayed, biases and norms not, at two rates."""
    torch.manual_seed(seed)
    model = shardwire.shard(GPT(config), units=[Block], **shard_args)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 1e-3},
    ], lr=3e-3, betas=(0.9, 0.95), eps=1e-6)
    return model, optimizer


def group_settings(optimizer) -> list[tuple]:
    return [(group["lr"], group["weight_decay"], len(group["params"])) for group in optimizer.param_groups]


def train(model, optimizer, steps: range, rank: int, world: int) -> None:
    """Steps whose global batch depends only on the step number, as the main job's data does."""
    for step in steps:
        tokens = torch.randint(0, 256, (world * LOCAL_BATCH, 33), generator=torch.Generator().manual_seed(step))
        local = tokens[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
        loss_fn(model(local[:, :-1]), local[:, 1:]).backward()
        shardwire.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()


def full_optimizer_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter's AdamW state, unsharded: its moments whole (DTensors gathered) and its step count."""
    return {f"{name}/{key}": value.full_tensor() if isinstance(value, DTensor) else value.clone()
            for name, param in model.named_parameters() for key, value in optimizer.state[param].items()}


def assert_same(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


# ---------------------------------------------------------------------------- saving at world 4


def _train_and_save(rank, world, root):
    root = pathlib.Path(root)
    model, optimizer = make_model(seed=0)
    train(model, optimizer, range(3), rank, world)
    optimizer.param_groups[1]["lr"] = 5e-4  # as a scheduler would: the loaded groups must have it
    rng_at_save = torch.get_rng_state()
    shardwire.save_checkpoint(root / "step3", model, optimizer, step=3, extra={"epoch": 1, "tag": "t"})
    saved = {"params": shardwire.full_state_dict(model), "optimizer": full_optimizer_state(model, optimizer),
             "groups": group_settings(optimizer)}
    train(model, optimizer, range(3, 5), rank, world)
    uninterrupted = shardwire.full_state_dict(model)

    torch.rand(100)  # move the RNG on, so that restoring it is visible
    info = shardwire.load_checkpoint(root / "step3", model, optimizer)
    assert (info.step, info.extra, info.world_size, info.rng_restored) == (3, {"epoch": 1, "tag": "t"}, 4, True)
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    train(model, optimizer, range(3, 5), rank, world)
    resumed = shardwire.full_state_dict(model)

    # Asynchronous: the checkpoint holds the state at the call, although training goes on meanwhile.
    pending = shardwire.save_checkpoint(root / "async5", model, optimizer, step=5, asynchronous=True)
    train(model, optimizer, range(5, 6), rank, world)
    pending.wait()

    other, other_optimizer = make_model(seed=0, config=OTHER_MODEL)
    shardwire.save_checkpoint(root / "other", other, other_optimizer)
    if rank == 0:
        torch.save({**saved, "uninterrupted": uninterrupted, "resumed": resumed}, root / "reference.pt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> pathlib.Path:
    """Checkpoints written by 4 ranks, and the reference values they hold (reference.pt)."""
    root = tmp_path_factory.mktemp("checkpoints")
    run_workers(4, _train_and_save, str(root))
    return root


def reference(root: pathlib.Path) -> dict:
    return torch.load(root / "reference.pt")


def test_resumed_training_equals_uninterrupted_training(saved):
    ref = reference(saved)
    assert_same(ref["resumed"], ref["uninterrupted"])


def test_checkpoint_is_a_manifest_and_one_file_per_rank(saved):
    files = sorted(p.name for p in (saved / "step3").iterdir())
    assert files == ["manifest.json", *(f"rank_{r:05d}.safetensors" for r in range(4)), "replicated.safetensors"]
    manifest = json.loads((saved / "step3" / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and manifest["step"] == 3
    assert [flat["name"] for flat in manifest["flats"]] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    assert manifest["flats"][0]["slots"][0]["names"] == ["tok_emb.weight", "head.weight"]
    assert {f["name"] for f in manifest["files"]} == set(files) - {"manifest.json"}
    assert not [p for p in saved.iterdir() if ".tmp-" in p.name]


def test_asynchronous_save_holds_the_state_at_the_call(saved, tmp_path):
    exported = shardwire.export_state_dict(saved / "async5", tmp_path / "async5.pt")
    assert_same(torch.load(exported), reference(saved)["resumed"])


def test_export_loads_into_the_unsharded_model_without_shardwire(saved, tmp_path):
    expected = reference(saved)["params"]
    plain = shardwire.export_state_dict(saved / "step3", tmp_path / "model.pt")
    model = GPT(PRESETS["tiny"])
    model.load_state_dict(torch.load(plain, weights_only=True))
    assert_same(model.state_dict(), expected)

    tensors = shardwire.export_state_dict(saved / "step3", tmp_path / "model.safetensors")
    assert "head.weight" not in safetensors.torch.load_file(tensors)  # the tie is stored once
    model = GPT(PRESETS["tiny"])
    safetensors.torch.load_model(model, tensors)
    assert_same(model.state_dict(), expected)


# ----------------------------------------------------------------- loading at 2 and 3 ranks
#
# Starting ranks takes seconds, so everything checked at two ranks runs in one set of processes (the
# ``at_two_ranks`` fixture); each test below asserts on its part of the results.


def _load_resharded(rank, world, saved, name="step3"):
    model, optimizer = make_model(seed=7)
    info = shardwire.load_checkpoint(pathlib.Path(saved) / name, model, optimizer)
    # The loaded state trains on: the padding of the new packing holds zeros, not stale values.
    for flat in engine_of(model).flats:
        for slot, _, held in flat.held_parts():
            assert not flat.shard[held.at + held.numel : slot.offset + flat.packing.part_numel(slot)].any()
    return {
        "info": (info.step, info.world_size, info.rng_restored),
        "groups": group_settings(optimizer),
        "params": shardwire.full_state_dict(model),
        "optimizer": full_optimizer_state(model, optimizer),
    }


def _import(rank, world, files):
    states = []
    for path in files["good"]:
        model, _ = make_model(seed=9)
        shardwire.import_state_dict(model, path)
        states.append(shardwire.full_state_dict(model))
    with pytest.raises(shardwire.CheckpointError) as caught:
        shardwire.import_state_dict(model, files["other"])
    return {"states": states, "other": str(caught.value)}


def _refuse_bad_input(rank, world, cases, series, scratch):
    model, optimizer = make_model(seed=7)
    before = shardwire.full_state_dict(model)
    errors = {}
    for name, path in cases.items():
        with pytest.raises(shardwire.CheckpointError) as caught:
            shardwire.load_checkpoint(path, model, optimizer)
        errors[name] = str(caught.value)
    unchanged = (shardwire.full_state_dict(model), not optimizer.state)

    # State that cannot be re-sliced for another world size is refused before anything is written.
    embedding = dict(model.named_parameters())["tok_emb.weight"]
    optimizer.state[embedding]["factored"] = torch.zeros(2)
    with pytest.raises(shardwire.CheckpointError) as caught:
        shardwire.save_checkpoint(pathlib.Path(scratch) / "unsaveable", model, optimizer)
    errors["unsaveable state"] = str(caught.value)
    del optimizer.state[embedding]
    with pytest.raises(shardwire.CheckpointError) as caught:
        shardwire.save_checkpoint(pathlib.Path(scratch) / "unsaveable", model, extra={"at": object()})
    errors["unsaveable extra"] = str(caught.value)
    assert not (pathlib.Path(scratch) / "unsaveable").exists()

    info = shardwire.load_latest_checkpoint(series, model, optimizer)
    return {"errors": errors, "before": before, "after": unchanged[0], "optimizer untouched": unchanged[1],
            "resumed from": info.path.name}


def _crash_during_save(rank, world, directory):
    directory = pathlib.Path(directory)
    model, optimizer = make_model(seed=0)
    train(model, optimizer, range(1), rank, world)
    shardwire.save_checkpoint(shardwire.checkpoint_path(directory, 1), model, optimizer, step=1, keep=2)
    at_step_1 = shardwire.full_state_dict(model)
    train(model, optimizer, range(1, 2), rank, world)
    step_2 = shardwire.checkpoint_path(directory, 2)

    def disk_full(path, data):  # rank 1 stops half-way through its file
        path.write_bytes(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    disk_full_on_rank_1 = mock.patch.object(save, "write_durably", disk_full) if rank == 1 else contextlib.nullcontext()
    def disk_full_error():
        return pytest.raises(shardwire.CheckpointError, match="rank 1: OSError: .*No space left")

    with disk_full_on_rank_1:
        pending = shardwire.save_checkpoint(step_2, model, optimizer, step=2, keep=2, asynchronous=True)
        with disk_full_error():
            pending.wait()
    with disk_full_error():  # and again: a failed save never passes for a saved one
        pending.wait()

    # Rank 0 writes the manifest, then stops short of the rename.
    crash = mock.patch.object(save, "_fsync_directory", side_effect=OSError(5, "Input/output error"))
    with crash if rank == 0 else contextlib.nullcontext(), pytest.raises(
        shardwire.CheckpointError, match="rank 0: OSError: .*Input/output error"
    ):
        shardwire.save_checkpoint(step_2, model, optimizer, step=2, keep=2)
    after_crashes = sorted(p.name for p in directory.iterdir() if p.name != CLAIM)

    info = shardwire.load_latest_checkpoint(directory, model, optimizer)
    restored = shardwire.full_state_dict(model)
    for step in (2, 3):
        train(model, optimizer, range(step - 1, step), rank, world)
        shardwire.save_checkpoint(shardwire.checkpoint_path(directory, step), model, optimizer, step=step, keep=2)
    return {
        "after crashes": after_crashes,
        "resumed step": info.step,
        "saved at step 1": at_step_1,
        "restored": restored,
        "finally": sorted(p.name for p in directory.iterdir() if p.name != CLAIM),
        "listed": [p.name for p in list_checkpoints(directory)],
    }


def _at_two_ranks(rank, world, paths):
    return {
        "resharded": _load_resharded(rank, world, paths["saved"]),
        "imported": _import(rank, world, paths["import"]),
        "bad input": _refuse_bad_input(rank, world, **paths["bad input"]),
        "crash": _crash_during_save(rank, world, paths["crash"]),
    }


def _import_files(saved: pathlib.Path, scratch: pathlib.Path) -> dict:
    return {
        "good": [str(shardwire.export_state_dict(saved / "step3", scratch / name))
                 for name in ("model.pt", "model.safetensors")],
        "other": str(shardwire.export_state_dict(saved / "other", scratch / "other.pt")),
    }


def _bad_inputs(saved: pathlib.Path, scratch: pathlib.Path) -> dict:
    def damaged(name, damage):
        copy = scratch / name
        shutil.copytree(saved / "step3", copy)
        damage(copy)
        return copy

    def truncate(path):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    def flip_byte(path):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    cases = {
        "truncated": damaged("truncated", lambda d: truncate(d / "rank_00001.safetensors")),
        "corrupted": damaged("corrupted", lambda d: flip_byte(d / "rank_00002.safetensors")),
        "missing": damaged("missing", lambda d: (d / "rank_00003.safetensors").unlink()),
        "no manifest": damaged("no_manifest", lambda d: (d / "manifest.json").unlink()),
        "other model": saved / "other",
    }
    series = scratch / "series"  # a good checkpoint, and a newer corrupted one
    shutil.copytree(saved / "step3", shardwire.checkpoint_path(series, 3))
    shutil.copytree(cases["corrupted"], shardwire.checkpoint_path(series, 5))
    return {"cases": {k: str(v) for k, v in cases.items()}, "series": str(series), "scratch": str(scratch)}


@pytest.fixture(scope="module")
def at_two_ranks(saved, tmp_path_factory) -> dict:
    scratch = tmp_path_factory.mktemp("two_ranks")
    paths = {
        "saved": str(saved),
        "import": _import_files(saved, scratch),
        "bad input": _bad_inputs(saved, scratch),
        "crash": str(scratch / "crash"),
    }
    return run_workers(2, _at_two_ranks, paths)[0]


def check_resharded(result: dict, saved: pathlib.Path) -> None:
    assert result["info"] == (3, 4, False)  # step, saved world size, RNG not restored
    ref = reference(saved)
    assert result["groups"] == ref["groups"] == [(3e-3, 0.1, 14), (5e-4, 0.0, 23)]
    assert_same(result["params"], ref["params"])
    assert_same(result["optimizer"], ref["optimizer"])


def test_reshards_from_four_ranks_to_two_exactly(at_two_ranks, saved):
    check_resharded(at_two_ranks["resharded"], saved)


def test_reshards_from_four_ranks_to_three_exactly(saved):
    check_resharded(run_workers(3, _load_resharded, str(saved))[0], saved)


def test_import_into_a_sharded_model(at_two_ranks, saved):
    imported = at_two_ranks["imported"]
    for state in imported["states"]:  # from model.pt and model.safetensors
        assert_same(state, reference(saved)["params"])
    assert "other.pt: 'tok_emb.weight' has shape (256, 48), the model (256, 32)" in imported["other"]


def test_bad_input_is_refused_naming_file_and_reason(at_two_ranks):
    result = at_two_ranks["bad input"]
    errors = result["errors"]
    assert "truncated/rank_00001.safetensors: " in errors["truncated"]
    assert "the file is truncated" in errors["truncated"]
    assert "corrupted/rank_00002.safetensors: its sha256 differs" in errors["corrupted"]
    assert "missing/rank_00003.safetensors: missing" in errors["missing"]
    assert "no_manifest/manifest.json: missing" in errors["no manifest"]
    assert "saved from a different model: 'tok_emb.weight' has shape (256, 48)" in errors["other model"]
    assert "optimizer state 'factored' of 'tok_emb.weight' is a tensor of shape (2,)" in errors["unsaveable state"]
    assert "extra must be JSON-serializable" in errors["unsaveable extra"]
    assert_same(result["after"], result["before"])  # never a partial load
    assert result["optimizer untouched"]
    assert result["resumed from"] == "step_00000003"  # skipping the corrupted newer one


def test_crash_during_save_leaves_the_previous_checkpoint(at_two_ranks):
    result = at_two_ranks["crash"]
    assert result["after crashes"] == ["step_00000001"]  # each failed save deleted what it had written
    assert result["resumed step"] == 1
    assert_same(result["restored"], result["saved at step 1"])
    # keep=2 keeps the newest two.
    assert result["finally"] == result["listed"] == ["step_00000002", "step_00000003"]


def _as_format_2(directory: pathlib.Path) -> None:
    """Rewrite a checkpoint's manifest as format 2 wrote it: optimizer state per flat buffer."""
    from shardwire.engine.checkpoint.format import _body_sha256

    body = json.loads((directory / "manifest.json").read_text())
    del body["sha256"], body["groups"]
    body["version"] = 2
    for record in body["files"]:
        del record["mtime_ns"]  # format 7's
    for flat in body["flats"]:
        flat["optimizer_state"] = {"exp_avg": {"kind": "per_element", "dtype": "float32"}}
    body["optimizer"] = {"class": "AdamW", "param_groups": [{"lr": 3e-3, "params": [f["name"] for f in body["flats"]]}]}
    (directory / "manifest.json").write_text(json.dumps({**body, "sha256": _body_sha256(body)}))


def test_a_format_2_checkpoint_loads_its_model_and_refuses_its_optimizer_state(tmp_path):
    model, optimizer = make_model(seed=0)
    train(model, optimizer, range(1), rank=0, world=1)
    shardwire.save_checkpoint(tmp_path / "old", model, optimizer, step=1)
    expected = shardwire.full_state_dict(model)
    _as_format_2(tmp_path / "old")
    model, optimizer = make_model(seed=1)
    with pytest.raises(shardwire.CheckpointError, match="written in checkpoint format 2, .*load it with optimizer=None"):
        shardwire.load_checkpoint(tmp_path / "old", model, optimizer)
    assert shardwire.load_checkpoint(tmp_path / "old", model).step == 1
    assert_same(shardwire.full_state_dict(model), expected)


def _as_format_5(directory: pathlib.Path) -> None:
    """Rewrite a checkpoint as format 5 wrote it: each rank's shard an equal run of its buffer's
    parameters laid end to end, a step count in the file of the rank holding its parameter's first
    element."""
    from shardwire.engine.checkpoint.format import _body_sha256, rank_file
    from shardwire.engine.checkpoint.reader import CheckpointReader
    from shardwire.engine.packing import Packing

    body = json.loads((directory / "manifest.json").read_text())
    with CheckpointReader(directory) as reader:
        world = reader.manifest.world_size
        files = [dict(safetensors.torch.load_file(directory / rank_file(rank))) for rank in range(world)]
        for flat, record in zip(reader.manifest.flats, body["flats"]):
            slots = flat.packing.slots
            old = Packing.end_to_end([(slot.names, slot.shape) for slot in slots], flat.packing.dtype, world)
            for key in [key for key in files[0] if key == f"param/{flat.name}" or key.startswith(f"optim/{flat.name}/")]:
                laid = torch.zeros(old.padded_numel, dtype=files[0][key].dtype)
                laid[: old.numel] = torch.cat([reader.param_run(flat, key, slot, 0, slot.numel, laid.dtype)
                                               for slot in slots])
                for rank in range(world):
                    start, end = old.shard_range(rank)
                    files[rank][key] = laid[start:end].clone()
            for slot, saved in zip(slots, old.slots):
                scalars = [key for key in files[0] if key.startswith(f"optim-scalar/{slot.names[0]}/")]
                for key in scalars:
                    files[old.first_holder(saved)][key] = files[0].pop(key)
            record.update(numel=old.numel, padded_numel=old.padded_numel,
                          slots=[{"names": list(s.names), "shape": list(s.shape), "offset": s.offset} for s in old.slots])
    for rank, tensors in enumerate(files):
        safetensors.torch.save_file(tensors, directory / rank_file(rank))
    for record in body["files"]:
        data = (directory / record["name"]).read_bytes()
        record.update(nbytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        del record["mtime_ns"]  # format 7's
    del body["sha256"]
    body["version"] = 5
    (directory / "manifest.json").write_text(json.dumps({**body, "sha256": _body_sha256(body)}))


def test_a_format_5_checkpoint_loads_its_model_and_optimizer_at_another_world_size(saved, tmp_path):
    """Before format 6 a shard was an equal run of its buffer's parameters laid end to end: saved so
    at 4 ranks, it loads at 3 as exactly as the same checkpoint in the current format does."""
    shutil.copytree(saved / "step3", tmp_path / "format5")
    _as_format_5(tmp_path / "format5")
    assert json.loads((tmp_path / "format5" / "manifest.json").read_text())["version"] == 5
    check_resharded(run_workers(3, _load_resharded, str(tmp_path), "format5")[0], saved)


def test_an_optimizer_with_other_param_groups_is_refused_naming_the_difference(tmp_path):
    model, optimizer = make_model(seed=0)
    train(model, optimizer, range(1), rank=0, world=1)
    shardwire.save_checkpoint(tmp_path / "groups", model, optimizer)
    ungrouped = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with pytest.raises(shardwire.CheckpointError, match="the optimizer had 2 param groups when saved and has 1 now"):
        shardwire.load_checkpoint(tmp_path / "groups", model, ungrouped)
    params = dict(model.named_parameters())
    moved = torch.optim.AdamW([  # norm.bias moved to the decayed group
        {"params": [p for name, p in params.items() if p.dim() >= 2 or name == "norm.bias"]},
        {"params": [p for name, p in params.items() if p.dim() < 2 and name != "norm.bias"]},
    ])
    with pytest.raises(shardwire.CheckpointError, match="param group 0 holds other parameters than when saved: "
                                                        "'norm.bias' is in it only now"):
        shardwire.load_checkpoint(tmp_path / "groups", model, moved)


def test_another_model_or_a_checkpoint_where_a_file_belongs_is_named(tmp_path):
    model, optimizer = make_model(seed=0)
    shardwire.save_checkpoint(tmp_path / "four", model, optimizer)
    deeper, deeper_optimizer = make_model(seed=0, config=dataclasses.replace(PRESETS["tiny"], layers=5))
    with pytest.raises(shardwire.CheckpointError, match=r"the checkpoint has 4 flat buffers \(one per unit and dtype\) "
                                                        r"and this model 6 \(this model's 'blocks\.3' is not in the "
                                                        r"checkpoint\): a model of another size, or units chosen"):
        shardwire.load_checkpoint(tmp_path / "four", deeper, deeper_optimizer)
    with pytest.raises(shardwire.CheckpointError, match=r"four: is a directory, and import_state_dict reads one state "
                                                        r"dict file; load a shardwire checkpoint with load_checkpoint"):
        shardwire.import_state_dict(model, tmp_path / "four")
    with pytest.raises(shardwire.CheckpointError, match=r"holds the state of optimizer class AdamW, not SGD: resume "
                                                        r"with the optimizer it was saved with"):
        shardwire.load_checkpoint(tmp_path / "four", model, torch.optim.SGD(model.parameters(), lr=0.1))


def _saved_as_another_step(rank, world, directory):
    model, optimizer = make_model(seed=0)
    named = shardwire.checkpoint_path(directory, 3)
    refusals = []
    for step, keep in ((2, None), (None, 2)):
        try:
            shardwire.save_checkpoint(named, model, optimizer, step=step, keep=keep)
        except shardwire.CheckpointError as err:
            refusals.append(str(err))
    shardwire.save_checkpoint(named, model, optimizer, step=3, keep=2)
    return refusals, [path.name for path in list_checkpoints(directory)]


@pytest.mark.slow
def test_a_series_checkpoint_records_the_step_its_name_says(tmp_path):
    """What keep prunes is a checkpoint of the step its name says: a save naming another is refused
    before anything is written."""
    refusals, saved = run_workers(1, _saved_as_another_step, str(tmp_path))[0]
    named = tmp_path / "step_00000003"
    assert refusals == [f"saving checkpoint {named} failed on rank 0: {named} is named for step 3, but step={step!r} "
                        f"was given: give step=3" for step in (2, None)]
    assert saved == ["step_00000003"]

