"""The benchmark's numbers: nccl-tests' bandwidth formulas, the saturation summary, the
latency-bandwidth fit, the sizes of a sweep, and the arguments refused before any process starts."""

from __future__ import annotations

import math
import random

import pytest

from harness import run_workers
from shardwire import cli
from shardwire.bench.metrics import (
    MIB,
    OPS,
    bandwidth,
    bus_factor,
    combine_ranks,
    fit_latency_bandwidth,
    saturation,
)
from shardwire.bench.ops import OPERATIONS
from shardwire.bench.benchmark import parse_size
from shardwire.bench.sweep import aligned_sizes, sweep_sizes


def test_bus_bandwidth_factors_are_nccl_tests():
    n = 4
    expected = {
        "all_reduce": 2 * 3 / 4,
        "all_gather": 3 / 4,
        "reduce_scatter": 3 / 4,
        "all_to_all": 3 / 4,
        "broadcast": 1.0,
        "reduce": 1.0,
        "sendrecv": 1.0,
    }
    assert set(OPS) == set(expected) == set(OPERATIONS)
    for op, factor in expected.items():
        assert bus_factor(op, n) == pytest.approx(factor)
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_gather", 8) == 7 / 8


def test_algbw_is_whole_buffer_over_time_and_busbw_scales_it():
    # 64 MiB gathered over 8 ranks in 10 ms
    rate = bandwidth("all_gather", 64 * MIB, 0.010, 8)
    assert rate.algbw == pytest.approx(64 * MIB / 0.010)
    assert rate.busbw == pytest.approx(rate.algbw * 7 / 8)
    rate = bandwidth("all_reduce", 1000, 1e-6, 2)
    assert rate.algbw == rate.busbw == pytest.approx(1e9)


def test_ranks_times_combine_by_max_min_or_mean():
    times = [3.0, 1.0, 2.0]
    assert combine_ranks(times, "max") == 3.0
    assert combine_ranks(times, "min") == 1.0
    assert combine_ranks(times, "avg") == 2.0
    with pytest.raises(ValueError, match="median"):
        combine_ranks(times, "median")


def test_saturation_finds_peak_the_sizes_reaching_80_and_90_percent_and_the_large_size_mean():
    sizes = [1 << k for k in range(16, 25)]  # 64 KiB .. 16 MiB
    busbw = [1, 2, 4, 7, 8.5, 9.2, 10, 9.8, 9.9]
    sat = saturation(sizes, busbw)
    assert sat.peak_busbw == 10 and sat.peak_bytes == 4 * MIB
    assert sat.bytes_to_80pct == 1 * MIB  # 8.5 >= 8, 7 < 8
    assert sat.bytes_to_90pct == 2 * MIB  # 9.2 >= 9
    assert sat.avg_busbw_from_1mib == pytest.approx((8.5 + 9.2 + 10 + 9.8 + 9.9) / 5)
    assert saturation([1024, 2048], [1.0, 2.0]).avg_busbw_from_1mib is None


SIZES = [1 << k for k in range(10, 27)]  # 1 KiB .. 64 MiB


def test_fit_recovers_alpha_and_beta_from_exact_timings():
    alpha, beta = 35e-6, 1.25e9
    fit = fit_latency_bandwidth(SIZES, [alpha + s / beta for s in SIZES])
    assert fit.alpha == pytest.approx(alpha, rel=1e-9)
    assert fit.beta == pytest.approx(beta, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0) and fit.points == len(SIZES)
    assert fit.predict(8 * MIB) == pytest.approx(alpha + 8 * MIB / beta)


def test_fit_recovers_alpha_and_beta_through_noise_at_every_size():
    """5 % noise on each time: the relative-error fit still pins the latency, which plain least
    squares would lose under the large sizes' absolute errors."""
    alpha, beta = 120e-6, 3e8
    rng = random.Random(7)
    times = [(alpha + s / beta) * (1 + rng.uniform(-0.05, 0.05)) for s in SIZES for _ in range(3)]
    fit = fit_latency_bandwidth([s for s in SIZES for _ in range(3)], times)
    assert fit.alpha == pytest.approx(alpha, rel=0.05)
    assert fit.beta == pytest.approx(beta, rel=0.05)
    assert 0.9 < fit.r2 <= 1.0


