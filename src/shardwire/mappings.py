"""Reading a mapping a user wrote, as JSON or YAML: config files (``--config``) and the simulator's
specs (``--model``, ``--cluster``, ``--training``, inline or in a file) read it the same way.

Whatever the input, reading it is bounded and says what is wrong in one line:

* a file is read up to a size limit (``--config /dev/zero`` would otherwise read forever), a FIFO
  without a writer as empty (it would otherwise block), and it must be UTF-8 text;
* YAML's aliases may not expand the document past ``MAX_VALUES`` values: a few hundred bytes of
  nested aliases (a "billion laughs") describe billions of them, and printing one in an error
  message alone would run for minutes;
* numbers read as the command line reads them: YAML 1.1 reads ``010`` as 8 (octal) and ``1:30`` as
  90 (sexagesimal) where ``--steps 010`` is 10, so a number is Python's ``int`` or ``float`` of the
  text as written, and text that those read otherwise (``1:30``, ``0x10``) is refused;
* a value shown in an error message is cut short (``shown``).

A JSON document a command wrote (a profile, bench results) is read the same way (``read_json``), to a
bound of its own: such a document grows with the steps and ranks it records.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import reprlib
import stat
from collections.abc import Mapping

from shardwire.extras import require
from shardwire.files import kind_of

# A thousand times the longest config file or spec: a bound on the time and memory a typo can take.
MAX_TEXT_BYTES = 1 << 20
# A profile holds about 1 KB per rank and step: 256 MiB is 10,000 steps of 25 ranks, far beyond the
# few steps a profile needs, and a document of that size still parses in a few GB of memory.
MAX_JSON_BYTES = 256 << 20
# Values in a document once its YAML aliases are expanded, likewise far beyond any config or spec.
MAX_VALUES = 100_000
_YAML_NUMBERS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
# A number in exponent form that YAML 1.1 leaves as text: without a dot (1e12), or an unsigned
# exponent (1.5e3, .5e3)
_EXPONENT = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")
_YAML_SPECIAL_FLOATS = {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}


class MappingError(ValueError):
    """Text that is not a JSON or YAML mapping; the message names where it came from and why."""


def read_file(path: str, what: str, limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of the file at ``path``, read no further than ``limit`` bytes. ``what`` names
    it in errors (``--config job.yaml``)."""
    if os.path.isdir(path):  # which open refuses in words of its own
        raise MappingError(f"{what} is a directory, not a file: give the file that holds it")
    try:
        # opened without waiting for a writer, so that a FIFO nobody writes to reads as empty instead of
        # blocking for ever; then read as usual (process substitution's pipe has its writer)
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):  # /dev/zero: no end to read to
                raise MappingError(f"{what} is {kind_of(path)}, not a file: give the file that holds it")
            os.set_blocking(f.fileno(), True)
            data = f.read(limit + 1)
            pipe = stat.S_ISFIFO(mode)
    except OSError as err:
        raise MappingError(f"{what}: {err.strerror or err}") from None
    if not data and pipe:
        raise MappingError(f"{what} is a FIFO that nothing was written to: give a file, or write the text into it "
                           f"as it is read")
    if len(data) > limit:
        raise MappingError(f"{what} is larger than {limit:,} bytes, far more than any file of its kind holds: "
                           f"check that the path names the file meant")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise MappingError(f"{what} is not UTF-8 text (byte {err.start:,} is {data[err.start]:#04x}): "
                           f"save it as UTF-8") from None


def read_json(path: str, what: str, *, kind: str, remedy: str, limit: int = MAX_JSON_BYTES) -> dict:
    """The JSON mapping in the file at ``path``, a ``kind`` of document a command wrote (a profile),
    read as ``read_file`` reads: a file edited, damaged or of another tool is refused in one line
    naming it (``what``) and ending with ``remedy``, whatever its size, encoding or depth."""
    text = read_file(path, what, limit)
    if not text.strip():  # a file cut to nothing, or a pipe nothing was written to
        raise MappingError(f"{what} is empty; {remedy}")
    try:
        data = json.loads(text, parse_int=_whole_number)
    except RecursionError:
        raise MappingError(f"{what} nests deeper than a {kind} does; {remedy}") from None
    except _TooLong as err:
        raise MappingError(f"{what} holds a number of {err.digits:,} digits, more than any {kind} holds; "
                           f"{remedy}") from None
    except ValueError as err:
        raise MappingError(f"{what} is not JSON ({err}); {remedy}") from None
    if not isinstance(data, Mapping):
        raise MappingError(f"{what} holds a JSON {type(data).__name__}, not a {kind}; {remedy}")
    return data


class _TooLong(ValueError):
    """A number of more digits than any document holds (``_MOST_DIGITS``)."""

    def __init__(self, digits: int):
        super().__init__(digits)
        self.digits = digits


# The most digits of a whole number a document holds: a float (every reader's arithmetic) holds up
# to 309, and no count, size or time of any document comes near.
_MOST_DIGITS = 300


