"""``shardwire testbed check``: does the testbed behave like the cluster it stands for?

Each measurement is one TCP stream (``probe.py``) of ``seconds`` at the link rate. A transfer from
each node to the next must reach at least half the link rate and no more than the shaping allows
(the rate, plus the burst the token bucket may pass at once); one inside a node, over its loopback,
must reach at least twice the link rate, so that the link, not the machine, is what limits traffic
between nodes.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

from shardwire.testbed import probe
from shardwire.testbed.network import burst_bytes, cut_off, in_namespace
from shardwire.testbed.spec import Testbed, TestbedFailure, format_rate

# Payload over the wire may exceed the rate by the bucket's burst, plus timer slack.
RATE_TOLERANCE = 1.02
MIN_FRACTION_OF_RATE = 0.5
MIN_INTRA_NODE_SPEEDUP = 2.0
# The receiver does not count its first read (up to a chunk, or about a bucket on a slow link), so a
# transfer is several chunks, or on a link too slow for that in seconds, many buckets.
MIN_TRANSFER_CHUNKS, MIN_TRANSFER_BUCKETS = 4, 32
# The longest transfer a check makes: ten minutes measure nothing one second does not, and hold the link.
MAX_SECONDS = 600.0


@dataclasses.dataclass(frozen=True)
class Transfer:
    source: int
    target: int
    nbytes: int
    seconds: float

    @property
    def bits_per_s(self) -> float:
        return self.nbytes * 8 / self.seconds


@dataclasses.dataclass(frozen=True)
class Finding:
    transfer: Transfer
    ok: bool
    verdict: str

    def __str__(self) -> str:
        t = self.transfer
        where = f"node{t.source} -> node{t.target}" if t.source != t.target else f"inside node{t.source}"
        return f"{where:<20} {format_rate(int(t.bits_per_s)) + '/s':>14}  {'ok' if self.ok else 'FAIL'}: {self.verdict}"


def transfer(testbed: Testbed, source: int, target: int, nbytes: int, timeout_s: float) -> Transfer:
    """Send ``nbytes`` from node ``source`` to node ``target`` over TCP and time it at the receiver."""
    script = [sys.executable, probe.__file__]
    address = testbed.address(target)
    receiver = subprocess.Popen(
        in_namespace(testbed.namespace(target), [*script, "receive", "--bind", address, "--timeout", str(timeout_s)]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        ready = receiver.stdout.readline().split()
        if ready[:1] != ["ready"]:
            raise TestbedFailure(f"the receiver on node{target} did not start: "
                                 f"{_said(receiver.stderr.read(), receiver.poll())}")
        sender = subprocess.run(
            in_namespace(testbed.namespace(source),
                         [*script, "send", "--to", address, "--port", ready[1], "--bytes", str(nbytes),
                          "--timeout", str(timeout_s)]),
            capture_output=True, text=True, timeout=timeout_s, check=False,
        )
        if sender.returncode != 0:
            raise TestbedFailure(f"sending from node{source} to node{target} failed: "
                                 f"{_said(sender.stderr, sender.returncode)}")
        out, err = receiver.communicate(timeout=timeout_s)
        if receiver.returncode != 0:
            raise TestbedFailure(f"receiving on node{target} from node{source} failed: "
                                 f"{_said(err, receiver.returncode)}")
        result = json.loads(out)
    except subprocess.TimeoutExpired:
        raise TestbedFailure(f"a transfer from node{source} to node{target} took over {timeout_s:g}s") from None
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    return Transfer(source, target, result["bytes"], result["seconds"])


def _said(stderr: str, status: int) -> str:
    """What a probe that failed said, in one line: the last of its standard error (a traceback's
    exception), or its status."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"it exited with status {status} and said nothing"


def check(testbed: Testbed, seconds: float = 1.0) -> list[Finding]:
    """Measure the links and judge each measurement; see the module docstring."""
    rate = testbed.rate_bits
    least = min(MIN_TRANSFER_CHUNKS * probe.CHUNK, MIN_TRANSFER_BUCKETS * burst_bytes(rate))
    nbytes = max(int(rate / 8 * seconds), least)
    timeout_s = 30 + 20 * seconds
    findings = []
    pairs = [(k, (k + 1) % testbed.nodes) for k in range(testbed.nodes)] if testbed.nodes > 1 else []
    started = time.time()
    for source, target in pairs:
        try:
            t = transfer(testbed, source, target, nbytes, timeout_s)
        except TestbedFailure as err:  # a link cut while it measured: named, as a failed job names it
            raise TestbedFailure(f"{err}{cut_off(testbed, started)}") from None
        ceiling = rate * RATE_TOLERANCE + burst_bytes(rate) * 8 / t.seconds
        share = f"{t.bits_per_s / rate:.0%} of the {format_rate(rate)} link"
        if t.bits_per_s > ceiling:
            findings.append(Finding(t, False, f"{share}: faster than the link allows, the shaping does not hold"))
        elif t.bits_per_s < MIN_FRACTION_OF_RATE * rate:
            findings.append(Finding(t, False, f"{share}: under half the link rate; is the machine busy?"))
        else:
            findings.append(Finding(t, True, share))
    t = transfer(testbed, 0, 0, nbytes, timeout_s)
    speedup = t.bits_per_s / rate
    findings.append(Finding(
        t, speedup >= MIN_INTRA_NODE_SPEEDUP,
        f"{speedup:.1f}x the link rate" + ("" if speedup >= MIN_INTRA_NODE_SPEEDUP else
                                           f", under {MIN_INTRA_NODE_SPEEDUP:g}x: the link is not the bottleneck"),
    ))
    return findings
