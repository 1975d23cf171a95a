"""The link rate that puts this machine in a GPU cluster's regime (``shardwire testbed up --like``).

Whether the network sets a training step depends on how much a node computes per byte its link
carries. Eight H100s share one 100 GbE NIC at about 600,000 FLOP per byte; a CPU rank here computes
about 10^11 FLOP/s, so even a 100 Mbit/s link gives it far more network per FLOP than that cluster
has. ``--like PRESET`` shapes the links so that a node here (its ranks' measured matrix-multiply
rate, together) over its link has PRESET's FLOP per byte: its GPUs' rate (the data sheet's peak in
the dtype they train in, at the matrix-multiply efficiency the simulator gives them) over the
bandwidth between its nodes. A job with as many tokens per node as on PRESET then waits on its link
for the same share of its step.
"""

from __future__ import annotations

import dataclasses
import os

from shardwire.mappings import shown
from shardwire.testbed import network
from shardwire.testbed.spec import MAX_RATE, MIN_RATE, Testbed, TestbedError, format_rate

PROBE_SECONDS = 1.0
SIGNIFICANT_DIGITS = 2
# Run to run, the probe of a rank's compute here moves by a few percent (134 to 148 GFLOP/s), which
# can carry the rate over a rounding edge: a testbed up within this of the rate measured is kept.
KEPT_WITHIN = 0.15


@dataclasses.dataclass(frozen=True)
class Regime:
    """A preset's FLOP per network byte and this machine's node: its ranks and what each computes."""

    preset: str
    node_flops: float  # the preset's node: its GPUs' FLOP/s together
    node_bytes_per_s: float  # the preset's bandwidth between nodes, per node
    rank_flops: float  # a rank here: its threads' measured rate, times its share of their time
    ranks_per_node: int
    threads: int  # each rank's compute threads here
    share: float = 1.0  # of its threads' time a rank gets where ranks outnumber the cores

    @property
    def flop_per_byte(self) -> float:
        return self.node_flops / self.node_bytes_per_s

    @property
    def rate_bits(self) -> int:
        exact = 8 * self.ranks_per_node * self.rank_flops / self.flop_per_byte
        return int(float(f"{exact:.{SIGNIFICANT_DIGITS}g}"))

    def describe(self) -> list[str]:
        return [
            f"{self.preset}: a node computes {self.node_flops / 1e15:.3g} PFLOP/s over "
            f"{self.node_bytes_per_s / 1e9:.3g} GB/s between nodes, {self.flop_per_byte:,.0f} FLOP per byte",
            f"here: a rank computes {self.rank_flops / 1e9:.3g} GFLOP/s (fp32 matrix multiply, {self.threads} "
            f"thread(s){'' if self.share == 1 else f', {self.share:.2g} of their time'}), "
            f"{self.ranks_per_node} per node: links of {format_rate(self.rate_bits)}",
        ]


def kept_rate(name: str, nodes: int, measured: int) -> int:
    """The rate of testbed ``name`` where it is up with ``nodes`` nodes within ``KEPT_WITHIN`` of the
    rate ``measured``, so that a second ``up --like`` keeps it; else ``measured``."""
    try:
        recorded = Testbed.load(name)
    except TestbedError:
        return measured
    if (recorded.nodes == nodes and abs(recorded.rate_bits - measured) <= KEPT_WITHIN * measured
            and network.is_up(recorded)):
        return recorded.rate_bits
    return measured


def like(preset: str, nodes: int, ranks_per_node: int) -> Regime:
    """The regime of cluster ``preset`` (``shardwire.sim.presets.CLUSTERS``) for a job of
    ``ranks_per_node`` ranks on each of ``nodes`` nodes here, measuring a rank's compute with the
    threads each will have (``shardwire testbed run`` gives each rank cores / all ranks, at least
    one) and, where ranks outnumber the cores, counting the share of the cores' time each gets."""
    import torch

    from shardwire.profile.flops import probe_peak_tflops
    from shardwire.sim.presets import CLUSTERS

    if preset not in CLUSTERS:
        raise TestbedError(f"--like {shown(preset)} is not a cluster preset; "
                           f"choose one of {', '.join(sorted(CLUSTERS))}")
    if ranks_per_node < 1:
        raise TestbedError(f"--nproc-per-node must be at least 1, got {ranks_per_node}")
    cluster = CLUSTERS[preset]
    cores, ranks = os.cpu_count() or 1, nodes * ranks_per_node
    threads = max(1, cores // ranks)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        threads_flops = probe_peak_tflops(torch.device("cpu"), torch.float32, PROBE_SECONDS) * 1e12
    finally:
        torch.set_num_threads(before)
    share = min(1.0, cores / (ranks * threads))  # all ranks compute at once on this machine's cores
    regime = Regime(
        preset=preset,
        node_flops=cluster.gpus_per_node * cluster.peak_tflops * 1e12 * cluster.matmul_efficiency,
        node_bytes_per_s=cluster.inter_node.busbw_GBps * 1e9,
        rank_flops=threads_flops * share,
        ranks_per_node=ranks_per_node,
        threads=threads,
        share=share,
    )
    if not MIN_RATE <= regime.rate_bits <= MAX_RATE:
        raise TestbedError(
            f"{preset}'s regime needs links of {format_rate(regime.rate_bits)} here, outside the "
            f"{format_rate(MIN_RATE)} to {format_rate(MAX_RATE)} a testbed shapes: choose another preset"
        )
    return regime
