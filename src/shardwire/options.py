"""A command's options, declared once on its configuration dataclass and checked before any worker
starts: one clear line for a bad value, and a non-zero exit, instead of a run that trains on nan or
a worker traceback after the work is done.

Each field of ``TrainConfig`` or ``BenchConfig`` that the user sets is an ``option``: its default,
help, bounds and parsing live on the field, and ``add_options`` makes the command line from them
(``--seq-len`` from ``seq_len``, ``--reshard/--no-reshard`` from a bool, ``--ops OP [OP ...]`` from
a list). ``command_line`` writes a configuration back as options, for the commands shardwire prints
(``--print-launch``, ``shardwire plan``). The numeric bounds are checked in one place
(``check_bounds``); so are paths the job will write to, so a directory that cannot be created is
found before training, not at the first checkpoint, and a device named as an output is refused
rather than replaced (``shardwire.files`` holds the policy for every file the project writes).

An option renamed keeps its old name for a release (``renamed_from``): given on the command line or
as a key of a ``--config`` file, the old name sets the option under its new one and warns, in one
line, before any worker starts; nothing after it (the workers' command line, ``--print-config``, a
checkpoint's record of the settings) speaks of the old name.

This is argparse underneath, and deliberately so: nccl-tests' short flags (``-b 1K -e 64M``), one-line
errors and a ``--help`` that imports nothing heavy matter more here than what a generator library adds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence

from shardwire.files import checkpoint_problem, directory_problem, rewrite_problem
from shardwire.mappings import cut, nearest, shown
from shardwire.renamed import warn_renamed


# The longest timeout a command or setting takes: a collective that takes a year has hung (and a
# timedelta, which a process group takes, holds no more than a billion days).
MAX_TIMEOUT_S = 365 * 24 * 3600
# A whole number an option may be, unless it says less: past it the job's arithmetic (a step count in
# float64, a seed or a size in int64) is no longer exact, long before any run could use it.
MAX_COUNT = 2**53
# float32's smallest normal number: a positive rate below it (a learning rate) is 0, or next to it,
# in the float32 arithmetic it feeds, so a run would train on and change nothing.
MIN_POSITIVE = 2.0**-126
# An integer as Python's ``int`` reads it: digits, a sign, underscores between digits, spaces around.
_INTEGER = re.compile(r"\s*[+-]?[0-9]+(?:_[0-9]+)*\s*")


def below_float32(value: float) -> str | None:
    """What a positive ``value`` that feeds float32 arithmetic must be, where it is not."""
    if 0 < value < MIN_POSITIVE:
        return f"at least {MIN_POSITIVE:.3g}, float32's smallest normal number (a smaller one is 0 in its arithmetic)"
    return None


class OptionError(ValueError):
    """A bad option; the message names it and says what it must be."""


class SettingError(ValueError):
    """A ``ValueError`` about settings that carries them as data, so that each caller names them as
    its users write them: ``str()`` as the library's keyword arguments (``layout='hybrid'``),
    ``as_options()`` as the command line's options (``--layout hybrid``). ``template`` holds a
    ``{placeholder}`` for each, and ``settings`` maps it to ``(setting, value)``, or to
    ``(setting,)`` for the setting's name alone."""

    def __init__(self, template: str, **settings: tuple):
        self.template = template
        self.settings = settings
        super().__init__(self._written(lambda name, *value: f"{name}={value[0]!r}" if value else name))

    def as_options(self, given: Mapping[str, str] | None = None) -> str:
        """The message with each setting named as an option; ``given``: the flag a renamed one was
        given under (``given_as``), so that ``--sync 3`` is refused as ``--sync``, not ``--diloco``."""
        def written(name, *value):
            option = (given or {}).get(name, flag(name))
            return f"{option} {value[0]}" if value else option
        return self._written(written)

    def _written(self, write) -> str:
        return self.template.format(**{key: write(*setting) for key, setting in self.settings.items()})