def _whole_number(text: str) -> int:
    """JSON's whole number ``text``, or ``_TooLong`` where it has more digits than any document
    holds: one past a float's range overflows a reader's arithmetic, one past Python's own bound
    would be refused in words that name its setting."""
    digits = len(text.lstrip("-"))
    if digits > _MOST_DIGITS:
        raise _TooLong(digits)
    return int(text)


def read_mapping(text: str, what: str, *, numbers_as_text: bool = False, unique: bool = True) -> dict:
    """A JSON mapping, or a YAML one (with the ``yaml`` extra): YAML is read only where JSON fails.
    ``what`` names the text in errors (``--config job.yaml``, ``inline cluster``). With
    ``numbers_as_text`` a YAML number stays the text it was written as, for a reader that parses
    text itself (a config file's values go to the command line's own parsers). ``unique``: a key
    given twice is refused (the user's own files); without it the last wins, as other tools read
    the files they wrote (a Hugging Face config)."""
    if len(text) > MAX_TEXT_BYTES:
        raise MappingError(f"{what} is longer than {MAX_TEXT_BYTES:,} characters, far more than any config or "
                           f"spec: give the mapping itself")
    as_text = (lambda number: number) if numbers_as_text else None  # as written: 1e2 stays 1e2, not 100.0
    try:
        data = json.loads(text, object_pairs_hook=(lambda pairs: _unique(pairs, what)) if unique else None,
                          parse_int=as_text, parse_float=as_text, parse_constant=as_text)
    except MappingError:
        raise
    except RecursionError:
        raise MappingError(f"{what} nests deeper than it can be read: flatten it") from None
    except ValueError:
        data = _read_yaml(text, what, numbers_as_text, unique)
    if data is None:
        raise MappingError(f"{what} is empty: give a mapping of keys to values")
    if not isinstance(data, Mapping):
        raise MappingError(f"{what} must be a mapping of keys to values in JSON or YAML, got {type(data).__name__}")
    return dict(data)


def _unique(pairs: list[tuple[str, object]], what: str, where: str = "") -> dict:
    """A JSON object's (or YAML mapping's) pairs as a dict, refusing a key given twice: readers keep
    the last silently, where the user meant one of the two."""
    found = {}
    for key, value in pairs:
        if key in found:
            raise MappingError(f"{what}: {shown(key)}{where} is given twice (the last would win silently): give it "
                               f"once")
        found[key] = value
    return found


def is_number(value) -> bool:
    """A JSON or YAML number: ``true`` is a Python ``int`` too, and no count, time or size."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def shown(value, limit: int = 80) -> str:
    """``repr(value)`` within about ``limit`` characters, for error messages: a value from a file
    can be as large as the file, or, through YAML's aliases, far larger."""
    bounded = reprlib.Repr()  # its limits as attributes: keyword arguments came only in Python 3.12
    bounded.maxlevel = 2
    bounded.maxstring = bounded.maxlong = bounded.maxother = limit
    short = bounded.repr(value)
    return short if len(short) <= limit else short[:limit - 3] + "..."


# Control characters as a line shows them: by their escapes (a tab is white space, and stays).
_SHOWN_CONTROLS = {code: ("\\n" if code == 10 else "\\r" if code == 13 else f"\\x{code:02x}")
                   for code in (*range(32), 127) if code != 9}


def one_line(text: str) -> str:
    """``text`` as one line prints it: a line break it holds came from what the user gave (a path, a
    value), and is shown as ``\\n``, so that a message, or a line naming a path, stays one line; any
    other control character (an escape sequence in a file's name, which a terminal would act on) is
    shown by its code, ``\\x1b``."""
    return text.translate(_SHOWN_CONTROLS)



_LONGEST_WORD = 200  # a path of ten directories of twenty characters


def refusal(text: str) -> str:
    """An error's ``text`` as the command line says it: one line (``one_line``), each word of more
    than ``_LONGEST_WORD`` characters cut short (``cut``). What the user gave reaches a message in
    many ways (a path, a value, argparse's "unrecognized arguments"), and any of them may be as long
    as the command line allows; a remedy the message gives holds no such word but the user's."""
    return re.sub(rf"\S{{{_LONGEST_WORD + 1},}}", lambda word: cut(word.group()), one_line(text))


class Missing(LookupError):
    """A document lacks a field, or holds something else where a mapping should be; the message
    says which, by its dotted path (``summary.figures``)."""


def field(document, *keys: str):
    """``document[keys[0]][keys[1]]...``, or ``Missing`` naming the first key absent or the first
    level that is not a mapping: a document edited or of another tool is reported by what it lacks,
    not by Python's words for a failed lookup."""
    value = document
    for depth, key in enumerate(keys):
        if not isinstance(value, Mapping):
            where = ".".join(keys[:depth])
            raise Missing(f"its {where} is {json_kind(value)}, not a mapping" if where else
                          f"it is {json_kind(value)}, not a mapping")
        if key not in value:
            raise Missing(f"it has no {'.'.join(keys[:depth + 1])}")
        value = value[key]
    return value


