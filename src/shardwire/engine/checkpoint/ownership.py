"""What a save may delete: only directories it can prove that a save made.

A checkpoint directory is shared with whatever else lives there (a user's notes, another tool's
output, a directory that merely looks like a temporary), so deleting by name alone can lose data.
A save therefore marks what it makes: it writes ``made-by-shardwire.json``, naming the directory (the
checkpoint's name and the save's random token), into the temporary directory it creates, and into a
checkpoint before hiding it under a temporary name for deletion. Clean-up deletes a temporary
directory only if its marker names it; a complete checkpoint's proof is its valid manifest, listing
every file it holds at the size and modification time its writer saw. Anything else is left alone,
however it is named, and so is whatever another file system is mounted on (a bind mount of the
user's directory at a checkpoint's name): like a link, what it shows is not the directory's to give,
and nothing is written into it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
from typing import NamedTuple

from shardwire.engine.checkpoint.format import MANIFEST, CheckpointError, FileRecord, Manifest, new_token, temporary_name
from shardwire.files import empty_directory, kind_of

MARKER = "made-by-shardwire.json"
_MAX_MARKER_BYTES = 1 << 16  # a marker holds a name and a token: a larger file is none


def create_marked(directory: pathlib.Path, name: str, token: str) -> None:
    """Create ``directory``, the temporary directory of a save of ``name`` with ``token``, and mark it.

    It must not exist yet: a directory that was there before is not this save's to mark.
    """
    directory.parent.mkdir(parents=True, exist_ok=True)
    directory.mkdir()
    _mark(directory, name, token)


def unmark(checkpoint: pathlib.Path) -> None:
    """Remove the marker from a checkpoint that is complete: its manifest is the proof from now on,
    and a checkpoint holds only its own files."""
    (checkpoint / MARKER).unlink(missing_ok=True)


def not_a_checkpoint(path: pathlib.Path, step: int | None = None) -> str | None:
    """Why ``path`` is not a complete checkpoint (a real directory with a valid manifest, holding only
    the files it lists, each of the size it records, and, where its name says its ``step``, a manifest
    of that step); None if it is. A file put in it since (an export, the user's notes), or a manifest
    copied in beside files of the user's, a file written over since it was saved (even at its
    size), or a mount in it, makes it other than a save's checkpoint, which no save may delete.
    (Sizes and modification times; checksums only of a file whose time has changed, as a copy's
    has: reading a whole checkpoint back before each prune would cost a save as much again. A
    manifest of before format 7 records no times: its sizes alone are checked.)"""
    if path.is_symlink():
        return f"{path} is a symbolic link"
    if (mount := _mount_in(path)) is not None:
        return f"{mount} is a mount point"
    try:
        manifest = Manifest.read(path)
    except CheckpointError as err:
        return str(err)
    if unsaved := _unlisted(path, manifest):
        shown = ", ".join(unsaved[:3]) + (f" and {len(unsaved) - 3} more" if len(unsaved) > 3 else "")
        return f"{path} also holds what no save wrote ({shown})"
    if step is not None and manifest.step != step:
        return f"{path} holds the manifest of step {manifest.step}, not of the step its name says"
    for record in manifest.files:
        try:
            size = (path / record.name).stat().st_size
        except OSError:
            return f"{path / record.name} is missing"
        if not (path / record.name).is_file():
            return f"{path / record.name} is {kind_of(path / record.name)}, where its manifest lists a file"
        if size != record.nbytes:
            return f"{path / record.name} holds {size:,} bytes where its manifest records {record.nbytes:,}"
        if record.mtime_ns is not None and not _as_saved(path / record.name, record):
            return f"{path / record.name} was written since it was saved"
    return None


def _as_saved(path: pathlib.Path, record: FileRecord) -> bool:
    """Whether the file at ``path`` holds what its save wrote: it has the modification time its
    writer saw (nothing wrote it since), or, where it has not (a copy of the checkpoint, a restore),
    the sha256 its manifest records, read back only then."""
    if path.stat().st_mtime_ns == record.mtime_ns:
        return True
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for piece in iter(lambda: f.read(1 << 20), b""):
                digest.update(piece)
    except OSError:
        return False
    return digest.hexdigest() == record.sha256


def _mount_in(path: pathlib.Path) -> str | None:
    """A mount point at ``path`` or inside it, or None. The kernel's table is read, since a bind mount
    of a directory of the same file system has the device of its parent (``os.path.ismount`` misses
    it); where there is no such table, ``ismount`` is what can be known."""
    where = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as table:
            points = [_unescaped(line.split()[4]) for line in table if len(line.split()) > 4]
    except OSError:
        return where if os.path.ismount(where) else None
    return next((point for point in points if point == where or point.startswith(where + os.sep)), None)


def _unescaped(point: str) -> str:
    """A mount point as /proc/self/mountinfo writes it, with a space, tab, newline or backslash as
    an octal escape (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), point)


def _unlisted(path: pathlib.Path, manifest: Manifest) -> list[str]:
    try:
        held = {entry.name for entry in path.iterdir()}
    except OSError:
        return []
    return sorted(held - {MANIFEST, MARKER, *(record.name for record in manifest.files)})


def not_made_by_a_save(path: pathlib.Path, step: int | None = None) -> str | None:
    """Why ``path`` (of ``step``, where its name is a series') cannot be proven a save's (to replace
    it); None for a complete checkpoint, or an incomplete one that still carries the marker naming it."""
    names = _marked_as(path)
    return None if names is not None and path.name == names.final else not_a_checkpoint(path, step)


def hide(path: pathlib.Path) -> pathlib.Path:
    """Mark a directory that a save made and move it to a temporary name, where ``sweep`` deletes it.

    Its name is free at once; the marker goes in first, so whenever a crash comes it is either still
    under its own name or provably the saves' under the temporary one.
    """
    token = new_token()
    _mark(path, path.name, token)
    hidden = path.with_name(temporary_name(path.name, token))
    path.rename(hidden)
    return hidden


def discard(path: pathlib.Path) -> None:
    """Delete a directory that a save made, hiding it first, so that a crash midway never leaves a
    half-deleted directory under its name."""
    _delete(hide(path))


def sweep(directory: pathlib.Path) -> None:
    """Delete the temporary directories in ``directory`` that saves made and left (a save that
    crashed, a checkpoint hidden for deletion); everything else stays, however it is named."""
    for path in directory.iterdir():
        names = _marked_as(path)
        if names is not None and path.name == names.temporary:
            _delete(path)


class _Names(NamedTuple):
    final: str  # the checkpoint's
    temporary: str  # while it was being written, or once hidden for deletion


def _mark(directory: pathlib.Path, name: str, token: str) -> None:
    (directory / MARKER).write_text(json.dumps({"name": name, "token": token}))


def _marked_as(path: pathlib.Path) -> _Names | None:
    """The names a save gave ``path``, from the marker in it; None for anything without one, and for a
    link or a mount (what it shows is not the directory's to give)."""
    if path.is_symlink():
        return None
    try:
        with (path / MARKER).open("rb") as f:
            marker = json.loads(f.read(_MAX_MARKER_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return None
    if not (isinstance(marker, dict) and isinstance(marker.get("name"), str) and isinstance(marker.get("token"), str)):
        return None
    if _mount_in(path) is not None:
        return None
    return _Names(marker["name"], temporary_name(marker["name"], marker["token"]))


def _delete(path: pathlib.Path) -> None:
    """Delete a marked directory, its marker last: a crash midway leaves it provably the saves', and
    the next sweep finishes the job."""
    empty_directory(path, keep=MARKER)
    (path / MARKER).unlink()
    path.rmdir()
