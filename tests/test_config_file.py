"""Options declared once on the configuration, and ``--config FILE``: a file's values under the
command line's, checked as the command line's are, for every command."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from shardwire.cli import config_file
from shardwire.bench.benchmark import BenchConfig
from shardwire.cli import command, main
from shardwire.options import add_options, config_from
from shardwire.renamed import RenamedWarning
from shardwire.training.config import TrainConfig

yaml = pytest.importorskip("yaml", reason="the yaml extra is not installed")


def parsed(name: str, argv: list[str]):
    """The configuration ``shardwire <name> <argv>`` runs with."""
    config_class = {"train": TrainConfig, "bench": BenchConfig}[name]
    args, _ = config_file.parse(command(name)[1], argv)
    return config_from(args, config_class)


def write(tmp_path, text: str, name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("config_class", [TrainConfig, BenchConfig])
def test_the_command_line_is_the_configuration(config_class):
    """Every setting is an option with the configuration's default, named after its field."""
    parser = argparse.ArgumentParser()
    add_options(parser, config_class)
    defaults = parser.parse_args([])
    assert config_from(defaults, config_class) == config_class()
    flags = {s for action in parser._actions for s in action.option_strings}
    for name in vars(defaults):
        assert "--" + name.replace("_", "-") in flags


def test_the_file_sets_defaults_and_the_command_line_wins_wherever_it_stands(tmp_path):
    path = write(tmp_path, "model: 30m\nseq-len: 64\nlr: 3e-3\nreshard: false\nsteps: 50\nlayout: hybrid\n")
    config = parsed("train", ["--steps", "7", "--config", path, "--reshard"])
    assert (config.model, config.seq_len, config.lr, config.layout) == ("30m", 64, 0.003, "hybrid")
    assert config.steps == 7 and config.reshard is True  # given on the command line, before and after
    assert parsed("train", ["--config", path]).reshard is False
    assert parsed("train", [f"--config={path}", "--no-reshard", "--layout", "full"]).layout == "full"


def test_bench_files_take_sizes_lists_and_json(tmp_path):
    path = write(tmp_path, "max_bytes: 1M\nmin_bytes: 4096\nops: all_gather\ngroups: [world, intra]\n")
    config = parsed("bench", ["--config", path])
    assert (config.max_bytes, config.min_bytes, config.ops, config.groups) == (1 << 20, 4096, ["all_gather"],
                                                                                ["world", "intra"])
    path = write(tmp_path, json.dumps({"ops": ["all_reduce", "broadcast"], "iters": 3}), "bench.json")
    config = parsed("bench", ["-n", "4", "--config", path])
    assert (config.ops, config.iters) == (["all_reduce", "broadcast"], 4)


@pytest.mark.parametrize("command, argv", [
    ("train", ["--model", "tiny", "--no-reshard", "--wire", "int8", "--seq-len", "32", "--lr", "1e-4"]),
    ("bench", ["--ops", "all_gather", "reduce_scatter", "-e", "1M", "--contention", "--json", "out.json"]),
])
def test_print_config_writes_a_file_that_reads_back_as_the_same_job(command, argv, tmp_path, capsys):
    assert main([command, "--print-config", *argv]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"# shardwire {command} --config FILE reads this")
    path = write(tmp_path, printed)
    assert parsed(command, ["--config", path]) == parsed(command, argv)


