"""The plumbing: a testbed's namespaces, bridge, links and shaping, built and removed with iproute2.

Layout, for a testbed named ``shardwire`` with two nodes::

    shardwire-node0                 shardwire-hub                  shardwire-node1
    lo, eth0 10.77.0.1 --veth-- node0 ] br0 [ node1 --veth-- eth0 10.77.0.2, lo

Both ends of every link are shaped with a token bucket filter, ``eth0`` for what a node sends and
the hub's port for what it receives, so each direction carries at most the link rate however many
nodes send to one node at once, as on a switched network. The bridge sits in a namespace of its own,
so the host's network namespace is never touched, and the nodes have no route anywhere else: all
traffic stays inside the testbed. Deleting the namespaces deletes every link and qdisc in them.

Each node also gets a hosts file naming every node (``ip netns exec`` shows
/etc/netns/NAMESPACE/hosts as /etc/hosts), so that the reverse lookups torch makes of its peers'
addresses succeed, as they do on a cluster with working DNS, and what runs on a node runs under
the node's name (``in_namespace``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from shardwire.files import write_atomically
from shardwire.mappings import cut
from shardwire.testbed.spec import (
    NODE_INTERFACE,
    SUBNET,
    Testbed,
    TestbedError,
    TestbedFailure,
    check_name,
    cut_since,
    cuts_path,
    held,
    job_on,
    state_path,
    testbed_command,
)

BRIDGE = "br0"
# The bucket holds about BURST_SECONDS of the rate, within bounds. At least a whole GSO segment
# (up to 64 KiB) at rates where that is under 10 ms, or tbf splits each segment into packets; at low
# rates a few packets, so that a link idle for a while cannot pass a second's traffic at once; and
# always at least rate / HZ (tc-tbf(8)): a millisecond at the rate covers any HZ up to 1000.
BURST_SECONDS = 0.01
TICK_SECONDS = 0.001  # 1 / HZ at HZ 1000, the highest
MAX_BURST_BYTES = 128 * 1024
MIN_BURST_BYTES = 4 * 1024
# How long a packet may wait in the queue before it is dropped: TCP senders that share the link
# back off on drops, so the queue must absorb their bursts without growing latency unrealistically.
QUEUE_LATENCY = "50ms"
STOP_GRACE_S = 5.0
NETNS_ETC = Path("/etc/netns")


def burst_bytes(rate_bits: int) -> int:
    bucket = min(MAX_BURST_BYTES, max(MIN_BURST_BYTES, int(rate_bits / 8 * BURST_SECONDS)))
    return max(bucket, int(rate_bits / 8 * TICK_SECONDS))


def require_privileges(action: str, command: str | None = None) -> None:
    """Fail early, and say what is needed, when this process cannot build or enter namespaces;
    ``command``, the user's own command line where known, is repeated under sudo, to run as printed."""
    if os.geteuid() != 0:
        remedy = f": `sudo {command}`" if command else ""
        raise TestbedError(
            f"`shardwire testbed {action}` needs root: it creates network namespaces, virtual links and "
            f"tc qdiscs. Run it as root{remedy}"
        )
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            raise TestbedError(f"`{tool}` is not installed; install {package} (Debian/Ubuntu: apt-get install {package})")


def in_namespace(namespace: str, argv: list[str]) -> list[str]:
    """``argv`` as a command that runs inside ``namespace``, on a host named after it.

    A network namespace keeps the machine's hostname, which names no node and resolves to none of
    their addresses; a UTS namespace of its own gives each node its name, which its hosts file maps
    to its address, as on a cluster. Tools that find a peer by its hostname then work unchanged
    (torchrun's standalone rendezvous, torchft's recovery from a live peer)."""
    rename = 'echo "$0" > /proc/sys/kernel/hostname && exec "$@"'
    return ["ip", "netns", "exec", namespace, "unshare", "--uts", "--", "sh", "-c", rename, namespace, *argv]


