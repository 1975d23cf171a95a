"""``load_checkpoint``: restore a sharded model and its optimizer from a checkpoint of any world size.

Each rank computes the part it holds of every parameter at the current world size and layout and
reads the overlapping parts of the old ranks' files (save at 4, load at 3: re-slicing the same
parameters; save hybrid in groups of 2, load full at 3: the first group's files hold every buffer).
Nothing is modified until every rank has read and verified all it needs: a load either completes
on every rank or changes nothing anywhere.

Groups that sync every H steps (``shard(..., diloco=...)``) each saved their own shards, optimizer
and outer state: a run with as many groups reads its own group's, re-sliced for its group size. One
with another number of groups, or without DiLoCo, starts every group from the global model (the
anchor, which every group saved alike), with the first group's optimizer and the outer state, and
nothing in flight; a run with DiLoCo that loads a checkpoint saved without it starts its outer
optimisation from the loaded parameters.

RNG states are per rank: at the world size the checkpoint was saved at, each rank gets its own back,
so a resumed run draws the same random numbers (dropout masks) as an uninterrupted one. At another
world size the ranks are different processes with different roles, and no old rank's stream is the
right one for a new rank; the RNG states are then left as they are (``CheckpointInfo.rng_restored``
says which happened), and a run that needs reproducible randomness there seeds it from the step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import zlib

import torch
import torch.distributed as dist
from torch import nn

from shardwire.engine.checkpoint import optim, series
from shardwire.engine.checkpoint.session import session_of
from shardwire.engine.checkpoint.consensus import all_gather_json, on_every_rank
from shardwire.engine.checkpoint.format import (
    OUTER_QUORUM,
    OUTER_SCHEDULE,
    REPLICATED,
    CheckpointError,
    CheckpointRefused,
    FlatRecord,
    buffer_key,
    buffer_records,
    first_difference,
    measure_key,
    outer_key,
    param_key,
    rank_file,
    residual_key,
    rng_key,
)
from shardwire.engine.checkpoint.reader import CheckpointReader
from shardwire.engine.runtime import Engine
from shardwire.engine.shard import engine_of
from shardwire.files import directory_problem

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    path: pathlib.Path
    step: int | None
    extra: object
    world_size: int  # the world size it was saved at
    rng_restored: bool  # True at the saving world size only
    # True where groups that synced every H steps saved their own progress since their last sync and
    # this run's groups (another count of them, or none syncing) start from the model they agreed on
    own_progress_dropped: bool = False


def load_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> CheckpointInfo:
    """Restore parameters, buffers, optimizer state and RNG states from the checkpoint at ``path``.

    Every rank must call it, with the model sharded as it was when saved (same units), at any world
    size. A checkpoint that is incomplete, corrupted (the manifest is checked against its own sha256
    and every field checked for type and range; every file read against the sha256 in the manifest)
    or from a different model raises a ``CheckpointError`` on every rank naming the file and the
    reason, and leaves the model and optimizer untouched.
    """
    engine = engine_of(model)
    session_of(engine).finish_pending()
    return _load(pathlib.Path(path), engine, model, optimizer, named_step=None)


def load_latest_checkpoint(
    directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> CheckpointInfo | None:
    """Load the newest good checkpoint of the series in ``directory``; None if it holds none.

    A checkpoint that cannot be loaded is skipped, and the one before it is tried; so is one whose
    manifest records another step than its name, which would make the series' order a lie, and one
    whose weights, optimizer state or outer state are not finite (a diverged run's, which a resume
    would train from in vain). Each one skipped is a warning saying why once an older one loads. If
    there are checkpoints and none can be loaded, it raises a ``CheckpointError`` with each one's
    reason instead (said once) rather than return None: starting over would let new saves prune the
    old ones.
    So does a directory that is a checkpoint itself, DCP's or one of a series (a series there would
    not see it, and would start over inside it), and one that holds only what is named as
    checkpoints and holds no manifest (the user's, which a series would take for damaged
    checkpoints of its own): ``series.series_problem``, before anything is written there.
    """
    if (problem := series.series_problem(directory)) is not None:
        raise CheckpointError(f"{directory} {problem}")
    engine = engine_of(model)
    session_of(engine).finish_pending()
    on_every_rank(engine, f"claiming {directory}", lambda: _claim_on_rank_0(directory, engine))
    candidates = [path.name for path in series.list_checkpoints(directory)]
    if any(names != candidates for names in all_gather_json(candidates, engine, tag="checkpoint list")):
        raise CheckpointError(
            f"ranks see different checkpoints in {directory}: it must be on storage that every rank sees"
        )
    skipped = []
    for name in reversed(candidates):
        path = pathlib.Path(directory) / name
        try:
            info = _load(path, engine, model, optimizer, named_step=series.step_of(path), finite=True)
        except CheckpointError as err:
            skipped.append((path, err))
            if isinstance(err, CheckpointRefused):  # whole: set aside, not replaced, by a save of its step
                session_of(engine).passed_over.add(str(path.resolve()))
            continue
        if dist.get_rank(engine.group) == 0:  # said once one loads: where none does, the error says each
            for newer, err in skipped:
                log.warning("cannot resume from %s, skipping it: %s", newer, err)
        return info
    if skipped:
        raise CheckpointError(f"no checkpoint in {directory} can be loaded: {series.reasons(skipped)}")
    return None


def _claim_on_rank_0(directory: str | os.PathLike, engine: Engine) -> None:
    """The run that resumes from a directory saves there: it claims it first (``claim``), on rank 0."""
    if dist.get_rank(engine.group) == 0:
        if (problem := directory_problem(directory)) is not None:  # a file, a link to nowhere: said so
            raise CheckpointError(f"{directory} {problem}")
        session_of(engine).claim(pathlib.Path(directory))


def _load(path: pathlib.Path, engine: Engine, model: nn.Module, optimizer, named_step: int | None,
          finite: bool = False) -> CheckpointInfo:
    """Read and verify on every rank, then apply; ``named_step``: the step the path's name says; with
    ``finite``, weights that are not finite are refused (a resume from them diverges at its first step,
    whatever it is given)."""
    staged = on_every_rank(
        engine, f"loading checkpoint {path}", lambda: _Staged.read(path, engine, model, optimizer, named_step, finite)
    )
    if staged.agreed is not None and (problem := _groups_disagree(staged.agreed, engine)) is not None:
        raise CheckpointRefused(f"{path}: {problem}")
    staged.apply(engine, model, optimizer)
    return staged.info


@dataclasses.dataclass
class _Staged:
    """Everything this rank will restore, read and verified but not yet applied."""

    info: CheckpointInfo
    shards: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    optimizer_state: dict | None
    rng: dict[str, torch.Tensor]
    residuals: dict[str, torch.Tensor]  # error feedback, by key; restored where saved alike
    measures: dict[str, torch.Tensor]  # the sync in flight's own change, squared and summed, by flat buffer
    outer: dict[str, dict[str, torch.Tensor]]  # sync every H steps: each flat buffer's outer state
    schedule: list[int] | None  # and the outer optimisation's place (None: saved without DiLoCo)
    quorum: list[int] | None  # and the fault-tolerant groups' count (``Quorum.state``; None: saved without)
    # where each group resumes its own: what the groups agreed on (``_agreement``), which must be alike
    agreed: dict | None = None

    @classmethod
    def read(
        cls, path: pathlib.Path, engine: Engine, model: nn.Module, optimizer, named_step: int | None,
        finite: bool = False,
    ) -> "_Staged":
        rank, world = dist.get_rank(engine.group), dist.get_world_size(engine.group)
        with CheckpointReader(path) as reader:
            manifest = reader.manifest
            if named_step is not None and manifest.step != named_step:
                raise CheckpointRefused(
                    f"{path}: its manifest records step {manifest.step}, its name step {named_step}"
                )
            here = [FlatRecord(flat.name, flat.packing) for flat in engine.flats]
            difference = first_difference(manifest, here, buffer_records(engine, model))
            if difference is not None:
                raise CheckpointRefused(f"{path} was saved from a different model: {difference}; load it into the "
                                      f"model it was saved from")
            reader.check_complete()
            saving_group = _saving_group(manifest.groups, engine)
            own = _resumes_own_group(manifest.groups, engine)
            shard_rank = engine.layout.shard.rank
            shards = {flat.name: reader.shard(saved, param_key(flat.name) if own else reader.weights_key(saved),
                                              flat.packing, shard_rank, flat.packing.dtype, saving_group)
                      for saved, flat in zip(manifest.flats, engine.flats)}
            buffers = {
                b.name: reader.tensor(REPLICATED, buffer_key(b.name), b.shape, b.dtype) for b in manifest.buffers
            }
            state = None if optimizer is None else optim.read_state_dict(reader, engine, optimizer, saving_group)
            outer, schedule, quorum = (_outer_state(reader, engine, saving_group) if engine.outer is not None
                                       else ({}, None, None))
            if schedule is not None and not own:  # every group starts from the global model, nothing in flight
                outer = {name: {key: kept[key] for key in ("anchor", "momentum") if key in kept}
                         for name, kept in outer.items()}
                schedule = [schedule[0], schedule[0], -1]
            if finite and (name := _not_finite(shards, state, outer)) is not None:
                raise CheckpointRefused(f"{path}: {name} holds values that are not finite: the run diverged before "
                                      f"it was saved")
            rng, residuals, measures = {}, {}, {}
            if manifest.world_size == world:
                rng["cpu"] = _rng_state(reader, rank, "cpu", torch.get_rng_state())
                if engine.device.type == "cuda" and rng_key("cuda") in reader.keys(rank_file(rank)):
                    rng["cuda"] = _rng_state(reader, rank, "cuda", torch.cuda.get_rng_state(engine.device))
                residuals = _residuals(reader, rank, engine)
                if own:  # this rank's shard of its group's change, as it was: the sync in flight is measured
                    measures = _measures(reader, rank, engine)
        info = CheckpointInfo(path, manifest.step, manifest.extra, manifest.world_size, bool(rng),
                              own_progress_dropped=manifest.groups > 1 and not own)
        agreed = _agreement(outer, schedule) if own and manifest.groups > 1 else None
        return cls(info, shards, buffers, state, rng, residuals, measures, outer, schedule, quorum, agreed)

    def apply(self, engine: Engine, model: nn.Module, optimizer) -> None:
        copy_into_model(engine, model, self.shards, self.buffers)
        for flat in engine.flats:
            for reduction, residual in flat.residuals.items():
                saved = self.residuals.get(residual_key(flat.name, reduction))
                if saved is None:
                    residual.zero_()
                else:
                    residual.copy_(saved)
        if optimizer is not None:
            optimizer.load_state_dict(self.optimizer_state)
        if engine.outer is not None:
            for flat in engine.flats:
                if flat.outer is not None:
                    flat.outer.load_state(self.outer.get(flat.name, {}), flat.shard)
                    if flat.outer.change is not None and flat.name in self.measures:
                        flat.outer.own_squared = self.measures[flat.name].to(flat.shard.device).reshape(())
            engine.outer.load_state(self.schedule)
            if engine.outer.quorum is not None:
                engine.outer.quorum.load_state(self.quorum)
        if engine.step_quorum is not None and self.info.step is not None:
            engine.step_quorum.resume(self.info.step)
        if "cpu" in self.rng:
            torch.set_rng_state(self.rng["cpu"])
        if "cuda" in self.rng:
            torch.cuda.set_rng_state(self.rng["cuda"], engine.device)


def _not_finite(shards: dict[str, torch.Tensor], optimizer_state: dict | None,
                outer: dict[str, dict[str, torch.Tensor]]) -> str | None:
    """The first of what a resume restores (the weights, the optimizer's state, the outer state of
    sync every H steps) that holds a value not finite, in words, or None: any of them makes the
    next step's loss not finite, whatever the run is given."""
    held = [*((f"the weights of {name}", shard) for name, shard in shards.items()),
            *((f"the optimizer's {key}", value) for state in (optimizer_state or {}).get("state", {}).values()
              for key, value in state.items()),
            *((f"the outer {key} of {name}", value) for name, kept in outer.items() for key, value in kept.items())]
    return next((what for what, value in held
                 if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all())),
                None)


