"""A training run's checks: options refused before any worker starts, divergence that names its
cause (a loss spike included), data and architecture that changed under a run or between a run and
its resume, and a DCP directory given as a checkpoint directory."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors import safe_open

import shardwire
from harness import byte_tokenizer
from shardwire import worker
from shardwire.cli import main
from shardwire.engine.checkpoint import list_checkpoints
from shardwire.models.gpt import GPT, PRESETS, Block
from shardwire.training.config import TrainConfig, changed_settings, training_settings
from shardwire.training.data import DataChanged, data_change, load_corpus
from shardwire.training.loop import _Divergence
from shardwire.training.scalars import ScalarLog


def train(*args: str, cwd, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "shardwire", "train", "--eval-batches", "1", *args],
                          capture_output=True, text=True, timeout=400, cwd=cwd)
    assert not check or done.returncode == 0, done.stderr[-3000:]
    return done


def token_file(path, tokens: int, seed: int = 0):
    np.random.default_rng(seed).integers(0, 256, tokens, dtype=np.uint16).tofile(path)
    return path


@pytest.fixture
def no_workers(monkeypatch):
    """A check that let the job through would start workers: fail at once instead."""
    def started(*args, **kwargs):
        raise AssertionError("workers were started")
    monkeypatch.setattr("shardwire.cli.train.launch_local", started)


@pytest.fixture
def dcp_directory(tmp_path):
    directory = tmp_path / "dcp-checkpoint"
    directory.mkdir()
    (directory / ".metadata").write_bytes(b"\x80\x04N.")  # a pickle, as DCP writes it
    (directory / "__0_0.distcp").write_bytes(b"")
    return directory


@pytest.mark.parametrize("args, message", [
    (["--layout", "hybrid", "--diloco", "fragments=8"],
     "error: --diloco fragments=8 is more than the 4 units with trainable parameters (each fragment is whole "
     "units): use at most 4, or more units"),
    (["--layout", "hybrid", "--diloco", "outer_lr=1e308"],
     "error: --diloco outer_lr must be a positive number of at most 10 (DiLoCo's is 0.7), got 1e+308"),
    (["--timeout", "0.001"], "error: --timeout must be a finite number of seconds, at least 10, got 0.001"),
    (["--checkpoint-dir", "/proc/shardwire-x"], "error: --checkpoint-dir /proc/shardwire-x cannot be created: /proc "
                                                "is not writable"),  # as root too: tried, not read off its mode
    (["--wire", "grads=int8,grads=int4"], "error: --wire grads is given twice (the last would win silently)"),
    (["--steps", str(2**63)], "error: --steps must be at most 9,007,199,254,740,992, got 9223372036854775808"),
    (["--nnodes", "2"], "error: --nnodes is for --print-launch, which prints the command for each node; to run here "
                        "give --nproc, or add --print-launch"),
    (["--weight-decay", "1e308"], "error: --weight-decay 1e+308 with --lr 0.003 would scale every weight by "
                                  "1 - lr x weight decay = -3e+305 at each step: give a weight decay below 1/lr (333)"),
    # activations, not only the logits: a batch no worker can hold is refused before it is killed for memory
    (["--batch", "100000"], "error: --batch 100000 sequences of 32 tokens need 30.9 GiB per worker for their "
                            "activations"),
])
def test_options_the_workers_would_fail_on_are_refused_before_they_start(args, message, no_workers):
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["train", "--model", "tiny", *args])


@pytest.mark.parametrize("option, kind", [("--log-jsonl", "file name"), ("--tensorboard", "directory"),
                                           ("--run-dir", "directory"), ("--checkpoint-dir", "directory")])
def test_an_output_that_is_a_link_to_nowhere_is_refused_before_the_workers_start(option, kind, tmp_path, no_workers):
    """Opened, the link would fail in the workers, the run directory's after the whole run (making
    it, FileExistsError; writing through it, FileNotFoundError). A file's link into a directory that
    exists is written through, making its target, as before."""
    (tmp_path / "link").symlink_to(tmp_path / "gone" / "target")
    with pytest.raises(SystemExit, match=re.escape(f"error: {option} {tmp_path / 'link'} is a symbolic link that "
                                                   f"leads nowhere (a loop, or its target is gone): give a {kind}")):
        main(["train", "--model", "tiny", "--profile", option, str(tmp_path / "link")])
    if kind == "file name":
        (tmp_path / "to-be-made").symlink_to(tmp_path / "made.jsonl")
        with pytest.raises(AssertionError, match="workers were started"):
            main(["train", "--model", "tiny", option, str(tmp_path / "to-be-made")])


@pytest.mark.parametrize("environment, message", [
    ({"WORLD_SIZE": "2", "RANK": "5", "LOCAL_RANK": "0"}, "the environment sets RANK=5 and WORLD_SIZE=2, which no "
                                                          "launch gives (torchrun's variables, left from another job?)"),
    ({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "3"}, "the environment sets LOCAL_RANK=3 and WORLD_SIZE=1, which "
                                                         "no launch gives"),
    ({"WORLD_SIZE": "abc", "LOCAL_RANK": "0"}, "WORLD_SIZE='abc' in the environment is not a count of ranks"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "99999"},
     "MASTER_PORT='99999' in the environment is not a port, 0 to 65535"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_PORT": "29500"},
     "the environment sets WORLD_SIZE=2 but no MASTER_ADDR"),
])
def test_torchruns_variables_left_in_the_environment_are_one_line_not_a_wait(environment, message):
    """A world no worker can join (another job's variables in the shell) would wait out --timeout."""
    done = subprocess.run([sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--steps", "1"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **environment})
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(f"error: {message}") and done.stderr.count("\n") == 1, done.stderr


@pytest.mark.slow
def test_a_first_node_out_of_reach_is_one_line_without_cs_stack_frames():
    """A worker of a job whose first node never answers: c10d's own error logs (stack frames and all)
    stay quiet, and shardwire's line says what to do."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    environment = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    done = subprocess.run([sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--steps", "1",
                           "--timeout", "10"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **environment})
    assert done.returncode != 0
    assert done.stderr.startswith("error: the workers did not meet within --timeout 10 seconds")
    assert done.stderr.count("\n") == 1, done.stderr


def test_a_master_port_in_use_is_said_to_be():
    """The first rank cannot host the workers' meeting there: waiting longer would not help."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        environment = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(taken.getsockname()[1])}
        done = subprocess.run([sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--steps", "1",
                               "--timeout", "30"], capture_output=True, text=True, timeout=120,
                              env={**os.environ, **environment})
    assert done.returncode != 0
    assert done.stderr == (f"error: MASTER_PORT {environment['MASTER_PORT']} is in use by another process on this "
                           f"node, so the workers cannot meet there: free it, or choose another port (torchrun "
                           f"--master-port)\n"), done.stderr


def test_the_scalar_log_makes_its_directory(tmp_path):
    log = ScalarLog(jsonl=str(tmp_path / "new" / "deeper" / "log.jsonl"))
    log.write(1, {"loss": 2.0})
    log.close()
    assert (tmp_path / "new" / "deeper" / "log.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'


def test_compile_without_a_compiler_is_one_line_before_the_workers_start(monkeypatch, no_workers):
    inductor = pytest.importorskip("torch._inductor.config")
    monkeypatch.setattr(inductor.cpp, "cxx", (None, "no-such-c++-compiler"))
    message = ("error: --compile on the CPU needs a C++ compiler, which torch.compile builds its kernels with, and "
               "none was found (tried no-such-c++-compiler)")
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["train", "--model", "tiny", "--compile", "--backend", "gloo"])


def test_a_dcp_directory_is_refused_as_a_checkpoint_directory(dcp_directory, no_workers):
    with pytest.raises(SystemExit, match=rf"error: --checkpoint-dir {dcp_directory} is a torch.distributed.checkpoint "
                                         rf"\(DCP\) checkpoint \(it holds .metadata\), not a series of shardwire's"):
        main(["train", "--model", "tiny", "--checkpoint-dir", str(dcp_directory)])
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block])
    with pytest.raises(shardwire.CheckpointError, match="is a torch.distributed.checkpoint"):
        shardwire.load_latest_checkpoint(dcp_directory, model)
    assert sorted(path.name for path in dcp_directory.iterdir()) == [".metadata", "__0_0.distcp"]
    with pytest.raises(SystemExit, match=rf"error: --checkpoint-dir {dcp_directory}/runs/a is inside "
                                         rf"{dcp_directory.resolve()}, a torch.distributed.checkpoint \(DCP\) checkpoint"):
        main(["train", "--model", "tiny", "--checkpoint-dir", str(dcp_directory / "runs" / "a")])
    assert sorted(path.name for path in dcp_directory.iterdir()) == [".metadata", "__0_0.distcp"]


@pytest.mark.parametrize("argv", [
    ["train", "--model", "tiny", "--profile", "--run-dir", "{dcp}/run"],
    ["train", "--model", "hf:{tmp}/gpt2", "--export-hf", "{dcp}/hf"],
    ["train", "--model", "tiny", "--log-jsonl", "{dcp}/log.jsonl"],
    ["export", "{tmp}/ckpt", "{dcp}/model.safetensors", "--model", "tiny"],
])
def test_nothing_is_written_inside_a_dcp_checkpoint(tmp_path, dcp_directory, no_workers, capsys, argv):
    """An output inside a DCP checkpoint was accepted, where one inside shardwire's is refused: its
    loader would meet files its save never wrote."""
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 4, "n_positions": 64, "vocab_size": 256}))
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block])
    shardwire.save_checkpoint(tmp_path / "ckpt", model, step=1).wait()
    argv = [arg.format(dcp=dcp_directory, tmp=tmp_path) for arg in argv]
    try:
        status = main(argv)
    except SystemExit as err:
        status, said = err.code, str(err.code) + "\n"
    else:
        said = capsys.readouterr().err
    assert status and f"is inside {dcp_directory.resolve()}, a torch.distributed.checkpoint (DCP) checkpoint, " \
           f"which holds only what its save wrote: give a path outside it" in said and said.count("\n") == 1, said
    assert sorted(path.name for path in dcp_directory.iterdir()) == [".metadata", "__0_0.distcp"]