def set_link(testbed: Testbed, node: int, up: bool) -> None:
    """Connect node ``node`` to the switch, or cut it off (its switch port down: what it sends and
    what is sent to it is lost, as when a cable is pulled, with no error at either end)."""
    _run("ip", "-n", testbed.hub, "link", "set", testbed.switch_port(node), "up" if up else "down")


def links_down(testbed: Testbed) -> list[int]:
    """The nodes ``set_link`` cut off from the switch (their switch port down), as things stand now."""
    listed = _run("ip", "-o", "-n", testbed.hub, "link", "show")
    down = []
    for node in range(testbed.nodes):
        line = next((line for line in listed.splitlines() if f" {testbed.switch_port(node)}@" in line
                     or f" {testbed.switch_port(node)}:" in line), "")
        flags = line[line.find("<") + 1:line.find(">")].split(",") if "<" in line else []
        if line and "UP" not in flags:
            down.append(node)
    return down


def cut_off(testbed: Testbed, since: float) -> str:
    """Which nodes ``shardwire testbed link`` (or ``ip link``) has cut off since ``since`` (a job's or
    a check's start), in words after a failure, or nothing: a node that lost its peers blames them,
    not the link (cut and put back before the collectives' timeout, it is up again as they fail)."""
    try:
        down = links_down(testbed)
    except TestbedFailure:  # the testbed removed under it: the failure says so itself
        return ""
    recorded = set(cut_since(testbed.name, since))
    cut = sorted(set(down) | recorded)
    if not cut:
        return ""
    said = ", ".join(f"node{node}" + ("" if node in down else " (up again)") for node in cut)
    if recorded.issuperset(cut):
        return f", after `shardwire testbed link` cut the link of {said}"
    return f", after the link of {said} went down"  # cut otherwise (`ip link`), which the testbed records not