# What every group saved alike, in words, as ``_agreement`` names it.
_AGREED = {"anchor": "anchors (the model they last agreed on)", "momentum": "outer momentum",
           "schedule": "places in the outer steps' schedule"}


def _agreement(outer: dict[str, dict[str, torch.Tensor]], schedule: list[int] | None) -> dict:
    """What this rank's group saved that every group saves alike: a checksum of its slice of the
    anchors and of the outer momentum (None where a flat buffer's is missing) and the schedule's
    place. The syncs leave them bit-identical, quantized wire or not."""
    found: dict = {"schedule": schedule}
    for key in ("anchor", "momentum"):
        held = [outer[name][key] for name in sorted(outer) if key in outer[name]]
        checksum = 0
        for tensor in held:
            checksum = zlib.crc32(tensor.contiguous().view(torch.uint8).numpy(), checksum)
        found[key] = checksum if len(held) == len(outer) else None
    return found


def _groups_disagree(agreed: dict, engine: Engine) -> str | None:
    """Why the groups' saved outer states cannot be resumed, or None: where the groups saved
    different models as the one they last agreed on, or different outer momentum or places in the
    schedule (an altered checkpoint), each would go on from its own, every later sync averaging
    changes from different anchors (or waiting for a sync the others never send), reported synced
    all the same. The same verdict on every rank: each judges every rank's."""
    gathered = all_gather_json([engine.layout.shard.rank, engine.layout.replicate.rank, agreed], engine,
                               tag="the groups' outer states")
    by_position: dict[int, dict[int, dict]] = {}
    for position, group, found in gathered:
        by_position.setdefault(position, {})[group] = found
    for key, words in _AGREED.items():
        for groups in by_position.values():
            first, *others = sorted(groups)
            other = next((group for group in others if groups[group][key] != groups[first][key]), None)
            if other is None:
                continue
            lacking = next((group for group in (first, other) if groups[group][key] is None), None)
            if lacking is not None:
                return (f"group {lacking} saved no {key} where group {first + other - lacking} did, as no run of "
                        f"shardwire leaves them; it was altered after it was saved")
            return (f"its groups saved different {words}: group {first}'s and group {other}'s differ, as no run "
                    f"of shardwire leaves them; it was altered after it was saved")
    return None


