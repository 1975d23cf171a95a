"""``shardwire export CHECKPOINT OUT``: a checkpoint written as its model's own ecosystem reads it.

An ``hf:`` model becomes a ``save_pretrained`` directory that ``from_pretrained`` loads
(``shardwire.models.export``); a GPT preset, a plain state dict file (``OUT.safetensors``, or a
``torch.save`` file). The model is the one ``shardwire train`` recorded in the checkpoint, with the
config it recorded for an ``hf:`` model, or ``--model``, whose weights must fit. It runs in one
process, without a GPU, from a checkpoint of any world size. Started as several workers (under
``torchrun --nproc-per-node N``, as a script may start every command), rank 0 exports and the other
ranks leave at once, successfully, having nothing to do: OUT is written once, and the job's status is
rank 0's.

OUT is checked before any weight is read: new (nothing is overwritten), writable, and outside the
checkpoint. Given a ``--checkpoint-dir``, the newest checkpoint that can be exported is, as ``train``
resumes from the newest that loads: a damaged or diverged one is skipped, saying why.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import warnings

import torch

from shardwire.engine.checkpoint import CheckpointError, export_state_dict, list_checkpoints
from shardwire.engine.checkpoint.format import MANIFEST
from shardwire.engine.checkpoint.portable import export_problem, weights_in
from shardwire.engine.checkpoint.reader import CheckpointReader
from shardwire.engine.checkpoint.series import (
    group_series,
    holds_a_manifest,
    reasons,
    set_aside_in,
    set_aside_why,
    step_of,
)
from shardwire.files import (OutputRefused, StagedDirectory, WriteFailed, holds_dcp, inside_problem, series_problem,
                             stage_of)
from shardwire.launch import under_launcher
from shardwire.mappings import cut, one_line, refusal, shown
from shardwire.options import argument_text, text
from shardwire.models import tokenizer as hf_tokenizer
from shardwire.models.choice import HF_PREFIX, choose, config_difference, config_fields, recorded_name
from shardwire.models.export import fit_problem, save_pretrained
from shardwire.sim.huggingface import config_file
from shardwire.training.config import recorded_diloco, recorded_seq_len
from shardwire.training.data import read_as_text_problem

_LISTINGS = 5  # how often a series whose checkpoints a running job prunes is listed again


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT", type=argument_text,
                        help="a checkpoint (ckpt/step_00000400), or a --checkpoint-dir: its newest checkpoint")
    parser.add_argument("out", metavar="OUT", type=argument_text,
                        help="hf: models: a new directory for save_pretrained; GPT presets: a new .safetensors or "
                             ".pt file")
    parser.add_argument("--model", type=text, help="the model the checkpoint holds, as train's --model names it (default: "
                                        "what shardwire train recorded in the checkpoint)")


def run(args: argparse.Namespace, argv: list[str], checked) -> int:
    """The checkpoint and OUT are checked until the weights are read: what ``checked`` holds is said
    once the export is written."""
    if _another_worker():
        return 0  # rank 0 exports, once: another rank would find OUT written, or race it for the name
    if under_launcher():  # its launcher's SIGTERM stops it as Ctrl-C does, what it staged removed (else: cli.main)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    given = pathlib.Path(args.checkpoint)
    try:
        checkpoint, model, out, notes = _export_newest(given, args)
    except (CheckpointError, ValueError, OutputRefused) as err:
        print(refusal(f"error: {err}"), file=sys.stderr)
        return 2
    except OSError as err:  # a name too long, a full disk: what the system said, of which file
        print(refusal(f"error: {_failed_write(err, args.out, args.checkpoint)}"), file=sys.stderr)
        return 2
    checked()
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(one_line(f"exported {checkpoint} ({cut(model)}) to {out}{_format(out, model)}"))
    return 0


def _another_worker() -> bool:
    """Whether this process is one of a launcher's workers other than rank 0 (torchrun's ``RANK`` past 0
    of a ``WORLD_SIZE`` past 1; ``shardwire.launch.launcher_problem`` has checked both are counts)."""
    if not under_launcher():
        return False
    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    return world.isdigit() and rank.isdigit() and int(world) > 1 and int(rank) > 0


def _failed_write(err: OSError, out: str, checkpoint: str) -> str:
    """What the system said of a file, as the command says it: a write into OUT or into its stage (a
    full disk) as OUT's, with what to do (``files.WriteFailed``); a read of CKPT or of a file in it
    as CKPT's; of another file, as it was said."""
    def within(place: str) -> bool:
        return os.path.commonpath([os.path.abspath(err.filename), os.path.abspath(place)]) == os.path.abspath(place)

    if err.filename is None or any(within(place) for place in (out, stage_of(out))):
        return str(WriteFailed(err.errno, err.strerror or str(err), out))
    if within(checkpoint):
        return (f"CKPT {shown(err.filename)} cannot be read ({err.strerror or err}): give a checkpoint, or a "
                f"--checkpoint-dir, you can read")
    return f"{shown(err.filename)}: {err.strerror or err}"


