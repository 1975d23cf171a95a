"""A training run under faults a careless or hostile user makes: two runs given one checkpoint
directory, a run that diverges, a resume that changes settings, Ctrl-C. Nothing saved is lost, and
nothing is silent."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import shutil
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import shardwire
from shardwire.cli import main
from shardwire.engine.checkpoint import list_checkpoints
from shardwire.engine.checkpoint.portable import read_state_dict
from shardwire.models.gpt import GPT, PRESETS, Block, loss_fn


def train(*args: str, cwd, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--eval-batches", "1",
                           *args], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert not check or done.returncode == 0, done.stderr[-3000:]
    return done


HOLDER = textwrap.dedent("""
    import sys, time
    import shardwire
    from shardwire.models.gpt import GPT, PRESETS, Block
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block])
    shardwire.load_latest_checkpoint(sys.argv[1], model)
    print("claimed", flush=True)
    time.sleep(300)
""")


@pytest.mark.slow
def test_a_checkpoint_directory_belongs_to_one_run_until_it_ends(tmp_path):
    directory = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "claimed\n"
        model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block])
        with pytest.raises(shardwire.CheckpointError, match=rf"belongs to another run that is still going \(process "
                                                             rf"{holder.pid} on .*: give this run a --checkpoint-dir"):
            shardwire.load_latest_checkpoint(directory, model)
        with pytest.raises(shardwire.CheckpointError, match="belongs to another run"):
            shardwire.save_checkpoint(shardwire.checkpoint_path(directory, 1), model, step=1)
        refused = train("--nproc", "2", "--steps", "1", "--checkpoint-dir", str(directory), cwd=tmp_path, check=False)
        assert refused.returncode == 2  # its workers' refusal, said once: no launcher's line after it
        assert refused.stderr.strip().splitlines() == [
            next(line for line in refused.stderr.splitlines() if "belongs to another run that is still going" in line)]
        assert list_checkpoints(directory) == []
    finally:
        holder.kill()
        holder.wait()
    assert shardwire.load_latest_checkpoint(directory, model) is None  # a dead run's claim is taken over
    shardwire.save_checkpoint(shardwire.checkpoint_path(directory, 1), model, step=1)
    again = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block])  # a second model of this process
    assert shardwire.load_latest_checkpoint(directory, again).step == 1


FAILS_AFTER_ITS_CLAIM = textwrap.dedent("""
    import pathlib, sys
    import shardwire
    from shardwire.models.gpt import GPT, PRESETS, Block
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block])
    shardwire.load_latest_checkpoint(sys.argv[1], model)
    for name in sys.argv[2:]:
        pathlib.Path(sys.argv[1], name).write_text("the user's")
    raise SystemExit("failed before its first save")