def _resumes_own_group(saved_groups: int, engine: Engine) -> bool:
    """Whether each group of this run continues from its own parameters: it syncs every H steps, as
    many groups as saved. Otherwise every group starts from the weights all groups agree on
    (``CheckpointReader.weights_key``)."""
    return engine.outer is not None and saved_groups == engine.layout.replicate.world


def _saving_group(saved_groups: int, engine: Engine) -> int:
    """The saving group whose shards this rank reads: its own group's where the checkpoint holds as
    many groups' as this run trains apart (sync every H steps), else the first's."""
    return engine.layout.replicate.rank if _resumes_own_group(saved_groups, engine) else 0


def _outer_state(reader: CheckpointReader, engine: Engine, saving_group: int
                 ) -> tuple[dict[str, dict[str, torch.Tensor]], list[int] | None, list[int] | None]:
    """The outer state group ``saving_group`` saved, re-sliced for this rank's shards as the shards
    are, the schedule's place and the quorum's count (``Quorum.state``); none of it where the
    checkpoint was saved without DiLoCo (or, the last, without fault tolerance)."""
    states = {}
    for saved, flat in zip(reader.manifest.flats, engine.flats):
        if flat.outer is None:
            continue
        held = set(reader.keys(reader.shard_file(saved, 0, saving_group)))
        states[flat.name] = {
            key: reader.shard(saved, outer_key(flat.name, key), flat.packing, engine.layout.shard.rank, dtype,
                              saving_group)
            for key, dtype in flat.outer.dtypes.items() if outer_key(flat.name, key) in held
        }
    first = reader.shard_file(reader.manifest.flats[0], 0, saving_group)
    held = reader.keys(first)
    if OUTER_SCHEDULE not in held:
        return states, None, None
    quorum = reader.tensor(first, OUTER_QUORUM, (2,), torch.int64).tolist() if OUTER_QUORUM in held else None
    schedule = reader.tensor(first, OUTER_SCHEDULE, (3,), torch.int64).tolist()
    extra = reader.manifest.extra
    trained = reader.manifest.step if isinstance(extra, dict) and "settings" in extra else None
    if (problem := _schedule_problem(schedule, quorum, engine.outer.diloco.sync_every, trained)) is not None:
        raise CheckpointRefused(f"{reader.directory / first}: {problem}, as no run of shardwire leaves it; it was "
                              f"altered after it was saved")
    return states, schedule, quorum