def _run(*argv: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise TestbedFailure(f"`{' '.join(argv)}` failed: {result.stderr.strip() or f'exit {result.returncode}'}")
    return result.stdout


def _owned_by(name: str) -> re.Pattern:
    """Matches the names of the namespaces testbed ``name`` makes, and nothing else."""
    return re.compile(rf"{re.escape(check_name(name))}-(hub|node\d+)")


def existing_namespaces(name: str) -> list[str]:
    """The namespaces of testbed ``name`` that exist now, whatever state any command left them in."""
    listed = (line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip())
    return sorted(ns for ns in listed if _owned_by(name).fullmatch(ns))


def is_up(testbed: Testbed) -> bool:
    """Whether exactly this testbed is built (the state file says so and every namespace exists)."""
    try:
        recorded = Testbed.load(testbed.name)
    except TestbedError:
        return False
    return recorded == testbed and set(existing_namespaces(testbed.name)) == set(testbed.namespaces)


def up(testbed: Testbed) -> bool:
    """Build ``testbed``, replacing whatever of that name exists; False if it was already up as asked.

    A failure part way removes everything built so far before the error goes on."""
    with held(testbed.name):
        if is_up(testbed):
            return False
        _no_job_on(testbed.name, "rebuilding")
        _remove(testbed.name)
        try:
            _build(testbed)
            testbed.save()
        except BaseException:
            _remove(testbed.name)
            raise
    return True


def _build(t: Testbed) -> None:
    burst = burst_bytes(t.rate_bits)
    shape = ["root", "tbf", "rate", f"{t.rate_bits}bit", "burst", str(burst), "latency", QUEUE_LATENCY]
    _run("ip", "netns", "add", t.hub)
    _run("ip", "-n", t.hub, "link", "add", BRIDGE, "type", "bridge")
    _run("ip", "-n", t.hub, "link", "set", BRIDGE, "up")
    hosts = _hosts_file({"127.0.0.1": "localhost", **{t.address(k): t.namespace(k) for k in range(t.nodes)}})
    for k in range(t.nodes):
        node, port = t.namespace(k), t.switch_port(k)
        _run("ip", "netns", "add", node)
        _run("ip", "-n", node, "link", "set", "lo", "up")  # ranks on one node talk over it
        (NETNS_ETC / node).mkdir(parents=True, exist_ok=True)
        write_atomically(NETNS_ETC / node / "hosts", hosts)
        _run("ip", "-n", t.hub, "link", "add", port, "type", "veth", "peer", "name", NODE_INTERFACE, "netns", node)
        _run("ip", "-n", t.hub, "link", "set", port, "master", BRIDGE)
        _run("ip", "-n", t.hub, "link", "set", port, "up")
        _run("ip", "-n", node, "addr", "add", f"{t.address(k)}/{SUBNET.prefixlen}", "dev", NODE_INTERFACE)
        _run("ip", "-n", node, "link", "set", NODE_INTERFACE, "up")
        _run("tc", "-n", node, "qdisc", "add", "dev", NODE_INTERFACE, *shape)
        _run("tc", "-n", t.hub, "qdisc", "add", "dev", port, *shape)


def _hosts_file(names: dict[str, str]) -> str:
    # torch's stores listen on IPv6 sockets, which see IPv4 peers as IPv4-mapped IPv6 addresses.
    return "".join(f"{address} {name}\n::ffff:{address} {name}\n" for address, name in names.items())


def down(name: str) -> list[str]:
    """Stop every process left on the testbed's nodes, delete its namespaces (and with them every
    link and qdisc), their hosts files and its state file; returns the namespaces deleted."""
    with held(name):
        _no_job_on(name, "removing")
        return _remove(name)


def _no_job_on(name: str, doing: str) -> None:
    """Refuse to change testbed ``name`` while a job runs on it: its nodes would go from under it,
    and the job end failed, naming none of this. Rebuilding, a process ``exec`` started on a node is
    a job too (a fault-tolerant group, a lighthouse); ``down`` stops those, as its help says."""
    if (owner := job_on(name)) is not None:
        raise TestbedError(f"testbed {name!r} is running a job ({owner}): stop it (Ctrl-C where it runs) before "
                           f"{doing} the testbed")
    if doing == "rebuilding" and (running := _processes_on(name)):
        pid, command = running[0]
        raise TestbedError(f"testbed {name!r} has {len(running)} process{'es' if len(running) > 1 else ''} running on "
                           f"its nodes (process {pid}: {cut(command)}): stop them, or run "
                           f"`{testbed_command('down', name)}` (which stops them) before rebuilding the testbed")


def _processes_on(name: str) -> list[tuple[int, str]]:
    """The processes running in the namespaces of testbed ``name``, with their command lines."""
    running = []
    for namespace in existing_namespaces(name):
        for pid in _run("ip", "netns", "pids", namespace).split():
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # ended meanwhile
                continue
            running.append((int(pid), command.strip()))
    return running


# What runs on the nodes for a job (``testbed run``: torchrun, ``shardwire.testbed.node``) or a link
# check (``testbed check``: its probes), as their command lines name them.
_STARTED_BY_SHARDWIRE = ("-m shardwire.testbed.node ", "shardwire/testbed/probe.py ")


def leftovers(name: str) -> list[tuple[int, str]]:
    """The processes a job or a link check started on the nodes of testbed ``name`` that still run,
    with their command lines: where no job or check holds the testbed (``running``), what one that
    was killed (SIGKILL ends it, not what it started) left behind, sharing the links with the next."""
    return [(pid, command) for pid, command in _processes_on(name)
            if any(mark in f"{command} " for mark in _STARTED_BY_SHARDWIRE)]


def _remove(name: str) -> list[str]:
    """``down``, by a command that holds the testbed."""
    namespaces = existing_namespaces(name)
    for namespace in namespaces:
        _stop_processes(namespace)
        _run("ip", "netns", "delete", namespace)
    if NETNS_ETC.is_dir():
        for files in NETNS_ETC.iterdir():
            if _owned_by(name).fullmatch(files.name):
                shutil.rmtree(files)
    state_path(name).unlink(missing_ok=True)
    cuts_path(name).unlink(missing_ok=True)
    return namespaces


def _stop_processes(namespace: str) -> None:
    """A namespace lives on, unnamed, while a process is inside it: end them, politely first."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(pid) for pid in _run("ip", "netns", "pids", namespace).split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and _run("ip", "netns", "pids", namespace).split():
            time.sleep(0.05)