""")


@pytest.mark.slow
def test_a_run_that_fails_before_its_first_save_leaves_no_directory_it_made(tmp_path):
    """A failed run left a new --checkpoint-dir (and the directories above it) holding only its claim."""
    def run(directory: pathlib.Path, *names: str) -> None:
        done = subprocess.run([sys.executable, "-c", FAILS_AFTER_ITS_CLAIM, str(directory), *names],
                              capture_output=True, text=True, timeout=120)
        assert done.stderr.splitlines()[-1:] == ["failed before its first save"]

    run(tmp_path / "new" / "ckpt")
    assert os.listdir(tmp_path) == []
    (tmp_path / "given").mkdir()
    run(tmp_path / "given")
    assert os.listdir(tmp_path / "given") == []  # the directory the user made is theirs to keep
    run(tmp_path / "mine", "notes.txt")
    assert sorted(os.listdir(tmp_path / "mine")) == [".shardwire-claim", "notes.txt"]


@pytest.mark.slow
def test_workers_a_signal_ends_before_their_first_save_leave_no_directory(tmp_path):
    """torchrun ends its workers with SIGTERM, so they cannot tidy what they claimed: their launcher does."""
    run = subprocess.Popen([sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--eval-batches", "1",
                            "--nproc", "2", "--steps", "5000", "--save-every", "4000", "--log-every", "1",
                            "--checkpoint-dir", "runs/ckpt"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, cwd=tmp_path)
    try:
        while not run.stdout.readline().startswith("step "):
            pass
        assert (tmp_path / "runs" / "ckpt" / ".shardwire-claim").exists()
        run.send_signal(signal.SIGTERM)
        _, errors = run.communicate(timeout=120)
    finally:
        run.kill()
    assert (run.returncode, errors.splitlines()[-1:]) == (
        128 + signal.SIGTERM, ["stopped by SIGTERM: no checkpoint was saved in runs/ckpt yet"])
    assert os.listdir(tmp_path) == []


def test_a_diverged_model_never_prunes_a_finite_checkpoint(tmp_path):
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block])
    for step in (1, 2):
        shardwire.save_checkpoint(shardwire.checkpoint_path(tmp_path, step), model, step=step, keep=2)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    with pytest.warns(UserWarning, match="holds weights that are not finite: it is saved, and every checkpoint "
                                         "before it is kept"):
        shardwire.save_checkpoint(shardwire.checkpoint_path(tmp_path, 3), model, step=3, keep=2)
    assert [path.name for path in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000002", "step_00000003"]


def test_a_resume_passes_over_a_checkpoint_of_weights_that_are_not_finite(tmp_path, caplog):
    """It resumed from them, and stopped as diverged at its first step, blaming --lr, at every try:
    the newest finite checkpoint is the one to train from, as export takes it."""
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block])
    optimizer = torch.optim.AdamW(model.parameters())
    loss_fn(model(torch.zeros(1, 8, dtype=torch.long)), torch.zeros(1, 8, dtype=torch.long)).backward()
    optimizer.step()
    shardwire.save_checkpoint(shardwire.checkpoint_path(tmp_path, 2), model, optimizer, step=2)
    next(iter(optimizer.state.values()))["exp_avg"].fill_(float("nan"))  # the weights finite, Adam's moment not
    shardwire.save_checkpoint(shardwire.checkpoint_path(tmp_path, 3), model, optimizer, step=3)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    with pytest.warns(UserWarning, match="not finite"):
        shardwire.save_checkpoint(shardwire.checkpoint_path(tmp_path, 4), model, optimizer, step=4, keep=3)
    fresh = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block])
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    assert shardwire.load_latest_checkpoint(tmp_path, fresh, fresh_optimizer).step == 2
    assert all(bool(torch.isfinite(p).all()) for p in fresh.parameters())
    assert "step_00000004: the weights of " in caplog.text and "holds values that are not finite" in caplog.text
    assert "step_00000003: the optimizer's exp_avg holds values that are not finite" in caplog.text
    # trained on from step 2, the run saves step 3 again: the one it passed over is set aside, not replaced
    with pytest.warns(UserWarning, match=r"set .*step_00000003 aside as step_00000003\.set-aside-\w+ to save in its "
                                         r"place, never deleting it: this run could not resume from it"):
        shardwire.save_checkpoint(shardwire.checkpoint_path(tmp_path, 3), fresh, fresh_optimizer, step=3)
    assert len([path for path in tmp_path.iterdir() if path.name.startswith("step_00000003.set-aside-")]) == 1
    assert shardwire.load_checkpoint(shardwire.checkpoint_path(tmp_path, 4), fresh).step == 4  # asked for by name


@pytest.mark.slow
def test_a_diverging_run_stops_naming_the_step_and_keeps_what_was_finite(tmp_path):
    """A learning rate that warms up to far too high: the run stops at the first step whose loss spiked
    (or was not finite), saving nothing after it, and names the checkpoint before it."""
    done = train("--lr", "5", "--weight-decay", "0", "--warmup", "10", "--steps", "30", "--checkpoint-dir", "ckpt",
                 "--save-every", "2", "--keep", "2", cwd=tmp_path, check=False)
    assert done.returncode != 0
    message = next(line for line in done.stderr.splitlines() if "diverged" in line)
    step = int(re.search(r" at step (\d+) ", message)[1])
    saved = list_checkpoints(tmp_path / "ckpt")
    assert saved and all(int(path.name.split("_")[1]) < step for path in saved)
    assert f"({saved[-1].relative_to(tmp_path)} " in message
    assert "and nothing after it was saved): lower --lr (now 5) or raise --warmup (now 10)" in message
    for path in saved:
        weights = read_state_dict(path)
        assert all(torch.isfinite(value).all() for value in weights.values())


@pytest.mark.slow
def test_weights_that_diverge_after_a_save_never_prune_the_checkpoint_before_them(tmp_path):
    """The loss that shows an update diverged is computed from weights already saved: that checkpoint
    is moved out of the series, and --keep pruned nothing a loss had not vouched for."""
    train("--steps", "6", "--checkpoint-dir", "ckpt", "--keep", "1", cwd=tmp_path)
    done = train("--steps", "20", "--checkpoint-dir", "ckpt", "--save-every", "1", "--keep", "1", "--lr", "30",
                 "--weight-decay", "0", cwd=tmp_path, check=False)
    message = done.stderr.strip().splitlines()[-1]
    step = int(re.search(r" at step (\d+) ", message)[1])
    assert [path.name for path in list_checkpoints(tmp_path / "ckpt")] == [f"step_{step - 2:08d}"], message
    assert f"were moved out of the series as step_{step - 1:08d}.diverged" in message
    assert (tmp_path / "ckpt" / f"step_{step - 1:08d}.diverged" / "manifest.json").is_file()


@pytest.mark.slow
def test_a_refusal_is_not_restarted(tmp_path):
    """--max-restarts restarted workers that had stopped the run as diverged: each restart resumed
    the last good checkpoint with the same settings, diverged again and set aside another copy."""
    done = train("--steps", "30", "--checkpoint-dir", "ckpt", "--save-every", "1", "--lr", "30", "--warmup", "1",
                 "--weight-decay", "0", "--log-every", "1", "--max-restarts", "2", cwd=tmp_path, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("training diverged") == 1 and "starting them again" not in done.stderr, done.stderr
    assert len([path for path in (tmp_path / "ckpt").iterdir() if ".diverged" in path.name]) == 1


@pytest.mark.slow
def test_a_loss_that_stays_far_above_where_it_started_is_divergence_and_prunes_nothing(tmp_path):
    """No single loss spikes 10 times its recent mean, but the resumed run's losses sit at several
    times the loss of the checkpoint it resumed: stopped, its own checkpoints set aside, the one it
    resumed kept."""
    train("--steps", "6", "--checkpoint-dir", "ckpt", "--keep", "1", cwd=tmp_path)
    done = train("--steps", "40", "--checkpoint-dir", "ckpt", "--save-every", "2", "--keep", "1", "--log-every", "1",
                 "--lr", "0.5", "--warmup", "1", "--weight-decay", "0", cwd=tmp_path, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    message = done.stderr.strip().splitlines()[-1]
    assert re.match(r"error: training diverged: the mean of the last 5 logged losses climbed to [\d.]+ at step \d+, "
                    r"over 2 times the loss of the model the run started from, [\d.]+ \(ckpt/step_00000006 is the "
                    r"newest checkpoint: the weights saved after it had diverged, and were moved out of the series as "
                    r"step_00000008.diverged, .*\): lower --lr \(now 0.5\)$", message), message
    assert [path.name for path in list_checkpoints(tmp_path / "ckpt")] == ["step_00000006"]
    assert (tmp_path / "ckpt" / "step_00000008.diverged" / "manifest.json").is_file()


@pytest.mark.slow
def test_a_climb_leaves_as_many_checkpoints_as_keep_promised(tmp_path):
    """The checkpoints saved while the loss climbed counted towards --keep and pruned the good ones
    before them; once the climb set them aside, fewer than --keep were left."""
    train("--steps", "6", "--checkpoint-dir", "ckpt", "--save-every", "3", "--keep", "2", cwd=tmp_path)
    done = train("--steps", "40", "--checkpoint-dir", "ckpt", "--save-every", "1", "--keep", "2", "--log-every", "1",
                 "--lr", "0.5", "--warmup", "1", "--weight-decay", "0", cwd=tmp_path, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "climbed to" in done.stderr.strip().splitlines()[-1], done.stderr[-3000:]
    assert [path.name for path in list_checkpoints(tmp_path / "ckpt")] == ["step_00000003", "step_00000006"]


@pytest.mark.slow
def test_a_climb_after_keep_pruned_is_one_line_and_sets_aside_what_is_left(tmp_path):
    """A climb found after --keep has pruned this run's early checkpoints: the ones left are set
    aside (the first among them, spared by --keep as the nearest to the fresh model's lowest loss),
    and those pruned are not looked for."""
    done = train("--steps", "40", "--save-every", "1", "--keep", "1", "--log-every", "1", "--lr", "0.5", "--warmup",
                 "1", "--weight-decay", "0", "--checkpoint-dir", "ckpt", cwd=tmp_path, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("error: training diverged: the mean of the last 5 logged losses climbed to "), message
    assert list_checkpoints(tmp_path / "ckpt") == []
    aside = sorted(path.name for path in (tmp_path / "ckpt").iterdir() if path.name.endswith(".diverged"))
    assert len(aside) == 3 and aside[0] == "step_00000001.diverged", message
    assert f"moved out of the series as {', '.join(aside)})" in message, message


@pytest.mark.slow
def test_a_final_sync_that_diverges_is_not_saved_over_the_last_good_checkpoint(tmp_path):
    """DiLoCo's final sync follows the last training loss: the validation loss vouches for it."""
    diloco = ("--layout", "hybrid", "--shard-group-size", "1", "--warmup", "0", "--checkpoint-dir", "ckpt",
              "--keep", "1")
    train("--steps", "3", *diloco, "--diloco", "sync_every=3", cwd=tmp_path)
    done = train("--steps", "6", *diloco, "--diloco", "sync_every=3,outer_lr=10,momentum=0.99", "--lr", "0.3",
                 cwd=tmp_path, check=False)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith("error: training diverged: the validation loss after the "
                                                           "last step was "), done.stderr
    assert "moved out of the series as step_00000006.diverged): the run's final sync took an outer step" in done.stderr
    assert [path.name for path in list_checkpoints(tmp_path / "ckpt")] == ["step_00000003"]


@pytest.mark.slow
def test_a_resumed_run_says_what_it_changes_and_trains_with_it(tmp_path):
    train("--steps", "4", "--checkpoint-dir", "ckpt", "--save-every", "4", cwd=tmp_path)
    done = train("--steps", "8", "--lr", "1e-3", "--checkpoint-dir", "ckpt", "--log-every", "1",
                 "--log-jsonl", "log.jsonl", cwd=tmp_path)
    assert ("resuming from ckpt/step_00000004 (step 4, saved by 2 ranks); this run changes --steps 4 -> 8, "
            "--lr 0.003 -> 0.001") in done.stdout
    record = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])  # the first step after resuming
    assert record["step"] == 5 and record["lr"] == pytest.approx(1e-3 * 6 / 40)  # the new peak, 6 of 40 warmup steps
    np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint16).tofile(tmp_path / "ids.bin")
    done = train("--steps", "9", "--lr", "1e-3", "--checkpoint-dir", "ckpt", "--data", "ids.bin", cwd=tmp_path)
    assert "this run changes --steps 8 -> 9, --data (not given) -> ids.bin" in done.stdout, done.stdout


