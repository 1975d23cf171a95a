"""Scaling over an emulated Ethernet cluster: shardwire vs PyTorch FSDP2 vs DDP, 1 to 4 ranks on one
and two nodes, and how close each comes to the fastest step the machine and the link allow.

    python benchmarks/scaling.py --model 30m --links 1gbit 5gbit --out-dir benchmarks/results/scaling
    python benchmarks/scaling.py --model small --clusters 2x1 --like h100-100gbe --out-dir ...

Two-node clusters run on a testbed of this machine (``shardwire testbed``, so: root) rebuilt for
each ``--links`` rate, one-node clusters on plain local workers. Every measurement runs in fresh
torchrun workers, and the systems take turns ``--repeats`` times so that drift on a shared machine
falls on all of them alike. Per cluster and system:

* step time: the median over the timed steps of every repeat; a step's time is its slowest rank's;
* tokens/s: the global batch's tokens over the step time;
* scaling efficiency, as the field defines it, time per sample at N workers against one worker:
  with a fixed per-rank batch, the same system's step time on 1 rank over its step time on N;
* inter-node bytes per step: what the nodes' links received during the timed steps (the ``eth0``
  counters of every node, summed: each byte that crosses between nodes is received once);
* compute-only time: every rank runs the same step on its own unsharded replica, with no
  communication in it, at the same per-rank batch and threads; all ranks compute at once, so each
  has the share of the machine's cores it has in the real step (its optimizer updates the whole
  model, not a shard: a little more than a sharded rank's work);
* communication-only time: the collectives one step of the system issued, recorded, then replayed
  on their own, all issued at once (``StepCollectives`` in systems.py);
* the bound: max(compute-only, communication-only), which even a step that overlaps the two
  perfectly cannot beat; the report shows step time over it;
* the link bound (clusters of several nodes): max(compute-only, the bytes each node sent over its
  link per step / the link's rate), what a step could take if its collectives cost no CPU and kept
  the link busy all the time; the report shows step time over it;
* peak memory per rank: the largest resident set size (``ru_maxrss``) of any rank by the end of
  the timed steps: the whole process (interpreter, torch, buffers), alike for every system;
* shardwire only (each cluster), in a run of its own: the step profiled (``shardwire.profile``),
  its profile kept in ``profiles/SYSTEM/LAYOUT``; its compute per phase, measured by the engine
  under the step's own contention for the cores, is what ``calibrate_sim.py`` feeds the simulator.

It writes scaling.json (every measurement), scaling.md (the table) and scaling.png into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measure import median, net_bytes, run_torchrun  # noqa: E402
from systems import SHARDWIRE_SYSTEMS, SYSTEMS, StepCollectives, TrainingStep, wrap  # noqa: E402

from shardwire.models.gpt import GPT, PRESETS  # noqa: E402
from shardwire.testbed.spec import TestbedError  # noqa: E402

TESTBED = "shardwire-scaling"  # its own testbed, apart from any a user has up


@dataclasses.dataclass(frozen=True)
class Cluster:
    nodes: int
    ranks_per_node: int
    link: str | None  # the link rate between nodes; None on one node

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def __str__(self) -> str:
        shape = f"{self.nodes}x{self.ranks_per_node}"
        return shape if self.link is None else f"{shape} @{self.link}"


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = PRESETS[args.model]
    model = GPT(config)
    if args.measure != "compute":
        model = wrap(args.system, model, reshard=args.reshard, prefetch=args.prefetch)
    collectives = StepCollectives(args.system, model) if args.measure == "comm" else None
    step = TrainingStep(None if args.measure == "compute" else args.system, model, config, args.batch)
    profiler = None
    if args.measure == "profile":
        from shardwire.profile.profiler import Profiler

        profiler = Profiler(model, step.optimizer, tokens_per_step=args.batch * world * config.seq_len,
                            probe_peak=False, warmup_steps=0)

    def total(value: float, op=dist.ReduceOp.SUM) -> float:
        value = torch.tensor(value, dtype=torch.float64)
        dist.all_reduce(value, op=op)
        return value.item()

    def link_bytes() -> float:
        """Bytes this node's link has received, counted once per node (by its first rank)."""
        mine = args.link_interface and os.environ.get("LOCAL_RANK", "0") == "0"
        return total(net_bytes(args.link_interface) if mine else 0.0)

    for _ in range(args.warmup):
        step()
    timed = step
    if collectives is not None:
        with collectives.record():
            step()
        timed = collectives.replay
    times = []
    received = link_bytes()
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        with profiler.step() if profiler else contextlib.nullcontext():
            timed()
        times.append(total(time.perf_counter() - start, dist.ReduceOp.MAX))
    received = link_bytes() - received
    peak_rss = total(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0, dist.ReduceOp.MAX)
    summary = profiler.save(args.profile_dir) if profiler else None
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({
                "times_s": times,
                # barriers and the timing all-reduces add a few hundred bytes per step
                "link_bytes_per_step": received / args.steps,
                "peak_rss_bytes": peak_rss,
                "tokens_per_step": args.batch * world * config.seq_len,
                "profile": summary and {name: stats["median"] for name, stats in summary["figures"].items()},
            }, f)
    # Every rank is done; leave without gloo's teardown, which at times aborts the process ("terminate
    # called without an active exception") once the results are written, and would fail the run.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@dataclasses.dataclass