def test_fit_keeps_parameters_physical():
    # time that does not grow with size: latency only, beta unbounded
    flat = fit_latency_bandwidth(SIZES[:4], [50e-6, 51e-6, 49e-6, 50e-6])
    assert math.isinf(flat.beta) and flat.alpha == pytest.approx(50e-6, rel=0.02)
    # time proportional to size with a dip at the small end: no negative latency
    pure = fit_latency_bandwidth(SIZES, [s / 1e9 * (0.8 if s == SIZES[0] else 1.0) for s in SIZES])
    assert pure.alpha == 0.0 and pure.beta == pytest.approx(1e9, rel=0.02)
    assert fit_latency_bandwidth([4096, 4096], [1e-3, 1e-3]) is None


def test_sweep_sizes_grow_by_a_factor_or_a_step():
    assert sweep_sizes(8, 128, factor=2) == [8, 16, 32, 64, 128]
    assert sweep_sizes(1000, 100_000, factor=10) == [1000, 10_000, 100_000]
    assert sweep_sizes(1024, 4096, step=1024) == [1024, 2048, 3072, 4096]
    with pytest.raises(ValueError):
        sweep_sizes(1024, 8, factor=2)


def test_sizes_round_up_to_the_alignment_and_say_which_changed():
    # all_gather of float32 over 4 ranks: multiples of 16 bytes
    used, changed = aligned_sizes([1, 8, 16, 1000, 1008], 16)
    assert used == [16, 1008]
    assert changed == [(1, 16), (8, 16), (1000, 1008)]


def test_sizes_parse_like_nccl_tests():
    assert parse_size("8") == 8
    assert parse_size("64K") == 64 << 10
    assert parse_size("128m") == 128 << 20
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("2GB") == 2 << 30
    with pytest.raises(Exception, match="not a size"):
        parse_size("1.5M")


@pytest.mark.parametrize("argv, message", [
    (["-b", "4K", "-e", "1K"], "--min-bytes (4096) is larger than --max-bytes (1024)"),
    (["--step-factor", "1"], "--step-factor must be at least 2"),
    (["--iters", "0"], "--iters must be at least 1"),
    (["--nproc", "1"], "the world group would have 1 rank"),
    (["--nproc", "4", "--groups", "inter"], "the inter group would have 1 rank"),
    (["--nproc", "4", "--ranks-per-node", "3"], "4 ranks do not split into nodes of 3"),
    (["--nproc", "4", "--ranks-per-node", "2", "--groups", "intra", "--root", "2"], "--root must be"),
    (["--nproc", "200", "--check", "--dtype", "int8", "--ops", "all_reduce"], "cannot verify a sum over 200"),
    (["--impl", "shardwire", "--redop", "max"], "reduces by sum only"),
    (["--json", "/dev/null/out.json"], "its directory /dev/null is a character device"),
    (["-b", "1", "-e", "1G", "-i", "1"], "makes 1073741824 sizes, more than 1000: raise --step-bytes"),
    (["--timeout", "nan"], "--timeout must be a finite number of seconds, at least 10, got nan"),
    (["--timeout", "inf"], "--timeout must be a finite number of seconds, at least 10, got inf"),
    (["--timeout", "0.01"], "--timeout must be a finite number of seconds, at least 10, got 0.01"),  # workers' meeting
])
def test_bad_arguments_are_refused_before_any_worker_starts(argv, message, capsys):
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_an_unreadable_size_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["bench", "-b", "lots"])
    assert exit.value.code == 2
    assert "'lots' is not a size" in capsys.readouterr().err


def _a_sweep_whose_collective_times_out(rank, world) -> str:
    import torch
    import torch.distributed as dist

    from shardwire.bench import sweep as sweeping
    from shardwire.bench.ops import AllGather, OpContext
    from shardwire.comm.errors import CollectiveError

    def timed_out(op, settings):
        raise RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                           "waiting 15000ms for recv operation to complete")

    sweeping.measure = timed_out
    ctx = OpContext(dist.group.WORLD, (0,), 0, torch.device("cpu"), torch.float32, "sum", 0, None)
    settings = sweeping.SweepSettings(warmup=1, iters=1, blocking=False, check=False, combine="max")
    try:
        next(sweeping.sweep(AllGather, [1024], ctx, settings))
    except CollectiveError as err:
        return str(err)
    return "no error"


def test_a_collective_that_fails_in_a_sweep_is_one_line_naming_what_was_measured():
    """A link cut past --timeout: torch's error, raised deep in the sweep, was a traceback on every rank."""
    [said] = run_workers(1, _a_sweep_whose_collective_times_out)
    assert said == ("rank 0: all_gather of 4,096 bytes failed (Timed out waiting 15000ms for recv operation to "
                    "complete). Another rank has probably stopped or crashed, or its link is down: check its log.")
