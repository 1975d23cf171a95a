"""A command's options checked before any worker starts: one clear line for a bad value, and a
non-zero exit, instead of a run that trains on nan or a worker traceback after the work is done.

Each numeric bound is declared on the configuration's field (``bounded``) and checked in one place
(``check_bounds``); paths the job will write to are checked here too, so a directory that cannot be
created is found before training, not at the first checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import os


class OptionError(ValueError):
    """A bad option; the message names it and says what it must be."""


@dataclasses.dataclass(frozen=True)
class Bounds:
    at_least: float | None = None
    above: float | None = None
    real: bool = False  # a float: it must also be finite
    unit: str = ""

    def allows(self, value) -> bool:
        if value is None:  # an optional option left out
            return True
        if self.real and not math.isfinite(value):
            return False
        return (self.at_least is None or value >= self.at_least) and (self.above is None or value > self.above)

    def describe(self) -> str:
        if self.above == 0:
            text = "a positive, finite number" if self.real else "positive"
        elif self.above is not None:
            text = f"{'a finite number ' if self.real else ''}above {self.above:g}"
        elif self.at_least == 0 and self.real:
            text = "a non-negative, finite number"
        else:
            text = f"{'a finite number of ' if self.real else ''}at least {self.at_least:g}"
        return f"{text} of {self.unit}" if self.unit else text


def bounded(default, *, at_least: float | None = None, above: float | None = None, real: bool | None = None,
            unit: str = "") -> dataclasses.Field:
    """A configuration field whose value must lie within the bounds (``real``: a float, also finite;
    by default, whether ``default`` is one)."""
    real = isinstance(default, float) if real is None else real
    return dataclasses.field(default=default, metadata={"bounds": Bounds(at_least, above, real, unit)})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_bounds(config) -> None:
    """Raise ``OptionError`` for the first field of the dataclass ``config`` outside its bounds."""
    for field in dataclasses.fields(config):
        bounds = field.metadata.get("bounds")
        value = getattr(config, field.name)
        if bounds is not None and not bounds.allows(value):
            raise OptionError(f"{flag(field.name)} must be {bounds.describe()}, got {value}")


def check_writable_directory(path: str, option: str) -> None:
    """``path`` is a directory the job can write in, or one it can create."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise OptionError(f"{option} {path} is a file; give it a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise OptionError(f"{option} {path} is not writable; give a directory you can write in")
        return
    existing = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise OptionError(f"{option} {path} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OptionError(f"{option} {path} cannot be created: {existing} is not writable")


def check_output_file(path: str, option: str) -> None:
    """``path`` names a file the job can write (not a directory) in a directory that exists."""
    if os.path.isdir(path):
        raise OptionError(f"{option} {path} is a directory; give a file name")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise OptionError(f"{option} {path}: the directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OptionError(f"{option} {path}: the directory {directory} is not writable")