class Row:
    system: str
    cluster: Cluster
    tokens_per_step: int
    step_times: list = dataclasses.field(default_factory=list)
    comm_times: list = dataclasses.field(default_factory=list)
    link_bytes_per_step: float = 0.0
    peak_rss_bytes: float = 0.0
    profile: dict | None = None  # shardwire's profiled step: each figure's median over ranks and steps

    @property
    def step_s(self) -> float:
        return median(self.step_times)

    @property
    def comm_s(self) -> float:
        return median(self.comm_times)


class Runner:
    """Runs workers for each cluster, on local processes or on the testbed built for its link."""

    def __init__(self, args):
        self.args = args
        self.testbed: tuple[int, str] | None = None  # (nodes, link) of the testbed that is up
        self.passthrough = [
            "--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--prefetch", str(args.prefetch),
            "--reshard" if args.reshard else "--no-reshard",
        ]

    def run(self, cluster: Cluster, measure: str, system: str | None = None) -> dict:
        threads = max(1, (os.cpu_count() or 1) // cluster.world)
        worker_args = ["--measure", measure, *(["--system", system] if system else []), *self.passthrough]
        if measure == "profile":
            profile_dir = os.path.join(self.args.out_dir, "profiles", system, str(cluster).replace(" @", "-"))
            worker_args += ["--profile-dir", os.path.abspath(profile_dir)]
        launcher = None
        if cluster.nodes > 1:
            self._testbed(cluster)
            launcher = [sys.executable, "-m", "shardwire", "testbed", "run", "--name", TESTBED,
                        "--nproc-per-node", str(cluster.ranks_per_node), "--"]
            worker_args += ["--link-interface", "eth0"]
        try:
            return run_torchrun(cluster.world, __file__, worker_args, threads=threads, launcher=launcher)
        except subprocess.CalledProcessError as err:
            raise SystemExit(f"error: the {measure} pass of {system or 'the bare model'} on {cluster} failed "
                             f"(exit {err.returncode}); its output is above") from None

    def _testbed(self, cluster: Cluster) -> None:
        from shardwire.testbed import network
        from shardwire.testbed.spec import Testbed, parse_rate

        if self.testbed != (cluster.nodes, cluster.link):
            network.up(Testbed(TESTBED, cluster.nodes, parse_rate(cluster.link)))
            self.testbed = (cluster.nodes, cluster.link)

    def close(self) -> None:
        if self.testbed is not None:
            from shardwire.testbed import network

            network.down(TESTBED)


def parse_clusters(shapes: list[str], links: list[str], like: str | None = None) -> list[Cluster]:
    """One-node clusters by size, then the others by size for each link in turn (one testbed each);
    with ``like``, each at the rate of that cluster preset's regime for its ranks per node."""
    parsed = []
    for shape in shapes:
        nodes, _, ranks = shape.partition("x")
        if not (nodes.isdigit() and ranks.isdigit() and int(nodes) >= 1 and int(ranks) >= 1):
            raise SystemExit(f"error: cluster {shape!r} is not NODESxRANKS_PER_NODE, e.g. 2x2")
        parsed.append((int(nodes), int(ranks)))
    parsed = sorted(set(parsed), key=lambda shape: (shape[0] * shape[1], shape[0]))
    single = [Cluster(1, ranks, None) for nodes, ranks in parsed if nodes == 1]
    several = [(nodes, ranks) for nodes, ranks in parsed if nodes > 1]
    if like is None:
        return single + [Cluster(nodes, ranks, link) for link in links for nodes, ranks in several]
    from shardwire.testbed import regime
    from shardwire.testbed.spec import format_rate

    clusters = []
    for nodes, ranks in several:
        matched = regime.like(like, nodes, ranks)
        print("; ".join(matched.describe()), file=sys.stderr)
        clusters.append(Cluster(nodes, ranks, format_rate(matched.rate_bits)))
    return single + clusters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help="directory for scaling.json, scaling.md, scaling.png and profiles/")
    parser.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--measure", choices=["time", "compute", "comm", "profile"], default="time",
                        help=argparse.SUPPRESS)
    parser.add_argument("--link-interface", default="", help=argparse.SUPPRESS)
    parser.add_argument("--profile-dir", help=argparse.SUPPRESS)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--clusters", nargs="+", default=["1x1", "1x2", "1x4", "2x1", "2x2"],
                        help="NODESxRANKS_PER_NODE; clusters of several nodes run once per --links rate")
    rates = parser.add_mutually_exclusive_group()
    rates.add_argument("--links", nargs="+", default=["1gbit", "5gbit"], help="link rates between nodes")
    rates.add_argument("--like", metavar="PRESET",
                        help="instead of --links: the rate of a GPU cluster preset's regime (`shardwire testbed "
                             "up --like`), measured here for each cluster's ranks per node")
    parser.add_argument("--model", default="30m", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--reshard", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if not args.out_dir:
        parser.error("--out-dir is required: the directory the table, plot and measurements go to")
    if args.warmup < 2:
        parser.error("--warmup must be at least 2: DDP rebuilds its buckets and shardwire records its order in step 1")
    try:
        from shardwire.testbed.network import require_privileges
        from shardwire.testbed.spec import parse_rate

        if args.like:  # before a second of measuring for each cluster
            require_privileges("up")
        clusters = parse_clusters(args.clusters, args.links, args.like)
        if any(cluster.nodes > 1 for cluster in clusters):
            require_privileges("up")
            for cluster in clusters:
                if cluster.link is not None:
                    parse_rate(cluster.link)
    except TestbedError as err:
        raise SystemExit(f"error: clusters of several nodes run on an emulated cluster: {err}") from None

    rows, compute = measure_all(args, clusters)
    os.makedirs(args.out_dir, exist_ok=True)
    table = report(rows, compute, args)
    print(table)
    with open(os.path.join(args.out_dir, "scaling.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out_dir, "scaling.json"), "w") as f:
        json.dump({
            "args": {k: v for k, v in vars(args).items()
                     if k not in ("worker", "out", "system", "measure", "link_interface", "profile_dir")},
            "compute_times_s": {str(world): times for world, times in compute.items()},
            "rows": [dataclasses.asdict(row) | {"cluster": str(row.cluster)} for row in rows.values()],
        }, f, indent=1)
    plot(rows, compute, os.path.join(args.out_dir, "scaling.png"))


def measure_all(args, clusters: list[Cluster]) -> tuple[dict[tuple[str, Cluster], Row], dict[int, list[float]]]:
    runner = Runner(args)
    rows: dict[tuple[str, Cluster], Row] = {}
    compute: dict[int, list[float]] = {}
    try:
        for cluster in clusters:
            if cluster.world not in compute:  # the same on one node as on several: no communication
                local = Cluster(1, cluster.world, None)
                compute[cluster.world] = runner.run(local, "compute")["times_s"]
            for _ in range(args.repeats):
                for system in args.systems:
                    result = runner.run(cluster, "time", system)
                    row = rows.setdefault((system, cluster), Row(system, cluster, result["tokens_per_step"]))
                    row.step_times += result["times_s"]
                    row.link_bytes_per_step = result["link_bytes_per_step"]  # the same every repeat
                    row.peak_rss_bytes = max(row.peak_rss_bytes, result["peak_rss_bytes"])
            for system in args.systems:
                rows[(system, cluster)].comm_times = runner.run(cluster, "comm", system)["times_s"]
            for system in args.systems:
                if system in SHARDWIRE_SYSTEMS:
                    rows[(system, cluster)].profile = runner.run(cluster, "profile", system)["profile"]
            print(f"measured {cluster}", file=sys.stderr, flush=True)
    finally:
        runner.close()
    return rows, compute


def report(rows: dict, compute: dict, args) -> str:
    lines = [
        f"GPT {args.model!r}, {args.batch} sequences per rank, {'reshard' if args.reshard else 'keep'} after "
        f"forward, prefetch {args.prefetch}; {args.steps} timed steps x {args.repeats} repeats; "
        f"{os.cpu_count()} cores shared by all ranks" + (f"; links in {args.like}'s regime" if args.like else ""),
        "",
        "| cluster | system | step time | tokens/s | scaling eff. | vs FSDP2 | inter-node MiB/step "
        "| peak RSS/rank | compute-only | comm-only | bound | step / bound | link bound | step / link bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (system, cluster), row in rows.items():
        single = rows.get((system, Cluster(1, 1, None)))
        fsdp2 = rows.get(("fsdp2", cluster))
        compute_s = median(compute[cluster.world])
        bound = max(compute_s, row.comm_s)
        link_bound = link_bound_s(row, compute_s)
        lines.append(
            f"| {cluster} | {system} | {row.step_s * 1e3:.0f} ms | {row.tokens_per_step / row.step_s:,.0f} "
            f"| {f'{single.step_s / row.step_s:.2f}' if single else '-'} "
            f"| {f'{row.step_s / fsdp2.step_s:.2f}' if fsdp2 else '-'} "
            f"| {row.link_bytes_per_step / 2**20:.1f} | {row.peak_rss_bytes / 2**20:.0f} MiB "
            f"| {compute_s * 1e3:.0f} ms | {row.comm_s * 1e3:.0f} ms "
            f"| {bound * 1e3:.0f} ms | {row.step_s / bound:.2f} "
            + (f"| {link_bound * 1e3:.0f} ms | {row.step_s / link_bound:.2f} |" if link_bound else "| - | - |")
        )
    target = Cluster(2, 2, "1gbit")
    ours = [rows[(system, target)] for system in SHARDWIRE_SYSTEMS if (system, target) in rows]
    if ours and ("fsdp2", target) in rows and ("ddp", target) in rows:
        best = min(ours, key=lambda row: row.step_s)
        fsdp2, ddp = rows[("fsdp2", target)], rows[("ddp", target)]
        lines += ["", f"Targets on {target}: the best shardwire layout, {best.system}: step "
                      f"{best.step_s / fsdp2.step_s:.2f} x FSDP2's full sharding (target <= 0.45), "
                      f"{best.step_s / ddp.step_s:.2f} x DDP's (target <= 0.9), peak memory per rank "
                      f"{best.peak_rss_bytes / ddp.peak_rss_bytes:.2f} x DDP's (target < 1)."]
    return "\n".join(lines)


def link_bound_s(row: Row, compute_s: float) -> float | None:
    """max(compute-only, the bytes one node sent per step over the link's rate); None on one node.
    Every byte that crosses is received by one node, and the layouts send alike from every node."""
    if row.cluster.link is None:
        return None
    from shardwire.testbed.spec import parse_rate

    from_each_node = row.link_bytes_per_step / row.cluster.nodes * 8 / parse_rate(row.cluster.link)
    return max(compute_s, from_each_node)


def plot(rows: dict, compute: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clusters = list(dict.fromkeys(cluster for _, cluster in rows))
    systems = list(dict.fromkeys(system for system, _ in rows))
    width = 0.8 / len(systems)
    fig, (times, efficiency, traffic) = plt.subplots(3, 1, figsize=(max(8, 1.6 * len(clusters)), 11), sharex=True)
    for i, system in enumerate(systems):
        at = [k + (i - (len(systems) - 1) / 2) * width for k in range(len(clusters))]
        got = [rows.get((system, cluster)) for cluster in clusters]
        times.bar(at, [r.step_s if r else 0 for r in got], width, label=system)
        bounds = [max(median(compute[l.world]), r.comm_s) if r else float("nan") for l, r in zip(clusters, got)]
        times.scatter(at, bounds, marker="_", s=300, color="black", zorder=3,
                      label="bound: max(compute-only, comm-only)" if i == 0 else None)
        single = rows.get((system, Cluster(1, 1, None)))
        efficiency.bar(at, [single.step_s / r.step_s if r and single else 0 for r in got], width, label=system)
        traffic.bar(at, [r.link_bytes_per_step / 2**20 if r else 0 for r in got], width, label=system)
    times.set_ylabel("step time (s)")
    times.legend()
    efficiency.set_ylabel("scaling efficiency\n(time/sample, 1 rank vs N)")
    efficiency.axhline(1.0, color="gray", linewidth=0.8)
    traffic.set_ylabel("inter-node MiB / step")
    traffic.set_xticks(range(len(clusters)), [str(cluster) for cluster in clusters])
    traffic.set_xlabel("cluster: nodes x ranks per node @ link rate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
