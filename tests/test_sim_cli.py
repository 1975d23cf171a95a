"""``shardwire simulate`` and ``shardwire plan`` as users run them: inputs, outputs, bad input, the
bench results they read, and the calibration script's pure parts."""

import dataclasses
import importlib.util
import json
import os
import shlex
import socket
import subprocess
import sys

import pytest

from harness import PROFILE as A_PROFILE, measured, save_tokenizer
from shardwire.cli import main
from shardwire.sim import planner
from shardwire.sim.inputs import cluster_from_bench, load_spec
from shardwire.sim.planner import plan
from shardwire.sim.predict import predict
from shardwire.sim.presets import CLUSTERS, MODELS
from shardwire.sim.specs import SpecError, TrainingSpec, as_dict, parse

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--model", "gpt2-125m", "--cluster", "a100-100gbe", "--nodes", "2"]


def run(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_simulate_explains_the_step(capsys):
    status, out, err = run(capsys, "simulate", *SMALL, "--training", "{micro_batch: 4}")
    assert status == 0 and err == ""
    for expected in ("step time", "exposed comm", "MFU", "GiB per GPU", "fits", "per unit", "block"):
        assert expected in out
    assert "bound" in out.splitlines()[-1]


def test_simulate_json_has_the_promised_keys(capsys):
    status, out, _ = run(capsys, "simulate", *SMALL, "--json")
    doc = json.loads(out)
    for key in ("step_time_s", "compute_time_s", "exposed_comm_s", "tflops_per_gpu", "mfu", "memory_gb_per_gpu",
                "fits"):
        assert isinstance(doc[key], (int, float, bool)), key
    assert set(doc["comm"]) == {"all_gather_s", "reduce_scatter_s", "all_reduce_s"}
    assert set(doc["bytes_per_step"]) == {"inter_node", "intra_node"}
    assert doc["cluster"]["nodes"] == 2 and status == 0
    assert doc["step_time_s"] == pytest.approx(doc["compute_time_s"] + doc["compute_slowed_s"] + doc["exposed_comm_s"])


def test_sweep_over_nodes_with_scaling_efficiency_and_plot(capsys, tmp_path):
    plot = tmp_path / "sweep.png"
    with pytest.warns(UserWarning, match=r"--nodes 2 is replaced by each node count of --sweep nodes=\.\.\."):
        status, out, _ = run(capsys, "simulate", *SMALL, "--sweep", "nodes=1,2,4", "--json", "--plot", str(plot))
    doc = json.loads(out)
    assert status == 0 and [p["cluster"]["nodes"] for p in doc["points"]] == [1, 2, 4]
    efficiency = [p["scaling_efficiency"] for p in doc["points"]]
    assert efficiency[0] == pytest.approx(1.0) and efficiency[2] < 1.0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    status, out, _ = run(capsys, "simulate", *SMALL, "--sweep", "prefetch=0,2")
    header = next(line for line in out.splitlines() if "step s" in line)
    assert status == 0 and header.split()[0] == "prefetch" and "scaling" not in header
    training = next(line for line in out.splitlines() if line.startswith("training"))
    assert "swept prefetch (sliding window)" in training  # not the first point's prefetch 0


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt5", "--cluster", "a100-100gbe"], "unknown model preset 'gpt5'; known presets: tiny, small"),
    (["--model", "{layers: 2, hidden: 64}", "--cluster", "a100-100gbe"], "missing key(s) heads, vocab, seq_len"),
    (["--model", "gpt2-125m", "--cluster", "{preset: a100-100gbe, inter_node: {busbw_GBps: -1}}"],
     "busbw_GBps must be positive"),
    (["--model", "gpt2-125m", "--cluster", "a100-100gbe", "--training", "{limiter: window}"],
     "limiter must be one of sliding, block"),
    (["--model", "gpt2-125m", "--cluster", "a100-100gbe", "--plot", "x.png"], "--plot draws a sweep"),
    (["--model", "gpt2-125m", "--cluster", "a100-100gbe", "--sweep", "nodes"], "--sweep takes KEY=V1,V2"),
    (["--model", "{preset: gpt2-125m, positions: 512}", "--cluster", "a100-100gbe"],
     "positions (512) are the rows of a decoder's learned position table, at least its seq_len (1024)"),
    (["--model", "gpt2-125m", "--cluster", "a100-100gbe", "--sweep", "nodes=1,many"], "nodes must be a whole number"),
    (["--model", "gpt2-125m", "--cluster", "a100-100gbe", "--sweep", "nodes=,"], "--sweep takes KEY=V1,V2"),
    (["--model", "gpt2-125m", "--cluster", "a100-100gbe", "--sweep", "nodes=[1"],
     "nodes must be a whole number, got '[1'"),
    (["--model", "{preset: [a]}", "--cluster", "a100-100gbe"],
     "unknown model preset ['a']; known presets: tiny, small"),
    (["--model", "gpt2-125m", "--cluster", "missing.yaml"], "missing.yaml does not exist"),
    (["--model", "gpt2-125m", "--cluster", "{preset: a100-100gbe, gpu: b200}"],
     "unknown GPU preset 'b200'; known GPUs: a100-80gb"),
    (["--model", "gpt-125m", "--seq-len", "0", "--cluster", "a100-100gbe"], "--seq-len must be at least 1, got 0"),
    (["--model", "hf:missing", "--cluster", "a100-100gbe"], "hf:missing does not exist"),
    (["--model", "hf:{\"model_type\": \"gpt2\"}", "--cluster", "a100-100gbe"], "its config gives no layers"),
    (["--model", "gpt-125m", "--cluster", "a100-100gbe", "--training", "{precision: fp8}"],
     "precision fp8 needs fp8 tensor cores: cluster 'a100-100gbe' gives no fp8_tflops"),
    (["--model", "gpt-125m", "--cluster", "a100-100gbe", "--calibrate", "missing.json"],
     "error: missing.json does not exist: give the profile.json `shardwire train --profile` wrote"),
])
def test_bad_input_says_what_is_wrong(capsys, argv, message):
    status, out, err = run(capsys, "simulate", *argv)
    assert status == 2 and out == ""
    assert message in err


def test_a_configuration_that_does_not_fit_says_by_how_much(capsys):
    status, out, err = run(capsys, "simulate", "--model", "llama2-70b", "--cluster", "a100-100gbe", "--nodes", "1")
    assert status == 1 and "DOES NOT FIT" in out
    assert "does not fit: needs" in err and "GiB more than the 73.6 GiB usable of 80 GiB" in err


