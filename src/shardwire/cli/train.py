"""``shardwire train``: check the job's settings, then start its workers or print how to.

Run as is, it starts ``--nproc`` local workers through torch's elastic launcher; under torchrun
(``torchrun --nnodes 2 --nproc-per-node 8 -m shardwire train --backend nccl``) this process is a
worker and runs the loop (``shardwire.training.loop``) in the launcher's world. Everything that can
be known wrong is refused here first, in one line, before any worker starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import warnings

import torch

from shardwire import worker
from shardwire.comm.wire import Wire
from shardwire.engine.checkpoint import list_checkpoints
from shardwire.engine.checkpoint.claim import leave_tidy
from shardwire.engine.checkpoint.series import group_series, series_problem, step_of
from shardwire.engine.diloco import DiLoCo
from shardwire.engine.fault_tolerance import FaultTolerance, check_fault_tolerance
from shardwire.engine.layout_plan import LayoutPlan
from shardwire.files import (CHECKPOINT_MANIFEST, checkpoint_problem, directory_problem, inside_problem,
                             leave_no_stage, missing_directories, new_directory_problem)
from shardwire.extras import require
from shardwire.launch import (
    host_memory_per_worker,
    launch_local,
    stopped,
    tells_the_user,
    torchrun_command,
    under_launcher,
)
from shardwire.mappings import cut, one_line
from shardwire.models import fp8
from shardwire.models import tokenizer as hf_tokenizer
from shardwire.models.choice import HF_PREFIX, ModelChoice, choose
from shardwire.options import (
    OptionError,
    SettingError,
    add_options,
    check_bounds,
    check_distinct_outputs,
    check_output_file,
    check_writable_directory,
    command_line,
    config_from,
    flag,
    given_as,
)
from shardwire.placement import launch_ranks_per_node
from shardwire.profile import PROFILE_FILE, TRACE_FILE
from shardwire.sim.architecture import architecture
from shardwire.sim.memory import activation_bytes
from shardwire.sim.specs import TrainingSpec
from shardwire.training.autoplan import unplannable
from shardwire.training.config import LAUNCH_OPTIONS, NEEDS, TrainConfig, is_given
from shardwire.training.data import check_default_corpus, read_as_text_problem
from shardwire.training.loop import run_tokenizer, train, trained_otherwise, training_corpus


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, TrainConfig)


def run(args: argparse.Namespace, argv: list[str], checked) -> int:
    """Launch local workers, print the launch command, or be a worker (``argv`` is not used: workers
    get the checked settings, not the command line and its config file)."""
    config = config_from(args, TrainConfig)
    _validate(config, given_as(args))
    checked()
    if config.print_launch:
        where = ("# on the node" if config.nnodes == 1 else f"# on each of the {config.nnodes} nodes; HEAD_ADDRESS: "
                                                             f"the first node's address, which every node must reach")
        print(f"{where}\n{_launch_command(config)}")
        return 0
    if not under_launcher():
        nproc = config.nproc or _local_workers(config)
        series, export = _series(config), config.export_hf
        missing = missing_directories(series) if series is not None else []
        missing_export = missing_directories(os.path.dirname(os.path.abspath(export))) if export else []
        try:
            return launch_local(nproc, _worker_arguments(config), max_restarts=config.max_restarts)
        except KeyboardInterrupt as err:
            said, status = stopped(err)
            if (finished := _finished(config)) is not None:  # the signal came as the workers were ending
                print(one_line(f"{said} as the run ended: {finished}"), file=sys.stderr)
                return 0
            print(one_line(f"{said}: {_what_was_saved(config)}"), file=sys.stderr)
            return status
        finally:  # workers a signal ended could not tidy what they claimed and never finished
            if series is not None:
                leave_tidy(series, missing)
            if export is not None:
                leave_no_stage(export, missing_export)
    try:
        train(config)
    except KeyboardInterrupt as err:
        said, status = stopped(err)
        if tells_the_user():  # under torchrun, whose agent does not say what was saved
            print(one_line(f"{said}: {_what_was_saved(config)}"), file=sys.stderr)
        return status
    return 0


def _series(config: TrainConfig) -> str | None:
    """The directory of the run's checkpoints: a fault-tolerant group's is its own, below
    --checkpoint-dir under the group's name."""
    if config.checkpoint_dir is None:
        return None
    fault_tolerance = FaultTolerance.parse(config.fault_tolerance)  # as _validate wrote it: the group named
    return (config.checkpoint_dir if fault_tolerance is None
            else os.path.join(config.checkpoint_dir, fault_tolerance.group))


