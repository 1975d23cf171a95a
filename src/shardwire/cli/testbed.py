"""``shardwire testbed up|run|check|down``: an emulated Ethernet cluster on this machine.

    shardwire testbed up --nodes 2 --link 1gbit
    shardwire testbed up --nodes 2 --like h100-100gbe    # as much network per FLOP as that cluster
    shardwire testbed check
    shardwire testbed run --nproc-per-node 2 -- -m shardwire train --model 30m
    shardwire testbed exec node1 -- shardwire train --nproc 2 ...    # one node's own job
    shardwire testbed link node1 down                                # pull its cable; `up` again
    shardwire testbed down

What follows ``--`` in ``run`` is what torchrun takes after its own options: a script and its
arguments, ``-m module ...``, or ``--no-python program ...``; a job of shardwire's own (``-m shardwire
train ...``) has its options checked here first, as its command checks them, and the inputs they name
(``--data``) found where its nodes will read them, before any node starts it. What follows ``--`` in ``exec`` is a command, run on that node as on a machine of the cluster:
under the node's hostname, with its link.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Iterator

from shardwire import cli
from shardwire.cli.config_file import ConfigError
from shardwire.extras import MissingExtra
from shardwire.files import LEADS_NOWHERE
from shardwire.launch import REFUSED, host_memory_per_worker
from shardwire.mappings import cut, one_line, refusal, shown
from shardwire.testbed import check, job, network, regime
from shardwire.testbed.spec import (
    DEFAULT_NAME,
    MIN_RATE,
    Testbed,
    TestbedError,
    TestbedFailure,
    check_name,
    format_rate,
    held,
    parse_rate,
    record_cut,
    running,
    testbed_command,
)

# The options of shardwire's commands that name what a job reads: each must be there before the nodes start it.
_JOB_INPUTS = ("data", "tokenizer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "Needs root and iproute2 (ip, tc). Every action takes --name to keep several testbeds apart."
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    def action(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = actions.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--name", default=DEFAULT_NAME,
                         help=f"the testbed's name, which prefixes everything it creates (default {DEFAULT_NAME})")
        return sub

    up = action("up", "build the nodes and their shaped links (rebuilds if the nodes or link rate differ)")
    up.add_argument("--nodes", type=int, required=True, help="emulated nodes (network namespaces)")
    rate = up.add_mutually_exclusive_group()  # one of them, from the command line or a config file
    rate.add_argument("--link", help="each node's link rate, per direction, in tc's units: 1gbit, 2.5gbit, 500mbit")
    rate.add_argument("--like", metavar="PRESET",
                      help="the link rate that gives a node here the FLOP per network byte of a GPU cluster "
                           "preset's node (one of `shardwire simulate --cluster`'s), measuring this machine's compute")
    up.add_argument("--nproc-per-node", type=int,
                    help="with --like: the ranks per node the jobs will run, whose compute together is the node's "
                         "(default 1)")
    run = action("run", "run a torchrun job across the nodes: shardwire testbed run [--nproc-per-node R] -- CMD...")
    run.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node (default 1)")
    run.add_argument("--max-restarts", type=int, default=0,
                     help="restart every node's workers when one fails, at most this many times (default 0)")
    run.add_argument("command", nargs=argparse.REMAINDER, help="after --: torchrun's script and its arguments")
    execute = action("exec", "run a command on one node, as on a machine of the cluster: shardwire testbed exec "
                             "NODE -- CMD...")
    execute.add_argument("node", help="the node: node0, node1, ... (as `up` lists them)")
    execute.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command and its arguments")
    link = action("link", "cut a node off the switch (down) or connect it again (up), as a pulled cable")
    link.add_argument("node", help="the node: node0, node1, ... (as `up` lists them)")
    link.add_argument("state", choices=("up", "down"), help="connect (up) or cut (down)")
    measure = action("check", "measure the links between and inside nodes, and judge them against the shaping")
    measure.add_argument("--seconds", type=float, default=1.0, help="length of each cross-node transfer")
    action("down", "stop anything still running on the nodes and remove the testbed")


def check_options(args: argparse.Namespace) -> None:
    """What ``--print-config`` checks before it prints: the name, and for ``up`` its settings as ``up``
    checks them before measuring or building anything, refused in the words and status of a run."""
    with cli.refused(TestbedError):
        check_name(args.name)
        if args.action == "up":
            _up_settings(args)


def run(args: argparse.Namespace, argv: list[str], checked) -> int:
    """Ends a refusal (what the user gave, or must do first) with 2, as every command's refusals end,
    and what the machinery could not do (``TestbedFailure``) with 1, as a failed job ends."""
    try:
        check_name(args.name)
        if args.action == "up":
            _up_settings(args)
        network.require_privileges(args.action, shlex.join(["shardwire", "testbed", *argv]))
        checked()
        return _ACTIONS[args.action](args)
    except TestbedError as err:
        print(refusal(f"error: {err}"), file=sys.stderr)
        return 1 if isinstance(err, TestbedFailure) else REFUSED
    except KeyboardInterrupt:  # `up` and `down` leave nothing half-built behind them
        print("interrupted", file=sys.stderr)
        return 130


def _up_settings(args) -> int | None:
    """The link rate ``--link`` gives (None for ``--like``, which measures it), once ``up``'s options
    are known to go together and the node count to be one a testbed can have."""
    if args.link is None and args.like is None:
        raise TestbedError("give the link rate: --link RATE (e.g. 1gbit) or --like PRESET (e.g. h100-100gbe)")
    if args.like is not None:
        Testbed(args.name, args.nodes, MIN_RATE)  # the node count, checked before a second of measuring
        if args.nproc_per_node is not None:
            _workers_fit(args.nodes, args.nproc_per_node)
        return None
    if args.nproc_per_node is not None:
        raise TestbedError("--nproc-per-node sets the node's compute for --like; a rate given with --link "
                           "needs none (give the ranks to `testbed run`)")
    rate = parse_rate(args.link)
    Testbed(args.name, args.nodes, rate)
    return rate


def _workers_fit(nodes: int, nproc_per_node: int) -> None:
    """Every node's workers run on this machine: refuses ranks it cannot hold, for ``run`` and for the
    compute ``up --like`` divides among them alike."""
    if nproc_per_node < 1:
        raise TestbedError(f"--nproc-per-node must be at least 1, got {nproc_per_node}")
    try:
        host_memory_per_worker(nodes * nproc_per_node)
    except ValueError as err:
        raise TestbedError(f"{err}: lower --nproc-per-node") from None


def _up(args) -> int:
    rate = _up_settings(args)
    if rate is None:
        matched = regime.like(args.like, args.nodes, 1 if args.nproc_per_node is None else args.nproc_per_node)
        print("\n".join(matched.describe()))
        rate = regime.kept_rate(args.name, args.nodes, matched.rate_bits)
        if rate != matched.rate_bits:
            print(f"kept the {format_rate(rate)} links that are up: within {regime.KEPT_WITHIN:.0%} of the "
                  f"{format_rate(matched.rate_bits)} measured now (`"
                  f"{Testbed(args.name, args.nodes, matched.rate_bits).up_command()}` builds that)")
    testbed = Testbed(args.name, args.nodes, rate)
    built = network.up(testbed)
    print(f"{testbed.describe()}: {'built' if built else 'already up, unchanged'}")
    for k in range(testbed.nodes):
        print(f"  node{k}: namespace {testbed.namespace(k)}, address {testbed.address(k)}")
    return 0


def _run(args) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        example = testbed_command("run", args.name, "--", "-m", "shardwire", "train")
        raise TestbedError(f"give the job after --, e.g. `{example}`")
    if args.max_restarts < 0:
        raise TestbedError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    with running(args.name):  # claimed first: an up or down that starts now is refused, not run under it
        testbed = _cleared(args.name)
        _workers_fit(testbed.nodes, args.nproc_per_node)
        if (ended := _check_job(testbed, args.nproc_per_node, command)) is not None:
            return ended

        def stop(signum, frame):  # a terminated `run` stops its job, like an interrupted one
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)
        return job.run_job(testbed, args.nproc_per_node, command, max_restarts=args.max_restarts)


def _check_job(testbed: Testbed, nproc_per_node: int, command: list[str]) -> int | None:
    """For a job of shardwire's own (``-m shardwire COMMAND ...``), the status it ends with before
    any node starts it: its options refused (one line, 2), or its help shown (0); None where it may
    start. They are checked here as the command checks them before its workers start, for the world
    the nodes will give it, rather than by every worker, each node saying so in turn (what only a
    worker can find, it still says itself). So is a job's script that is not there."""
    given = _shardwire_arguments(command)
    if given is None:
        _check_lead(command)
        return None
    # the options' warnings (an abbreviation) are the workers' to give, as they read the same options
    with _in_the_jobs_first_rank(testbed.nodes, nproc_per_node), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            args = _check_options_of(given, world=testbed.nodes * nproc_per_node)
        except SystemExit as err:  # argparse's (its line said), a check's (its line its code), or --help's
            if isinstance(err.code, str):
                print(one_line(err.code), file=sys.stderr)
                return REFUSED
            return err.code or 0
    if (missing := _missing_input(args)) is not None:
        raise TestbedError(missing)
    return None