@dataclasses.dataclass(frozen=True)
class Bounds:
    at_least: float | None = None
    above: float | None = None
    real: bool = False  # a float: it must also be finite
    unit: str = ""
    at_most: int | None = None  # where a larger value cannot be held (a 64-bit seed, a timedelta)
    float32: bool = False  # it feeds float32 arithmetic, where a positive value must be a normal number

    def allows(self, value) -> bool:
        if value is None:  # an optional option left out
            return True
        if self.real and not math.isfinite(value):
            return False
        if self.float32 and below_float32(value) is not None:
            return False
        return ((self.at_least is None or value >= self.at_least) and (self.above is None or value > self.above)
                and (self.at_most is None or value <= self.at_most))

    def describe(self, value) -> str:
        """What the option must be, where ``value`` is outside the bounds."""
        if self.at_most is not None and value > self.at_most and (not self.real or math.isfinite(value)):
            return f"at most {self.at_most:,}{f' {self.unit}' if self.unit else ''}"
        if self.float32 and (needed := below_float32(value)) is not None:
            return needed
        if self.above == 0:
            text = "a positive, finite number" if self.real else "positive"
        elif self.above is not None:
            text = f"{'a finite number ' if self.real else ''}above {self.above:g}"
        elif self.at_least == 0 and self.real:
            text = "a non-negative, finite number"
        elif self.unit:
            return f"{'a finite number of ' if self.real else ''}{self.unit}, at least {self.at_least:g}"
        else:
            text = f"{'a finite number of ' if self.real else ''}at least {self.at_least:g}"
        return f"{text} of {self.unit}" if self.unit else text


@dataclasses.dataclass(frozen=True)
class Option:
    """How a configuration field appears on the command line."""
    help: str
    flags: tuple[str, ...] = ()  # short forms besides the long one, e.g. ("-b",)
    choices: Sequence[str] | None = None
    parse: Callable[[str], typing.Any] | None = None  # text -> value; default: the field's type
    metavar: str | None = None
    bounds: Bounds | None = None
    renamed_from: str | None = None  # the field's name before, still taken for a release, with a warning


