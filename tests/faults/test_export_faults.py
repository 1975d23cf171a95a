"""What an export writes goes through the one output policy (``shardwire.files``): OUT is new,
writable and outside the checkpoint, checked before any weight is read; a directory appears whole,
claimed for its writer, with the umask's mode, and what a killed export left is cleared by the next.
What is exported is what was trained: weights that fit the model named, finite, with the config an
``hf:`` checkpoint recorded; a series' damaged newest checkpoint is skipped as ``train`` skips it.
``train --export-hf`` is checked, and claimed, as the run starts."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file, load_model

import shardwire
from harness import byte_tokenizer, rewrite_manifest, run_workers, save_tokenizer
from shardwire.cli import main
from shardwire.files import OutputRefused, StagedDirectory, write_atomically
from shardwire.models.gpt import GPT, PRESETS, Block
from shardwire.training import loop
from shardwire.training.config import TrainConfig

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytestmark = pytest.mark.timeout(120)

GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 32, "vocab_size": 64,
        "activation_function": "gelu_new"}


def _save(directory: str, model, step: int, extra: dict) -> None:
    shardwire.save_checkpoint(shardwire.checkpoint_path(directory, step), model, step=step, extra=extra).wait()


def _make_checkpoints(rank, world, root):
    """A GPT series of two steps, one trained at a shorter sequence, one whose newest step is not
    finite, and an hf: checkpoint that records its config."""
    torch.manual_seed(0)
    model = shardwire.shard(GPT(PRESETS["tiny"]))
    _save(f"{root}/gpt", model, 1, {"model": "tiny"})
    _save(f"{root}/gpt", model, 2, {"model": "tiny"})
    short = shardwire.shard(GPT(dataclasses.replace(PRESETS["tiny"], seq_len=16)))
    _save(f"{root}/short", short, 1, {"model": "tiny", "settings": {"seq_len": 16}})  # as train --seq-len 16
    _save(f"{root}/diverged", model, 1, {"model": "tiny"})
    with torch.no_grad():
        next(model.parameters()).to_local().fill_(float("nan"))
    _save(f"{root}/diverged", model, 2, {"model": "tiny"})
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**GPT2))
    shardwire.shard(hf)
    for parameter in hf.parameters():
        with torch.no_grad():
            parameter.to_local().normal_()
    _save(f"{root}/hf", hf, 1, {"model": f"hf:{root}/gpt2-mini", "hf_config": GPT2})


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("exports")
    (root / "gpt2-mini").mkdir()
    (root / "gpt2-mini" / "config.json").write_text(json.dumps(GPT2))
    run_workers(1, _make_checkpoints, str(root))
    return root


@pytest.fixture
def work(made, tmp_path) -> pathlib.Path:
    """A copy of the checkpoints the test may change."""
    for name in ("gpt", "short", "diverged", "hf", "gpt2-mini"):
        shutil.copytree(made / name, tmp_path / name)
    return tmp_path


def export(capsys, *argv: str) -> tuple[int, str, str]:
    """The export's status, standard output and standard error, its warnings in it as the command
    writes them (here pytest records them)."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        status = main(["export", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, "".join(f"warning: {warning.message}\n" for warning in warned) + err


def refused(capsys, *argv: str) -> str:
    status, _, err = export(capsys, *argv)
    message = err.strip()
    assert status == 2 and message.startswith("error: ") and "\n" not in message and "Traceback" not in message, err
    return message


def test_an_out_directory_made_while_the_export_is_written_keeps_both(work, capsys, monkeypatch):
    """A directory the user made at OUT as the export was written (a run's --export-hf, at the end of
    hours of training) discarded the whole export: it is kept beside it, named."""
    from shardwire.models import export as writer

    write = writer._write_safetensors

    def and_the_user_meanwhile(*args, **kwargs):
        write(*args, **kwargs)
        (work / "out").mkdir()
        (work / "out" / "notes.txt").write_text("the user's")

    monkeypatch.setattr(writer, "_write_safetensors", and_the_user_meanwhile)
    assert refused(capsys, work / "hf", work / "out") == (
        f"error: OUT {work / 'out'} was made, or filled, while it was being written: what was written is kept as "
        f"{work / 'out-2'} instead; move it where it belongs")
    assert os.listdir(work / "out") == ["notes.txt"] and "config.json" in os.listdir(work / "out-2")


def test_an_export_into_the_data_its_run_reads_as_text_is_refused(tmp_path, capsys, monkeypatch):
    """`export CKPT txt/notes.md` wrote into the --data directory its checkpoint was trained on: the
    run's resume read the weights as text (84% of its data). Weights in a file of their own kind are
    not read, and may lie there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.md").write_text("hello world " * 500)
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block])
    shardwire.save_checkpoint(tmp_path / "ckpt", model, step=1,
                              extra={"model": "tiny", "settings": {"data": "txt"}}).wait()
    assert refused(capsys, "ckpt", "txt/notes.md") == (
        "error: OUT txt/notes.md is inside txt, the --data directory ckpt was trained on, whose .py, .txt, .md files "
        "are read as text: give a path outside it")
    assert export(capsys, "ckpt", "txt/model.safetensors")[0] == 0


def test_the_data_a_run_recorded_is_found_from_any_directory(tmp_path, capsys, monkeypatch):
    """A run given `--data txt` recorded the path as typed: an export run from another directory
    looked for txt there, and wrote into the run's data, which its resume read as text."""
    from shardwire.training.config import TrainConfig, training_settings

    (tmp_path / "run" / "txt").mkdir(parents=True)
    (tmp_path / "run" / "txt" / "a.md").write_text("hello world " * 500)
    monkeypatch.chdir(tmp_path / "run")
    settings = training_settings(TrainConfig(data="txt"))
    assert settings["data"] == str(tmp_path / "run" / "txt")
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block])
    shardwire.save_checkpoint(tmp_path / "run" / "ckpt", model, step=1,
                              extra={"model": "tiny", "settings": settings}).wait()
    monkeypatch.chdir(tmp_path)
    assert refused(capsys, "run/ckpt", "run/txt/notes.md") == (
        f"error: OUT run/txt/notes.md is inside {tmp_path / 'run' / 'txt'}, the --data directory run/ckpt was "
        f"trained on, whose .py, .txt, .md files are read as text: give a path outside it")