def test_an_output_the_run_would_read_as_its_data_is_refused(tmp_path, no_workers, capsys):
    """A --log-jsonl notes.md in the --data directory was read as data: its resume was refused for a
    changed corpus, and --max-restarts spent every restart on it. What the corpus does not read (a
    .jsonl log, checkpoints) may lie there."""
    data = tmp_path / "dd"
    data.mkdir()
    (data / "a.txt").write_text("hello world " * 2000)
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 4, "n_positions": 64, "vocab_size": 256}))
    for argv, option in ((["--model", "tiny", "--log-jsonl", f"{data}/notes.md"], "--log-jsonl"),
                         (["--model", f"hf:{tmp_path}/gpt2", "--export-hf", f"{data}/out"], "--export-hf")):
        with pytest.raises(SystemExit, match=rf"^error: {option} {data}/\S+ is inside {data}, the --data directory, "
                                             rf"whose \.py, \.txt, \.md files are read as text: give a path outside "
                                             rf"it$"):
            main(["train", "--data", str(data), *argv])
    with pytest.raises(AssertionError, match="workers were started"):  # its checks passed
        main(["train", "--model", "tiny", "--data", str(data), "--log-jsonl", f"{data}/log.jsonl",
              "--checkpoint-dir", f"{data}/ckpt"])


