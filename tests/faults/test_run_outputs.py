"""What a training run writes, and what it is given to write it with, when either is broken: a log
on a full disk, a standard output whose reader has left, a checkpoint directory that holds the
user's own files, a number too large to read. Each is one line on stderr, never a traceback; a
broken log ends that log, not the run; nothing of the user's is touched."""

from __future__ import annotations

import json
import os
import re
import resource
import shlex
import subprocess
import sys

import pytest

from shardwire.engine.checkpoint import list_checkpoints


def train(*args: str, cwd, **kwargs) -> subprocess.CompletedProcess:
    """``shardwire train`` of the tiny model, at its smallest, with ``args``."""
    return subprocess.run([sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--eval-batches", "1",
                           *args], capture_output=True, text=True, timeout=120, cwd=cwd, **kwargs)


def no_file_beyond(size: int):
    """A process's limit on the size of each file it writes (RLIMIT_FSIZE): past it a write fails as on
    a full disk (EFBIG; Python ignores the signal that comes with it), wherever the file is."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))


@pytest.mark.slow
def test_a_tensorboard_log_that_cannot_be_written_is_one_warning_and_training_goes_on(tmp_path):
    """Written by torch's SummaryWriter, its thread printed a traceback and the next call raised it."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    # the event file's first event, its version, fits; the first interval's scalars do not
    done = train("--steps", "2", "--log-every", "1", "--tensorboard", "tb", cwd=tmp_path,
                 preexec_fn=no_file_beyond(64))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.splitlines() == [
        "warning: --tensorboard tb: File too large; training goes on without this log from step 1"]
    assert "done: 2 steps" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("eval_every", [None, 2])
def test_the_final_validation_loss_is_the_last_point_of_the_logs(tmp_path, eval_every):
    """Once, where the last interval computed it already (--eval-every)."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    evaluating = ["--eval-every", str(eval_every)] if eval_every else []
    done = train("--steps", "2", "--nproc", "1", "--log-jsonl", "log.jsonl", "--tensorboard", "tb", *evaluating,
                 cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = float(re.search(r"validation loss (\S+)", done.stdout)[1])
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [(r["step"], round(r["val_loss"], 3)) for r in records if "val_loss" in r] == [(2, printed)]
    assert records[-1]["step"] == 2 and "val_loss" in records[-1]
    board = EventAccumulator(str(tmp_path / "tb"))
    board.Reload()
    assert [(e.step, round(e.value, 3)) for e in board.Scalars("val/loss")] == [(2, printed)]


@pytest.mark.slow
def test_a_standard_output_whose_reader_leaves_ends_the_progress_not_the_run(tmp_path):
    """``shardwire train | head -n 2``: the steps after go on, and are saved."""
    errors = tmp_path / "stderr"
    with errors.open("w") as stderr:
        run = subprocess.Popen([sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--eval-batches", "1",
                                "--steps", "8", "--log-every", "1", "--checkpoint-dir", "ckpt"],
                               stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=tmp_path)
        try:
            assert run.stdout.readline().startswith("shardwire train: ")
            assert run.stdout.readline().startswith("step 1/8 ")
            run.stdout.close()  # the reader leaves, as head does
            assert run.wait(timeout=120) == 0, errors.read_text()[-3000:]
        finally:
            run.kill()
    assert errors.read_text().splitlines() == [
        "warning: standard output: Broken pipe; training goes on without printing its progress"]
    assert [path.name for path in list_checkpoints(tmp_path / "ckpt")] == ["step_00000008"]


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["simulate", "--model", "medium", "--cluster", "h100-100gbe"],
    ["train", "--print-config"],
    ["train", "--print-launch", "--nproc", "2"],
    ["--help"],  # argparse's own writes say nothing of a failure
], ids=["simulate", "print-config", "print-launch", "help"])
def test_a_result_that_cannot_be_written_is_a_failure_in_one_line(args):
    """A command whose output is its result, to a full disk, gave a traceback (or, where the text
    waited in a buffer until exit, said nothing and left with 0); to a closed one (``>&-``), said
    nothing and left with 0."""
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "shardwire", *args], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    assert (done.returncode, done.stderr) == (
        1, "error: standard output: No space left on device; what the command printed is incomplete\n")
    closed = subprocess.run(f"{sys.executable} -m shardwire {shlex.join(args)} >&-", shell=True,
                            stderr=subprocess.PIPE, text=True, timeout=120)
    assert (closed.returncode, closed.stderr) == (
        1, "error: standard output: it was closed as the command started (>&-); what the command printed is "
           "incomplete\n")


@pytest.mark.slow
def test_a_launched_commands_result_that_cannot_be_written_is_one_line_and_no_traceback():
    """bench's rank 0 left at its first failed write, and rank 1, mid-collective, printed gloo's
    traceback; now the ranks measure to the end and rank 0 says why, its launcher adding nothing."""
    bench = [sys.executable, "-m", "shardwire", "bench", "--nproc", "2", "--ops", "all_reduce", "-b", "1K", "-e", "4K",
             "-n", "2", "-w", "1"]
    with open("/dev/full", "w") as full:
        done = subprocess.run(bench, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert (done.returncode, done.stderr) == (
        2, "error: standard output: No space left on device; what the command printed is incomplete\n")
    reader, writer = os.pipe()
    os.close(reader)  # a reader gone, as after | head: every write fails
    try:
        gone = subprocess.run(bench, stdout=writer, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(writer)
    assert (gone.returncode, gone.stderr) == (2, "")


@pytest.mark.slow
def test_a_run_whose_standard_output_is_a_full_disk_trains_and_saves(tmp_path):
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--eval-batches", "1",
                               "--steps", "2", "--checkpoint-dir", "ckpt"], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120, cwd=tmp_path)
    assert (done.returncode, done.stderr.splitlines()) == (
        0, ["warning: standard output: No space left on device; training goes on without printing its progress"])
    assert [path.name for path in list_checkpoints(tmp_path / "ckpt")] == ["step_00000002"]


@pytest.mark.slow
def test_a_run_started_without_standard_output_trains_and_saves(tmp_path):
    """``shardwire train >&-``: Python's ``sys.stdout`` is None in every process."""
    done = subprocess.run(f"{sys.executable} -m shardwire train --model tiny --eval-batches 1 --steps 2 "
                          f"--checkpoint-dir ckpt >&-", shell=True, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                          timeout=300)
    assert (done.returncode, done.stderr.splitlines()) == (0, [
        "warning: standard output: it was closed as the command started (>&-); training goes on without printing "
        "its progress"])
    assert [path.name for path in list_checkpoints(tmp_path / "ckpt")] == ["step_00000002"]


