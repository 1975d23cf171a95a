"""Writing files so that a reader never finds one half-written, and nothing but a file is written over.

Every file shardwire writes (profiles, traces, reports, plots, benchmark results, token caches,
exported state dicts, the testbed's state and hosts files) goes through ``write_atomically``, under
one policy:

* **Regular files only.** A path naming a device, a FIFO, a socket or a directory is refused, not
  replaced: renaming a new file over ``/dev/null`` would replace the device node itself. A symbolic
  link is followed, so the file it points to is written and the link stays.
* **Whole or untouched.** The data goes to a temporary file beside the target, which then replaces
  the target in one rename. A crash, a full disk or an error while rendering leaves the target as it
  was and no temporary file behind. (Checkpoints are written a directory at a time, with the same
  idea: ``shardwire.engine.checkpoint.save``.)
* **The mode a plain write would give.** A new file gets the umask's mode (the kernel applies it to
  the temporary file), one written over keeps its own; missing parent directories are created.

``output_problem`` and ``directory_problem`` say what stops a path being written, so that the
command line (``shardwire.options``) refuses it before any work, with the same words.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import stat

# What a path that is not a regular file is, for messages.
_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}
# The target's name kept in a temporary file's, short enough that the whole stays within NAME_MAX.
_TEMPORARY_STEM = 100


class OutputRefused(OSError):
    """A path that cannot be written as a regular file; the message names it and what to give instead."""


def output_problem(path: str | os.PathLike) -> str | None:
    """What stops ``path`` being written as a regular file, or None: it names something that is not
    a regular file, or its directory cannot be created or written in. The words follow the path
    in a message (``--json out.json is a FIFO, not a regular file; give a file name``)."""
    if (kind := _kind(path)) is not None:
        return _not_a_file(kind)
    directory = os.path.dirname(os.path.realpath(path))
    problem = directory_problem(directory)
    return None if problem is None else f"cannot be written: its directory {directory} {problem}"


def directory_problem(path: str | os.PathLike) -> str | None:
    """What stops ``path`` being a directory to write in, or None: it is something else, or it is
    missing and cannot be created, or it is not writable. The words follow the path in a message."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        if not os.path.isdir(path):
            return f"is {_kind(path) or 'a file'}; give it a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return "is not writable; give a directory you can write in"
        return None
    existing = os.path.dirname(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"cannot be created: {existing} is {_kind(existing) or 'a file'}"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot be created: {existing} is not writable"
    return None


def _kind(path: str | os.PathLike) -> str | None:
    """What ``path`` is when it is not a regular file (following links, /dev/stdout's to a pipe too);
    None for a regular file or nothing at all."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return None if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _not_a_file(kind: str) -> str:
    return f"is {kind}{'' if kind == 'a directory' else ', not a regular file'}; give a file name"


def write_atomically(path: str | os.PathLike, data: str | bytes, *, durable: bool = False) -> None:
    """Make ``path`` hold exactly ``data``, or leave it as it was; raises ``OutputRefused`` for a path
    that is not a regular file. With ``durable`` the data and the rename are on disk, not only in the
    page cache, before it returns (for results that must survive a power loss)."""
    if (kind := _kind(path)) is not None:
        raise OutputRefused(f"{os.fspath(path)} {_not_a_file(kind)}")
    target = os.path.realpath(path)
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = _temporary(target)
    try:
        with contextlib.suppress(FileNotFoundError):  # written over: keep the file's own mode
            os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        _sync_directory(directory)


def _temporary(target: str) -> tuple[int, str]:
    """A new file beside ``target``, open for writing, created with mode 0666 so that the kernel
    applies the umask (``tempfile.mkstemp`` makes every file 0600, whatever the umask)."""
    stem = f"{os.path.dirname(target)}/.{os.path.basename(target)[:_TEMPORARY_STEM]}."
    while True:
        tmp = f"{stem}{secrets.token_hex(8)}.partial"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:  # another writer's name: draw again
            continue


def _sync_directory(directory: str) -> None:
    """Put a rename in ``directory`` on disk (a file's own fsync does not cover its directory entry)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def figure_png(figure) -> bytes:
    """A finished matplotlib figure as PNG bytes (to write with ``write_atomically``), and the
    figure closed: a report of many runs would otherwise pile figures up."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    try:
        figure.savefig(buffer, format="png", dpi=120)
    finally:
        plt.close(figure)
    return buffer.getvalue()
