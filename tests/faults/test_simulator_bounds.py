"""The simulator's work is bounded for any input: sizes that make no sense are refused at once with
one line that says why, the event loop does work in proportion to units whatever the magnitudes,
and the memory model charges no more prefetched units than the model has.

Every simulation here counts the actions it schedules and stops past ``WORK_BUDGET``, so one that
would never end fails at once instead of hanging the suite; the module's timeout catches loops
outside the event loop.
"""

import pytest

from shardwire.cli import main
from shardwire.sim import step
from shardwire.sim.architecture import architecture
from shardwire.sim.events import Link, Simulation
from shardwire.sim.memory import estimate_memory
from shardwire.sim.predict import predict
from shardwire.sim.specs import ClusterSpec, LinkSpec, ModelSpec, SpecError, TrainingSpec

pytestmark = pytest.mark.timeout(10)

# Eight times what the busiest test here schedules (four simulations, 24,000 actions in all).
WORK_BUDGET = 200_000
SMALL = ["--model", "gpt2-125m", "--cluster", "a100-100gbe", "--nodes", "2"]
BIG = str(10**30)


class Work:
    """The actions scheduled by the simulations of one test."""

    def __init__(self):
        self.scheduled = 0


class CountedSimulation(Simulation):
    """A simulation that counts what it schedules into ``work`` and refuses to go past the budget."""

    def __init__(self, work: Work):
        super().__init__()
        self._work = work

    def at(self, time, action):
        self._work.scheduled += 1
        if self._work.scheduled > WORK_BUDGET:
            raise RuntimeError(f"over {WORK_BUDGET} actions scheduled: this simulation does not end")
        super().at(time, action)


@pytest.fixture(autouse=True)
def work(monkeypatch) -> Work:
    counted = Work()
    monkeypatch.setattr(step, "Simulation", lambda: CountedSimulation(counted))
    return counted


def run(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def gpt(layers: int) -> ModelSpec:
    return ModelSpec(layers=layers, hidden=1024, heads=16, vocab=50000, seq_len=2048)


def cluster(nodes: int, latency_us: float) -> ClusterSpec:
    """A100-like nodes of 8 GPUs; ``latency_us`` per step of a collective across nodes."""
    return ClusterSpec(nodes=nodes, gpus_per_node=8, peak_tflops=312.0, gpu_memory_gb=80.0,
                       intra_node=LinkSpec(240.0, 3.4), inter_node=LinkSpec(25.0, latency_us))


# ------------------------------------------------------------------------------- refused inputs


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "1000000"], "nodes 1000000 is more nodes than the simulator takes (at most 65,536"),
    (["--cluster", "{preset: a100-100gbe, gpus_per_node: 100000}"], "gpus_per_node 100000 is more GPUs per node"),
    (["--cluster", "{preset: a100-100gbe, inter_node: {busbw_GBps: 1.0e-12}}"],
     "busbw_GBps 1e-12 is under 1e-05 GB/s (10 kB/s), slower than any network: bandwidths are in GB/s"),
    (["--cluster", "{preset: a100-100gbe, intra_node: {busbw_GBps: 1.0e+15}}"], "busbw_GBps 1e+15 is over 1e12 GB/s"),
    (["--cluster", "{preset: a100-100gbe, memory_bandwidth_GBps: 1.0e-9}"], "memory_bandwidth_GBps 1e-09 is under"),
    (["--cluster", "{preset: a100-100gbe, inter_node: {latency_us: 1.0e+300}}"],
     "latency_us 1e+300 is over 1,000,000 us (1 s) per step"),
    (["--cluster", "{preset: a100-100gbe, peak_tflops: 1.0e-30}"], "peak_tflops 1e-30 is under 1e-06 TFLOP/s"),
    (["--cluster", "{preset: a100-100gbe, gpu_memory_gb: 1.0e+30}"], "gpu_memory_gb 1e+30 is over 65,536 GiB"),
    (["--model", "{layers: 100000, hidden: 64, heads: 4, vocab: 100, seq_len: 16}"],
     "layers 100000 is more blocks than the simulator builds (at most 1,024 per stack"),
    (["--model", "{preset: t5-3b, decoder_layers: 5000, params: null}"], "decoder_layers 5000 is more blocks"),
    (["--model", "{preset: gpt2-125m, hidden: 12582912, params: null}"], "hidden 12582912 is over 1,048,576"),
    (["--model", "{preset: gpt2-125m, vocab: 1000000000, params: null}"], "vocab 1000000000 is over 16,777,216"),
    (["--model", "{preset: gpt2-125m, seq_len: 1000000000, params: null}"], "seq_len 1000000000 is over 16,777,216"),
    (["--model", "{preset: gpt2-125m, params: " + BIG + "}"], f"params {BIG} is over 1e+15 parameters"),
    (["--training", "{micro_batch: " + BIG + "}"], f"micro_batch {BIG} is over 1,048,576 sequences"),
    (["--cluster", "{preset: a100-100gbe, matmul_efficiency: 1.0e-300}"], "matmul_efficiency 1e-300 is under 0.0001"),
    (["--training", "{prefetch: 1000000}"], "prefetch 1000000 is more units than any model has (at most 2,048)"),
    (["--model", "{layers: 1024, hidden: 64, heads: 4, vocab: 100, seq_len: 16}", "--training", "{grad_accum: 64}"],
     "1,025 units x grad_accum 64 x gathers_per_unit 1 is 65,600 unit passes a step, more than the simulator "
     "schedules (65,536): give fewer micro-batches"),
    (["--sweep", "nodes=" + ",".join(str(n) for n in range(1, 66))], "a sweep of 65 values is more than the 64"),
])
def test_absurd_sizes_are_refused_at_once_with_one_line(capsys, work, argv, message):
    status, out, err = run(capsys, "simulate", *SMALL, *argv)  # the last of a repeated option counts
    assert (status, out) == (2, "")
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err
    assert work.scheduled == 0  # refused before anything was simulated