@pytest.mark.parametrize("argv, message", [
    (["train", "--model", "tiny", "--profile", "--run-dir", "{tmp}/prof", "--log-jsonl", "{tmp}/prof/profile.json"],
     "--log-jsonl and --run-dir {tmp}/prof's profile.json name one file, {tmp}/prof/profile.json"),
    (["train", "--model", "tiny", "--profile", "--run-dir", "{tmp}/prof", "--log-jsonl",
      "{tmp}/prof/../prof/trace.json"],
     "--log-jsonl and --run-dir {tmp}/prof's trace.json name one file"),
    (["bench", "--ops", "all_reduce", "--nproc", "2", "--json", "{tmp}/b.json", "--csv", "{tmp}/b.json"],
     "--json and --csv name one file, {tmp}/b.json"),
    (["bench", "--ops", "all_reduce", "--nproc", "2", "--json", "{tmp}/b.json", "--plot", "{tmp}/./b.json"],
     "--json and --plot name one file"),
])
def test_two_outputs_of_one_file_are_refused(tmp_path, no_workers, capsys, argv, message):
    """The second written replaced the first without a word: a log by the profile, a bench's JSON by
    its CSV or its plot."""
    try:
        status = main([arg.format(tmp=tmp_path) for arg in argv])
    except SystemExit as err:
        status, said = err.code, str(err.code)
    else:
        said = capsys.readouterr().err
    assert status and message.format(tmp=tmp_path) in said and "the second written would replace the first; " \
        "give each a file of its own" in said, said
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("option, path", [("--checkpoint-dir", ""), ("--export-hf", "/out"),
                                          ("--log-jsonl", "/log.jsonl")])
def test_nothing_is_written_in_the_model_directory_the_run_reads(tmp_path, no_workers, option, path):
    """The series, the export or the profile were saved inside the hf: model directory read a slice at
    a time."""
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 4, "n_positions": 64, "vocab_size": 256}))
    with pytest.raises(SystemExit, match=rf"^error: {option} {model}{path} (is|is inside {model},) the model "
                                         rf"directory hf:{model} reads, which the run never writes in"):
        main(["train", "--model", f"hf:{model}", option, f"{model}{path}"])
    assert os.listdir(model) == ["config.json"]


def test_a_dcp_save_not_finished_is_a_dcp_checkpoint_too(tmp_path, no_workers):
    """DCP writes its .metadata last: a save still running, or one that died, was taken for an empty
    directory, and a run saved its series in it."""
    unfinished = tmp_path / "dcp"
    unfinished.mkdir()
    (unfinished / "__0_0.distcp").write_bytes(b"")
    for option, path in (("--checkpoint-dir", unfinished), ("--log-jsonl", unfinished / "log.jsonl")):
        with pytest.raises(SystemExit, match=r"a torch.distributed.checkpoint \(DCP\) checkpoint, which holds only "
                                             r"what its save wrote"):
            main(["train", "--model", "tiny", option, str(path)])
    assert os.listdir(unfinished) == ["__0_0.distcp"]


def test_report_of_a_dcp_checkpoint_suggests_no_run_there(dcp_directory, capsys):
    assert main(["report", str(dcp_directory)]) != 0
    said = capsys.readouterr().err
    assert "no run writes one there" in said and "--run-dir" not in said, said


def test_a_checkpoint_given_as_the_checkpoint_directory_is_refused_naming_its_parent(tmp_path, no_workers):
    """A series started inside a checkpoint would not resume from it, and would make it unprunable."""
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block])
    checkpoint = shardwire.checkpoint_path(tmp_path / "ckpt", 4)
    shardwire.save_checkpoint(checkpoint, model, step=4).wait()
    with pytest.raises(SystemExit, match=rf"error: --checkpoint-dir {checkpoint} is a checkpoint itself, not a "
                                         rf"directory of them: give the directory that holds it \({tmp_path}/ckpt\)"):
        main(["train", "--model", "tiny", "--checkpoint-dir", str(checkpoint)])
    with pytest.raises(shardwire.CheckpointError, match="is a checkpoint itself"):
        shardwire.load_latest_checkpoint(checkpoint, model)
    assert sorted(path.name for path in checkpoint.iterdir()) == ["manifest.json", "rank_00000.safetensors",
                                                                  "replicated.safetensors"]


@pytest.mark.parametrize("name, why, said", [
    ("step_00000004.diverged", "set aside by its run as diverged",
     "set aside by its run as diverged, which no resume starts from: to train on from it, copy it into a directory "
     "of its own as step_00000004 and give that directory"),
    # damaged, as often as not: no hint to train from it
    ("step_00000004.set-aside-aaaaaaaaaaaa", "set aside by the save that replaced it",
     "set aside by the save that replaced it (it was damaged, or its run could not resume from it), which no resume "
     "starts from: give the directory of a series ({tmp_path}/ckpt resumes from the newest good checkpoint there)"),
])
def test_a_checkpoint_set_aside_given_as_the_checkpoint_directory_says_no_resume_starts_from_it(tmp_path, no_workers,
                                                                                               capsys, name, why, said):
    """It said to give the directory that holds it to resume from it: that resumed another checkpoint,
    or started over. Exported by name, it is exported with a note; the series holding only such,
    export says so."""
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block])
    shardwire.save_checkpoint(tmp_path / "ckpt" / name, model, step=4, extra={"model": "tiny"}).wait()
    with pytest.raises(SystemExit) as refused:
        main(["train", "--model", "tiny", "--checkpoint-dir", str(tmp_path / "ckpt" / name)])
    assert refused.value.code == (f"error: --checkpoint-dir {tmp_path}/ckpt/{name} is a checkpoint itself, "
                                  + said.format(tmp_path=tmp_path))
    assert main(["export", str(tmp_path / "ckpt" / name), str(tmp_path / "model.safetensors")]) == 0
    assert f"note: {tmp_path}/ckpt/{name} was {why}, and no resume trains from it" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "other.safetensors")]) == 2
    assert f"{tmp_path}/ckpt holds no checkpoint but ones set aside ({name}), which no resume starts from: give one " \
           f"by name to export it" in capsys.readouterr().err