def _what_was_saved(config: TrainConfig) -> str:
    """The newest checkpoint of the run's series."""
    if (series := _series(config)) is None:
        return "nothing was saved (no --checkpoint-dir)"
    saved = list_checkpoints(series)
    if not saved:
        return f"no checkpoint was saved in {series} yet"
    return f"{saved[-1]} is the newest checkpoint; running the same command again resumes from it"


def _finished(config: TrainConfig) -> str | None:
    """What a run that a signal stopped had finished, in words, where it had done all it was asked
    (its last step saved, its export in place), or None: such a run succeeded, and running it again
    would be refused, its export directory taken."""
    if (series := _series(config)) is None or not (saved := list_checkpoints(series)):
        return None
    if step_of(saved[-1]) != config.steps:
        return None
    if config.export_hf is not None:
        if not os.path.isdir(config.export_hf) or not any(os.scandir(config.export_hf)):
            return None
        return f"its {config.steps} steps are trained and saved in {saved[-1]}, and exported to {config.export_hf}"
    return f"its {config.steps} steps are trained and saved in {saved[-1]}"


def _launch_command(config: TrainConfig) -> str:
    """The torchrun command for ``--print-launch``."""
    _, per_node = _world_and_node_size(config)
    return torchrun_command(config.nnodes, per_node, _worker_arguments(config), max_restarts=config.max_restarts)


def _worker_arguments(config: TrainConfig) -> list[str]:
    """What the workers run: this job's options written back from the config, so that every worker
    trains what was checked here, with no config file to read again (or edited in the meantime)."""
    defaults = TrainConfig()
    changed = {f.name: getattr(config, f.name) for f in dataclasses.fields(TrainConfig)
               if f.name not in LAUNCH_OPTIONS and getattr(config, f.name) != getattr(defaults, f.name)}
    return ["train", *command_line(changed)]


def _local_workers(config: TrainConfig) -> int:
    """Workers on this machine by default: one per GPU with NCCL, else 2."""
    return torch.cuda.device_count() if worker.uses_cuda(config.backend) else 2


def _world_and_node_size(config: TrainConfig) -> tuple[int, int]:
    """The ranks the job will have, and on each node: with --print-launch, the cluster's; under a
    launcher, its; else the local workers'."""
    if config.print_launch:
        per_node = config.nproc_per_node or config.nproc or _local_workers(config)
        return config.nnodes * per_node, per_node
    if under_launcher():
        world = int(os.environ["WORLD_SIZE"])
        return world, launch_ranks_per_node(world)
    local = config.nproc or _local_workers(config)
    return local, local


def check_options(args: argparse.Namespace) -> None:
    """What ``--print-config`` checks before it prints: the settings, alone and together, and against
    the model they name, as a run checks them (a printed config runs, or fails as the command did);
    not this machine, where the config may never run."""
    config = config_from(args, TrainConfig)
    diloco, _ = _check_settings(config, given_as(args))
    _check_model(config, diloco, given_as(args))


def _validate(config: TrainConfig, given: dict[str, str]) -> None:
    """Everything that can be known wrong before a worker starts, as one line and exit status 1:
    ``--print-launch`` checks the settings alone (the model and the machine are the cluster's).
    ``given``: the flags renamed options were given under, for the errors to name."""
    diloco, fault_tolerance = _check_settings(config, given)
    if config.print_launch:
        return
    if fault_tolerance is not None:  # every worker of the group the same name and lighthouse
        config.fault_tolerance = str(fault_tolerance)
    _check_this_machine(config, fault_tolerance)
    choice = _check_model(config, diloco, given)
    if config.checkpoint_dir is not None and (another := trained_otherwise(config, choice.seq_len)) is not None:
        raise SystemExit(f"error: {another}")
    _check_memory(config, choice)
    _check_data(config, choice)


