"""``shardwire export CHECKPOINT OUT``: a checkpoint written as its model's own ecosystem reads it.

An ``hf:`` model becomes a ``save_pretrained`` directory that ``from_pretrained`` loads
(``shardwire.models.export``); a GPT preset, a plain state dict file (``OUT.safetensors``, or a
``torch.save`` file). The model is the one ``shardwire train`` recorded in the checkpoint, or
``--model``. It runs in one process, without a GPU, from a checkpoint of any world size.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from shardwire.engine.checkpoint import CheckpointError, export_state_dict, list_checkpoints
from shardwire.engine.checkpoint.portable import weights_in
from shardwire.engine.checkpoint.reader import CheckpointReader
from shardwire.models.choice import HF_PREFIX
from shardwire.models.export import save_pretrained


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a checkpoint (ckpt/step_00000400), or a --checkpoint-dir: its newest checkpoint")
    parser.add_argument("out", metavar="OUT",
                        help="hf: models: a new directory for save_pretrained; GPT presets: a .safetensors or .pt file")
    parser.add_argument("--model", help="the model the checkpoint holds, as train's --model names it (default: "
                                        "what shardwire train recorded in the checkpoint)")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        checkpoint = _one_checkpoint(pathlib.Path(args.checkpoint))
        with CheckpointReader(checkpoint) as reader:
            extra = reader.manifest.extra
        model = args.model or (extra.get("model") if isinstance(extra, dict) else None)
        if not isinstance(model, str):
            raise ValueError(f"{checkpoint} does not record its model (shardwire train records it): give --model")
        if model.startswith(HF_PREFIX):
            with weights_in(checkpoint) as weights:  # read and written a unit at a time
                out = save_pretrained(model, weights, args.out)
        else:
            out = export_state_dict(checkpoint, args.out)
    except (CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {checkpoint} ({model}) to {out}")
    return 0


def _one_checkpoint(path: pathlib.Path) -> pathlib.Path:
    """``path`` itself, or the newest checkpoint of the series it holds."""
    if not path.is_dir() or (path / "manifest.json").exists():
        return path
    series = list_checkpoints(path)
    if not series:
        raise ValueError(f"{path} holds no checkpoint: give one (ckpt/step_00000400) or a --checkpoint-dir")
    return series[-1]
