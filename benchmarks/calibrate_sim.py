"""Calibrate the simulator against this machine: predict shardwire's measured step times from the
measured network and the measured compute, and compare.

    shardwire testbed up --nodes 2 --link 1gbit
    shardwire testbed run --nproc-per-node 2 -- -m shardwire bench --groups intra inter \
        --impl shardwire --ops all_gather reduce_scatter -b 64K -e 64M --json bench-1gbit.json
    shardwire testbed down
    python benchmarks/scaling.py --systems shardwire --links 1gbit --out benchmarks/results/scaling
    python benchmarks/calibrate_sim.py --measured benchmarks/results/scaling/scaling.json \
        --bench 1gbit=bench-1gbit.json

The simulator gets only what was measured on this machine, nothing from the runs it predicts:

* the network, from ``shardwire bench --json`` run on the emulated cluster with the engine's own
  collectives (``--impl shardwire``): busbw and per-step latency of each level, and the
  hierarchical algorithm the engine uses on gloo (``shardwire simulate --cluster-from``); runs on
  one node use the intra-node level only, which is the same loopback on and off the testbed;
* compute, by timing forward and backward of one block of the benchmark's GPT at its batch, in as
  many processes at once as the run has ranks on this machine (each with the threads the benchmark
  gives a rank), so that ranks sharing the cores are priced in; that is turned into a FLOP rate,
  the simulator's peak with kernels at 100% of it;
* the optimizer step, by timing AdamW on a rank's shard the same way (as a memory bandwidth).

Each shardwire run of ``benchmarks/scaling.py``'s JSON is then predicted and set against its
measured median step time; the target is agreement within ``TOLERANCE``. The benchmark's own
compute-only time (the whole step on an unsharded replica, every rank at once) is shown beside the
predicted compute, to tell a compute error from a communication one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import multiprocessing.synchronize
import os
import statistics
import sys
import time

import torch

from shardwire.models.gpt import PRESETS, Block
from shardwire.sim.architecture import architecture
from shardwire.sim.inputs import cluster_from_bench
from shardwire.sim.predict import Prediction, predict
from shardwire.sim.specs import ClusterSpec, LinkSpec, ModelSpec, TrainingSpec, as_dict, parse
from shardwire.sim.step import OPTIMIZER_BYTES_PER_PARAM

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
    nodes: int
    ranks_per_node: int
    link: str | None  # the emulated link's rate, None on one node
    step_time_s: float  # measured median
    compute_only_s: float | None  # the benchmark's compute-only step at this many ranks

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def layout(self) -> str:
        shape = f"{self.nodes}x{self.ranks_per_node}"
        return shape if self.link is None else f"{shape} @{self.link}"


@dataclasses.dataclass(frozen=True)
class Compute:
    """Measured on this machine with ``ranks`` processes at once."""

    ranks: int
    block_s: float  # forward + backward of one block at the benchmark's batch
    optimizer_s: float  # AdamW step over one rank's shard
    shard_params: int


def read_measured(doc: dict) -> tuple[Settings, list[Run]]:
    """The shardwire runs of ``benchmarks/scaling.py``'s scaling.json: ``{"args": {...},
    "compute_times_s": {WORLD: [s]}, "rows": [{"system", "layout": "2x2 @1gbit", "step_times"}]}``."""
    args = doc["args"]
    settings = Settings(model=args["model"], batch=args["batch"], prefetch=args["prefetch"], reshard=args["reshard"])
    compute_only = {int(world): statistics.median(times) for world, times in doc.get("compute_times_s", {}).items()}
    runs = []
    for row in doc["rows"]:
        if row["system"] != "shardwire":
            continue
        shape, _, link = row["layout"].partition(" @")
        nodes, _, per_node = shape.partition("x")
        nodes, per_node = int(nodes), int(per_node)
        runs.append(Run(nodes, per_node, link or None, statistics.median(row["step_times"]),
                        compute_only.get(nodes * per_node)))
    if not runs:
        raise ValueError("the measured JSON has no shardwire run: run benchmarks/scaling.py with shardwire")
    return settings, runs


def model_spec(settings: Settings) -> ModelSpec:
    """The simulator's description of the benchmark's GPT (``shardwire.models.gpt``)."""
    c = PRESETS[settings.model]
    return ModelSpec(name=f"gpt {settings.model}", layers=c.layers, hidden=c.hidden, heads=c.heads,
                     vocab=c.vocab_size, seq_len=c.seq_len, learned_positions=True, tied_embeddings=True)


def machine_cluster(compute: Compute, settings: Settings) -> ClusterSpec:
    """This machine as a 'GPU': the measured block's FLOP rate as peak, AdamW's as memory bandwidth."""
    block = architecture(model_spec(settings), 4).units[0]
    rate = 3 * block.forward_flops * settings.batch / compute.block_s
    placeholder = LinkSpec(busbw_GBps=1.0)  # replaced by the bench's measurements
    streamed = OPTIMIZER_BYTES_PER_PARAM * compute.shard_params / compute.optimizer_s
    return ClusterSpec(name="this machine", nodes=1, gpus_per_node=1, peak_tflops=rate / 1e12,
                       gpu_memory_gb=1024.0, intra_node=placeholder, inter_node=placeholder,
                       memory_bandwidth_GBps=streamed / 1e9)


def predict_run(run: Run, settings: Settings, compute: Compute, bench_path: str) -> Prediction:
    measured = cluster_from_bench(bench_path, machine_cluster(compute, settings))
    cluster = parse("cluster", {**as_dict(measured), "nodes": run.nodes, "gpus_per_node": run.ranks_per_node})
    training = TrainingSpec(name="benchmark", micro_batch=settings.batch, prefetch=settings.prefetch,
                            reshard_after_forward=settings.reshard, precision="fp32",
                            reduce_precision="fp32", compute_efficiency=1.0)  # fp32, as the benchmark
    return predict(model_spec(settings), cluster, training)


WARMUP = 3  # untimed repetitions before each compute measurement

_start_together: multiprocessing.synchronize.Barrier | None = None  # set in each measuring process


def _join(barrier) -> None:
    global _start_together
    _start_together = barrier


def _time_compute(settings: Settings, threads: int, shard_params: int, repeats: int) -> tuple[float, float]:
    """One process's median seconds for a block's forward and backward, and an AdamW step."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = PRESETS[settings.model]
    block = Block(config)
    x = torch.randn(settings.batch, config.seq_len, config.hidden, requires_grad=True)
    shard = torch.nn.Parameter(torch.zeros(shard_params))
    shard.grad = torch.randn(shard_params)
    optimizer = torch.optim.AdamW([shard], lr=1e-4)

    def seconds(fn) -> float:
        for _ in range(WARMUP):
            fn()
        _start_together.wait()  # the processes contend for the cores as the ranks of a run do
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
        return statistics.median(times)

    return seconds(lambda: block(x).sum().backward()), seconds(optimizer.step)


