"""Bad options are one clear line and a non-zero exit before any worker starts."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import types
import warnings

import pytest

from shardwire import launch
from shardwire.cli import _run, command, main
from shardwire.comm.errors import CollectiveError, ScheduleMismatchError
from shardwire.launch import COLLECTIVE_FAILED, REFUSED
from harness import PROFILE



@pytest.mark.parametrize("args, message", [
    (["--lr", "-1"], "--lr must be a positive, finite number, got -1.0"),
    (["--lr", "nan"], "--lr must be a positive, finite number, got nan"),
    (["--weight-decay", "-0.1"], "--weight-decay must be a non-negative, finite number, got -0.1"),
    (["--clip", "inf"], "--clip must be a non-negative, finite number, got inf"),
    (["--peak-tflops", "0"], r"--peak-tflops must be a finite number of TFLOP/s \(each 1e12 FLOP/s\), at least 1e-06, got 0.0"),
    # a peak in FLOP/s, which would give an MFU of 0.0%
    (["--peak-tflops", "312e12"], r"--peak-tflops must be at most 1,000,000,000 TFLOP/s \(each 1e12 FLOP/s\), got "),
    (["--warmup", "-5"], "--warmup must be at least 0, got -5"),
    (["--seed", "-1"], "--seed must be at least 0, got -1"),
    # 0 in fp32: a run that trains and changes nothing
    (["--lr", "1e-50"], r"--lr must be at least 1.18e-38, float32's smallest normal number \(a smaller one is 0"),
    (["--layout", "hybrid", "--diloco", "outer_lr=1e-320"], "--diloco outer_lr must be at least 1.18e-38"),
    # a step, or a validation, that would never end
    (["--grad-accum", "1099511627776"], "--grad-accum must be at most 65,536, got 1099511627776"),
    (["--eval-batches", "1000000000"], "--eval-batches must be at most 65,536, got 1000000000"),
])
def test_nonsensical_hyperparameters_are_refused(args, message):
    with pytest.raises(SystemExit, match=message):
        main(["train", *args])


@pytest.mark.parametrize("option, given, instead", [
    (["--profile", "--run-dir"], "step_00000002", "profile"),
    (["--tensorboard"], "step_00000004/tb", "tb"),
    (["--log-jsonl"], "step_00000003.tmp-0123456789ab/log.jsonl", "log.jsonl"),
])
def test_a_log_where_checkpoints_are_saved_is_refused_before_training(tmp_path, option, given, instead):
    """It was written into a checkpoint's name: kept as a checkpoint --keep never prunes, or set aside
    by the save of that step and the log lost."""
    ckpt = tmp_path / "ckpt"
    with pytest.raises(SystemExit, match=f"{option[-1]} {ckpt}/{given} is where --checkpoint-dir saves its checkpoints "
                                         rf"\(step_...\): a save would take it for one, or set it aside; give it a "
                                         f"place beside them, such as {ckpt}/{instead}"):
        main(["train", "--checkpoint-dir", str(ckpt), *option, str(ckpt / given)])
    assert not ckpt.exists()


@pytest.mark.parametrize("option, instead", [(["--profile", "--run-dir"], "profile"), (["--tensorboard"], "tb"),
                                             (["--log-jsonl"], "log.jsonl")])
def test_a_log_named_as_the_manifest_of_a_new_series_is_refused_before_training(tmp_path, option, instead):
    """Accepted in a series not yet begun, it made the series a checkpoint, and the same command,
    run again to resume, was refused."""
    ckpt = tmp_path / "ckpt"
    with pytest.raises(SystemExit, match=f"{option[-1]} {ckpt}/manifest.json is named as a checkpoint's manifest, in "
                                         f"--checkpoint-dir's series, which would then be taken for a checkpoint "
                                         f"itself: give it another name, such as {ckpt}/{instead}"):
        main(["train", "--checkpoint-dir", str(ckpt), *option, str(ckpt / "manifest.json")])
    assert not ckpt.exists()


def test_an_output_named_as_a_series_checkpoint_or_manifest_is_refused(tmp_path, capsys):
    """Beside a series of checkpoints, with no --checkpoint-dir given: a log named ``step_N`` was set
    aside under a random name by the save of that step, and one named ``manifest.json`` made
    ``export`` of the series refuse it as a damaged checkpoint."""
    import torch

    import shardwire
    series = tmp_path / "ckpt"
    model = shardwire.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    shardwire.save_checkpoint(shardwire.checkpoint_path(series, 3), model, step=3).wait()
    checkpoint = f"is named as a checkpoint of the series in {series}, which would take it for one of its own"
    for argv, refusal in [
        (["train", "--log-jsonl", f"{series}/step_00000006"], checkpoint),
        (["train", "--profile", "--run-dir", f"{series}/step_00000009"], checkpoint),
        (["train", "--log-jsonl", f"{series}/manifest.json"], f"is named as a checkpoint's manifest, in {series}"),
        (["bench", "--json", f"{series}/step_00000012"], checkpoint),
    ]:
        try:
            assert main(argv) == 2
        except SystemExit as err:
            print(err.code, file=sys.stderr)
        assert refusal in capsys.readouterr().err, argv
    assert [path.name for path in series.iterdir() if not path.name.startswith(".")] == ["step_00000003"]
    assert main(["train", "--log-jsonl", f"{series}/log.jsonl", "--print-config"]) == 0  # beside them: its own place


def test_directories_that_cannot_be_created_are_refused_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match=f"--checkpoint-dir {blocker}/ckpt cannot be created: {blocker} is a file"):
        main(["train", "--checkpoint-dir", str(blocker / "ckpt")])
    with pytest.raises(SystemExit, match=f"--run-dir {blocker}/run cannot be created: {blocker} is a file"):
        main(["train", "--profile", "--run-dir", str(blocker / "run")])


def test_an_empty_data_file_says_so(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(SystemExit, match=f"--data: data path {empty} is empty"):
        main(["train", "--data", str(empty)])


def test_an_empty_token_file_says_so(tmp_path):
    empty = tmp_path / "tokens.bin"
    empty.write_bytes(b"")
    with pytest.raises(SystemExit, match=f"--data: {empty} is empty: write its token ids again"):
        main(["train", "--data", str(empty)])


@pytest.mark.slow
def test_a_refusal_leaves_with_status_2_and_one_line_whatever_the_value_holds(tmp_path):
    """The command's refusals (its own, not only the parser's) end as a refusal does, 2; a line
    break in what the user gave is shown, not broken on."""
    for argv, said in ((["--steps", "-1"], "error: --steps must be at least 1, got -1"),
                       (["--data", f"{tmp_path}/no\nfile"], f"error: --data: data path {tmp_path}/no\\nfile does not")):
        done = subprocess.run([sys.executable, "-m", "shardwire", "train", "--nproc", "1", *argv], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and done.stderr.startswith(said) and done.stderr.count("\n") == 1, done.stderr


@pytest.mark.parametrize("argv", [
    ["simulate", "--model", "tiny", "--cluster", "a100-100gbe", "--cluster-from", "{dir}/no\nbench.json"],
    ["simulate", "--model", "tiny", "--cluster", "a100-100gbe", "--calibrate", "{dir}/no\nprofile.json"],
    ["plan", "--model", "tiny", "--cluster", "a100-100gbe", "--global-batch", "8",
     "--cluster-from", "{dir}/no\nb.json"],
    ["export", "{dir}/no\nckpt", "{dir}/out.pt"],
    ["report", "{dir}/no\nrun"],
])
def test_every_commands_refusal_of_a_path_with_a_line_break_is_one_line(argv, tmp_path, capsys):
    assert main([arg.format(dir=tmp_path) for arg in argv]) == 2
    said = capsys.readouterr().err
    assert said.startswith("error: ") and said.count("\n") == 1 and "no\\n" in said, said


def test_a_bench_output_that_is_a_directory_is_refused(tmp_path, capsys):
    assert main(["bench", "--nproc", "2", "--json", str(tmp_path)]) == 2
    assert f"--json {tmp_path} is a directory; give a file name" in capsys.readouterr().err


def test_report_on_a_damaged_profile_or_into_a_file_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "profile.json").write_text('{"version": 1, "world_size": 1, "timeline": {}}')
    assert main(["report", str(run)]) == 2
    said = capsys.readouterr().err  # what it lacks, in words: not the name of a Python exception
    assert f"{run}/profile.json is damaged (the profile has no device, unlike a profile of" in said
    assert "Error" not in said
    (run / "profile.json").write_text("[1, 2]")
    assert main(["report", str(run)]) == 2
    assert "holds a JSON list, not a profile" in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    shutil.copyfile(PROFILE, run / "profile.json")
    assert main(["report", str(run), "--out", str(blocker)]) == 2
    assert f"--out {blocker} is a file; give it a directory" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["train", "--steps", "abc"], "error: argument --steps: 'abc' is not an integer (see shardwire train --help)"),
    (["bogus"], "error: argument COMMAND: invalid choice: 'bogus'"),
    (["plan", "--model", "gpt-125m"], "error: the following arguments are required"),
    # an empty word (a variable that was not set) names nothing: not the current directory, not the default
    # ... an option can be left out; an argument can only be given
    (["export", "ckpt", ""], "error: argument OUT: an empty value names nothing: give one (a variable that was not "
                             "set?)"),
    (["export", "", "out.pt"], "error: argument CHECKPOINT: an empty value names nothing: give one (a variable"),
    (["export", "ckpt", "out.pt", "--model", ""], "error: argument --model: an empty value names nothing: give one, "
                                                  "or leave the option out"),
    (["report", ""], "error: argument RUN_DIR: an empty value names nothing: give one (a variable"),
    (["report", "run", "--out", ""], "error: argument --out: an empty value names nothing: give one, or leave the "
                                     "option out"),
])
def test_a_command_line_argparse_refuses_is_one_line(argv, said, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.startswith(said) and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, suggested", [
    (["train", "--checkpoint-dri", "x"], "; did you mean --checkpoint-dir?"),
    (["train", "--lrr", "1"], "; did you mean --lr?"),
    (["simulate", "--model", "tiny", "--cluster", "a100-100gbe", "--sweeep", "nodes=1,2"], "; did you mean --sweep?"),
    (["train", "--zzzzzz"], ""),
])
def test_an_option_slipped_on_names_the_nearest(capsys, argv, suggested):
    with pytest.raises(SystemExit):
        main(argv)
    said = capsys.readouterr().err.strip()
    assert said.startswith("error: unrecognized arguments: ") and "\n" not in said, said
    assert said.endswith(f"{suggested} (see shardwire {argv[0]} --help)"), said


def test_a_setting_slipped_on_names_the_nearest():
    with pytest.raises(SystemExit, match=r"error: --diloco 'sync_evry=5' is not understood: .* \(did you mean "
                                         r"sync_every\?\)$"):
        main(["train", "--model", "tiny", "--layout", "hybrid", "--diloco", "sync_evry=5"])


def test_an_abbreviated_option_works_for_a_release_with_a_warning(capsys):
    """argparse took any unambiguous beginning of an option for it, so a new option beginning the same
    way would break a command line: an abbreviation is read whole, naming the option to write."""
    simulate = ["simulate", "--model", "gpt-1.3b", "--cluster", "a100-100gbe"]
    with pytest.warns(FutureWarning, match=r"^--trainin is read as --training: write it whole"):
        assert main([*simulate, "--trainin", "{micro_batch: 2}"]) == 0
    with pytest.warns(FutureWarning, match=r"^--seq is read as --seq-len"):
        assert main([*simulate, "--seq=256"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["simulate", "--model", "gpt-1.3b", "--clus", "a100-100gbe"])
    said = capsys.readouterr().err
    assert said == "error: ambiguous option: --clus could match --cluster, --cluster-from (see shardwire simulate " \
                   "--help)\n", said
    with warnings.catch_warnings():  # the words of the command testbed exec runs are that command's
        warnings.simplefilter("error")
        exec_args = command("testbed")[1].parse_args(["exec", "node0", "echo", "--nam", "x", "--h"])
    assert exec_args.command == ["echo", "--nam", "x", "--h"]
    with warnings.catch_warnings():  # --config is written in full: refused as ever, with no warning first
        warnings.simplefilter("error")
        with pytest.raises(SystemExit):
            main(["train", "--conf", "x"])
    assert capsys.readouterr().err.startswith("error: write --config in full")


def test_an_option_given_twice_works_for_a_release_with_a_warning(capsys):
    """argparse kept the last of an option given twice and dropped the others without a word: a second
    --sweep replaced the first."""
    simulate = ["simulate", "--model", "gpt-1.3b", "--cluster", "a100-100gbe"]
    with pytest.warns(FutureWarning, match=r"^--sweep is given more than once: the last one given is used and the "
                                           r"others are dropped; give it once"):
        assert main([*simulate, "--sweep", "micro_batch=1,2", "--sweep=nodes=1,2"]) == 0
    assert "sweep     nodes = 1, 2 " in capsys.readouterr().out
    with pytest.warns(FutureWarning, match=r"^--training is given more than once"):  # an abbreviation counts
        assert main([*simulate, "--training", "{micro_batch: 2}", "--trainin", "{micro_batch: 1}"]) == 0
    with pytest.warns(FutureWarning, match=r"^-b is given more than once"):  # a value written on
        command("bench")[1].parse_args(["-b1K", "-b", "2K"])
    with pytest.warns(FutureWarning, match=r"^--nproc-per-node is given more than once"):  # before a job's words
        command("testbed")[1].parse_args(["run", "--name", "x", "--nproc-per-node", "1", "--nproc-per-node", "2",
                                          "--", "t.py"])
    with pytest.warns(FutureWarning, match=r"^--no-reshard is given after --reshard: the last one given is used"):
        command("train")[1].parse_args(["--reshard", "--no-reshard"])
    with warnings.catch_warnings():  # each once, a switch twice alike, and the words after -- are another command's
        warnings.simplefilter("error")
        main([*simulate, "--nodes", "2", "--seq-len", "256"])
        command("plan")[1].parse_args(["--model", "tiny", "--cluster", "a100-100gbe", "--global-batch", "8", "--exact",
                                       "--exact"])
        command("testbed")[1].parse_args(["run", "--name", "x", "--", "t.py", "--name", "y"])


def test_a_worker_whose_peer_stopped_says_so_in_one_line(monkeypatch, capsys):
    """A peer that refused (data changed under it), crashed or hung leaves the others' collectives
    failing: each says what it was waiting for in one line, not a traceback, where the launcher has not
    stopped it first (the peer's line is then the one the user reads), and ends with a status
    --max-restarts restarts (a hung peer ended the run as a refusal); ranks that issued different
    collectives refuse, as a restart would meet it again."""
    def run(args, argv, checked):
        raise CollectiveError("rank 1: all_gather of 'blocks.0'\nfailed (Connection closed by peer). Another rank "
                              "has probably stopped")

    waited = []
    monkeypatch.setattr(launch.time, "sleep", waited.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _run(types.SimpleNamespace(run=run), argparse.ArgumentParser(), []) == COLLECTIVE_FAILED  # restartable
    assert waited == [launch._LAUNCHERS_STOP_S]  # for the launcher, which looks at its workers every 0.1 s
    assert capsys.readouterr().err == ("error: rank 1: all_gather of 'blocks.0' failed (Connection closed by peer). "
                                       "Another rank has probably stopped\n")

    def mismatched(args, argv, checked):
        raise ScheduleMismatchError("rank 1: ranks issued different collectives in step 3")

    assert _run(types.SimpleNamespace(run=mismatched), argparse.ArgumentParser(), []) == REFUSED
    capsys.readouterr()
    monkeypatch.delenv("LOCAL_RANK")  # a library call outside a launcher raises as ever
    with pytest.raises(CollectiveError):
        _run(types.SimpleNamespace(run=run), argparse.ArgumentParser(), [])


def test_a_torch_collective_whose_peer_is_gone_says_so_in_one_line(monkeypatch, capsys):
    """Under DiLoCo, a kill -9 of rank 1 met rank 0 in the loop's own all-reduce of its loss: 30 lines
    of gloo's traceback before the launcher's line naming the rank killed."""
    def run(args, argv, checked):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4122: "
                           "Connection reset by peer")

    monkeypatch.setattr(launch.time, "sleep", lambda _: None)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _run(types.SimpleNamespace(run=run), argparse.ArgumentParser(), []) == COLLECTIVE_FAILED
    assert capsys.readouterr().err == ("error: rank 0 lost its connection to another rank, whose process ended or "
                                       "whose link broke (Read error [127.0.0.1]:4122: Connection reset by peer)\n")

    def bug(args, argv, checked):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):  # any other error is not taken for a lost peer
        _run(types.SimpleNamespace(run=bug), argparse.ArgumentParser(), [])


@pytest.mark.parametrize("rank, waits", [("0", False), ("1", True)])
def test_a_refusal_every_rank_meets_is_rank_0s_to_say(monkeypatch, capsys, rank, waits):
    """Every rank reads the same data and options: where each refuses alike (a file cut short as the
    workers start), rank 0 says it at once and the others wait for the launcher to stop them."""
    def run(args, argv, checked):
        raise SystemExit("error: --data: t.bin changed")

    waited = []
    monkeypatch.setattr(launch.time, "sleep", waited.append)
    for name, value in (("LOCAL_RANK", rank), ("RANK", rank), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    assert _run(types.SimpleNamespace(run=run), argparse.ArgumentParser(), []) == REFUSED
    assert waited == ([launch._LAUNCHERS_STOP_S] if waits else [])
    assert capsys.readouterr().err == "error: --data: t.bin changed\n"  # said where the launcher did not stop it


def test_shardwires_own_warnings_are_one_line_and_others_as_ever():
    from shardwire.cli import _warnings_in_one_line
    from shardwire.engine.checkpoint import series

    with _warnings_in_one_line():
        ours = warnings.formatwarning("kept step_1", UserWarning, series.__file__, 80)
        theirs = warnings.formatwarning("deprecated", DeprecationWarning, argparse.__file__, 10)
    assert ours == "warning: kept step_1\n"
    assert theirs.startswith(f"{argparse.__file__}:10: DeprecationWarning: deprecated")


@pytest.mark.parametrize("diloco, trains", [
    ([], "it trains as --layout full;"),
    (["--diloco", "sync_every=2"], "it trains as one group, sharded as --layout full, whose --diloco outer step still "
                                   "applies at each sync with no other group to average;"),
])
def test_hybrid_on_one_node_says_once_what_it_trains_as(capsys, diloco, trains):
    with pytest.warns(UserWarning) as warned:
        assert main(["train", "--model", "tiny", "--nproc", "2", "--layout", "hybrid", *diloco, "--print-config"]) == 0
    said = [str(warning.message) for warning in warned]
    assert len(said) == 1 and said[0].startswith("--layout hybrid shards within each node and replicates across "
                                                 "nodes, and all 2 ranks are on one node: ") and trains in said[0], said


@pytest.mark.parametrize("argv", [
    ["export", "ckpt", "out.pt", "--model", "x" * 100_000],
    ["report", "q" * 5_000],
])
def test_a_value_far_too_long_is_cut_short_in_its_message(argv, capsys, tmp_path, monkeypatch):
    import torch

    import shardwire
    monkeypatch.chdir(tmp_path)
    model = shardwire.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    shardwire.save_checkpoint(shardwire.checkpoint_path("ckpt", 1), model, step=1, extra={"model": "tiny"}).wait()
    main(argv)
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and len(err) < 500, err[:300]


@pytest.fixture
def testbed_jobs(monkeypatch, tmp_path):
    """A testbed of 2 nodes as ``up`` records it, taken for built (no root, no namespaces), whose jobs
    are recorded instead of started: what ``testbed run`` does before any node starts."""
    from shardwire.testbed import job, network, spec

    monkeypatch.setattr(spec, "STATE_DIR", tmp_path)
    monkeypatch.setattr(network, "require_privileges", lambda *given: None)
    monkeypatch.setattr(network, "is_up", lambda testbed: True)
    monkeypatch.setattr(job, "stop_leftovers", lambda testbed: [])  # no nodes: nothing left on them
    started = []
    monkeypatch.setattr(job, "run_job", lambda testbed, nproc_per_node, command, **options: started.append(command))
    spec.Testbed("shardwire-test-options", 2, spec.parse_rate("100mbit")).save()
    terminated = signal.getsignal(signal.SIGTERM)  # `run` stops its job on SIGTERM
    yield lambda *job: main(["testbed", "run", "--name", "shardwire-test-options", "--nproc-per-node", "2", "--",
                             "-m", "shardwire", *job])
    signal.signal(signal.SIGTERM, terminated)
    assert not started, started


@pytest.mark.parametrize("job, said", [
    (["train", "--model", "tiny", "--steps", "3", "--lr", "-1"],
     "error: --lr must be a positive, finite number, got -1.0"),
    (["train", "--lrr", "1"],
     "error: unrecognized arguments: --lrr 1; did you mean --lr? (see shardwire train --help)"),
    # the world the nodes give it: 2 nodes of 2 ranks, whatever --nproc says
    (["train", "--nproc", "1", "--layout", "hybrid", "--shard-group-size", "3"],
     "error: --shard-group-size 3 does not divide the 4 ranks of the process group: choose one of 1, 2, 4"),
    (["train", "--config", "no-such.yaml"], "error: --config no-such.yaml: "),
    (["bench", "--min-bytes", "2M", "--max-bytes", "1M"], "error: --min-bytes (2097152) is larger than --max-bytes"),
    (["trian", "--model", "tiny"], "error: the job -m shardwire needs one of shardwire's commands (train, bench, "),
])
def test_a_testbed_jobs_bad_option_is_one_line_before_any_node_starts(testbed_jobs, job, said, capsys):
    """Each node's workers refused it, and each node's torchrun added its traceback: 72 lines and a
    status of 1 for a --lr of -1. It is checked once, as the command itself checks it, and refused."""
    assert testbed_jobs(*job) == REFUSED
    err = capsys.readouterr().err
    assert err.startswith(said) and err.count("\n") == 1, err


def test_a_testbed_job_is_checked_for_the_world_its_nodes_give_it(testbed_jobs, capsys, monkeypatch):
    """2 nodes of 2 ranks: a group of 4, and bench's groups between nodes, are the job's to have
    (bench's --nproc, 2 by default, is one node's count of ranks here), and its --help is said once."""
    from shardwire.testbed import job

    started = []
    monkeypatch.setattr(job, "run_job", lambda testbed, nproc_per_node, command, **options: started.append(command)
                        or 0)
    for given in (["train", "--model", "tiny", "--layout", "hybrid", "--shard-group-size", "4"],
                  ["bench", "--groups", "intra", "inter"]):
        assert testbed_jobs(*given) == 0, capsys.readouterr().err
        assert started.pop() == ["-m", "shardwire", *given]  # as the user gave it
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"} & os.environ.keys()
    assert testbed_jobs("train", "--help") == 0 and not started
    assert capsys.readouterr().out.startswith("usage: shardwire train")


def test_a_testbed_job_is_claimed_before_its_testbed_and_options_are_checked(testbed_jobs, capsys, monkeypatch):
    """`run` checked the testbed, then the job's options for seconds, and only then claimed it: a
    `down` or an `up` in between was not refused, and the job failed blaming a node, or ran on the
    links of another testbed without a word."""
    import contextlib

    from shardwire.cli import testbed as testbed_command
    from shardwire.testbed import job, spec

    done = []
    checking, claiming = testbed_command._check_job, testbed_command.running

    @contextlib.contextmanager
    def running(name):
        with claiming(name):
            done.append("claimed")
            yield

    monkeypatch.setattr(testbed_command, "running", running)
    monkeypatch.setattr(testbed_command, "_settled", lambda name: done.append("settled") or spec.Testbed.load(name))
    monkeypatch.setattr(testbed_command, "_check_job", lambda *given: done.append("checked") or checking(*given))
    monkeypatch.setattr(job, "run_job", lambda testbed, nproc_per_node, command, **options: done.append("ran") or 0)
    assert testbed_jobs("train", "--model", "tiny") == 0, capsys.readouterr().err
    assert done == ["claimed", "settled", "checked", "ran"]


def test_a_testbed_check_is_refused_while_a_job_runs(testbed_jobs, tmp_path, capsys):
    """It measured the links beside the job's traffic, failing them as slow (`is the machine busy?`),
    and cut the job's traffic; a `down` during it was not refused."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time, pathlib\n"
                               "from shardwire.testbed import spec\n"
                               "spec.STATE_DIR = pathlib.Path(sys.argv[1])\n"
                               "with spec.running('shardwire-test-options'):\n"
                               "    print('held', flush=True)\n"
                               "    time.sleep(60)\n", str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert main(["testbed", "check", "--name", "shardwire-test-options"]) != 0
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert f"testbed 'shardwire-test-options' is running another job (process {holder.pid} " in err and \
        err.count("\n") == 1, err


def test_ctrl_c_names_a_fault_tolerant_groups_own_series(tmp_path):
    import shardwire
    from shardwire.cli.train import _what_was_saved
    from shardwire.models.gpt import GPT, PRESETS, Block
    from shardwire.training.config import TrainConfig

    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block])
    shardwire.save_checkpoint(shardwire.checkpoint_path(tmp_path / "g1", 4), model, step=4).wait()
    config = TrainConfig(checkpoint_dir=str(tmp_path), fault_tolerance="lighthouse=http://localhost:29510,group=g1")
    assert _what_was_saved(config) == (f"{tmp_path}/g1/step_00000004 is the newest checkpoint; running the same "
                                       f"command again resumes from it")


