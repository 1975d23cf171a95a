"""What ``keep`` prunes is provably what a save wrote, down to each file: a file written over since
(even at its recorded size) or a mount at a checkpoint's name (a bind mount of the user's directory)
keeps the checkpoint, with a warning, and nothing is written into a mount."""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import subprocess
import warnings

import pytest
import torch

import shardwire
from shardwire.engine.checkpoint import ownership
from shardwire.engine.checkpoint.series import list_checkpoints, prune


def _save_series(directory: pathlib.Path, steps, model) -> list[str]:
    """Save ``steps`` with keep=2; the warnings they gave."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for step in steps:
            shardwire.save_checkpoint(shardwire.checkpoint_path(directory, step), model, step=step, keep=2).wait()
    return [str(warning.message) for warning in warned]


@pytest.fixture
def model():
    return shardwire.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))


def test_a_file_written_over_at_its_own_size_keeps_its_checkpoint(tmp_path, model):
    _save_series(tmp_path, (1, 2), model)
    mine = tmp_path / "step_00000002" / "rank_00000.safetensors"
    mine.write_bytes(b"U" * mine.stat().st_size)  # the user's bytes, where the sizes alone would match
    warned = _save_series(tmp_path, (3, 4), model)
    assert mine.read_bytes() == b"U" * mine.stat().st_size
    assert any(f"kept {tmp_path}/step_00000002" in w and "rank_00000.safetensors was written since it was saved" in w
               for w in warned), warned
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003", "step_00000004"]


def test_a_checkpoint_untouched_since_it_was_saved_is_still_pruned(tmp_path, model):
    assert _save_series(tmp_path, (1, 2, 3), model) == []
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003"]


def test_a_series_copied_without_its_times_is_pruned_as_its_contents_are_the_saves(tmp_path, model):
    """``cp -r`` gives every file a new time: the checksums, read back then, prove them the saves'."""
    _save_series(tmp_path / "first", (1, 2), model)
    shutil.copytree(tmp_path / "first", tmp_path / "copy", copy_function=shutil.copyfile)  # times not kept
    assert _save_series(tmp_path / "copy", (3,), model) == []
    assert sorted(p.name for p in (tmp_path / "copy").glob("step_*")) == ["step_00000002", "step_00000003"]


@contextlib.contextmanager
def _bind_mounted(source: pathlib.Path, target: pathlib.Path):
    target.mkdir()
    if subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True).returncode != 0:
        pytest.skip("bind mounts need root (mount --bind)")
    try:
        yield
    finally:
        subprocess.run(["umount", str(target)], check=True)


def test_a_bind_mounted_checkpoint_is_never_marked_or_pruned(tmp_path, model):
    series = tmp_path / "series"
    _save_series(series, (1, 2), model)
    users = tmp_path / "best"
    shutil.copytree(series / "step_00000002", users)  # a copy, times and all, mounted where it was
    shutil.rmtree(series / "step_00000002")
    (users / ownership.MARKER).write_text('{"name": "step_00000002", "token": "0123456789ab"}')  # even marked
    before = sorted(p.name for p in users.iterdir())
    with _bind_mounted(users, series / "step_00000002"):
        warned = _save_series(series, (3, 4), model)
        assert (series / "step_00000002").is_dir()
    assert sorted(p.name for p in users.iterdir()) == before
    assert any("step_00000002 is a mount point" in w for w in warned), warned
    assert not any("tidying its directory failed" in w for w in warned), warned


def test_the_spared_checkpoints_are_kept_beside_the_newest(tmp_path, model):
    """A run whose loss climbs spares its checkpoints at the lowest loss from ``keep``."""
    for step in (1, 2, 3, 4, 5):
        shardwire.save_checkpoint(shardwire.checkpoint_path(tmp_path, step), model, step=step).wait()
    prune(shardwire.checkpoint_path(tmp_path, 5), 1,
          spare=[shardwire.checkpoint_path(tmp_path, 1), shardwire.checkpoint_path(tmp_path, 3)])
    assert [path.name for path in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000003", "step_00000005"]