def test_the_groups_directory_of_a_fault_tolerant_run_is_not_started_over_in(tmp_path, no_workers, capsys):
    """Fault-tolerant groups keep their series side by side under --checkpoint-dir: a run without
    --fault-tolerance would find no checkpoint there and start over beside them, and an export
    finds none to export."""
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block])
    for group in ("a", "b"):
        shardwire.save_checkpoint(shardwire.checkpoint_path(tmp_path / "ckpt" / group, 4), model, step=4,
                                  extra={"model": "tiny"}).wait()
    with pytest.raises(SystemExit, match=rf"error: --checkpoint-dir {tmp_path}/ckpt holds series of checkpoints in "
                                         rf"its subdirectories \(a, b\), as fault-tolerant groups keep theirs"):
        main(["train", "--model", "tiny", "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "model.pt")]) == 2
    assert "holds series of checkpoints in its subdirectories (a, b), as fault-tolerant groups keep theirs, and " \
           "none of its own: export one series" in capsys.readouterr().err
    assert sorted(path.name for path in (tmp_path / "ckpt").iterdir()) == ["a", "b"]
    with pytest.raises(SystemExit, match=r"error: --fault-tolerance group=step_00000004 names the group's series under "
                                         r"--checkpoint-dir as a checkpoint of a series is named"):
        main(["train", "--model", "tiny", "--layout", "hybrid", "--fault-tolerance",
              "lighthouse=localhost:29510,group=step_00000004", "--checkpoint-dir", str(tmp_path / "ckpt")])
    with pytest.raises(SystemExit, match=r"error: --fault-tolerance group=.shardwire-claim names the group's series "
                                         r"under --checkpoint-dir with a hidden name"):
        main(["train", "--model", "tiny", "--layout", "hybrid", "--fault-tolerance",
              "lighthouse=localhost:29510,group=.shardwire-claim", "--checkpoint-dir", str(tmp_path / "ckpt")])


@pytest.mark.parametrize("directory, said", [
    ("n" * 300, "has a name of 300 bytes, where a name here is at most"),
    ("ckpt/step_00000004/inner", "is inside"),  # below a checkpoint, which would then never be pruned
])
def test_a_checkpoint_directory_the_system_or_a_checkpoint_refuses_is_one_line(directory, said, tmp_path, no_workers,
                                                                                capsys):
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block])
    shardwire.save_checkpoint(shardwire.checkpoint_path(tmp_path / "ckpt", 4), model, step=4).wait()
    with pytest.raises(SystemExit) as refused:
        main(["train", "--model", "tiny", "--checkpoint-dir", str(tmp_path / directory)])
    message = str(refused.value.code)
    assert message.startswith("error: --checkpoint-dir ") and said in message and "\n" not in message, message


def divergence(start_val_loss: float | None = None, **settings) -> _Divergence:
    worker.ensure_initialized(torch.device("cpu"))  # a world of one
    return _Divergence(TrainConfig(**{"steps": 100, "warmup": 0, **settings}), torch.device("cpu"),
                       start_val_loss=start_val_loss)


def test_a_loss_spike_is_divergence_naming_the_inner_optimizer():
    diverged = divergence(lr=0.5)
    for step, loss in enumerate((5.5, 5.4, 5.3, 5.2, 5.1), 1):
        diverged.note_loss(step - 1, torch.tensor(loss))
        diverged.check()
        diverged.logged(step, loss)
    diverged.note_loss(5, torch.tensor(102_258.0))
    with pytest.raises(SystemExit, match=r"error: training diverged: the loss was above 53, 10 times the mean of the "
                                         r"last 5 logged losses, at step 6 \(nothing was saved\): lower --lr \(now "
                                         r"0.5\) or raise --warmup \(now 0\)"):
        diverged.check()


@pytest.mark.parametrize("losses", [(5.5, 364.0), (3.1, 97.9)], ids=["fresh", "resumed"])
def test_a_spike_before_any_loss_is_logged_is_bounded_by_the_first_loss(losses):
    """A run that diverges in its first steps, or at once on resuming with another --lr, has no
    logged losses to average yet: the model it started from bounds it."""
    diverged = divergence(lr=5.0, warmup=5)
    first, spike = losses
    diverged.note_loss(0, torch.tensor(first))
    diverged.note_loss(1, torch.tensor(spike))
    with pytest.raises(SystemExit, match=rf"the loss was above {10 * first:.3g}, 10 times the run's first loss, "
                                         r"at step 2 \(nothing was saved\): lower --lr \(now 5\)"):
        diverged.check()


