"""A series of checkpoints in one directory, one per saved step: their names, and keeping the newest.

``checkpoint_path(directory, step)`` names them ``step_00000400``; zero-padding makes the names sort
by step. A save gives such a name only to a complete checkpoint: one being written, or hidden before
deletion, has a temporary name beside it, which nothing here lists. Anything else named like a
checkpoint (a user's directory, a checkpoint whose manifest is missing or damaged) is listed, so a
loader says why it skips it, but ``prune`` neither counts nor deletes it.
"""

from __future__ import annotations

import numbers
import os
import pathlib
import warnings
from collections.abc import Collection

from shardwire.engine.checkpoint import ownership
from shardwire.engine.checkpoint.format import MANIFEST, CheckpointError, Manifest
from shardwire.files import CHECKPOINT_NAME, DCP_METADATA, holds_dcp


def reasons(skipped: list[tuple[pathlib.Path, Exception]]) -> str:
    """Why each checkpoint of a series ``skipped`` (newest first) could not be read, each reason said
    once: a series of another model's checkpoints, or damaged alike, fails alike at every one."""
    (newest, reason), *older = skipped
    if older and all(str(err).replace(str(path), str(newest)) == str(reason) for path, err in older):
        return f"all {len(skipped)} ({skipped[-1][0].name} to {newest.name}) fail as the newest does: {reason}"
    return "; ".join(f"{path.name}: {err}" for path, err in skipped)


def checkpoint_path(directory: str | pathlib.Path, step: int) -> pathlib.Path:
    """Where the series in ``directory`` keeps the checkpoint of ``step`` (a whole number from 0)."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:  # -1 would sort before 0
        raise ValueError(f"a checkpoint's step is a whole number from 0, got {step!r}")
    return pathlib.Path(directory) / f"step_{step:08d}"


def step_of(path: pathlib.Path) -> int | None:
    """The step of a series checkpoint path, or None for a name outside the series."""
    match = CHECKPOINT_NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def series_problem(directory: str | pathlib.Path) -> str | None:
    """Why ``directory`` cannot hold a series, or None: it is a checkpoint itself, one of
    torch.distributed.checkpoint (DCP writes ``.metadata`` beside its ``.distcp`` files) or one of
    shardwire's (a series' ``step_N``). A series would not see it and would start over inside it,
    its own checkpoints making the one there unprunable. Or it holds only what is named as a series'
    checkpoints and is none (``_others_problem``). Said after the directory's name."""
    directory = pathlib.Path(directory)
    if os.path.isfile(directory / DCP_METADATA):  # False, not an error, where it cannot be looked at
        return (f"is a torch.distributed.checkpoint (DCP) checkpoint (it holds {DCP_METADATA}), not a series of "
                f"shardwire's: load it with dcp.load (docs/checkpoints.md), only from a source you trust, and give "
                f"shardwire's checkpoints a directory of their own")
    if holds_a_manifest(directory):
        if ".set-aside-" in directory.name:  # damaged, or passed over by a resume: no hint to train from it
            return (f"is a checkpoint itself, set aside by the save that replaced it (it was damaged, or its run "
                    f"could not resume from it), which no resume starts from: give the directory of a series "
                    f"({directory.resolve().parent} resumes from the newest good checkpoint there)")
        if step_of(directory) is None:  # no resume lists it: a run set it aside, or it was renamed
            why = set_aside_why(directory.name) or "named outside a series (step_00000400)"
            return (f"is a checkpoint itself, {why}, which no resume starts from: to "
                    f"train on from it, copy it into a directory of its own as "
                    f"{checkpoint_path('', Manifest.read(directory).step)} and give that directory")
        return (f"is a checkpoint itself, not a directory of them: give the directory that holds it "
                f"({directory.resolve().parent}) to resume from it, or a directory of its own")
    if (dcp := next((above for above in directory.resolve().parents if holds_dcp(above)), None)) is not None:
        return (f"is inside {dcp}, a torch.distributed.checkpoint (DCP) checkpoint, which a series would fill with "
                f"its own: give shardwire's checkpoints a directory of their own")
    return _others_problem(directory)


