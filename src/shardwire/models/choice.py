"""What ``shardwire train --model`` names: a preset of the project's GPT, or ``hf:`` and a Hugging
Face causal LM.

``hf:`` takes a local directory or a JSON file or an inline JSON mapping. A directory holding
weights loads them (``from_pretrained``, local files only: training never downloads); a config
alone, in a directory or a file or inline (``{"model_type": "llama", "hidden_size": 256, ...}``),
builds the architecture with random weights (``from_config``). Its sharding units are the classes
the model names in ``_no_split_modules``, the convention accelerate follows for FSDP's auto-wrap
(the transformer block: ``LlamaDecoderLayer``, ``GPT2Block``), unless ``--units`` names others.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable

import torch
from torch import nn

from shardwire.extras import require
from shardwire.models.gpt import GPT, PRESETS, Block
from shardwire.sim.huggingface import HF_PREFIX, seq_len_of, spec_from_config
from shardwire.sim.specs import ModelSpec

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclasses.dataclass(frozen=True)
class ModelChoice:
    """How to build the model, what to shard it into, the sequences it trains on, and (where the
    FLOP count knows the architecture) its description for MFU."""

    name: str
    build: Callable[[], nn.Module]
    units: tuple[type[nn.Module], ...]
    seq_len: int
    vocab_size: int
    spec: ModelSpec | None
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    # whether a forward runs on the meta device, where torch's FLOP counter cross-checks the count
    # at no cost (Hugging Face models read tensor values to build their attention masks)
    runs_on_meta: bool = True


def recorded_name(name: str) -> str:
    """``name`` as a checkpoint records it, to build the same model from anywhere later: an ``hf:``
    path made absolute (inline JSON and presets as they are)."""
    if name.startswith(HF_PREFIX) and pathlib.Path(name[len(HF_PREFIX):]).exists():
        return HF_PREFIX + str(pathlib.Path(name[len(HF_PREFIX):]).resolve())
    return name


def tokenizer_directory(name: str) -> pathlib.Path | None:
    """The directory of an ``hf:`` model that holds its tokenizer too (as ``save_pretrained`` writes
    both), or None."""
    if not name.startswith(HF_PREFIX):
        return None
    path = pathlib.Path(name[len(HF_PREFIX):])
    return path if path.is_dir() and any((path / file).exists() for file in _TOKENIZER_FILES) else None


def choose(name: str, *, units: str | None = None, seq_len: int | None = None) -> ModelChoice:
    """The model ``name`` names; ``units``: comma-separated class names to shard into instead of the
    model's own; ``seq_len``: tokens per sequence instead of the preset's (or, for ``hf:``, the
    smaller of the model's positions and 1024). Raises ``ValueError`` saying what to change."""
    if name.startswith(HF_PREFIX):
        return _hugging_face(name[len(HF_PREFIX):], units, seq_len)
    if name not in PRESETS:
        raise ValueError(f"--model {name!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor hf:PATH_OR_JSON")
    if units is not None:
        raise ValueError("--units is for hf: models; the GPT presets shard into their blocks")
    config = PRESETS[name] if seq_len is None else dataclasses.replace(PRESETS[name], seq_len=seq_len)
    return ModelChoice(f"GPT {name!r}", lambda: GPT(config), (Block,), config.seq_len, config.vocab_size,
                       config.spec(name), lambda model, tokens: model(tokens))


def _hugging_face(source: str, units: str | None, seq_len: int | None) -> ModelChoice:
    transformers = require("transformers", "--model hf:")
    config, weights = hf_config(transformers, source)
    auto = transformers.AutoModelForCausalLM
    if weights is not None:
        build = lambda: auto.from_pretrained(weights, config=config, local_files_only=True)  # noqa: E731
    else:
        build = lambda: auto.from_config(config)  # noqa: E731
    with torch.device("meta"):
        skeleton = auto.from_config(config)
    classes = {type(module).__name__: type(module) for module in skeleton.modules()}
    wanted = units.split(",") if units else list(getattr(skeleton, "_no_split_modules", None) or ())
    if not wanted:
        raise ValueError(f"{type(skeleton).__name__} names no _no_split_modules to shard into: give --units "
                         f"with its block's class name")
    missing = [unit for unit in wanted if unit not in classes]
    if missing:
        raise ValueError(f"{type(skeleton).__name__} has no module of class {', '.join(missing)}: --units takes "
                         f"class names of its modules, such as its decoder layer")
    length = seq_len_of(config.to_dict(), seq_len)
    return ModelChoice(f"hf:{type(skeleton).__name__}", build, tuple(classes[unit] for unit in wanted), length,
                       config.vocab_size, _hf_spec(config, skeleton, length),
                       lambda model, tokens: model(tokens).logits, runs_on_meta=False)


def _hf_spec(config, skeleton: nn.Module, seq_len: int) -> ModelSpec | None:
    """The decoder the config describes, for the FLOP count (a gated MLP where the model has
    ``gate_proj`` modules), or None where it names no sizes the simulator's reader knows."""
    gated = any(name.endswith("gate_proj") for name, _ in skeleton.named_modules())
    try:
        return spec_from_config(config.to_dict(), name=f"hf:{type(skeleton).__name__}", seq_len=seq_len, gated=gated)
    except ValueError:
        return None


def hf_config(transformers, source: str):
    """(config, directory of weights or None) of ``source``: a directory, a JSON file or inline JSON."""
    path = pathlib.Path(source)
    try:
        if source.lstrip().startswith("{"):
            fields = json.loads(source)
            return transformers.AutoConfig.for_model(fields.pop("model_type", ""), **fields), None
        if not path.exists():
            raise ValueError(f"{source} does not exist: hf: takes a local directory, a config .json or inline JSON")
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(f"hf:{source}: {str(err).splitlines()[0]}") from None
    has_weights = path.is_dir() and any((path / name).exists() for name in _WEIGHTS)
    return config, (path if has_weights else None)