@pytest.fixture
def started(monkeypatch) -> list:
    """The worker arguments of each job the command would start, which none is."""
    jobs = []
    monkeypatch.setattr("shardwire.cli.train.launch_local", lambda nproc, argv, **options: jobs.append(argv) or 0)
    return jobs


@pytest.mark.parametrize("args, said", [
    (["--keep", "5"], "--keep is for --checkpoint-dir, and without it this run saves no checkpoint: give "
                      "--checkpoint-dir DIR, or leave out --keep"),
    (["--save-every", "10"], "--save-every is for --checkpoint-dir, and without it this run saves no checkpoint"),
    (["--keep", "0", "--save-every", "1"], "--save-every and --keep are for --checkpoint-dir, and without it this run "
                                           "saves no checkpoint: give --checkpoint-dir DIR, or leave out --save-every "
                                           "and --keep"),
    (["--run-dir", "runs/a"], "--run-dir is for --profile, and without it this run writes no profile: give --profile, "
                              "or leave out --run-dir"),
    (["--peak-tflops", "312"], "--peak-tflops is for --profile, and without it this run writes no profile"),
    (["--no-profile", "--run-dir", "runs/a", "--peak-tflops", "312"], "--run-dir and --peak-tflops are for --profile"),
])
def test_an_option_given_without_the_one_it_acts_beside_is_said_not_ignored(args, said, started, capsys):
    """Ignored, a --keep without --checkpoint-dir ran to the end with status 0 and saved nothing, its user
    believing the run checkpointed; so did a --run-dir or --peak-tflops without --profile. Said at start
    in one line, by --print-config and --print-launch too; the run goes on (a script that passes them
    always, and what they need only at times, keeps working)."""
    for extra in ([], ["--print-config"], ["--print-launch", "--nnodes", "2"]):
        with pytest.warns(UserWarning, match=re.escape(said)):
            assert main(["train", "--model", "tiny", *args, *extra]) == 0
    assert len(started) == 1
    with warnings.catch_warnings(record=True) as warned, pytest.raises(SystemExit, match="--steps must be"):
        warnings.simplefilter("always")  # a refusal comes alone
        main(["train", "--model", "tiny", *args, "--steps", "0"])
    assert not warned


