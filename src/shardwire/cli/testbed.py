"""``shardwire testbed up|run|check|down``: an emulated Ethernet cluster on this machine.

    shardwire testbed up --nodes 2 --link 1gbit
    shardwire testbed up --nodes 2 --like h100-100gbe    # as much network per FLOP as that cluster
    shardwire testbed check
    shardwire testbed run --nproc-per-node 2 -- -m shardwire train --model 30m
    shardwire testbed down

What follows ``--`` in ``run`` is what torchrun takes after its own options: a script and its
arguments, ``-m module ...``, or ``--no-python program ...``.
"""

from __future__ import annotations

import argparse
import signal
import sys

from shardwire.launch import host_memory_per_worker
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
    run.add_argument("command", nargs=argparse.REMAINDER, help="after --: torchrun's script and its arguments")
    measure = action("check", "measure the links between and inside nodes, and judge them against the shaping")
    measure.add_argument("--seconds", type=float, default=1.0, help="length of each cross-node transfer")
    action("down", "stop anything still running on the nodes and remove the testbed")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        check_name(args.name)
        network.require_privileges(args.action)
        return _ACTIONS[args.action](args)
    except TestbedError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # `up` and `down` leave nothing half-built behind them
        print("interrupted", file=sys.stderr)
        return 130


def _up(args) -> int:
    if args.link is None and args.like is None:
        raise TestbedError("give the link rate: --link RATE (e.g. 1gbit) or --like PRESET (e.g. h100-100gbe)")
    if args.like is None:
        if args.nproc_per_node is not None:
            raise TestbedError("--nproc-per-node sets the node's compute for --like; a rate given with --link "
                               "needs none (give the ranks to `testbed run`)")
        rate = parse_rate(args.link)
    else:
        Testbed(args.name, args.nodes, MIN_RATE)  # the node count, checked before a second of measuring
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
    if args.nproc_per_node < 1:
        raise TestbedError(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
    testbed = Testbed.load(args.name)
    try:  # every node's workers run on this machine
        host_memory_per_worker(testbed.nodes * args.nproc_per_node)
    except ValueError as err:
        raise TestbedError(f"{err}: lower --nproc-per-node") from None
    if not network.is_up(testbed):
        raise TestbedError(f"{testbed.describe()} is only partly there; rebuild it with `shardwire testbed up`")

    def stop(signum, frame):  # a terminated `run` stops its job, like an interrupted one
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    return job.run_job(testbed, args.nproc_per_node, command)


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


_ACTIONS = {"up": _up, "run": _run, "check": _check, "down": _down}
