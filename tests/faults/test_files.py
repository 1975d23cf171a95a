"""Every file shardwire writes follows one policy (``shardwire.files``): whole or untouched, regular
files only (a device, FIFO, socket or directory named as an output is refused, never replaced, and
on the command line before any work), the mode a plain write would give, parent directories made;
a write the system stops (a full disk) is one line naming the file, with a refusal's status."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import warnings

import pytest
import torch

import shardwire
from harness import PROFILE, full_disk, run_workers, save_tokenizer  # noqa: F401 (a fixture)
from shardwire.cli import main
from shardwire.files import OutputRefused, StagedDirectory, WriteFailed, rewrite_problem, write_atomically
from shardwire.profile.trace import chrome_trace
from shardwire.training.data import load_corpus

FULL = "could not be written: No space left on device; free space there, or choose another place for it"



def test_a_failed_write_leaves_the_previous_file_whole_and_no_temporary(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("previous")

    class Unwritable(str):
        def encode(self):
            raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomically(path, Unwritable("new"))
    assert path.read_text() == "previous"
    assert os.listdir(tmp_path) == ["results.json"]
    write_atomically(path, "new", durable=True)
    assert path.read_text() == "new"
    assert os.listdir(tmp_path) == ["results.json"]


def special_files(directory) -> dict[str, str]:
    """What is not a regular file, one of each kind this machine lets us make -> how it is named."""
    made = {}
    os.mkdir(directory / "directory")
    made["directory"] = "a directory"
    os.mkfifo(directory / "fifo")
    made["fifo"] = "a FIFO"
    with socket.socket(socket.AF_UNIX) as unix:
        unix.bind(str(directory / "socket"))
    made["socket"] = "a socket"
    try:
        os.mknod(directory / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
        made["null"] = "a character device"
    except PermissionError:  # mknod needs root
        pass
    return made


def unchanged(directory, made) -> bool:
    kinds = {"directory": stat.S_ISDIR, "fifo": stat.S_ISFIFO, "socket": stat.S_ISSOCK, "null": stat.S_ISCHR}
    return all(kinds[name](os.lstat(directory / name).st_mode) for name in made)


def test_what_is_not_a_regular_file_is_refused_not_replaced(tmp_path):
    made = special_files(tmp_path)
    for name, kind in made.items():
        with pytest.raises(OutputRefused, match=f"{tmp_path / name} is {kind}(, not a regular file)?; give a file"):
            write_atomically(tmp_path / name, b"data")
    (tmp_path / "link").symlink_to(tmp_path / "fifo")
    with pytest.raises(OutputRefused, match="is a FIFO"):
        write_atomically(tmp_path / "link", b"data")
    assert unchanged(tmp_path, made) and (tmp_path / "link").is_symlink()
    assert sorted(os.listdir(tmp_path)) == sorted([*made, "link"])  # no temporary left
    read, write = os.pipe()  # /dev/stdout into a pipe: a link that names no path
    try:
        with pytest.raises(OutputRefused, match="is a FIFO"):
            write_atomically(f"/proc/self/fd/{write}", b"data")
    finally:
        os.close(read)
        os.close(write)


def test_a_written_file_has_the_umask_mode_or_keeps_its_own_and_parents_are_made(tmp_path):
    previous = os.umask(0o027)
    try:
        write_atomically(tmp_path / "new" / "deeper" / "file", "data")
        assert stat.S_IMODE(os.stat(tmp_path / "new" / "deeper" / "file").st_mode) == 0o640
        os.chmod(tmp_path / "new" / "deeper" / "file", 0o604)
        write_atomically(tmp_path / "new" / "deeper" / "file", "again", durable=True)
        assert stat.S_IMODE(os.stat(tmp_path / "new" / "deeper" / "file").st_mode) == 0o604
    finally:
        os.umask(previous)
    (tmp_path / "target").write_text("old")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    write_atomically(tmp_path / "link", "new")  # the file is written, the link stays
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target").read_text() == "new"


def _run(command: list[str], output, capsys) -> tuple[int, str]:
    """``command`` with ``output`` as its last argument: its status and what it said."""
    try:
        status = main([*command, str(output)])
    except SystemExit as exit:
        return 1, str(exit)
    return status, capsys.readouterr().err


@pytest.mark.parametrize("command", [
    ["bench", "--nproc", "2", "--ops", "all_reduce", "-b", "1K", "-e", "1K", "-w", "0", "-n", "1", "--json"],
    ["bench", "--nproc", "2", "--ops", "all_reduce", "-b", "1K", "-e", "1K", "-w", "0", "-n", "1", "--csv"],
    ["train", "--log-jsonl"],
    ["train", "--checkpoint-dir"],
    ["train", "--profile", "--run-dir"],
    ["simulate", "--model", "gpt2-125m", "--cluster", "a100-100gbe", "--sweep", "nodes=1,2", "--plot"],
])
def test_commands_refuse_an_output_that_is_not_a_regular_file_before_any_work(command, tmp_path, capsys):
    made = special_files(tmp_path)
    for name, kind in made.items():
        if command[-1] in ("--checkpoint-dir", "--run-dir") and name == "directory":
            continue
        status, message = _run(command, tmp_path / name, capsys)
        assert status != 0 and f"{tmp_path / name} is {kind}" in message, message
    assert unchanged(tmp_path, made)


@pytest.mark.parametrize("command", [
    ["bench", "--nproc", "2", "--ops", "all_reduce", "-b", "1K", "-e", "1K", "-w", "0", "-n", "1", "--json"],
    ["bench", "--nproc", "2", "--ops", "all_reduce", "-b", "1K", "-e", "1K", "-w", "0", "-n", "1", "--csv"],
    ["bench", "--nproc", "2", "--ops", "all_reduce", "-b", "1K", "-e", "1K", "-w", "0", "-n", "1", "--plot"],
    ["train", "--log-jsonl"],
    ["simulate", "--model", "gpt2-125m", "--cluster", "a100-100gbe", "--sweep", "nodes=1,2", "--plot"],
])
def test_a_result_made_again_replaces_only_its_own_never_weights_data_or_a_manifest(command, tmp_path, capsys):
    """A command's result replaces (the log: extends) its earlier self; a file of anything else at
    that name (model weights, token data, a checkpoint's manifest) is refused before any work."""
    theirs = {"model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ", "tokens.npy": b"\x93NUMPY\x01\x00",
              "manifest.json": b'{"format": "shardwire.checkpoint/1", "step": 2, "loss": 1.0}'}
    for name, data in theirs.items():
        (tmp_path / name).write_bytes(data)
        status, message = _run(command, tmp_path / name, capsys)
        assert status != 0 and f"{tmp_path / name} exists and is not " in message, message
        assert (tmp_path / name).read_bytes() == data


def test_a_plot_or_trace_of_the_users_own_is_never_taken_for_shardwires(tmp_path, capsys):
    """Every Matplotlib PNG names Matplotlib, and every Chrome trace opens with its events: a user's
    own was replaced by `--plot` and by a profiled run, and so was another command's plot. Each
    command's are marked as its own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = plt.figure()
    plt.plot([3, 1, 2])
    figure.savefig(tmp_path / "mine.png")
    plt.close(figure)
    mine = (tmp_path / "mine.png").read_bytes()
    sweep = ["simulate", "--model", "gpt2-125m", "--cluster", "a100-100gbe", "--sweep", "nodes=1,2", "--plot"]
    status, message = _run(sweep, tmp_path / "mine.png", capsys)
    assert status != 0 and "mine.png exists and is not a plot of `shardwire simulate --sweep`" in message, message
    assert (tmp_path / "mine.png").read_bytes() == mine
    assert _run(sweep, tmp_path / "ours.png", capsys)[0] == 0
    assert _run(sweep, tmp_path / "ours.png", capsys)[0] == 0  # its own, replaced
    run = tmp_path / "run"  # another command's plot, a report's timeline, is not the sweep's to replace
    run.mkdir()
    shutil.copyfile(PROFILE, run / "profile.json")
    assert main(["report", str(run), "--out", str(tmp_path / "plots")]) == 0
    timeline = next((tmp_path / "plots").glob("*timeline.png"))
    drawn = timeline.read_bytes()
    status, message = _run(sweep, timeline, capsys)
    assert status != 0 and "exists and is not a plot of `shardwire simulate --sweep`" in message, message
    assert timeline.read_bytes() == drawn
    trace = json.dumps({"traceEvents": [{"name": "mine", "ph": "X", "ts": 0, "dur": 5, "pid": 1, "tid": 1}]})
    assert rewrite_problem(_written(tmp_path / "trace.json", trace), "trace") == (
        "exists and is not a trace shardwire wrote, so it is left as it is: give another file name")
    ours = json.dumps(chrome_trace([]))
    assert rewrite_problem(_written(tmp_path / "trace.json", ours), "trace") is None


def _written(path, text: str):
    path.write_text(text)
    return path


def test_an_output_refused_inside_a_checkpoint_writes_nothing_there_first(tmp_path, capsys):
    """The check that a directory is writable made and removed a probe in it before the check that
    it lies in a checkpoint: a process killed between the two left an entry that kept the checkpoint
    from ever being pruned, and its mtime changed."""
    model = shardwire.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    checkpoint = shardwire.checkpoint_path(tmp_path / "ckpt", 1)
    shardwire.save_checkpoint(checkpoint, model, step=1).wait()
    before = os.stat(checkpoint).st_mtime_ns
    for argv in (["train", "--log-jsonl", f"{checkpoint}/log.jsonl"],
                 ["train", "--profile", "--run-dir", f"{checkpoint}/run"],
                 ["train", "--checkpoint-dir", f"{checkpoint}/more"],
                 ["simulate", "--model", "gpt2-125m", "--cluster", "a100-100gbe", "--sweep", "nodes=1,2", "--plot",
                  f"{checkpoint}/sweep.png"]):
        status, message = _run(argv[:-1], argv[-1], capsys)
        assert status != 0 and "inside" in message, message
    assert os.stat(checkpoint).st_mtime_ns == before


def test_a_run_directory_holding_something_else_where_the_profile_goes_is_refused(tmp_path):
    os.mkfifo(tmp_path / "profile.json")
    with pytest.raises(SystemExit, match=f"--run-dir: {tmp_path}/profile.json is a FIFO, not a regular file"):
        main(["train", "--profile", "--run-dir", str(tmp_path)])
    os.remove(tmp_path / "profile.json")
    (tmp_path / "profile.json").write_text("the user's notes")  # the run names the file: another directory is asked
    with pytest.raises(SystemExit, match=f"--run-dir: {tmp_path}/profile.json exists and is not a profile shardwire "
                                         f"wrote, so it is left as it is: give another --run-dir$"):
        main(["train", "--profile", "--run-dir", str(tmp_path)])


def test_no_output_goes_inside_a_checkpoint_which_stays_prunable(tmp_path, capsys):
    """A file put in a checkpoint makes it one no prune may delete (it holds what no save wrote): a
    command refuses an output there (the checkpoint, a directory in it, a link into it) before any
    work, and the checkpoint is pruned in its turn."""
    model = shardwire.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    series = tmp_path / "ckpt"
    shardwire.save_checkpoint(shardwire.checkpoint_path(series, 1), model, step=1).wait()
    checkpoint = shardwire.checkpoint_path(series, 1)
    held = sorted(os.listdir(checkpoint))
    run = tmp_path / "run"
    run.mkdir()
    shutil.copyfile(PROFILE, run / "profile.json")
    (tmp_path / "link").symlink_to(checkpoint)
    sweep = ["simulate", "--model", "gpt2-125m", "--cluster", "a100-100gbe", "--sweep", "nodes=1,2", "--plot"]
    for command, output in ((["report", str(run), "--out"], checkpoint / "plots"),
                            (["report", str(run), "--out"], checkpoint),
                            (["report", str(run), "--out"], tmp_path / "link" / "plots"),
                            (sweep, checkpoint / "sweep.png")):
        status, message = _run(command, output, capsys)
        where = "is" if output == checkpoint else f"is inside {os.path.realpath(checkpoint)},"
        assert status == 2 and f"{output} {where} a checkpoint, which holds only what its save wrote" in message \
            and message.count("\n") == 1, message
    assert sorted(os.listdir(checkpoint)) == held
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "kept ..., never deleting what it holds" would fail here
        shardwire.save_checkpoint(shardwire.checkpoint_path(series, 2), model, step=2, keep=1).wait()
    assert not checkpoint.exists()


def test_an_output_name_too_long_for_the_file_system_is_refused_before_any_work(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copyfile(PROFILE, run / "profile.json")
    sweep = ["simulate", "--model", "gpt2-125m", "--cluster", "a100-100gbe", "--sweep", "nodes=1,2", "--plot"]
    for command, output, said in (
            (["report", str(run), "--out"], tmp_path / ("n" * 300), "has a name of 300 bytes, where a name here is"),
            (["report", str(run), "--out"], tmp_path / "new" / ("n" * 300) / "plots", "has a name of 300 bytes"),
            (sweep, tmp_path / ("n" * 300 + ".png"), "has a name of 304 bytes"),
            (sweep, "/".join([str(tmp_path), *["d" * 200] * 30, "x.png"]), "bytes long, where a path here is under")):
        status, message = _run(command, output, capsys)
        assert status == 2 and said in message and message.count("\n") == 1 and len(message) < 400, message
    assert os.listdir(tmp_path) == ["run"]


def _save_a_checkpoint(rank, world, directory):
    model = shardwire.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    shardwire.save_checkpoint(shardwire.checkpoint_path(directory, 1), model, step=1)


@pytest.mark.slow
def test_export_writes_into_new_directories_and_never_over_a_device(tmp_path):
    run_workers(1, _save_a_checkpoint, str(tmp_path / "ckpt"))
    checkpoint = shardwire.checkpoint_path(tmp_path / "ckpt", 1)
    exported = shardwire.export_state_dict(checkpoint, tmp_path / "out" / "plain" / "model.pt")
    assert sorted(torch.load(exported)) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    made = special_files(tmp_path)
    for name in made:
        with pytest.raises(OutputRefused):
            shardwire.export_state_dict(checkpoint, tmp_path / name)
    assert unchanged(tmp_path, made)


@pytest.mark.root
def test_an_empty_mount_point_is_refused_as_a_new_directory_before_any_work(tmpfs):
    """A staged directory is renamed into place, which a mount point refuses (EBUSY): found at the
    end, after the run trained, it lost a run that kept no checkpoint."""
    with pytest.raises(OutputRefused, match=f"export directory {tmpfs} is a mount point, which a directory "
                                            f"cannot be renamed onto: give a new directory inside it"):
        StagedDirectory(tmpfs, "export directory")
    assert StagedDirectory(tmpfs / "model", "export directory").publish() == tmpfs / "model"
    assert os.listdir(tmpfs.parent) == [tmpfs.name]


def test_an_output_below_a_link_that_leads_nowhere_says_so(tmp_path):
    """A loop of links, or a link whose target is gone, on the way to an output: named as the link
    it is, where the system says "Too many levels of symbolic links" or fails at the claim."""
    from shardwire.files import directory_problem, output_problem

    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    for link in ("a", "dangling"):
        said = f"{tmp_path / link} is a symbolic link that leads nowhere (a loop, or its target is gone)"
        assert output_problem(tmp_path / link / "out.pt") == f"cannot be written: {said}"
        assert directory_problem(tmp_path / link / "run" / "x") == f"cannot be created: {said}"


def test_a_write_into_a_full_disk_is_one_line_naming_the_file_and_leaves_it_as_it_was(tmp_path, full_disk):
    path = tmp_path / "results.json"
    path.write_text("previous")
    for target, new in ((path, False), (tmp_path / "model.pt", True)):
        with pytest.raises(WriteFailed) as failed:
            write_atomically(target, "new results", durable=True, new=new)
        assert isinstance(failed.value, OutputRefused) and failed.value.errno == errno.ENOSPC
        assert str(failed.value) == f"{target} {FULL}"
    assert path.read_text() == "previous"
    assert os.listdir(tmp_path) == ["results.json"]  # no temporary left, nothing new made


def test_a_write_the_system_refuses_otherwise_names_no_space_to_free(tmp_path, monkeypatch):
    def read_only(source, target):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "replace", read_only)
    with pytest.raises(WriteFailed, match=r"^\S+/out.json could not be written: Read-only file system; choose another "
                                          r"place for it$"):
        write_atomically(tmp_path / "out.json", "data")
    assert os.listdir(tmp_path) == []


def test_a_report_into_a_full_disk_is_one_line_with_a_refusals_status(tmp_path, full_disk, capsys):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copyfile(PROFILE, run / "profile.json")
    assert main(["report", str(run), "--out", str(tmp_path / "plots")]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"error: {tmp_path / 'plots'}/") and said.endswith(f".png {FULL}\n")
    assert said.count("\n") == 1
    assert not (tmp_path / "plots").exists()  # a failed command leaves no directory it made


def test_a_token_cache_that_cannot_be_written_is_one_line_naming_it(tmp_path, full_disk):
    """The cache is not skipped: the run reads its ids from it, memory-mapped."""
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    save_tokenizer(tmp_path / "tokenizer")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 500)
    with pytest.raises(ValueError) as refused:
        load_corpus(str(text), seq_len=16, tokenizer=str(tmp_path / "tokenizer"))
    said = str(refused.value)
    assert said.startswith(f"--tokenizer: the ids of {text} go to {text}.tokens-") and "\n" not in said
    assert said.endswith(".npy, which could not be written: No space left on device; free space there, or copy the "
                         "text to a directory with room")
    assert sorted(os.listdir(tmp_path)) == ["text.txt", "tokenizer"]


def _profile_into_a_full_disk(rank, world, run_dir):
    """A profiled step on each rank, whose save meets a full disk on rank 0, the rank that writes."""
    from shardwire.profile import profiler

    if rank == 0:
        def full(path, data, **kwargs):
            raise WriteFailed(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

        profiler.write_atomically = full
    model = shardwire.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    profile = profiler.Profiler(model, optimizer, tokens_per_step=4, probe_peak=False, warmup_steps=0)
    with profile.step():
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    try:
        profile.save(run_dir)
    except WriteFailed as err:
        return str(err)
    return "saved"


@pytest.mark.slow
def test_a_profile_rank_0_cannot_write_fails_on_every_rank_so_none_waits_for_it(tmp_path):
    said = run_workers(2, _profile_into_a_full_disk, str(tmp_path / "run"))
    assert said == [f"{tmp_path / 'run' / 'profile.json'} {FULL}"] * 2


@pytest.fixture
def tmpfs(tmp_path):
    """An empty 100 KiB tmpfs mounted on a directory of ``tmp_path`` (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "mnt"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("a tmpfs cannot be mounted here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture
def filled_file_system(tmpfs):
    """A directory on a file system with no space left: ``tmpfs``, filled."""
    fd = os.open(tmpfs / "fill", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError, match="No space left on device"):
            while True:
                os.write(fd, bytes(4096))
    finally:
        os.close(fd)
    return tmpfs


@pytest.mark.slow
@pytest.mark.parametrize("command, output", [
    (["report", "RUN", "--out"], "plots"),
    (["bench", "--nproc", "2", "--ops", "all_reduce", "-b", "1K", "-e", "1K", "-w", "0", "-n", "1", "--json"],
     "b.json"),
])
def test_commands_writing_into_a_full_file_system_say_so_in_one_line(command, output, tmp_path, filled_file_system):
    """As a user meets it: the command itself, and bench's rank 0 under its launcher."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copyfile(PROFILE, run / "profile.json")
    command = [str(run) if word == "RUN" else word for word in command]
    done = subprocess.run([sys.executable, "-m", "shardwire", *command, str(filled_file_system / output)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.endswith(f" {FULL}\n"), done.stderr
    assert done.stderr.startswith(f"error: {filled_file_system / output}")
    left = [os.path.relpath(os.path.join(d, f), filled_file_system) for d, _, files in os.walk(filled_file_system)
            for f in files]
    assert left == ["fill"]  # no temporary, nothing half-written


def test_a_report_is_not_drawn_into_another_runs_directory(tmp_path, capsys):
    """`report p2 --out p1` replaced p1's plots with p2's, beside p1's profile, without a word."""
    first, second = tmp_path / "p1", tmp_path / "p2"
    for run in (first, second):
        run.mkdir()
        shutil.copyfile(PROFILE, run / "profile.json")
    assert main(["report", str(first)]) == 0
    drawn = {path.name: path.read_bytes() for path in first.glob("*.png")}
    capsys.readouterr()
    assert main(["report", str(second), "--out", str(first)]) == 2
    assert capsys.readouterr().err == (f"error: --out {first} holds the profile of another run ({first}/profile.json), "
                                       f"whose plots these would replace or sit beside as if they were its own: give "
                                       f"another directory\n")
    assert {path.name: path.read_bytes() for path in first.glob("*.png")} == drawn
    assert main(["report", str(first), "--out", str(first)]) == 0  # its own run's directory


def test_a_report_without_out_names_the_run_directory_it_would_draw_into(tmp_path, capsys):
    """A plot's place taken by a user's file is named as what holds it, not an option not given."""
    run = tmp_path / "p1"
    run.mkdir()
    shutil.copyfile(PROFILE, run / "profile.json")
    (run / "timeline.png").write_text("mine")
    assert main(["report", str(run)]) == 2
    assert capsys.readouterr().err.startswith(f"error: RUN_DIR (where the plots go without --out): {run}/timeline.png ")
    assert (run / "timeline.png").read_text() == "mine"


def test_a_run_given_twice_to_report_is_said_so(tmp_path, capsys):
    """It was told the two runs had the same world size."""
    run = tmp_path / "p1"
    run.mkdir()
    shutil.copyfile(PROFILE, run / "profile.json")
    assert main(["report", str(run), str(run)]) == 2
    assert capsys.readouterr().err == f"error: {run} is given twice (under one name or two): give each run once\n"