def _export_newest(given: pathlib.Path, args: argparse.Namespace) -> tuple[pathlib.Path, str, pathlib.Path, list[str]]:
    """Export ``given``, or the newest checkpoint of the series it holds that can be exported: the
    checkpoint, its model, what was written and the notes on it. A damaged one is skipped with a
    warning, as ``train`` skips it; one that a run saving in the series prunes while it is read is
    passed over for the series' newest, listed again."""
    for _ in range(_LISTINGS):
        candidates, skipped = _checkpoints(given), []
        for checkpoint in candidates:
            notes: list[str] = []  # of the checkpoint exported only
            try:
                return (checkpoint, *_export(checkpoint, given, args, notes), notes)
            except (CheckpointError, OSError) as err:
                if checkpoint != given and not checkpoint.exists():
                    break  # pruned under the export: list the series again
                if candidates == [given] or not isinstance(err, CheckpointError):
                    raise
                warnings.warn(f"cannot export {checkpoint}, skipping it: {err}", stacklevel=1)  # said once one is
                skipped.append((checkpoint, err))
        else:
            raise CheckpointError(f"no checkpoint in {given} can be exported: {reasons(skipped)}")
    raise CheckpointError(f"the checkpoints of {given} were deleted as they were read, {_LISTINGS} times (a run "
                          f"saving there with --keep prunes them): export one it keeps, or when it has ended")


def _format(out: pathlib.Path, model: str) -> str:
    """What kind of file a GPT preset's export wrote, by OUT's name."""
    if model.startswith(HF_PREFIX):
        return " (a save_pretrained directory)"
    if out.name.lower().endswith(".safetensors"):
        return " (safetensors)"
    return " (torch.save)" if out.suffix.lower() in (".pt", ".pth") else " (torch.save: name it .safetensors for safetensors)"


def _series_problem(out: str, given: pathlib.Path) -> str | None:
    """What stops ``out`` being written in a series of checkpoints, the one that holds ``given`` or
    any other (a path inside ``given`` itself is refused as it is exported): a run saving into the
    series would take it for one of its checkpoints, or set it aside."""
    if inside_problem(out, given) is not None:
        return None
    return series_problem(out, given.parent)


def _checkpoints(path: pathlib.Path) -> list[pathlib.Path]:
    """``path`` itself, or the checkpoints of the series it holds, newest first: a series beside a
    ``manifest.json`` that is no checkpoint's (the user's) is a series, as ``train`` resumes it."""
    if not path.is_dir():
        return [path]
    series = list_checkpoints(path)
    if (path / MANIFEST).exists() and (not series or holds_a_manifest(path)):
        return [path]
    if not series and (groups := group_series(path)):
        raise ValueError(f"{path} holds series of checkpoints in its subdirectories ({', '.join(groups[:4])}"
                         f"{', ...' if len(groups) > 4 else ''}), as fault-tolerant groups keep theirs, and none of "
                         f"its own: export one series ({path / groups[0]})")
    if not series and holds_dcp(path):
        raise ValueError(f"{path} is a torch.distributed.checkpoint (DCP) checkpoint, not shardwire's: load it with "
                         f"dcp.load (docs/checkpoints.md), only from a source you trust")
    if not series and (aside := set_aside_in(path)):
        raise ValueError(f"{path} holds no checkpoint but ones set aside ({', '.join(aside[:3])}"
                         f"{', ...' if len(aside) > 3 else ''}), which no resume starts from: give one by name to "
                         f"export it")
    if not series:
        raise ValueError(f"{path} holds no checkpoint: give one (ckpt/step_00000400) or a --checkpoint-dir")
    return series[::-1]


