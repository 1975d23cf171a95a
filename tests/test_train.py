"""``shardwire train`` refuses bad settings before it starts any worker, with a message saying what to change."""

from __future__ import annotations

import pytest

from shardwire.cli import main


@pytest.mark.parametrize("args, message", [
    (["--eval-batches", "0"], "--eval-batches must be at least 1, got 0"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--prefetch", "-1"], "--prefetch must be at least 0, got -1"),
    (["--data", "/no/such/corpus"], "--data: data path /no/such/corpus does not exist"),
    (["--timeout", "0"], "--timeout must be a finite number of seconds, at least 10, got 0.0"),
    (["--nproc", "0"], "--nproc must be at least 1, got 0"),
    (["--eval-every", "-1"], "--eval-every must be at least 0, got -1"),
    (["--wire", "params=int4"], "--wire params='int4' is not supported"),
    (["--wire", "grads=int4,block=0"], "--wire block must be a positive integer"),
    (["--wire", "fast"], "--wire 'fast' is not understood"),
    # the user's values are written as given, braces too, and the option as the command line spells it
    (["--wire", "{x}"], r"--wire '\{x\}' is not understood"),
    (["--diloco", "sync_every={0}"], r"--diloco sync_every must be a positive integer.*, got '\{0\}'"),
    (["--fault-tolerance", "lighthouse=h:1,min_groups={}"], r"--fault-tolerance min_groups must be a number, got '\{\}'"),
    (["--plan", "auto", "--wire", "int8"], "--plan auto chooses the wire and the syncs itself"),
    (["--plan", "auto-lossy", "--layout", "hybrid", "--diloco", "sync_every=20"], "leave out --wire and --diloco"),
])
def test_bad_settings_are_refused_before_launch(args, message):
    with pytest.raises(SystemExit, match=message):
        main(["train", *args])


def test_a_corpus_too_small_for_validation_says_how_much_is_needed(tmp_path):
    corpus = tmp_path / "small.txt"
    corpus.write_text("x" * 5000)  # 1% of it is shorter than one sequence of the "small" model
    with pytest.raises(SystemExit, match=r"validation split \(1%\) must hold a sequence of 129 bytes, "
                                         r"so give it at least 13,000 bytes"):
        main(["train", "--model", "small", "--data", str(corpus)])


def test_a_checkpoint_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "checkpoints"
    path.write_text("not a directory")
    with pytest.raises(SystemExit, match="--checkpoint-dir .* is a file; give it a directory"):
        main(["train", "--checkpoint-dir", str(path)])


def test_more_workers_than_gpus_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match="--nproc 2 asks for one GPU per worker, but 1 is visible; use --nproc 1"):
        main(["train", "--nproc", "2"])


def test_print_launch_writes_one_command_for_every_node_that_parses_back_to_the_job(capsys):
    import argparse
    import shlex

    from shardwire.cli.train import add_arguments

    job = ["--model", "30m", "--no-reshard", "--wire", "int8", "--backend", "nccl", "--precision", "bf16"]
    assert main(["train", "--print-launch", "--nnodes", "4", "--nproc-per-node", "8", "--max-restarts", "2", *job]) == 0
    comment, command = capsys.readouterr().out.splitlines()
    assert "on each of the 4 nodes" in comment and "HEAD_ADDRESS" in comment
    words = shlex.split(command)
    assert words[:8] == ["torchrun", "--nnodes=4", "--nproc-per-node=8", "--rdzv-backend=c10d",
                         "--rdzv-endpoint=HEAD_ADDRESS:29500", "--rdzv-id=shardwire", "--max-restarts=2", "-m"]
    assert words[8:10] == ["shardwire", "train"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert vars(parser.parse_args(words[10:])) == vars(parser.parse_args(job))
    # one node meets no other: no address to fill in
    assert main(["train", "--print-launch", "--nproc-per-node", "2", *job]) == 0
    comment, command = capsys.readouterr().out.splitlines()
    assert comment == "# on the node" and shlex.split(command)[:4] == ["torchrun", "--standalone",
                                                                      "--nproc-per-node=2", "-m"]


def test_print_launch_checks_the_layout_against_the_cluster_it_is_for():
    """16 ranks in groups of 3 do not divide, on the cluster the command is for (not this machine)."""
    with pytest.raises(SystemExit, match="--shard-group-size 3 does not divide"):
        main(["train", "--print-launch", "--nnodes", "2", "--nproc-per-node", "8", "--layout", "hybrid",
              "--shard-group-size", "3"])


def test_the_slurm_example_is_valid_bash_and_launches_as_print_launch_does():
    import pathlib
    import subprocess

    script = pathlib.Path(__file__).parents[1] / "examples" / "slurm.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    text = script.read_text()
    for part in ("srun torchrun", "--rdzv-backend=c10d", '--rdzv-endpoint="$HEAD:29500"', "-m shardwire train"):
        assert part in text


def test_progress_is_a_line_per_update_in_a_log_and_a_redrawn_bar_on_a_terminal():
    import io

    from shardwire.training.progress import ProgressBar

    log = io.StringIO()
    progress = ProgressBar(400, stream=log)
    progress.update(10, {"loss": "3.100"})
    progress.update(20, {"loss": "2.900"})
    progress.close()
    lines = log.getvalue().splitlines()
    assert [line.split("  eta ")[0] for line in lines] == [
        "step  10/400 [........................] loss 3.100", "step  20/400 [#.......................] loss 2.900"]

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    progress = ProgressBar(400, stream=terminal)
    progress.update(400, {"loss": "2.100"})
    progress.close()
    drawn = terminal.getvalue()
    assert "\r" in drawn and drawn.endswith("\n") and "step 400/400" in drawn and "loss 2.100" in drawn


def test_the_kubeflow_example_is_a_trainjob_that_runs_shardwire_train():
    import pathlib

    yaml = pytest.importorskip("yaml", reason="the yaml extra is not installed")
    job = yaml.safe_load((pathlib.Path(__file__).parents[1] / "examples" / "kubeflow-trainjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = job["spec"]["trainer"]
    assert trainer["command"] == ["torchrun", "-m", "shardwire", "train"] and trainer["numNodes"] >= 1
    import argparse

    from shardwire.cli.train import add_arguments

    parser = argparse.ArgumentParser()  # the arguments are ones shardwire train takes
    add_arguments(parser)
    assert parser.parse_args(trainer["args"]).backend == "nccl"
