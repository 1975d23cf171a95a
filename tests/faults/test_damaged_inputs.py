"""Damaged or hostile input is one line, found before any worker starts, instead of a traceback
from every worker: a config or spec that is not UTF-8, weights that are damaged, a pickle that
would run code, an index naming files outside the model, units that cannot shard, a file named .npy
that is not one, a .bin of 64-bit ids, a tokenizer larger than the model's vocabulary; at run time, a
log that cannot be written; and a damaged token cache is tokenised again."""

from __future__ import annotations

import json
import os
import re
import signal

import numpy as np
import pytest
import torch

from harness import save_tokenizer
from shardwire.cli import main
from shardwire.training.data import load_corpus
from shardwire.training.scalars import ScalarLog

GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 256, "n_positions": 64}


def test_text_that_is_not_utf8_or_holds_what_yaml_refuses_is_one_line(tmp_path, capsys):
    latin1 = tmp_path / "job.yaml"
    latin1.write_bytes("model: café\n".encode("latin-1"))
    assert main(["train", "--config", str(latin1)]) == 2
    assert f"--config {latin1} is not UTF-8 text (byte 10 is 0xe9): save it as UTF-8" in capsys.readouterr().err
    assert main(["simulate", "--model", str(latin1), "--cluster", "a100-100gbe"]) == 2
    assert f"model file {latin1} is not UTF-8 text" in capsys.readouterr().err
    latin1.write_bytes(b"steps: 7\x00\n")
    assert main(["train", "--config", str(latin1)]) == 2
    assert "is neither JSON nor YAML: unacceptable character #x0000" in capsys.readouterr().err


@pytest.fixture
def model_dir(tmp_path):
    """A GPT-2 directory as save_pretrained writes it: config.json and model.safetensors."""
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    directory = tmp_path / "model"
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**GPT2)).save_pretrained(directory)
    return directory


def refused(model_dir, *extra: str) -> str:
    with pytest.raises(SystemExit) as refusal:
        main(["train", "--model", f"hf:{model_dir}", *extra])
    assert "\n" not in str(refusal.value)
    return str(refusal.value)


def test_damaged_weights_are_refused_before_any_worker(model_dir):
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    assert refused(model_dir).startswith(f"error: hf:{model_dir}: model.safetensors is damaged (")


def test_a_pickle_that_would_run_code_is_refused_and_never_runs(model_dir, tmp_path):
    marker = tmp_path / "marker"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (model_dir / "model.safetensors").unlink()
    torch.save({"transformer.wte.weight": Payload()}, model_dir / "pytorch_model.bin")
    assert "pytorch_model.bin holds more than tensors" in refused(model_dir)
    assert not marker.exists()