def _check_lead(command: list[str]) -> None:
    """Refuse a job that does not start as torchrun takes one on every node: a script that is there,
    ``-m module``, or ``--no-python`` and a program found here (each node would otherwise print
    torchrun's usage, or a traceback, of its own)."""
    lead = command[0]
    program = lead in ("--no-python", "--no_python")  # torchrun takes either spelling
    if (program or lead in ("-m", "--module")) and len(command) < 2:
        raise TestbedError(f"the job's {lead} names nothing after it: give a {'program' if program else 'module'}")
    if program:
        if shutil.which(command[1]) is None:
            raise TestbedError(f"the job's program {cut(command[1])} is not an executable file here or on PATH, where "
                               f"the nodes run the job: give one that is")
    elif lead.startswith("-") and lead not in ("-m", "--module"):
        raise TestbedError(f"the job starts with {cut(lead)}: give a script, -m module or --no-python program, then "
                           f"its arguments")
    elif not lead.startswith("-") and not os.path.exists(lead):
        why = LEADS_NOWHERE if os.path.islink(lead) else "does not exist"
        where = "" if os.path.isabs(lead) else f" in {os.getcwd()}, where the nodes run the job"
        raise TestbedError(f"the job's script {cut(lead)} {why}{where}: give a path that exists")


