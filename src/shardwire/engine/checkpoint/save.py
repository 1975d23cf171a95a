"""``save_checkpoint``: every rank writes its own shards, and a checkpoint appears only when complete.

A save runs in three phases, each ending with the ranks agreeing that it succeeded everywhere:

1. snapshot: copy this rank's shards and optimizer state (under hybrid sharding, the first
   group's ranks only: every group holds the same), and its RNG states, to host memory (rank 0 also
   the buffers), describe the model and the optimizer for the manifest,
   and agree on a temporary directory beside the target, ``<name>.tmp-<random>``, which rank 0
   creates with a marker naming it (``ownership``): the proof that the saves made it;
2. write: serialize this rank's file into that directory, flush and fsync it, note its size and
   sha256. With ``asynchronous=True`` this runs on a background thread while training goes on: the
   snapshot is the point in time saved;
3. commit (in ``wait()``, which the next save or load calls if the user did not): the ranks exchange
   their file records, which is when every file is known to be complete. Rank 0 then writes the
   manifest, fsyncs it and the directory, renames the directory to its final name, fsyncs the parent,
   and with ``keep`` deletes the oldest checkpoints of the series. Collectives run only here and in
   the snapshot, on the calling thread, never on the writer thread.

A crash at any moment before the rename leaves a marked temporary directory that no loader looks at
(the next successful save deletes it) and every earlier checkpoint as it was. Clean-up deletes only
what it can prove a save made (``ownership``): a user's directory is never deleted, whatever its name.

Replacing an existing checkpoint hides the old one under a marked temporary name first, so the target
name only ever holds a complete checkpoint; a crash between those two renames leaves no checkpoint
under that name, which is why training saves a series (``checkpoint_path(directory, step)``: a new
name each time) and never replaces one. In a series, a run that resumed past a newest checkpoint it
could not load saves that step again: what holds the name then is replaced if it is provably a
save's, and otherwise set aside under a name of its own, with a warning, never deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import threading
import warnings

import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn

from shardwire.engine.checkpoint import optim, ownership, schema, series
from shardwire.engine.checkpoint.session import session_of
from shardwire.engine.checkpoint.consensus import all_gather_json, on_every_rank
from shardwire.engine.checkpoint.format import (
    MANIFEST,
    OUTER_QUORUM,
    OUTER_SCHEDULE,
    REPLICATED,
    CheckpointError,
    FileRecord,
    FlatRecord,
    Manifest,
    buffer_key,
    buffer_records,
    measure_key,
    new_token,
    outer_key,
    param_key,
    rank_file,
    residual_key,
    rng_key,
    temporary_name,
)
from shardwire.engine.runtime import Engine
from shardwire.engine.shard import engine_of

def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    extra=None,
    keep: int | None = None,
    asynchronous: bool = False,
) -> "PendingCheckpoint":
    """Save a sharded model (and its optimizer) as a checkpoint directory at ``path``.

    Every rank must call it, at a step's end (after the optimizer's step: under DiLoCo it issues
    the sync due after that step, as the next forward would); each writes its own shards, in
    parallel. ``path`` must be on storage every rank sees. The checkpoint becomes visible only once complete: until then, and after a crash
    at any moment, every other checkpoint is intact. An existing checkpoint at ``path`` is replaced
    (a crash in the instant between renaming it aside and renaming the new one in loses both
    names: save a series, a new path per step, to never replace one); anything else there is
    refused, except in a series, where it is set aside with a warning (see the module's doc).

    Args:
        step: the training step, returned by ``load_checkpoint``; it is also the data position of
            loaders that are a function of the step (``shardwire.training.data.ByteCorpus.batch``).
        extra: anything else to restore (a scheduler's ``state_dict()``, a data loader's position),
            JSON-serializable; rank 0's is saved.
        keep: for a checkpoint of a series (``checkpoint_path(directory, step)``), delete the oldest
            earlier checkpoints of the series once this one is visible, so that ``keep`` remain. A
            checkpoint whose weights are not finite (a diverged run) deletes none.
        asynchronous: return once the state is copied to host memory and write it in the
            background; call ``wait()`` on the result (every rank) to make it visible. The next
            ``save_checkpoint`` or ``load_checkpoint`` waits for it, so one save is in flight at most.

    Returns the ``PendingCheckpoint``, already visible unless ``asynchronous``.
    """
    engine = engine_of(model)
    session_of(engine).finish_pending()
    engine.compare_ranks("what came before this checkpoint", now=True)
    target = pathlib.Path(path)
    snapshot = on_every_rank(
        engine, f"saving checkpoint {target}",
        lambda: _Snapshot.take(target, engine, model, optimizer, step, extra, keep),
    )
    if optimizer is not None:
        per_rank = all_gather_json(snapshot.optimizer_state, engine, tag="checkpoint optimizer state")
        snapshot.manifest.optimizer["state"] = optim.merged_state(per_rank)
    if keep is not None and not all(all_gather_json(snapshot.finite, engine, tag="checkpoint finiteness")):
        keep = None  # a diverged model's checkpoint must not prune the finite ones before it
        if dist.get_rank(engine.group) == 0:
            warnings.warn(f"{target} holds weights that are not finite: it is saved, and every checkpoint before it "
                          f"is kept", stacklevel=2)
    token = all_gather_json(new_token(), engine, tag="checkpoint name")[0]
    pending = PendingCheckpoint(target, engine, snapshot, token, keep)
    on_every_rank(engine, f"saving checkpoint {target}", pending._make_staging)
    if asynchronous:
        session_of(engine).pending = pending
        pending._write_in_background()
    else:
        pending._write()
        pending.wait()
    return pending


class PendingCheckpoint:
    """A checkpoint being written. ``wait()`` (on every rank) commits it once every rank's files are
    complete, and raises the error of any rank that failed to write its files."""

    def __init__(self, path: pathlib.Path, engine: Engine, snapshot: "_Snapshot", token: str, keep: int | None):
        self.path = path
        self._engine = engine
        self._snapshot = snapshot
        self._token = token
        self._staging = path.with_name(temporary_name(path.name, token))
        self._keep = keep
        self._written: list[FileRecord] | None = None
        self._error: Exception | None = None  # the writer's, reported to every rank in wait()
        self._failure: Exception | None = None  # the commit's, as wait() raised it
        self._writer: threading.Thread | None = None
        self._done = False

    def wait(self) -> None:
        """Commit the checkpoint; a save that failed raises its error again on every later call."""
        if self._done:
            if self._failure is not None:
                raise self._failure
            return
        session = session_of(self._engine)
        if session.pending is self:
            session.pending = None
        if self._writer is not None:
            self._writer.join()
        engine = self._engine
        is_rank0 = dist.get_rank(engine.group) == 0
        try:
            mine = on_every_rank(engine, f"writing checkpoint {self.path}", self._written_files)
            records = [FileRecord(**r) for rank in all_gather_json(mine, engine, tag="checkpoint files") for r in rank]
            on_every_rank(
                engine, f"publishing checkpoint {self.path}", lambda: self._publish(records) if is_rank0 else None
            )
        except Exception as err:
            self._failure = err
            if is_rank0:
                self._discard_staging()
            raise
        finally:
            self._done = True
            self._snapshot = None  # release the host copies
        if is_rank0:
            self._tidy()

    def _make_staging(self) -> None:
        """Rank 0 claims the directory the save writes in for this run, and creates the one that every
        rank writes into, marked as this save's; the others wait for it in the agreement that follows."""
        if dist.get_rank(self._engine.group) == 0:
            session_of(self._engine).claim(self.path.parent, self.path.name)
            ownership.create_marked(self._staging, self.path.name, self._token)

    def _write_in_background(self) -> None:
        self._writer = threading.Thread(target=self._write, name=f"writing {self.path.name}")
        self._writer.start()

    def _write(self) -> None:
        try:
            self._written = self._snapshot.write(self._staging)
        except Exception as err:  # reported to every rank in wait()
            self._error = err

    def _written_files(self) -> list[dict]:
        if self._error is not None:
            raise self._error
        return [dataclasses.asdict(record) for record in self._written]

    def _publish(self, records: list[FileRecord]) -> None:
        """Rank 0: write the manifest into the finished directory and give it its final name."""
        staging, target = self._staging, self.path
        for record in records:
            size = (staging / record.name).stat().st_size if (staging / record.name).is_file() else None
            if size != record.nbytes:
                raise CheckpointError(
                    f"{staging / record.name}: written by a rank but not seen here with its {record.nbytes} "
                    f"bytes: the checkpoint directory must be on storage that every rank sees"
                )
        manifest = dataclasses.replace(self._snapshot.manifest, files=records)
        write_durably(staging / MANIFEST, manifest.to_json().encode())
        _fsync_directory(staging)
        if target.exists() or target.is_symlink():
            _make_way(target, passed_over=str(target.resolve()) in session_of(self._engine).passed_over)
        staging.rename(target)
        _fsync_directory(target.parent)

    def _discard_staging(self) -> None:
        """Rank 0, once every rank has stopped writing a save that failed: delete what it wrote, so
        that a full disk does not fill further with each retry (the next save sweeps what this cannot)."""
        with contextlib.suppress(OSError):
            ownership.sweep(self.path.parent)

    def _tidy(self) -> None:
        """Rank 0, once the checkpoint is visible: delete what ``keep`` drops, the checkpoint this one
        replaced and what crashed saves left (nothing else is in flight), all of it provably made by
        saves. A failure here is a warning: the checkpoint itself is saved."""
        try:
            ownership.unmark(self.path)
            if self._keep is not None:
                series.prune(self.path, self._keep)
            ownership.sweep(self.path.parent)
        except OSError as err:
            warnings.warn(f"checkpoint {self.path} is saved, but tidying its directory failed: {err}", stacklevel=3)


@dataclasses.dataclass
class _Snapshot:
    """One rank's part of a checkpoint, copied to host memory: what it writes, and the manifest."""

    rank: int
    tensors: dict[str, torch.Tensor]  # this rank's file
    replicated: dict[str, torch.Tensor]  # written by rank 0
    manifest: Manifest  # the same on every rank; rank 0 completes it with the file records
    optimizer_state: dict | None  # which optimizer state this rank holds, per parameter
    finite: bool  # this rank's shards hold no inf or nan (checked where ``keep`` would prune)

    @classmethod
    def take(cls, target, engine, model, optimizer, step, extra, keep) -> "_Snapshot":
        _check_target(target, keep, step)
        if step is not None:
            try:
                schema.integer(step, "step")  # what a loader accepts
            except ValueError as err:
                raise CheckpointError(f"{err}: give the training step, or None") from None
        try:
            extra = json.loads(json.dumps(extra))  # a copy: an asynchronous save keeps this moment's
        except (TypeError, ValueError) as err:
            raise CheckpointError(
                f"extra must be JSON-serializable (dicts, lists, strings, numbers): {err}"
            ) from None
        rank, world = dist.get_rank(engine.group), dist.get_world_size(engine.group)
        # Under hybrid sharding every group holds the same shards and the first group's are saved;
        # groups that sync every H steps train models of their own, and each group's are.
        writes_shards = engine.layout.writes_shards or engine.outer is not None
        if engine.outer is not None:
            # the sync due is issued, and the one in flight saved as arrived, to be applied when it
            # was due (between fault-tolerant groups, applied now); its all-reduce updates its error
            # feedback's residual in place, so it must arrive before that, or the shards, are copied
            engine.outer.settle()
        tensors = {param_key(flat.name): _host_copy(flat.shard) for flat in engine.flats if writes_shards}
        tensors[rng_key("cpu")] = torch.get_rng_state()
        for flat in engine.flats:
            for reduction, residual in flat.residuals.items():
                tensors[residual_key(flat.name, reduction)] = _host_copy(residual)
        if engine.outer is not None:
            for flat in engine.flats:
                for key, value in ({} if flat.outer is None else flat.outer.state()).items():
                    tensors[outer_key(flat.name, key)] = _host_copy(value)
                if flat.outer is not None and flat.outer.own_squared is not None:  # a sync in flight's measure
                    tensors[measure_key(flat.name)] = _host_copy(flat.outer.own_squared.reshape(1))
            tensors[OUTER_SCHEDULE] = torch.tensor(engine.outer.state(), dtype=torch.int64)
            if engine.outer.quorum is not None:
                tensors[OUTER_QUORUM] = torch.tensor(engine.outer.quorum.state(), dtype=torch.int64)
        if engine.device.type == "cuda":
            tensors[rng_key("cuda")] = torch.cuda.get_rng_state(engine.device)
        buffers = buffer_records(engine, model)
        replicated = {buffer_key(b.name): _host_copy(model.get_buffer(b.name)) for b in buffers}
        optimizer_state = None
        if optimizer is not None:
            optimizer_state = optim.capture(engine, optimizer, _host_copy if writes_shards else None)
            tensors.update(optimizer_state.tensors)
        manifest = Manifest(
            step=step,
            world_size=world,
            flats=[FlatRecord(flat.name, flat.packing) for flat in engine.flats],
            buffers=buffers,
            state_dict_keys=list(engine.state_dict_keys),
            optimizer=None if optimizer_state is None else optimizer_state.record,
            extra=extra,
            files=[],
            groups=1 if engine.outer is None else engine.layout.replicate.world,
        )
        finite = keep is None or all(bool(torch.isfinite(tensors[param_key(flat.name)]).all())
                                     for flat in engine.flats if param_key(flat.name) in tensors)
        return cls(rank, tensors, replicated if rank == 0 else {}, manifest,
                   None if optimizer_state is None else optimizer_state.state, finite)

    def write(self, directory: pathlib.Path) -> list[FileRecord]:
        if not directory.is_dir():
            raise CheckpointError(
                f"{directory}: created by rank 0 but not seen here: the checkpoint directory must be on "
                f"storage that every rank sees"
            )
        files = {rank_file(self.rank): self.tensors}
        if self.rank == 0:
            files[REPLICATED] = self.replicated
        records = []
        for name, tensors in files.items():
            data = safetensors.torch.save(tensors)
            write_durably(directory / name, data)
            records.append(FileRecord.of(directory / name, data))
        return records


def _check_target(target: pathlib.Path, keep: int | None, step: int | None) -> None:
    named = series.step_of(target)
    if named is not None and step != named and (step is not None or keep is not None):
        # what keep prunes is a checkpoint of the step its name says (ownership.not_a_checkpoint)
        raise CheckpointError(f"{target} is named for step {named}, but step={step!r} was given: give step={named}")
    if named is None and (target.exists() or target.is_symlink()):
        reason = ownership.not_made_by_a_save(target)
        if reason is not None:
            raise _not_replaceable(target, reason)
    if keep is not None:
        if named is None:
            raise CheckpointError(
                f"keep applies to a series of checkpoints, and {target} is not named like one: "
                f"save to shardwire.checkpoint_path(directory, step)"
            )
        if keep < 1:
            raise CheckpointError(f"keep must be at least 1 (this checkpoint), got {keep}")


def _make_way(target: pathlib.Path, passed_over: bool = False) -> None:
    """Rank 0, before renaming the new checkpoint in: free ``target``'s name.

    What a save provably made (a complete checkpoint, an incomplete one still marked) is hidden for
    deletion, unless a resume of this run ``passed_over`` it, whole, for what it holds
    (``CheckpointRefused``: its weights not finite, its groups unlike), saying why: it may be all
    the user has of that step. Anything else is never deleted: in a series, where a run that resumed
    from an earlier checkpoint must save this step again, it is set aside under a name of its own
    with a warning; elsewhere the save is refused.
    """
    reason = ownership.not_made_by_a_save(target, series.step_of(target))
    if reason is None and passed_over and series.holds_a_manifest(target):
        reason = "this run could not resume from it (said as it started)"
    if reason is None:
        ownership.hide(target)
    elif series.step_of(target) is not None:
        aside = target.with_name(f"{target.name}.set-aside-{new_token()}")
        target.rename(aside)
        warnings.warn(f"set {target} aside as {aside.name} to save in its place, never deleting it: {reason}")
    else:
        raise _not_replaceable(target, reason)


def _not_replaceable(target: pathlib.Path, reason: str) -> CheckpointError:
    return CheckpointError(f"cannot replace {target}: {reason} (choose another path; nothing there is replaced)")


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def write_durably(path: pathlib.Path, data: bytes) -> None:
    """Write a new file and make it durable; an existing file is never overwritten."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_directory(path: pathlib.Path) -> None:
    """Make the directory's entries (names created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