def test_inputs_from_files_and_preset_overrides(tmp_path):
    path = tmp_path / "mycluster.yaml"
    path.write_text("preset: ibm-a100-ethernet\nnodes: 16\ninter_node: {latency_us: 20}\n")
    cluster = load_spec("cluster", str(path))
    assert cluster.name == "mycluster" and cluster.nodes == 16
    assert cluster.inter_node.latency_us == 20 and cluster.inter_node.busbw_GBps == 15.0
    faster = load_spec("cluster", "{preset: a100-100gbe, gpu: h100-sxm, matmul_efficiency: 0.5}")
    assert (faster.gpu, faster.peak_tflops, faster.fp8_tflops) == ("h100-sxm", 989.0, 1979.0)
    assert faster.matmul_efficiency == 0.5 and faster.inter_node == CLUSTERS["a100-100gbe"].inter_node
    inline = load_spec("training", '{"preset": "ibm-t5-3b", "micro_batch": 8}')
    assert inline.micro_batch == 8 and inline.activation_checkpointing
    with pytest.raises(SpecError, match="unknown cluster preset 'nope'"):
        load_spec("cluster", "{preset: nope}")


def bench_document(nodes=2, per_node=2, backend="gloo", impl="shardwire"):
    """A ``shardwire.bench/1`` document with known fits (see shardwire.bench.report), each the fit of
    the times it gives at 8 sizes, as bench writes them."""
    fits = {"intra": {"all_gather": (1e-4, 4e9), "reduce_scatter": (3e-4, 2e9)},
            "inter": {"all_gather": (2e-3, 0.25e9)}}
    sizes = [1024 * 4 ** i for i in range(8)]
    world = nodes * per_node
    groups = {"world": {"ranks": world, "members": [list(range(world))]},
              "intra": {"ranks": per_node, "members": [list(range(n * per_node, (n + 1) * per_node))
                                                       for n in range(nodes)]},
              "inter": {"ranks": nodes, "members": [list(range(0, world, per_node))]}}
    return {
        "schema": "shardwire.bench/1",
        "context": {"world": world, "nodes": nodes, "ranks_per_node": per_node, "backend": backend,
                    "settings": {"impl": impl}, "groups": groups},
        "results": {group: {op: [{"bytes": size, "out_of_place": {"time_us": (alpha + size / beta) * 1e6}}
                                 for size in sizes] for op, (alpha, beta) in ops.items()}
                    for group, ops in fits.items()},
        "summary": {},
        "fit": {group: {"all_gather": None, "reduce_scatter": None,
                        **{op: {"ranks": 2, "placement": "out_of_place", "alpha_s": alpha, "beta_Bps": beta, "r2": 1.0,
                                "points": len(sizes)} for op, (alpha, beta) in ops.items()}}
                for group, ops in fits.items()},
    }


def test_cluster_from_bench_converts_fits_to_busbw_and_step_latency(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench_document()))
    cluster = cluster_from_bench(str(path), CLUSTERS["a100-100gbe"])
    assert (cluster.nodes, cluster.gpus_per_node, cluster.algorithm) == (2, 2, "hierarchical")
    # busbw = beta (k-1)/k; latency per step = alpha / (k-1); averaged over the ops measured
    assert cluster.intra_node.busbw_GBps == pytest.approx((2 + 1) / 2)
    assert cluster.intra_node.latency_us == pytest.approx((100 + 300) / 2)
    assert cluster.inter_node.busbw_GBps == pytest.approx(0.125)
    assert cluster.inter_node.latency_us == pytest.approx(2000)
    assert cluster.peak_tflops == CLUSTERS["a100-100gbe"].peak_tflops

    path.write_text(json.dumps(bench_document(backend="nccl", impl="torch")))
    assert cluster_from_bench(str(path), CLUSTERS["a100-100gbe"]).algorithm == "ring"
    doc = bench_document()
    doc["fit"].pop("inter")
    path.write_text(json.dumps(doc))
    with pytest.raises(SpecError, match="no usable all_gather or reduce_scatter fit for the 'inter' group"):
        cluster_from_bench(str(path), CLUSTERS["a100-100gbe"])
    path.write_text(json.dumps({"schema": "something else"}))
    with pytest.raises(SpecError, match="is not `shardwire bench --json` output"):
        cluster_from_bench(str(path), CLUSTERS["a100-100gbe"])


def test_cluster_from_bench_takes_the_shares_measured_of_each_level(tmp_path):
    path = tmp_path / "bench.json"
    doc = bench_document()
    path.write_text(json.dumps(doc))
    preset = CLUSTERS["a100-100gbe"]
    unmeasured = cluster_from_bench(str(path), preset)
    assert unmeasured.intra_node.compute_share == preset.intra_node.compute_share  # the cluster's own stays
    doc["contention"] = {"workload": {"op": "matmul", "n": 1024, "dtype": "float32"},
                         "intra": {"alone_s": 0.7, "beside_s": 1.0, "compute_share": 0.3,
                                   "rank_shares": [0.2, 0.4, 0.2, 0.4], "bandwidth_share": 0.4,
                                   "rank_bandwidth_shares": [0.4] * 4},
                         "world": {"alone_s": 0.9, "beside_s": 1.0, "compute_share": 0.1,
                                   "rank_shares": [0.1, 0.0, 0.2, 0.1], "bandwidth_share": 0.2,
                                   "rank_bandwidth_shares": [0.2] * 4}}
    path.write_text(json.dumps(doc))
    measured = cluster_from_bench(str(path), preset)
    assert (measured.intra_node.compute_share, measured.intra_node.bandwidth_share) == (0.3, 0.4)
    assert (measured.inter_node.compute_share, measured.inter_node.bandwidth_share) == (0.1, 0.2)  # the world's


def test_cluster_from_bench_takes_the_worlds_fit_where_it_is_one_levels_group(tmp_path):
    """On one node, or one rank a node, the world's group is the other level's: a bench of the world
    (its default) was refused with a hint to measure a group that cannot be formed there."""
    path = tmp_path / "bench.json"
    for nodes, per_node, level in ((1, 2, "intra_node"), (2, 1, "inter_node")):
        doc = bench_document(nodes=nodes, per_node=per_node)
        doc["fit"] = {"world": doc["fit"]["intra"]}
        doc["results"] = {"world": doc["results"]["intra"]}
        path.write_text(json.dumps(doc))
        cluster = cluster_from_bench(str(path), CLUSTERS["a100-100gbe"])
        assert getattr(cluster, level).busbw_GBps == pytest.approx((2 + 1) / 2), level