def test_restarts_with_no_checkpoint_to_resume_from_are_said(started, monkeypatch):
    """Restarted workers resume from the newest checkpoint; without --checkpoint-dir a worker that
    failed near the end trained the run again from step 0, and only the step numbers told. Said at
    start; not where a checkpoint is kept, nor for a fault-tolerant group, which rejoins with the
    other groups' state."""
    said = ("--max-restarts 2 restarts failed workers from the newest checkpoint, and without --checkpoint-dir "
            "this run saves none: a restart trains again from step 0; give --checkpoint-dir DIR")
    for extra in ([], ["--print-launch", "--nnodes", "2"]):
        with pytest.warns(UserWarning, match=re.escape(said)):
            assert main(["train", "--model", "tiny", "--max-restarts", "2", *extra]) == 0
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    for kept in (["--checkpoint-dir", "ckpt"],
                 ["--layout", "hybrid", "--diloco", "sync_every=5", "--fault-tolerance", "lighthouse=h:1"]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert main(["train", "--model", "tiny", "--max-restarts", "2", *kept]) == 0
    assert len(started) == 3


def test_a_printed_config_runs_and_the_options_beside_what_they_need_are_taken(tmp_path, started, capsys,
                                                                                 monkeypatch):
    """--print-config records every option, --keep's, --save-every's, --run-dir's and --peak-tflops'
    defaults among them: the file runs, as printed; given with what they act beside, they are the run's."""
    pytest.importorskip("yaml", reason="the yaml extra is not installed")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--model", "tiny", "--steps", "2", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert all(line in printed.splitlines() for line in ("save_every: 100", "keep: 3", "run_dir: null",
                                                          "peak_tflops: null", "checkpoint_dir: null")), printed
    (tmp_path / "job.yaml").write_text(printed)
    assert main(["train", "--config", "job.yaml"]) == 0
    assert started.pop() == ["train", "--model", "tiny", "--steps", "2"]
    given = ["--checkpoint-dir", "ckpt", "--save-every", "1", "--keep", "0", "--profile", "--run-dir", "runs/a",
             "--peak-tflops", "312.5"]
    assert main(["train", "--config", "job.yaml", *given]) == 0
    assert started.pop() == ["train", "--model", "tiny", "--steps", "2", *given]
    assert main(["train", "--config", "job.yaml", *given, "--print-config"]) == 0  # and printed again, it runs
    (tmp_path / "again.yaml").write_text(capsys.readouterr().out)
    assert main(["train", "--config", "again.yaml"]) == 0
    assert started.pop() == ["train", "--model", "tiny", "--steps", "2", *given]
    # a config file that sets one without what it acts beside is said, as the command line is
    (tmp_path / "kept.yaml").write_text(printed.replace("keep: 3", "keep: 5"))
    with pytest.warns(UserWarning, match="--keep is for --checkpoint-dir"):
        assert main(["train", "--config", "kept.yaml"]) == 0