def test_an_absurd_global_batch_is_refused_before_the_search(capsys, work):
    """The planner looks for the batch's divisors: a batch of 1e30 would keep it counting for ever."""
    status, out, err = run(capsys, "plan", *SMALL, "--global-batch", BIG)
    assert (status, out) == (2, "")
    assert err.startswith(f"error: --global-batch {BIG} is over 1,048,576 sequences")
    assert err.count("\n") == 1 and work.scheduled == 0


# ---------------------------------------------------------------------------- the event loop


def test_a_link_finishes_a_transfer_its_clock_can_no_longer_resolve():
    """At 1e14 s a 1 ms transfer no longer moves the clock: its completion must still finish it, not
    be planned again for the same instant without end."""
    work = Work()
    sim = CountedSimulation(work)
    link = Link(sim, capacity=1e9)
    started = []
    sim.at(1e14, lambda: started.append(link.transfer(1e6)))
    sim.run()
    assert started[0].time == 1e14
    assert work.scheduled == 2  # the start, and one completion


def test_work_grows_with_units_and_not_with_latency(work):
    """1,000 layers on 4,096 nodes with a second per step of a collective across nodes (the longest
    latency taken) schedules as many actions as with 50 us, ten times those of 100 layers. The long
    latency takes the clock where a transfer's duration no longer moves it: a link that judged a
    completion by the bytes left would plan it again for the same instant, for ever."""
    scheduled = {}
    for layers in (100, 1000):
        for latency_us in (50.0, 1e6):
            before = work.scheduled
            p = predict(gpt(layers), cluster(4096, latency_us), TrainingSpec())
            scheduled[layers, latency_us] = work.scheduled - before
            assert p.step_time_s > p.compute_time_s  # simulated through, with its communication
    assert scheduled[1000, 1e6] == pytest.approx(scheduled[1000, 50.0], rel=0.01)
    assert scheduled[100, 1e6] == pytest.approx(scheduled[100, 50.0], rel=0.01)
    assert scheduled[1000, 1e6] <= 10 * scheduled[100, 1e6] * 1.01


def test_a_model_of_the_most_layers_is_simulated_and_one_more_is_refused():
    largest = gpt(1024)
    assert len(architecture(largest, 2).units) == 1024
    assert predict(largest, cluster(4096, 50.0), TrainingSpec()).step_time_s > 0
    with pytest.raises(SpecError, match="layers 1025 is more blocks than the simulator builds"):
        gpt(1025)


# ---------------------------------------------------------------------------- the memory model


@pytest.mark.parametrize("limiter, all_units", [("sliding", 3), ("block", 4)])
def test_prefetch_beyond_the_units_is_charged_as_every_unit(limiter, all_units):
    """The engine gathers ahead no further than the last unit, so a window deeper than the model
    holds the model's units at most: 4 here, reached by prefetch 3 with a sliding window (the
    running unit and 3 ahead) and by prefetch 4 with a block limiter; and one more while the running
    unit's gather is copied out."""
    model = gpt(4)
    arch = architecture(model, 2)
    largest = max(u.params for u in arch.units)
    deep, enough = (estimate_memory(arch, cluster(2, 50.0), TrainingSpec(prefetch=n, limiter=limiter))
                    for n in (1000, all_units))
    assert deep.gathered_parameters == enough.gathered_parameters == 2 * (arch.root.params + (4 + 1) * largest)
    assert predict(model, cluster(2, 50.0), TrainingSpec(prefetch=1000, limiter=limiter)).memory == deep
