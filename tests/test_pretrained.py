"""Pretrained Hugging Face weights read into a sharded model by the slice, bit-equal to
``from_pretrained``, with a clear error for weights that are not the model's."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

import shardwire
from harness import run_workers

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from shardwire.models.pretrained import load_pretrained  # noqa: E402

CONFIGS = {
    "llama": {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64},
    "gpt2": {"model_type": "gpt2", "vocab_size": 128, "n_embd": 32, "n_layer": 3, "n_head": 4, "n_positions": 64,
             "bos_token_id": 0, "eos_token_id": 0},  # its head is tied to the embedding, saved once
}


def _save(directory, name: str, max_shard_size: str, dtype=torch.float32) -> None:
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**CONFIGS[name]))
    model.to(dtype).save_pretrained(directory, max_shard_size=max_shard_size)


def _loaded(rank, world, directory, group_size):
    """The sharded model loaded by the slice, whole on every rank, against from_pretrained's."""
    expected = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(expected.config)
    shardwire.shard(model, layout="full" if group_size == world else "hybrid", shard_group_size=group_size)
    load_pretrained(model, directory)
    loaded = {name: param.full_tensor() for name, param in model.named_parameters()}
    return [name for name, value in expected.named_parameters() if not torch.equal(loaded[name], value)]


@pytest.mark.parametrize("name, max_shard_size", [("llama", "5GB"), ("gpt2", "20KB")],
                         ids=["llama-one-file", "gpt2-tied-several-files"])
@pytest.mark.parametrize("world, group_size", [pytest.param(1, 1, id="world-1", marks=pytest.mark.slow),
                                               pytest.param(2, 2, id="full-2"),
                                               pytest.param(3, 3, id="full-3", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_weights_are_read_by_the_slice_as_from_pretrained_reads_them(name, max_shard_size, world, group_size,
                                                                     tmp_path):
    _save(tmp_path, name, max_shard_size)
    assert (tmp_path / "model.safetensors.index.json").exists() == (max_shard_size == "20KB")
    for wrong in run_workers(world, _loaded, tmp_path, group_size):
        assert wrong == []


@pytest.mark.slow
def test_bf16_weights_load_into_an_fp32_model_under_hybrid(tmp_path):
    _save(tmp_path, "llama", "20KB", torch.bfloat16)
    for wrong in run_workers(4, _loaded, tmp_path, 2, timeout=300):
        assert wrong == []


def _synced_after_steps_that_move_nothing(rank, world, directory):
    """Groups of one rank syncing every step: with a learning rate of 0 no group moves from the
    pretrained weights, so no sync may move them either, whatever the outer step."""
    expected = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(expected.config)
    shardwire.shard(model, layout="hybrid", shard_group_size=1, diloco="sync_every=1")
    load_pretrained(model, directory)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    shardwire.diloco_sync(model)
    synced = {name: param.full_tensor() for name, param in model.named_parameters()}
    return [name for name, value in expected.named_parameters() if not torch.equal(synced[name], value)]


@pytest.mark.slow
def test_pretrained_weights_are_where_syncing_every_h_steps_starts(tmp_path):
    _save(tmp_path, "llama", "5GB")
    for moved in run_workers(2, _synced_after_steps_that_move_nothing, tmp_path, env={"LOCAL_WORLD_SIZE": "1"}):
        assert moved == []


def _refused(rank, world, directory, config):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    shardwire.shard(model)
    try:
        load_pretrained(model, directory)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.slow
def test_weights_of_another_model_are_refused_naming_the_tensor(tmp_path):
    _save(tmp_path, "llama", "5GB")
    wider = {**CONFIGS["llama"], "intermediate_size": 96}
    deeper = {**CONFIGS["llama"], "num_hidden_layers": 4}
    (message,) = run_workers(1, _refused, tmp_path, wider)
    assert "'model.layers.0.mlp.gate_proj.weight' is (64, 32) in the weights but (96, 32) in the model" in message
    (message,) = run_workers(1, _refused, tmp_path, deeper)
    assert "the weights have no 'model.layers.3." in message
    assert "another model's, or were saved in part" in message


def test_weights_stored_under_other_names_say_transformers_converts_them(tmp_path):
    """A mixture of experts' weights as save_pretrained stores them, by expert, which from_pretrained
    fuses as it loads: refused as another model's, or saved in part."""
    from safetensors.torch import load_file, save_file

    _save(tmp_path, "llama", "5GB")
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.mlp.experts.0.w1.weight"] = weights.pop("model.layers.0.mlp.gate_proj.weight")
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (message,) = run_workers(1, _refused, tmp_path, CONFIGS["llama"])
    assert ("the weights have no 'model.layers.0.mlp.gate_proj.weight', which the model its config.json builds has, "
            "and hold 1 tensor(s) it has no place for ('model.layers.0.mlp.experts.0.w1.weight'...): stored in a "
            "layout transformers converts as from_pretrained loads them") in message


@pytest.mark.slow
def test_weights_not_finite_are_refused_on_every_rank_and_unused_ones_named(tmp_path):
    """An inf in one rank's rows was trained on, blamed on --lr at step 1; a NaN row no batch reads
    was exported with status 0. Tensors the model has no place for were dropped without a word."""
    from safetensors.torch import load_file, save_file

    _save(tmp_path, "llama", "5GB")
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"][60, 5] = float("inf")  # in the second rank's rows of 2
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    said = run_workers(2, _refused_saying, tmp_path, CONFIGS["llama"])
    for message, _ in said:
        assert message == (f"{tmp_path}: the weights' 'model.layers.0.mlp.up_proj.weight' holds values that are not "
                           f"finite: the weights are damaged, or were saved from a run that diverged")
    (_, first), (_, second) = said
    assert (f"note: {tmp_path}'s weights hold 1 tensor(s) the model its config.json builds has no place for, which are "
            f"not read: model.layers.0.self_attn.q_proj.bias\n") in first and "note:" not in second  # said once


def _refused_saying(rank, world, directory, config):
    """``_refused``, and what the load said on standard error."""
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        refused = _refused(rank, world, directory, config)
    return refused, said.getvalue()
