"""One run owns a checkpoint directory at a time.

Saves write temporary directories beside their target and tidy the directory afterwards (keep's
pruning, the leftovers of crashed saves), so two runs given the same directory would delete each
other's saves in progress. The first save or resume of a run therefore claims the directory: rank 0
(the rank that creates, renames and deletes there) takes an exclusive POSIX lock on
``.shardwire-claim`` in it and keeps it for the life of its process, and a second run is refused,
naming the first. The operating system drops the lock when the process ends however it ends, so the
claim of a dead run is taken over by the next one with no cleaning up; POSIX locks are the process's
(a process may claim again what it holds, as a second model in one program does) and are honoured
across the machines of an NFS mount, where BSD ``flock`` may not be. The descriptor stays open for
the process's life: closing any descriptor of the file would drop its lock. A directory the run
never saved in is left as it was found, and one it saved in without what a save stopped part-way
left (``leave_tidy``): as the process ends, a claim file alone in it goes, with the directories the
claim made; and a launcher does the same for workers that a signal ended.
"""

from __future__ import annotations

import atexit
import os
import pathlib
import warnings

from shardwire.engine.checkpoint import ownership
from shardwire.engine.checkpoint.format import CheckpointError, DirectoryMoved
from shardwire.engine.checkpoint.series import list_checkpoints
from shardwire.files import ClaimHeld, claim_file, make_directories, remove_directories

CLAIM = ".shardwire-claim"


def claim(directory: pathlib.Path, claimed: dict[str, tuple[int, int]], saving: str | None = None) -> None:
    """Make this process the owner of ``directory``, or raise a ``CheckpointError`` naming the run that
    owns it. ``claimed`` holds the directories this model's engine has claimed already (no new
    descriptor for each save), each with its claim file's identity (device, inode): one whose claim
    file is no longer that one was moved or removed under the run (a copy of another series brings
    a copy of its claim file), and is claimed again with a warning where it holds no checkpoint, or
    refused (``DirectoryMoved``) where it holds some, which the run's pruning would delete. It is
    known by its name as given, not by where that name leads: a name turned into a link to another
    series leads to another claim file, so it is refused as replaced, not claimed afresh there.
    ``saving``: the checkpoint about to be saved there, which the warning names (a directory moved
    twice is said to be twice, not once, as a repeated warning would be)."""
    key = os.path.abspath(directory)
    if key in claimed:
        if _identity(directory / CLAIM) == claimed[key]:
            return
        _check_replaced(directory)
        saved = f"saves {saving} there and what follows" if saving else "saves there from now on"
        warnings.warn(f"{directory} was moved or removed while this run saved in it: the run claims it again and "
                      f"{saved}; what it had saved is where the directory went", stacklevel=3)
        del claimed[key]
    made = make_directories(directory)
    try:
        fd = claim_file(directory / CLAIM)  # held, open, for the life of the process
    except ClaimHeld as err:
        raise CheckpointError(f"{directory} belongs to another run that is still going ({err.owner}): give this run a "
                              f"--checkpoint-dir of its own, or stop that one") from None
    except OSError as err:
        remove_directories(made)
        raise CheckpointError(f"cannot claim {directory} for this run: {err.strerror}") from None
    stat = os.fstat(fd)
    claimed[key] = (stat.st_dev, stat.st_ino)
    atexit.register(leave_tidy, directory, made)


def _identity(path: pathlib.Path) -> tuple[int, int] | None:
    """A file's (device, inode), or None where there is none."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _check_replaced(directory: pathlib.Path) -> None:
    """Refuse to claim again a directory this run saved in that is now something else: not a
    directory, or one holding checkpoints the run did not save (another series put at its name)."""
    lost = (f"{directory} was moved or removed while this run saved in it, and the checkpoints it saved are where "
            f"it went")
    if os.path.lexists(directory) and not directory.is_dir():
        raise DirectoryMoved(f"{lost}; something else now has its name, which is left as it is: move the directory "
                             f"back, or resume from it with --checkpoint-dir where it is now")
    if found := list_checkpoints(directory):
        raise DirectoryMoved(f"{lost}; it now holds checkpoints this run did not save ({found[-1].name}, ...), which "
                             f"its pruning would delete, and which are left as they are: move the directory back, or "
                             f"resume from it with --checkpoint-dir where it is now")


def leave_tidy(directory: str | os.PathLike, made: list[str]) -> None:
    """Remove from ``directory`` what saves left there part-way (a run stopped or failed as it saved:
    its temporary directory, no loader's, otherwise lies there until the next run's first save), and
    where its run saved nothing, so that only the claim file is left, that and the directories in
    ``made``, those made for it. The claim is taken first, so another live run's is left alone; one
    holding anything else (the user's own file) keeps its claim file."""
    claim_path = os.path.join(directory, CLAIM)
    try:
        if CLAIM not in os.listdir(directory):
            return
        fd = claim_file(claim_path)  # this process's own claim is taken again; another live one is not
    except OSError:  # held by another run, gone, or unreadable: nothing of this run's to tidy
        return
    try:
        ownership.sweep(pathlib.Path(directory))  # what a save stopped part-way left, now that none writes
        if os.listdir(directory) == [CLAIM]:
            os.unlink(claim_path)
            remove_directories(made)
    except OSError:
        pass
    finally:
        os.close(fd)
