"""What a testbed is: its name, node count and link rate, the names and addresses that follow from
them, and the state file that tells later commands the testbed ``up`` built.

Every object a testbed creates is named after it (``NAME-hub``, ``NAME-node0``, ...), and names must
start with ``shardwire``, so ``down`` removes exactly what ``up`` made and nothing else. The state
file lives under /run, a tmpfs, so it vanishes at reboot together with the namespaces it describes,
beside the lock that lets one command at a time change a testbed (``held``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import ipaddress
import json
import os
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

from shardwire.files import ClaimHeld, claim_file, write_atomically
from shardwire.mappings import MAX_TEXT_BYTES, MappingError, cut, read_json, shown

STATE_DIR = Path("/run/shardwire/testbed")
DEFAULT_NAME = "shardwire"
NODE_INTERFACE = "eth0"  # each node's link, as on a server
# The nodes' private subnet. It never meets the host's networks: the namespaces have no route out.
SUBNET = ipaddress.ip_network("10.77.0.0/24")
MAX_NODES = 64
MIN_RATE, MAX_RATE = 10**5, 10**11  # 100 kbit/s (a GPU cluster's regime for a CPU rank: --like) to 100 Gbit/s

_NAME = re.compile(r"shardwire(-[a-z0-9]+)*")
# tc's units (tc(8)): decimal multiples of bits per second, and of bytes per second (bps: tc's bytes).
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
               "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12}
_RATE = re.compile(rf"([0-9]+(?:\.[0-9]+)?)({'|'.join(_RATE_UNITS)})")  # ASCII digits, as tc reads them


class TestbedError(RuntimeError):
    """A testbed command cannot go on; the message says what is wrong and what to do. Raised as is,
    it is a refusal (what the user gave or must do first: a bad name, no testbed up), which the
    command ends with a status of 2, as every command's refusals end."""


class TestbedFailure(TestbedError):
    """What the testbed's machinery could not do (an ``ip`` or ``tc`` command, a transfer ``check``
    timed): not the user's input, so the command ends with a status of 1, as a failed job does."""


def check_name(name: str) -> str:
    """``name`` if it is a testbed name, so that no command touches anything a testbed did not make."""
    if not _NAME.fullmatch(name) or len(name) > 40:
        raise TestbedError(
            f"testbed name {shown(name)} must be 'shardwire' and words of lowercase letters or digits, each after "
            f"one '-' (e.g. shardwire-ci, shardwire-ci-2), at most 40 characters"
        )
    return name


def parse_rate(text: str) -> int:
    """Bits per second from a tc-style rate such as ``1gbit``, ``2.5gbit`` or ``500mbit``."""
    match = _RATE.fullmatch(text.strip().lower())
    if not match:
        raise TestbedError(f"link rate {shown(text)} is not a rate like 1gbit, 2.5gbit or 500mbit (tc's units: "
                           f"{', '.join(_RATE_UNITS)}; bps is bytes per second)")
    bits = float(match[1]) * _RATE_UNITS[match[2]]  # infinite for a number past a float's range
    if not MIN_RATE <= bits <= MAX_RATE:
        raise TestbedError(f"link rate {shown(text)} is outside {format_rate(MIN_RATE)} to {format_rate(MAX_RATE)}")
    return round(bits)


def rate_option(bits: int) -> str:
    """``bits`` per second as ``--link`` takes it back, exactly: ``format_rate``'s words where they
    read back as ``bits``, else the bits themselves, so that a printed ``up`` builds this very rate."""
    shown = format_rate(bits)
    return shown if parse_rate(shown) == bits else f"{bits}bit"


def testbed_command(action: str, name: str, *rest: str) -> str:
    """``shardwire testbed ACTION`` on testbed ``name``, as a message suggests it: with ``--name``
    unless it is the default (an action without it acts on the default testbed), so that it runs as
    printed."""
    named = ["--name", name] if name != DEFAULT_NAME else []
    return shlex.join(["shardwire", "testbed", action, *named, *rest])


def format_rate(bits: int) -> str:
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bits >= _RATE_UNITS[unit]:
            return f"{bits / _RATE_UNITS[unit]:.4g}{unit}"
    return f"{bits}bit"