def test_an_out_of_a_dash_is_no_file_named_so(work, capsys, monkeypatch):
    monkeypatch.chdir(work)
    assert refused(capsys, work / "gpt", "-") == ("error: OUT - names no file (export does not write to standard "
                                                  "output): give a file name, such as model.safetensors")
    assert not (work / "-").exists()


def test_an_out_file_that_exists_is_never_overwritten(work, capsys):
    out = work / "model.safetensors"
    out.write_text("the user's")
    assert "exists: give a new file name (nothing is overwritten)" in refused(capsys, work / "gpt", out)
    assert out.read_text() == "the user's"


def test_the_library_export_refuses_a_file_that_exists_or_lies_inside_before_reading_a_weight(work, monkeypatch):
    """``export_state_dict`` holds the command's promise itself: refused at once, in one line saying
    what to do, the user's file as it was."""
    out = work / "model.pt"
    out.write_text("the user's")
    checkpoint = shardwire.checkpoint_path(work / "gpt", 2)
    monkeypatch.setattr("shardwire.engine.checkpoint.portable.weights_in", None)  # reading would fail
    with pytest.raises(OutputRefused, match=r"^\S+/model.pt exists: give a new file name \(nothing is overwritten\)$"):
        shardwire.export_state_dict(checkpoint, out)
    assert out.read_text() == "the user's"
    with pytest.raises(OutputRefused, match="model.pt is inside .*step_00000002, which is being exported: give a path "
                                            "outside it$"):
        shardwire.export_state_dict(checkpoint, checkpoint / "model.pt")


@pytest.mark.parametrize("inside", ["gpt/step_00000002/model.safetensors", "gpt/model.pt", "gpt/out"])
def test_an_out_inside_the_checkpoint_being_exported_is_refused(work, capsys, inside):
    before = sorted(p.relative_to(work) for p in (work / "gpt").rglob("*"))
    model = [] if inside.endswith((".safetensors", ".pt")) else ["--model", f"hf:{work}/gpt2-mini"]
    given = work / ("gpt/step_00000002" if "step" in inside else "gpt")
    assert "is being exported: give a path outside it" in refused(capsys, given, work / inside, *model)
    assert sorted(p.relative_to(work) for p in (work / "gpt").rglob("*")) == before


def test_an_out_beside_the_checkpoint_in_its_series_is_refused(work, capsys):
    """A run saving into the series would take OUT, named like a checkpoint, for one of its own (and
    set it aside), or prune around it."""
    message = refused(capsys, work / "gpt/step_00000002", work / "gpt/step_00000009")
    assert message.endswith("gpt/step_00000009 is inside " + str(work / "gpt") + ", a series of checkpoints, which the "
                            "runs saving into it name and prune: give a path outside it"), message
    assert not (work / "gpt/step_00000009").exists()


@pytest.mark.parametrize("out", ["gpt/step_00000009", "gpt/model.pt"])
def test_an_out_in_another_series_is_refused(work, capsys, out):
    """Not only the series of the checkpoint exported: any run saving into a series names and prunes
    what is in it."""
    message = refused(capsys, work / "short", work / out)
    assert message.endswith(f"{out} is inside {work / 'gpt'}, a series of checkpoints, which the runs saving into it "
                            f"name and prune: give a path outside it"), message
    assert not (work / out).exists()


def _link(path: pathlib.Path, to: pathlib.Path) -> pathlib.Path:
    """A link to a file that is not there: not a file that exists, nor one to write through."""
    path.symlink_to(to)
    return path


def _fifo(path: pathlib.Path) -> pathlib.Path:
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("make, said", [
    (lambda work: _fifo(work / "fifo"), "exists: give a new file name"),
    (lambda work: work / "gpt2-mini", "exists: give a new file name"),
    (lambda work: work / "gpt2-mini" / "config.json" / "model.pt", "is a file"),
    (lambda work: pathlib.Path("/proc/self/status"), "exists: give a new file name"),
    (lambda work: _link(work / "link.pt", work / "nowhere" / "model.pt"), "is a symbolic link: give a new file name"),
])
def test_an_out_that_cannot_be_a_new_file_is_one_line(work, capsys, make, said):
    assert said in refused(capsys, work / "gpt", make(work))


def test_a_file_given_as_the_checkpoint_is_named_for_what_it_is(work, capsys):
    """Not "no such checkpoint directory" for a path that is there: what it is, and what to give; a
    checkpoint's own file names the checkpoint. train's --checkpoint-dir says so of its own."""
    notes = work / "notes.txt"
    notes.write_text("the user's")
    assert refused(capsys, notes, work / "out.safetensors") == (
        f"error: {notes} is a file, not a checkpoint directory: give a directory a save wrote (a step_00000400 under "
        f"`shardwire train --checkpoint-dir`)")
    manifest = work / "gpt" / "step_00000002" / "manifest.json"
    assert refused(capsys, manifest, work / "out.safetensors") == (
        f"error: {manifest} is a file of a checkpoint, not a checkpoint directory: give the checkpoint that holds it, "
        f"{manifest.parent}")
    assert refused(capsys, "/dev/null", work / "out.safetensors").startswith(
        "error: /dev/null is a character device, not a checkpoint directory: give a directory a save wrote")
    assert not (work / "out.safetensors").exists() and notes.read_text() == "the user's"
    with pytest.raises(SystemExit, match=f"^error: --checkpoint-dir {notes} is a file; give it a directory$"):
        main(["train", "--checkpoint-dir", str(notes)])