def test_a_one_node_bench_leaves_the_network_between_nodes_its_own_shares(tmp_path):
    """Its world's contention, measured within the node, was taken for the links between nodes too."""
    path = tmp_path / "bench.json"
    doc = bench_document(nodes=1, per_node=2)
    doc["fit"], doc["results"] = {"world": doc["fit"]["intra"]}, {"world": doc["results"]["intra"]}
    doc["contention"] = {"workload": {"op": "matmul", "n": 1024, "dtype": "float32"},
                         "world": {"alone_s": 0.7, "beside_s": 1.0, "compute_share": 0.3, "rank_shares": [0.2, 0.4],
                                   "bandwidth_share": 0.9, "rank_bandwidth_shares": [0.9, 0.9]}}
    path.write_text(json.dumps(doc))
    preset = CLUSTERS["a100-100gbe"]
    measured = cluster_from_bench(str(path), preset)
    assert (measured.intra_node.compute_share, measured.intra_node.bandwidth_share) == (0.3, 0.9)
    assert measured.inter_node.compute_share == preset.inter_node.compute_share
    assert measured.inter_node.bandwidth_share == preset.inter_node.bandwidth_share
    # its link between nodes is the preset's too, which the cluster's name says (not "measured")
    assert measured.inter_node.busbw_GBps == preset.inter_node.busbw_GBps
    assert measured.name == "a100-100gbe measured by bench.json (inter-node link not measured)"
    long = dataclasses.replace(preset, name="c" * 190)  # a name the user did not write is never refused
    name = cluster_from_bench(str(path), long).name
    assert len(name) <= 200 and name.endswith(" measured by bench.json (inter-node link not measured)")


def test_simulate_takes_the_cluster_from_bench_results(capsys, tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench_document()))
    status, out, _ = run(capsys, "simulate", "--model", "gpt2-125m", "--cluster", "a100-100gbe",
                         "--cluster-from", str(path), "--json")
    doc = json.loads(out)
    assert doc["cluster"]["inter_node"]["busbw_GBps"] == pytest.approx(0.125) and doc["cluster"]["nodes"] == 2
    changed = "{preset: a100-100gbe, gpus_per_node: 4, inter_node: {latency_us: 5}, peak_tflops: 100}"
    with pytest.warns(UserWarning, match=rf"^--cluster-from {path} replaces the --cluster's gpus_per_node, "
                                         rf"inter_node with what it measured; leave them out of --cluster$"):
        run(capsys, "simulate", "--model", "gpt2-125m", "--cluster", changed, "--cluster-from", str(path))


def test_a_setting_swept_under_its_old_name_works_for_a_release_with_a_warning(capsys):
    with pytest.warns(FutureWarning, match="^--sweep: sharding is renamed layout"):
        status, out, _ = run(capsys, "simulate", "--model", "gpt2-125m", "--cluster", "a100-100gbe", "--nodes", "2",
                             "--sweep", "sharding=full,hybrid")
    assert status == 0 and "sweep     layout = full, hybrid " in out


@pytest.mark.slow
def test_plan_finds_the_fastest_configuration_that_fits_and_says_why():
    cluster = CLUSTERS["a100-100gbe"]
    result = plan(MODELS["gpt2-350m"], cluster, 8 * 64, TrainingSpec())
    best = result.best
    assert best.memory.fits
    assert result.runner_up.step_time_s >= best.step_time_s
    assert all(a.step_time_s is None or a.step_time_s >= best.step_time_s * 0.999 for a in result.alternatives)
    assert {a.change.split()[0] for a in result.alternatives} >= {"micro-batch", "layout", "prefetch"}
    assert best.training.micro_batch * best.training.grad_accum == 8


def test_a_plan_whose_search_would_take_minutes_keeps_each_settings_largest_micro_batches(monkeypatch):
    """1,920 sequences per GPU: every divisor a micro-batch, each simulated in full, took 502 s. The
    search keeps to a budget of unit passes: each setting of the rest keeps its largest micro-batches
    that fit, so that a small one that fits without checkpointing, faster than a large one with it,
    is still searched (cut by size alone, the search chose a plan 23% slower); it says what it left
    out, and prices a one-change alternative it left out alone."""
    cluster = dataclasses.replace(CLUSTERS["a100-100gbe"], gpu_memory_gb=6)
    args = MODELS["gpt2-350m"], cluster, 16 * 64, TrainingSpec()
    whole = plan(*args, exact=True)
    assert (whole.best.training.micro_batch, whole.best.training.activation_checkpointing) == (2, False)
    monkeypatch.setattr(planner, "MAX_SEARCH_PASSES", 2_000)
    cut = plan(*args, exact=True)
    assert cut.best.training == whole.best.training and cut.candidates == whole.candidates
    left_out = [n for n in cut.notes if "simulated only with its largest micro-batch that fit" in n]
    assert len(left_out) == 1 and not any("simulated only" in n for n in whole.notes), cut.notes
    assert [a.step_time_s for a in cut.alternatives] == [a.step_time_s for a in whole.alternatives]


def test_plan_finds_the_micro_batches_without_counting_to_the_batch():
    assert planner._divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert planner._divisors(1) == [1]
    assert planner._divisors(2**40) == [2**k for k in range(41)]  # at once: pairs up to the square root


@pytest.mark.slow
def test_plan_command_and_its_errors(capsys):
    status, out, _ = run(capsys, "plan", "--model", "gpt-125m", "--cluster", "a100-100gbe", "--nodes", "2",
                         "--global-batch", "64")
    assert status == 0 and "best" in out and "why: each setting changed alone" in out and "runner-up" in out
    rendezvous = ("run:   torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d "
                  "--rdzv-endpoint=HEAD_ADDRESS:29500 --rdzv-id=shardwire -m shardwire train --model gpt-125m "
                  "--seq-len 2048 --batch ")
    assert out.count(rendezvous) == 3
    assert out.count("or:    shardwire.shard(model, layout=") == 3  # the best, the runner-up, the one that syncs
    assert out.count(" --wire ") == 3 and out.count(", wire='") == 3
    status, out, _ = run(capsys, "plan", "--model", "gpt-125m", "--cluster", "a100-100gbe", "--nodes", "2",
                         "--global-batch", "64", "--json")
    doc = json.loads(out)
    assert doc["best"]["fits"] and doc["fitting"] <= doc["candidates"] and doc["alternatives"]
    run_best = doc["best"]["run"]
    assert run_best["command"].endswith(" ".join(run_best["train_options"]))
    assert run_best["shard_arguments"]["layout"] in ("full", "hybrid", "hybrid_secondary")
    status, _, err = run(capsys, "plan", "--model", "gpt-125m", "--cluster", "a100-100gbe", "--nodes", "2",
                         "--global-batch", "100")
    assert status == 2 and "does not divide over 16 GPUs; the nearest that do are 96, 112" in err
    status, _, err = run(capsys, "plan", "--model", "llama2-70b", "--cluster", "a100-100gbe", "--nodes", "1",
                         "--global-batch", "8")
    assert status == 2 and "no configuration of llama2-70b" in err and "GiB more than the" in err
    status, _, err = run(capsys, "plan", "--model", "gpt-125m", "--cluster", "a100-100gbe", "--nodes", "2",
                         "--global-batch", "64", "--training", "{layout: hybrid, shard_group_size: 3}")
    assert status == 2 and "shard_group_size 3 must divide the cluster's 16 GPUs" in err  # refused, not dropped