def _check_settings(config: TrainConfig, given: dict[str, str]) -> tuple[DiLoCo | None, FaultTolerance | None]:
    """The options' bounds and how they combine, nothing read from disk; returns --diloco and
    --fault-tolerance parsed."""
    try:
        check_bounds(config)
        if not config.print_launch and (config.nnodes != 1 or config.nproc_per_node is not None):
            given = "--nnodes" if config.nnodes != 1 else "--nproc-per-node"
            raise OptionError(f"{given} is for --print-launch, which prints the command for each node; to run "
                              f"here give --nproc, or add --print-launch")
        for said in (_without_what_they_need(config), _restarted_from_the_start(config)):
            if said is not None and tells_the_user():
                warnings.warn(said, stacklevel=1)
        launched = os.environ.get("LOCAL_WORLD_SIZE", "")
        if under_launcher() and config.nproc is not None and str(config.nproc) != launched and tells_the_user():
            here = f" ({launched} on this node)" if launched else ""
            warnings.warn(f"--nproc {config.nproc} is ignored: a launcher started these workers{here}; give the "
                          f"launcher its count (torchrun --nproc-per-node)", stacklevel=1)
        if config.lr * config.weight_decay >= 1:  # AdamW scales each weight by 1 - lr x weight decay a step
            raise OptionError(f"--weight-decay {config.weight_decay:g} with --lr {config.lr:g} would scale every "
                              f"weight by 1 - lr x weight decay = {1 - config.lr * config.weight_decay:.3g} at "
                              f"each step: give a weight decay below 1/lr ({1 / config.lr:.3g}), usually 0 to 0.1")
        if config.export_hf is not None and not config.print_launch:
            if not config.model.startswith(HF_PREFIX):
                raise OptionError(f"--export-hf writes a Hugging Face model, and --model {config.model} is a "
                                  f"GPT preset: export its checkpoint with shardwire export CKPT model.safetensors")
            # every other output the run writes: the export, a new directory, would no longer be one. It
            # may lie in a run or TensorBoard directory (the run's files there are named, and new); not in
            # a series of checkpoints, which would take it for one of its own (or set it aside)
            for option, path, beneath in (("--checkpoint-dir", config.checkpoint_dir, True),
                                          ("--run-dir", config.run_dir, False),
                                          ("--tensorboard", config.tensorboard, False),
                                          ("--log-jsonl", config.log_jsonl, False)):
                if path is not None and (_overlap(config.export_hf, path) if beneath
                                         else _within(path, config.export_hf)):
                    raise OptionError(f"--export-hf {config.export_hf} and {option} {path} overlap: the export "
                                      f"would hold what the run writes there, or replace it; give each a place "
                                      f"of its own")
        if (crossing := _among_checkpoints(config)) is not None:
            raise OptionError(crossing)
        if config.profile and config.run_dir is not None:  # the default run directory is a new one
            check_distinct_outputs([("--log-jsonl", config.log_jsonl),
                                    *((f"--run-dir {cut(config.run_dir)}'s {name}", os.path.join(config.run_dir, name))
                                      for name in (PROFILE_FILE, TRACE_FILE))])
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    try:
        Wire.parse(config.wire)
        diloco = DiLoCo.parse(config.diloco)  # warns for the keys every= and overlap=, renamed
        fault_tolerance = FaultTolerance.parse(config.fault_tolerance)
    except SettingError as err:
        raise SystemExit(f"error: {err.as_options(given)}") from None
    if config.plan != "none":
        if fault_tolerance is not None:
            raise SystemExit("error: --plan with --fault-tolerance: a fault-tolerant job's layout is fixed (hybrid, "
                             "one group, meeting the others at each sync or step); leave --plan out")
        if config.wire != "none" or diloco is not None:
            raise SystemExit(f"error: --plan {config.plan} chooses the wire and the syncs itself (auto: exact "
                             f"collectives; auto-lossy also weighs quantized wires and DiLoCo): leave out --wire and "
                             f"--diloco, or --plan")
    if fault_tolerance is not None and config.export_hf:
        raise SystemExit("error: --export-hf with --fault-tolerance: every group would write the same "
                         "directory; export one group's last checkpoint with shardwire export instead")
    try:
        world, per_node = _world_and_node_size(config)
        check_fault_tolerance(fault_tolerance, diloco, config.layout, config.shard_group_size, world)
        plan = LayoutPlan.make(config.layout, config.shard_group_size, world, per_node, diloco=diloco,
                               one_group=fault_tolerance is not None)
    except SettingError as err:  # the settings named as this command's options
        raise SystemExit(f"error: {err.as_options(given)}") from None
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    if (config.layout != "full" and config.shard_group_size is None and fault_tolerance is None and world > 1
            and plan.group == world and not under_launcher()):  # before the workers start (under a launcher, shard's)
        trains = ("one group, sharded as --layout full, whose --diloco outer step still applies at each sync with no "
                  "other group to average" if diloco is not None else "--layout full")
        warnings.warn(f"--layout {config.layout} shards within each node and replicates across nodes, and all "
              f"{world} ranks are on one node: it trains as {trains}; give --shard-group-size, or run on "
              f"several nodes (--nnodes)", stacklevel=1)
    return diloco, fault_tolerance