def _trained_from_the_copy(work: pathlib.Path) -> pathlib.Path:
    """The directory of the hf: checkpoint's model, its copy in ``work`` recorded in its stead, for a
    test to damage."""
    model = work / "gpt2-mini"
    rewrite_manifest(work / "hf" / "step_00000001", lambda manifest: manifest["extra"].update(model=f"hf:{model}"))
    return model


def _sparse(path: pathlib.Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)  # read whole, it would be held whole


@pytest.mark.parametrize("damage, said", [
    (lambda config: config.symlink_to("/dev/zero"), "config.json is not a regular file"),
    (lambda config: os.mkfifo(config), "config.json is not a regular file"),
    (lambda config: _sparse(config, 3 << 30), "config.json is larger than 1,048,576 bytes"),
])
def test_an_hf_models_config_that_cannot_be_read_is_one_line_not_passed_over(work, capsys, damage, said):
    """The checkpoint records the config it trained with, but a model directory there whose config
    cannot be read (endless, a pipe, huge) is refused as train refuses it, naming the file, not passed
    over without a word; one that is gone leaves the recorded config to count."""
    model = _trained_from_the_copy(work)
    (model / "config.json").unlink()
    damage(model / "config.json")
    message = refused(capsys, work / "hf", work / "out")
    assert message.startswith(f"error: hf:{model}: {said}") and message.endswith(
        f"({work / 'hf' / 'step_00000001'} was trained as this model: mend its directory, which export reads too)")
    assert not (work / "out").exists()
    (model / "config.json").unlink()
    status, _, err = export(capsys, work / "hf", work / "out")
    assert status == 0 and err == "", err
    assert GPT2.items() <= json.loads((work / "out" / "config.json").read_text()).items()


def test_a_tokenizer_file_larger_than_any_is_refused_unread_leaving_no_directory_made(work, capsys):
    """transformers reads a tokenizer's JSON whole: one of 300 MiB (sparse) is refused naming it before
    it is read, and the export, which had staged OUT, leaves none of the directories made for it."""
    model = _trained_from_the_copy(work)
    save_tokenizer(model)
    _sparse(model / "tokenizer_config.json", 300 << 20)
    before = sorted(os.listdir(work))
    message = refused(capsys, work / "hf", work / "new" / "sub" / "out")
    assert message == (f"error: the tokenizer in {model}: tokenizer_config.json is 314,572,800 bytes, more than "
                       f"268,435,456, far more than any model's or tokenizer's .json file: is it damaged? save the "
                       f"model or tokenizer again")
    assert sorted(os.listdir(work)) == before


def test_long_names_export_and_the_current_directory_is_refused(work, capsys, monkeypatch):
    long = work / ("m" * 240 + ".safetensors")
    assert export(capsys, work / "gpt", long)[0] == 0 and long.is_file()
    directory = work / ("d" * 250)
    assert export(capsys, work / "hf", directory)[0] == 0 and (directory / "config.json").is_file()
    empty = work / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    assert "is the current directory: give a new directory" in refused(capsys, work / "hf", ".")
    assert empty.is_dir() and not any(empty.iterdir())


def test_weights_that_do_not_fit_the_model_named_are_refused_naming_the_key_and_shapes(work, capsys):
    message = refused(capsys, work / "gpt", work / "out.safetensors", "--model", "small")
    assert re.search(r"do not fit --model small: 'tok_emb.weight' is \[\d+, \d+\] in them and \[\d+, \d+\] "
                     r"in the model", message), message
    rewrite_manifest(work / "short" / "step_00000001", lambda manifest: manifest["extra"].update(model="x" * 5000))
    message = refused(capsys, work / "short" / "step_00000001", work / "out.safetensors")  # not a --model given
    assert message.startswith(f"error: {work / 'short' / 'step_00000001'} records its model as 'xxx")
    assert message.endswith("which names no model shardwire builds: give --model") and len(message) < 300, message
    rewrite_manifest(work / "short" / "step_00000001", lambda manifest: manifest["extra"].update(model="small"))
    message = refused(capsys, work / "short" / "step_00000001", work / "out.safetensors")  # no --model given
    assert "do not fit the model it records, small: 'tok_emb.weight' is" in message, message
    message = refused(capsys, work / "gpt", work / "out", "--model", f"hf:{work}/gpt2-mini")
    assert re.search(r"do not fit GPT2LMHeadModel: they have no 'transformer.wte.weight' \[64, 32\]", message), message
    assert not (work / "out").exists() and not list(work.glob(".out*"))


def test_a_preset_trained_at_another_sequence_length_exports_at_it(work, capsys):
    status, out, err = export(capsys, work / "short", work / "short.safetensors")
    assert status == 0, err
    assert load_file(work / "short.safetensors")["pos_emb.weight"].shape[0] == 16
    # labelled by its preset alone, the weights did not load into the preset's model: the note says how
    made = err.split("load into the model made at that length, ")[1].strip()
    assert "was trained at --seq-len 16, not tiny's 32" in err and made == (
        "GPT(dataclasses.replace(PRESETS['tiny'], seq_len=16))")
    load_model(eval(made, {"GPT": GPT, "PRESETS": PRESETS, "dataclasses": dataclasses}), work / "short.safetensors")


def test_another_name_whose_weights_fit_is_exported_with_a_note(work, capsys):
    status, _, err = export(capsys, work / "gpt", work / "out.pt", "--model", "tiny")
    assert status == 0 and "note" not in err