@dataclasses.dataclass(frozen=True)
class Testbed:
    """A testbed: ``nodes`` namespaces, each with one link of ``rate_bits`` bits per second in each
    direction, and everything named after ``name``."""

    name: str
    nodes: int
    rate_bits: int

    def __post_init__(self):
        check_name(self.name)
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or not 1 <= self.nodes <= MAX_NODES:
            raise TestbedError(f"--nodes must be between 1 and {MAX_NODES}, got {shown(self.nodes)}")
        if isinstance(self.rate_bits, bool) or not isinstance(self.rate_bits, int) or not (
                MIN_RATE <= self.rate_bits <= MAX_RATE):
            raise TestbedError(f"the link rate must be {format_rate(MIN_RATE)} to {format_rate(MAX_RATE)}, got "
                               f"{shown(self.rate_bits)} bit/s")

    @property
    def hub(self) -> str:
        """The namespace holding the bridge that joins the nodes' links, the emulated switch."""
        return f"{self.name}-hub"

    def namespace(self, node: int) -> str:
        return f"{self.name}-node{node}"

    @property
    def namespaces(self) -> list[str]:
        return [self.hub, *(self.namespace(k) for k in range(self.nodes))]

    def node(self, text: str) -> int:
        """The node ``text`` names, as ``up`` lists them: ``node1``, or ``1``."""
        index = text.removeprefix("node")
        if (not (index.isascii() and index.isdigit()) or len(index) > len(str(self.nodes))
                or int(index) >= self.nodes or index != str(int(index))):
            raise TestbedError(f"no node {shown(text)} on {self.describe()}: give one of node0 to node{self.nodes - 1}")
        return int(index)

    def address(self, node: int) -> str:
        return str(SUBNET[node + 1])

    def switch_port(self, node: int) -> str:
        """The hub's end of a node's link (the node's end is ``NODE_INTERFACE`` in its namespace)."""
        return f"node{node}"

    def up_command(self) -> str:
        """The command that builds this testbed, nodes and rate as they are."""
        return testbed_command("up", self.name, "--nodes", str(self.nodes), "--link", rate_option(self.rate_bits))

    def describe(self) -> str:
        return f"testbed {self.name!r}: {self.nodes} node(s) on {format_rate(self.rate_bits)} links"

    def save(self) -> None:
        """Write the state file atomically, so a crash never leaves a half-written one."""
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        write_atomically(state_path(self.name), json.dumps(dataclasses.asdict(self)), durable=True)

    @classmethod
    def load(cls, name: str) -> Testbed:
        """The testbed ``up`` recorded for ``name``; an error that says how to build one if none is up."""
        path = state_path(name)
        if not path.exists():
            example = testbed_command("up", name, "--nodes", "2", "--link", "1gbit")
            raise TestbedError(f"no testbed {name!r} is up; build one first, e.g. `{example}`")
        remedy = f"run `{testbed_command('down', name)}` and up again"
        try:
            recorded = cls(**read_json(str(path), f"the state file {path}", kind="testbed's state", remedy=remedy,
                                       limit=MAX_TEXT_BYTES))
        except MappingError as err:
            raise TestbedError(str(err)) from None
        except (TestbedError, ValueError, TypeError) as err:  # a value up never records: edited, or damaged
            raise TestbedError(f"the state file {path} is damaged ({cut(str(err))}); {remedy}") from None
        if recorded.name != name:
            raise TestbedError(f"the state file {path} is damaged (it records testbed {recorded.name!r}); {remedy}")
        return recorded


def cuts_path(name: str) -> Path:
    """Where ``testbed link ... down`` records when it cut each node off (``record_cut``)."""
    return STATE_DIR / f"{name}.cuts"


def record_cut(name: str, node: int, at: float) -> None:
    """Note that node ``node`` of testbed ``name`` was cut off at ``at`` (seconds since the epoch): a
    job that fails after, its link up again or not, names it (``cut_since``)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(cuts_path(name), "a", encoding="utf-8") as cuts:
        cuts.write(f"{node} {at}\n")


def cut_since(name: str, since: float) -> list[int]:
    """The nodes of testbed ``name`` cut off at or after ``since``, sorted; none where none was."""
    try:
        lines = cuts_path(name).read_text(encoding="utf-8").splitlines()[-1000:]  # a testbed's, bounded
    except (OSError, UnicodeError):
        return []
    cut = set()
    for line in lines:
        node, _, at = line.partition(" ")
        with contextlib.suppress(ValueError):
            if float(at) >= since:
                cut.add(int(node))
    return sorted(cut)


def state_path(name: str) -> Path:
    return STATE_DIR / f"{name}.json"


@contextlib.contextmanager
def running(name: str) -> Iterator[None]:
    """Hold testbed ``name`` for one job, for as long as it runs: a second job would find its
    rendezvous port taken by the first and blame an unreachable node, and share the links it
    measures; ``up`` and ``down`` would remove the nodes under it (``job_on``). A claim file, which
    the system releases when its holder ends, however it ends."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    try:
        fd = claim_file(STATE_DIR / f"{name}.job")
    except ClaimHeld as err:
        raise TestbedError(f"testbed {name!r} is running another job ({err.owner}): wait for it to end, or stop "
                           f"it; a testbed runs one job at a time") from None
    try:
        yield
    finally:
        os.close(fd)


def job_on(name: str) -> str | None:
    """Who runs a job on testbed ``name`` (``running``), in words, or None where none does."""
    if not (STATE_DIR / f"{name}.job").exists():  # no job ever ran here: nothing to claim, nor to make
        return None
    try:
        os.close(claim_file(STATE_DIR / f"{name}.job"))
    except ClaimHeld as err:
        return err.owner
    except FileNotFoundError:  # removed meanwhile
        return None
    return None


@contextlib.contextmanager
def held(name: str) -> Iterator[None]:
    """Hold testbed ``name`` for one command that changes it. ``up`` and ``down`` look at what exists
    and then change it: two at once would interleave those steps, one's clean-up removing what the
    other built. The lock is an flock, which the kernel releases when its holder ends, however it
    ends, so a killed command never leaves the testbed locked."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(STATE_DIR / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another command building or removing testbed {name!r} to finish",
                  file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
