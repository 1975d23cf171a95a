"""``--config FILE`` and ``--print-config``, for every command: option values kept in a file.

A config file is a mapping from a command's long options to their values, in YAML (with the ``yaml``
extra) or JSON::

    # shardwire train --config job.yaml --steps 50
    model: 125m
    seq_len: 512          # or seq-len: --seq-len without its dashes
    layout: hybrid
    reshard: false        # a switch takes true or false
    lr: 3e-3

Its values become the parser's defaults, so an option given on the command line wins over the file
wherever it stands. They are read and checked as the command line's are: a choice must be one of the
choices, a number must read as one (``3e-3`` too, which YAML 1.1 reads as text; ``010`` is ten, not
YAML 1.1's octal eight, and ``1:30`` is no number, not its sexagesimal 90), a size may be ``64M``, a
switch is true or false, a spec option (``options.spec_text``: ``--cluster``) takes its mapping nested,
and a key that is no option of the command is an error naming the nearest one (a key that is an
option's name before a rename sets the option and warns, for a release).
``--print-config`` prints the options the command would run with, in this form: a file to start
from, or a record of a run; first it runs the checks the command makes of them before any work
(``check_options``, ``shardwire.cli``), so a combination a run refuses is refused here too.

Both are taken out of the arguments before the command's parser reads them, so they work for every
command and subcommand alike, and a command that relaunches itself as workers passes ``--config`` on
to them with the rest.
"""

from __future__ import annotations

import argparse
import json

from shardwire.extras import require
from shardwire.mappings import MappingError, nearest, read_file, read_mapping, shown
from shardwire.options import NUMBER_READERS, Renamed, given_in_file, spec_text
from shardwire.renamed import warn_renamed

CONFIG, PRINT = "--config", "--print-config"


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and what to change."""


def add_help(parser: argparse.ArgumentParser) -> None:
    """List the two options in ``parser``'s help. They never reach the parser (``split`` takes them
    out), except as an abbreviation, which is refused rather than silently ignored."""
    group = parser.add_argument_group("configuration file")
    group.add_argument(CONFIG, metavar="FILE", action=_WrittenInFull, default=argparse.SUPPRESS,
                       help="read option values from this YAML or JSON file; options given here win over it")
    group.add_argument(PRINT, nargs=0, action=_WrittenInFull, default=argparse.SUPPRESS,
                       help="print the options this command would run with, as a config file, and exit")


class _WrittenInFull(argparse.Action):
    written_in_full = True  # an abbreviation is not read as it (shardwire.cli._Parser)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"write {self.option_strings[0]} in full")


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, bool]:
    """``argv`` parsed by ``parser`` over the values of its ``--config`` file, if it names one; and
    whether ``--print-config`` was given."""
    path, printing, options = split(argv)
    if path is not None:
        apply(parser, path)
    return parser.parse_args(options), printing


def split(argv: list[str]) -> tuple[str | None, bool, list[str]]:
    """(the ``--config`` file, whether ``--print-config`` was given, the other arguments). What follows
    ``--`` belongs to another program (``shardwire testbed run -- ...``) and is left alone."""
    path, printing, rest = None, False, []
    words = iter(argv)
    for word in words:
        if word == "--":
            rest += [word, *words]
        elif word == PRINT:
            printing = True
        elif word == CONFIG or word.startswith(CONFIG + "="):
            if path is not None:
                raise ConfigError(f"{CONFIG} is given twice: give one file")
            path = word.partition("=")[2] if "=" in word else next(words, None)
            if not path:
                raise ConfigError(f"{CONFIG} needs a file: {CONFIG} FILE")
        else:
            rest.append(word)
    return path, printing, rest


def apply(parser: argparse.ArgumentParser, path: str) -> None:
    """Make the values of the config file at ``path`` the defaults of ``parser`` (and of those of its
    subcommands that have the option)."""
    where = f"{CONFIG} {path}"
    try:  # numbers as written: the options' own parsers read them, as they read the command line
        content = read_file(path, where)
        values = read_mapping(content, where, numbers_as_text=True)
        if any(isinstance(value, dict) for value in values.values()):  # a spec's mapping, its numbers as numbers
            typed = read_mapping(content, where)
            values.update({key: value for key, value in typed.items() if isinstance(value, dict)})
    except MappingError as err:
        raise ConfigError(str(err)) from None
    options = _options(parser)
    given: dict[str, str] = {}  # each option the file sets -> the key that sets it
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name not in options:
            raise ConfigError(f"{where}: {shown(key)} is not an option of {parser.prog}{_nearest(name, options)}")
        for sub, action in options[name]:
            if action.dest in given:
                raise ConfigError(f"{where}: {given[action.dest]} and {key} set the same option: keep one")
            if isinstance(action, Renamed):
                warn_renamed(f"{where}: {key} is renamed {action.dest.replace('_', '-')}")
                given_in_file(sub, action.dest, name)
            sub.set_defaults(**{action.dest: _converted(action, value, f"{where}: {key}")})
            action.required = False
        given.update({action.dest: str(key) for _, action in options[name]})


def dump(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The options in ``args`` as a config file for ``parser``'s command."""
    yaml = require("yaml", PRINT)
    options = _options(parser)
    values = {key: value for key, value in vars(args).items() if key in options}
    return (f"# {parser.prog} {CONFIG} FILE reads this; options given with it win over it\n"
            + yaml.safe_dump(values, sort_keys=False))


def _options(parser: argparse.ArgumentParser) -> dict[str, list[tuple[argparse.ArgumentParser, argparse.Action]]]:
    """Each option a config file may set -> the parsers (the command's, its subcommands') that have it."""
    options: dict[str, list] = {}
    parsers = [parser]
    while parsers:
        current = parsers.pop()
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += action.choices.values()
            elif isinstance(action, Renamed):
                options.setdefault(action.old, []).append((current, action))
            elif action.option_strings and not isinstance(action, (argparse._HelpAction, _WrittenInFull)):
                options.setdefault(action.dest, []).append((current, action))
    return options


def _nearest(key: str, options) -> str:
    meant = nearest(key, options, cutoff=0.6)
    return f"; did you mean {meant!r}?" if meant else f"; its options are {', '.join(options)}"


def _converted(action: argparse.Action, value, where: str):
    """``value`` from the file as the command line would give the option: parsed, in its choices."""
    if value is None:
        if action.default is None and not action.required:
            return None
        raise ConfigError(f"{where}: give a value, not null")
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: a switch is true or false, got {shown(value)}")
        return value
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
        if not items and action.nargs == "+":
            raise ConfigError(f"{where}: give at least one value")
        return [_converted_item(action, item, where) for item in items]
    return _converted_item(action, value, where)


def _converted_item(action: argparse.Action, value, where: str):
    if isinstance(value, dict) and action.type is spec_text:  # the mapping as the command line gives it inline
        return json.dumps(value, default=str)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{where}: give a value as the command line takes it, got {shown(value)}")
    if action.type is None:
        converted = str(value)
    else:
        try:  # a number as the command line reads it
            converted = NUMBER_READERS.get(action.type, action.type)(str(value))
        except argparse.ArgumentTypeError as err:
            raise ConfigError(f"{where}: {err}") from None
        except ValueError:
            raise ConfigError(f"{where}: {shown(value)} is not a valid value") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(f"{where}: {shown(value)} is not one of {', '.join(map(str, action.choices))}")
    return converted