def _schedule_problem(schedule: list[int], quorum: list[int] | None, sync_every: int,
                      trained: int | None) -> str | None:
    """Why a saved place in the outer steps' schedule (``OuterLoop.state``: the inner steps done,
    the step whose due sync was issued, the step the sync in flight is applied after, or -1) and
    the quorum's counts cannot be resumed, or None. The syncs are issued at each forward, so the
    steps done run at most a sync's interval ahead of the last issued (a resumed run issues every
    sync due in between, one at a time: 2**62 steps ahead would never end; one optimizer step a
    forward leaves it one ahead), and a sync in flight is applied no earlier than it was issued. A
    training job's checkpoint (one that records its settings, as `shardwire train` saves them) of
    step ``trained`` was saved with that many inner steps done: another count moves every sync."""
    steps, checked, applied_after = schedule
    if not 0 <= checked <= steps <= checked + sync_every:
        return f"its outer schedule records {steps} inner steps done and syncs issued to step {checked}"
    if trained is not None and steps != trained:
        return f"its outer schedule records {steps} inner steps done in a training job's checkpoint of step {trained}"
    if applied_after != -1 and applied_after < checked:  # how far behind it runs is the saving run's setting
        return f"its outer schedule applies the sync in flight after step {applied_after}, issued at step {checked}"
    if quorum is not None and min(quorum) < 0:
        return f"its quorum's counts of syncs and batches are {quorum}"
    return None


