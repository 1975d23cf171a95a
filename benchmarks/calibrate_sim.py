"""Calibrate the simulator against this machine: predict shardwire's measured step times from the
measured network and the measured compute, and compare.

    shardwire testbed up --nodes 2 --link 1gbit
    shardwire testbed run --nproc-per-node 2 -- -m shardwire bench --groups intra inter \
        --impl shardwire --ops all_gather reduce_scatter -b 64K -e 64M --contention --json bench-1gbit.json
    shardwire testbed run --nproc-per-node 1 -- -m shardwire bench --groups inter \
        --impl shardwire --ops all_gather reduce_scatter -b 64K -e 64M --contention --json bench-2x1-1gbit.json
    shardwire testbed down
    python benchmarks/scaling.py --systems shardwire --links 1gbit --out-dir benchmarks/results/scaling
    python benchmarks/calibrate_sim.py --measured benchmarks/results/scaling/scaling.json \
        --bench 1gbit=bench-1gbit.json 2x1@1gbit=bench-2x1-1gbit.json

The simulator is given what was measured on this machine, as a user would give it what one GPU
and the network measured, and predicts how the step's communication overlaps its computation and
how much each slows the other:

* compute: the profile of the 1x1 run (one rank, the whole machine: ``shardwire.profile``, as
  ``benchmarks/scaling.py`` takes it of each shardwire step) calibrates the compute model
  (``shardwire simulate --calibrate``, ``shardwire.sim.calibrate``): its optimizer step gives the
  rate the optimizer streams its state at, its forward and backward the fraction of the machine's
  peak the kernels reach (a CPU's memory bandwidth is not given: its memory-bound work is folded
  into that fraction). A CPU has no data sheet here: it is given a nominal peak, twice the FLOP rate
  the 1x1 run's forward and backward reached (only the peak times the fitted fraction enters a
  prediction). The rate a lane thread quantizes at, for the quantized wires, is timed here;
* the machine's share per rank: on the testbed every rank of every node runs on this machine's two
  cores, so a rank of a run on W ranks gets the part of the machine the benchmark's compute-only
  step shows (the same model as an unsharded replica on W ranks, no communication: its step at 1
  rank over its step at W); a GPU cluster, a GPU per rank, has no such term;
* the network, from ``shardwire bench --contention --json`` run on the emulated cluster with the
  engine's own collectives (``--impl shardwire``): busbw and per-step latency of each level, the
  hierarchical algorithm the engine uses on gloo, and each level's compute share and bandwidth
  share, the part of a rank's compute a running all-gather of that level takes and the part of the
  all-gather's bandwidth the compute takes (``shardwire simulate --cluster-from``); runs on one
  node use the intra-node level only, which is the same loopback on and off the testbed. A bench
  run on the cluster of a run (``2x1@1gbit``) measures its shares as that run sees them (how many
  ranks share the cores sets them); a link's bench (``1gbit``, on 2 x 2) serves its other clusters.

Each shardwire run of ``benchmarks/scaling.py``'s JSON (every sharding layout it measured, hybrid
ones in groups of a node's ranks) is then predicted and set against its measured median step time;
the target is agreement within ``TOLERANCE``. A measured JSON without a 1x1 run takes the profile
of another's (``--one-rank``, measured on this machine). The engine's compute as its profile
measured it inside each step is shown beside the predicted compute, slowdown and exposed
communication.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from systems import SHARDWIRE_SYSTEMS  # noqa: E402

from shardwire.comm.quantize import encode_rate  # noqa: E402
from shardwire.models.gpt import PRESETS  # noqa: E402
from shardwire.sim.architecture import architecture  # noqa: E402
from shardwire.sim.calibrate import Measured, calibrated  # noqa: E402
from shardwire.sim.inputs import cluster_from_bench  # noqa: E402
from shardwire.sim.predict import Prediction, predict  # noqa: E402
from shardwire.sim.specs import ClusterSpec, LinkSpec, ModelSpec, TrainingSpec, as_dict, parse  # noqa: E402

TOLERANCE = 0.15


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every run in the measured JSON shares."""

    model: str
    batch: int  # sequences per rank
    prefetch: int
    reshard: bool


@dataclasses.dataclass(frozen=True)
class Run:
    system: str  # a shardwire layout of systems.py
    nodes: int
    ranks_per_node: int
    link: str | None  # the emulated link's rate, None on one node
    step_time_s: float  # measured median
    share: float  # the machine's compute each rank gets: the compute-only step at 1 rank over at this many
    profile: dict  # the engine's profile of the step: each figure's median over ranks and steps

    @property
    def engine_compute_s(self) -> float:
        """The step's compute as the engine measured it: forward, backward and the optimizer."""
        return self.profile["forward_s"] + self.profile["backward_s"] + self.profile["optimizer_s"]

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def cluster(self) -> str:
        shape = f"{self.nodes}x{self.ranks_per_node}"
        return shape if self.link is None else f"{shape} @{self.link}"