@pytest.mark.slow
def test_a_run_resumed_without_diloco_says_each_groups_inner_steps_are_not_kept(tmp_path):
    hybrid = ("--layout", "hybrid", "--shard-group-size", "1", "--checkpoint-dir", "ckpt")
    train("--steps", "4", "--save-every", "3", *hybrid, "--diloco", "sync_every=2", cwd=tmp_path)
    shutil.rmtree(tmp_path / "ckpt" / "step_00000004")  # the last, after the run's final sync: nothing dropped
    done = train("--steps", "4", *hybrid, cwd=tmp_path)
    assert ("resuming from ckpt/step_00000003 (step 3, saved by 2 ranks); this run changes --diloco sync_every=2 -> "
            "none (every group goes on from the model the groups agreed on at their last sync: the inner steps "
            "since, each group's own, are not kept)") in done.stdout, done.stdout


@pytest.mark.slow
def test_a_run_resumed_into_other_groups_says_each_groups_inner_steps_are_not_kept(tmp_path):
    """Two groups that synced every 4 steps, saved between syncs, resumed as one: the line named the
    group size alone. Saved at the run's last step, which ends with a sync, nothing is dropped."""
    diloco = ("--layout", "hybrid", "--diloco", "sync_every=4", "--checkpoint-dir", "ckpt")
    train("--steps", "3", "--save-every", "2", "--shard-group-size", "1", *diloco, cwd=tmp_path)
    done = train("--steps", "4", "--shard-group-size", "2", *diloco, cwd=tmp_path)
    assert "resuming from ckpt/step_00000003" in done.stdout and "are not kept" not in done.stdout, done.stdout
    shutil.rmtree(tmp_path / "ckpt" / "step_00000004")
    shutil.rmtree(tmp_path / "ckpt" / "step_00000003")
    done = train("--steps", "4", "--shard-group-size", "2", *diloco, cwd=tmp_path)
    assert ("resuming from ckpt/step_00000002 (step 2, saved by 2 ranks); this run changes --steps 3 -> 4, "
            "--shard-group-size 1 -> 2, and every group goes on from the model the groups agreed on at their last "
            "sync: the inner steps since, each group's own, are not kept") in done.stdout, done.stdout