def test_weights_that_are_not_finite_are_never_exported_and_a_series_falls_back(work, capsys):
    message = refused(capsys, work / "diverged" / "step_00000002", work / "out.safetensors")
    assert "holds weights that are not finite" in message and "export an earlier checkpoint" in message
    assert not (work / "out.safetensors").exists()
    status, out, err = export(capsys, work / "diverged", work / "out.safetensors")
    assert status == 0 and "cannot export" in err and "step_00000002, skipping it" in err
    assert "exported" in out and "step_00000001" in out
    assert all(torch.isfinite(value).all() for value in load_file(work / "out.safetensors").values())


def test_a_damaged_newest_checkpoint_is_skipped_as_train_skips_it(work, capsys):
    newest = work / "gpt" / "step_00000002"
    weights = next(path for path in newest.iterdir() if path.suffix == ".safetensors")
    weights.write_bytes(weights.read_bytes()[:-8])  # cut short
    status, out, err = export(capsys, work / "gpt", work / "out.pt")
    assert status == 0 and "step_00000002, skipping it" in err and "step_00000001" in out


def test_a_series_damaged_alike_is_one_line_saying_why_once(work, capsys):
    """Each checkpoint skipped was a warning, and then the refusal said each reason again, in one
    long line: five lines for four checkpoints, each saying the same."""
    series = work / "damaged"
    shutil.copytree(work / "gpt", series)
    for checkpoint in series.glob("step_*"):
        (checkpoint / "manifest.json").write_text("damaged")
    message = refused(capsys, series, work / "out.pt")
    assert message.startswith(f"error: no checkpoint in {series} can be exported: all 2 (step_00000001 to "
                              f"step_00000002) fail as the newest does: ") and message.count("unreadable") == 1, message


def test_a_series_beside_a_users_manifest_json_is_exported_as_train_resumes_it(work, capsys):
    """A manifest.json that is no checkpoint's, beside a series' checkpoints: export took the directory
    for a checkpoint and refused it, where train resumes the series."""
    series = work / "beside"
    shutil.copytree(work / "gpt", series)
    (series / "manifest.json").write_text('{"the user\'s": 1}')
    status, out, err = export(capsys, series, work / "out.pt")
    assert status == 0 and "step_00000002" in out, err


def test_a_checkpoint_whose_manifest_is_of_another_step_is_skipped_as_train_skips_it(work, capsys):
    """A resealed manifest that records another step than its directory's name: train refuses to
    resume from it, and export wrote it out."""
    newest = work / "gpt" / "step_00000002"
    rewrite_manifest(newest, lambda manifest: manifest.update(step=2**70))
    status, out, err = export(capsys, work / "gpt", work / "out.pt")
    assert status == 0 and "step_00000001" in out
    assert f"{newest}: its manifest records step {2**70}, its name step 2" in err
    assert f"its manifest records step {2**70}, its name step 2" in refused(capsys, newest, work / "other.pt")
    assert not (work / "other.pt").exists()


def test_exports_get_the_umasks_mode(work, capsys):
    old = os.umask(0o022)
    try:
        assert export(capsys, work / "gpt", work / "out.safetensors")[0] == 0
        assert export(capsys, work / "hf", work / "out")[0] == 0
    finally:
        os.umask(old)
    assert (work / "out.safetensors").stat().st_mode & 0o777 == 0o644
    assert (work / "out").stat().st_mode & 0o777 == 0o755
    assert {path.stat().st_mode & 0o777 for path in (work / "out").iterdir()} == {0o644}


@contextlib.contextmanager
def writing(target: pathlib.Path):
    """Another process writing ``target`` (its stage claimed, a part written) until it is killed."""
    code = (f"import sys; from shardwire.files import StagedDirectory; s = StagedDirectory({str(target)!r}, 'OUT'); "
            f"(s.path / 'model.safetensors').write_bytes(b'half'); print(s.path, flush=True); sys.stdin.read()")
    writer = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield pathlib.Path(writer.stdout.readline().strip())
    finally:
        writer.kill()
        writer.wait()


def test_what_a_killed_export_left_is_cleared_and_a_live_one_is_not_taken(work, capsys):
    with writing(work / "out") as left:
        refusal = refused(capsys, work / "hf", work / "out")  # while it lives, it holds the directory
        assert "is being written by another run (process" in refusal
    assert left.exists()  # killed: what it wrote is left, and its lock gone with it
    assert export(capsys, work / "hf", work / "out")[0] == 0
    assert not left.exists() and sorted(p.name for p in (work / "out").iterdir())[0] == "config.json"

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = __import__("hashlib").sha256(socket.gethostname().encode()).hexdigest()[:8]
    stale = work / f".out.pt.{host}-{int(dead.stdout)}-{'0' * 16}.partial"
    stale.write_bytes(b"half")
    others = work / f".out.pt.00000000-{int(dead.stdout)}-{'0' * 16}.partial"  # another host's: not ours to judge
    others.write_bytes(b"half")
    assert export(capsys, work / "gpt", work / "out.pt")[0] == 0
    assert not stale.exists() and others.exists()


@pytest.mark.slow
def test_an_export_stopped_by_sigterm_removes_what_it_staged(work):
    """As a job's time limit stops it (timeout, SLURM, systemd): once its weights are staged."""
    code = ("import sys, time; from shardwire.models import export; from shardwire.cli import main\n"
            "written = export._write_safetensors\n"
            "def staged(*args):\n"
            "    written(*args); print('staged', flush=True); time.sleep(120)\n"
            "export._write_safetensors = staged\n"
            f"sys.exit(main(['export', {str(work / 'hf')!r}, {str(work / 'out')!r}]))")
    job = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline() == "staged\n", job.stderr.read()
        assert (work / ".out.shardwire-partial").is_dir()
        job.terminate()
        assert job.wait(timeout=60) == 128 + 15
    finally:
        job.kill()
    assert not (work / ".out.shardwire-partial").exists() and not (work / "out").exists()


