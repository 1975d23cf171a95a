"""The settings of a ``shardwire train`` job: one tree, declared once.

Each field of ``TrainConfig`` is an option of the command (``seq_len`` is ``--seq-len``) and a key of
its ``--config`` file (``shardwire.options`` makes both from the field), so the command line, the
file, the printed launch command and the planner's commands all speak of the same settings.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

from shardwire import worker
from shardwire.engine.diloco import DiLoCo, current_keys
from shardwire.engine.fault_tolerance import fault_tolerance_asked
from shardwire.engine.layout_plan import LAYOUTS
from shardwire.models.choice import recorded_name
from shardwire.models.gpt import PRESETS
from shardwire.options import MAX_TIMEOUT_S, option, text
from shardwire.renamed import RenamedWarning
from shardwire.sim.specs import MAX_PEAK_TFLOPS, MIN_PEAK_TFLOPS
from shardwire.training.data import BIN_DTYPES, MAX_SEED

# Micro-batches a step accumulates, or batches a validation reads: far beyond any recipe's (a step of
# more would take hours of any machine), so that a typo is refused rather than run for ever.
MAX_BATCHES = 2**16


@dataclasses.dataclass
class TrainConfig:
    """The job's settings; each is a ``shardwire train`` option (``seq_len`` is ``--seq-len``) and a
    key of its ``--config`` file."""

    model: str = option(
        "small", f"a GPT preset ({', '.join(sorted(PRESETS))}), or hf:PATH_OR_JSON: a Hugging Face causal LM "
                 f"from a local directory (its weights, if it holds them), a config .json or an inline JSON config")
    units: str | None = option(None, "hf: comma-separated module classes to shard into (default: the model's "
                                     "_no_split_modules, its transformer block)")
    seq_len: int | None = option(None, "tokens per sequence (default: the preset's; hf: the model's positions, "
                                       "at most 1024)", at_least=2)
    nproc: int | None = option(None, "local worker processes (default: one per visible GPU with NCCL, 2 on CPU; "
                                     "ignored under torchrun)", at_least=1)
    steps: int = option(400, "optimizer steps", at_least=1)
    batch: int = option(16, "sequences per rank and micro-batch", at_least=1)
    grad_accum: int = option(1, "micro-batches per step (all but the last under no_sync)", at_least=1,
                             at_most=MAX_BATCHES)
    lr: float = option(3e-3, "peak learning rate (warmup, then cosine)", above=0, float32=True)
    warmup: int = option(40, "warmup steps", at_least=0)
    weight_decay: float = option(0.1, "AdamW's weight decay of matrices (biases and norms get none)", at_least=0)
    clip: float = option(1.0, "max global gradient norm (0: off)", at_least=0)
    precision: str = option("fp32", "compute dtype (master weights stay fp32); fp8: bf16, with the units' linear layers "
                                    "multiplying in fp8 (torchao's float8 training)",
                            choices=("fp32", "bf16", "fp16", "fp8"))
    backend: str = option("auto", "auto: NCCL when CUDA is available, else gloo", choices=worker.BACKENDS)
    prefetch: int = option(2, "units gathered ahead of use", at_least=0)
    reshard: bool = option(True, "release each unit's parameters after forward and gather again for backward")
    layout: str = option(
        "full", "full: over every rank; hybrid: within groups, replicated across them; hybrid_secondary: full, "
                "with backward gathering within groups (ZeRO++ hpZ)", choices=LAYOUTS, renamed_from="sharding")
    shard_group_size: int | None = option(
        None, "ranks per shard group for the hybrid layouts (default: the ranks of a node)", at_least=1)
    wire: str = option(
        "none", "what crosses nodes: none, int8 (parameters and gradients), or key=value pairs such as "
                "params=int8,grads=int4,block=256 (only collectives that span nodes quantize)")
    diloco: str = option(
        "none", "hybrid layout: let the groups train apart and take DiLoCo's outer step on their averaged change "
                "every H steps (it changes the optimisation): none, or key=value pairs such as "
                "sync_every=20,wire=int4 (also fragments, outer_lr, momentum, fragment_sync_delay)",
        parse=lambda value: current_keys(text(value)), renamed_from="sync")
    fault_tolerance: str = option(
        "none", "with --layout hybrid: make this job one group of many that survive each other, meeting through a "
                "torchft lighthouse at each sync (--diloco) or at every step: none, or key=value pairs such as "
                "lighthouse=http://head:29510,group=node-3 (also min_groups, timeout in seconds); each group "
                "checkpoints under --checkpoint-dir/GROUP")
    plan: str = option(
        "none", "auto: before training, measure this cluster's collectives and a few steps of the job, and train "
                "with the layout, shard group, prefetch and resharding the simulator predicts fastest (exact "
                "collectives); auto-lossy: also weigh quantized wires and --diloco, which change the optimisation",
        choices=("none", "auto", "auto-lossy"))
    activation_checkpointing: bool = option(False, "recompute each unit's activations in backward")
    compile: bool = option(False, "compile each unit's forward with torch.compile (the first step compiles)")
    data: str | None = option(
        None, "text file or directory, read as bytes, or pre-tokenised ids: a flat .bin (nanoGPT's) or a .npy "
              "file (default: Python's stdlib sources)")
    token_dtype: str = option("uint16", "element type of a .bin --data file: nanoGPT's uint16, or uint32 for "
                                        "vocabularies past 65,536 (a .npy says its own)", choices=BIN_DTYPES)
    tokenizer: str | None = option(
        None, "a local Hugging Face tokenizer: tokenise the text --data once, with a progress bar, into a .npy "
              "beside it, and train on its ids", metavar="DIR")
    seed: int = option(0, "seed of the weights and the batches", at_least=0, at_most=MAX_SEED)
    log_every: int = option(10, "steps between progress updates (reading the loss waits for the GPU)", at_least=1)
    eval_batches: int = option(8, "validation batches per evaluation", at_least=1, at_most=MAX_BATCHES)
    eval_every: int = option(0, "steps between validation losses, shown as val in the progress line "
                                "(0: at the end only)", at_least=0)
    checkpoint_dir: str | None = option(None, "save checkpoints here; running again resumes from the newest good one")
    save_every: int = option(100, "with --checkpoint-dir: steps between checkpoints (the last step is always saved)",
                             at_least=1)
    keep: int = option(3, "with --checkpoint-dir: newest checkpoints to keep (0: all); while the loss is above its "
                          "lowest, as many more from before it", at_least=0)
    export_hf: str | None = option(None, "hf: models: at the end, write the trained model to this new directory as "
                                         "save_pretrained does (with the model's tokenizer)", metavar="DIR")
    max_restarts: int = option(0, "restart failed local workers this many times; they resume from the newest "
                                  "checkpoint", at_least=0)
    timeout: float = option(600.0, "seconds a collective may take before the job stops with an error naming it",
                            at_least=worker.MIN_TIMEOUT_S, real=True, unit="seconds", at_most=MAX_TIMEOUT_S)
    profile: bool = option(False, "profile every step; writes profile.json and trace.json to --run-dir")
    run_dir: str | None = option(None, "with --profile: its output directory (default runs/<date-time>)")
    peak_tflops: float | None = option(None, "with --profile: peak TFLOP/s per worker for MFU (default: a GPU's data "
                                             "sheet, or a matmul probe)", at_least=MIN_PEAK_TFLOPS, real=True,
                                       at_most=MAX_PEAK_TFLOPS, unit="TFLOP/s (each 1e12 FLOP/s)")
    tensorboard: str | None = option(
        None, "write loss, learning rate, tokens/s, step time, communication and exposed communication (and MFU "
              "with --profile) as TensorBoard scalars here, each log interval", metavar="DIR")
    log_jsonl: str | None = option(None, "append the same scalars to this file as JSON lines", metavar="FILE")
    print_launch: bool = option(False, "print the torchrun command that runs this job on each of --nnodes nodes, "
                                       "and exit")
    nnodes: int = option(1, "with --print-launch: nodes", at_least=1)
    nproc_per_node: int | None = option(None, "with --print-launch: workers per node (default: as --nproc)",
                                        at_least=1)


# The options that say where and how to start the workers, not what they train.
LAUNCH_OPTIONS = ("nproc", "max_restarts", "print_launch", "nnodes", "nproc_per_node")
# The options that act only beside another (-> the one they need), said without it: a --keep alone
# saves nothing while its user believes the run checkpoints. (--nnodes and --nproc-per-node, which
# need --print-launch, are refused in words of their own, ``shardwire.cli.train``.)
NEEDS = {"save_every": "checkpoint_dir", "keep": "checkpoint_dir", "run_dir": "profile", "peak_tflops": "profile"}
# The options that say what the job reports and keeps, which change nothing it trains.
_REPORTING_OPTIONS = ("log_every", "eval_batches", "eval_every", "checkpoint_dir", "save_every", "keep", "export_hf",
                      "timeout", "profile", "run_dir", "peak_tflops", "tensorboard", "log_jsonl")


def is_given(config: TrainConfig, name: str) -> bool:
    """Whether ``config`` sets the option ``name`` away from its default, as the user gave it on the
    command line or in a ``--config`` file. A default is not given, however it came: a file that
    ``--print-config`` wrote records every option, the defaults too, and runs as it was printed (so
    the default's own value, ``--keep 3``, passes as one, changing nothing)."""
    field = next(field for field in dataclasses.fields(TrainConfig) if field.name == name)
    return getattr(config, name) != field.default


def training_settings(config: TrainConfig) -> dict:
    """The settings that decide what a run trains: a checkpoint records them, and a run resuming from
    it says which of them it changes. Files and directories are recorded by their absolute paths, so
    that a command run from another directory (a resume, ``shardwire export`` refusing to write into
    the run's data) finds what the run read."""
    return {field.name: _recorded(field.name, getattr(config, field.name)) for field in dataclasses.fields(config)
            if field.name not in LAUNCH_OPTIONS + _REPORTING_OPTIONS}


def _recorded(name: str, value):
    """``value`` of the setting ``name`` as a checkpoint records it: a path made absolute."""
    return os.path.abspath(value) if name in ("data", "tokenizer") and isinstance(value, str) else value


def changed_settings(recorded: dict, config: TrainConfig) -> dict[str, tuple]:
    """Each setting ``config`` changes from those a checkpoint ``recorded``: name -> (recorded, now).
    A checkpoint saved before a setting's rename records it under its old name (``sync``, now
    ``diloco``, whose old keys ``every`` and ``overlap`` name the same settings as the new ones)."""
    renamed = {field.metadata["option"].renamed_from: field.name for field in dataclasses.fields(config)
               if "option" in field.metadata and field.metadata["option"].renamed_from}
    current = training_settings(config)
    changed = {}
    for name, value in recorded.items():
        name = renamed.get(name, name)
        if name in current and _comparable(name, current[name]) != _comparable(name, value):
            changed[name] = (value, getattr(config, name))  # this run's as given
    return changed


def recorded_seq_len(extra: dict) -> int | None:
    """The sequence length a checkpoint's run trained at, from what ``shardwire train`` recorded in
    the checkpoint's ``extra``: the ``--seq-len`` it was given, or a GPT preset's own where it was
    given none (a preset's position table has that many rows, so only a model made at that length
    fits its weights); None where that is not known (an ``hf:`` model's own length)."""
    settings = extra.get("settings")
    if not isinstance(settings, dict):
        return None
    seq_len = settings.get("seq_len")
    if isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len > 0:
        return seq_len
    model = extra.get("model")
    return PRESETS[model].seq_len if seq_len is None and isinstance(model, str) and model in PRESETS else None


def recorded_diloco(extra: dict) -> DiLoCo | None:
    """The ``--diloco`` a checkpoint's run recorded in its ``extra``, or None: none recorded, or none
    that reads. A renamed key the run was given was warned of as it ran, not again here."""
    settings = extra.get("settings")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return DiLoCo.parse(settings.get("diloco")) if isinstance(settings, dict) else None
    except (TypeError, ValueError):
        return None


def _comparable(name: str, value):
    """``value`` of the setting ``name`` as it trains: DiLoCo's settings, whatever their spelling; a
    file or directory (data, a tokenizer, an ``hf:`` model's), however its path is spelled, from the
    directory the run starts in (a relative path recorded by a run started elsewhere may name
    another file: the data's fingerprint tells); fault tolerance, whether it is asked for."""
    if name == "fault_tolerance":
        return fault_tolerance_asked(value)
    if name in ("data", "tokenizer") and isinstance(value, str):
        return os.path.realpath(value)
    if name == "model" and isinstance(value, str):
        return recorded_name(value)
    if name != "diloco" or not isinstance(value, str):
        return value
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RenamedWarning)
            return DiLoCo.parse(value)
    except (TypeError, ValueError):
        return value
