"""Optional dependencies: the core install is what training needs (torch, numpy, safetensors, tqdm);
plotting, YAML input and fp8 training are extras, imported only by the features that use them.

``require`` is how such a feature imports one: a missing package becomes a ``MissingExtra`` whose
message names the feature and the extra that installs it, which every command prints as a one-line
error instead of a traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import warnings
from collections.abc import Iterator
from types import ModuleType

# top-level package -> the extra of pyproject.toml that installs it
EXTRAS = {"matplotlib": "plots", "yaml": "yaml", "transformers": "hf", "tensorboard": "tensorboard",
          "torchao": "fp8"}


class MissingExtra(ImportError):
    """An optional package a feature needs is not installed; the message says which extra to install."""


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature`` (how the error names it), or raise ``MissingExtra``."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.partition(".")[0]
        extra = EXTRAS[package]
        raise MissingExtra(
            f"{feature} needs {package}, which is not installed: pip install 'shardwire[{extra}]'"
        ) from None


@contextlib.contextmanager
def quietly_importing() -> Iterator[None]:
    """Run the block without the warnings torchao gives as it loads: its logs about optional kernel
    libraries built for other GPUs or torch versions and about enums torch's pytree now takes, and
    Python's about its source, and transformers' own about a config's defaults as it builds a model.
    fp8 training imports torchao, and so does transformers building any model wherever torchao is
    installed; none of them concerns what shardwire runs."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree", "transformers")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    # transformers sets its own level as it is first imported, from this variable: inside the block too
    added = "TRANSFORMERS_VERBOSITY" not in os.environ
    if added:
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        if added:
            os.environ.pop("TRANSFORMERS_VERBOSITY", None)
