"""A trained model written where its own ecosystem reads it.

A Hugging Face model (``--model hf:...``) becomes a ``save_pretrained`` directory: its weights as
safetensors, ``config.json``, and the tokenizer of its directory where it has one, so that
``AutoModelForCausalLM.from_pretrained(directory)`` (and ``AutoTokenizer``) load it as any other.
The weights come whole, from ``shardwire.full_state_dict`` of the live model or from a checkpoint
(``shardwire.engine.checkpoint.portable.read_state_dict``); the architecture is built on the meta
device and takes them by assignment, so exporting needs no second copy of the model.

The directory appears whole or not at all: it is written beside the target under a temporary name
and renamed into place, and a target that exists and is not empty is refused rather than replaced.
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile

import torch

from shardwire.extras import require
from shardwire.models.choice import HF_PREFIX, hf_config, tokenizer_directory


def save_pretrained(model_name: str, state: dict[str, torch.Tensor], directory: str | pathlib.Path) -> pathlib.Path:
    """Write the ``hf:`` model ``model_name`` with the weights ``state`` (the unsharded state dict) as
    a ``save_pretrained`` directory, with its tokenizer where its directory has one; returns the
    directory. Raises ``ValueError`` saying what to change."""
    if not model_name.startswith(HF_PREFIX):
        raise ValueError(f"--model {model_name!r} is not a Hugging Face model: a save_pretrained directory is "
                         f"for hf: models (export a GPT preset as a .safetensors or .pt file)")
    directory = pathlib.Path(directory)
    check_new_directory(directory)
    transformers = require("transformers", "exporting a Hugging Face model")
    config, _ = hf_config(transformers, model_name[len(HF_PREFIX):])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    try:
        model.load_state_dict(state, assign=True, strict=True)
    except RuntimeError as err:
        raise ValueError(f"the weights do not fit {type(model).__name__}: {str(err).splitlines()[0]}") from None
    model.tie_weights()
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".partial"))
    try:
        model.save_pretrained(staging)
        tokenizer = tokenizer_directory(model_name)
        if tokenizer is not None:
            transformers.AutoTokenizer.from_pretrained(
                tokenizer, local_files_only=True, trust_remote_code=False).save_pretrained(staging)
        staging.rename(directory)  # replaces an empty directory, atomically
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def check_new_directory(directory: pathlib.Path) -> None:
    """``directory`` can take an export: absent, or an empty directory (nothing of the user's in it)."""
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise ValueError(f"{directory} exists and is not a directory: give a new directory to export to")
    if directory.is_dir() and any(directory.iterdir()):
        raise ValueError(f"{directory} is not empty: give a new directory to export to (nothing is overwritten)")