@pytest.mark.slow
def test_plan_marks_lossy_wires_and_searches_exact_ones_alone(capsys):
    """On a slow network the fastest wire quantizes gradients: the plan says it is lossy, and
    --exact leaves quantized wires out of the search."""
    argv = ["plan", "--model", "gpt-1.3b", "--cluster", "{preset: a100-100gbe, gpus_per_node: 4}", "--nodes", "2",
            "--global-batch", "64"]
    status, out, _ = run(capsys, *argv, "--json")
    best = json.loads(out)["best"]
    assert status == 0 and best["training"]["wire"] != "none"
    assert best["run"]["lossy"].startswith("lossy: the wire quantizes gradients between nodes")
    status, out, _ = run(capsys, *argv)
    assert "          lossy: the wire quantizes" in out and "plan --exact for exact collectives only" in out
    status, out, _ = run(capsys, *argv, "--exact", "--json")
    doc = json.loads(out)
    assert status == 0 and doc["best"]["training"]["wire"] == "none" and doc["best"]["run"]["lossy"] is None
    assert doc["candidates"] < json.loads(run(capsys, *argv, "--json")[1])["candidates"]


def test_plan_takes_what_train_takes_and_says_what_train_cannot_run(capsys, tmp_path):
    """The GPT sizes and hf: configs (read without torch) get a command; a model train does not
    name, and fp8 gathers, get the shard(...) arguments and the reason there is no command."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 8,
                                  "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 4096,
                                  "vocab_size": 32000, "max_position_embeddings": 4096, "tie_word_embeddings": False}))
    cluster = ["--cluster", "h100-ib-400", "--nodes", "1", "--global-batch", "16"]
    status, out, _ = run(capsys, "plan", "--model", f"hf:{config}", "--seq-len", "2048", *cluster, "--json")
    doc = json.loads(out)
    assert status == 0 and doc["best"]["model"]["ffn_gated"] and doc["best"]["model"]["norm"] == "rmsnorm"
    assert f"-m shardwire train --model hf:{config} --seq-len 2048 " in doc["best"]["run"]["command"]
    status, out, _ = run(capsys, "plan", "--model", "llama2-7b", *cluster)
    assert status == 0 and out.count("not run by shardwire train: shardwire train names no model 'llama2-7b'") == 2
    status, out, _ = run(capsys, "plan", "--model", "{preset: gpt-125m, seq_len: 1024}", *cluster)  # a size train has
    assert status == 0 and "-m shardwire train --model gpt-125m --seq-len 1024 " in out
    coded = tmp_path / "coded"  # custom code for a model_type of its own: neither simulated nor trained
    coded.mkdir()
    (coded / "config.json").write_text(json.dumps({**json.loads(config.read_text()), "model_type": "mine",
                                                   "auto_map": {"AutoModelForCausalLM": "mine.Model"}}))
    status, _, err = run(capsys, "plan", "--model", f"hf:{coded}", *cluster)  # no shape the simulator knows
    assert status == 2 and "its model_type 'mine' is not one whose shape the simulator knows" in err
    status, out, _ = run(capsys, "plan", "--model", "gpt-350m", *cluster, "--training", "{precision: fp8}")
    assert status == 0 and "--precision fp8" in out and "run:   torchrun" in out
    assert "or:    shardwire.models.fp8.convert(model, units); shardwire.shard(model, " in out
    status, out, _ = run(capsys, "plan", "--model", "gpt-350m", *cluster, "--training",
                         "{precision: fp8, fp8_all_gather: true}")
    assert status == 0 and "(fp8 gathers) is simulated, not run" in out and "run:   torchrun" not in out
    status, _, err = run(capsys, "plan", "--model", "gpt-350m", "--cluster", "a100-100gbe", "--nodes", "1",
                         "--global-batch", "16", "--training", "{precision: fp8}")
    assert status == 2 and "precision fp8 needs fp8 tensor cores" in err


# ----------------------------------------------------------------------- calibration script


@pytest.fixture(scope="module")
def calibrate():
    spec = importlib.util.spec_from_file_location("calibrate_sim", os.path.join(REPO, "benchmarks", "calibrate_sim.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


PROFILE = {"forward_s": 0.004, "backward_s": 0.008, "optimizer_s": 0.001, "wait_s": 0.5}


def test_calibration_reads_the_measured_runs(calibrate):
    """scaling.json as benchmarks/scaling.py writes it; a rank's share of the machine is the
    compute-only step on one rank over the step on as many as the run had."""
    doc = {"args": {"model": "30m", "batch": 2, "prefetch": 2, "reshard": True},
           "compute_times_s": {"1": [0.25], "2": [0.5], "4": [0.5, 1.5, 1.0]},
           "rows": [{"system": "fsdp2", "cluster": "2x2 @1gbit", "step_times": [9.0], "profile": None},
                    {"system": "shardwire", "cluster": "2x2 @1gbit", "step_times": [1.5, 1.4, 9.0], "profile": PROFILE},
                    {"system": "shardwire", "cluster": "1x2", "step_times": [1.0, 3.0, 2.0], "profile": PROFILE},
                    {"system": "shardwire-hybrid", "cluster": "2x2 @1gbit", "step_times": [1.2], "profile": PROFILE}]}
    settings, runs, alone = calibrate.read_measured(doc)
    assert settings == calibrate.Settings("30m", 2, 2, True) and alone == 0.25
    assert runs == [calibrate.Run("shardwire", 2, 2, "1gbit", 1.5, 0.25, PROFILE),
                    calibrate.Run("shardwire", 1, 2, None, 2.0, 0.5, PROFILE),
                    calibrate.Run("shardwire-hybrid", 2, 2, "1gbit", 1.2, 0.25, PROFILE)]
    assert [r.cluster for r in runs] == ["2x2 @1gbit", "1x2", "2x2 @1gbit"]
    assert runs[0].engine_compute_s == pytest.approx(0.013)
    without_one_rank = {**doc, "compute_times_s": {"2": [0.5], "4": [1.0]}}
    with pytest.raises(ValueError, match="no compute-only step on one rank"):
        calibrate.read_measured(without_one_rank)
    assert calibrate.read_measured(without_one_rank, one_rank_s=0.25)[1][0].share == 0.25
    with pytest.raises(ValueError, match="no shardwire run"):
        calibrate.read_measured({**doc, "rows": doc["rows"][:1]})
    unprofiled = {**doc, "rows": [{**doc["rows"][1], "profile": None}]}
    with pytest.raises(ValueError, match="shardwire's run on 2x2 @1gbit has no profile"):
        calibrate.read_measured(unprofiled)
    with pytest.raises(ValueError, match="no shardwire run on 1x1"):
        calibrate.one_rank(runs)


def test_calibration_predicts_from_one_ranks_profile_and_the_network(calibrate, tmp_path):
    """The 1x1 run's profile fits the machine's compute model: its step on one rank is predicted as
    measured, and a rank of a larger run gets its share of the machine."""
    settings = calibrate.Settings("small", 4, 2, True)
    model = calibrate.model_spec(settings)
    assert (model.layers, model.hidden, model.vocab) == (4, 128, 256)
    single = calibrate.Run("shardwire", 1, 1, None, 0.02, 1.0, PROFILE)
    machine = calibrate.machine_cluster(single, settings)
    alone = predict(model, machine, calibrate.training_spec(settings))
    assert alone.timeline.compute["forward"] + alone.timeline.compute["backward"] == pytest.approx(0.012)
    assert alone.timeline.compute["optimizer"] == pytest.approx(0.001)

    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench_document()))
    run = calibrate.Run("shardwire", 2, 2, "1gbit", 0.2, 0.25, PROFILE)
    p = calibrate.predict_run(run, machine, settings, str(path))
    assert p.cluster.world == 4 and p.cluster.algorithm == "hierarchical"
    assert p.timeline.compute["forward"] + p.timeline.compute["backward"] == pytest.approx(0.012 / 0.25)
    assert p.timeline.compute["optimizer"] == pytest.approx(0.001 / 4 / 0.25)  # a quarter of the model
    comparison = calibrate.Comparison(run, p.step_time_s, p.compute_time_s, p.compute_slowed_s, p.exposed_comm_s)
    assert comparison.error == pytest.approx(p.step_time_s / 0.2 - 1)
    assert "| 2x2 @1gbit | shardwire |" in calibrate.table(settings, [comparison])
    hybrid_run = dataclasses.replace(run, system="shardwire-hybrid")
    hybrid = calibrate.predict_run(hybrid_run, machine, settings, str(path))
    assert (hybrid.training.layout, hybrid.training.shard_group_size) == ("hybrid", 2)
    assert hybrid.timeline.compute["optimizer"] == pytest.approx(0.001 / 2 / 0.25)  # each rank steps half


def test_calibration_takes_a_clusters_bench_before_its_links(calibrate):
    benches = {"1gbit": "links.json", "2x1@1gbit": "2x1.json", "5gbit": "fast.json"}
    run = calibrate.Run("shardwire", 2, 1, "1gbit", 1.0, 1.0, PROFILE)
    assert calibrate.bench_for(run, benches) == "2x1.json"
    assert calibrate.bench_for(dataclasses.replace(run, ranks_per_node=2), benches) == "links.json"
    assert calibrate.bench_for(dataclasses.replace(run, link="5gbit"), benches) == "fast.json"
    assert calibrate.bench_for(dataclasses.replace(run, nodes=1, link=None), benches) == "links.json"
    assert calibrate.bench_for(dataclasses.replace(run, link="10gbit"), benches) is None


def test_simulating_and_planning_do_not_import_torch():
    """``shardwire simulate`` and ``plan`` are pure Python, so they start at once on any laptop, a
    Hugging Face config and the GPT sizes of ``shardwire train`` included."""
    config = json.dumps({"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 512,
                         "vocab_size": 1000, "tie_word_embeddings": False})
    code = ("import sys; from shardwire.cli import main; "
            "main(['simulate', '--model', 'gpt2-125m', '--cluster', 'a100-100gbe', '--json']); "
            f"main(['plan', '--model', 'hf:' + {config!r}, '--cluster', 'a100-100gbe', '--global-batch', '64']); "
            "main(['plan', '--model', 'gpt-125m', '--cluster', 'a100-100gbe', '--global-batch', '64']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_command_the_plan_prints_runs(tmp_path):
    """The best and the runner-up of a plan for 2 nodes x 2 GPUs, their torchrun commands run as
    printed: two agents on this machine stand for the two nodes, meeting at a rendezvous on
    loopback where the command says the first node's address; a few steps each."""
    cluster = "{preset: a100-100gbe, nodes: 2, gpus_per_node: 2}"
    planned = subprocess.run([sys.executable, "-m", "shardwire", "plan", "--model", "tiny", "--cluster", cluster,
                              "--global-batch", "16", "--json"], capture_output=True, text=True, timeout=120)
    assert planned.returncode == 0, planned.stderr
    doc = json.loads(planned.stdout)
    for choice in (doc["best"], doc["runner_up"]):
        command = shlex.split(choice["run"]["command"])
        assert command[0] == "torchrun" and "--nnodes=2" in command and "--model" in command
        endpoint = f"127.0.0.1:{_free_port()}"
        argv = [sys.executable, "-m", "torch.distributed.run",
                *(arg.replace("HEAD_ADDRESS:29500", endpoint) for arg in command[1:]),
                "--steps", "2", "--log-every", "1", "--eval-batches", "1"]
        nodes = [subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for _ in range(2)]
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
        for node, output in zip(nodes, outputs, strict=True):
            assert node.returncode == 0, output
        assert any("done: 2 steps" in output for output in outputs)


