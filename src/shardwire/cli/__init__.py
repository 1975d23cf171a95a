"""The ``shardwire`` command line: one subcommand per job, each in the module of its name here
(``shardwire.cli.train`` is ``shardwire train``).

A subcommand module provides ``add_arguments(parser)`` and ``run(args, argv, checked) -> exit status``
(``argv`` is the subcommand's own arguments, for commands that re-launch themselves as workers), and
may provide ``check_options(args)``: the checks of its options that ``--print-config`` runs before it
prints, so that a combination the command refuses is refused there too, in the same words. The
warnings given while a command reads and checks its options (an old name, an abbreviation) are held
until it calls ``checked()``, before its work: a refusal is its one line alone. A command that never
calls it has them said as it ends, unless it ends refused.
Modules are imported only when their command runs, so ``shardwire --help`` stays instant. Every
command also takes ``--config FILE`` and ``--print-config`` (``shardwire.cli.config_file``). A
name kept for a release after a rename warns in one line on stderr (``shardwire.renamed``).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import signal
import sys
import threading
import warnings
from types import ModuleType
from typing import NoReturn

from shardwire.cli import config_file
from shardwire.cli.config_file import ConfigError
from shardwire.comm.errors import CollectiveError, ScheduleMismatchError, peer_lost, without_source_locations
from shardwire.extras import MissingExtra
from shardwire.files import OutputRefused
from shardwire.launch import (
    COLLECTIVE_FAILED,
    REFUSED,
    Closed,
    OutputLost,
    Stopped,
    UntilClosed,
    die_with_launcher,
    end_process,
    launcher_problem,
    leave_it_to_the_launcher,
    share_node_threads,
    signals_held,
    stop_signals,
    stopped,
    stopping,
    under_launcher,
)
from shardwire.mappings import cut, nearest, refusal
from shardwire.options import NUMBER_READERS
from shardwire.renamed import RenamedWarning

# How long after a stop dropped in a finalizer its signal is sent again (``_stop_again``).
_STOP_AGAIN_S = 0.05

COMMANDS = {
    "train": "train a model with the sharded engine (a byte-level GPT by default)",
    "bench": "measure what the network delivers to collectives (nccl-tests' numbers)",
    "export": "write a checkpoint as its model's ecosystem reads it (a Hugging Face save_pretrained directory)",
    "report": "plot where the steps of profiled runs went",
    "testbed": "emulate a cluster of nodes joined by a shaped Ethernet link on this machine",
    "simulate": "predict and explain a sharded job's step time on any cluster",
    "plan": "find the fastest settings that fit a cluster",
}


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line, as every other refusal is, naming where the
    usage is, instead of the usage itself (25 lines for ``train``) and then the error.

    argparse takes any unambiguous beginning of an option for it (``--trainin`` for ``--training``),
    so a new option that begins the same way breaks a command line that ran before. An abbreviation
    still works for a release, with a warning naming the whole option; then it is refused.

    argparse keeps the last value of an option given twice and drops the first without a word (a
    second ``--sweep`` replaced the first); it says so, and from the next release refuses it, as a
    config file's key given twice is refused (a wrapper script that appends its own overrides keeps
    working for a release).

    An option of ``type=int`` or ``float`` is read as ``shardwire.options.NUMBER_READERS`` reads it (ASCII
    digits only, not every script's that Python's ``int`` reads), whichever module declares it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)
        for kind, reader in NUMBER_READERS.items():
            self.register("type", kind, reader)

    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(self._spelled_out(sys.argv[1:] if args is None else args), namespace)

    def _spelled_out(self, args: list[str]) -> list[str]:
        """``args`` with each abbreviated option written whole (its warning given), and an option given
        twice said. Where a positional takes the rest of the line (``testbed exec NODE COMMAND...``, a
        subcommand's arguments), the words from the first positional on (not an option's value) are not
        this parser's to read, and stay as they are."""
        whole, given, a_value = [], {}, False
        rest_is_not_ours = any(action.nargs in (argparse.REMAINDER, argparse.PARSER) for action in self._actions)
        for k, word in enumerate(args):
            if a_value:  # the value of the option before it, whatever it looks like
                whole.append(word)
                a_value = False
                continue
            if word == "--" or (rest_is_not_ours and not word.startswith("-")):
                return whole + list(args[k:])
            name, equals, value = word.partition("=")
            attached = bool(equals)  # its value in the same word
            if not name.startswith("--") and len(name) > 2 and name[:2] in self._option_string_actions:
                name, attached = name[:2], True  # a short option with its value written on (-b1K)
            if name.startswith("--") and name not in self._option_string_actions:
                options = sorted(flag for flag in self._option_string_actions if flag.startswith(name))
                if len(options) > 1:
                    self.error(f"ambiguous option: {name} could match {', '.join(options)}")
                if options:  # an option to be written in full says so itself when it is not
                    if not getattr(self._option_string_actions[options[0]], "written_in_full", False):
                        warnings.warn(f"{name} is read as {options[0]}: write it whole, as abbreviated options "
                                      f"are refused from the next release", RenamedWarning, stacklevel=2)
                    word = options[0] + equals + value
                    name = options[0]
            if (action := self._option_string_actions.get(name)) is not None and action.nargs != argparse.PARSER:
                # a switch given twice alike drops nothing; --reshard then --no-reshard does
                if action in given and (action.nargs != 0 or given[action] != name):
                    twice = "more than once" if given[action] == name else f"after {given[action]}"
                    warnings.warn(f"{name} is given {twice}: the last one given is used and the others are "
                                  f"dropped; give it once, as an option given twice is refused from the next "
                                  f"release", RenamedWarning, stacklevel=2)
                given.setdefault(action, name)
                a_value = action.nargs is None and not attached
            whole.append(word)
        return whole

    def _print_message(self, message: str, file=None):
        """argparse's, less its silence when the write fails: help that cannot be written to standard
        output is a failed command (``OutputLost``), as any result is."""
        if message:
            (file or sys.stderr).write(message)

    def error(self, message: str):
        self.exit(2, refusal(f"error: {message}{self._nearest(message)} (see {self.prog} --help)") + "\n")

    def _nearest(self, message: str) -> str:
        """For an option argparse does not know, the one it is likely a slip of (Python 3.11's
        argparse suggests none): ``; did you mean --checkpoint-dir?``."""
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        unknown = next((word.split("=")[0] for word in message[len(prefix):].split() if word.startswith("--")), None)
        known = [flag for action in self._actions for flag in action.option_strings if flag.startswith("--")]
        meant = nearest(unknown, known) if unknown else None
        return f"; did you mean {meant}?" if meant else ""