@pytest.mark.slow
def test_a_refusal_after_the_line_is_read_is_its_one_line_alone(tmp_path):
    """What the options are warned of as they are read (an old name, an old key in a config file, an
    abbreviation, an option without the one it acts beside) is held until they are checked: a refusal,
    here by the checks after the parser's, is its one line alone, as the parser's own are."""
    (tmp_path / "job.yaml").write_text("sync: every=5\n")
    for argv in (["--sync", "bogus"], ["--config", "job.yaml"], ["--seq", "8", "--steps", "0"],
                 ["--keep", "5", "--steps", "0"], ["--sync", "every=5", "--layout", "hybrid", "--data", "missing.txt"]):
        done = subprocess.run([sys.executable, "-m", "shardwire", "train", *argv], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)
        assert done.returncode == 2 and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, \
            (argv, done.stderr)


@pytest.mark.parametrize("rank, said", [("0", True), ("1", False)])
def test_ctrl_c_under_torchrun_is_said_by_rank_0_naming_the_newest_checkpoint(tmp_path, monkeypatch, capsys, rank,
                                                                                said):
    """torchrun's agent says nothing of what was saved (shardwire's own launcher does, its workers quiet)."""
    for name, value in {"LOCAL_RANK": rank, "RANK": rank, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SHARDWIRE_NOTED_BY_LAUNCHER", raising=False)

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr("shardwire.cli.train.train", interrupted)
    assert main(["train", "--model", "tiny", "--checkpoint-dir", str(tmp_path)]) == 130
    line = f"interrupted: no checkpoint was saved in {tmp_path} yet"
    assert capsys.readouterr().err.splitlines() == ([line] if said else [])