@pytest.mark.parametrize("warmup", [0, 40])
def test_a_climb_is_divergence_in_warmup_and_after_it(warmup):
    """No loss is 10 times the last ones, but they climb to over twice the loss the run started from."""
    diverged = divergence(lr=0.5, warmup=warmup)
    diverged.note_loss(0, torch.tensor(5.5))
    with pytest.raises(SystemExit, match=r"error: training diverged: the mean of the last 5 logged losses climbed to "
                                         r"11.1 at step 9, over 2 times the loss of the model the run started from, "
                                         r"5.5 \(nothing was saved\): lower --lr \(now 0.5\)$"):
        for step, loss in enumerate((6, 7, 8, 9, 9.5, 10, 11, 12, 13, 18), 1):
            diverged.logged(step, float(loss))


def test_a_noisy_loss_that_falls_is_not_a_climb():
    diverged = divergence(warmup=5)
    diverged.note_loss(0, torch.tensor(5.5))
    for step in range(1, 200):
        diverged.logged(step, 5.5 * 0.98 ** step + (0.3 if step % 2 else -0.3))


def test_a_loss_in_warmup_or_below_the_bound_is_not_a_spike():
    diverged = divergence(warmup=10)
    for step in range(1, 10):
        diverged.logged(step, 0.01)
    diverged.note_loss(9, torch.tensor(50.0))  # in warmup: no recent average yet
    diverged.check()
    for step in range(11, 16):
        diverged.logged(step, 0.01)
    diverged.note_loss(16, torch.tensor(9.0))  # 900 times a loss near 0, but below 10
    diverged.check()


@pytest.mark.parametrize("diloco, blamed", [(None, r"lower --lr \(now 0.3\) or raise --warmup \(now 0\)$"),
                                            ("sync_every=3", r"the run's final sync took an outer step: lower --diloco "
                                                             r"outer_lr \(now 0.7\) or momentum \(now 0.9\); or, "
                                                             r"where the loss had risen over the inner steps before "
                                                             r"it, lower --lr \(now 0.3\)")])
def test_a_final_model_far_worse_than_the_one_the_run_started_from_is_divergence(diloco, blamed):
    """A loss that climbs in the last steps, or at the final sync, too late for a logged mean of 5 to
    cross its bound: the run ended with a model 2.3 times worse than the fresh one, and status 0."""
    layout = {} if diloco is None else {"layout": "hybrid", "diloco": diloco}
    diverged = divergence(lr=0.3, steps=8, start_val_loss=5.6, **layout)
    diverged.note_loss(0, torch.tensor(5.5))
    for step, loss in enumerate((5.4, 5.3, 5.6, 6.0, 7.5, 9.0, 11.0, 12.5), 1):
        diverged.logged(step, loss)
    diverged.check()
    with pytest.raises(SystemExit, match=r"the validation loss after the last step was 12.6, over a nat above that of "
                                         r"the model the run started from, 5.6, and its training loss ended at 12.5, "
                                         r"no lower than it began \(5.5\) \(nothing was saved\): " + blamed):
        diverged.vouched(12.6)


def test_a_final_validation_loss_far_above_the_start_while_training_fell_is_no_divergence():
    """A model fine-tuned away from text like the validation split's (English words, Chinese in the
    validation split): its training loss fell from 3.9 to 1.3 while the validation loss rose 3 nats,
    and the run was stopped as diverged, its checkpoint set aside."""
    diverged = divergence(steps=30, start_val_loss=5.57)
    diverged.note_loss(0, torch.tensor(3.92))
    for step, loss in enumerate((3.5, 2.9, 2.2, 1.81, 1.5, 1.26), 1):
        diverged.logged(step, loss)
    diverged.vouched(8.48)


def test_a_final_validation_loss_far_above_the_training_loss_is_judged_against_the_start_validation_loss():
    """A resume on text whose validation split is unlike its training split (English, then Chinese):
    both losses fell, and the run was stopped as diverged at every try, its validation loss being
    over a nat above the training loss it started from."""
    diverged = divergence(steps=33, start_val_loss=5.42)
    diverged.note_loss(0, torch.tensor(2.9))
    for step, loss in enumerate((2.95, 2.94, 2.93), 1):
        diverged.logged(step, loss)
    diverged.vouched(5.27)


def test_a_divergence_after_an_outer_step_names_the_outer_optimizer():
    diverged = divergence(layout="hybrid", diloco="sync_every=4,outer_lr=9,momentum=0.95")
    diverged.note_norm(4, torch.tensor(float("inf")))  # the step after the sync of the first 4 steps
    with pytest.raises(SystemExit, match=r"not finite at step 5 \(nothing was saved\): it came at the step after an "
                                         r"outer step: lower --diloco outer_lr \(now 9\) or momentum \(now 0.95\); "
                                         r"or, where the loss had risen over the inner steps before it, lower --lr "
                                         r"\(now .*\) or raise --warmup \(now .*\)$"):
        diverged.check()


@pytest.mark.parametrize("step, blamed", [(2, "lower --lr"), (3, "lower --diloco outer_lr")])
def test_a_delayed_outer_step_is_blamed_where_it_is_applied(step, blamed):
    """fragment_sync_delay=1: the sync issued after 2 steps is applied a step later, at step index 3."""
    diverged = divergence(layout="hybrid", diloco="sync_every=4,fragments=2,fragment_sync_delay=1")
    diverged.note_norm(step, torch.tensor(float("nan")))
    with pytest.raises(SystemExit, match=rf"at step {step + 1} \(nothing was saved\): .*{blamed}"):
        diverged.check()