def command(name: str) -> tuple[ModuleType, argparse.ArgumentParser]:
    """The module of the subcommand ``name`` and its parser (``--config`` and ``--print-config`` too)."""
    module = importlib.import_module(f"shardwire.cli.{name}")
    parser = _Parser(prog=f"shardwire {name}", description=COMMANDS[name])
    module.add_arguments(parser)
    config_file.add_help(parser)
    return module, parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        parser = _Parser(
            prog="shardwire",
            description="Fully sharded data-parallel training that hides its communication.",
        )
        commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
        for name, help_text in COMMANDS.items():
            commands.add_parser(name, help=help_text, add_help=False)
        parser.parse_args(argv)  # prints usage or help and exits
        return 2
    name, rest = argv[0], argv[1:]
    if (problem := launcher_problem()) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if under_launcher():
        die_with_launcher()
        share_node_threads()
    # Every C++ error a command can meet (c10d's sockets and stores, NCCL) reaches shardwire as an
    # exception, which it says in one line; torch would also log each with its stack frames.
    # TORCH_CPP_LOG_LEVEL=INFO brings them back.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    with _stopped_by_signals():
        try:
            with signals_held():  # imports torch: seconds, in which a signal is held until it has
                module, parser = command(name)
        except KeyboardInterrupt as err:
            return _interrupted(err)
        with _warnings_in_one_line():
            return _run(module, parser, rest)