def _residuals(reader: CheckpointReader, rank: int, engine: Engine) -> dict[str, torch.Tensor]:
    """``rank``'s saved error-feedback residuals that fit this run's: one saved for another placement
    of ranks on nodes, another wire or another packing does not, and its feedback starts again from
    zero (it holds one step's rounding, not training state)."""
    if reader.manifest.version < 6:  # laid out as the flat packing's buffers, not this one's
        return {}
    saved = set(reader.keys(rank_file(rank)))
    found = {}
    for flat in engine.flats:
        for reduction, residual in flat.residuals.items():
            key = residual_key(flat.name, reduction)
            if key in saved:
                try:
                    found[key] = reader.tensor(rank_file(rank), key, tuple(residual.shape), residual.dtype)
                except CheckpointError:
                    continue
    return found


def _measures(reader: CheckpointReader, rank: int, engine: Engine) -> dict[str, torch.Tensor]:
    """``rank``'s measures of the sync in flight (``measure_key``), by flat buffer, where saved: a
    checkpoint saved before they were, or with no sync in flight, has none, and that sync goes
    unmeasured in the metrics."""
    saved = set(reader.keys(rank_file(rank)))
    return {flat.name: reader.tensor(rank_file(rank), measure_key(flat.name), (1,), torch.float32)
            for flat in engine.flats if measure_key(flat.name) in saved}


def _rng_state(reader: CheckpointReader, rank: int, device_type: str, current: torch.Tensor) -> torch.Tensor:
    """``rank``'s saved RNG state, which must be shaped like the ``current`` one to be settable."""
    return reader.tensor(rank_file(rank), rng_key(device_type), tuple(current.shape), current.dtype)


@torch.no_grad()
def copy_into_model(engine: Engine, model: nn.Module, shards: dict[str, torch.Tensor],
                    buffers: dict[str, torch.Tensor]) -> None:
    """Overwrite each flat buffer's shard on this rank, and the buffers, with host tensors."""
    for flat in engine.flats:
        flat.shard.copy_(shards[flat.name])
    for name, value in buffers.items():
        model.get_buffer(name).copy_(value)