def option(default=dataclasses.MISSING, help: str = "", *, factory: Callable[[], typing.Any] | None = None,
           flags: Sequence[str] = (), choices: Sequence[str] | None = None,
           parse: Callable[[str], typing.Any] | None = None, metavar: str | None = None,
           at_least: float | None = None, above: float | None = None, real: bool | None = None,
           unit: str = "", at_most: int | None = None, float32: bool = False,
           renamed_from: str | None = None) -> dataclasses.Field:
    """A configuration field that is a command-line option: ``default`` (or ``factory`` for a list),
    its ``help``, and the bounds its value must lie within (``real``: a float, also finite; by
    default, whether ``default`` is one; ``float32``: one that feeds float32 arithmetic);
    ``renamed_from``: its name before a rename."""
    bounds = None
    if at_least is not None or above is not None or at_most is not None:
        real = isinstance(default, float) if real is None else real
        bounds = Bounds(at_least, above, real, unit, at_most if at_most is not None or real else MAX_COUNT,
                        float32)
    metadata = {"option": Option(help, tuple(flags), choices, parse, metavar, bounds, renamed_from)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def add_options(parser: argparse.ArgumentParser, config_class: type) -> None:
    """An option on ``parser`` for each ``option`` field of the dataclass ``config_class``."""
    hints = typing.get_type_hints(config_class)
    defaults = config_class()
    for field in dataclasses.fields(config_class):
        spec = field.metadata.get("option")
        if spec is None:
            continue
        kind = _without_none(hints[field.name])
        kwargs = {"dest": field.name, "default": getattr(defaults, field.name), "help": spec.help}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            if typing.get_origin(kind) is list:
                kwargs["nargs"] = "+"
                kind = typing.get_args(kind)[0]
            kwargs["type"] = spec.parse or (text if kind is str else kind)
            kwargs["choices"] = spec.choices
            kwargs["metavar"] = spec.metavar
        if spec.renamed_from is None:
            parser.add_argument(*spec.flags, flag(field.name), **kwargs)
            continue
        parser.add_argument(*spec.flags, flag(field.name), **kwargs, action=RenamedTo)
        # hidden: the help speaks of the new name alone
        parser.add_argument(flag(spec.renamed_from), **{**kwargs, "help": argparse.SUPPRESS,
                                                         "default": argparse.SUPPRESS}, action=Renamed)


# The namespace's records of the name each renamed option was given under (its dest -> the flag): on
# the command line, and as a --config file's key, which the command line overrides.
_SPELLED = "renamed options as given"
_SPELLED_IN_FILE = "renamed options as a config file gives them"


class RenamedTo(argparse.Action):
    """The new name of a renamed option: stores its value, refusing it where the old name set the
    same option on the same command line (one of the two values would be lost silently)."""

    def __call__(self, parser, namespace, values, option_string=None):
        _set_under_one_name(parser, namespace, self.dest, values, option_string)


class Renamed(argparse.Action):
    """An option's name before a rename: sets the option under its new name (``dest``), and warns;
    refused beside the new name, whichever comes first."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.old = option_strings[0].removeprefix("--").replace("-", "_")

    def __call__(self, parser, namespace, values, option_string=None):
        warn_renamed(f"{option_string} is renamed {flag(self.dest)}")
        _set_under_one_name(parser, namespace, self.dest, values, option_string)


def given_as(args: argparse.Namespace) -> dict[str, str]:
    """The flag each renamed option was given under (its dest to ``--sync``): on the command line, or
    as a config file's key (``sync:``), named as the option it sets, as the file's other keys are."""
    return {**getattr(args, _SPELLED_IN_FILE, {}), **getattr(args, _SPELLED, {})}


def given_in_file(parser: argparse.ArgumentParser, dest: str, key: str) -> None:
    """Record that a config file sets the renamed option ``dest`` under its old key ``key``, for
    ``given_as`` to name it so (the file's values reach the parser as its defaults)."""
    spelled = {**(parser.get_default(_SPELLED_IN_FILE) or {}), dest: flag(key)}
    parser.set_defaults(**{_SPELLED_IN_FILE: spelled})


def _set_under_one_name(parser, namespace, dest: str, values, option_string: str) -> None:
    """Set ``dest``, unless the option was given under its other name before (a one-line error)."""
    spelled = namespace.__dict__.setdefault(_SPELLED, {})
    earlier = spelled.setdefault(dest, option_string)
    if earlier != option_string:
        old, new = sorted((earlier, option_string), key=lambda name: name == flag(dest))
        parser.error(f"{old} and {new} are the same option ({old} is its name before a rename): give {new} alone")
    setattr(namespace, dest, values)


def text(value: str) -> str:
    """A text option's value, which must name something: an empty one (``--checkpoint-dir ""``, a
    variable that was not set) would be taken for the current directory, or for no option at all."""
    return _named(value, "give one, or leave the option out")


def spec_text(value: str) -> str:
    """The value of an option that names a spec or describes it: a preset's name, a file, or a JSON or
    YAML mapping inline. Read as ``text``; a config file may give the mapping itself, nested, for this
    option alone (``shardwire.cli.config_file``)."""
    return text(value)


def argument_text(value: str) -> str:
    """A positional argument's value, which must name something as ``text``'s does; there is no
    option to leave out, so the message asks for the value alone."""
    return _named(value, "give one (a variable that was not set?)")


def _named(value: str, remedy: str) -> str:
    if not value:
        raise argparse.ArgumentTypeError(f"an empty value names nothing: {remedy}")
    if "\0" in value:  # the system refuses it in a path ("embedded null byte"), and nothing is named so
        raise argparse.ArgumentTypeError(f"{shown(value)} holds a NUL character, which no name or path holds: give it "
                                         f"without")
    return value


class NotANumber(argparse.ArgumentTypeError, ValueError):
    """A number the command line cannot read; the message shows it and says what it must be. Raised as
    argparse's error for a value (its message as it is) and as a ``ValueError`` to readers of settings."""


def whole_number(value: str) -> int:
    """An integer as the command line, a ``--config`` file and a setting (``--diloco sync_every=20``)
    write it: ASCII digits, with a sign. Python's ``int`` also reads the digits of other scripts
    (``١٠``, ``１０``), which would run a job on a value the user may not have meant, unseen."""
    return _number(value, int, "an integer")


def real_number(value: str) -> float:
    """A number as ``whole_number``'s, with a fraction or an exponent (``3e-4``), or ``inf``/``nan``
    (which bounds refuse by name): ASCII alone, as ``float`` reads more."""
    return _number(value, float, "a number")


def _number(value: str, kind: type, what: str):
    """``value`` read by ``kind``; a number too large to read is said so, as written: Python reads no
    integer of over 4,300 digits, and ``float`` reads one past its range (``1e400``) as infinity,
    which the user did not write."""
    if not value.strip():  # an unset variable (``--steps "$STEPS"``), which names no number
        raise NotANumber(f"an empty value is not {what}: give one (a variable that was not set?)")
    if not value.isascii():
        raise NotANumber(f"{shown(value)} is not {what} in ASCII digits (0-9)")
    try:
        number = kind(value)
    except ValueError:
        if _INTEGER.fullmatch(value):
            digits = sum(map(str.isdigit, value))
            raise NotANumber(f"{shown(value)} is too large a number ({digits:,} digits)") from None
        raise NotANumber(f"{shown(value)} is not {what}") from None
    if isinstance(number, float) and math.isinf(number) and "inf" not in value.lower():
        raise NotANumber(f"{shown(value)} is too large a number (past {sys.float_info.max:.3g})")
    return number


# What reads a number of each type from text, wherever the command line's words or a setting's values
# become numbers: the commands' parsers, ``--config`` files and ``settings_fields``.
NUMBER_READERS: Mapping[type, Callable[[str], typing.Any]] = {int: whole_number, float: real_number}


def config_from(args: argparse.Namespace, config_class: type, **others):
    """The ``config_class`` that parsed ``args`` describe; ``others`` gives its fields that are not options."""
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_class) if "option" in f.metadata}
    return config_class(**options, **others)