def set_aside_in(directory: str | pathlib.Path) -> list[str]:
    """The names of the checkpoints set aside from the series in ``directory`` (``set_aside_why``),
    sorted; none where it cannot be listed."""
    try:
        return sorted(path.name for path in pathlib.Path(directory).iterdir()
                      if set_aside_why(path.name) is not None and CHECKPOINT_NAME.match(path.name))
    except OSError:
        return []


def set_aside_why(name: str) -> str | None:
    """Why a checkpoint named ``name`` was set aside from its series, in words, or None where it was not."""
    if ".diverged" in name:  # ``step_N.diverged``, ``-2`` after it where taken
        return "set aside by its run as diverged"
    if ".set-aside-" in name:
        return "set aside by the save that replaced it"
    return None


def _others_problem(directory: pathlib.Path) -> str | None:
    """Why ``directory`` holds what is no series: directories named as its checkpoints are, none of
    which holds a manifest, which a save writes into every checkpoint before it names it so (a
    user's own ``step_1``). A resume would try each as a damaged checkpoint and start over beside
    them; said before anything is written there, nothing of theirs is touched."""
    try:
        found = list_checkpoints(directory)
    except OSError:  # a directory this process may not list: what it holds is said where it is read
        return None
    if not found or any(os.path.lexists(path / MANIFEST) for path in found):
        return None
    names = ", ".join(path.name for path in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    return (f"holds {names}, named as checkpoints are, but without the {MANIFEST} every checkpoint holds (yours?): "
            f"give shardwire's checkpoints a directory of their own")


def list_checkpoints(directory: str | pathlib.Path) -> list[pathlib.Path]:
    """The series' checkpoints in ``directory``, oldest first (none if it does not exist)."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return []
    # named first: a directory of other entries (/proc) may refuse a look at what they are
    found = [path for path in directory.iterdir() if step_of(path) is not None and path.is_dir()]
    return sorted(found, key=step_of)


def group_series(directory: str | pathlib.Path) -> list[str]:
    """The subdirectories of ``directory`` that hold a series: fault-tolerant groups keep theirs side
    by side, each named for its group (``--checkpoint-dir ckpt`` saves ``ckpt/a/step_...``)."""
    directory = pathlib.Path(directory)
    try:
        inside = sorted(path for path in directory.iterdir() if path.is_dir() and step_of(path) is None)
    except OSError:  # none, or none this process may list
        return []
    return [path.name for path in inside if list_checkpoints(path)]


def holds_a_manifest(path: pathlib.Path) -> bool:
    """Whether ``path`` holds a valid checkpoint manifest (a user's own manifest.json is none)."""
    try:
        Manifest.read(path)
    except (CheckpointError, OSError):  # none, or none this process may read
        return False
    return True


def prune(newest: pathlib.Path, keep: int, spare: Collection[pathlib.Path] = ()) -> None:
    """Delete the oldest complete checkpoints before ``newest`` so that ``keep`` remain with it, and
    ``spare`` beside them (a training run's checkpoints at its lowest loss, while its loss is above it).

    Only what is provably a checkpoint, a real directory whose manifest is valid, of its step, and
    lists all it holds at their sizes, counts and is deleted; anything else named like one is left
    alone, with a warning where it holds a checkpoint's manifest (an export put inside a checkpoint,
    a manifest copied beside files of the user's). Checkpoints of later steps (left by a run
    that resumed from an earlier one) are not counted or touched. Each is hidden under a temporary
    name before deletion, so a crash while deleting never leaves a half-deleted checkpoint under a
    checkpoint's name.
    """
    older = []
    for path in list_checkpoints(newest.parent):
        if step_of(path) >= step_of(newest):
            continue
        if path in spare:
            continue
        if (reason := ownership.not_a_checkpoint(path, step_of(path))) is None:
            older.append(path)
        elif holds_a_manifest(path):  # a checkpoint's manifest beside what may be the user's
            # said from here, not from the caller: once a run, whichever of its saves prunes
            warnings.warn(f"kept {path}, never deleting what it holds: {reason}; move what is yours out and "
                          f"delete it yourself")
    for path in older[: max(0, len(older) - (keep - 1))]:
        ownership.discard(path)