@pytest.mark.parametrize("text, message", [
    ("layot: hybrid\n", "'layot' is not an option of shardwire train; did you mean 'layout'?"),
    ("layout: hybird\n", "layout: 'hybird' is not one of full, hybrid, hybrid_secondary"),
    ("steps: 1.5\n", "steps: '1.5' is not an integer"),
    ("lr: fast\n", "lr: 'fast' is not a number"),
    ("profile: yes please\n", "profile: a switch is true or false, got 'yes please'"),
    ("steps: null\n", "steps: give a value, not null"),
    ("model: [tiny]\n", "model: give a value as the command line takes it, got ['tiny']"),
    ("- steps\n", "must be a mapping of keys to values in JSON or YAML, got list"),
    ("steps: [1\n", "is neither JSON nor YAML"),
    ("steps: 5\nsteps: 7\n", "'steps' at line 2, column 1 is given twice (the last would win silently): give it once"),
    ('{"steps": 5, "steps": 7}', "'steps' is given twice (the last would win silently)"),
])
def test_a_bad_file_is_one_line_naming_the_file_and_the_key(text, message, tmp_path, capsys):
    path = write(tmp_path, text)
    assert main(["train", "--config", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --config {path}") and message in err and err.count("\n") == 1


def test_a_yaml_merge_may_override_and_a_renamed_sync_key_is_printed_under_its_new_name(tmp_path, capsys):
    """A key merged in (``<<``) and written again is YAML's override, not a key given twice; a
    renamed ``--diloco`` key is read with a warning and printed under its new name."""
    assert main(["train", "--config", write(tmp_path, "<<: {steps: 5}\nsteps: 7\n"), "--print-config"]) == 0
    assert "steps: 7" in capsys.readouterr().out
    with pytest.warns(RenamedWarning, match="diloco every= is renamed sync_every="):
        assert main(["train", "--layout", "hybrid", "--diloco", "every=2", "--print-config"]) == 0
    assert "diloco: sync_every=2,fragments=1," in capsys.readouterr().out


def test_the_file_bounds_are_checked_as_the_command_lines_are(tmp_path, capsys):
    with pytest.raises(SystemExit, match="--steps must be at least 1, got 0"):
        main(["train", "--config", write(tmp_path, "steps: 0\n")])
    assert main(["bench", "--config", write(tmp_path, "step_factor: 4\n"), "-i", "1K"]) == 2
    assert "give --step-factor or --step-bytes, not both" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--config", "missing.yaml"], "error: --config missing.yaml: No such file or directory\n"),
    (["--config"], "error: --config needs a file: --config FILE\n"),
    (["--config", "a.yaml", "--config", "b.yaml"], "error: --config is given twice: give one file\n"),
])
def test_a_missing_file_is_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *argv]) == 2
    assert capsys.readouterr().err == message


def test_an_abbreviated_config_is_refused_not_ignored(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--conf", "job.yaml"])
    assert "write --config in full" in capsys.readouterr().err


def test_yaml_without_its_extra_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "yaml", None)  # importing it fails, as when it is not installed
    assert main(["train", "--config", write(tmp_path, "steps: 5\n")]) == 2
    assert capsys.readouterr().err == (f"error: --config {tmp_path / 'job.yaml'}, which is not JSON, needs yaml, "
                                       f"which is not installed: pip install 'shardwire[yaml]'\n")
    assert main(["train", "--config", write(tmp_path, '{"steps": 5}', "job.json"), "--print-launch"]) == 0