def read_measured(doc: dict, one_rank_s: float | None = None) -> tuple[Settings, list[Run], float]:
    """The shardwire runs of ``benchmarks/scaling.py``'s scaling.json: ``{"args": {...},
    "compute_times_s": {WORLD: [s]}, "rows": [{"system", "cluster": "2x2 @1gbit", "step_times",
    "profile"}]}``, and its compute-only step on one rank (``one_rank_s`` where ``doc`` has none)."""
    args = doc["args"]
    settings = Settings(model=args["model"], batch=args["batch"], prefetch=args["prefetch"], reshard=args["reshard"])
    compute_only = {int(world): statistics.median(times) for world, times in doc["compute_times_s"].items()}
    alone = compute_only.get(1, one_rank_s)
    if alone is None:
        raise ValueError("the measured JSON has no compute-only step on one rank: give --one-rank")
    runs = []
    for row in doc["rows"]:
        if row["system"] not in SHARDWIRE_SYSTEMS:
            continue
        shape, _, link = row["cluster"].partition(" @")
        nodes, _, per_node = shape.partition("x")
        nodes, per_node = int(nodes), int(per_node)
        if not row.get("profile"):
            raise ValueError(f"shardwire's run on {row['cluster']} has no profile: measure it again with "
                             f"this version of benchmarks/scaling.py")
        runs.append(Run(row["system"], nodes, per_node, link or None, statistics.median(row["step_times"]),
                        alone / compute_only[nodes * per_node], row["profile"]))
    if not runs:
        raise ValueError("the measured JSON has no shardwire run: run benchmarks/scaling.py with shardwire")
    return settings, runs, alone


def model_spec(settings: Settings) -> ModelSpec:
    """The simulator's description of the benchmark's GPT (``shardwire.models.gpt``)."""
    return PRESETS[settings.model].spec(f"gpt {settings.model}")


def one_rank(runs: list[Run]) -> Run:
    """The run on one rank, whose profile calibrates the machine."""
    single = [run for run in runs if run.ranks == 1]
    if not single:
        raise ValueError("the measured JSON has no shardwire run on 1x1 to calibrate with: give --one-rank")
    return single[0]


# The machine's nominal peak, over the FLOP rate its one-rank forward and backward reached.
NOMINAL_PEAK = 2.0


def machine_cluster(single: Run, settings: Settings) -> ClusterSpec:
    """This machine as one 'GPU', its compute model fitted to the profile of the run on one rank."""
    f = single.profile
    model_flops = 3 * architecture(model_spec(settings), 4).forward_flops * settings.batch
    reached = model_flops / (f["forward_s"] + f["backward_s"])
    placeholder = LinkSpec(busbw_GBps=1.0)  # replaced by the bench's measurements
    machine = ClusterSpec(name="this machine", gpu="this machine's CPU", nodes=1, gpus_per_node=1,
                          peak_tflops=NOMINAL_PEAK * reached / 1e12, gpu_memory_gb=1024.0, intra_node=placeholder,
                          inter_node=placeholder, quantize_gelems=quantize_rate() / 1e9)
    measured = Measured(f["forward_s"], f["backward_s"], f["optimizer_s"], ranks=1, model=model_spec(settings),
                        training=training_spec(settings))
    return calibrated(machine, measured, "the 1x1 run's profile")


def rank_share(machine: ClusterSpec, share: float) -> ClusterSpec:
    """``machine`` as one of several ranks on it: ``share`` of its compute and memory bandwidth."""
    return dataclasses.replace(machine, peak_tflops=machine.peak_tflops * share,
                               optimizer_GBps=machine.optimizer_GBps * share)


def training_spec(settings: Settings, layout: str = "full", wire: str = "none",
                  shard_group_size: int | None = None, sync: str | None = None) -> TrainingSpec:
    """The benchmark's step: fp32, as it runs on the CPU."""
    return TrainingSpec(name="benchmark", micro_batch=settings.batch, prefetch=settings.prefetch, layout=layout,
                        shard_group_size=shard_group_size, wire=wire, reshard_after_forward=settings.reshard,
                        precision="fp32", reduce_precision="fp32", diloco=sync or "none")


@functools.cache
def quantize_rate() -> float:
    """Elements per second one thread (a lane's) quantizes here, the wire's kernels as the engine
    runs them. Measured once: every layout runs on the same machine."""
    torch.set_num_threads(1)
    return encode_rate(torch.device("cpu"))