def _export(checkpoint: pathlib.Path, given: pathlib.Path, args: argparse.Namespace,
            notes: list[str]) -> tuple[str, pathlib.Path]:
    """Export ``checkpoint`` (of ``given``, as the user named it) to ``args.out``; returns the model it
    holds and what was written, and adds to ``notes`` what the user should know of it."""
    if args.out == "-":  # to most commands, standard output: weights are written to a file of their own
        raise OutputRefused("OUT - names no file (export does not write to standard output): give a file name, "
                            "such as model.safetensors")
    if (problem := _series_problem(args.out, given)) is not None:
        raise OutputRefused(f"OUT {cut(args.out)} {problem}")
    with CheckpointReader(checkpoint) as reader:
        if (named := step_of(checkpoint)) is not None and reader.manifest.step != named:  # as train's resume refuses it
            raise CheckpointError(f"{checkpoint}: its manifest records step {reader.manifest.step}, its name step "
                                  f"{named}")
        extra = reader.manifest.extra if isinstance(reader.manifest.extra, dict) else {}
        notes += _between_syncs(checkpoint, extra, reader.manifest.step)
    if (why := set_aside_why(checkpoint.name)) is not None:  # asked for by name: a series' export passes it by
        notes.append(f"{checkpoint} was {why}, and no resume trains from it")
    recorded = extra.get("model") if isinstance(extra.get("model"), str) else None
    model = args.model or recorded
    if model is None:
        raise ValueError(f"{checkpoint} does not record its model (shardwire train records it): give --model")
    settings = extra.get("settings") if isinstance(extra.get("settings"), dict) else {}
    data = settings.get("data") if isinstance(settings.get("data"), str) else None
    if (problem := read_as_text_problem(args.out, data, f"the --data directory {checkpoint} was trained on",
                                        directory=model.startswith(HF_PREFIX))) is not None:
        raise OutputRefused(f"OUT {cut(args.out)} {problem}")  # its run's resume would read it
    if model.startswith(HF_PREFIX) and os.path.isdir(directory := model[len(HF_PREFIX):]) and (
            problem := inside_problem(args.out, directory, what=f"the model directory {cut(model)} reads, which "
                                                                 f"export never writes in")) is not None:
        raise OutputRefused(f"OUT {cut(args.out)} {problem}")  # as train refuses its outputs there
    trained = (args.model is None or recorded_name(args.model) == recorded  # one model, however it is spelled
               or _same_architecture(checkpoint, args.model, extra))
    if not trained and recorded:
        notes.append(f"{checkpoint} was trained as {cut(recorded)}; exported as --model {cut(args.model)}")
    if model.startswith(HF_PREFIX):
        if (suffix := pathlib.Path(args.out).suffix.lower()) in (".safetensors", ".pt", ".pth", ".bin"):
            raise OutputRefused(f"OUT {cut(args.out)} is named as a file ({suffix}), and {cut(model)} exports a "
                                f"save_pretrained directory: give it a directory's name, such as "
                                f"{pathlib.Path(args.out).with_suffix('')}")
        if (problem := inside_problem(args.out, given, "exported")) is not None:
            raise OutputRefused(f"OUT {cut(args.out)} {problem}")
        stage = StagedDirectory(args.out, "OUT")  # claimed, and checked, before any weight is read
        try:
            with weights_in(checkpoint, finite=True) as weights:  # read and written a unit at a time
                fields = _trained_config(checkpoint, model, extra, notes) if trained else None
                tokenizer = _trained_tokenizer(checkpoint, extra, args.out, notes) if trained else True
                return model, save_pretrained(model, weights, stage, fields=fields, tokenizer=tokenizer)
        except BaseException:
            stage.discard()
            raise
    if args.out.endswith(os.sep):  # a directory asked for, where the weights go in one file
        raise OutputRefused(f"OUT {cut(args.out)} names a directory, which is for hf: models (a save_pretrained "
                            f"directory): give {cut(model)} a file name, such as model.safetensors")
    if (problem := export_problem(args.out, given)) is not None:
        raise OutputRefused(f"OUT {cut(args.out)} {problem}")
    seq_len = recorded_seq_len(extra) if trained else None
    _check_fit(checkpoint, model, seq_len, given=args.model is not None)
    if seq_len is not None and seq_len != (preset := choose(model)).seq_len:  # its position table's rows
        notes.append(f"{checkpoint} was trained at --seq-len {seq_len}, not {cut(model)}'s {preset.seq_len}: its "
                     f"weights load into the model made at that length, GPT(dataclasses.replace(PRESETS"
                     f"[{model!r}], seq_len={seq_len}))")
    return model, export_state_dict(checkpoint, args.out)