def test_long_names_alike_in_their_first_bytes_are_staged_apart(tmp_path):
    """A temporary carries a long name cut short: two outputs whose names share their first 100 bytes
    (in any script) are written side by side, neither refused as the other's."""
    for stem in ("p" * 100, "é" * 50):
        first, second = (StagedDirectory(tmp_path / f"{stem}{end}", "OUT") for end in "AB")
        assert first.path != second.path
        for stage in (first, second):
            stage.discard()
    write_atomically(tmp_path / ("é" * 120), "a name of 240 bytes")


def test_a_directory_in_the_way_of_the_stage_is_not_removed(work, capsys):
    mine = work / ".out.shardwire-partial"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    assert "was not made by shardwire: move it" in refused(capsys, work / "hf", work / "out")
    assert (mine / "notes.txt").read_text() == "the user's"


def test_a_dcp_checkpoint_given_to_export_is_named_as_one(tmp_path, capsys):
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"\x80\x04N.")  # a pickle, as DCP writes it: never read
    (dcp / "__0_0.distcp").write_bytes(b"")
    assert refused(capsys, dcp, tmp_path / "out.safetensors", "--model", "tiny") == (
        f"error: {dcp} is a torch.distributed.checkpoint (DCP) checkpoint, not shardwire's: load it with dcp.load "
        f"(docs/checkpoints.md), only from a source you trust")


def test_an_hf_export_into_a_full_disk_names_out_and_what_to_do(work, capsys, monkeypatch):
    """Its stage, not OUT, was named, with the system's words alone."""
    from shardwire.models import export as writer

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer, "_write_safetensors", full)
    assert refused(capsys, work / "hf", work / "out") == (
        f"error: {work / 'out'} could not be written: No space left on device; free space there, or choose another "
        f"place for it")
    assert not (work / "out").exists() and not (work / ".out.shardwire-partial").exists()


def test_an_hf_config_of_a_dtype_no_model_is_built_in_exports_as_trained(work, capsys):
    """A config's dtype is the one its weights were saved in: training builds fp32 master weights
    whatever it names, and so does the export, which failed at the end of the run on an int8."""
    rewrite_manifest(shardwire.checkpoint_path(work / "hf", 1),
                     lambda manifest: manifest["extra"]["hf_config"].update(dtype="int8"))
    status, _, err = export(capsys, work / "hf", work / "out")
    assert status == 0, err
    assert json.loads((work / "out" / "config.json").read_text())["dtype"] == "float32"


@pytest.mark.parametrize("spelled", [None, "{made}/./gpt2-mini/", "gpt2-mini"])
def test_an_hf_export_uses_the_config_it_was_trained_with(made, work, capsys, monkeypatch, spelled):
    """However ``--model`` spells the directory the checkpoint names (relative, ``./``, a trailing
    slash), it is the model trained, and the config recorded is the one exported."""
    config = made / "gpt2-mini" / "config.json"  # the model directory the checkpoint names
    config.write_text(json.dumps({**GPT2, "activation_function": "relu"}))
    monkeypatch.chdir(made)
    model = [] if spelled is None else ["--model", "hf:" + spelled.format(made=made)]
    try:
        status, _, err = export(capsys, work / "hf", work / "out", *model)
    finally:
        config.write_text(json.dumps(GPT2))
    assert status == 0 and "was trained as" not in err
    assert "config has changed since" in err and "activation_function 'gelu_new' -> 'relu'" in err
    assert json.loads((work / "out" / "config.json").read_text())["activation_function"] == "gelu_new"