# Each option that ``NEEDS`` names, as the remedy writes it, and what a run without it does not do.
_WITHOUT = {"checkpoint_dir": ("--checkpoint-dir DIR", "saves no checkpoint"),
            "profile": ("--profile", "writes no profile")}


def _without_what_they_need(config: TrainConfig) -> str | None:
    """The options given that change nothing for want of the option they act beside (``--keep``
    without ``--checkpoint-dir``, ``--run-dir`` without ``--profile``), in one line; or None. Said, not
    refused: a run would otherwise end well having done nothing they asked, its user believing it
    checkpointed; but a script that always passes them, and the option they need only at times, runs."""
    for needed, (written, undone) in _WITHOUT.items():
        idle = [flag(name) for name, need in NEEDS.items() if need == needed and is_given(config, name)]
        if idle and not getattr(config, needed):
            names = " and ".join(idle)
            return (f"{names} {'is' if len(idle) == 1 else 'are'} for {flag(needed)}, and without it this run "
                    f"{undone}: give {written}, or leave out {names}")
    return None


def _restarted_from_the_start(config: TrainConfig) -> str | None:
    """``--max-restarts`` where a restart has nothing to resume from, in one line; or None. Restarted
    workers resume from the newest checkpoint, and without ``--checkpoint-dir`` there is none: a
    worker that fails at step 900 of 1000 trains the run again from step 0, and only the step numbers
    tell. Said, not refused (a short run may mean it); a fault-tolerant group rejoins with the state
    of the groups still training instead."""
    if config.max_restarts and config.checkpoint_dir is None and config.fault_tolerance == "none":
        return (f"--max-restarts {config.max_restarts} restarts failed workers from the newest checkpoint, and "
                f"without --checkpoint-dir this run saves none: a restart trains again from step 0; give "
                f"--checkpoint-dir DIR")
    return None


def check_outputs(args: argparse.Namespace) -> None:
    """What the job writes, checked where it runs on this machine's file system without its own
    launch (``shardwire testbed run``'s nodes): each worker would refuse it in turn."""
    config = config_from(args, TrainConfig)
    _check_outputs(config, FaultTolerance.parse(config.fault_tolerance))


def _check_this_machine(config: TrainConfig, fault_tolerance: FaultTolerance | None) -> None:
    """What this job writes, on this machine, and what it needs of it (a backend, GPUs, a compiler)."""
    _check_outputs(config, fault_tolerance)
    if (problem := worker.unavailable(config.backend)) is not None:
        raise SystemExit(f"error: {problem}")
    if config.precision == "fp8" and (problem := fp8.unavailable(config.backend)) is not None:
        raise SystemExit(f"error: {problem}")
    if config.nproc is not None and not under_launcher():
        if (problem := worker.missing_gpus(config.backend, config.nproc)) is not None:
            raise SystemExit(f"error: {problem}")
    if config.compile and (problem := _compiler_problem(config.backend)) is not None:
        raise SystemExit(f"error: {problem}")