def test_a_divergence_between_outer_steps_names_both_optimizers():
    """A loss that climbs across outer steps crosses the bound at an inner step as often as not: it
    was blamed on the inner optimizer alone, where outer_lr=10 drove it."""
    diverged = divergence(layout="hybrid", diloco="sync_every=2,outer_lr=10,momentum=0.99", lr=0.05, warmup=40)
    diverged.note_norm(19, torch.tensor(float("inf")))  # outer steps applied as steps 2, 4, ..., 18 began
    with pytest.raises(SystemExit, match=r"at step 20 \(nothing was saved\): lower --lr \(now 0.05\) or raise "
                                         r"--warmup \(now 40\); or, as it came after outer steps, lower --diloco "
                                         r"outer_lr \(now 10\) or momentum \(now 0.99\)$"):
        diverged.check()


def test_a_fresh_run_whose_loss_never_fell_spares_its_oldest_checkpoint(tmp_path):
    """Its lowest loss is the fresh model's, before any save, where a run that logs seldom has too
    few losses to place it better: every checkpoint from before a climb was pruned by --keep."""
    diverged = divergence(checkpoint_dir=str(tmp_path), keep=1)
    diverged.note_loss(0, torch.tensor(5.5))
    diverged.logged(10, 9.0)  # one logged loss, above the first: the lowest is still the fresh model's
    for step in (2, 4, 6, 8):
        (tmp_path / f"step_{step:08d}").mkdir()
    assert diverged._at_lowest(tmp_path) == [tmp_path / "step_00000002"]


def test_a_token_file_cut_short_under_a_run_is_one_error_naming_it(tmp_path):
    path = token_file(tmp_path / "tokens.bin", 100_000)
    corpus = load_corpus(str(path), 32)
    corpus.batch(0, 4, 32)
    os.truncate(path, 2_000)  # a memory map's read past the end would be SIGBUS
    with pytest.raises(DataChanged, match=f"{path} changed while the run read it: it holds 2,000 bytes, 200,000 "
                                          f"when the run started"):
        corpus.batch(1, 4, 32)


def test_a_token_file_rewritten_in_place_under_a_run_is_one_error_naming_it(tmp_path):
    path = token_file(tmp_path / "tokens.bin", 100_000)
    corpus = load_corpus(str(path), 32, vocab_size=256)
    corpus.batch(0, 4, 32)
    stat = path.stat()
    np.zeros(100_000, dtype=np.uint16).tofile(path)  # the same size: its modification time tells
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    with pytest.raises(DataChanged, match=f"{path} changed while the run read it: its modification time changed "
                                          f"since the run started \\(rewritten in place, or touched"):
        corpus.batch(1, 4, 32)
    corpus = load_corpus(str(path), 32, vocab_size=256)
    ids = np.memmap(path, dtype=np.uint16, mode="r+")
    ids[:] = 60_000  # written between the run's look at the file and its read: past the vocabulary
    ids.flush()
    corpus._file._written = path.stat().st_mtime_ns
    with pytest.raises(DataChanged, match=f"{path} changed while the run read it: it now holds token id 60,000, past "
                                          f"the model's vocabulary of 256"):
        corpus.batch(1, 4, 32)


def test_the_data_identity_tells_other_data_apart(tmp_path):
    first = load_corpus(str(token_file(tmp_path / "a.bin", 100_000)), 32).identity
    assert data_change(first, load_corpus(str(tmp_path / "a.bin"), 32).identity) is None
    token_file(tmp_path / "a.bin", 100_000, seed=1)
    assert data_change(first, load_corpus(str(tmp_path / "a.bin"), 32).identity) == \
        f"the contents of {tmp_path / 'a.bin'} (same length)"
    smaller = load_corpus(str(token_file(tmp_path / "b.bin", 4_000)), 32).identity
    assert data_change(first, smaller) == "the data (100,000 -> 4,000 tokens)"


def test_the_data_identity_tells_an_edit_between_its_ends(tmp_path):
    """A quarter of a 3.2 MB token file rewritten at the same size, between its first and last MiB,
    passed for the same data: workers restarted by --max-restarts resumed on it."""
    path = token_file(tmp_path / "a.bin", 1_600_000)
    first = load_corpus(str(path), 32).identity
    ids = np.memmap(path, dtype=np.uint16, mode="r+")
    ids[600_000:1_000_000] = 7
    ids.flush()
    now = load_corpus(str(path), 32).identity
    assert data_change(first, now) == f"the contents of {path} (same length)"
    # a checkpoint written before the sampled fingerprint compares the one it records, of the ends alone
    assert data_change({key: value for key, value in first.items() if key != "sampled"}, now) is None


