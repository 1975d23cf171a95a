"""Input is bounded: a config or spec is read up to a size, YAML's aliases cannot expand a few
hundred bytes into billions of values, an error never prints an unbounded value, and sizes that no
worker of this machine can hold are refused in one line before any worker starts."""

from __future__ import annotations

import os
import types

import pytest
import torch

from shardwire.cli import main
from shardwire.mappings import MAX_TEXT_BYTES
from shardwire.testbed import spec

pytestmark = pytest.mark.timeout(30)  # each case is refused at once; the unbounded ones ran for minutes


def alias_bomb(key: str) -> str:
    """A "billion laughs" as ``key``'s value: ten levels of nine aliases each, 9**10 values from
    about 400 bytes, which an error message showing the value would print in full."""
    levels = ['&a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    return f"{key}: [{', '.join(levels)}]"


def refusal(argv: list[str], capsys) -> str:
    """The one line ``shardwire`` ends ``argv`` with, failing."""
    try:
        status = main(argv)
    except SystemExit as exit:
        status, message = 1, str(exit)
    else:
        message = capsys.readouterr().err.strip()
    assert status != 0 and "\n" not in message, message
    return message


def test_an_alias_bomb_is_refused_at_once(tmp_path, capsys):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb("steps"))
    assert os.path.getsize(bomb) < 1000
    assert "expands through its YAML aliases (*name) to over 100,000 values" in refusal(
        ["train", "--config", str(bomb)], capsys)
    assert "expands through its YAML aliases" in refusal(
        ["simulate", "--model", "{" + alias_bomb("hidden") + "}", "--cluster", "a100-100gbe"], capsys)
    recursive = tmp_path / "recursive.yaml"
    recursive.write_text("ops: &ops [all_gather, *ops]\n")
    assert "refers to a collection from inside itself" in refusal(["bench", "--config", str(recursive)], capsys)


def test_files_are_read_up_to_a_bound_and_never_wait_for_a_writer(tmp_path, capsys):
    assert "--config /dev/zero is a character device, not a file: give the file that holds it" in refusal(
        ["train", "--config", "/dev/zero"], capsys)
    huge = tmp_path / "cluster.yaml"
    huge.write_text("nodes: 2\n" + "#" * MAX_TEXT_BYTES)
    assert "is larger than" in refusal(["simulate", "--model", "gpt2-125m", "--cluster", str(huge)], capsys)
    os.mkfifo(tmp_path / "fifo")
    assert f"--config {tmp_path / 'fifo'} is a FIFO that nothing was written to" in refusal(["bench", "--config", str(tmp_path / "fifo")], capsys)
    assert "is a character device, not a file" in refusal(["simulate", "--model", "gpt2-125m", "--cluster",
                                                            "a100-100gbe", "--cluster-from", "/dev/zero"], capsys)
    assert "--data: data path /dev/zero is neither a regular file nor a directory" in refusal(
        ["train", "--data", "/dev/zero"], capsys)
    run = tmp_path / "run"
    run.mkdir()
    (run / "profile.json").symlink_to("/dev/zero")
    assert f"{run}/profile.json is a character device, not a file" in refusal(["report", str(run)], capsys)
    os.unlink(run / "profile.json")
    os.mkfifo(run / "profile.json")
    assert f"{run}/profile.json is a FIFO that nothing was written to" in refusal(["report", str(run)], capsys)
    assert (f"{run}/profile.json is not a directory: give the run directory that holds it, {run}"
            in refusal(["report", str(run / "profile.json")], capsys))


def test_a_hugging_face_directory_is_read_within_bounds(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "config.json")
    assert f"hf:{model}: config.json is not a regular file" in refusal(["train", "--model", f"hf:{model}"], capsys)
    (model / "config.json").unlink()
    (model / "config.json").symlink_to("/dev/zero")
    assert "config.json is not a regular file" in refusal(["train", "--model", f"hf:{model}"], capsys)
    empty = '{"model_type": "gpt2", "n_layer": 0, "n_embd": 64, "n_head": 4, "vocab_size": 256}'
    assert "n_layer must be a whole number of at least 1, got 0" in refusal(  # not a --units at fault
        ["train", "--model", f"hf:{empty}"], capsys)
    deep = '{"model_type": "gpt2", "n_layer": 100000, "n_embd": 64, "n_head": 4, "vocab_size": 256}'
    assert "100,000 layers, more than 1,024" in refusal(["train", "--model", f"hf:{deep}"], capsys)
    wide = '{"model_type": "gpt2", "n_layer": 4, "n_embd": 65536, "n_head": 4, "vocab_size": 256}'
    assert ("hf:GPT2LMHeadModel has 206,245,855,232 parameters, 192 GiB of them in fp32 held whole on each worker "
            "while it builds its largest unit and root") in refusal(["train", "--model", f"hf:{wide}"], capsys)