def test_plan_says_what_an_hf_model_without_a_tokenizer_needs_beside_its_command(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
                                  "vocab_size": 300}))
    argv = ["plan", "--model", f"hf:{config}", "--cluster", "a100-100gbe", "--nodes", "1", "--global-batch", "16"]
    status, out, _ = run(capsys, *argv)
    assert status == 0 and out.count("add:   --data: the model's 300 ids are its tokenizer's") == 2
    doc = json.loads(run(capsys, *argv, "--json")[1])
    assert doc["best"]["run"]["command"] and "--tokenizer DIR" in doc["best"]["run"]["needs"]
    save_tokenizer(tmp_path)  # beside config.json: the directory holds the model's tokenizer
    argv[2] = f"hf:{tmp_path}"
    assert json.loads(run(capsys, *argv, "--json")[1])["best"]["run"]["needs"] is None
    assert json.loads(run(capsys, *argv[:2], "tiny", *argv[3:], "--json")[1])["best"]["run"]["needs"] is None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_command_the_plan_prints_for_an_hf_model_with_its_tokenizer_runs(tmp_path):
    """A Hugging Face model directory with its tokenizer: its text reads the default corpus, so the
    plan's command runs as printed (one node standing for the planned one, a few steps)."""
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    model = tmp_path / "gpt2-mini"
    save_tokenizer(model)
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                                   "n_positions": 64, "vocab_size": 300}))
    planned = subprocess.run([sys.executable, "-m", "shardwire", "plan", "--model", f"hf:{model}", "--seq-len", "32",
                              "--cluster", "{preset: a100-100gbe, nodes: 1, gpus_per_node: 2}", "--global-batch", "4",
                              "--json"], capture_output=True, text=True, timeout=120)
    assert planned.returncode == 0, planned.stderr
    best = json.loads(planned.stdout)["best"]["run"]
    assert best["needs"] is None
    command = shlex.split(best["command"])
    argv = [sys.executable, "-m", "torch.distributed.run",
            *(arg.replace("HEAD_ADDRESS:29500", f"127.0.0.1:{_free_port()}") for arg in command[1:]),
            "--steps", "2", "--log-every", "1", "--eval-batches", "1"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0 and "done: 2 steps" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def profile_document(model="gpt-1.3b", batch=8, forward=0.08, backward=0.17, optimizer=0.011) -> dict:
    """A profile.json as ``shardwire train --profile`` writes it (a real one), with the medians and
    the job calibration reads changed."""
    with open(A_PROFILE) as f:
        document = json.load(f)
    for part, seconds in (("forward_s", forward), ("backward_s", backward), ("optimizer_s", optimizer)):
        measured(document, part, seconds)
    document["metadata"]["config"].update(model=model, batch=batch)
    document["metadata"]["model"] = model
    return document


def test_calibration_fits_the_compute_model_to_a_profile(capsys, tmp_path):
    """The profiled job is predicted as measured; the optimizer step gives its rate; the matrix
    multiplies and attention take what the memory-bound work leaves."""
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_document()))
    one_gpu = ["--model", "gpt-1.3b", "--cluster", "{preset: h100-ib-400, gpus_per_node: 1}", "--nodes", "1",
               "--training", "{micro_batch: 8}"]
    status, out, _ = run(capsys, "simulate", *one_gpu, "--calibrate", str(path), "--json")
    doc = json.loads(out)
    assert status == 0 and doc["compute"]["forward"] + doc["compute"]["backward"] == pytest.approx(0.25)
    assert doc["compute"]["optimizer"] == pytest.approx(0.011)
    preset = CLUSTERS["h100-ib-400"]
    scale = doc["cluster"]["matmul_efficiency"] / preset.matmul_efficiency
    assert doc["cluster"]["attention_efficiency"] == pytest.approx(preset.attention_efficiency * scale)
    assert doc["cluster"]["name"] == "h100-ib-400, changed (calibrated by profile.json)"
    # a larger batch on the same GPU: more compute, at the fitted rates
    status, out, _ = run(capsys, "simulate", *one_gpu[:-1], "{micro_batch: 16}", "--calibrate", str(path), "--json")
    assert 0.25 * 1.9 < json.loads(out)["compute"]["forward"] + json.loads(out)["compute"]["backward"] < 0.25 * 2.1


