"""A Hugging Face directory is data, never code: a config or tokenizer whose ``auto_map`` names a
Python file is refused in one line, and the file never runs, even with ``y`` waiting on stdin for
transformers' "Do you wish to run the custom code?"."""

from __future__ import annotations

import io
import json

import pytest

from shardwire.cli import main

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

GPT2 = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 128}


def plant(directory, marker, config_name: str, fields: dict) -> None:
    """A directory whose ``config_name`` maps transformers' classes to ``custom.py``, which would
    leave ``marker`` behind if it ever ran."""
    directory.mkdir()
    (directory / "custom.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    (directory / config_name).write_text(json.dumps(fields))


@pytest.fixture
def yes_on_stdin(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 10))


def test_a_model_needing_custom_code_is_refused_and_its_code_never_runs(tmp_path, yes_on_stdin):
    marker = tmp_path / "marker"
    plant(tmp_path / "model", marker, "config.json", {
        "model_type": "custom-gpt", **GPT2,
        "auto_map": {"AutoConfig": "custom.Config", "AutoModelForCausalLM": "custom.Model"}})
    with pytest.raises(SystemExit, match=r"needs custom code \(the auto_map of config.json names .*\), which "
                                         r"shardwire never runs"):
        main(["train", "--model", f"hf:{tmp_path / 'model'}"])
    assert not marker.exists()


def test_a_known_architecture_with_an_auto_map_trains_on_transformers_own_code(tmp_path, yes_on_stdin):
    marker = tmp_path / "marker"
    plant(tmp_path / "model", marker, "config.json", {
        "model_type": "gpt2", **GPT2, "auto_map": {"AutoModelForCausalLM": "custom.Model"}})
    from shardwire.models.choice import choose

    choice = choose(f"hf:{tmp_path / 'model'}")
    assert choice.name == "hf:GPT2LMHeadModel" and not marker.exists()
    # said as the run starts: the class trained is not the one the auto_map names
    assert choice.note == (f"hf:{tmp_path / 'model'} names custom code (auto_map {{'AutoModelForCausalLM': "
                           f"'custom.Model'}}), which shardwire never runs: it builds transformers' own "
                           f"GPT2LMHeadModel for model_type 'gpt2'")


def test_a_tokenizer_needing_custom_code_is_refused_and_its_code_never_runs(tmp_path, yes_on_stdin):
    marker = tmp_path / "marker"
    plant(tmp_path / "tokenizer", marker, "tokenizer_config.json", {
        "tokenizer_class": "CustomTokenizer", "auto_map": {"AutoTokenizer": ["custom.CustomTokenizer", None]}})
    text = tmp_path / "text.txt"
    text.write_text("some text " * 1000)
    with pytest.raises(SystemExit, match=r"--tokenizer .*: it needs custom code \(the auto_map of "
                                         r"tokenizer_config.json names .*\), which shardwire never runs: use a "
                                         r"tokenizer whose class transformers itself implements"):
        main(["train", "--data", str(text), "--tokenizer", str(tmp_path / "tokenizer")])
    assert not marker.exists()