def test_an_index_naming_files_outside_the_model_is_refused(model_dir, tmp_path):
    (model_dir / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    index = {"metadata": {}, "weight_map": {"transformer.wte.weight": "../elsewhere.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "names '../elsewhere.safetensors', not a file of the model's directory" in refused(model_dir)
    index["weight_map"] = {"transformer.wte.weight": "missing.safetensors"}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "missing.safetensors is missing" in refused(model_dir)


@pytest.mark.parametrize("fields, message", [
    ({"n_embd": -1}, "n_embd must be a whole number of at least 1, got -1"),
    ({"n_layer": "two"}, "n_layer must be a whole number of at least 1, got 'two'"),
])
def test_a_config_transformers_cannot_build_is_one_line(fields, message, model_dir):
    (model_dir / "config.json").write_text(json.dumps({**GPT2, **fields}))
    assert message in refused(model_dir)


@pytest.mark.parametrize("units, message", [
    ("GPT2LMHeadModel", "--units GPT2LMHeadModel: units selects the model itself"),
    ("GPT2Block,GPT2Attention", "--units GPT2Block,GPT2Attention: units nest"),
    (",", "--units ',' names no class"),
])
def test_units_that_cannot_shard_are_refused_before_any_worker(units, message, model_dir):
    assert message in refused(model_dir, "--units", units)


def test_a_log_that_cannot_be_written_is_one_line_and_training_goes_on(capsys):
    log = ScalarLog(jsonl="/dev/full")
    log.write(10, {"loss": 1.0})
    log.write(20, {"loss": 0.5})
    log.close()
    assert capsys.readouterr().err == ("warning: --log-jsonl /dev/full: No space left on device; training goes on "
                                       "without this log from step 10\n")


def test_a_damaged_token_cache_is_tokenised_again(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    save_tokenizer(tmp_path / "tokenizer")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 500)
    first = load_corpus(str(text), seq_len=16, tokenizer=str(tmp_path / "tokenizer"))
    ids, cache = np.array(first.ids), first.name
    for damage in (b"", b"\x93NUMPY damaged", open(cache, "rb").read()[:-10]):
        with open(cache, "wb") as f:
            f.write(damage)
        again = load_corpus(str(text), seq_len=16, tokenizer=str(tmp_path / "tokenizer"))
        assert again.name == cache and np.array_equal(again.ids, ids)


def test_a_file_named_npy_that_is_not_one_is_one_line_never_suggesting_unpickling_it(tmp_path):
    """numpy takes a file without the .npy header for a pickle, and its message suggests loading it with
    allow_pickle: of a file of unknown origin, running its code."""
    path = tmp_path / "t.npy"
    path.write_text("hello\n")
    with pytest.raises(SystemExit) as refusal:
        main(["train", "--model", "tiny", "--steps", "2", "--nproc", "1", "--data", str(path)])
    assert str(refusal.value) == (f"error: --data: {path} is not a NumPy .npy array file (it does not begin with the "
                                  f"header numpy.save writes): a .npy holds token ids saved by numpy.save, a .bin flat "
                                  f"ids, and a file of any other name is read as text")
    path.write_bytes(b"\x93NUMPY\x01\x00\x10\x00{'descr': '<u2',")  # a header cut short
    cut_short = (f"^error: --data: {re.escape(str(path))} is not a readable .npy file \\(.*\\): write it again with "
                 f"numpy.save$")
    with pytest.raises(SystemExit, match=cut_short):
        main(["train", "--model", "tiny", "--steps", "2", "--nproc", "1", "--data", str(path)])


@pytest.fixture
def testbed_run(monkeypatch, tmp_path):
    """``shardwire testbed run`` on a testbed of 2 nodes as ``up`` records it, taken for built (no root,
    no namespaces), whose jobs are recorded instead of started."""
    from shardwire.testbed import job, network, spec

    monkeypatch.setattr(spec, "STATE_DIR", tmp_path / "state")
    monkeypatch.setattr(network, "require_privileges", lambda *given: None)
    monkeypatch.setattr(network, "is_up", lambda testbed: True)
    monkeypatch.setattr(job, "stop_leftovers", lambda testbed: [])  # no nodes: nothing left on them
    started = []
    monkeypatch.setattr(job, "run_job", lambda testbed, nproc_per_node, command, **options: started.append(command)
                        or 0)
    spec.Testbed("shardwire-test-inputs", 2, spec.parse_rate("100mbit")).save()
    terminated = signal.getsignal(signal.SIGTERM)  # `run` stops its job on SIGTERM
    yield started, lambda *job: main(["testbed", "run", "--name", "shardwire-test-inputs", "--", "-m", "shardwire",
                                      *job])
    signal.signal(signal.SIGTERM, terminated)


def test_a_testbed_jobs_missing_script_is_one_line_before_any_node_starts(testbed_run, tmp_path, monkeypatch, capsys):
    """Every node said it could not open the file, in turn."""
    from shardwire.cli import main

    started, _ = testbed_run
    monkeypatch.chdir(tmp_path)
    assert main(["testbed", "run", "--name", "shardwire-test-inputs", "--", "nosuchscript.py"]) != 0
    assert (f"the job's script nosuchscript.py does not exist in {tmp_path}, where the nodes run the job: give a "
            f"path that exists") in capsys.readouterr().err
    assert not started


@pytest.mark.parametrize("job, said", [
    (["--no-python", "/nonexistent"], "the job's program /nonexistent is not an executable file here or on PATH"),
    (["--no-python"], "the job's --no-python names nothing after it: give a program"),
    (["--no_python", "/nonexistent"], "the job's program /nonexistent is not an executable file"),  # torchrun's too
    (["-c", "1"], "the job starts with -c: give a script, -m module or --no-python program, then its arguments"),
])
def test_a_testbed_job_torchrun_cannot_start_is_one_line_before_any_node_starts(testbed_run, capsys, job, said):
    """A missing --no-python program was each node's traceback; a lead torchrun does not take, each
    node's usage text."""
    from shardwire.cli import main

    started, _ = testbed_run
    assert main(["testbed", "run", "--name", "shardwire-test-inputs", "--", *job]) != 0
    assert said in capsys.readouterr().err
    assert not started


def test_a_testbed_jobs_missing_input_is_one_line_before_any_node_starts(testbed_run, tmp_path, monkeypatch, capsys):
    """Each node's worker found a --data that is not there as it started, and each said so: one line
    here, before any node starts, naming the directory a relative path is read from (the nodes run
    the job in the one ``run`` is given in)."""
    started, run = testbed_run
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    for given, said in (
            (["--data", "some/relative/missing.bin"],
             f"--data some/relative/missing.bin does not exist in {tmp_path}, where the nodes run the job"),
            (["--data", "/no/such/ids.bin"], "--data /no/such/ids.bin does not exist"),
            (["--data", "dangling"], "--data dangling is a symbolic link that leads nowhere (a loop, or its target is "
                                     f"gone) in {tmp_path}, where the nodes run the job"),
            (["--tokenizer", "tok"], f"--tokenizer tok does not exist in {tmp_path}, where the nodes run the job")):
        assert run("train", *given) == 2
        assert capsys.readouterr().err == f"error: {said}: give a path that exists\n"
    assert not started
    np.zeros(1000, dtype=np.uint16).tofile(tmp_path / "ids.bin")
    assert run("train", "--data", "ids.bin") == 0 and started == [["-m", "shardwire", "train", "--data", "ids.bin"]]


@pytest.mark.parametrize("token_dtype", ["uint16", "uint32"])
@pytest.mark.parametrize("vocabulary", [256, 100_000])
def test_64_bit_ids_are_refused_at_either_width_saying_how_to_convert_them(tmp_path, token_dtype, vocabulary):
    """int64 ids read as uint32 have every second id 0: the uint16 refusal once advised uint32, which
    then trained on them. Each width names 64-bit ids, and the conversion it gives, run as written,
    makes a file the advised options train on."""
    ids = np.random.default_rng(0).integers(0, vocabulary, 50_000)
    path = tmp_path / "ids.bin"
    ids.astype(np.int64).tofile(path)
    with pytest.raises(SystemExit) as refusal:
        main(["train", "--model", "tiny", "--steps", "2", "--nproc", "1", "--data", str(path),
              "--token-dtype", token_dtype])
    said = str(refusal.value)
    assert re.fullmatch(f"error: --data: {re.escape(str(path))} looks like 64-bit ids read as {token_dtype} \\(.* "
                        f"(is|are) 0\\), and --token-dtype takes uint16 or uint32: convert them, e.g. with (.*), and give "
                        f"--data (.*) --token-dtype uint32", said)
    conversion, converted = re.search(r"e\.g\. with (.*), and give --data (.*) --token-dtype", said).groups()
    eval(conversion, {"numpy": np})
    assert np.array_equal(load_corpus(converted, 32, bin_dtype="uint32").ids, ids)


def _tokenizer_of(directory, size: int) -> None:
    """``save_tokenizer``'s tokenizer grown to ``size`` ids by added tokens ``<x0>``, ``<x1>``, ...:
    ``len`` counts them, its ``vocab_size`` does not."""
    import transformers

    save_tokenizer(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    tokenizer.add_tokens([f"<x{i}>" for i in range(size - len(tokenizer))])
    tokenizer.save_pretrained(directory)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_before_tokenising_leaving_nothing(tmp_path):
    """The text was tokenised whole, into a .npy beside it, before the first id past the model's
    vocabulary was refused; the tokenizer's size says so first, whether or not an earlier run left ids
    there."""
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    _tokenizer_of(tmp_path / "tokz", 300)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox <x250> jumps over the lazy dog " * 500)
    run = ["train", "--model", "tiny", "--steps", "2", "--nproc", "1", "--data", str(text),
           "--tokenizer", str(tmp_path / "tokz")]
    said = (f"error: --tokenizer {tmp_path / 'tokz'} has 300 ids, but the model's vocabulary has 256: give a model "
            f"whose vocabulary holds them, an hf: model with a vocab_size of 300 or more, or --model gpt-125m "
            f"(50,304 ids); or a tokenizer of at most 256 ids")
    with pytest.raises(SystemExit) as refusal:
        main(run)
    assert str(refusal.value) == said
    assert sorted(os.listdir(tmp_path)) == ["text.txt", "tokz"]
    load_corpus(str(text), seq_len=16, tokenizer=str(tmp_path / "tokz"))  # ids cached, as for a larger model
    with pytest.raises(SystemExit) as refusal:
        main(run)
    assert str(refusal.value) == said