def entry() -> NoReturn:
    """The ``shardwire`` command (and ``python -m shardwire``): ``main``, where a command's refusal,
    a ``SystemExit`` carrying its one line, leaves with a refusal's status, 2, as the parser's errors
    and every other error a user can cause do (Python's own for it is 1). The process ends through
    ``end_process``: a worker's gloo threads must not outlive its interpreter. Its standard error is
    where it says what went wrong, so one that cannot be written (``2>full/err.log``, ``2>&-``) drops
    what is said, never ends the command or changes its status; a stream it was started without
    (``>&-``: Python's is None) is the null device. Its standard output is its result, so one that
    cannot be written (a full disk; closed, ``launch.Closed``) ends the command as failed, in one line
    (``OutputLost``), where training only stops printing its progress (``progress.until_closed``)."""
    sys.stdout = UntilClosed(sys.stdout if sys.stdout is not None else Closed(), OutputLost.raised)
    sys.stderr = UntilClosed(sys.stderr) if sys.stderr is not None else open(os.devnull, "w")
    try:
        status = main()
    except SystemExit as err:
        if isinstance(err.code, str):
            print(refusal(err.code), file=sys.stderr)
            status = REFUSED
        else:  # a status (argparse's: 0 after --help, 2 for its errors), as Python would leave with
            status = err.code or 0
    except OutputLost as err:  # in the parser's help or usage
        status = _output_lost(err)
    try:
        sys.stdout.flush()  # what is left in its buffer is the end of the result
    except OutputLost as err:
        status = status or _output_lost(err)
    end_process(status)


@contextlib.contextmanager
def refused(*errors: type[Exception]):
    """Within it, an error of the kinds ``errors`` (input the command cannot use) ends the command as
    its run would refuse it: the error's one line, and a status of 2. What a command's
    ``check_options`` wraps, so that ``--print-config`` refuses in the words of a run."""
    try:
        yield
    except errors as err:
        print(refusal(f"error: {err}"), file=sys.stderr)
        raise SystemExit(2) from None


@contextlib.contextmanager
def _stopped_by_signals():
    """Within it, Ctrl-C, a scheduler's SIGTERM or a closed terminal's SIGHUP stops the command in its
    words (``launch.Stopped``): what it staged is removed, and it says what was saved; a second
    signal meanwhile is ignored (``launch.stopping``). Not a worker's SIGTERM, by which its launcher
    ends it and says what that stopped (``launch.stop_signals``); not where the signal is ignored
    (nohup) or taken. The handlers before are restored after, unless a stop is under way, which
    goes on ignoring them until the process has ended. A stop raised where Python drops exceptions has
    its signal sent again (``_stop_again``)."""
    before = {signum: signal.getsignal(signum) for signum in stop_signals()}
    for signum, handler in before.items():
        if handler in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(signum, _stop)
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: _stop_again(unraisable, hook)
    try:
        yield
    finally:
        sys.unraisablehook = hook
        for signum, handler in before.items():
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, handler)


def _stop(signum: int, frame) -> NoReturn:
    raise stopping(signum)


def _stop_again(unraisable, hook) -> None:
    """Send again the signal of a stop raised where Python drops the exception (a finalizer, such as
    a ``__del__``, running in the main thread as the signal came): dropped, the command would run on
    to its end, ignoring every later stop signal (``launch.stopping``). Sent by another thread a
    moment later, not here, where its handler would run at once and be dropped again (``os.kill`` of
    its own process, or a wait, runs it before returning): it runs at the next point of the main
    thread that can raise (a finalizer still running then drops it, and it is sent again). Any other
    exception so dropped goes to the hook before (``hook``), which says it."""
    if not isinstance(unraisable.exc_value, Stopped):
        hook(unraisable)
        return
    signal.signal(unraisable.exc_value.signum, _stop)
    again = threading.Timer(_STOP_AGAIN_S, os.kill, (os.getpid(), unraisable.exc_value.signum))
    again.daemon = True
    again.start()


def _interrupted(err: KeyboardInterrupt) -> int:
    """Ctrl-C (or the signal that stopped a launcher, ``launch.Stopped``): a worker leaves quietly,
    and its launcher says what was saved."""
    said, status = stopped(err)
    if not under_launcher():
        print(said, file=sys.stderr)
    return status


class _Held:
    """What ``warnings`` shows while a command reads and checks its options (an old name, an
    abbreviation, a setting's old key), held until the command has checked them all: a refusal is then
    its one line alone, as it is when the parser refuses."""

    def __init__(self, show):
        self.show = show  # warnings' own
        self._held: list[tuple] | None = []

    def shown(self, *warning) -> None:
        if self._held is None:
            self.show(*warning)
        else:
            self._held.append(warning)

    def checked(self) -> None:
        """The checks passed: say what was held, and from now on what comes."""
        held, self._held = self._held, None
        for warning in held or ():
            self.show(*warning)