def test_a_path_spelled_another_way_is_not_a_changed_setting(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    token_file(tmp_path / "a.bin", 1_000)
    (tmp_path / "m").mkdir()
    config = TrainConfig(data="a.bin", tokenizer="./m", model="hf:m")
    recorded = {**training_settings(config), "data": str(tmp_path / "a.bin"), "tokenizer": str(tmp_path / "m"),
                "model": f"hf:{tmp_path / 'm'}"}
    assert changed_settings(recorded, config) == {}
    assert changed_settings({**recorded, "data": str(tmp_path / "b.bin")}, config) == {
        "data": (str(tmp_path / "b.bin"), "a.bin")}


def test_a_lighthouse_elsewhere_is_not_a_changed_setting_but_fault_tolerance_itself_is():
    """Where the groups meet and how long they wait change nothing a run trains: a lighthouse
    restarted on another host is no change to name on the resume line."""
    config = TrainConfig(layout="hybrid", fault_tolerance="lighthouse=http://head-2:29510,group=a,timeout=30")
    recorded = {**training_settings(config), "fault_tolerance": "lighthouse=http://head:29510,group=a"}
    assert changed_settings(recorded, config) == {}
    assert changed_settings({**recorded, "fault_tolerance": "none"}, config) == {
        "fault_tolerance": ("none", config.fault_tolerance)}


@pytest.mark.slow
def test_a_resume_names_a_tokenizer_changed_in_place_not_the_text(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    byte_tokenizer(tmp_path / "tok", 0)
    (tmp_path / "text.txt").write_text("hello world " * 2000)
    run = ["--model", "tiny", "--data", "text.txt", "--tokenizer", "tok", "--checkpoint-dir", "ckpt"]
    train(*run, "--steps", "2", cwd=tmp_path)
    byte_tokenizer(tmp_path / "tok", 7)  # the same directory, another tokenizer: the same text, other ids
    done = train(*run, "--steps", "3", cwd=tmp_path)
    assert (f"this run changes --steps 2 -> 3, the files of the tokenizer in {tmp_path / 'tok'}, and with it the "
            f"ids of text.txt (same length)") in done.stdout, done.stdout


@pytest.mark.slow
def test_a_resume_names_other_data_world_size_and_global_batch(tmp_path):
    token_file(tmp_path / "a.bin", 100_000)
    train("--model", "tiny", "--steps", "2", "--checkpoint-dir", "ckpt", "--data", "a.bin", cwd=tmp_path)
    extra = json.loads((tmp_path / "ckpt/step_00000002/manifest.json").read_text())["extra"]
    assert extra["data"]["tokens"] == 100_000 and extra["global_batch"] == 32
    token_file(tmp_path / "a.bin", 4_000)
    done = train("--model", "tiny", "--steps", "3", "--checkpoint-dir", "ckpt", "--data", "a.bin", "--nproc", "1",
                 cwd=tmp_path)
    assert ("resuming from ckpt/step_00000002 (step 2, saved by 2 ranks); this run changes --steps 2 -> 3, world "
            "size 2 -> 1, global batch 32 -> 16 sequences (--batch is per rank), the contents of a.bin (100,000 -> "
            "4,000 tokens)") in done.stdout
    # half the batch, accumulated over two micro-batches, is the same global batch; the preset's own
    # sequence length given is the one it trained at
    done = train("--model", "tiny", "--steps", "4", "--checkpoint-dir", "ckpt", "--data", "a.bin", "--nproc", "1",
                 "--batch", "8", "--grad-accum", "2", "--seq-len", "32", cwd=tmp_path)
    assert ("resuming from ckpt/step_00000003 (step 3, saved by 1 rank); this run changes --steps 3 -> 4, --batch "
            "16 -> 8, --grad-accum 1 -> 2\n") in done.stdout, done.stdout


@pytest.mark.slow
def test_data_cut_short_under_a_run_stops_it_without_a_restart(tmp_path):
    """Restarted (--max-restarts), the workers resumed the run's last checkpoint on data that had
    changed since, and refused it: a restart after a refusal meets it again, so none is made."""
    path = token_file(tmp_path / "a.bin", 400_000)
    job = subprocess.Popen([sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--eval-batches", "1",
                            "--steps", "100000", "--checkpoint-dir", "ckpt", "--save-every", "2", "--data", "a.bin",
                            "--max-restarts", "1"], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 200
        while not list_checkpoints(tmp_path / "ckpt") and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.2)
        os.truncate(path, path.stat().st_size // 40)  # another, smaller split written over it
        _, stderr = job.communicate(timeout=300)
    finally:
        job.kill()
    assert job.returncode == 2
    assert "error: --data: a.bin changed while the run read it: it holds 20,000 bytes, 800,000" in stderr
    assert stderr.count("changed while the run read it") == 1, stderr  # every rank reads it; one says it
    assert "starting them again" not in stderr and "the data changed since" not in stderr, stderr
    assert "Traceback" not in stderr and "SIGBUS" not in stderr


@pytest.mark.slow
def test_workers_restarted_after_a_crash_refuse_data_changed_since_their_checkpoint(tmp_path):
    """A worker killed, the data rewritten before the restart: the restarted workers would resume the
    run on other data, as if it were the same run."""
    token_file(tmp_path / "a.bin", 400_000)
    train("--model", "tiny", "--steps", "2", "--checkpoint-dir", "ckpt", "--data", "a.bin", cwd=tmp_path)
    token_file(tmp_path / "a.bin", 10_000)
    restarted = {**os.environ, "LOCAL_WORLD_SIZE": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29573", "TORCHELASTIC_RUN_ID": "test",
                 "TORCHELASTIC_RESTART_COUNT": "1"}
    done = subprocess.run([sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--eval-batches", "1",
                           "--steps", "4", "--checkpoint-dir", "ckpt", "--data", "a.bin"], capture_output=True,
                          text=True, timeout=400, cwd=tmp_path, env=restarted)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        "error: the data changed since ckpt/step_00000002 was saved: the contents of a.bin (400,000 -> 10,000 "
        "tokens); these workers were restarted (--max-restarts) to resume that run: restore the data, or run the "
        "command again to resume on this data"), done.stderr


@pytest.mark.slow
def test_an_hf_checkpoint_records_its_config_and_refuses_another(tmp_path):
    pytest.importorskip("transformers")
    model = tmp_path / "gpt2-mini"
    model.mkdir()
    config = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64, "vocab_size": 256,
              "activation_function": "gelu_new"}
    (model / "config.json").write_text(json.dumps(config))
    train("--model", "hf:gpt2-mini", "--seq-len", "32", "--steps", "2", "--checkpoint-dir", "ckpt", cwd=tmp_path)
    extra = json.loads((tmp_path / "ckpt/step_00000002/manifest.json").read_text())["extra"]
    assert extra["hf_config"] == config
    (model / "config.json").write_text(json.dumps({**config, "activation_function": "relu"}))
    done = train("--model", "hf:gpt2-mini", "--seq-len", "32", "--steps", "4", "--checkpoint-dir", "ckpt",
                 cwd=tmp_path, check=False)
    assert done.returncode != 0
    assert ("error: hf:gpt2-mini's config differs from the one ckpt/step_00000002 was trained with: "
            "activation_function 'gelu_new' -> 'relu'; its weights belong to the recorded "
            "architecture") in done.stderr
    assert [path.name for path in list_checkpoints(tmp_path / "ckpt")] == ["step_00000002"]
    (model / "config.json").write_text(json.dumps(config))
    done = train("--model", "hf:gpt2-mini", "--seq-len", "32", "--steps", "4", "--checkpoint-dir", "ckpt",
                 "--units", "GPT2MLP", cwd=tmp_path, check=False)
    assert done.stderr.strip().splitlines()[-1] == (
        "error: ckpt/step_00000002 was trained with the model's own units, and this run has --units GPT2MLP: a "
        "checkpoint holds its weights unit by unit, so give no --units to resume it"), done.stderr


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: mounts a small tmpfs")
def test_an_export_that_fills_the_disk_is_one_line_naming_where_the_model_is(tmp_path):
    pytest.importorskip("transformers")
    config = tmp_path / "gpt2.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
                                  "vocab_size": 256}))
    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], check=True)
    try:
        done = train("--model", f"hf:{config}", "--seq-len", "32", "--steps", "2", "--checkpoint-dir", "ckpt",
                     "--export-hf", str(full / "out"), cwd=tmp_path, check=False)
        left = os.listdir(full)
    finally:
        subprocess.run(["umount", str(full)], check=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: --export-hf {full / 'out'}: No space left on device; the trained model is in ckpt/step_00000002: "
        f"`shardwire export ckpt/step_00000002 DIR` writes it elsewhere")
    assert left == []  # nothing half-written is left


