"""What ``shardwire train --model`` names: a preset of the project's GPT, or ``hf:`` and a Hugging
Face causal LM.

``hf:`` takes a local directory or a JSON file or an inline JSON mapping. The model is built on
the meta device and made by ``shard`` a unit at a time, with random weights (``from_config``), so no
worker holds it whole; a directory holding safetensors then fills it, each worker reading only its
rows (``shardwire.models.pretrained``). Other weights (``pytorch_model.bin``) load whole on every
worker (``from_pretrained``). Only local files are read: training never downloads. Its sharding
units are the classes the model names in ``_no_split_modules``, the convention accelerate follows
for FSDP's auto-wrap (the transformer block: ``LlamaDecoderLayer``, ``GPT2Block``), unless
``--units`` names others.

A model directory is data, never code: every transformers call passes ``trust_remote_code=False``
(left unset, transformers asks on the terminal whether to run the Python files a config's
``auto_map`` names, and a ``y`` piped in runs them), and a model that needs such code is refused.
Its weights are checked before any worker starts (``_check_weights``): an index may name files of
the directory only, a file must be whole, and a pickle is read as ``weights_only`` reads it, which
runs no code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import pathlib
import pickle
import re
import warnings
import zipfile
from collections.abc import Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from shardwire.engine.selection import assign_params, select_units
from shardwire.extras import quietly_importing, require
from shardwire.launch import tells_the_user
from shardwire.mappings import MappingError, cut, one_line, read_file, read_mapping, shown
from shardwire.models import fp8, pretrained
from shardwire.models.gpt import GPT, PRESETS, Block
from shardwire.sim.huggingface import (HF_PREFIX, check_sizes, config_file, has_tokenizer, needs_custom_code,
                                       read_config, seq_len_of, spec_from_config)
from shardwire.sim.specs import ModelSpec

# The dtype an hf: model's parameters are built in, whatever its config's dtype says (a published
# config.json names the dtype its weights were saved in, bfloat16 mostly, and transformers builds in
# it): shardwire keeps fp32 master weights and computes in --precision, as it does for its own GPT.
MASTER_DTYPE = torch.float32
# The weights from_pretrained loads, the first of these a directory holds.
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# An index of a model's weight files: a few hundred kB for the largest published models.
_MAX_INDEX_BYTES = 64 << 20
# A file transformers reads whole from a model's or tokenizer's directory, by its kind: JSON (configs,
# tokenizer.json, vocab.json), text (merges.txt) or a SentencePiece model. The largest published, a
# tokenizer.json, is some 35 MB; a larger one is none of these, and would be read into memory whole
# (a sparse file of terabytes, for ever) before transformers said what is wrong with it.
_READ_WHOLE = (".json", ".txt", ".model")
_MAX_READ_WHOLE_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class ModelChoice:
    """How to build the model, what to shard it into, the sequences it trains on, and (where the
    FLOP count knows the architecture) its description for MFU."""

    name: str
    build: Callable[[], nn.Module]
    units: tuple[type[nn.Module], ...]
    seq_len: int
    vocab_size: int
    params: int
    spec: ModelSpec | None
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    # What initialises each module of the model built on the meta device (shard's ``init``, None: its
    # default), given the model; None where the model is built with its values (pretrained weights).
    init: Callable[[nn.Module], Callable[[nn.Module], None] | None] | None
    # the parameters a worker holds whole while it builds the model: the root unit's and the largest
    # unit's where it is made a unit at a time on the meta device, otherwise all of them
    held_whole: int
    # what fills the sharded model with pretrained weights, reading each rank's rows only, or None
    load: Callable[[nn.Module], None] | None = None
    # why its units have no linear layer to multiply in fp8 (shardwire.models.fp8), or None
    fp8_refusal: str | None = None
    # whether ``spec`` counts the model's FLOPs, for its MFU: not a mixture of experts' (``_of_experts``)
    counts_flops: bool = True
    # whether a forward runs on the meta device, where torch's FLOP counter cross-checks the count
    # at no cost (Hugging Face models read tensor values to build their attention masks)
    runs_on_meta: bool = True
    # the units that hold parameters, the root included: what ``shard`` makes and DiLoCo's fragments are dealt
    units_with_parameters: int = 1
    # what the user should know of the model chosen, said once as the run starts (rank 0's start line), or None
    note: str | None = None


def recorded_name(name: str) -> str:
    """``name`` as a checkpoint records it, to build the same model from anywhere later: an ``hf:``
    path made absolute (inline JSON and presets as they are)."""
    if not name.startswith(HF_PREFIX):
        return name
    source = pathlib.Path(name[len(HF_PREFIX):])
    try:
        return HF_PREFIX + str(source.resolve()) if source.exists() else name
    except OSError:  # longer than a path may be: inline JSON
        return name


def tokenizer_directory(name: str) -> pathlib.Path | None:
    """The directory of an ``hf:`` model that holds its tokenizer too (as ``save_pretrained`` writes
    both), or None."""
    if not name.startswith(HF_PREFIX):
        return None
    source = name[len(HF_PREFIX):]
    return pathlib.Path(source) if has_tokenizer(source) else None


def choose(name: str, *, units: str | None = None, seq_len: int | None = None) -> ModelChoice:
    """The model ``name`` names; ``units``: comma-separated class names to shard into instead of the
    model's own; ``seq_len``: tokens per sequence instead of the preset's (or, for ``hf:``, the
    smaller of the model's positions and 1024). Raises ``ValueError`` saying what to change."""
    if name.startswith(HF_PREFIX):
        return _hugging_face(name[len(HF_PREFIX):], units, seq_len)
    if name not in PRESETS:
        raise ValueError(f"--model {shown(name)} is neither a preset ({', '.join(sorted(PRESETS))}) nor hf:PATH_OR_JSON")
    if units is not None:
        raise ValueError("--units is for hf: models; the GPT presets shard into their blocks")
    config = PRESETS[name] if seq_len is None else dataclasses.replace(PRESETS[name], seq_len=seq_len)
    spec = config.spec(name)
    with torch.device("meta"):
        skeleton = GPT(config)
    return ModelChoice(f"GPT {name!r}", lambda: GPT(config), (Block,), config.seq_len, config.vocab_size,
                       _parameters(skeleton), spec, lambda model, tokens: model(tokens),
                       fp8_refusal=fp8.convertible(skeleton, (Block,))[1], init=lambda model: model.init_module,
                       held_whole=_held_while_made(skeleton, (Block,)),
                       units_with_parameters=_units_with_parameters(skeleton, (Block,)))


def _hugging_face(source: str, units: str | None, seq_len: int | None) -> ModelChoice:
    transformers = require("transformers", "--model hf:")
    config, weights = hf_config(transformers, source)
    auto = transformers.AutoModelForCausalLM

    by_slice = weights is not None and pretrained.reads_by_slice(weights)

    def build() -> nn.Module:
        with quietly_importing():  # transformers imports torchao where it is installed
            if weights is not None and not by_slice:
                return auto.from_pretrained(weights, config=config, local_files_only=True, trust_remote_code=False,
                                            dtype=MASTER_DTYPE)
            return auto.from_config(config, trust_remote_code=False, dtype=MASTER_DTYPE)

    try:
        with torch.device("meta"), quietly_importing(), _logged_by_transformers(logging.WARNING) as said:
            skeleton = auto.from_config(config, trust_remote_code=False, dtype=MASTER_DTYPE)
    except Exception as err:  # a config transformers cannot build, however it says so
        raise ValueError(f"hf:{cut(source)}: {custom_code(pathlib.Path(config_file(source))) or first_line(err)}") from None
    if any("is_decoder" in note for note in said):
        raise ValueError(f"hf:{cut(source)}: {type(skeleton).__name__} attends to the tokens after each one unless "
                         f"its config sets is_decoder, and would learn to copy the token it is to predict: add "
                         f"\"is_decoder\": true to the config")
    classes = {type(module).__name__: type(module) for module in skeleton.modules()}
    if units is not None:
        wanted = [unit.strip() for unit in units.split(",") if unit.strip()]
        if not wanted:
            raise ValueError(f"--units {units!r} names no class: give class names of the model's modules, "
                             f"such as its decoder layer, separated by commas")
    else:
        wanted = list(getattr(skeleton, "_no_split_modules", None) or ())
        if not wanted:
            raise ValueError(f"{type(skeleton).__name__} names no _no_split_modules to shard into: give --units "
                             f"with its block's class name")
    missing = [unit for unit in wanted if unit not in classes]
    if missing:
        raise ValueError(f"{type(skeleton).__name__} has no module of class {', '.join(missing)}: --units takes "
                         f"class names of its modules, such as its decoder layer")
    try:  # what shard() would refuse inside every worker: the model itself, or units inside units
        select_units(skeleton, [classes[unit] for unit in wanted])
    except ValueError as err:
        raise ValueError(f"--units {','.join(wanted)}: {err}") from None
    length = seq_len_of(config.to_dict(), seq_len)
    chosen = tuple(classes[unit] for unit in wanted)
    return ModelChoice(f"hf:{type(skeleton).__name__}", build, chosen, length, config.vocab_size,
                       _parameters(skeleton), _hf_spec(config, skeleton, length),
                       _logits_without_cache(skeleton), fp8_refusal=fp8.convertible(skeleton, chosen)[1],
                       counts_flops=not _of_experts(config), runs_on_meta=False,
                       init=None if weights is not None and not by_slice else lambda model: None,
                       held_whole=(_parameters(skeleton) if weights is not None and not by_slice
                                   else _held_while_made(skeleton, chosen)),
                       load=functools.partial(pretrained.load_pretrained, directory=weights) if by_slice else None,
                       units_with_parameters=_units_with_parameters(skeleton, chosen),
                       note=_custom_code_not_run(config, source, type(skeleton).__name__))


def _logits_without_cache(skeleton: nn.Module) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """The model's logits for a training forward, asking it for no KV cache where its forward takes
    ``use_cache``: training never reads one, and building it each forward holds memory and makes each
    compiled unit recompile for every layer (the cache's state per layer is guarded), past torch's
    limit of recompiles. The config is left as it is, so that an exported model still caches."""
    if "use_cache" in inspect.signature(type(skeleton).forward).parameters:
        return lambda model, tokens: model(tokens, use_cache=False).logits
    return lambda model, tokens: model(tokens).logits


def _parameters(model: nn.Module) -> int:
    """The elements of ``model``'s parameters (a tied weight once)."""
    return sum(p.numel() for p in model.parameters())


def _held_while_made(skeleton: nn.Module, units: tuple[type[nn.Module], ...]) -> int:
    """The parameters a worker holds whole while ``shard`` makes the meta-built ``skeleton`` a unit at
    a time: the root unit's (made last) and the largest unit's."""
    sizes = [_parameters(module) for _, module in select_units(skeleton, list(units))]
    return _parameters(skeleton) - sum(sizes) + max(sizes)


def _units_with_parameters(skeleton: nn.Module, units: tuple[type[nn.Module], ...]) -> int:
    """The units ``shard`` makes of ``skeleton`` that hold parameters, the root unit among them."""
    owned = assign_params(skeleton, [name for name, _ in select_units(skeleton, list(units))])
    return sum(bool(entries) for entries in owned.values())


# How configs of a mixture of experts count their experts (Mixtral's and Qwen-MoE's, DeepSeek's, DBRX's).
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok")


def _of_experts(config) -> bool:
    """Whether ``config`` is of a mixture of experts, whose FLOPs a dense count of its sizes leaves
    out (half Mixtral's at two experts a token): its spec sizes memory, but gives no MFU."""
    return any(config.to_dict().get(key) for key in _EXPERTS)


def _hf_spec(config, skeleton: nn.Module, seq_len: int) -> ModelSpec | None:
    """The decoder the config describes, for the FLOP count (a gated MLP where the model has
    ``gate_proj`` modules, or Phi-3's fused ``gate_up_proj``), or None where it names no sizes the
    simulator's reader knows."""
    gated = any(name.endswith(("gate_proj", "gate_up_proj")) for name, _ in skeleton.named_modules())
    try:
        return spec_from_config(config.to_dict(), name=f"hf:{type(skeleton).__name__}", seq_len=seq_len, gated=gated)
    except ValueError:
        return None


def hf_config(transformers, source: str):
    """(config, directory of weights or None) of ``source``: a directory, a JSON file or inline JSON."""
    what = f"hf:{cut(source)}"
    fields = read_config(source)  # within bounds first: transformers reads /dev/zero for ever
    try:
        check_sizes(fields)
        if os.path.isdir(source):
            check_files(pathlib.Path(source))
        if source.lstrip().startswith("{"):
            return config_from_fields(transformers, fields, what), None
        with transformers_notes(what):
            config = _buildable(fields, transformers.AutoConfig.from_pretrained(
                source, local_files_only=True, trust_remote_code=False))
    except Exception as err:  # transformers' errors for a config it cannot read vary
        raise ValueError(f"{what}: {custom_code(pathlib.Path(config_file(source))) or first_line(err)}") from None
    path = pathlib.Path(source)
    weights = next((path / name for name in _WEIGHTS if path.is_dir() and (path / name).exists()), None)
    if weights is not None:
        _check_weights(weights, what)
    return config, (path if weights is not None else None)


def config_fields(name: str) -> dict | None:
    """The config of the ``hf:`` model ``name`` as its source holds it (a directory's config.json, a
    config .json, inline JSON), for a checkpoint to record what it trained; None for a GPT preset."""
    if not name.startswith(HF_PREFIX):
        return None
    return read_config(name[len(HF_PREFIX):])


def config_from_fields(transformers, fields: dict, what: str = "the recorded config"):
    """The transformers config of ``fields``, a config.json's mapping (an inline config, or what a
    checkpoint recorded); a ``ValueError`` saying what is wrong with it. ``what``: the config, as
    transformers' warnings about it name it."""
    fields = dict(fields)
    if not fields.get("model_type"):
        raise ValueError("the config names no model_type: give the one its model is (llama, gpt2, ...)")
    if not isinstance(fields["model_type"], str) or fields["model_type"] not in transformers.CONFIG_MAPPING:
        raise ValueError(f"model_type {shown(fields['model_type'], 60)} is not one transformers "
                         f"{transformers.__version__} knows: give the one its model is (llama, gpt2, ...)")
    try:
        with transformers_notes(what):
            config = transformers.AutoConfig.for_model(fields.pop("model_type", ""), **fields)
    except Exception as err:  # transformers' errors for a config it cannot read vary
        raise ValueError(first_line(err)) from None
    return _buildable(fields, config)


@contextlib.contextmanager
def transformers_notes(what: str) -> Iterator[None]:
    """Say what transformers logs while it reads a config or a tokenizer (a bos_token_id outside the
    vocabulary; a tokenizer file it falls back from reading one way to another) as shardwire's
    warnings, naming what it read (``what``), and only in the process that tells the user
    (``launch.tells_the_user``): every rank reads the same files, and would repeat them once per
    rank. As warnings they are held with the command's own until its checks pass (a refusal is its one
    line alone). Within that process transformers says each one once, however often a config is read."""
    with _logged_by_transformers() as said:
        try:
            yield
        finally:
            for note in said if tells_the_user() else ():
                warnings.warn(one_line(f"{what}: {' '.join(note.split())}"), stacklevel=1)


@contextlib.contextmanager
def _logged_by_transformers(level: int | None = None) -> Iterator[list[str]]:
    """What transformers logs within the block, kept rather than printed: at the level it is at (a
    caller's ``quietly_importing`` may have raised it), or at ``level``."""
    logger = logging.getLogger("transformers")
    before, handlers = logger.level, logger.handlers
    notes = _Notes()
    logger.handlers = [notes]
    if level is not None:
        logger.setLevel(level)
    try:
        yield notes.said
    finally:
        logger.setLevel(before)
        logger.handlers = handlers


class _Notes(logging.Handler):
    """What transformers logs, kept to be said otherwise."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())


def _buildable(written: dict, config):
    """``config``, transformers' reading of the config file's ``written`` fields, if a model of it can
    be built at all (``check_sizes``)."""
    check_sizes(config.to_dict(), written)
    return config


# Keys of an hf: model's config.json that say who wrote it, not what it builds: a directory saved
# again by a newer transformers changes them, and the trained weights still fit it. auto_map names
# code that never runs here, and architectures a class: transformers' own causal LM of the model_type
# is built either way; the dtype its weights were saved in is not the one they train in (MASTER_DTYPE).
_CONFIG_BOOKKEEPING = ("transformers_version", "_name_or_path", "auto_map", "architectures", "dtype", "torch_dtype")
# The differences between two configs a message names, before saying how many more there are.
_DIFFERENCES_NAMED = 3


def config_difference(recorded: dict, now: dict) -> str | None:
    """The differences between the config a checkpoint ``recorded`` and the one its model's source
    holds ``now`` (``config_fields``), each as ``key before -> after``, the first
    ``_DIFFERENCES_NAMED`` of them and how many more; None where they build the same model. Each is
    compared as transformers reads it, its defaults filled in: a config that spells out a default
    (GPT-2's ``activation_function: gelu_new``) builds the same model; both in their own words where
    transformers cannot read one. A changed ``model_type`` is named first: the other differences
    follow from it."""
    read = _as_read(recorded), _as_read(now)
    if None not in read:
        recorded, now = read
    missing = object()
    keys = (recorded.keys() | now.keys()) - set(_CONFIG_BOOKKEEPING)
    differences = []
    for key in sorted(keys, key=lambda key: (key != "model_type", str(key))):
        before, after = recorded.get(key, missing), now.get(key, missing)
        if before != after:
            said = [("absent" if value is missing else shown(value, 60)) for value in (before, after)]
            differences.append(f"{str(key)[:60]} {said[0]} -> {said[1]}")
    if not differences:
        return None
    more = len(differences) - _DIFFERENCES_NAMED
    return ", ".join(differences[:_DIFFERENCES_NAMED]) + (f", and {more} more" if more > 0 else "")


def _as_read(fields: dict) -> dict | None:
    """``fields`` with the defaults transformers fills in, or None where it cannot read them."""
    try:
        with quietly_importing():
            return config_from_fields(require("transformers", "--model hf:"), fields).to_dict()
    except Exception:  # a config transformers refuses, however it says so, or no transformers
        return None


def check_files(directory: pathlib.Path) -> None:
    """Refuse a Hugging Face directory holding what is neither a regular file nor a directory, or a
    file transformers reads whole that is larger than any such file: transformers opens the files it
    finds, and a FIFO would block it for ever, a device or a huge file feed it without end. The one
    check before transformers reads a model's directory or a tokenizer's, naming the file."""
    for entry in directory.iterdir():
        if not (entry.is_file() or entry.is_dir()):
            raise ValueError(f"{entry.name} is not a regular file (a FIFO, a device, a broken link): a model's or "
                             f"tokenizer's directory holds files")
        size = entry.stat().st_size if entry.suffix in _READ_WHOLE and entry.is_file() else 0
        if size > _MAX_READ_WHOLE_BYTES:
            raise ValueError(f"{entry.name} is {size:,} bytes, more than {_MAX_READ_WHOLE_BYTES:,}, far more than any "
                             f"model's or tokenizer's {entry.suffix} file: is it damaged? save the model or tokenizer "
                             f"again")


def custom_code(config: pathlib.Path) -> str | None:
    """Why transformers refused a Hugging Face directory whose ``config`` (its ``config.json`` or
    ``tokenizer_config.json``) has an ``auto_map``: the Python files it names would have to run,
    which shardwire never lets them. None where the file names no code."""
    try:
        fields = read_mapping(read_file(config, config.name), config.name, unique=False)
    except MappingError:
        return None
    if not fields.get("auto_map"):
        return None
    instead = "a tokenizer whose class" if config.name == "tokenizer_config.json" else "a model whose architecture"
    return needs_custom_code(fields["auto_map"], named_in=config.name, instead=instead)


def _custom_code_not_run(config, source: str, built: str) -> str | None:
    """Where a config names custom code (an ``auto_map``) but its ``model_type`` is one transformers
    implements, transformers builds its own class, not the one the code defines: say so, since the
    two may differ (a model upstreamed from such code is usually the same)."""
    auto_map = getattr(config, "auto_map", None)
    if not auto_map:
        return None
    return (f"hf:{cut(source)} names custom code (auto_map {shown(auto_map, 60)}), which shardwire never runs: it "
            f"builds transformers' own {built} for model_type {config.model_type!r}")


def first_line(err: Exception) -> str:
    """An exception's message as one line of at most 300 characters, ending in ``...`` where cut
    (transformers' span several, and some say what is wrong on the line after a colon); a
    ``KeyError``, which says only the key, as the name transformers does not know; a config's check
    without the name of transformers' validator that wraps it."""
    if isinstance(err, KeyError) and err.args:
        return f"the config names {shown(err.args[0], 60)}, which transformers does not know: give one it does"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    said = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    said = re.sub(r"^Class validation error for validator '[^']*': \w+: ", "", said)
    return said if len(said) <= 300 else f"{said[:297]}..."


def _check_weights(weights: pathlib.Path, what: str) -> None:
    """Refuse the weights ``from_pretrained`` would load (``weights``: a file, or an index of files)
    where loading them would fail inside every worker or read outside the model's directory."""
    if weights.name.endswith(".index.json"):
        try:
            index = read_mapping(read_file(weights, f"{what}: {weights.name}", _MAX_INDEX_BYTES),
                                 f"{what}: {weights.name}", unique=False)
        except MappingError as err:
            raise ValueError(str(err)) from None
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{what}: {weights.name} has no weight_map of tensor names to file names: is it damaged?")
        files = sorted(set(weight_map.values()))
        outside = [f for f in files if f in ("", ".", "..") or pathlib.PurePath(f).name != f]
        if outside:
            raise ValueError(f"{what}: {weights.name} names {shown(outside[0])}, not a file of the model's directory: "
                             f"an index names the directory's own files")
        for name in files:
            _check_weights_file(weights.parent / name, what)
    else:
        _check_weights_file(weights, what)


def _check_weights_file(file: pathlib.Path, what: str) -> None:
    """Read what ``from_pretrained`` will read of ``file`` before it does: a safetensors header, or
    the pickle of a ``torch.save`` file, as ``weights_only`` reads it (no code runs), without its data."""
    if not file.is_file():
        problem = "is missing" if not file.exists() else "is not a regular file"
        raise ValueError(f"{what}: {file.name} {problem}: the model's weights are incomplete")
    try:
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt"):
                pass
        else:
            torch.load(file, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"{what}: {file.name} holds more than tensors ({first_line(err)[:120]}...), "
                         f"and shardwire runs no code from a model: save its weights as safetensors") from None
    except (SafetensorError, RuntimeError, OSError, EOFError, ValueError, zipfile.BadZipFile) as err:
        raise ValueError(f"{what}: {file.name} is damaged ({first_line(err)[:120]}): "
                         f"download or save the model again") from None