def command_line(values: Mapping[str, typing.Any]) -> list[str]:
    """Options that set each field of ``values`` (``None``: left out, as unset)."""
    argv = []
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag(name) if value else "--no-" + flag(name)[2:])
        elif isinstance(value, list):
            argv += [flag(name), *map(str, value)]
        else:
            argv += [flag(name), str(value)]
    return argv


def _without_none(hint):
    """``int`` for ``int | None``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return hint


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_bounds(config) -> None:
    """Raise ``OptionError`` for the first field of the dataclass ``config`` outside its bounds."""
    for field in dataclasses.fields(config):
        bounds = field.metadata["option"].bounds if "option" in field.metadata else None
        value = getattr(config, field.name)
        if bounds is not None and not bounds.allows(value):
            raise OptionError(f"{flag(field.name)} must be {bounds.describe(value)}, got {shown(value)}")


def check_writable_directory(path: str, option: str) -> None:
    """``path`` is a directory the job can write in, or one it can create, outside any checkpoint."""
    if (problem := checkpoint_problem(path) or directory_problem(path)) is not None:  # no probe in a checkpoint
        raise OptionError(f"{option} {cut(path)} {problem}")


def check_output_file(path: str, option: str, kind: str, instead: str = "give another file name") -> None:
    """``path`` names a regular file the job can write as a result of ``kind`` (``shardwire.files``'
    policy: one it can create, or an earlier result of that kind); else the user is asked to give
    ``instead``."""
    if (problem := rewrite_problem(path, kind, instead)) is not None:
        raise OptionError(f"{option} {cut(path)} {problem}")


def check_distinct_outputs(outputs: list[tuple[str, str | None]]) -> None:
    """Refuse two of a command's output files (each named by what writes it: ``--json``, ``--run-dir
    runs/a's profile.json``) that are one file: the second written would replace the first, without
    a word. None for an output not asked for."""
    seen: dict[str, str] = {}
    for what, path in outputs:
        if path is None:
            continue
        if (first := seen.setdefault(os.path.realpath(path), what)) != what:
            raise OptionError(f"{first} and {what} name one file, {cut(path)}: the second written would replace "
                              f"the first; give each a file of its own")


def setting_error(setting: str, text: str) -> SettingError:
    """An error about the setting named ``setting`` (``wire``, ``diloco``): ``text`` follows its name,
    which is written as the caller's users write it (``wire`` or ``--wire``); the user's values in
    ``text`` are taken as they are, braces and all."""
    return SettingError("{setting} " + text.replace("{", "{{").replace("}", "}}"), setting=(setting,))


def settings_fields(text: str, types: Mapping[str, Callable[[str], typing.Any]], *, setting: str, remedy: str,
                    bad_value: Callable[[str, str], str], twice: Callable[[str], str],
                    renamed: Mapping[str, str] | None = None) -> tuple[dict[str, typing.Any], list[str]]:
    """The fields of ``setting`` given in the command line's form, comma-separated ``key=value`` pairs
    (``--diloco sync_every=20,wire=int4``), each value read by ``types[key]`` (``int`` and ``float`` as
    ``NUMBER_READERS`` read them); and the keys given by
    an old name in ``renamed`` (old -> new), read as the new one. A pair that is not one raises a
    ``setting_error`` saying the text is not understood and ``remedy``, a value its type refuses one
    saying ``bad_value(key, value)``, a key given twice (under either name) one saying ``twice(key)``.
    The user's text and values reach the messages cut short (``shown``): they may be of any length."""
    fields: dict[str, typing.Any] = {}
    old_names = []
    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if sep and renamed and key in renamed:
            old_names.append(key)
            key = renamed[key]
        if not sep or key not in types:
            meant = nearest(key, [*types, *(renamed or ())]) if sep else None
            raise setting_error(setting, f"{shown(text)} is not understood: {remedy}"
                                         f"{f' (did you mean {meant}?)' if meant else ''}")
        if key in fields:  # the last would win silently, over a value the user also meant
            raise setting_error(setting, twice(key))
        if not value:  # an unset variable ($GROUP), which must not fall back to a default silently
            raise setting_error(setting, f"{key}= has no value: give one, or leave {key} out")
        try:
            fields[key] = NUMBER_READERS.get(types[key], types[key])(value)
        except ValueError:
            raise setting_error(setting, bad_value(key, shown(value))) from None
    return fields, old_names