@pytest.mark.slow
def test_a_checkpoint_kept_for_the_users_files_in_it_is_said_once_a_run(tmp_path):
    assert train("--steps", "2", "--checkpoint-dir", "ckpt", cwd=tmp_path).returncode == 0
    (tmp_path / "ckpt" / "step_00000002" / "notes.txt").write_text("the user's")
    done = train("--steps", "6", "--save-every", "1", "--keep", "1", "--checkpoint-dir", "ckpt", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("warning: kept ckpt/step_00000002, never deleting what it holds") == 1, done.stderr
    assert (tmp_path / "ckpt" / "step_00000002" / "notes.txt").read_text() == "the user's"


def test_a_checkpoint_directory_of_the_users_own_named_as_one_is_refused_and_left_alone(tmp_path):
    """A directory of the user's named ``step_N`` is no checkpoint: resuming skipped it as a damaged one
    and stopped, naming no remedy, after claiming the directory."""
    own = tmp_path / "ckpt" / "step_00000010"
    own.mkdir(parents=True)
    (own / "notes.txt").write_text("mine")
    done = train("--steps", "2", "--checkpoint-dir", "ckpt", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: --checkpoint-dir ckpt holds step_00000010, named as checkpoints are, but without the manifest.json "
        "every checkpoint holds (yours?): give shardwire's checkpoints a directory of their own"]
    assert sorted(path.name for path in (tmp_path / "ckpt").rglob("*")) == ["notes.txt", "step_00000010"]
    assert (own / "notes.txt").read_text() == "mine"


@pytest.mark.slow
@pytest.mark.parametrize("name, text, said", [
    # a config's numbers reach the options as written, whether JSON or YAML would read them as infinity
    ("job.json", '{"steps": 1e400}', ["--config job.json: steps: '1e400' is not an integer"]),
    ("job.json", '{"lr": 1e400}', ["--config job.json: lr: '1e400' is too large a number (past 1.8e+308)"]),
    ("job.yaml", "lr: 1e400\n", ["--config job.yaml: lr: '1e400' is too large a number (past 1.8e+308)"]),
    # more digits than Python reads an integer of
    ("job.yaml", f"save_every: {'9' * 5000}\n", ["--config job.yaml: save_every: '99999",
                                                 "...9", "9' is too large a number (5,000 digits)"]),
    # read, and past the bound: shown cut short
    ("job.yaml", f"seed: {'9' * 400}\n", ["--seed must be at most 18,446,744,073,709,551,615, got 99999",
                                          "...9"]),
], ids=["json-integer", "json-real", "yaml-real", "yaml-5000-digits", "yaml-400-digits"])
def test_a_number_too_large_is_said_as_written_or_in_words_not_as_infinity(tmp_path, name, text, said):
    pytest.importorskip("yaml", reason="the yaml extra is not installed")
    (tmp_path / name).write_text(text)
    done = train("--config", name, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: {said[0]}") and all(part in done.stderr for part in said), done.stderr
    assert done.stderr.count("\n") == 1 and len(done.stderr) < 300, done.stderr
    assert "inf" not in done.stderr.replace("infinity", "")


@pytest.mark.slow
@pytest.mark.parametrize("args, status", [
    (["--steps", "2", "--log-every", "1", "--keep", "2"], 0),  # a warning to say
    (["--steps", "0"], 2),  # a refusal to say
])
def test_a_standard_error_that_cannot_be_written_changes_nothing_of_the_run_or_its_status(tmp_path, args, status):
    """Where what a command says cannot be written (``2>&-``; a reader gone, as a full disk under
    ``2>err.log`` fails), a run died at its first warning with status 1 and no word anywhere, and a
    refusal left with 1, not 2."""
    command = [sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--eval-batches", "1", *args]
    closed = subprocess.run(f"{shlex.join(command)} 2>&-", shell=True, stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path, timeout=300)
    reader, writer = os.pipe()
    os.close(reader)  # every write to the other end fails (EPIPE)
    try:
        gone = subprocess.run(command, stdout=subprocess.PIPE, stderr=writer, text=True, cwd=tmp_path, timeout=300)
    finally:
        os.close(writer)
    for done in (closed, gone):
        assert done.returncode == status, done.stdout[-2000:]
        assert ("done: 2 steps" in done.stdout) == (status == 0)


def test_runs_that_end_in_the_same_second_write_their_profiles_apart(tmp_path, monkeypatch):
    """The default --run-dir is named for the second a run ends: two started together wrote one
    profile over the other's."""
    from shardwire.training import loop

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loop.time, "strftime", lambda form: "20261130-120000")
    assert [loop._new_run_dir() for _ in range(3)] == [
        "runs/20261130-120000", "runs/20261130-120000-2", "runs/20261130-120000-3"]
    assert sorted(os.listdir(tmp_path / "runs")) == ["20261130-120000", "20261130-120000-2", "20261130-120000-3"]


@pytest.mark.slow
def test_a_log_holds_whole_records_only_and_one_never_written_leaves_nothing(tmp_path):
    """A full disk stopped a line part-way, and the next run appended its first line onto that half;
    a log that failed at its first record left its new directories and an empty file."""
    log = tmp_path / "l.jsonl"
    before = b'{"step": 1, "loss": 4.7, "lr": 0.001, "tokens_per_s": 10.0, "step_time_s": 0.1}\n{"step": 2, "lo'
    log.write_bytes(before)  # its last line one a killed writer left unended
    found = log.stat().st_size
    done = train("--steps", "6", "--log-every", "1", "--log-jsonl", "l.jsonl", cwd=tmp_path,
                 preexec_fn=no_file_beyond(found + 400))  # room for a line or two, not for six
    assert done.returncode == 0 and "from step" in done.stderr, done.stderr[-3000:]
    text = log.read_bytes()
    assert text.startswith(before + b"\n") and text.endswith(b"\n")
    records = [json.loads(line) for line in text.splitlines()[2:]]
    assert records and [record["step"] for record in records] == list(range(1, len(records) + 1))

    done = train("--steps", "2", "--log-every", "1", "--log-jsonl", "new/deeper/l.jsonl", cwd=tmp_path,
                 preexec_fn=no_file_beyond(64))  # not even one line
    assert done.returncode == 0 and done.stderr.endswith("training goes on without this log from step 1\n")
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", ["1", "2"])
def test_the_closing_line_starts_from_the_first_steps_loss(tmp_path, accumulation):
    """It started from the first logged loss, a mean over --log-every steps: one interval read as a
    loss that did not fall (`loss 5.467 -> 5.467`); with accumulation, from the first micro-batch's."""
    every = train("--steps", "6", "--log-every", "1", "--grad-accum", accumulation, cwd=tmp_path)
    once = train("--steps", "6", "--log-every", "6", "--grad-accum", accumulation, cwd=tmp_path)
    first = re.search(r"step 1/6 .*?loss (\d+\.\d+)", every.stdout)[1]
    assert re.search(rf"done: 6 steps in \S+, loss {first} -> ", once.stdout), once.stdout


@pytest.mark.slow
def test_an_nproc_a_launcher_ignores_is_said_to_be(tmp_path):
    """Under torchrun (`testbed run -- -m shardwire train --nproc 3`) it trained the launcher's ranks
    without a word."""
    import os

    launched = {**os.environ, "LOCAL_WORLD_SIZE": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29571", "TORCHELASTIC_RUN_ID": "test"}
    done = train("--steps", "1", "--nproc", "3", cwd=tmp_path, env=launched)
    assert done.returncode == 0 and done.stderr.splitlines()[0] == (
        "warning: --nproc 3 is ignored: a launcher started these workers (1 on this node); give the launcher its "
        "count (torchrun --nproc-per-node)"), done.stderr