def _shardwire_arguments(command: list[str]) -> list[str] | None:
    """What follows ``-m shardwire`` in a job that is one of shardwire's commands (refusing one that
    names none), or None for any other job."""
    if command[:2] not in (["-m", "shardwire"], ["--module", "shardwire"]):
        return None
    given = command[2:]
    if not given or given[0] not in cli.COMMANDS:
        raise TestbedError(f"the job -m shardwire needs one of shardwire's commands ({', '.join(cli.COMMANDS)}), "
                           f"got {shown(given[0]) if given else 'none'}")
    return given


def _check_options_of(given: list[str], world: int) -> argparse.Namespace:
    """``shardwire GIVEN...``'s options, as the command checks them before it starts workers: its
    parser (its ``--config`` file too), then its ``check_options`` and ``check_outputs`` where it has
    them; returns them parsed. Its ``--nproc``, local workers, is the world: under torchrun a command
    takes its world from the launcher."""
    module, parser = cli.command(given[0])
    try:
        args, _ = cli.config_file.parse(parser, given[1:])
        if hasattr(args, "nproc"):
            args.nproc = world
        if hasattr(module, "check_options"):
            module.check_options(args)
        if hasattr(module, "check_outputs"):  # the nodes write on this machine's file system, from here
            module.check_outputs(args)
    except (ConfigError, MissingExtra) as err:
        raise TestbedError(str(err)) from None
    return args


def _missing_input(args: argparse.Namespace) -> str | None:
    """Why an input the job names (``--data``, ``--tokenizer``) is not there for its workers, or None:
    a command checks its inputs only as its workers start (what it reads is the machine's), where on
    the testbed every node would say so in turn. The nodes run the job in this directory (``run``
    starts them in it, and namespaces share the file system), so a relative path is read from here."""
    for option in _JOB_INPUTS:
        path = getattr(args, option, None)
        if path is None or os.path.exists(path):
            continue
        why = LEADS_NOWHERE if os.path.islink(path) else "does not exist"
        where = "" if os.path.isabs(path) else f" in {os.getcwd()}, where the nodes run the job"
        return f"--{option} {cut(path)} {why}{where}: give a path that exists"
    return None