def _check_outputs(config: TrainConfig, fault_tolerance: FaultTolerance | None) -> None:
    """What this job writes: its checkpoints, profile, logs and export, each where it may be written."""
    try:
        if config.checkpoint_dir is not None:
            # a checkpoint itself, or a DCP one, is named so before it is refused as lying in one, and
            # that before directory_problem writes a probe in it
            directory = config.checkpoint_dir
            if (problem := series_problem(directory) or checkpoint_problem(directory)
                    or directory_problem(directory)) is not None:
                raise OptionError(f"--checkpoint-dir {cut(directory)} {problem}")
            if fault_tolerance is not None and step_of(pathlib.Path(fault_tolerance.group)) is not None:
                raise OptionError(f"--fault-tolerance group={fault_tolerance.group} names the group's series under "
                                  f"--checkpoint-dir as a checkpoint of a series is named: give the group another name")
            if fault_tolerance is not None and fault_tolerance.group.startswith("."):
                # hidden names are the series' own (its claim, a save's staging)
                raise OptionError(f"--fault-tolerance group={fault_tolerance.group} names the group's series under "
                                  f"--checkpoint-dir with a hidden name, as a series names its own files: give the "
                                  f"group a name that does not begin with '.'")
            if fault_tolerance is None and (groups := group_series(directory)) and not list_checkpoints(directory):
                raise OptionError(
                    f"--checkpoint-dir {cut(directory)} holds series of checkpoints in its subdirectories "
                    f"({', '.join(cut(group) for group in groups[:4])}{', ...' if len(groups) > 4 else ''}), as "
                    f"fault-tolerant groups keep theirs, and none of its own: resume the groups with "
                    f"--fault-tolerance, give one series ({cut(os.path.join(directory, groups[0]))}), or give a "
                    f"directory of its own")
        if config.profile:
            check_writable_directory(config.run_dir or "runs", "--run-dir")
            if config.run_dir is not None:  # the default one is named for the time the run ends
                for name, kind in ((PROFILE_FILE, "profile"), (TRACE_FILE, "trace")):
                    check_output_file(os.path.join(config.run_dir, name), "--run-dir:", kind,
                                      "give another --run-dir")
        if config.tensorboard is not None:
            require("tensorboard", "--tensorboard")
            check_writable_directory(config.tensorboard, "--tensorboard")
        if config.log_jsonl is not None:
            check_output_file(config.log_jsonl, "--log-jsonl", "scalars")
        if config.export_hf is not None and (problem := new_directory_problem(config.export_hf)) is not None:
            raise OptionError(f"--export-hf {config.export_hf} {problem}")
        if (problem := _read_as_data(config) or _inside_the_model(config)) is not None:
            raise OptionError(problem)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None


def _check_model(config: TrainConfig, diloco: DiLoCo | None, given: dict[str, str]) -> ModelChoice:
    """The settings against the model they name, which is returned: it can be built, it has the units
    --diloco cuts into fragments, fp8 suits it, --plan can price it."""
    try:
        choice = choose(config.model, units=config.units, seq_len=config.seq_len)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    try:
        if diloco is not None:  # the units are known before any worker builds them
            diloco.check_units(choice.units_with_parameters)
    except SettingError as err:
        raise SystemExit(f"error: {err.as_options(given)}") from None
    if config.precision == "fp8" and choice.fp8_refusal is not None:
        raise SystemExit(f"error: --precision fp8: {choice.fp8_refusal}")
    if config.plan != "none" and (problem := unplannable(config)) is not None:
        raise SystemExit(f"error: {problem}")
    return choice