@pytest.mark.slow
def test_a_signal_as_a_finished_run_ends_leaves_it_a_success(tmp_path, monkeypatch, capsys):
    """A signal that came as the workers were ending, their run trained, saved and exported, said
    "stopped" with status 143 and told the user to run again, which the export then refused."""
    from shardwire.cli import train as command
    from shardwire.launch import Stopped

    train("--steps", "2", "--checkpoint-dir", "ckpt", cwd=tmp_path)
    monkeypatch.chdir(tmp_path)

    def stopped_as_it_ends(*args, **kwargs):
        raise Stopped(signal.SIGTERM)

    monkeypatch.setattr(command, "launch_local", stopped_as_it_ends)
    assert main(["train", "--model", "tiny", "--steps", "2", "--checkpoint-dir", "ckpt"]) == 0
    assert capsys.readouterr().err.splitlines()[-1] == (
        "stopped by SIGTERM as the run ended: its 2 steps are trained and saved in ckpt/step_00000002")
    assert main(["train", "--model", "tiny", "--steps", "3", "--checkpoint-dir", "ckpt"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines()[-1] == (
        "stopped by SIGTERM: ckpt/step_00000002 is the newest checkpoint; running the same command again resumes "
        "from it")


@pytest.mark.parametrize("saved_before", [False, True])
def test_workers_a_signal_ends_mid_save_and_mid_export_leave_nothing(tmp_path, monkeypatch, capsys, saved_before):
    """torchrun ends its workers with SIGTERM, so a save's temporary directory and an export's stage
    they were writing stayed, and with them the new --checkpoint-dir: their launcher tidies them. A
    series that holds a checkpoint already keeps it, and its directory, and loses the part alone."""
    from shardwire.cli import train as command
    from shardwire.engine.checkpoint import ownership
    from shardwire.engine.checkpoint.format import new_token, temporary_name
    from shardwire.files import claim_file
    from shardwire.launch import Stopped

    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 4, "n_positions": 64, "vocab_size": 256}))

    def stopped_mid_save(*args, **kwargs):  # what the workers leave, their processes gone
        series = tmp_path / "runs" / "ckpt"
        series.mkdir(parents=True)
        os.close(claim_file(series / ".shardwire-claim"))
        if saved_before:
            (series / "step_00000002").mkdir()
        token = new_token()
        ownership.create_marked(series / temporary_name("step_00000003", token), "step_00000003", token)
        stage = tmp_path / "out" / ".export.shardwire-partial"
        stage.mkdir(parents=True)
        os.close(claim_file(stage / ".shardwire-claim"))
        (stage / "model.safetensors").write_bytes(b"part of it")
        raise Stopped(signal.SIGTERM)

    monkeypatch.setattr(command, "launch_local", stopped_mid_save)
    assert main(["train", "--model", "hf:model", "--steps", "3", "--checkpoint-dir", "runs/ckpt",
                 "--export-hf", "out/export"]) == 128 + signal.SIGTERM
    if saved_before:
        assert capsys.readouterr().err.splitlines()[-1] == (
            "stopped by SIGTERM: runs/ckpt/step_00000002 is the newest checkpoint; running the same command again "
            "resumes from it")
        assert sorted(os.listdir(tmp_path / "runs" / "ckpt")) == [".shardwire-claim", "step_00000002"]
        return
    assert capsys.readouterr().err.splitlines()[-1] == "stopped by SIGTERM: no checkpoint was saved in runs/ckpt yet"
    assert sorted(os.listdir(tmp_path)) == ["model"], [str(p) for p in tmp_path.rglob("*")]


@pytest.mark.slow
@pytest.mark.parametrize("signum, status, said", [(signal.SIGINT, 130, "interrupted"),
                                                  (signal.SIGTERM, 143, "stopped by SIGTERM")])
def test_ctrl_c_ends_a_run_with_one_line_saying_what_was_saved(tmp_path, signum, status, said):
    """And a scheduler's SIGTERM, said as such, with the status a shell gives a process it ended."""
    job = subprocess.Popen([sys.executable, "-m", "shardwire", "train", "--model", "small", "--steps", "400",
                            "--checkpoint-dir", "ckpt", "--save-every", "2"], cwd=tmp_path, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list_checkpoints(tmp_path / "ckpt") and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(job.pid, signum)  # as a terminal's Ctrl-C (a scheduler's stop) reaches the launcher and its workers
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == status
    newest = list_checkpoints(tmp_path / "ckpt")[-1].relative_to(tmp_path)
    assert stderr.splitlines() == [f"{said}: {newest} is the newest checkpoint; running the same command "
                                   f"again resumes from it"]
    assert pathlib.Path(tmp_path / newest / "manifest.json").is_file()