@pytest.mark.parametrize("recorded, layout, size, nodes, ranks", [
    (None, "full", None, 1, 4),
    (None, "hybrid_secondary", 1, 1, 4),  # its optimizer state is split over every rank
    (None, "hybrid", 1, 1, 1),
    (2, "hybrid", None, 1, 2),  # as recorded: a node's ranks, which the job's options do not say
])
def test_the_optimizer_step_streams_the_share_the_profiled_layout_split(recorded, layout, size, nodes, ranks):
    """A profile of several ranks: its optimizer step streamed one share of the state, split over
    the ranks the job's layout split it over (recorded since profiles record it, else from the job)."""
    from shardwire.sim.calibrate import _optimizer_ranks

    doc = {"world_size": 4, "metadata": {"config": {"layout": layout, "shard_group_size": size, "nnodes": nodes}}}
    if recorded is not None:
        doc["metadata"]["optimizer_ranks"] = recorded
    assert _optimizer_ranks("profile.json", doc, "") == ranks


def test_a_profile_that_does_not_say_how_its_state_was_split_is_refused():
    from shardwire.sim.calibrate import _optimizer_ranks

    unknown = {"world_size": 4, "metadata": {"config": {"layout": "hybrid", "shard_group_size": None, "nnodes": 1}}}
    with pytest.raises(SpecError, match="does not say how many ranks its 4 ranks' optimizer states were split over"):
        _optimizer_ranks("profile.json", unknown, "")
    for edited in (3, "2", True):
        with pytest.raises(SpecError, match=r"is damaged \(its metadata's optimizer_ranks is .*, not a whole number "):
            _optimizer_ranks("profile.json", {**unknown, "metadata": {**unknown["metadata"], "optimizer_ranks": edited}},
                             "")


def test_calibration_refuses_a_sweep_of_what_it_fits(capsys, tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_document()))
    status, _, err = run(capsys, "simulate", "--model", "gpt-1.3b", "--cluster", "h100-ib-400", "--calibrate",
                         str(path), "--sweep", "matmul_efficiency=0.5,0.6")
    assert status == 2 and "--sweep matmul_efficiency=... would replace part of that fit" in err


@pytest.mark.parametrize("profile, message", [
    (profile_document(forward=0.02, backward=0.04), "take less than their memory-bound work alone"),
    (profile_document(forward=0.03, backward=0.07), "faster than the peak of cluster 'h100-ib-400' allows"),
    # far slower than the GPU runs (a CPU's profile): blamed on the profile, never on the cluster given
    (profile_document(forward=800.0, backward=1700.0), "profile.json: its compute runs at 4.1e-05 of the peak of "
                                                        "cluster 'h100-ib-400', slower than any GPU runs its kernels"),
    (profile_document(optimizer=1e300), "profile.json is damaged (summary.figures.step_s.min is 1e+300: times, "
                                        "bytes and ratios are numbers from 0 to 1e+15)"),
    ({**profile_document(), "summary": {}}, "is damaged (summary has no figures, unlike a profile of `shardwire "
                                            "train --profile`)"),
    (profile_document(model="nope"), "unknown model preset 'nope'"),
])
def test_calibration_refuses_a_profile_that_cannot_be_this_gpus(capsys, tmp_path, profile, message):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    status, out, err = run(capsys, "simulate", "--model", "gpt-1.3b", "--cluster", "h100-ib-400",
                           "--calibrate", str(path))
    assert status == 2 and out == "" and message in err and err.count("\n") == 1 and "cluster: " not in err


def test_a_preset_with_learned_positions_at_another_seq_len_is_not_held_to_its_stated_count(capsys):
    """The count a preset states is at its own context: a table of learned positions grows with the
    sequence, so a long --seq-len must not be blamed on the preset's parameters."""
    status, out, _ = run(capsys, "simulate", "--model", "gpt2-1.5b", "--cluster", "a100-100gbe", "--seq-len", "1000000")
    assert "params says" not in out
    assert out.startswith("model     gpt2-1.5b: 3.16B parameters")