def _check_data(config: TrainConfig, choice: ModelChoice) -> None:
    """The corpus the job trains on is there and fits the model's vocabulary, and the tokenizer an
    ``--export-hf`` writes can be read."""
    memory = host_memory_per_worker(_world_and_node_size(config)[1])  # each worker reads a text corpus whole
    try:
        if config.data is None and config.tokenizer is None and not config.model.startswith(HF_PREFIX):
            check_default_corpus(choice.seq_len)  # bytes, which any GPT preset reads
        else:
            training_corpus(config, choice, memory).check_vocab(choice.vocab_size)
    except OSError as err:
        if err.strerror is None:  # a message of shardwire's own, about --data or the tokenizer
            raise SystemExit(f"error: {err}" if str(err).startswith(("--", "the tokenizer in"))
                             else f"error: --data: {err}") from None
        if err.filename:  # the system's words: the file is named here (the data's, or its tokenizer's)
            tokenizer = run_tokenizer(config)
            option, what = (("--tokenizer", "a tokenizer directory") if tokenizer is not None
                            and _within(str(err.filename), str(tokenizer[0])) else ("--data", "files"))
            raise SystemExit(f"error: {option}: {cut(err.filename)} cannot be read ({err.strerror}): give {what} you "
                             f"can read") from None
        raise SystemExit(f"error: --data {cut(config.data or '')} cannot be read ({err.strerror}): give a text file, "
                         f"a directory of them, or token ids you can read") from None
    except ValueError as err:  # a message not naming its option is about --data
        named = str(err).startswith(("--", "the tokenizer in"))  # run_tokenizer's words
        raise SystemExit(f"error: {err}" if named else f"error: --data: {err}") from None
    if config.export_hf and (tokenizer := run_tokenizer(config)) is not None:
        try:
            hf_tokenizer.load(*tokenizer)  # written beside the weights at the end, so read now
        except ValueError as err:
            raise SystemExit(f"error: --export-hf: {err}") from None


def _read_as_data(config: TrainConfig) -> str | None:
    """Why an output of the run would be read back as its data (``read_as_text_problem``), or None:
    its resume would be refused for a changed corpus, restart after restart."""
    return next((f"{option} {cut(path)} {problem}" for option, path, directory in
                 (("--export-hf", config.export_hf, True), ("--log-jsonl", config.log_jsonl, False))
                 if path is not None and (problem := read_as_text_problem(path, config.data, "the --data directory",
                                                                          directory=directory)) is not None), None)


def _inside_the_model(config: TrainConfig) -> str | None:
    """Why an output of the run would lie in the ``hf:`` model directory it reads (its config, its
    weights a slice at a time, its tokenizer), or None: an input is never written in."""
    model = config.model[len(HF_PREFIX):] if config.model.startswith(HF_PREFIX) else None
    if model is None or not os.path.isdir(model):
        return None
    written = [("--checkpoint-dir", config.checkpoint_dir), ("--export-hf", config.export_hf),
               ("--run-dir", config.run_dir if config.profile else None), ("--tensorboard", config.tensorboard),
               ("--log-jsonl", config.log_jsonl)]
    what = f"the model directory {config.model} reads, which the run never writes in"
    return next((f"{option} {cut(path)} {problem}" for option, path in written
                 if path is not None and (problem := inside_problem(path, model, what=what)) is not None), None)


def _among_checkpoints(config: TrainConfig) -> str | None:
    """Why a log or profile the run writes cannot go where it is given, or None: a path inside the
    series of --checkpoint-dir named as its checkpoints are (``step_...``) would be taken for one, or
    set aside by the save of that step, and lost; one named as a checkpoint's manifest would make the
    series a checkpoint (a run's first: ``files.checkpoint_problem`` refuses it in a series that has
    begun). Beside them (``ckpt/log.jsonl``) is a place of its own."""
    if (series := _series(config)) is None:
        return None
    for option, path, name in (("--run-dir", config.run_dir, "profile"), ("--tensorboard", config.tensorboard, "tb"),
                               ("--log-jsonl", config.log_jsonl, "log.jsonl")):
        if path is None:
            continue
        inside = os.path.relpath(os.path.realpath(path), os.path.realpath(series))
        if inside.split(os.sep)[0].startswith("step_"):
            return (f"{option} {cut(path)} is where --checkpoint-dir saves its checkpoints (step_...): a save "
                    f"would take it for one, or set it aside; give it a place beside them, such as "
                    f"{cut(os.path.join(series, name))}")
        if inside == CHECKPOINT_MANIFEST:
            return (f"{option} {cut(path)} is named as a checkpoint's manifest, in --checkpoint-dir's series, which "
                    f"would then be taken for a checkpoint itself: give it another name, such as "
                    f"{cut(os.path.join(series, name))}")
    return None


