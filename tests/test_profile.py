"""The step profiler: its arithmetic, its files, and what it reports about real steps."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time

import pytest
import torch

from harness import figured, matmul_precision, run_workers, summarised
from shardwire.models.gpt import GPT, PRESETS, GPTConfig, loss_fn
from shardwire.profile import analysis, intervals, report
from shardwire.profile.flops import flops_per_token, torch_counted_flops_per_token
from shardwire.profile.analysis import StepTimeline
from shardwire.profile.report import ReportError, write_report


# ------------------------------------------------------------------------------ arithmetic


def test_interval_arithmetic():
    assert intervals.merge([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert intervals.total([(0, 2), (1, 3), (5, 6)]) == 4
    assert intervals.covered([(0, 4)], [(1, 2), (3, 5)]) == 2
    assert intervals.subtract([(0, 10)], [(2, 3), (5, 7), (9, 12)]) == [(0, 2), (3, 5), (7, 9)]
    assert intervals.clip([(-1, 2), (3, 4), (8, 12)], (0, 10)) == [(0, 2), (3, 4), (8, 10)]


def test_synthetic_schedule_gives_exact_overlap_and_exposed_time():
    # A 10 s step: forward 0-4 s, backward 4-9 s, in which compute waits 6-7 s for a gather;
    # collectives in flight 1-3 (hidden), 5-7 (half exposed: the wait) and 8-11 (cut at the step end).
    timeline = StepTimeline(
        step=0, start=0.0, end=10.0,
        phases=[("forward", None, 0.0, 4.0), ("forward", "blocks.0", 0.5, 3.5), ("backward", None, 4.0, 9.0)],
        comms=[("all_gather", "blocks.0", 100, 26, 1.0, 3.0), ("all_gather", "blocks.1", 100, 26, 5.0, 7.0),
               ("reduce_scatter", "blocks.1", 200, 200, 8.0, 11.0)],
        waits=[("blocks.1", 6.0, 7.0)],
    )
    f = analysis.breakdown(timeline)
    assert f["step_s"] == 10.0
    assert (f["forward_s"], f["backward_s"], f["wait_s"], f["other_s"]) == (4.0, 4.0, 1.0, 1.0)
    assert f["comm_s"] == 6.0 and f["all_gather_s"] == 4.0 and f["reduce_scatter_s"] == 2.0
    assert f["exposed_comm_s"] == 1.0
    assert f["overlap_ratio"] == pytest.approx(5 / 6)
    assert f["all_gather_bytes"] == 200 and f["reduce_scatter_bytes"] == 200
    assert f["all_gather_wire_bytes"] == 52 and f["reduce_scatter_wire_bytes"] == 200  # gathers quantized


def test_spread_over_ranks_and_the_straggler():
    steps = [analysis.across_ranks([{name: 1.0 for name in analysis.FIGURES} | {"step_s": s} for s in times])
             for times in ([1.0, 1.5, 1.2], [1.1, 1.4, 1.0], [0.9, 1.0, 1.6])]
    assert steps[0]["figures"]["step_s"] == {"min": 1.0, "median": 1.2, "max": 1.5}
    summary = analysis.over_steps(steps)
    assert summary["slowest_rank"]["rank"] == 1 and summary["slowest_rank"]["share_of_steps"] == pytest.approx(2 / 3)


# ------------------------------------------------------------------------------------ FLOPs


def test_flops_of_a_known_config_match_the_closed_form():
    # GPT-2 small's shape: 12 layers, hidden 768, 1024 positions, 50257-token vocabulary (tied head).
    config = GPTConfig(vocab_size=50257, seq_len=1024, layers=12, hidden=768, heads=12)
    h, layers, seq, vocab = 768, 12, 1024, 50257
    matmul_params = vocab * h + layers * 12 * h * h  # the head (tied) and the blocks' weight matrices
    flops = flops_per_token(config.spec())
    assert flops.model == 6 * matmul_params + 12 * layers * h * seq
    assert flops.hardware == flops.model
    # torch's own count (matrix multiplies and attention only) agrees to well under 1%
    with torch.device("meta"):
        model = GPT(config)
        tokens = torch.zeros(1, seq + 1, dtype=torch.long)
    counted = torch_counted_flops_per_token(lambda: loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward(), seq)
    assert counted == pytest.approx(flops.model, rel=5e-3)


def test_the_profiler_and_the_simulator_count_the_same_flops():
    from shardwire.sim.predict import predict
    from shardwire.sim.presets import CLUSTERS, TRAININGS

    config = PRESETS["30m"]
    prediction = predict(config.spec(), CLUSTERS["a100-100gbe"], TRAININGS["default"])
    per_sequence = prediction.model_flops_per_gpu / TRAININGS["default"].micro_batch
    assert flops_per_token(config.spec()).model * config.seq_len == pytest.approx(per_sequence)


def test_recomputation_counts_as_hardware_flops_only():
    config = PRESETS["small"]
    plain = flops_per_token(config.spec())
    recomputed = flops_per_token(config.spec(), activation_checkpointing=True)
    h, layers, seq = config.hidden, config.layers, config.seq_len
    assert recomputed.model == plain.model
    assert recomputed.hardware - recomputed.model == layers * (24 * h * h + 4 * h * seq)  # every block's forward


# ----------------------------------------------------------------------------- real steps


def profiled_training(rank, world, run_dir, probe_peak):
    import shardwire
    from shardwire.engine.shard import engine_of
    from shardwire.models.gpt import GPT, Block, loss_fn
    from shardwire.profile.profiler import Profiler

    config = dataclasses.replace(PRESETS["small"], layers=6)
    torch.manual_seed(0)
    model = shardwire.shard(GPT(config), units=[Block])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = 8

    def step(i) -> dict[str, float]:
        """One step; returns how long each call that holds a profiled phase took."""
        tokens = torch.randint(0, 256, (batch, config.seq_len + 1), generator=torch.Generator().manual_seed(i))
        calls, start = {}, time.perf_counter()
        for phase, call in (("forward", lambda: model(tokens[:, :-1])),
                            ("backward", lambda: loss_fn(logits, tokens[:, 1:]).backward()),
                            ("clip", lambda: shardwire.clip_grad_norm_(model, 1.0)),
                            ("optimizer", optimizer.step)):
            result = call()
            logits = result if phase == "forward" else None
            calls[phase], start = time.perf_counter() - start, time.perf_counter()
        optimizer.zero_grad()
        return calls

    step(0)  # the recording step, unprofiled, to count collectives of a steady step below
    comm = engine_of(model).comm
    with comm.record() as plain:
        step(1)
    profiler = Profiler(model, optimizer, tokens_per_step=batch * config.seq_len * world,
                        flops=flops_per_token(config.spec()), probe_peak=probe_peak,
                        metadata={"model": "small-6", "precision": "fp32"})
    walls, calls = [], []
    with comm.record() as profiled:
        for i in range(2, 8):
            start = time.perf_counter()
            with profiler.step():
                calls.append(step(i))
            walls.append(time.perf_counter() - start)
    summary = profiler.save(run_dir)
    profiler.close()
    return walls, summary, len(plain), len(profiled) / 6, calls


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("profiled") / "run")
    results = run_workers(2, profiled_training, run_dir, True)
    return run_dir, results


def test_breakdown_adds_up_to_the_measured_step_time(profiled_run):
    """The parts partition the step, and each phase lies inside the call that runs it. (How much of
    a step falls between the calls depends on the machine's load, so it is not bounded here.)"""
    run_dir, results = profiled_run
    with open(os.path.join(run_dir, "profile.json")) as f:
        profile = json.load(f)
    phases = ("forward", "backward", "clip", "optimizer")
    for rank, (walls, *_, calls) in enumerate(results):
        for wall, call, step in zip(walls, calls, profile["steps"]):
            figures = step["ranks"][rank]
            assert figures["step_s"] == pytest.approx(wall, rel=0.05)
            parts = sum(figures[f"{p}_s"] for p in phases) + figures["other_s"] + figures["wait_s"]
            assert parts == pytest.approx(figures["step_s"], rel=1e-9)
            for phase in phases:  # waits lie inside the calls too, so each call bounds its phase
                assert 0 < figures[f"{phase}_s"] <= call[phase], f"rank {rank} step {step['step']}: {phase}"
            assert figures["wait_s"] <= call["forward"] + call["backward"] + call["clip"]


def test_profiling_adds_no_collective_to_the_steps(profiled_run):
    _, results = profiled_run
    for _, _, plain, profiled_per_step, _ in results:
        assert profiled_per_step == plain


def test_summary_has_throughput_and_mfu(profiled_run):
    _, results = profiled_run
    summary = results[0][1]
    assert summary["tokens_per_s"] > 0 and summary["model_tflops_per_worker"] > 0
    assert 0 < summary["mfu"] < 2  # against this machine's measured matmul rate
    assert 0 <= summary["figures"]["overlap_ratio"]["median"] <= 1
    assert summary["slowest_rank"]["rank"] in (0, 1)
    assert results[1][1] is None  # only rank 0 holds the summary


def test_trace_is_valid_chrome_trace_json(profiled_run):
    run_dir, _ = profiled_run
    with open(os.path.join(run_dir, "trace.json")) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert slices and all(e["ph"] in ("X", "M") for e in events)
    for e in slices:
        assert isinstance(e["name"], str) and e["ts"] >= 0 and e["dur"] >= 0
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    for rank in (0, 1):
        assert {(rank, "compute"), (rank, "all-gather lane"), (rank, "reduce-scatter lane")} <= tracks
        names = {e["name"] for e in slices if e["pid"] == rank}
        assert {"forward", "backward", "optimizer", "blocks.0"} <= names
    gathers = [e for e in slices if e.get("cat") == "all_gather"]
    assert gathers and all(e["args"]["bytes"] > 0 for e in gathers)


def test_report_writes_its_plots(profiled_run, tmp_path):
    run_dir, _ = profiled_run
    written = write_report([run_dir], str(tmp_path))
    assert sorted(os.path.basename(p) for p in written) == ["breakdown.png", "overlap.png", "timeline.png"]
    for path in written:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_report_of_a_long_run_draws_its_steps_at_once(profiled_run, tmp_path):
    """Past ``_MAX_BARS`` steps the breakdown is stacked areas, not a bar per step (20,000 bars took
    minutes to draw)."""
    run_dir, _ = profiled_run
    with open(os.path.join(run_dir, "profile.json")) as f:
        profile = json.load(f)
    drawn = next(step for step in profile["steps"] if step["step"] == profile["timeline"]["step"])
    profile["steps"] = [{**drawn, "step": step} for step in range(report._MAX_BARS + 1)]  # its timeline's among them
    summarised(profile)
    long_run = tmp_path / "long"
    long_run.mkdir()
    (long_run / "profile.json").write_text(json.dumps(profile))
    written = write_report([str(long_run)], str(tmp_path / "plots"))
    assert "breakdown.png" in [os.path.basename(p) for p in written]


def test_report_of_a_large_world_draws_a_few_ranks_and_each_lane_at_once(profiled_run, tmp_path, monkeypatch):
    """A timeline of 24 ranks, one of them 20,000 spans long: rank 0 and the slowest, up to
    ``_MAX_TIMELINES``, each lane and colour one collection (a bar per span took minutes and
    gigabytes; a 600-rank figure was 700 inches tall)."""
    run_dir, _ = profiled_run
    with open(os.path.join(run_dir, "profile.json")) as f:
        profile = json.load(f)
    ranks = profile["timeline"]["ranks"]
    late = {**ranks[1], "end": ranks[1]["end"] + 1.0,
            "phases": [[*phase[:2], phase[2] + 1.0, phase[3] + 1.0] for phase in ranks[1]["phases"]]}
    ranks[0] = {**ranks[0], "phases": ranks[0]["phases"] * (20_000 // len(ranks[0]["phases"]) + 1)}
    profile["timeline"]["ranks"] = [ranks[0], *[ranks[1]] * 21, late, ranks[1]]  # rank 22 ends a second late
    for step in profile["steps"]:  # each rank's figures of the drawn step are what its spans give
        step["ranks"] = ([analysis.breakdown(analysis.StepTimeline(**rank)) for rank in profile["timeline"]["ranks"]]
                         if step["step"] == profile["timeline"]["step"] else
                         [step["ranks"][0]] * len(profile["timeline"]["ranks"]))
    profile["world_size"] = len(profile["timeline"]["ranks"])
    figured(profile)
    big = tmp_path / "big"
    big.mkdir()
    (big / "profile.json").write_text(json.dumps(profile))
    drawn = {}
    monkeypatch.setattr(report, "_save", lambda fig, path: drawn.setdefault(os.path.basename(path), fig) and path)
    write_report([str(big)], str(tmp_path / "plots"))
    axes = drawn["timeline.png"].axes[0]
    names = [label.get_text() for label in axes.get_yticklabels()]
    assert len(names) == 4 * report._MAX_TIMELINES and names[0] == "rank 0 compute" and "rank 22 compute" in names
    assert len(axes.collections) <= 16 * report._MAX_TIMELINES and not axes.patches  # by lane and colour, not span


def test_report_of_one_job_at_two_world_sizes_plots_scaling(profiled_run, tmp_path, monkeypatch):
    run_dir, _ = profiled_run
    with open(os.path.join(run_dir, "profile.json")) as f:
        profile = json.load(f)
    profile["world_size"], profile["tokens_per_step"] = 4, profile["tokens_per_step"] * 2
    _twice_the_ranks(profile)
    summarised(profile)
    wider = tmp_path / "world4"
    wider.mkdir()
    (wider / "profile.json").write_text(json.dumps(profile))
    drawn = {}
    monkeypatch.setattr(report, "_save", lambda fig, path: drawn.setdefault(os.path.basename(path), fig) and path)
    written = write_report([run_dir, str(wider)], str(tmp_path / "out"))
    assert "scaling.png" in [os.path.basename(p) for p in written] and len(written) == 7
    # each bar's parts add up to the typical step of its run as its slowest rank took it: the one the
    # profile names, after its warmup (the steps' median, which the throughput is of)
    bars = drawn["scaling.png"].axes[0].patches
    heights = [sum(bar.get_height() for bar in bars[run::2]) for run in range(2)]
    assert heights == pytest.approx([profile["summary"]["typical_step"]["figures"]["step_s"] * 1e3] * 2)


def _twice_the_ranks(profile: dict) -> None:
    """A profile of twice the ranks, each rank's steps as one of the profiled ones took them."""
    profile["timeline"]["ranks"] *= 2
    for step in profile["steps"]:
        step["ranks"] *= 2


@pytest.mark.slow
def test_unknown_peak_leaves_mfu_out(tmp_path):
    summary = run_workers(1, profiled_training, str(tmp_path / "run"), False)[0][1]
    assert "mfu" not in summary and summary["model_tflops_per_worker"] > 0
    with open(tmp_path / "run" / "profile.json") as f:
        assert json.load(f)["peak_tflops_per_worker"]["source"].startswith("unknown")


# -------------------------------------------------------------------------------- bad input


def test_report_on_a_directory_without_profile_data(tmp_path):
    with pytest.raises(ReportError, match="has no profile data .*shardwire train --profile --run-dir"):
        write_report([str(tmp_path)], str(tmp_path))
    odd = tmp_path / "my run;x"  # the hint runs as printed: quoted as a shell reads it
    odd.mkdir()
    with pytest.raises(ReportError, match=re.escape(f"--run-dir '{odd}'`")):
        write_report([str(odd)], str(tmp_path))
    with pytest.raises(ReportError, match="missing does not exist: give the run directory"):
        write_report([str(tmp_path / "missing")], str(tmp_path))
    (tmp_path / "file").write_text("")
    with pytest.raises(ReportError, match="is not a directory"):
        write_report([str(tmp_path / "file")], str(tmp_path))


def test_report_refuses_runs_of_different_jobs(profiled_run, tmp_path):
    run_dir, _ = profiled_run
    with open(os.path.join(run_dir, "profile.json")) as f:
        profile = json.load(f)
    other = tmp_path / "other"
    other.mkdir()
    profile["world_size"] = 4
    _twice_the_ranks(profile)
    profile["metadata"]["model"] = "medium"
    (other / "profile.json").write_text(json.dumps(profile))
    with pytest.raises(ReportError, match="runs differ in model: .* has 'small-6', .* has 'medium'"):
        write_report([run_dir, str(other)], str(tmp_path))


@pytest.mark.parametrize("name, dtype, tf32, peak", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989.0),
    ("NVIDIA H100 PCIe", torch.bfloat16, False, 756.0),
    ("NVIDIA H200", torch.float16, False, 989.0),
    ("NVIDIA A100-SXM4-80GB", torch.float32, True, 156.0),
    ("NVIDIA A100-SXM4-80GB", torch.float32, False, 19.5),
    ("NVIDIA GeForce RTX 3090", torch.bfloat16, False, None),
])
def test_the_peak_of_a_known_gpu_is_its_data_sheet_figure_in_the_compute_dtype(monkeypatch, name, dtype, tf32, peak):
    from shardwire.profile.flops import datasheet_peak_tflops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    with matmul_precision("tf32" if tf32 else "ieee"):
        assert datasheet_peak_tflops(torch.device("cuda", 0), dtype) == peak
    assert datasheet_peak_tflops(torch.device("cpu"), dtype) is None


@pytest.mark.parametrize("matmul, everything, tf32", [
    ("tf32", "ieee", True), ("ieee", "tf32", False), ("none", "tf32", True), ("none", "ieee", False)])
def test_tf32_is_read_through_the_current_precision_api(matmul, everything, tf32):
    from shardwire.profile.flops import matmul_uses_tf32

    with matmul_precision(matmul, everything):
        assert matmul_uses_tf32() is tf32
