"""``shardwire testbed up|run|check|down``: an emulated Ethernet cluster on this machine.

    shardwire testbed up --nodes 2 --link 1gbit
    shardwire testbed up --nodes 2 --like h100-100gbe    # as much network per FLOP as that cluster
    shardwire testbed check
    shardwire testbed run --nproc-per-node 2 -- -m shardwire train --model 30m
    shardwire testbed exec node1 -- shardwire train --nproc 2 ...    # one node's own job
    shardwire testbed link node1 down                                # pull its cable; `up` again
    shardwire testbed down

What follows ``--`` in ``run`` is what torchrun takes after its own options: a script and its
arguments, ``-m module ...``, or ``--no-python program ...``. What follows it in ``exec`` is a
command, run on that node as on a machine of the cluster: under the node's hostname, with its link.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from shardwire.launch import host_memory_per_worker
from shardwire.mappings import one_line, shown
from shardwire.testbed import check, job, network, regime
from shardwire.testbed.spec import (
    DEFAULT_NAME,
    MIN_RATE,
    Testbed,
    TestbedError,
    check_name,
    parse_rate,
)


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
    try:
        check_name(args.name)
        if args.action == "up":
            _up_settings(args)
    except TestbedError as err:
        print(one_line(f"error: {err}"), file=sys.stderr)
        raise SystemExit(1) from None


def run(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        check_name(args.name)
        network.require_privileges(args.action)
        return _ACTIONS[args.action](args)
    except TestbedError as err:
        print(one_line(f"error: {err}"), file=sys.stderr)
        return 1
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
        rate = matched.rate_bits
    testbed = Testbed(args.name, args.nodes, rate)
    built = network.up(testbed)
    print(f"{testbed.describe()}: {'built' if built else 'already up, unchanged'}")
    for k in range(testbed.nodes):
        print(f"  node{k}: namespace {testbed.namespace(k)}, address {testbed.address(k)}")
    return 0


def _run(args) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise TestbedError("give the job after --, e.g. `shardwire testbed run -- -m shardwire train`")
    if args.max_restarts < 0:
        raise TestbedError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    testbed = _built(args.name)
    _workers_fit(testbed.nodes, args.nproc_per_node)

    def stop(signum, frame):  # a terminated `run` stops its job, like an interrupted one
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    return job.run_job(testbed, args.nproc_per_node, command, max_restarts=args.max_restarts)


def _exec(args) -> int:
    """Replace this process with the command, so that its exit status and the signals sent to it are
    the command's own."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise TestbedError("give the command after --, e.g. `shardwire testbed exec node0 -- hostname`")
    if command is args.command and command[0].startswith("-"):  # an option of exec's, given after NODE
        raise TestbedError(f"{shown(command[0])} after the node would be the command: give exec's options before "
                           f"the node and the command after --, e.g. `shardwire testbed exec --name NAME node0 -- "
                           f"hostname`")
    testbed = _built(args.name)
    argv = network.in_namespace(testbed.namespace(testbed.node(args.node)), command)
    os.execvpe(argv[0], argv, job.node_environment(testbed))


def _link(args) -> int:
    testbed = _built(args.name)
    node = testbed.node(args.node)
    network.set_link(testbed, node, args.state == "up")
    print(f"node{node}: link {args.state}")
    return 0


def _built(name: str) -> Testbed:
    """The testbed ``up`` recorded for ``name``, refused unless all of it is there."""
    testbed = Testbed.load(name)
    if not network.is_up(testbed):
        raise TestbedError(f"{testbed.describe()} is only partly there; rebuild it with `shardwire testbed up`")
    return testbed


def _check(args) -> int:
    testbed = Testbed.load(args.name)
    if not 0 < args.seconds <= check.MAX_SECONDS:
        raise TestbedError(f"--seconds must be positive and at most {check.MAX_SECONDS:g}, got {args.seconds}")
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