def predict_run(run: Run, machine: ClusterSpec, settings: Settings, bench_path: str) -> Prediction:
    measured = cluster_from_bench(bench_path, rank_share(machine, run.share))
    cluster = parse("cluster", {**as_dict(measured), "nodes": run.nodes, "gpus_per_node": run.ranks_per_node})
    setup = SHARDWIRE_SYSTEMS[run.system]
    hybrid = setup.layout in ("hybrid", "hybrid_secondary")
    training = training_spec(settings, setup.layout, setup.wire, run.ranks_per_node if hybrid else None,
                             setup.diloco)
    return predict(model_spec(settings), cluster, training)


@dataclasses.dataclass(frozen=True)
class Comparison:
    run: Run
    predicted_s: float
    compute_s: float  # the prediction's compute alone
    slowed_s: float  # what overlapped communication added to it
    exposed_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.run.step_time_s - 1

    @property
    def agrees(self) -> bool:
        return abs(self.error) <= TOLERANCE


def table(settings: Settings, comparisons: list[Comparison]) -> str:
    lines = [
        f"GPT {settings.model!r}, {settings.batch} sequences per rank, fp32, prefetch "
        f"{settings.prefetch}, {'reshard' if settings.reshard else 'keep'} after forward",
        "",
        "| cluster | system | measured step | predicted step | error | within 15% | engine's compute "
        "| machine per rank | predicted compute | predicted slowdown | predicted exposed comm |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        lines.append(
            f"| {c.run.cluster} | {c.run.system} | {c.run.step_time_s * 1e3:.0f} ms | {c.predicted_s * 1e3:.0f} ms "
            f"| {100 * c.error:+.1f}% | {'yes' if c.agrees else 'no'} | {c.run.engine_compute_s * 1e3:.0f} ms "
            f"| {c.run.share:.2f} | {c.compute_s * 1e3:.0f} ms | {c.slowed_s * 1e3:.0f} ms "
            f"| {c.exposed_s * 1e3:.0f} ms |"
        )
    return "\n".join(lines)


def parse_bench(items: list[str]) -> dict[str, str]:
    """``KEY=PATH`` arguments -> {key: path}; a key is a link rate (``1gbit``) or a cluster on one
    (``2x1@1gbit``)."""
    paths = {}
    for item in items:
        key, sep, path = item.partition("=")
        if not sep or not key or not path:
            raise SystemExit(f"error: --bench takes LINK=PATH or NODESxRANKS@LINK=PATH (e.g. 1gbit=bench-1gbit.json), "
                             f"got {item!r}")
        if not os.path.isfile(path):
            raise SystemExit(f"error: --bench {item}: no such file")
        paths[key] = path
    return paths


def bench_for(run: Run, benches: dict[str, str]) -> str | None:
    """The bench measured on ``run``'s cluster, else on its link; on one node, any link's (the
    intra-node level is the same loopback on every testbed)."""
    if run.link is None:
        return next((path for key, path in benches.items() if "@" not in key), None)
    return benches.get(f"{run.nodes}x{run.ranks_per_node}@{run.link}") or benches.get(run.link)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measured", required=True, help="scaling.json of benchmarks/scaling.py")
    parser.add_argument("--bench", nargs="+", required=True, metavar="KEY=PATH",
                        help="`shardwire bench --json` on the testbed at each link rate of the runs (1gbit=PATH), "
                             "and optionally on one cluster (2x1@1gbit=PATH), which its runs then use")
    parser.add_argument("--links", nargs="+", metavar="LINK",
                        help="compare only the measured runs on these link rates (default: every run)")
    parser.add_argument("--one-rank", metavar="SCALING_JSON",
                        help="a measured JSON of this machine with a 1x1 run, for one without (default: --measured)")
    parser.add_argument("--json", help="write the comparison here")
    args = parser.parse_args()

    with open(args.one_rank or args.measured) as f:
        reference_settings, reference, alone = read_measured(json.load(f))
    single = one_rank(reference)
    with open(args.measured) as f:
        settings, runs, _ = read_measured(json.load(f), one_rank_s=alone)
    if settings != reference_settings:
        raise SystemExit(f"error: --one-rank measured {reference_settings}, not the runs' {settings}")
    machine = machine_cluster(single, settings)
    if args.links:
        runs = [run for run in runs if run.link in args.links]
    benches = parse_bench(args.bench)
    missing = sorted({r.cluster for r in runs if bench_for(r, benches) is None})
    if missing:
        raise SystemExit(f"error: no --bench for {', '.join(missing)} of the measured runs: give one per link rate")

    comparisons = []
    for run in runs:
        p = predict_run(run, machine, settings, bench_for(run, benches))
        comparisons.append(Comparison(run, p.step_time_s, p.compute_time_s, p.compute_slowed_s, p.exposed_comm_s))
    print(table(settings, comparisons))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": dataclasses.asdict(settings),
                       "runs": [dataclasses.asdict(c.run) | {"predicted_s": c.predicted_s, "error": c.error}
                                for c in comparisons]}, f, indent=1)
    return 0 if all(c.agrees for c in comparisons) else 1


if __name__ == "__main__":
    sys.exit(main())