def test_a_gpu_without_bf16_refuses_bf16_in_one_line_and_runs_fp16(capsys):
    """The V100's tensor cores take fp16, not bf16: a bf16 spec on it is refused, saying what to give."""
    code, out, err = run(capsys, "simulate", "--model", "gpt-1.3b", "--cluster", "v100-dgx2-ib-800", "--nodes", "2")
    assert code == 2 and not out
    assert err.count("\n") == 1 and "precision bf16 needs bf16 tensor cores" in err and "give precision fp16" in err
    code, out, _ = run(capsys, "simulate", "--model", "gpt-1.3b", "--cluster", "v100-dgx2-ib-800", "--nodes", "2",
                       "--training", "{precision: fp16}")
    assert code == 0 and "step time" in out
    with pytest.raises(SpecError, match="needs bf16 tensor cores"):
        predict(MODELS["gpt-1.3b"], CLUSTERS["v100-dgx2-ib-800"], TrainingSpec(precision="bf16"))
    assert all(CLUSTERS[name].bf16 for name in ("a100-100gbe", "h100-400gbe", "h200-rdma-3200"))


def test_the_plan_for_a_gpu_without_bf16_runs_fp16(capsys):
    """A plan for V100s trains in fp16, the 16-bit mixed precision they have, and says so."""
    result = plan(MODELS["gpt-1.3b"], CLUSTERS["v100-dgx2-ib-800"], 384, TrainingSpec(), exact=True)
    assert result.best.training.precision == "fp16" and "no bf16 tensor cores" in result.notes[0]
    code, out, _ = run(capsys, "plan", "--model", "gpt-1.3b", "--cluster", "v100-dgx2-ib-800", "--nodes", "2",
                       "--global-batch", "64", "--exact")
    assert code == 0
    commands = [line for line in out.splitlines() if "torchrun" in line]
    assert commands and all("--precision fp16" in line and "bf16" not in line for line in commands)
    assert "mixed_precision='fp16'" in out and "no bf16 tensor cores" in out
    code, out, _ = run(capsys, "plan", "--model", "gpt-1.3b", "--cluster", "v100-dgx2-ib-800", "--nodes", "2",
                       "--global-batch", "64", "--exact", "--json")
    assert code == 0 and "--precision fp16" in " ".join(json.loads(out)["best"]["run"]["train_options"])


SMDDP = "{preset: a100-efa-400, collectives: smddp}"


def test_simulate_runs_the_collective_library_a_cluster_names(capsys):
    """SMDDP on p4d: its rate across nodes and its all-gathers' share of the SMs, named in the report."""
    status, out, _ = run(capsys, "simulate", "--model", "gpt2-125m", "--cluster", SMDDP)
    assert status == 0
    assert "inter-node 45 GB/s, 14 us per step; ring collectives (smddp)" in out
    cluster = load_spec("cluster", SMDDP)
    assert cluster.inter_node.busbw_GBps == 45 and cluster.inter_node.all_gather_share == pytest.approx(9 / 108)
    assert cluster.inter_node.compute_share == CLUSTERS["a100-efa-400"].inter_node.compute_share  # NCCL's reductions
    p4de = load_spec("cluster", "{preset: a100-efa-400, gpu: a100-80gb, collectives: smddp}")
    assert p4de.gpu_memory_gb == 80 and p4de.inter_node == cluster.inter_node


@pytest.mark.parametrize("cluster, message", [
    ("{preset: a100-efa-400, collectives: mpi}", "collectives must be one of nccl, smddp; got 'mpi'"),
    ("{preset: h100-ib-400, collectives: smddp}", "has h100-sxm: start from preset a100-efa-400"),
    ("{preset: a100-efa-400, gpu: h100-sxm, collectives: smddp}", "has h100-sxm: start from preset a100-efa-400"),
    # a 100 GbE link carries 12.5 GB/s: SMDDP's 45, measured on p4d's EFA, is never set on it
    ("{preset: a100-100gbe, collectives: smddp}", "has another network between nodes: start from preset a100-efa-400"),
])
def test_a_collective_library_where_it_does_not_run_is_refused_in_one_line(capsys, cluster, message):
    status, out, err = run(capsys, "simulate", "--model", "gpt2-125m", "--cluster", cluster)
    assert status == 2 and out == ""
    assert message in err and err.count("\n") == 1


def test_a_mappings_own_figures_win_over_its_librarys():
    """The library is set on the preset, and the mapping's keys change the result."""
    cluster = load_spec("cluster", "{preset: a100-efa-400, collectives: smddp, inter_node: {busbw_GBps: 42, "
                                   "compute_share: 0.1}}")
    assert cluster.inter_node.busbw_GBps == 42 and cluster.inter_node.compute_share == 0.1
    assert cluster.inter_node.all_gather_share == pytest.approx(9 / 108)
    own = load_spec("cluster", "{preset: a100-efa-400, collectives: smddp, inter_node: {all_gather_share: 0.05}}")
    assert own.inter_node.all_gather_share == 0.05 and own.inter_node.busbw_GBps == 45


def test_a_cluster_made_any_way_runs_all_of_its_library_or_is_refused():
    """parse and dataclasses.replace resolve the library as load_spec does, and refuse as it does."""
    smddp = load_spec("cluster", SMDDP)
    nccl = CLUSTERS["a100-efa-400"]
    assert dataclasses.replace(nccl, collectives="smddp").inter_node == smddp.inter_node
    assert parse("cluster", {**as_dict(nccl), "collectives": "smddp"}).inter_node == smddp.inter_node
    assert parse("cluster", {**as_dict(smddp), "nodes": 64}).inter_node == smddp.inter_node  # as it reads back
    with pytest.raises(SpecError, match="has h100-sxm: start from preset a100-efa-400"):
        dataclasses.replace(CLUSTERS["h100-ib-400"], collectives="smddp")
    with pytest.raises(SpecError, match="another network between nodes"):
        parse("cluster", {**as_dict(CLUSTERS["a100-100gbe"]), "collectives": "smddp"})


def test_plan_says_it_searched_without_fault_tolerance(capsys):
    argv = ["plan", "--model", "gpt-125m", "--cluster", "a100-100gbe", "--nodes", "2", "--global-batch", "64",
            "--exact", "--training", "{layout: hybrid, fault_tolerance: true}"]
    status, out, _ = run(capsys, *argv)
    assert status == 0 and out.count("fault_tolerance: searched without it") == 1
    status, out, _ = run(capsys, *argv[:-2])
    assert status == 0 and "fault_tolerance" not in out


