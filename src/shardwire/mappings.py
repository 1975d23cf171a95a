"""Reading a mapping a user wrote, as JSON or YAML: config files (``--config``) and the simulator's
specs (``--model``, ``--cluster``, ``--training``, inline or in a file) read it the same way."""

from __future__ import annotations

import json
from collections.abc import Mapping

from shardwire.extras import require


class MappingError(ValueError):
    """Text that is not a JSON or YAML mapping; the message names where it came from and why."""


def read_mapping(text: str, what: str) -> dict:
    """A JSON mapping, or a YAML one (with the ``yaml`` extra): YAML is read only where JSON fails.
    ``what`` names the text in errors (``--config job.yaml``, ``inline cluster``)."""
    try:
        data = json.loads(text)
    except ValueError:
        yaml = require("yaml", f"{what}, which is not JSON,")
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise MappingError(f"{what} is neither JSON nor YAML: {_one_line(err)}") from None
    if not isinstance(data, Mapping):
        raise MappingError(f"{what} must be a mapping of keys to values, got {type(data).__name__}")
    return dict(data)


def _one_line(err) -> str:
    """A YAML error, which spans several lines with a picture of where, as one line."""
    problem, mark = getattr(err, "problem", None) or str(err), getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return " ".join(problem.split()) + where