@pytest.mark.slow
def test_a_resume_at_another_seq_len_names_the_one_the_checkpoint_was_trained_at(tmp_path):
    """A GPT preset's position table has a row per token: its checkpoint fits only a model made at the
    --seq-len it was trained at, which the refusal names."""
    train("--model", "tiny", "--seq-len", "16", "--steps", "2", "--checkpoint-dir", "ckpt", cwd=tmp_path)
    done = train("--model", "tiny", "--steps", "4", "--checkpoint-dir", "ckpt", cwd=tmp_path, check=False)
    assert done.returncode != 0
    assert done.stderr.strip() == ("error: ckpt/step_00000002 was trained at --seq-len 16, and this run's is "
                                   f"{PRESETS['tiny'].seq_len}: give --seq-len 16 to resume it"), done.stderr
    assert "4/4" in train("--model", "tiny", "--seq-len", "16", "--steps", "4", "--checkpoint-dir", "ckpt",
                          cwd=tmp_path).stdout
    # trained at the preset's own length, resumed at another: the preset's is named
    train("--model", "tiny", "--steps", "2", "--checkpoint-dir", "own", cwd=tmp_path)
    done = train("--model", "tiny", "--seq-len", "16", "--steps", "4", "--checkpoint-dir", "own", cwd=tmp_path,
                 check=False)
    assert done.stderr.strip().endswith(f"own/step_00000002 was trained at --seq-len {PRESETS['tiny'].seq_len}, and "
                                        f"this run's is 16: give --seq-len {PRESETS['tiny'].seq_len} to resume it"), \
        done.stderr
    # another preset's checkpoints: named once, with what to give, before any is loaded
    done = train("--model", "small", "--steps", "4", "--checkpoint-dir", "own", cwd=tmp_path, check=False)
    assert done.returncode != 0 and done.stderr.strip().splitlines()[-1] == (
        "error: own/step_00000002 was trained as --model tiny, and this run's is small: give --model tiny to resume "
        "it, or another --checkpoint-dir to start a run of small"), done.stderr
    # a model of the other kind: named as one
    if importlib.util.find_spec("transformers") is not None:
        (tmp_path / "gpt2.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                                        "n_positions": 64, "vocab_size": 256}))
        done = train("--model", "hf:gpt2.json", "--steps", "4", "--checkpoint-dir", "own", cwd=tmp_path, check=False)
        assert done.returncode == 2 and done.stderr == (  # its line alone: before the config's warnings, the start
            "error: own/step_00000002 was trained as --model tiny, and this run's is hf:gpt2.json: give --model tiny "
            "to resume it, or another --checkpoint-dir to start a run of hf:gpt2.json\n"), done.stderr


@pytest.mark.slow
def test_the_last_checkpoint_of_a_diloco_run_holds_the_synced_model(tmp_path):
    train("--model", "tiny", "--steps", "5", "--layout", "hybrid", "--shard-group-size", "1", "--diloco",
          "sync_every=3,wire=none", "--checkpoint-dir", "ckpt", cwd=tmp_path)
    last = tmp_path / "ckpt/step_00000005"
    groups = [safe_open(last / f"rank_{rank:05d}.safetensors", "pt") for rank in (0, 1)]
    for key in (key for key in groups[0].keys() if key.startswith("param/")):
        anchor = key.replace("param/", "outer/") + "/anchor"
        assert torch.equal(groups[0].get_tensor(key), groups[1].get_tensor(key))  # one model, not each group's
        assert torch.equal(groups[0].get_tensor(key), groups[0].get_tensor(anchor))  # what export reads