@contextlib.contextmanager
def _in_the_jobs_first_rank(nodes: int, nproc_per_node: int) -> Iterator[None]:
    """torchrun's variables as the job's first worker finds them, for checks that take the world and
    its nodes from them (``shardwire.launch.under_launcher``); the environment as it was after."""
    given = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(nodes * nproc_per_node),
             "LOCAL_WORLD_SIZE": str(nproc_per_node)}
    before = {name: os.environ.get(name) for name in given}
    os.environ.update(given)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _exec(args) -> int:
    """Replace this process with the command, so that its exit status and the signals sent to it are
    the command's own."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        example = testbed_command("exec", args.name, args.node, "--", "hostname")
        raise TestbedError(f"give the command after --, e.g. `{example}`")
    if command is args.command and command[0].startswith("-"):  # an option of exec's, given after NODE
        meant = _options_first(args.node, command)
        example = f"e.g. `{meant}`" if meant else "as in shardwire testbed exec [--name NAME] NODE -- CMD..."
        raise TestbedError(f"{shown(command[0])} after the node would be the command: give exec's options before "
                           f"the node and the command after --, {example}")
    testbed = _settled(args.name)
    argv = network.in_namespace(testbed.namespace(testbed.node(args.node)), command)
    os.execvpe(argv[0], argv, job.node_environment(testbed))


def _options_first(node: str, words: list[str]) -> str | None:
    """The ``exec`` the user meant by ``exec NODE WORDS...``: the words before ``--`` (exec's options,
    given after the node) moved before it, to run as printed; None without a ``--``, where those
    options end is not known."""
    if "--" not in words:
        return None
    end = words.index("--")
    return shlex.join(["shardwire", "testbed", "exec", *words[:end], node, *words[end:]])


def _link(args) -> int:
    testbed = _settled(args.name)
    node = testbed.node(args.node)
    if args.state == "down":
        record_cut(args.name, node, time.time())  # first: a job that fails at once is told of it
    network.set_link(testbed, node, args.state == "up")
    print(f"node{node}: link {args.state}")
    return 0


def _built(name: str) -> Testbed:
    """The testbed ``up`` recorded for ``name``, refused unless all of it is there."""
    testbed = Testbed.load(name)
    if not network.is_up(testbed):
        raise TestbedError(f"{testbed.describe()} is only partly there; rebuild it with `{testbed.up_command()}`")
    return testbed


def _settled(name: str) -> Testbed:
    """The testbed ``_built`` finds once an ``up`` or ``down`` under way has ended (``held``): one
    half removed is no testbed to rebuild, and one half built is not yet the one asked for."""
    with held(name):
        return _built(name)


def _cleared(name: str) -> Testbed:
    """``_settled``, for a job or a check holding it (``running``): what one that was killed left
    running on the nodes is stopped first, and said, as it would share the links."""
    testbed = _settled(name)
    if stopped := job.stop_leftovers(testbed):
        pid, command = stopped[0]
        more = f" and {len(stopped) - 1} more" if len(stopped) > 1 else ""
        print(f"note: stopped what a job or check that was killed left on the nodes (process {pid}: "
              f"{cut(command)}{more})", file=sys.stderr, flush=True)
    return testbed


def _check(args) -> int:
    if not 0 < args.seconds <= check.MAX_SECONDS:
        raise TestbedError(f"--seconds must be positive and at most {check.MAX_SECONDS:g}, got {args.seconds}")
    with running(args.name):  # a job, or another check, would share the links it measures
        testbed = _cleared(args.name)
        if down := network.links_down(testbed):
            node = f"node{down[0]}"
            raise TestbedError(f"{node}'s link is down (`shardwire testbed link` cut it): reconnect it with "
                               f"`{testbed_command('link', args.name, node, 'up')}` to check the links")
        print(testbed.describe())
        findings = check.check(testbed, args.seconds)
    for finding in findings:
        print(f"  {finding}")
    passed = all(finding.ok for finding in findings)
    print("link check passed" if passed else "link check FAILED")
    return 0 if passed else 1


def _down(args) -> int:
    removed = network.down(args.name)
    print(f"removed testbed {args.name!r} ({', '.join(removed)})" if removed else f"no testbed {args.name!r} to remove")
    return 0


_ACTIONS = {"up": _up, "run": _run, "exec": _exec, "link": _link, "check": _check, "down": _down}