def _run(module: ModuleType, parser: argparse.ArgumentParser, rest: list[str]) -> int:
    """``_run_held``, the warnings held until the command calls ``checked``, or said as it ends where
    it did not end refused."""
    held = _Held(warnings.showwarning)
    warnings.showwarning = held.shown
    status = None
    try:
        status = _run_held(module, parser, rest, held.checked)
        return status
    except SystemExit as err:
        status = REFUSED if isinstance(err.code, str) else err.code
        raise
    finally:
        warnings.showwarning = held.show
        if status != REFUSED:
            held.checked()


def _run_held(module: ModuleType, parser: argparse.ArgumentParser, rest: list[str], checked) -> int:
    try:
        args, printing = config_file.parse(parser, rest)
        if printing:
            if hasattr(module, "check_options"):  # a config printed runs, or fails as the command would
                module.check_options(args)
            checked()
            print(config_file.dump(parser, args), end="")
            return 0
        return module.run(args, rest, checked)
    except (ConfigError, MissingExtra, OutputRefused) as err:
        # OutputRefused: a result that could not be written (a full disk), said alike in a worker, where
        # rank 0 writes the results and its launcher stops the rest at a refusal's status
        print(refusal(f"error: {err}"), file=sys.stderr)
        return REFUSED
    except SystemExit as err:
        if not (under_launcher() and isinstance(err.code, str)):
            raise
        if os.environ.get("RANK", "0") != "0":  # every rank may refuse alike (data changed under them): rank 0 says it
            leave_it_to_the_launcher()
        print(refusal(err.code), file=sys.stderr)  # a worker's refusal: its line, and the status its launcher knows
        return REFUSED
    except CollectiveError as err:
        if not under_launcher():
            raise
        # A peer stopped (refused, crashed, was killed, hung) while this worker waited on it: its message
        # says why, where it gave one, this one only what it was waiting for, in one line, where the launcher
        # does not stop it first. Ranks that issued different collectives refuse: a restart meets it again.
        leave_it_to_the_launcher()
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return REFUSED if isinstance(err, ScheduleMismatchError) else COLLECTIVE_FAILED
    except RuntimeError as err:
        if not (under_launcher() and peer_lost(err)):
            raise
        # a torch collective of the loop's own (its loss, its checks) met the same: said as the above
        leave_it_to_the_launcher()
        said = " ".join(without_source_locations(str(err)).split())
        print(refusal(f"error: rank {os.environ.get('RANK', '?')} lost its connection to another rank, whose "
                      f"process ended or whose link broke ({cut(said)})"), file=sys.stderr)
        return COLLECTIVE_FAILED
    except KeyboardInterrupt as err:
        return _interrupted(err)
    except OutputLost as err:
        return _output_lost(err)


def _output_lost(err: OutputLost) -> int:
    """Standard output failed: a failure's status, and one line on why, unless its reader left
    (``| head``), which asked for no more. A worker's is a refusal's, which its launcher adds no line to."""
    if err.errno != errno.EPIPE:
        print(f"error: standard output: {err.strerror}; what the command printed is incomplete",
              file=sys.stderr)
    return REFUSED if under_launcher() else 1


@contextlib.contextmanager
def _warnings_in_one_line():
    """Show shardwire's own warnings (a ``RenamedWarning``, a checkpoint kept) as one line,
    "warning: ...", rather than as the warning and the line of shardwire's source that raised it,
    which says nothing to the user; other libraries' warnings as ever."""
    form = warnings.formatwarning  # what shows a warning uses; one recorded (by a test) is not formatted
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

    def formatted(message, category, filename, lineno, line=None):
        if issubclass(category, RenamedWarning) or os.path.abspath(filename).startswith(ours):
            return f"warning: {message}\n"
        return form(message, category, filename, lineno, line)

    warnings.formatwarning = formatted
    try:
        yield
    finally:
        if warnings.formatwarning is formatted:
            warnings.formatwarning = form
