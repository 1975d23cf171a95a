"""``shardwire report`` keeps the promise of every command: a profile that lacks a rank's entries is
damaged, and refused in one line naming what it lacks, never drawn as if the world were smaller; and
a report that cannot be written (a full disk) leaves no directory it made behind it, nor removes one
that was there before."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from harness import PROFILE, FillingFile, full_disk  # noqa: F401 (a fixture)
from shardwire.cli import main
from shardwire.files import WriteFailed, write_atomically

pytestmark = pytest.mark.timeout(60)
FULL = "could not be written: No space left on device; free space there, or choose another place for it"


def refusal(argv: list[str], capsys) -> str:
    """The one line ``shardwire`` ends ``argv`` with, refusing it."""
    status = main(argv)
    message = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in message and "Traceback" not in message, message
    return message


def _world_of_four(document: dict) -> dict:
    """The one-rank profile as the profiler writes a world of four: every rank's timeline of the
    typical step, and every rank's figures of each step (here all alike)."""
    document["world_size"] = 4
    document["timeline"]["ranks"] *= 4
    for step in document["steps"]:
        step["ranks"] *= 4
    return document


@pytest.fixture
def four_ranks(tmp_path):
    """A run directory and its profile of four ranks, to change and write back."""
    with open(PROFILE) as f:
        return tmp_path / "run", _world_of_four(json.load(f))


def test_a_whole_profile_of_four_ranks_is_drawn(four_ranks, capsys):
    run, document = four_ranks
    run.mkdir()
    (run / "profile.json").write_text(json.dumps(document))
    assert main(["report", str(run)]) == 0, capsys.readouterr().err
    assert sorted(os.listdir(run)) == ["breakdown.png", "overlap.png", "profile.json", "timeline.png"]


@pytest.mark.parametrize("lose, said", [
    (lambda d: d["timeline"]["ranks"].pop(), "its timeline holds 3 ranks' steps for a world_size of 4"),
    (lambda d: d["steps"][3]["ranks"].pop(), "its step 3 holds 3 ranks' figures for a world_size of 4"),
    (lambda d: d["steps"][9]["ranks"].append(d["steps"][9]["ranks"][0]),
     "its step 9 holds 5 ranks' figures for a world_size of 4"),
    (lambda d: d["steps"][0].pop("ranks"), "steps.0 has no ranks, unlike a profile of `shardwire train --profile`"),
])
def test_a_profile_lacking_a_ranks_entries_is_damaged_and_not_drawn(four_ranks, capsys, lose, said):
    """The profiler gathers every rank's timeline and each step's figures of every rank: a rank short
    (or over) is a damaged file, whose plots would leave that rank out of the spread over ranks."""
    run, document = four_ranks
    run.mkdir()
    lose(document)
    (run / "profile.json").write_text(json.dumps(document))
    assert refusal(["report", str(run), "--out", str(run / "plots")], capsys) == (
        f"error: {run / 'profile.json'} is damaged ({said}); profile the run again")
    assert os.listdir(run) == ["profile.json"]


def test_a_report_that_cannot_be_written_leaves_no_directory_it_made(tmp_path, full_disk, capsys):
    """``--out`` new directories deep, or a new one in a directory that was there: each made for the
    plots is removed with them, and what was there before is kept."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copyfile(PROFILE, run / "profile.json")
    (tmp_path / "kept").mkdir()
    for out in (tmp_path / "new" / "sub" / "r.png", tmp_path / "kept" / "sub"):
        said = refusal(["report", str(run), "--out", str(out)], capsys)
        assert said.startswith(f"error: {out}/") and said.endswith(f".png {FULL}"), said
    assert sorted(os.listdir(tmp_path)) == ["kept", "run"] and os.listdir(tmp_path / "kept") == []
    assert os.listdir(run) == ["profile.json"]


def test_a_directory_made_for_a_write_that_another_writer_filled_meanwhile_is_kept(tmp_path, monkeypatch):
    """Only an empty directory is removed: what another process wrote into one made for a failed write,
    while it was written, stays, with the directories above it."""
    fdopen = os.fdopen

    def theirs_then_full(fd, *args, **kwargs):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".partial"):
            (tmp_path / "new" / "sub" / "theirs.txt").write_text("another writer's")
            return FillingFile(fd, "wb")
        return fdopen(fd, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", theirs_then_full)
    with pytest.raises(WriteFailed):
        write_atomically(tmp_path / "new" / "sub" / "plot.png", b"data")
    assert os.listdir(tmp_path / "new" / "sub") == ["theirs.txt"]


def test_a_checkpoint_given_for_a_run_directory_is_named_not_told_to_profile_into(tmp_path, capsys):
    """The refusal suggested `shardwire train --profile --run-dir CHECKPOINT`, which train refuses."""
    import torch

    import shardwire
    model = shardwire.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    checkpoint = shardwire.checkpoint_path(tmp_path / "ckpt", 2)
    shardwire.save_checkpoint(checkpoint, model, step=2).wait()
    assert main(["report", str(checkpoint)]) == 2
    assert capsys.readouterr().err == (f"error: {checkpoint} has no profile data (profile.json is missing), and no "
                                       f"run writes one there: it is a checkpoint, which holds only what its save "
                                       f"wrote (anything else there keeps it from ever being pruned): give another "
                                       f"path\n")