def _overlap(first: str, second: str) -> bool:
    """Whether one of two directories is, or is inside, the other."""
    return _within(first, second) or _within(second, first)


def _within(inner: str, outer: str) -> bool:
    """Whether ``inner`` is ``outer``, or inside it."""
    inner, outer = os.path.realpath(inner), os.path.realpath(outer)
    return os.path.commonpath([inner, outer]) == outer


def _compiler_problem(backend: str) -> str | None:
    """Why ``--compile`` cannot run here, or None: on the CPU, torch.compile's inductor builds each
    unit's kernels with a C++ compiler ($CXX, else g++), and without one every worker would fail at
    its first step with a traceback of its own."""
    if worker.uses_cuda(backend):
        return None
    from torch._inductor import config as inductor, cpp_builder, exc

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        searched = inductor.cpp.cxx if isinstance(inductor.cpp.cxx, (list, tuple)) else (inductor.cpp.cxx,)
        return (f"--compile on the CPU needs a C++ compiler, which torch.compile builds its kernels with, and "
                f"none was found (tried {', '.join(str(c) for c in searched if c)}): install one (or set CXX to "
                f"one), or leave out --compile")
    return None


def _check_memory(config: TrainConfig, choice: ModelChoice) -> None:
    """Refuse a job that cannot fit a worker of this machine, whatever else it holds: every worker
    holds part of the model whole in fp32 while it builds it (the root unit and its largest unit,
    where it is made a unit at a time on the meta device; all of it, where it loads pretrained
    weights), then keeps its share of the fp32 weights, gradients and Adam's two moments (16 bytes a
    parameter, over the world at most), and a micro-batch's activations: those the simulator's
    memory model counts (``shardwire.sim.memory.activation_bytes``) where it knows the architecture,
    the loss's logits in fp32 (``loss_fn``, a vocabulary's worth per token) among them."""
    world, local = _world_and_node_size(config)
    try:
        memory = worker.memory_per_worker(config.backend, local)
    except ValueError as err:
        raise SystemExit(f"error: {err}: start fewer (--nproc)") from None
    fewer = "" if worker.uses_cuda(config.backend) else ", or start fewer workers (--nproc)"
    held, shards, state = 4 * choice.held_whole, 4 * choice.params // world, 16 * choice.params // world
    logits = 4 * config.batch * choice.seq_len * choice.vocab_size
    activations = logits
    if choice.spec is not None:  # a sequence's, then the batch's (any batch: past the simulator's bounds too)
        sequence = TrainingSpec(precision=config.precision, activation_checkpointing=config.activation_checkpointing)
        activations = max(logits, config.batch * activation_bytes(architecture(choice.spec, sequence.compute_bytes),
                                                                  sequence))
    if held + shards > memory:
        how = ("on each worker that loads its pretrained weights whole" if choice.init is None else
               f"held whole on each worker while it builds its largest unit and root (on the meta device, a unit "
               f"at a time), beside {shards / 2**30:.3g} GiB of shards")
        raise SystemExit(
            f"error: {choice.name} has {choice.params:,} parameters, {held / 2**30:.3g} GiB of them in fp32 {how}, "
            f"more than each of the {local} workers here can hold ({memory / 2**30:.3g} GiB): "
            f"pick a smaller --model{fewer}")
    if state + activations > memory:
        raise SystemExit(
            f"error: --batch {config.batch} sequences of {choice.seq_len} tokens need {activations / 2**30:.3g} GiB "
            f"per worker for their activations (fp32 logits of {choice.vocab_size:,} per token among them) beside "
            f"{state / 2**30:.3g} GiB of the model's sharded state, more than each of the {local} workers here can "
            f"hold ({memory / 2**30:.3g} GiB): lower --batch (raising --grad-accum keeps the batch) or "
            f"--seq-len{fewer}")