@pytest.mark.slow
def test_train_export_hf_writes_the_config_the_run_trained_with(tmp_path):
    """A config.json edited while the run trains does not label the weights it exports."""
    (tmp_path / "m").mkdir()
    config = tmp_path / "m" / "config.json"
    config.write_text(json.dumps(GPT2))
    torch.randint(0, 64, (20_000,), dtype=torch.int16).numpy().tofile(tmp_path / "ids.bin")
    run = subprocess.Popen([sys.executable, "-m", "shardwire", "train", "--model", "hf:m", "--data", "ids.bin",
                            "--steps", "40", "--log-every", "1", "--eval-batches", "1", "--export-hf", "out"],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in run.stdout:
            if line.startswith("step  2/"):
                config.write_text(json.dumps({**GPT2, "activation_function": "relu", "layer_norm_epsilon": 0.5}))
                break
        out, _ = run.communicate(timeout=300)
    finally:
        run.kill()
    assert run.returncode == 0, out
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (exported["activation_function"], exported["layer_norm_epsilon"]) == ("gelu_new", 1e-5)


def test_another_hf_directory_exports_only_the_architecture_trained(work, capsys):
    """A model directory elsewhere (the one trained moved) is the model trained where its config builds
    the same architecture; one whose activation differs fits the same shapes, and is refused."""
    elsewhere = work / "gpt2-mini" / "config.json"  # a copy: not the directory the checkpoint names
    status, _, err = export(capsys, work / "hf", work / "same", "--model", f"hf:{work / 'gpt2-mini'}")
    assert status == 0 and "was trained as" not in err, err
    elsewhere.write_text(json.dumps({**GPT2, "layer_norm_epsilon": 1e-5}))  # GPT-2's default, spelled out
    status, _, err = export(capsys, work / "hf", work / "spelled", "--model", f"hf:{work / 'gpt2-mini'}")
    assert status == 0 and "was trained as" not in err, err
    elsewhere.write_text(json.dumps({**GPT2, "activation_function": "gelu"}))
    message = refused(capsys, work / "hf", work / "other", "--model", f"hf:{work / 'gpt2-mini'}")
    assert "config differs from the one" in message and "activation_function 'gelu_new' -> 'gelu'" in message
    assert not (work / "other").exists()


def test_a_manifest_forged_to_another_dtype_is_refused_not_cast(work, capsys):
    def bfloat16(manifest):
        for flat in manifest["flats"]:
            flat["dtype"] = "bfloat16"

    rewrite_manifest(work / "gpt" / "step_00000002", bfloat16)  # resealed: only the dtype can refuse it
    refusal = refused(capsys, work / "gpt" / "step_00000002", work / "out.safetensors")
    assert "is float32 where the manifest implies bfloat16" in refusal
    assert not (work / "out.safetensors").exists()


@pytest.mark.parametrize("change, said", [
    ({"n_layer": 1_000_000_000}, "1,000,000,000 layers, more than 1,024"),
    ({"n_embd": -32}, "n_embd must be a whole number of at least 1, got -32"),
    ({"n_head": 0}, "n_head must be a whole number of at least 1, got 0"),
    ({"vocab_size": 64.5}, "vocab_size"),
    ({"n_layer": -1}, "n_layer must be a whole number of at least 1, got -1"),
    ({"n_head": 3}, "n_embd (32) must be a multiple of n_head (3)"),
])
def test_a_config_no_model_can_be_built_of_is_one_line_before_it_is_built(work, capsys, change, said):
    """Of a checkpoint that records no config (of an older shardwire), whose weights --model labels."""
    rewrite_manifest(work / "hf" / "step_00000001", lambda manifest: manifest["extra"].pop("hf_config"))
    config = json.dumps({**GPT2, **change})
    status, out, err = export(capsys, work / "hf", work / "out", "--model", f"hf:{config}")
    assert status == 2 and err.strip().count("\n") == 0 and said in err, err  # no warning before it either
    assert not (work / "out").exists()


def test_inline_json_longer_than_a_path_is_read_as_json(work, capsys):
    """As train and simulate read it: a config is no file name, however long."""
    config = json.dumps({**GPT2, "comment": "x" * 5000})
    message = refused(capsys, work / "gpt" / "step_00000002", work / "out", "--model", f"hf:{config}")
    assert "do not fit GPT2LMHeadModel" in message and "File name too long" not in message, message


def test_a_directory_named_for_one_file_is_refused(work, capsys):
    assert "names a directory, which is for hf: models" in refused(capsys, work / "gpt", f"{work / 'newdir'}/")
    assert not (work / "newdir").exists()


SIGNALLED_AS_IT_WRITES = """
import os, runpy, signal, sys
from shardwire.cli import export
def stopped_as_it_writes(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's, as the weights are written
    raise AssertionError("the signal did not stop the export")
export.save_pretrained = stopped_as_it_writes
sys.argv = ["shardwire", "export", *sys.argv[1:]]
runpy.run_module("shardwire", run_name="__main__")
"""


@pytest.mark.slow
def test_an_export_stopped_by_a_signal_says_so_and_leaves_nothing(work):
    """A SIGTERM as the weights were written ended the export with status 143 and no word."""
    import signal

    done = subprocess.run([sys.executable, "-c", SIGNALLED_AS_IT_WRITES, str(work / "hf"), str(work / "out")],
                          capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stderr) == (128 + signal.SIGTERM, "stopped by SIGTERM\n")
    assert not (work / "out").exists() and not list(work.glob(".out*"))


def test_a_file_name_for_an_hf_models_directory_is_refused(work, capsys):
    """It made a directory named out.safetensors."""
    message = refused(capsys, work / "hf", work / "out.safetensors")
    assert message.startswith(f"error: OUT {work / 'out.safetensors'} is named as a file (.safetensors), and hf:")
    assert message.endswith(f"exports a save_pretrained directory: give it a directory's name, such as {work / 'out'}")
    assert not (work / "out.safetensors").exists()


def test_an_export_inside_the_hf_model_directory_it_reads_is_refused(work, capsys):
    """train refused its --export-hf there; export wrote its weights and config into it."""
    model = work / "gpt2-mini"
    message = refused(capsys, work / "hf", model / "sub", "--model", f"hf:{model}")
    assert message == (f"error: OUT {model / 'sub'} is inside {model}, the model directory hf:{model} reads, which "
                       f"export never writes in: give a path outside it"), message
    assert sorted(os.listdir(model)) == ["config.json"]


def test_train_checks_and_claims_its_export_directory_as_it_starts(work, monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("workers were started")

    monkeypatch.setattr("shardwire.cli.train.launch_local", started)
    model = f"hf:{json.dumps(GPT2)}"
    under_a_file = work / "gpt2-mini" / "config.json" / "exported"
    with pytest.raises(SystemExit, match=re.escape(f"--export-hf {under_a_file} cannot be created")):
        main(["train", "--model", model, "--export-hf", str(under_a_file)])
    with pytest.raises(SystemExit, match="and --checkpoint-dir .* overlap: the export would hold what the run"):
        main(["train", "--model", model, "--checkpoint-dir", str(work / "x"), "--export-hf", str(work / "x")])
    with pytest.raises(SystemExit, match="overlap"):
        main(["train", "--model", model, "--checkpoint-dir", str(work / "x"), "--export-hf", str(work / "x" / "y")])
    # another run's series, as export refuses it
    with pytest.raises(SystemExit, match=re.escape(f"--export-hf {work / 'gpt' / 'mine'} is inside {work / 'gpt'}, a "
                                                   f"series of checkpoints, which the runs saving into it name and "
                                                   f"prune: give a path outside it")):
        main(["train", "--model", model, "--export-hf", str(work / "gpt" / "mine")])
    for flag, path in (("--run-dir", work / "x"), ("--log-jsonl", work / "x" / "log.jsonl"),
                       ("--tensorboard", work / "x" / "tb")):  # anything else the run writes
        with pytest.raises(SystemExit, match=f"and {flag} .* overlap"):
            main(["train", "--model", model, *(["--profile"] if flag == "--run-dir" else []), flag, str(path),
                  "--export-hf", str(work / "x")])
    from shardwire.cli.train import _check_settings

    for inside in ({"profile": True, "run_dir": str(work / "r")}, {"tensorboard": str(work / "r")}):
        # a new directory inside them holds none of their files
        _check_settings(TrainConfig(model=model, export_hf=str(work / "r" / "model"), **inside), {})
    with writing(work / "exported"):  # a run training towards it
        monkeypatch.delenv("RANK", raising=False)
        with pytest.raises(SystemExit, match=r"--export-hf .*exported is being written by another run \(process"):
            loop.train(TrainConfig(model=model, export_hf=str(work / "exported")))
    assert not (work / "exported").exists()


def test_write_atomically_keeps_its_promises_with_the_new_temporaries(tmp_path):
    target = tmp_path / "file.json"
    write_atomically(target, "{}")
    assert target.read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == ["file.json"]


def test_a_name_the_system_refuses_is_one_line_and_any_case_of_safetensors_is_safetensors(work, capsys):
    assert "has a name of 312 bytes, where a name here is at most" in refused(
        capsys, work / "gpt", work / ("a" * 300 + ".safetensors"))
    status, out, _ = export(capsys, work / "gpt", work / "x.SAFETENSORS")
    assert status == 0 and out.rstrip().endswith("(safetensors)") and load_file(work / "x.SAFETENSORS")
    status, out, _ = export(capsys, work / "gpt", work / "x.weights")
    assert status == 0 and out.rstrip().endswith("(torch.save: name it .safetensors for safetensors)")


def test_a_new_file_is_never_written_over_even_one_made_while_it_was_written(tmp_path):
    target = tmp_path / "model.safetensors"
    target.write_text("the user's, made while the export ran")
    with pytest.raises(OutputRefused, match="exists: it was made while this was written, and nothing was overwritten"):
        write_atomically(target, b"weights", new=True)
    assert target.read_text() == "the user's, made while the export ran" and len(list(tmp_path.iterdir())) == 1
    write_atomically(tmp_path / "fresh.bin", b"weights", new=True)
    assert (tmp_path / "fresh.bin").read_bytes() == b"weights" and len(list(tmp_path.iterdir())) == 2


def test_a_checkpoint_pruned_while_it_is_read_is_passed_over_for_the_newest(work, capsys, monkeypatch):
    """A run saving with --keep deletes the checkpoint an export picked as newest: the export lists
    the series again and exports the newest there is, as if it had started a moment later."""
    from shardwire.cli import export as command
    from shardwire.engine.checkpoint import CheckpointError

    reading = command._export

    def pruned_first(checkpoint, *args):
        if checkpoint.name == "step_00000002":
            shutil.rmtree(checkpoint)
            raise CheckpointError(f"{checkpoint}: no such checkpoint directory")
        return reading(checkpoint, *args)

    monkeypatch.setattr(command, "_export", pruned_first)
    status, out, err = export(capsys, work / "gpt", work / "newest.safetensors")
    assert status == 0 and err == "", err
    assert f"exported {work / 'gpt' / 'step_00000001'}" in out


@pytest.mark.slow
def test_the_tokenizer_trained_with_is_the_one_exported_or_none_is(tmp_path):
    """``--tokenizer`` made the ids, not the model directory's own; a checkpoint's tokenizer changed
    since is not written beside weights it did not train."""
    model = tmp_path / "m"
    byte_tokenizer(model, 0)
    (model / "config.json").write_text(json.dumps({**GPT2, "vocab_size": 256}))
    byte_tokenizer(tmp_path / "other", 7)
    (tmp_path / "text.txt").write_text("hello world " * 2000)
    train = [sys.executable, "-m", "shardwire", "train", "--model", "hf:m", "--data", "text.txt", "--steps", "2",
             "--eval-batches", "1"]
    done = subprocess.run([*train, "--tokenizer", "other", "--export-hf", "out"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out/tokenizer.json").read_bytes() == (tmp_path / "other/tokenizer.json").read_bytes()
    done = subprocess.run([*train, "--checkpoint-dir", "ckpt"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    (model / "README.md").write_text("fine-tuned on my notes")  # a note beside it leaves the tokenizer the same
    done = subprocess.run([sys.executable, "-m", "shardwire", "export", "ckpt", "kept"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "has changed since" not in done.stderr, done.stderr
    assert (tmp_path / "kept/tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    shutil.copy(tmp_path / "other/tokenizer.json", model / "tokenizer.json")  # the directory's tokenizer replaced
    done = subprocess.run([sys.executable, "-m", "shardwire", "export", "ckpt", "again"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"note: the tokenizer ckpt/step_00000002 was trained with, {model}, has changed since or is gone: " \
           f"exported without a tokenizer" in done.stderr
    assert not (tmp_path / "again/tokenizer.json").exists()


def test_a_tokenizer_is_known_by_its_own_files_and_by_the_digest_earlier_versions_recorded(tmp_path):
    """A README or the weights beside a model's tokenizer are not the tokenizer; a checkpoint that
    recorded a digest of every file of the directory still finds its tokenizer there."""
    from shardwire.models import tokenizer as hf_tokenizer

    byte_tokenizer(tmp_path, 0)
    (tmp_path / "config.json").write_text(json.dumps(GPT2))
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    earlier, now = hf_tokenizer.digest_of(tmp_path, every_file=True), hf_tokenizer.digest_of(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"weights trained on")
    (tmp_path / "README.md").write_text("notes")
    assert hf_tokenizer.digest_of(tmp_path) == now and hf_tokenizer.holds(tmp_path, now)
    assert not hf_tokenizer.holds(tmp_path, earlier)  # every file, the weights too: changed since
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "README.md").unlink()
    assert hf_tokenizer.holds(tmp_path, earlier)
    (tmp_path / "config.json").write_text(json.dumps({**GPT2, "model_type": "bert"}))  # picks the tokenizer's class
    assert not hf_tokenizer.holds(tmp_path, now)
    (tmp_path / "config.json").write_text(json.dumps(GPT2))
    (tmp_path / "merges.txt").write_text("a b")  # a file of a kind not listed is taken for the tokenizer's
    assert not hf_tokenizer.holds(tmp_path, now)


@pytest.mark.slow
def test_a_tokenizer_export_hf_cannot_read_is_one_line_before_the_run(tmp_path):
    """Token ids need no tokenizer to train, but the export writes one: read at the start, not after
    the run."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m/config.json").write_text(json.dumps(GPT2))
    (tmp_path / "m/tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    (tmp_path / "m/tokenizer.json").write_text('{"broken": ')
    torch.randint(0, 64, (20_000,), dtype=torch.int16).numpy().tofile(tmp_path / "ids.bin")
    done = subprocess.run([sys.executable, "-m", "shardwire", "train", "--model", "hf:m", "--data", "ids.bin",
                           "--steps", "2", "--export-hf", "out"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        "error: --export-hf: the tokenizer in hf:m: transformers cannot read it (Expecting value"), done.stderr
    # a tokenizer of custom code: transformers would load the model type's class for it, but the export would
    # carry an auto_map naming code it does not hold
    byte_tokenizer(tmp_path / "m", 0)
    config = json.loads((tmp_path / "m/tokenizer_config.json").read_text())
    (tmp_path / "m/tokenizer_config.json").write_text(json.dumps({**config, "auto_map": {"AutoTokenizer": ["t.T", None]}}))
    (tmp_path / "m/config.json").write_text(json.dumps({**GPT2, "vocab_size": 256}))
    done = subprocess.run([sys.executable, "-m", "shardwire", "train", "--model", "hf:m", "--data", "ids.bin",
                           "--steps", "2", "--export-hf", "out"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1].startswith("error: --export-hf: the tokenizer in hf:m: it needs custom code"), \
        done.stderr


@pytest.mark.slow
def test_a_diloco_checkpoint_between_syncs_says_which_model_is_exported(tmp_path, capsys):
    done = subprocess.run([sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--steps", "4", "--nproc", "2",
                           "--layout", "hybrid", "--shard-group-size", "1", "--diloco", "sync_every=3",
                           "--checkpoint-dir", "ckpt", "--save-every", "2", "--eval-batches", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    status, _, err = export(capsys, tmp_path / "ckpt/step_00000002", tmp_path / "two.pt")
    assert status == 0 and err == (f"note: {tmp_path}/ckpt/step_00000002 was saved at step 2, between syncs of --diloco "
                                   f"(every 3 steps): exported is the model the groups last agreed on, without the "
                                   f"steps each trained since\n")
    status, _, err = export(capsys, tmp_path / "ckpt", tmp_path / "last.pt")  # the run ended with a sync
    assert status == 0 and err == ""


def _a_worker_of_two(monkeypatch, rank: int) -> None:
    """This process as torchrun's worker ``rank`` of 2, left bound to the test's parent."""
    for name, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2,
                        "MASTER_ADDR": "localhost", "MASTER_PORT": 29500}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr("shardwire.cli.die_with_launcher", lambda: None)


def test_under_torchrun_rank_0_exports_and_the_other_ranks_leave_done(work, capsys, monkeypatch):
    """Every rank exported: rank 0 wrote OUT, and rank 1 then refused it as a file that exists (or
    raced rank 0 for it), failing a job whose export had succeeded. An export is one process's work."""
    out = work / "model.pt"
    _a_worker_of_two(monkeypatch, 1)
    assert export(capsys, work / "gpt", out) == (0, "", "")
    assert not out.exists()
    _a_worker_of_two(monkeypatch, 0)
    status, said, _ = export(capsys, work / "gpt", out)
    assert status == 0 and said == f"exported {work}/gpt/step_00000002 (tiny) to {out} (torch.save)\n", said
    assert torch.load(out, weights_only=True).keys() == GPT(PRESETS["tiny"]).state_dict().keys()


@pytest.mark.slow
def test_torchrun_of_export_writes_out_once_and_succeeds(work):
    """What the user ran: two workers, one export, one line, and torchrun's status 0 (not its
    ChildFailedError traceback for the rank that found OUT written)."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "shardwire", "export", "gpt", "model.pt"], cwd=work, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr and "error" not in done.stderr, done.stderr
    assert done.stdout == "exported gpt/step_00000002 (tiny) to model.pt (torch.save)\n", done.stdout
    assert torch.load(work / "model.pt", weights_only=True).keys() == GPT(PRESETS["tiny"]).state_dict().keys()


@pytest.mark.slow
def test_ctrl_c_as_the_run_exports_is_one_line_and_leaves_no_directory(tmp_path):
    """A terminal's Ctrl-C reaches every worker: rank 0, stopped while it wrote, took part in the
    gathers the writer had not reached, and said the collective failure its stopped peer caused."""
    (tmp_path / "gpt2.json").write_text(json.dumps({**GPT2, "vocab_size": 256, "n_layer": 4, "n_embd": 128}))
    job = subprocess.Popen([sys.executable, "-m", "shardwire", "train", "--model", "hf:gpt2.json", "--steps", "2",
                            "--batch", "2", "--eval-batches", "1", "--export-hf", "out"], cwd=tmp_path, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for line in job.stdout:
            if line.startswith("done:"):
                os.killpg(job.pid, signal.SIGINT)  # as a terminal sends it: to the launcher and its workers
                break
        _, errors = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 130 and errors.strip().splitlines()[-1].startswith("interrupted"), errors
    assert "error:" not in errors and not (tmp_path / "out").exists(), errors