@pytest.mark.slow
def test_an_error_shows_a_value_cut_short(tmp_path, capsys):
    config = tmp_path / "job.yaml"
    config.write_text(f"model: [{', '.join(['x' * 1000] * 1000)}]\n")
    assert len(refusal(["train", "--config", str(config)], capsys)) < 300
    config.write_text(f"layout: {'y' * 100_000}\n")
    assert len(refusal(["train", "--config", str(config)], capsys)) < 400
    assert len(refusal(["simulate", "--model", "{hidden: [" + "1, " * 100_000 + "1]}", "--cluster",
                        "a100-100gbe"], capsys)) < 300


def test_nesting_too_deep_to_read_is_one_line(tmp_path, capsys):
    config = tmp_path / "deep.json"
    config.write_text("[" * 100_000 + "]" * 100_000)
    assert "nests deeper than it can be read" in refusal(["train", "--config", str(config)], capsys)


@pytest.mark.parametrize("argv, message", [
    (["bench", "-e", "1000T"], "--max-bytes 1,099,511,627,776,000 is more than a worker here can hold"),
    (["bench", "--nproc", "100000"], "100,000 workers take over"),
    (["train", "--batch", "1000000000000"], "--batch 1000000000000 sequences of 128 tokens need"),
    (["train", "--seq-len", "10000000"], "--batch 16 sequences of 10000000 tokens need"),
    (["train", "--nproc", "100000"], "100,000 workers take over"),
    (["train", "--seed", str(2**64)], "--seed must be at most 18,446,744,073,709,551,615"),
    (["train", "--timeout", "1e300"], "--timeout must be at most 31,536,000 seconds"),
    (["bench", "--timeout", "1e300"], "--timeout must be at most 31,536,000 seconds"),
    (["train", "--wire", f"grads=int8,block={10**30}"], "--wire block must be a positive integer of at most"),
])
def test_sizes_no_worker_here_can_hold_are_refused(argv, message, capsys):
    assert message in refusal(argv, capsys)


def test_on_gpus_each_worker_needs_a_gpu_and_holds_its_memory(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(total_memory=80 << 30))
    assert "--nproc 2 asks for one GPU per worker, but 1 is visible; use --nproc 1 or fewer" in refusal(
        ["bench", "--nproc", "2"], capsys)
    assert "more than each of the 1 workers here can hold (80 GiB): lower --batch" in refusal(
        ["train", "--nproc", "1", "--batch", "10000000"], capsys)


def test_text_larger_than_a_worker_holds_is_refused_before_it_is_read(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    with open(text, "wb") as f:  # sparse: as large as the machine's memory, and no disk
        f.truncate(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    assert f"--data: corpus {text} holds" in refusal(["train", "--data", str(text)], capsys)


def test_a_sequence_longer_than_the_default_corpus_is_refused_before_any_worker(capsys):
    assert "its validation split (1%) must hold a sequence of 400001 bytes" in refusal(
        ["train", "--model", "tiny", "--batch", "1", "--seq-len", "400000"], capsys)
    # a sequence whose activations no worker holds is refused for them first
    assert "--batch 1 sequences of 1000000 tokens need 40.5 GiB per worker for their activations" in refusal(
        ["train", "--batch", "1", "--seq-len", "1000000"], capsys)


def test_a_link_rate_past_a_floats_range_is_one_line():
    with pytest.raises(spec.TestbedError, match="is outside 100kbit to 100gbit"):
        spec.parse_rate("9" * 400 + "gbit")


def test_a_line_shows_the_control_characters_a_name_holds():
    """A file named with an escape sequence reached the terminal raw (`measured by n\\nl^[[31m.json`)."""
    from shardwire.mappings import one_line

    assert one_line("n\nl\x1b[31m\r.json\t\x7f") == "n\\nl\\x1b[31m\\r.json\t\\x7f"
