"""``shardwire bench``: what the network delivers to collectives, in the numbers nccl-tests prints.

Run as is, it starts ``--nproc`` local workers through torch's elastic launcher; under torchrun
(``torchrun --nnodes 4 --nproc-per-node 8 ... -m shardwire bench --groups world intra inter``) this
process is a worker: it measures the launcher's world (``shardwire.bench.benchmark``), rank 0
prints the tables as they come and saves ``--json``, ``--csv`` and ``--plot``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from shardwire import worker
from shardwire.bench import report
from shardwire.bench.benchmark import BenchConfig, BenchError, BenchResults, benchmark, validate
from shardwire.files import write_atomically
from shardwire.launch import OutputLost, UntilClosed, launch_local, under_launcher
from shardwire.mappings import one_line, refusal
from shardwire.options import add_options, command_line, config_from


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, BenchConfig)


def check_options(args: argparse.Namespace) -> None:
    """What ``--print-config`` checks before it prints: what a run refuses before its workers start,
    in its words and with its exit status."""
    config = config_from(args, BenchConfig, argv=[])
    try:
        validate(config, world=config.nproc)
    except BenchError as err:
        print(refusal(f"error: {err}"), file=sys.stderr)
        raise SystemExit(2) from None


def run(args: argparse.Namespace, argv: list[str], checked) -> int:
    """Entry point of ``shardwire bench``: check the arguments, then launch local workers or be one."""
    config = config_from(args, BenchConfig, argv=argv)
    try:
        if not under_launcher():
            validate(config, world=config.nproc)
            checked()
            return launch_local(config.nproc, ["bench", *_worker_arguments(config)])
        validate(config, world=int(os.environ["WORLD_SIZE"]))
        checked()
        return _worker(config)
    except BenchError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(refusal(f"error: {err}"), file=sys.stderr)
        return 2


def _worker_arguments(config: BenchConfig) -> list[str]:
    """The settings checked here, as the workers' command line: no config file to read again."""
    defaults = BenchConfig()
    return command_line({f.name: getattr(config, f.name) for f in dataclasses.fields(BenchConfig)
                         if "option" in f.metadata and getattr(config, f.name) != getattr(defaults, f.name)})


def _worker(config: BenchConfig) -> int:
    """One rank's measurement. Rank 0's table, on a standard output that cannot be written (a full
    disk, a reader gone), goes on to the null device so that every rank measures to the end together
    (a rank that left would stop the others mid-collective); then it fails as a command's result does."""
    device = worker.worker_device(config.backend)
    lost: list[OSError] = []
    with (worker.process_group(device, datetime.timedelta(seconds=config.timeout)),
          contextlib.redirect_stdout(UntilClosed(sys.stdout, lost.append))):
        status = measure_and_report(config, device)
    if lost:
        OutputLost.raised(lost[0])
    return status


def measure_and_report(config: BenchConfig, device: torch.device) -> int:
    """Run the benchmark in the default process group, print it, save what was asked (rank 0);
    returns the exit status: 1 when an output element was wrong, else 0."""
    results = benchmark(config, device, out=sys.stdout)
    wrong = sum(result.wrong for result in results.ops)
    if dist.get_rank() == 0:
        _save(config, results)
        if wrong:
            print(f"error: {wrong} output elements differ from their expected values (the #wrong columns)",
                  file=sys.stderr)
    return 1 if wrong else 0


def _save(config: BenchConfig, results: BenchResults) -> None:
    outputs = [
        (config.json, lambda: json.dumps(report.document(results.context, results.ops, results.contention),
                                         indent=2) + "\n"),
        (config.csv, lambda: report.csv_text(results.ops)),
        (config.plot, lambda: report.plot_png(results.ops)),
    ]
    for path, render in outputs:
        if path is not None:
            write_atomically(path, render())
            print(one_line(f"# saved {path}"), flush=True)
