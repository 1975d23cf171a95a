"""Optional dependencies: the core install is what training needs (torch, numpy, safetensors, tqdm);
plotting and YAML input are extras, imported only by the features that use them.

``require`` is how such a feature imports one: a missing package becomes a ``MissingExtra`` whose
message names the feature and the extra that installs it, which every command prints as a one-line
error instead of a traceback.
"""

from __future__ import annotations

import importlib
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
