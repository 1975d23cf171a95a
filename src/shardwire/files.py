"""Writing files so that a reader never finds one half-written, and nothing but a file is written over.

Every file shardwire writes (profiles, traces, reports, plots, benchmark results, token caches,
exported state dicts, the testbed's state and hosts files) goes through ``write_atomically``, under
one policy:

* **Regular files only.** A path naming a device, a FIFO, a socket or a directory is refused, not
  replaced: renaming a new file over ``/dev/null`` would replace the device node itself. A symbolic
  link is followed, so the file it points to is written and the link stays.
* **Whole or untouched.** The data goes to a temporary file beside the target, which then replaces
  the target in one rename. A crash, a full disk or an error while rendering leaves the target as it
  was and no temporary file behind; a write the system stops (a full disk, a quota) is a
  ``WriteFailed``, which says in one line which file, why and what to do. (Checkpoints are written a
  directory at a time, with the same idea: ``shardwire.engine.checkpoint.save``.)
* **The mode a plain write would give.** A new file gets the umask's mode (the kernel applies it to
  the temporary file), one written over keeps its own; missing parent directories are created, and
  removed again where the write fails (only those it made, and only while empty).
* **Nothing left behind.** A temporary's name carries its writer's host and process, so that the
  next write of the same target removes the ones whose writer was killed.

A directory that appears whole (an exported model) is written the same way by ``StagedDirectory``,
which also claims it: from the moment it is staged until it is renamed into place, a second writer
of the same target is refused, naming the first.

``output_problem`` and ``directory_problem`` say what stops a path being written, so that the
command line (``shardwire.options``) refuses it before any work, with the same words;
``inside_problem`` what stops it where it lies inside an input being read (an export's checkpoint),
and ``checkpoint_problem`` where it lies in any checkpoint, which must hold only what its save wrote.
``rewrite_problem`` adds the rule for a result a command makes again (a plot, a bench file, a
profile, the scalar log it appends to): it replaces or extends only an earlier result of its own
kind (``OUTPUTS``, told by the file's first bytes), never the user's other files, be they weights,
data or a checkpoint's manifest.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import hashlib
import io
import json
import os
import pathlib
import re
import secrets
import shutil
import socket
import stat
import sys
import tempfile

# What a path that is not a regular file is, for messages.
_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}
# What a dangling link is called where a path must be read or written.
LEADS_NOWHERE = "is a symbolic link that leads nowhere (a loop, or its target is gone)"
# The bytes of the target's name kept in a temporary's, short enough that the whole stays within NAME_MAX.
_TEMPORARY_STEM = 100
# In a staged directory: the file its writer holds locked, naming itself, until the rename.
_CLAIM = ".shardwire-claim"
# How much of an existing output is read to tell whether a command wrote it.
_HEAD_BYTES = 64 << 10
# A checkpoint is a directory holding this manifest, of this format (``shardwire.engine.checkpoint.format``
# reads and writes it); nothing a command writes at the user's word goes inside one (``checkpoint_problem``).
CHECKPOINT_MANIFEST, CHECKPOINT_FORMAT = "manifest.json", "shardwire-checkpoint"
# The name of a series' checkpoint of step N (``shardwire.engine.checkpoint.series``), which nothing a
# command writes at the user's word takes beside the series' checkpoints.
CHECKPOINT_NAME = re.compile(r"step_(\d+)")
# What torch.distributed.checkpoint's (DCP's) file system writer names its metadata, beside its
# ``.distcp`` files: a directory of them is a checkpoint too, of another tool, and nothing goes inside.
DCP_METADATA = ".metadata"


def _first_line_is_scalars(head: bytes) -> bool:
    try:
        line = json.loads(head.split(b"\n", 1)[0])
    except ValueError:
        return False
    return isinstance(line, dict) and {"step", "loss", "lr", "tokens_per_s", "step_time_s"} <= line.keys()


# What each command's plots name as their software (a PNG text chunk), by their kind of result: the
# mark that tells them from any other plot (every Matplotlib figure names Matplotlib), another
# command's among them, so that a rerun replaces its own plots alone.
PLOTS = {"report-plot": "shardwire report", "sweep-plot": "shardwire simulate --sweep",
         "bench-plot": "shardwire bench"}
# The key a trace shardwire writes opens with, naming its writer: a trace of another tool has none.
TRACE_WRITER = {"otherData": {"writer": "shardwire"}}

# The results commands make again, by what they are called in messages and how their first bytes look.
def _plot_of(software: str):
    """Whether a file's first bytes are a PNG whose software is ``software``: its text chunk whole,
    its length first."""
    text = b"Software\x00" + software.encode()
    chunk = len(text).to_bytes(4, "big") + b"tEXt" + text
    return lambda head: head.startswith(b"\x89PNG\r\n\x1a\n") and chunk in head


OUTPUTS = {
    **{kind: (f"a plot of `{software}`", _plot_of(software)) for kind, software in PLOTS.items()},
    "bench-json": ("a `shardwire bench --json` file",
                   lambda head: head.lstrip().startswith(b'{\n  "schema": "shardwire.bench/')),
    "bench-csv": ("a `shardwire bench --csv` file", lambda head: head.startswith(b"group,ranks,op,")),
    "profile": ("a profile shardwire wrote",
                lambda head: head.startswith(b'{"version": ') and b'"world_size"' in head),
    "trace": ("a trace shardwire wrote", lambda head: head.startswith(json.dumps(TRACE_WRITER)[:-1].encode())),
    "scalars": ("a `--log-jsonl` log", _first_line_is_scalars),
}


class OutputRefused(OSError):
    """A path that cannot be written as a regular file; the message names it and what to give instead."""


class WriteFailed(OutputRefused):
    """A write the system stopped part-way (a full disk, a quota, a read-only mount, an I/O error),
    raised by ``write_atomically`` with the system's ``errno`` and ``strerror`` and the path as it was
    given. An ``OutputRefused``, so that each command says it as it says any output it cannot write:
    one line naming the file, why and what to do, where Python's own words would name no remedy (and
    escape as a traceback). The file is as it was before the write."""

    def __str__(self) -> str:
        room = "free space there, or " if self.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        return f"{self.filename} could not be written: {self.strerror}; {room}choose another place for it"


def output_problem(path: str | os.PathLike) -> str | None:
    """What stops ``path`` being written as a regular file, or None: it names something that is not
    a regular file, or its directory cannot be created or written in, or it lies in a checkpoint
    (``checkpoint_problem``). The words follow the path in a message (``--json out.json is a FIFO,
    not a regular file; give a file name``)."""
    if (problem := _length_problem(path)) is not None:
        return problem
    if (link := _dead_link_above(path)) is not None:
        return f"cannot be written: {link} {LEADS_NOWHERE}"
    if (kind := _kind(path)) is not None:
        return _not_a_file(kind)
    directory = os.path.dirname(os.path.realpath(path))
    if _leads_nowhere(path) and not (os.path.isdir(directory) and _resolves(path)):
        return f"{LEADS_NOWHERE}: give a file name"  # opening it would not make its target
    if (problem := checkpoint_problem(path)) is not None:  # before directory_problem writes a probe there
        return problem
    if (problem := directory_problem(directory)) is not None:
        return f"cannot be written: its directory {directory} {problem}"
    return None


def rewrite_problem(path: str | os.PathLike, kind: str, instead: str = "give another file name") -> str | None:
    """What stops ``path`` being written as a result of ``kind`` (a key of ``OUTPUTS``) that a command
    makes again, or None: ``output_problem``, or a file there, not empty, that is not such a result,
    which the user is asked to write ``instead`` of (a file named by a directory: another directory)."""
    if (problem := output_problem(path)) is not None:
        return problem
    try:
        with open(path, "rb") as existing:
            head = existing.read(_HEAD_BYTES)
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"cannot be read to see what it holds ({err.strerror or err})"
    what, ours = OUTPUTS[kind]
    if head and not ours(head):
        return f"exists and is not {what}, so it is left as it is: {instead}"
    return None


def results_in(directory: str | os.PathLike, kind: str) -> list[str]:
    """The names of the files in ``directory`` that are results of ``kind`` (a key of ``OUTPUTS``),
    sorted; none where it cannot be listed."""
    _, ours = OUTPUTS[kind]
    found = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in names:
        path = os.path.join(directory, name)
        try:
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as existing:
                    if ours(existing.read(_HEAD_BYTES)):
                        found.append(name)
        except OSError:  # one this process may not read is not said to be one
            continue
    return found


def new_output_problem(path: str | os.PathLike) -> str | None:
    """What stops ``path`` being a new file to write, or None: it exists (an output that must never
    replace the user's file, as an export's), or ``output_problem``."""
    if os.path.islink(path):  # one to nothing too: the file it names would be written, wherever that is
        return "is a symbolic link: give a new file name (nothing is written through a link)"
    if os.path.lexists(path):
        return "exists: give a new file name (nothing is overwritten)"
    return output_problem(path)


def inside_problem(path: str | os.PathLike, source: str | os.PathLike, doing: str = "read", *,
                   what: str | None = None) -> str | None:
    """What stops ``path`` being written while ``source`` (a file or a directory) is ``doing``, or
    None: writing inside it (or over it) would change what is being read. ``what`` says instead what
    ``source`` is that nothing may be written in it. The words follow the path."""
    written, read = os.path.realpath(path), os.path.realpath(source)
    if written == read:
        return f"is {what or f'what is being {doing}'}: give another path"
    if os.path.commonpath([written, read]) == read:
        return f"is inside {os.fspath(source)}, {what or f'which is being {doing}'}: give a path outside it"
    return None


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """What stops ``path`` being written where it lies in a shardwire checkpoint (the checkpoint
    itself, or anywhere below it), or in a DCP one (whose loader would meet what is not its save's),
    or None: a file a save did not write makes the checkpoint one that no prune may delete
    (``shardwire.engine.checkpoint.ownership``), kept for ever with a warning. So does a name the
    series beside it takes for its own: a checkpoint's (``step_N``), which the series would list as
    a damaged checkpoint and its save of that step set aside, or a manifest's, which makes the
    series' directory a checkpoint to ``export`` and ``train``. The words follow the path."""
    here = os.path.realpath(path)
    while not _is_checkpoint(here):
        if holds_dcp(here):
            return inside_problem(path, here, what="a torch.distributed.checkpoint (DCP) checkpoint, which holds only "
                                                   "what its save wrote")
        parent, name = os.path.split(here)
        if parent == here:
            return None
        if (CHECKPOINT_NAME.fullmatch(name) or (name == CHECKPOINT_MANIFEST and here == os.path.realpath(path))) \
                and _holds_checkpoints(parent):
            if name == CHECKPOINT_MANIFEST:
                return (f"is named as a checkpoint's manifest, in {parent}, a series of checkpoints, which would then "
                        f"be taken for a checkpoint itself: give it another name")
            return (f"is {'' if here == os.path.realpath(path) else f'inside {here}, '}named as a checkpoint of the "
                    f"series in {parent}, which would take it for one of its own: give it another name")
        here = parent
    return inside_problem(path, here, what="a checkpoint, which holds only what its save wrote (anything else "
                                           "there keeps it from ever being pruned)")


def series_problem(path: str | os.PathLike, *series: str | os.PathLike) -> str | None:
    """What stops ``path`` being written in a series of checkpoints (the directory it is written in,
    or one of ``series``, where that holds checkpoints), or None: the runs saving into a series name
    and prune what it holds, and ``export`` and ``train`` list it; an output of another command there
    would be taken for, or lost among, its checkpoints. The words follow the path."""
    for directory in dict.fromkeys([os.path.dirname(os.path.abspath(path)), *map(os.fspath, series)]):
        if _holds_checkpoints(directory):
            problem = inside_problem(path, directory, what="a series of checkpoints, which the runs saving into it "
                                                           "name and prune")
            if problem is not None:
                return problem
    return None


def holds_dcp(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a DCP checkpoint: its ``.distcp`` files, with or without the
    metadata DCP writes last (a save still running, or one that died before it finished)."""
    try:
        return any(name.endswith(".distcp") for name in os.listdir(directory))
    except OSError:  # a directory this process may not list holds nothing it could write beside
        return False


def _holds_checkpoints(directory: str) -> bool:
    """Whether ``directory`` holds a series' checkpoint."""
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    return any(CHECKPOINT_NAME.fullmatch(name) and _is_checkpoint(os.path.join(directory, name)) for name in names)


def _is_checkpoint(directory: str) -> bool:
    """Whether ``directory`` holds a checkpoint's manifest, told by its first bytes as a save writes it."""
    manifest = os.path.join(directory, CHECKPOINT_MANIFEST)
    if not os.path.isfile(manifest):  # none, or none to read (a FIFO's reader would wait for a writer)
        return False
    try:
        with open(manifest, "rb") as f:
            head = f.read(256)
    except OSError:
        return False
    return head.startswith(b'{\n "format": "' + CHECKPOINT_FORMAT.encode() + b'"')


def directory_problem(path: str | os.PathLike) -> str | None:
    """What stops ``path`` being a directory to write in, or None: it is something else, or it is
    missing and cannot be created, or it is not writable. The words follow the path in a message."""
    path = os.path.abspath(path)
    if (problem := _length_problem(path)) is not None:
        return problem
    if _leads_nowhere(path):  # making it would make the link's target, or fail
        return f"{LEADS_NOWHERE}: give a directory"
    if (link := _dead_link_above(path)) is not None:
        return f"cannot be created: {link} {LEADS_NOWHERE}"
    if os.path.exists(path):
        if not os.path.isdir(path):
            return f"is {kind_of(path)}; give it a directory"
        if not _can_write_in(path):
            return "is not writable; give a directory you can write in"
        return None
    existing = os.path.dirname(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"cannot be created: {existing} is {kind_of(existing)}"
    if not _can_write_in(existing):
        return f"cannot be created: {existing} is not writable"
    return None


def _length_problem(path: str | os.PathLike) -> str | None:
    """What stops ``path`` being made for its length, or None: a part of it longer than a name may be
    where it would be made (NAME_MAX), or the whole longer than a path may be (PATH_MAX); each fails
    only once the path is made, after the work, and a check of what it is fails on it too."""
    whole = os.fsencode(os.path.abspath(path))
    existing = os.path.dirname(whole)
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    limits = []
    for name, usual in (("PC_NAME_MAX", 255), ("PC_PATH_MAX", 4096)):
        try:
            limit = os.pathconf(existing, name)
        except (OSError, ValueError):
            limit = -1
        limits.append(limit if limit > 0 else usual)  # -1: no limit stated; 0 would refuse every path
    longest = max(len(part) for part in whole.split(b"/"))
    if longest > limits[0]:
        return f"has a name of {longest:,} bytes, where a name here is at most {limits[0]:,}: give a shorter one"
    if len(whole) >= limits[1]:
        return f"is {len(whole):,} bytes long, where a path here is under {limits[1]:,}: give a shorter one"
    return None


def _leads_nowhere(path: str | os.PathLike) -> bool:
    return os.path.islink(path) and not os.path.exists(path)


def _dead_link_above(path: str | os.PathLike) -> str | None:
    """The first directory on the way to ``path`` that is a symbolic link leading nowhere (a loop, a
    target gone), or None: nothing can be made below it, and the system's words for it name no link."""
    above = pathlib.PurePath(os.path.abspath(path)).parents
    return next((os.fspath(link) for link in reversed(above) if _leads_nowhere(link)), None)


def _resolves(path: str | os.PathLike) -> bool:
    """Whether following ``path``'s links ends somewhere (that may not exist yet): not in a loop."""
    try:
        os.stat(path)
    except OSError as err:
        return err.errno != errno.ELOOP
    return True


def _can_write_in(directory: str) -> bool:
    """Whether entries can be made in ``directory``: tried, since its mode does not tell (root passes
    every access check, and /proc or a read-only mount refuses root all the same)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".shardwire-probe-", dir=directory))
    except OSError:
        return False
    return True


def _kind(path: str | os.PathLike) -> str | None:
    """What ``path`` is when it is not a regular file (following links, /dev/stdout's to a pipe too);
    None for a regular file or nothing at all."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return None if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def kind_of(path: str | os.PathLike) -> str:
    """What ``path``, which exists, is, in words for a message: ``a file`` for a regular one."""
    return _kind(path) or "a file"


def _not_a_file(kind: str) -> str:
    return f"is {kind}{'' if kind == 'a directory' else ', not a regular file'}; give a file name"


def write_atomically(path: str | os.PathLike, data: str | bytes, *, durable: bool = False, new: bool = False) -> None:
    """Make ``path`` hold exactly ``data``, or leave it as it was; raises ``OutputRefused`` for a path
    that is not a regular file, and ``WriteFailed`` where the system stops the write (a full disk).
    With ``durable`` the data and the rename are on disk, not only in the page cache, before it
    returns (for results that must survive a power loss). With ``new`` a file at ``path`` is never
    replaced, even one made while the data was written (another writer's, the user's): the data is
    linked into place, which fails where a file already is."""
    if (kind := _kind(path)) is not None:
        raise OutputRefused(f"{os.fspath(path)} {_not_a_file(kind)}")
    try:
        _write(path, data, durable, new)
    except OutputRefused:
        raise
    except OSError as err:  # the temporary is gone: what is left to say is which file, why, what to do
        raise WriteFailed(err.errno, err.strerror or str(err), os.fspath(path)) from None


def _write(path: str | os.PathLike, data: str | bytes, durable: bool, new: bool) -> None:
    """``write_atomically``'s work, once ``path`` is known to be a file or nothing: a write that fails
    takes away the directories it made for the file, as it takes away its temporary."""
    target = os.path.realpath(path)
    made = make_directories(os.path.dirname(target))
    try:
        _write_in_place(target, os.fspath(path), data, durable, new)
    except BaseException:
        remove_directories(made)
        raise


def _write_in_place(target: str, given: str, data: str | bytes, durable: bool, new: bool) -> None:
    """Write ``data`` to ``target`` (``given``, as the user named it) through a temporary beside it,
    in a directory that exists."""
    directory = os.path.dirname(target)
    fd, tmp = _temporary(target)
    try:
        with contextlib.suppress(FileNotFoundError):  # written over: keep the file's own mode
            os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if new:
            _link_new(tmp, target, given)
        else:
            os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        _sync_directory(directory)


def make_directories(directory: str | os.PathLike) -> list[str]:
    """Make ``directory`` and the directories missing above it, as ``os.makedirs`` does; returns those
    this call made, outermost first, for ``remove_directories`` to take away where what they were
    made for fails: a failed command leaves no directory behind it. One another writer makes
    meanwhile is not counted, and so never removed."""
    made = []
    try:
        for path in missing_directories(directory):
            try:
                os.mkdir(path)
            except FileExistsError:  # made meanwhile, or a file in the way (what comes next says so)
                continue
            made.append(path)
    except BaseException:
        remove_directories(made)
        raise
    return made


def missing_directories(directory: str | os.PathLike) -> list[str]:
    """``directory`` and those above it that do not exist, outermost first: what ``make_directories``
    would make, for one process to note before another makes them."""
    missing = []
    here = os.path.abspath(directory)
    while not os.path.isdir(here):
        missing.append(here)
        here = os.path.dirname(here)
    return missing[::-1]


def remove_directories(made: list[str]) -> None:
    """Remove the directories ``make_directories`` made, innermost first, each only while it is
    empty: one another writer has put something in since is kept, with those above it."""
    for path in reversed(made):
        try:
            os.rmdir(path)
        except OSError:
            return


def _link_new(tmp: str, target: str, given: str) -> None:
    """Put the written ``tmp`` at ``target`` only if nothing is there, then drop its temporary name."""
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise OutputRefused(f"{given} exists: it was made while this was written, and nothing was overwritten") from None
    os.unlink(tmp)


def _temporary(target: str) -> tuple[int, str]:
    """A new file beside ``target``, open for writing, created with mode 0666 so that the kernel
    applies the umask (``tempfile.mkstemp`` makes every file 0600, whatever the umask). Those a
    killed writer of ``target`` left on this host go first."""
    stem = f"{os.path.dirname(target)}/.{_stem(os.path.basename(target))}."
    _remove_abandoned(stem)
    while True:
        tmp = f"{stem}{_writer()}-{secrets.token_hex(8)}.partial"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:  # another writer's name: draw again
            continue


def _stem(name: str) -> str:
    """``name`` as a temporary's name carries it: a long one cut short, with a digest of the whole, so
    that two names alike in their first characters never share a temporary (nor a claim on one)."""
    encoded = os.fsencode(name)  # NAME_MAX counts bytes
    if len(encoded) <= _TEMPORARY_STEM:
        return name
    return f"{os.fsdecode(encoded[:_TEMPORARY_STEM])}-{hashlib.sha256(encoded).hexdigest()[:12]}"


def _writer() -> str:
    """This host (a digest: a name's length is bounded) and process, as a temporary's name carries them."""
    return f"{hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]}-{os.getpid()}"


def _remove_abandoned(stem: str) -> None:
    """Delete the temporary files named ``stem...`` whose writer, a process of this host, has ended.
    Only names of exactly this form are touched: a writer on another host sharing the directory, or
    a file of the user's, is left alone."""
    host = _writer().split("-")[0]
    pattern = re.compile(rf"{re.escape(os.path.basename(stem))}{host}-(\d+)-[0-9a-f]{{16}}\.partial")
    with contextlib.suppress(OSError):
        for entry in os.scandir(os.path.dirname(stem) or "."):
            match = pattern.fullmatch(entry.name)
            if match and entry.is_file(follow_symlinks=False) and not _alive(int(match.group(1))):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class StagedDirectory:
    """A new directory written whole or not at all, claimed from the start: its files go to
    ``path``, a hidden directory beside ``target`` (made with the umask's mode), which ``publish``
    renames into place. The stage has one name per target, holding a locked claim file: a second
    writer of the same target is refused while the first lives, and takes over, clearing it, what a
    killed one left. ``target`` must be absent or an empty directory (nothing of the user's is
    replaced), and not the current directory. The directories made above it are removed with the
    stage where it is discarded."""

    def __init__(self, target: str | os.PathLike, what: str):
        self.given = pathlib.Path(target)  # as the user named it, for messages
        self.target = pathlib.Path(os.path.abspath(target))
        self.what = what
        if (problem := new_directory_problem(target)) is not None:
            raise OutputRefused(f"{what} {os.fspath(target)} {problem}")
        self.path = stage_of(self.target)
        self._made = make_directories(self.path.parent)
        try:
            self._fd = self._claim(target, what)
        except BaseException:
            remove_directories(self._made)
            raise

    def _claim(self, target: str | os.PathLike, what: str) -> int:
        """Make the stage, or take over a killed writer's, and hold its claim; returns the claim's
        descriptor. A stage made here that cannot be claimed (a full disk) is removed again."""
        try:
            self.path.mkdir(0o777)
            made = True
        except FileExistsError:
            if self.path.is_symlink() or not (self.path / _CLAIM).is_file():
                raise OutputRefused(f"{self.path} is in the way of {what} {os.fspath(target)} and was not made by "
                                    f"shardwire: move it") from None
            made = False
        try:
            fd = claim_file(self.path / _CLAIM)
        except ClaimHeld as err:  # another writer's, even where made here: it claimed it first
            raise OutputRefused(f"{what} {os.fspath(target)} is being written by another run ({err.owner}): give "
                                f"this one another directory, or stop that one") from None
        except OSError as err:
            if made:
                shutil.rmtree(self.path, ignore_errors=True)
            raise OutputRefused(f"cannot claim {what} {os.fspath(target)}: {err.strerror}") from None
        empty_directory(self.path, keep=_CLAIM)  # what a killed writer left
        return fd

    def publish(self) -> pathlib.Path:
        """Rename the stage into place as ``target`` (an empty directory there is replaced, atomically);
        returns the target as it was given. Where something was put there since the stage was claimed
        (a run's export is written at its end, hours later), the stage is published beside it under a
        free name instead, and ``Diverted`` names both: what was written (a trained model) is never
        discarded for the user's file, nor the user's file replaced."""
        taken = new_directory_problem(self.target, series=False) is not None
        (self.path / _CLAIM).unlink()
        if not taken:
            self.path.rename(self.target)
            self._release()
            return self.given
        kept = _free_sibling(self.target)
        try:
            self.path.rename(kept)
        except OSError:
            kept = self.path  # left as it is, named: never discarded
        self._release()
        raise Diverted(f"{self.what} {self.given} was made, or filled, while it was being written: what was "
                       f"written is kept as {kept} instead; move it where it belongs")

    def discard(self) -> None:
        """Remove the stage and what was written to it, and the directories made for it, unless it was
        published."""
        if self._fd is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self._release()
            remove_directories(self._made)

    def _release(self) -> None:
        os.close(self._fd)
        self._fd = None


class Diverted(OutputRefused):
    """A directory written whole, published under another name than its target, taken meanwhile: the
    message names both, and what was written is complete there."""


def _free_sibling(target: pathlib.Path) -> pathlib.Path:
    """``target`` with the first number from 2 added that names nothing beside it (``out-2``)."""
    n = 2
    while os.path.lexists(candidate := target.with_name(f"{target.name}-{n}")):
        n += 1
    return candidate


def stage_of(target: str | os.PathLike) -> pathlib.Path:
    """Where a ``StagedDirectory`` of ``target`` is written before it is published."""
    target = pathlib.Path(os.path.abspath(target))
    return target.with_name(f".{_stem(target.name)}.shardwire-partial")


def leave_no_stage(target: str | os.PathLike, made: list[str]) -> None:
    """Remove the stage of ``target`` that a writer a signal ended left, and the directories in
    ``made`` (those made for it), where no live writer holds its claim: what its own ``discard``
    would have done, for a process that watched the writer end (a launcher)."""
    stage = stage_of(target)
    if stage.is_symlink() or not (stage / _CLAIM).is_file():
        return
    try:
        fd = claim_file(stage / _CLAIM)
    except OSError:  # another writer's, alive
        return
    try:
        shutil.rmtree(stage, ignore_errors=True)
        remove_directories(made)
    finally:
        os.close(fd)


def empty_directory(path: pathlib.Path, *, keep: str) -> None:
    """Delete everything in ``path`` but the entry named ``keep`` (a link is removed, not followed)."""
    for entry in path.iterdir():
        if entry.name == keep:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def new_directory_problem(path: str | os.PathLike, *, series: bool = True) -> str | None:
    """What stops ``path`` being a new directory to write (``StagedDirectory``), or None; with
    ``series`` false, a series of checkpoints made around it is not (``StagedDirectory.publish``
    puts in place a directory claimed before). The words follow the path in a message."""
    if os.path.islink(os.path.normpath(path)):  # the directory is put in place by a rename, which replaces a link
        return ("is a symbolic link, which the new directory would replace: give the directory it points to, or a "
                "new one")
    if os.path.exists(path) and not os.path.isdir(path):
        return "exists and is not a directory: give a new directory"
    if os.path.isdir(path):
        if os.path.samefile(path, os.getcwd()):
            return "is the current directory: give a new directory (it would be replaced under the shell in it)"
        if any(os.scandir(path)):
            return "is not empty: give a new directory (nothing is overwritten)"
        if os.path.ismount(path):  # the directory is put in place by a rename, which a mount point refuses
            return "is a mount point, which a directory cannot be renamed onto: give a new directory inside it"
    placed = checkpoint_problem(path) or (series_problem(path) if series else None)
    # one not made yet: can it be (never a probe written into a checkpoint)
    return placed or (None if os.path.isdir(path) else directory_problem(path))


class ClaimHeld(OSError):
    """A claim another live process holds; ``owner`` says which, as it wrote itself."""

    def __init__(self, owner: str):
        super().__init__(errno.EAGAIN, f"held by {owner}")
        self.owner = owner


def claim_file(path: str | os.PathLike) -> int:
    """Make this process the holder of the claim file ``path`` (created if missing), writing who it
    is into it; returns the descriptor, which holds the claim until it is closed or the process ends,
    however it ends. Raises ``ClaimHeld`` where another live process holds it.

    The lock is a POSIX one: honoured across the machines of an NFS mount, where BSD ``flock`` may
    not be, and the process's, so a process may claim again what it holds. Closing any descriptor
    of the file drops it: the holder keeps this one open."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        owner = _owner(fd)
        os.close(fd)
        if err.errno in (errno.EACCES, errno.EAGAIN):
            raise ClaimHeld(owner) from None
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                  "since": datetime.datetime.now().isoformat(timespec="seconds"),
                                  "command": " ".join(sys.argv)[:500]}).encode(), 0)
    except BaseException:  # a full disk: the claim is not held, by a descriptor left open or otherwise
        os.close(fd)
        raise
    return fd


def _owner(fd: int) -> str:
    """Who holds a claim, as it wrote itself in the file."""
    try:
        who = json.loads(os.pread(fd, 4096, 0))
        return f"process {who['pid']} on {who['host']} since {who['since']}: {who['command'][:200]}"
    except (OSError, ValueError, KeyError, TypeError):
        return "it did not say which"


def _sync_directory(directory: str) -> None:
    """Put a rename in ``directory`` on disk (a file's own fsync does not cover its directory entry)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def figure_png(figure, kind: str) -> bytes:
    """A finished matplotlib figure as PNG bytes (to write with ``write_atomically``), marked as a
    result of ``kind`` (a key of ``PLOTS``), and the figure closed: a report of many runs would
    otherwise pile figures up."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    try:
        figure.savefig(buffer, format="png", dpi=120, metadata={"Software": PLOTS[kind]})
    finally:
        plt.close(figure)
    return buffer.getvalue()