def test_required_options_of_simulate_and_plan_may_come_from_the_file(tmp_path, capsys):
    path = write(tmp_path, "model: gpt-125m\ncluster: a100-100gbe\nnodes: 2\nglobal_batch: 64\n")
    assert main(["plan", "--config", path]) == 0
    assert "torchrun --nnodes=2" in capsys.readouterr().out
    assert main(["simulate", "--config", path]) == 2  # global_batch is plan's, not simulate's
    assert "'global_batch' is not an option of shardwire simulate" in capsys.readouterr().err
    path = write(tmp_path, "model: gpt2-125m\ncluster: a100-100gbe\n")
    assert main(["simulate", "--config", path, "--json", "--nodes", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"]["nodes"] == 4


def test_yaml_reads_every_exponent_form_as_a_number_as_json_does():
    from shardwire.mappings import read_mapping
    text = "a: 1e3\nb: .5e3\nc: 1.5e3\nd: -2E-1\ne: .inf\nf: .5x\n"
    assert read_mapping(text, "t") == {"a": 1000.0, "b": 500.0, "c": 1500.0, "d": -0.2, "e": float("inf"), "f": ".5x"}


def test_a_spec_option_takes_its_mapping_nested_with_numbers_as_numbers(tmp_path, capsys):
    path = write(tmp_path, "model: gpt2-125m\ncluster:\n  preset: a100-100gbe\n  nodes: 2\n"
                           "  inter_node: {busbw_GBps: .5e1, latency_us: 10, compute_share: 0.1}\n")
    assert main(["simulate", "--config", path, "--json"]) == 0
    cluster = json.loads(capsys.readouterr().out)["cluster"]
    assert cluster["nodes"] == 2 and cluster["inter_node"]["busbw_GBps"] == 5.0
    assert main(["simulate", "--config", path, "--print-config"]) == 0
    printed = write(tmp_path, capsys.readouterr().out, "printed.yaml")
    assert main(["simulate", "--config", printed, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == cluster


def test_subcommands_take_the_options_they_have_and_what_follows_dashes_is_left_alone(tmp_path):
    _, parser = command("testbed")
    path = write(tmp_path, "name: lab\nnodes: 2\nlink: 1gbit\nnproc_per_node: 2\n")
    config_file.apply(parser, path)
    up = parser.parse_args(["up"])
    assert (up.name, up.nodes, up.link) == ("lab", 2, "1gbit")
    assert vars(parser.parse_args(["down"])) == {"action": "down", "name": "lab"}
    argv = ["run", "--config", path, "--", "-m", "shardwire", "train", "--config", "job.yaml"]
    assert config_file.split(argv) == (path, False, ["run", "--", "-m", "shardwire", "train", "--config", "job.yaml"])


@pytest.mark.slow
def test_workers_started_by_the_command_get_the_files_values(tmp_path):
    """``shardwire bench --config`` relaunches itself as two gloo workers; they measure what the file says,
    handed to them as options (the file is read once, by the launcher)."""
    path = write(tmp_path, "ops: [all_reduce]\nmin_bytes: 1K\nmax_bytes: 4K\nwarmup: 1\niters: 2\njson: out.json\n")
    done = subprocess.run([sys.executable, "-m", "shardwire", "bench", "--config", path, "-n", "3"],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    doc = json.loads((tmp_path / "out.json").read_text())
    settings = doc["context"]["settings"]
    assert (settings["ops"], settings["sizes"], settings["iters"]) == (["all_reduce"], [1024, 2048, 4096], 3)
    assert "--config" not in doc["context"]["command"] and "--ops all_reduce" in doc["context"]["command"]


@pytest.mark.parametrize("argv", [
    ["--plan", "auto", "--wire", "int8"],
    ["--lr", "2", "--weight-decay", "0.9"],
    ["--layout", "hybrid", "--nproc", "3", "--shard-group-size", "2"],
    ["--nnodes", "2"],
    ["--model", "tiny", "--layout", "hybrid", "--shard-group-size", "1", "--diloco", "fragments=64,sync_every=64"],
    ["--export-hf", "out", "--model", "tiny"],
])
def test_print_config_refuses_a_combination_the_run_refuses_in_the_same_words(argv):
    """A config printed is one that runs: what a run refuses before its workers start (the settings
    together, and against their model) --print-config refuses too, rather than printing it."""
    with pytest.raises(SystemExit) as run:
        main(["train", *argv])
    with pytest.raises(SystemExit) as printed:
        main(["train", "--print-config", *argv])
    assert str(run.value.code).startswith("error: ") and printed.value.code == run.value.code


def test_print_config_refuses_what_bench_refuses(capsys):
    assert main(["bench", "-b", "1M", "-e", "1K"]) == 2
    refused = capsys.readouterr().err
    with pytest.raises(SystemExit) as printed:
        main(["bench", "--print-config", "-b", "1M", "-e", "1K"])
    assert printed.value.code == 2 and capsys.readouterr() == ("", refused)


@pytest.mark.parametrize("argv", [
    ["testbed", "up", "--nodes", "2", "--link", "1gbit"], ["export", "ckpt", "out.pt"], ["report", "run"],
    ["simulate", "--model", "tiny", "--cluster", "h100-100gbe"],
    ["plan", "--model", "tiny", "--cluster", "h100-100gbe", "--global-batch", "64"],
])
def test_print_config_prints_for_every_command(argv, capsys):
    """A command's module may hold a name like the hook's (testbed's ``check`` action): only the hook runs."""
    assert main([argv[0], "--print-config", *argv[1:]]) == 0
    assert capsys.readouterr().out.startswith(f"# shardwire {argv[0]} --config FILE reads this")


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "gpt-125m", "--cluster", "h100-100gbe", "--global-batch", "3"],
    ["plan", "--model", "gpt-125m", "--cluster", "h100-100gbe", "--global-batch", "0"],
    ["simulate", "--model", "gpt-125m", "--cluster", "h100-100gbe", "--plot", "x.png"],
    ["simulate", "--model", "gpt-125m", "--cluster", "nosuch"],
])
def test_print_config_refuses_what_plan_and_simulate_refuse(argv, capsys):
    assert main(argv) == 2
    refused = capsys.readouterr().err
    with pytest.raises(SystemExit) as printed:
        main([argv[0], "--print-config", *argv[1:]])
    assert printed.value.code == 2 and capsys.readouterr() == ("", refused)


@pytest.mark.parametrize("argv, said", [
    (["--nodes", "0", "--link", "1gbit"], "error: --nodes must be between 1 and 64, got 0"),
    (["--nodes", "2", "--link", "bogus"], "error: link rate 'bogus' is not a rate like 1gbit"),
    (["--nodes", "2", "--link", "1gbit", "--nproc-per-node", "2"], "error: --nproc-per-node sets the node's compute"),
    (["--nodes", "2"], "error: give the link rate"),
])
def test_print_config_refuses_what_testbed_up_refuses_before_building(argv, said, capsys):
    with pytest.raises(SystemExit) as printed:
        main(["testbed", "--print-config", "up", *argv])
    out, err = capsys.readouterr()
    assert printed.value.code == 2 and out == "" and err.startswith(said) and err.count("\n") == 1