def json_kind(value) -> str:
    """What a value read from JSON or YAML is, in words, for a message that says what was expected."""
    kinds = ((type(None), "null"), (bool, "a boolean"), ((int, float), "a number"), (str, "a string"),
             (list, "a list"), (Mapping, "a mapping"))
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def nearest(word: str, known, *, cutoff: float = 0.75) -> str | None:
    """The one of ``known`` (names of options, settings or keys) that ``word`` is likely a slip of, or
    None: what every "did you mean ...?" of a refusal names."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=cutoff)
    return close[0] if close else None


def cut(text: str, limit: int = 120) -> str:
    """``text`` as the user gave it (a path, inline JSON), within ``limit`` characters: its start and
    its end around ``...``, for error messages."""
    if len(text) <= limit:
        return text
    half = (limit - 3) // 2
    return f"{text[:half]}...{text[-half:]}"


def _read_yaml(text: str, what: str, numbers_as_text: bool, unique: bool):
    yaml = require("yaml", f"{what}, which is not JSON,")

    def number(loader, node):
        """A YAML number as the command line reads it: the value, or with ``numbers_as_text`` the text
        its parsers take (YAML's ``.inf`` as ``inf``)."""
        if node.value.lower() in _YAML_SPECIAL_FLOATS:
            special = _YAML_SPECIAL_FLOATS[node.value.lower()]
            return repr(special) if numbers_as_text else special
        if not numbers_as_text and (digits := sum(map(str.isdigit, node.value))) > _MOST_DIGITS:
            raise MappingError(f"{what}: {shown(node.value)}{_where(node.start_mark)} has {digits:,} digits, more "
                               f"than any value takes: write the value itself")
        for kind in (int, float):
            try:
                value = kind(node.value)
            except ValueError:
                continue
            return node.value if numbers_as_text else value
        raise MappingError(
            f"{what}: {shown(node.value)}{_where(node.start_mark)} is a YAML 1.1 number that the command line "
            f"reads otherwise (YAML reads 1:30 as 90 and 0x10 as 16): write it in decimal, or quote it as text")

    try:
        loader = yaml.SafeLoader(text)  # its reader refuses characters YAML does not allow
        # this loader's own constructors (the class's are shared by every SafeLoader)
        loader.yaml_constructors = {**loader.yaml_constructors, **{tag: number for tag in _YAML_NUMBERS}}
        # YAML 1.1 reads 1e12 as text (its floats have a dot), where JSON and the command line read a number
        loader.yaml_implicit_resolvers = {first: [*([("tag:yaml.org,2002:float", _EXPONENT)] if first in "+-.0123456789"
                                                    else []), *resolvers]
                                          for first, resolvers in loader.yaml_implicit_resolvers.items()}
        if numbers_as_text:
            loader.yaml_constructors["tag:yaml.org,2002:timestamp"] = lambda loader, node: node.value
        mapping = loader.yaml_constructors["tag:yaml.org,2002:map"]

        def unique_mapping(loader, node):  # keys written twice; a merge (<<) may override, as YAML says
            written = set()
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    if (key.tag, key.value) in written:
                        _unique([(key.value, None)] * 2, what, _where(key.start_mark))
                    written.add((key.tag, key.value))
            return mapping(loader, node)

        if unique:
            loader.yaml_constructors["tag:yaml.org,2002:map"] = unique_mapping
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_expansion(node, what)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        raise MappingError(f"{what} is neither JSON nor YAML: {_yaml_problem(err)}") from None
    except RecursionError:
        raise MappingError(f"{what} nests deeper than it can be read: flatten it") from None


def _check_expansion(root, what: str) -> None:
    """Refuse a YAML document whose aliases expand it past ``MAX_VALUES`` values, or refer to a
    collection from inside itself. Each node's expanded size is counted once (an alias is the same
    node object as its anchor), so the count costs the size of the text, not of the expansion."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()  # the collections being counted: the path from the root
    stack = [(root, False)]
    while stack:
        node, counted = stack.pop()
        children = _children(node)
        if counted:
            open_nodes.discard(id(node))
            sizes[id(node)] = min(1 + sum(sizes[id(child)] for child in children), MAX_VALUES + 1)
        elif id(node) in open_nodes:
            raise MappingError(f"{what}: an alias{_where(node.start_mark)} refers to a collection from inside "
                               f"itself: write the values out")
        elif id(node) not in sizes:
            open_nodes.add(id(node))
            stack.append((node, True))
            stack += [(child, False) for child in children if id(child) not in sizes]
    if sizes[id(root)] > MAX_VALUES:
        raise MappingError(f"{what} expands through its YAML aliases (*name) to over {MAX_VALUES:,} values: "
                           f"write the values out instead")


def _children(node) -> list:
    if isinstance(node.value, list):  # a sequence's items, or a mapping's (key, value) pairs
        return [part for item in node.value for part in (item if isinstance(item, tuple) else (item,))]
    return []


def _where(mark) -> str:
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def _yaml_problem(err) -> str:
    """A YAML error, which spans several lines with a picture of where, as one line."""
    problem = " ".join((getattr(err, "problem", None) or str(err)).split())
    return problem[:200] + _where(getattr(err, "problem_mark", None))