def _between_syncs(checkpoint: pathlib.Path, extra: dict, step: int | None) -> list[str]:
    """A note where ``checkpoint`` was saved between two syncs of ``--diloco``: each group saved its own
    parameters beside the model the groups last agreed on, and that model is the one exported (as
    any other job loads it)."""
    diloco = recorded_diloco(extra)
    if diloco is None or not isinstance(step, int) or diloco.agreed_after(step, extra["settings"].get("steps")):
        return []
    return [f"{checkpoint} was saved at step {step}, between syncs of --diloco (every {diloco.sync_every} steps): "
            f"exported is the model the groups last agreed on, without the steps each trained since"]


def _same_architecture(checkpoint: pathlib.Path, model: str, extra: dict) -> bool:
    """Whether the ``hf:`` ``model`` given builds the architecture the checkpoint records (its config
    moved, say); refuses one that differs from it: another activation or epsilon fits the same
    shapes, and would label the trained weights as another model without a word."""
    recorded = extra.get("hf_config")
    if not (model.startswith(HF_PREFIX) and isinstance(recorded, dict)):
        return False
    if (change := config_difference(recorded, config_fields(model))) is not None:
        raise ValueError(f"--model {cut(model)}'s config differs from the one {checkpoint} was trained with: {change}; "
                         f"its weights belong to the recorded architecture: leave out --model (the checkpoint "
                         f"records its config)")
    return True


def _trained_config(checkpoint: pathlib.Path, model: str, extra: dict, notes: list[str]) -> dict | None:
    """The config the checkpoint's ``hf:`` model was trained with, where it records one; a note names
    how the model's source differs now. A source whose config is gone (moved, deleted) leaves the
    recorded config to count; one that is there and cannot be read (a config.json that is a FIFO, a device,
    huge, not JSON) is refused, as ``train`` refuses it: its directory is read for the tokenizer too,
    and passed over it would hide what happened to the model's files."""
    fields = extra.get("hf_config")
    if not isinstance(fields, dict):
        return None
    try:
        now = config_fields(model)
    except ValueError as err:  # read_config's words, naming the file
        if not os.path.lexists(config_file(model[len(HF_PREFIX):])):
            return fields
        raise ValueError(f"{err} ({checkpoint} was trained as this model: mend its directory, which export reads "
                         f"too)") from None
    if (change := config_difference(fields, now)) is not None:
        notes.append(f"{cut(model)}'s config has changed since {checkpoint} was trained ({change}); exported with the "
                     f"config it was trained with")
    return fields


def _trained_tokenizer(checkpoint: pathlib.Path, extra: dict, out: str, notes: list[str]) -> pathlib.Path | bool:
    """The tokenizer the checkpoint's model trained with, where it records one and the directory still
    holds it; none, with a note, where it has changed or is gone (another tokenizer's ids would not
    be the model's); True, the model directory's own, where the checkpoint records none."""
    recorded = extra.get("tokenizer")
    if not (isinstance(recorded, dict) and isinstance(recorded.get("path"), str)):
        return True
    path = pathlib.Path(recorded["path"])
    if path.is_dir() and hf_tokenizer.holds(path, recorded.get("digest")):
        return path
    notes.append(f"the tokenizer {checkpoint} was trained with, {cut(str(path))}, has changed since or is gone: "
                 f"exported without a tokenizer; save the one it trained with into {cut(out)}")
    return False


def _check_fit(checkpoint: pathlib.Path, model: str, seq_len: int | None, *, given: bool) -> None:
    """The checkpoint's weights fit the GPT preset ``model`` names (at ``seq_len`` tokens where the run
    trained at other than the preset's), key for key and shape for shape; ``given``: the user named
    ``model`` (--model), rather than the checkpoint, which recorded it."""
    try:
        choice = choose(model, seq_len=seq_len)
    except ValueError:
        if given:
            raise
        raise ValueError(f"{checkpoint} records its model as {shown(model)}, which names no model shardwire "
                         f"builds: give --model") from None
    with torch.device("meta"):
        built = choice.build()
    with weights_in(checkpoint) as weights:  # its description only: no part is read
        problem = fit_problem(built, weights)
    if problem is not None:
        named = f"--model {cut(model)}" if given else f"the model it records, {cut(model)}"
        raise ValueError(f"the weights of {checkpoint} do not fit {named}: {problem}")
