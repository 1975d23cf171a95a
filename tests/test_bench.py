"""``shardwire bench`` on real gloo ranks: every operation's result checked element by element, a
corrupted result caught, node groups (with torch's collectives and with the engine's transport),
and what the backend cannot run."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io

import pytest
import torch

import shardwire
from harness import run_workers
from shardwire.bench import ops
from shardwire.bench.ops import IN_PLACE, OUT_OF_PLACE
from shardwire.bench.benchmark import BenchConfig, BenchError, benchmark, validate
from shardwire.cli.bench import measure_and_report

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
TINY = BenchConfig(min_bytes=1000, max_bytes=16000, step_factor=4, warmup=1, iters=2, check=True)


def checked_runs(rank, world):
    """Every operation, every form, several dtypes, reductions and both implementations."""
    configs = [
        TINY,
        dataclasses.replace(TINY, dtype="bfloat16"),
        dataclasses.replace(TINY, dtype="uint8", redop="max", blocking=True),
        dataclasses.replace(TINY, dtype="int32", redop="prod", root=2, combine="min"),
        dataclasses.replace(TINY, dtype="float16", redop="min", ops=["all_reduce", "reduce_scatter", "reduce"]),
        dataclasses.replace(TINY, impl="shardwire", ops=["all_gather", "reduce_scatter"]),
    ]
    outcomes = []
    for config in configs:
        results = benchmark(config, CPU)
        outcomes.append([
            (r.op, r.dtype, [row.nbytes for row in r.rows], r.wrong,
             [sorted(row.points) for row in r.rows], [p.seconds > 0 for row in r.rows for p in row.points.values()])
            for r in results.ops
        ])
    return outcomes


def test_every_operation_produces_exactly_the_expected_elements():
    outcomes = run_workers(3, checked_runs)
    assert outcomes[0] == outcomes[1] == outcomes[2], "every rank must hold the same rows"
    for config_outcome in outcomes[0]:
        for op, dtype, sizes, wrong, forms, timed in config_outcome:
            assert wrong == 0, f"{op} on {dtype}: {wrong} wrong elements"
            assert all(timed)
            element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
            split = ops.OPERATIONS[op].split
            # sizes round up to whole elements, and to one element per rank when the buffer is split
            assert all(s % (element * (3 if split else 1)) == 0 for s in sizes), (op, sizes)
            expected_forms = sorted(ops.OPERATIONS[op].forms)
            assert all(f == expected_forms for f in forms)
    measured = {op for op, *_ in outcomes[0][0]}
    assert measured == set(ops.OPERATIONS)


def corrupted_all_gather(rank, world):
    """A transport that flips one element on rank 1: the check must see it, and the exit status too."""
    issue = ops.AllGather.issue

    def issue_then_corrupt(self):
        for handle in issue(self):
            handle.wait()
        if self.ctx.rank == 1:
            self.output[-1] += 1
        return []

    ops.AllGather.issue = issue_then_corrupt
    config = dataclasses.replace(TINY, ops=["all_gather", "all_reduce"])
    stderr = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        status = measure_and_report(config, CPU)
    results = benchmark(config, CPU)
    wrong = {r.op: [{form: p.wrong for form, p in row.points.items()} for row in r.rows] for r in results.ops}
    return status, wrong, stderr.getvalue()


def test_check_catches_a_corrupted_result_and_fails_the_run():
    (status, wrong, stderr), *others = run_workers(2, corrupted_all_gather)
    assert status == 1 and all(other[0] == 1 for other in others)
    assert wrong["all_gather"] == [{OUT_OF_PLACE: 1, IN_PLACE: 1}] * 3
    assert all(row == {IN_PLACE: 0} for row in wrong["all_reduce"])
    assert "6 output elements differ" in stderr


def node_groups(rank, world):
    config = dataclasses.replace(TINY, ops=["all_reduce", "all_gather", "sendrecv"], groups=["world", "intra", "inter"],
                                 ranks_per_node=2)
    results = benchmark(config, CPU)
    return results.context["groups"], [(r.group, r.ranks, r.op, r.wrong, len(r.rows)) for r in results.ops]


def test_groups_split_four_ranks_into_two_nodes():
    outcomes = run_workers(4, node_groups)
    groups, measured = outcomes[0]
    assert all(outcome == outcomes[0] for outcome in outcomes)
    assert groups == {
        "world": {"ranks": 4, "members": [[0, 1, 2, 3]]},
        "intra": {"ranks": 2, "members": [[0, 1], [2, 3]]},
        "inter": {"ranks": 2, "members": [[0, 2]]},
    }
    # each group is reported on its own, with its own size; correct results in the 2-rank groups
    # (sendrecv's ring included) show that each moved data only among its own members
    assert [(g, n, op) for g, n, op, _, _ in measured] == [
        (group, ranks, op)
        for group, ranks in (("world", 4), ("intra", 2), ("inter", 2))
        for op in ("all_reduce", "all_gather", "sendrecv")
    ]
    assert all(wrong == 0 and rows == 3 for *_, wrong, rows in measured)


def engine_transport_on_node_groups(rank, world):
    """Twice, so that the second run follows collectives that ranks outside ``inter`` skipped."""
    config = dataclasses.replace(TINY, impl="shardwire", ops=["all_gather", "reduce_scatter"],
                                 groups=["world", "intra", "inter"], ranks_per_node=2)
    return [[(r.group, r.op, r.wrong, len(r.rows)) for r in benchmark(config, CPU).ops] for _ in range(2)]


def test_engine_transport_keeps_each_group_to_its_own_communicator():
    outcomes = run_workers(4, engine_transport_on_node_groups, timeout=120)
    assert all(outcome == outcomes[0] for outcome in outcomes)
    for measured in outcomes[0]:
        assert [(g, op) for g, op, _, _ in measured] == [
            (group, op) for group in ("world", "intra", "inter") for op in ("all_gather", "reduce_scatter")
        ]
        assert all(wrong == 0 and rows == 3 for *_, wrong, rows in measured)


def bench_then_hybrid_layout(rank, world):
    config = dataclasses.replace(TINY, impl="shardwire", ops=["all_gather"], groups=["intra", "inter"],
                                 ranks_per_node=2)
    benchmark(config, CPU)
    model = shardwire.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), layout="hybrid",
                            shard_group_size=2, timeout=30)
    model(torch.ones(2, 4)).sum().backward()
    return True


def test_a_layout_made_after_a_bench_in_the_same_processes_forms_its_groups():
    """The bench's groups leave every process holding as many groups as the others, so groups made
    later by their members alone (a hybrid layout's, as `train --plan` makes them) get one name on
    all of them: with the inter-node group made on its members only, they waited for each other."""
    assert run_workers(4, bench_then_hybrid_layout, timeout=120, env={"LOCAL_WORLD_SIZE": "2"}) == [True] * 4


def quantized_wire(rank, world, ranks_per_node=None):
    config = dataclasses.replace(TINY, impl="shardwire", wire="params=int8,grads=int4", max_bytes=64000,
                                 ops=["all_gather", "reduce_scatter"], ranks_per_node=ranks_per_node)
    return [(r.op, r.wrong, [(row.nbytes, row.wire_nbytes, row.count) for row in r.rows])
            for r in benchmark(config, CPU).ops]


@pytest.mark.parametrize("nodes_from", ["launch", "--ranks-per-node"])
def test_a_quantized_wire_reports_the_bytes_it_sent_and_checks_within_its_error(nodes_from):
    """4 ranks as 2 nodes, as the launch places them or as --ranks-per-node treats one machine's:
    the gather sends each rank's int8 shard and its scales, the reduce-scatter exact slots within the
    node and int4 ones across; no element is off by more than quantization allows."""
    from shardwire.comm.wire import Codec

    if nodes_from == "launch":
        (gather, reduce), *_ = run_workers(4, quantized_wire, env={"LOCAL_WORLD_SIZE": "2"})
    else:
        (gather, reduce), *_ = run_workers(4, functools.partial(quantized_wire, ranks_per_node=2),
                                           env={"LOCAL_WORLD_SIZE": "4"})
    assert gather[1] == 0 and reduce[1] == 0
    int8, int4 = Codec(8, 256), Codec(4, 256)
    for nbytes, wire_nbytes, count in gather[2]:
        assert wire_nbytes == 4 * int8.packed_numel(count)
    nbytes, wire_nbytes, _ = gather[2][-1]
    assert wire_nbytes < nbytes / 3  # small sizes pay for whole blocks
    for nbytes, wire_nbytes, count in reduce[2]:
        sent = 1 * 2 * count * 4 + 1 * int4.packed_numel(count)  # within the node, then across
        assert wire_nbytes == sent * 4 // 3


def test_a_quantized_wire_needs_the_engines_transport():
    with pytest.raises(BenchError, match="--wire quantizes the engine's own collectives: add --impl shardwire"):
        validate(dataclasses.replace(TINY, wire="int8"), 2)
    with pytest.raises(BenchError, match="--wire params='int4' is not supported"):
        validate(dataclasses.replace(TINY, impl="shardwire", wire="params=int4"), 2)


def test_a_quantized_wire_needs_a_group_across_nodes():
    """On one node it quantized nothing, and its results said they were measured through it."""
    with pytest.raises(BenchError, match=r"--wire quantizes only what crosses nodes, and no group measured does "
                                         r"\(1 node\(s\) of 2 ranks, --groups world\)"):
        validate(dataclasses.replace(TINY, impl="shardwire", wire="int8", ranks_per_node=2), 2)
    with pytest.raises(BenchError, match="no group measured does"):
        validate(dataclasses.replace(TINY, impl="shardwire", wire="int8", ranks_per_node=2, groups=["intra"]), 4)
    validate(dataclasses.replace(TINY, impl="shardwire", wire="int8", ranks_per_node=1), 2)


def unsupported_dtype(rank, world):
    with contextlib.redirect_stdout(io.StringIO()):
        benchmark(dataclasses.replace(TINY, dtype="float8_e4m3fn", ops=["sendrecv", "all_reduce"]), CPU)


def test_a_dtype_the_backend_lacks_is_a_clear_error_not_a_hang():
    messages = run_workers(2, unsupported_dtype, expect_errors=True, timeout=60)
    for message in messages:
        assert message.startswith(BenchError.__name__)
        assert "gloo could not run all_reduce with redop sum on float8_e4m3fn (Invalid scalar type)" in message
        assert "choose another --dtype" in message


def contention_on_node_groups(rank, world):
    config = dataclasses.replace(TINY, impl="shardwire", ops=["all_gather"], groups=["intra", "inter"],
                                 ranks_per_node=2, max_bytes=1 << 20, check=False, contention=True)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        measured = benchmark(config, CPU, out=out).contention
    plain = benchmark(dataclasses.replace(config, contention=False), CPU).contention
    return measured, plain, out.getvalue() if rank == 0 else None


def test_contention_times_matmuls_alone_and_beside_each_groups_all_gather():
    """4 ranks as 2 nodes: each group's all-gather runs beside the workload, the inter group's on
    ranks 0 and 2 only (1 and 3 compute alone in both phases); every rank gets the same section."""
    outcomes = run_workers(4, contention_on_node_groups, timeout=240)
    measured, plain, printed = outcomes[0]
    assert all(outcome[:2] == (measured, plain) for outcome in outcomes)
    assert plain is None, "no contention section without --contention"
    assert measured["workload"] == {"op": "matmul", "n": 1024, "dtype": "float32", "count": 8}
    for group, ranks, members in (("intra", 2, 4), ("inter", 2, 2)):
        result = measured[group]
        assert result["ranks"] == ranks and len(result["rank_shares"]) == members
        assert result["all_gather_bytes"] == 1 << 20
        assert 0 < result["alone_s"] and 0 < result["beside_s"]
        assert all(0 <= share <= 1 for share in result["rank_shares"])
        assert min(result["rank_shares"]) <= result["compute_share"] <= max(result["rank_shares"])
        assert result["all_gather_s"] > 0 and len(result["rank_bandwidth_shares"]) == members
        assert all(0 <= share <= 1 for share in result["rank_bandwidth_shares"])
        assert min(result["rank_bandwidth_shares"]) <= result["bandwidth_share"] <= max(result["rank_bandwidth_shares"])
        assert f"# contention {group}: 8 x 1024^2 float32 matmuls" in printed