def test_plan_of_a_zero1_run_searches_the_layouts_shardwire_runs(capsys):
    """zero1 describes other tools' runs, which the engine does not run: plan says so and searches its own."""
    status, out, _ = run(capsys, "plan", "--model", "gpt-125m", "--cluster", "a100-100gbe", "--nodes", "2",
                         "--global-batch", "64", "--exact", "--training",
                         "{layout: zero1, shard_group_size: 4, reduce_bucket_elements: 1000000}")
    assert status == 0 and out.count("layout zero1: searched over the layouts shardwire runs instead") == 1
    assert "layout zero1," not in out.replace("layout zero1: searched", "")


def test_plan_names_what_it_searched_and_the_settings_given_it_did_not_hold(capsys):
    """A micro-batch, layout or prefetch given is where no search starts; a wire given under --exact
    (or on one node) is not searched at all."""
    status, out, _ = run(capsys, "plan", "--model", "gpt-125m", "--cluster", "a100-100gbe", "--nodes", "2",
                         "--global-batch", "64", "--exact", "--training", "{micro_batch: 2, layout: grad_op, wire: int8}")
    assert status == 0 and "configurations (micro-batch, layout, resharding, prefetch, checkpointing), " in out
    assert "micro_batch 2, layout grad_op: the plan searches these itself" in out, out
    assert "wire int8: searched with exact collectives only (--exact)" in out, out
    status, out, _ = run(capsys, "plan", "--model", "gpt-125m", "--cluster", "a100-100gbe", "--nodes", "2",
                         "--global-batch", "64")
    assert status == 0 and "(micro-batch, layout, resharding, prefetch, checkpointing, wire)" in out
    assert "searches" not in out


def test_plan_says_which_settings_given_it_searched_as_the_engine_runs_them(capsys):
    """They were replaced by the engine's without a word."""
    status, out, _ = run(capsys, "plan", "--model", "gpt-125m", "--cluster", "a100-100gbe", "--nodes", "2",
                         "--global-batch", "64", "--exact", "--training", "{limiter: block, reduce_precision: bf16}")
    assert status == 0 and ("limiter block, reduce_precision bf16: searched as shardwire's engine runs (limiter "
                            "sliding, reduce_precision fp32)") in out, out


def test_plan_says_it_searched_other_groups_and_syncs_than_those_given(capsys):
    """A shard_group_size or a diloco given was replaced by the search's without a word."""
    plan = ["plan", "--model", "gpt-125m", "--cluster", "a100-100gbe", "--nodes", "2", "--global-batch", "64"]
    status, out, _ = run(capsys, *plan, "--exact", "--training", "{layout: hybrid, shard_group_size: 4}")
    assert status == 0 and "shard_group_size 4: searched with hybrid groups of a node's 8 GPUs" in out, out
    status, out, _ = run(capsys, *plan, "--training", "{layout: hybrid, diloco: 'sync_every=5'}")
    assert status == 0 and ("diloco sync_every=5: syncing every H steps is offered as DiLoCo's published setting "
                            "(diloco sync_every=20)") in out, out
    status, out, _ = run(capsys, *plan, "--exact", "--training", "{layout: hybrid, diloco: 'sync_every=5'}")
    assert status == 0 and "diloco sync_every=5: syncing every H steps is not offered (--exact)" in out, out


@pytest.mark.parametrize("layout", ["hybrid", "zero1"])
def test_a_sweep_of_a_nodes_gpus_names_the_groups_that_follow_it_as_swept(capsys, layout):
    """The header named the first point's groups (of 1) for every row."""
    status, out, _ = run(capsys, "simulate", "--model", "gpt-125m", "--cluster", "a100-100gbe", "--nodes", "2",
                         "--training", f"{{layout: {layout}}}", "--sweep", "gpus_per_node=1,8")
    assert status == 0 and " in swept groups" in out and "groups of 1" not in out and "(one GPU)" not in out, out


@pytest.mark.parametrize("swept, said", [
    ("nodes=1e400", "error: --sweep value '1e400' is not a finite number"),
    ("nodes=1" + "0" * 5000, "has 5,001 digits, more than any setting takes"),
    ("nodes=1,2,2", "error: the sweep of nodes gives 2 twice: give each value once"),
    ("nodes=1.0,1", "error: the sweep of nodes gives 1 twice: give each value once"),
    ("nodes=1,,2", "error: --sweep 'nodes=1,,2' has an empty value: give each value once, separated by commas"),
    ("micro_batch=1,0", "error: at micro_batch 0: training: micro_batch must be positive and finite, got 0"),
])
def test_a_sweep_simulates_the_values_given_once_each(capsys, swept, said):
    """1e400 was read as infinity, a value given twice simulated twice, an empty one dropped."""
    status, _, err = run(capsys, "simulate", "--model", "tiny", "--cluster", "h100-ib-400", "--sweep", swept)
    assert status == 2 and (err == said + "\n" or not said.startswith("error") and said in err), err


def test_a_sweep_shows_each_value_as_it_was_simulated(capsys):
    status, out, _ = run(capsys, "simulate", "--model", "tiny", "--cluster", "h100-ib-400", "--sweep", "nodes=1e3,2.0",
                         "--json")
    assert status == 0 and json.loads(out)["sweep"] == {"key": "nodes", "values": [1000, 2]}


def test_a_sweep_over_nodes_explains_where_it_scales_least_not_its_last_value(capsys):
    """The docs promise what bounds the step where the sweep scales least: it explained the last
    value given, whatever its scaling."""
    status, out, _ = run(capsys, "simulate", "--model", "tiny", "--cluster", "a100-100gbe", "--sweep", "nodes=1,4,2")
    rows = {line.split()[0]: float(line.split()[-1].rstrip("%")) for line in out.splitlines()
            if line.split() and line.split()[0] in ("1", "2", "4") and line.endswith("%")}
    assert status == 0 and min(rows, key=rows.get) == "4" and "\nat nodes=4: " in out, out


def test_a_plans_library_call_compiles_where_its_command_does(capsys):
    """Its `or:` line left compile=True out: the call ran another job than the one priced."""
    status, out, _ = run(capsys, "plan", "--model", "gpt-125m", "--cluster", "a100-100gbe", "--nodes", "2",
                         "--global-batch", "64", "--exact", "--training", "{compile: true}")
    best = out.split("\n\n")[1]
    assert status == 0 and "--compile" in best and "compile=True)" in best, best


def test_a_sweep_names_the_point_that_cannot_be_simulated(capsys):
    status, _, err = run(capsys, "simulate", "--model", "tiny", "--cluster", "a100-ib-200", "--training",
                         "{layout: hybrid, shard_group_size: 16}", "--sweep", "nodes=2,1,4")
    assert status == 2 and err.startswith("error: at nodes 1: shard_group_size 16 must divide the cluster's 8 GPUs"), err