def measure_compute(settings: Settings, ranks: int, repeats: int = 5) -> Compute:
    """Time a block and an AdamW step over a 1/``ranks`` shard in ``ranks`` processes at once, each
    with the threads the benchmark gives a rank."""
    shard_params = architecture(model_spec(settings), 4).params // ranks
    threads = max(1, (os.cpu_count() or 1) // ranks)
    context = multiprocessing.get_context("spawn")
    # One task per process: each waits at the barrier until all have started theirs.
    with context.Pool(ranks, initializer=_join, initargs=(context.Barrier(ranks),)) as pool:
        results = pool.starmap(_time_compute, [(settings, threads, shard_params, repeats)] * ranks, chunksize=1)
    return Compute(ranks, statistics.mean(r[0] for r in results), statistics.mean(r[1] for r in results),
                   shard_params)


@dataclasses.dataclass(frozen=True)
class Comparison:
    run: Run
    predicted_s: float
    compute_s: float  # the prediction's compute alone
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
        "| layout | measured step | predicted step | error | within 15% | predicted compute "
        "| measured compute-only | predicted exposed comm |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        measured_compute = "-" if c.run.compute_only_s is None else f"{c.run.compute_only_s * 1e3:.0f} ms"
        lines.append(
            f"| {c.run.layout} | {c.run.step_time_s * 1e3:.0f} ms | {c.predicted_s * 1e3:.0f} ms "
            f"| {100 * c.error:+.1f}% | {'yes' if c.agrees else 'no'} | {c.compute_s * 1e3:.0f} ms "
            f"| {measured_compute} | {c.exposed_s * 1e3:.0f} ms |"
        )
    return "\n".join(lines)


def parse_bench(items: list[str]) -> dict[str, str]:
    """``LINK=PATH`` arguments -> {link: path}."""
    paths = {}
    for item in items:
        link, sep, path = item.partition("=")
        if not sep or not link or not path:
            raise SystemExit(f"error: --bench takes LINK=PATH (e.g. 1gbit=bench-1gbit.json), got {item!r}")
        if not os.path.isfile(path):
            raise SystemExit(f"error: --bench {item}: no such file")
        paths[link] = path
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measured", required=True, help="scaling.json of benchmarks/scaling.py")
    parser.add_argument("--bench", nargs="+", required=True, metavar="LINK=PATH",
                        help="`shardwire bench --json` on the testbed at each link rate of the runs")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions of each compute measurement")
    parser.add_argument("--json", help="write the comparison here")
    args = parser.parse_args()

    with open(args.measured) as f:
        settings, runs = read_measured(json.load(f))
    benches = parse_bench(args.bench)
    missing = sorted({r.link for r in runs if r.link is not None} - set(benches))
    if missing:
        raise SystemExit(f"error: no --bench for link(s) {', '.join(missing)} of the measured runs")
    any_bench = next(iter(benches.values()))  # one node: the intra-node level, alike in every bench

    comparisons = []
    measured_compute: dict[int, Compute] = {}
    for run in runs:
        if run.ranks not in measured_compute:
            measured_compute[run.ranks] = measure_compute(settings, run.ranks, args.repeats)
        p = predict_run(run, settings, measured_compute[run.ranks], benches.get(run.link, any_bench))
        comparisons.append(Comparison(run, p.step_time_s, p.compute_time_s, p.exposed_comm_s))
    print(table(settings, comparisons))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": dataclasses.asdict(settings),
                       "compute": [dataclasses.asdict(c) for c in measured_compute.values()],
                       "runs": [dataclasses.asdict(c.run) | {"predicted_s": c.predicted_s, "error": c.error}
                                for c in comparisons]}, f, indent=1)
    return 0 if all(c.agrees for c in comparisons) else 1


if __name__ == "__main__":
    sys.exit(main())
