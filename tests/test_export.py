"""A trained model out of shardwire in one step: ``shardwire train --export-hf DIR`` and ``shardwire
export CKPT OUT`` write what ``from_pretrained`` loads, with the model's tokenizer; an ``hf:`` model's
own tokenizer reads text ``--data``, and text never reaches a tokenizer's vocabulary as bytes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from harness import save_tokenizer
from shardwire.cli import main
from shardwire.engine.checkpoint.portable import read_state_dict

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64, "vocab_size": 300}


@pytest.fixture
def model_dir(tmp_path):
    """A Hugging Face model directory as save_pretrained leaves it, weights aside: config and tokenizer."""
    directory = tmp_path / "gpt2-mini"
    save_tokenizer(directory)
    (directory / "config.json").write_text(json.dumps(GPT2))
    return directory


def shardwire(*args: str, cwd) -> str:
    done = subprocess.run([sys.executable, "-m", "shardwire", *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_a_trained_model_exports_as_from_pretrained_loads_it(tmp_path, model_dir):
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 3000)
    out = shardwire("train", "--model", f"hf:{model_dir}", "--data", "text.txt", "--steps", "6", "--batch", "4",
                    "--seq-len", "32", "--eval-batches", "1", "--checkpoint-dir", "ckpt", "--save-every", "6",
                    "--export-hf", "live", cwd=tmp_path)
    assert ".tokens-" in out  # the text went through the model's own tokenizer
    assert "exported to live (from_pretrained loads it)" in out
    shardwire("export", "ckpt", "saved", cwd=tmp_path)

    trained = read_state_dict(tmp_path / "ckpt" / "step_00000006")
    tokens = torch.randint(0, GPT2["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    logits = []
    for name in ("live", "saved"):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name)
        for key, value in model.state_dict().items():
            assert torch.equal(value, trained[key]), (name, key)
        logits.append(model(tokens).logits)
        tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / name)
        original = transformers.AutoTokenizer.from_pretrained(model_dir)
        assert tokenizer("the lazy fox")["input_ids"] == original("the lazy fox")["input_ids"]
    assert torch.equal(*logits)
    untrained = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**GPT2))
    assert not torch.equal(untrained.state_dict()["transformer.h.0.mlp.c_fc.weight"],
                           trained["transformer.h.0.mlp.c_fc.weight"])


def test_text_as_bytes_into_a_tokenizers_vocabulary_is_refused(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(GPT2))
    (tmp_path / "text.txt").write_text("x" * 100_000)
    with pytest.raises(SystemExit, match=r"--data is text, read as bytes \(ids 0 to 255\), but hf:GPT2LMHeadModel's "
                                         r"300 ids are its tokenizer's: give --tokenizer DIR"):
        main(["train", "--model", f"hf:{config}", "--data", str(tmp_path / "text.txt")])


def test_exports_never_overwrite_and_say_what_they_need(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("the user's")
    with pytest.raises(SystemExit, match=r"taken is not empty: give a new directory \(nothing is overwritten\)"):
        main(["train", "--model", f"hf:{json.dumps(GPT2)}", "--export-hf", str(taken)])
    with pytest.raises(SystemExit, match="--export-hf writes a Hugging Face model, and --model small is a GPT preset"):
        main(["train", "--model", "small", "--export-hf", str(tmp_path / "new")])
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "holds no checkpoint: give one (ckpt/step_00000400) or a --checkpoint-dir" in capsys.readouterr().err
    assert (taken / "mine.txt").read_text() == "the user's"


def _export_growth(rank, world, root):
    """MiB this process's anonymous memory (not the checkpoint's files, which it maps) peaked at
    beyond where it started, while exporting a 145 MiB checkpoint in files of 60 MiB; the model's
    MiB and its largest unit's."""
    import ctypes
    import threading

    from shardwire.engine.checkpoint.portable import weights_in
    from shardwire.models.export import save_pretrained

    def anonymous_mib() -> float:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:")) / 1024

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # freed tensors go back, so the peak counts live ones
    config = {"model_type": "gpt2", "n_embd": 512, "n_layer": 12, "n_head": 8, "n_positions": 64, "vocab_size": 300}
    name = f"hf:{json.dumps(config)}"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    import shardwire as sw

    sw.shard(model)
    sw.save_checkpoint(f"{root}/ckpt", model, extra={"model": name}).wait()
    whole = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    unit = sum(p.numel() * 4 for p in model.transformer.h[0].parameters()) / 2**20
    del model
    with weights_in(f"{root}/ckpt") as weights:  # loads what exporting first uses, outside the count
        save_pretrained(name, weights, f"{root}/warm", max_shard_size=60 * 2**20)
    before, peak, done = anonymous_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            peak[0] = max(peak[0], anonymous_mib())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with weights_in(f"{root}/ckpt") as weights:
            save_pretrained(name, weights, f"{root}/out", max_shard_size=60 * 2**20)
    finally:
        done.set()
        sampler.join()
    return peak[0] - before, whole, unit


@pytest.mark.slow
def test_an_export_writes_a_unit_at_a_time_in_files_from_pretrained_reads(tmp_path):
    from harness import run_workers

    ((grown, whole, unit),) = run_workers(1, _export_growth, str(tmp_path))
    assert grown <= 3 * unit + 16 < whole / 2, (grown, whole, unit)  # never the whole model: a unit or two
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3 and "lm_head.weight" not in index["weight_map"]  # tied
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    trained = read_state_dict(tmp_path / "ckpt")
    for key, value in exported.state_dict().items():
        assert torch.equal(value, trained[key]), key
