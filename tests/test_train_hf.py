"""``shardwire train --model hf:...``: Hugging Face causal LMs built from configs (inline, a file) or
loaded from a local directory train with the engine, and bad models are refused before any worker
starts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings

import pytest
import torch

from shardwire.cli import main
from shardwire.models.choice import choose

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 128,
        "bos_token_id": 0, "eos_token_id": 0}
BERT = {"model_type": "bert", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}


def trained(model: str, *extra: str) -> tuple[float, float, str]:
    done = subprocess.run([sys.executable, "-m", "shardwire", "train", "--model", model, "--steps", "20",
                           "--log-every", "5", "--nproc", "2", "--batch", "8", "--eval-batches", "1", *extra],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torchao" not in done.stderr  # transformers imports it where installed, quietly
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", done.stdout).groups())
    return first, last, done.stdout


@pytest.mark.slow
def test_a_llama_built_from_an_inline_config_trains():
    first, last, out = trained("hf:" + json.dumps(LLAMA))
    assert "hf:LlamaForCausalLM" in out and "2 block units + root" in out
    assert last < first


@pytest.mark.slow
def test_a_gpt2_built_from_a_config_file_trains(tmp_path):
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(GPT2))
    first, last, out = trained(f"hf:{path}", "--seq-len", "64")
    assert "hf:GPT2LMHeadModel" in out and last < first


@pytest.mark.slow
def test_a_configs_special_tokens_outside_its_vocabulary_are_noted_once_not_once_per_rank(tmp_path):
    """GPT-2's default bos and eos ids (50256) lie outside a vocabulary of 256: transformers notes
    it as each process reads the config; the launcher, which reads it first, says it, its workers not."""
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps({key: value for key, value in GPT2.items() if not key.endswith("_token_id")}))
    done = subprocess.run([sys.executable, "-m", "shardwire", "train", "--model", f"hf:{path}", "--steps", "2",
                           "--nproc", "2", "--batch", "2", "--seq-len", "32", "--eval-batches", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("bos_token_id", "eos_token_id"):
        assert done.stderr.count(f"{name} must be `None` or an integer within the vocabulary") == 1, done.stderr
    refused = subprocess.run([sys.executable, "-m", "shardwire", "train", "--model", f"hf:{path}", "--seq-len", "129"],
                             capture_output=True, text=True, timeout=300)
    assert refused.stderr == "error: --seq-len 129 is longer than the 128 positions the model has\n"  # its line alone


@pytest.mark.parametrize("environment, says", [
    ({}, True),  # the command itself
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "2", "RANK": "0"}, True),  # rank 0 under the user's torchrun
    ({"LOCAL_RANK": "1", "WORLD_SIZE": "2", "RANK": "1"}, False),
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "2", "RANK": "0", "SHARDWIRE_NOTED_BY_LAUNCHER": "1"}, False),
])
def test_transformers_config_notes_come_from_one_process_as_its_warnings(monkeypatch, environment, says):
    """Said as warnings, naming the config: the command holds them with its own until its checks pass."""
    from shardwire.models.choice import config_from_fields
    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "SHARDWIRE_NOTED_BY_LAUNCHER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    vocab = 300 + len(environment) + says  # a message of its own: transformers says each one once a process
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        config_from_fields(transformers, {**GPT2, "vocab_size": vocab, "bos_token_id": 50256}, "hf:gpt2.json")
    noted = [str(w.message) for w in said if str(w.message).startswith("hf:gpt2.json: ") and
             f"bos_token_id must be `None` or an integer within the vocabulary (between 0 and {vocab - 1})"
             in str(w.message)]
    assert len(noted) == (1 if says else 0), [str(w.message) for w in said]


def test_a_directory_with_weights_loads_them(tmp_path):
    config = transformers.AutoConfig.for_model(**LLAMA)
    saved = transformers.AutoModelForCausalLM.from_config(config)
    saved.save_pretrained(tmp_path / "safetensors")
    choice = choose(f"hf:{tmp_path / 'safetensors'}")  # built on the meta device, then read by the slice
    assert [c.__name__ for c in choice.units] == ["LlamaDecoderLayer"] and choice.seq_len == 128
    assert choice.init is not None and choice.load is not None  # tests/test_pretrained.py reads them
    (tmp_path / "bin").mkdir()
    config.save_pretrained(tmp_path / "bin")
    torch.save(saved.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    choice = choose(f"hf:{tmp_path / 'bin'}")  # loaded whole, by from_pretrained
    assert choice.init is None and choice.load is None and choice.held_whole == choice.params
    loaded = choice.build()
    for (name, mine), theirs in zip(loaded.state_dict().items(), saved.state_dict().values()):
        assert torch.equal(mine, theirs), name


def test_compiled_units_of_more_layers_than_torchs_recompile_limit_run_without_a_cache():
    """A training forward asks the model for no KV cache: each layer's cache state is guarded, so a
    model of more layers than torch's recompile limit (8) would recompile past it and fail."""
    import torch.distributed as dist

    import shardwire
    from shardwire import worker

    choice = choose("hf:" + json.dumps({**LLAMA, "num_hidden_layers": 10}))
    made_here = not dist.is_initialized()  # a world of one, unless an earlier test left one
    worker.ensure_initialized(torch.device("cpu"))
    try:
        model = shardwire.shard(choice.build(), units=list(choice.units), compile={"backend": "eager"})
        tokens = torch.randint(0, LLAMA["vocab_size"], (2, 16))
        assert choice.logits(model, tokens).shape == (2, 16, LLAMA["vocab_size"])
    finally:
        if made_here:
            dist.destroy_process_group()


@pytest.mark.parametrize("model, extra, message", [
    ('hf:{"model_type": "nope"}', [], f"model_type 'nope' is not one transformers {transformers.__version__} knows"),
    ('hf:{"n_embd": 64}', [], "the config names no model_type: give the one its model is (llama, gpt2, ...)"),
    ("hf:" + json.dumps({**LLAMA, "hidden_act": "nope"}), [], "the config names 'nope', which transformers does not know"),
    ("hf:" + json.dumps({**LLAMA, "num_attention_heads": 3, "num_key_value_heads": 1}), [],
     "hidden_size (64) must be a multiple of num_attention_heads (3), or give each head's width (head_dim) where "
     "the model takes one"),
    ("hf:" + json.dumps({**LLAMA, "num_key_value_heads": 3}), [],
     "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
    ('hf:{"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4}', [],
     "num_attention_heads (4) must be a multiple of num_key_value_heads (8, its default where the config gives none)"),
    ("hf:" + json.dumps(LLAMA), ["--units", "Block"], "LlamaForCausalLM has no module of class Block"),
    ("hf:/no/such/model", [], "/no/such/model does not exist"),
    ("hf:/etc", [], "hf:/etc is a directory without a config.json: give the model's directory"),
    ("hf:" + json.dumps(LLAMA), ["--seq-len", "512"], "--seq-len 512 is longer than the 128 positions"),
    ("hf:" + json.dumps({**LLAMA, "max_position_embeddings": 0}), [],
     "max_position_embeddings must be a whole number of at least 1, got 0"),
    ("hf:" + json.dumps({**LLAMA, "num_attention_heads": 0}), [], "num_attention_heads must be a whole number of at least 1"),
    ("hf:" + json.dumps({**LLAMA, "vocab_size": 10**20}), [], "vocab_size is 100,000,000,000,000,000,000, more than 16,777,216"),
    ("small", ["--units", "Block"], "--units is for hf: models"),
    ("hf:" + json.dumps(BERT), [], 'BertLMHeadModel attends to the tokens after each one unless its config sets '
                                   'is_decoder, and would learn to copy the token it is to predict: add "is_decoder": '
                                   'true to the config'),
])
def test_bad_models_are_refused_before_any_worker_starts(model, extra, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["train", "--model", model, *extra])


def test_an_encoder_made_a_decoder_sees_no_later_token():
    model = choose("hf:" + json.dumps({**BERT, "is_decoder": True})).build().eval()
    tokens = torch.randint(0, BERT["vocab_size"], (1, 12))
    changed = torch.cat([tokens[:, :6], torch.randint(0, BERT["vocab_size"], (1, 6))], dim=1)
    with torch.no_grad():
        assert torch.allclose(model(tokens).logits[:, :6], model(changed).logits[:, :6], atol=1e-6)


def test_a_config_transformers_validates_is_refused_in_the_words_of_its_check():
    with pytest.raises(SystemExit) as refused:
        main(["train", "--model", "hf:" + json.dumps({**LLAMA, "head_dim": 15})])
    said = str(refused.value)
    assert ": RoPE requires an even rotary dimension, but got `head_dim`=15" in said and "validator" not in said


def test_a_model_naming_no_blocks_needs_units(monkeypatch):
    monkeypatch.setattr(transformers.LlamaPreTrainedModel, "_no_split_modules", None)
    with pytest.raises(ValueError, match="LlamaForCausalLM names no _no_split_modules to shard into: give --units"):
        choose("hf:" + json.dumps(LLAMA))
    assert [c.__name__ for c in choose("hf:" + json.dumps(LLAMA), units="LlamaDecoderLayer").units] == [
        "LlamaDecoderLayer"]


def test_the_flop_count_describes_hugging_face_decoders():
    """GPT-2's count equals torch's own (its attention is plain matrix multiplies); Llama's names its
    gated MLP, grouped keys and untied head."""
    from shardwire.models.gpt import loss_fn
    from shardwire.profile.flops import flops_per_token, torch_counted_flops_per_token

    choice = choose("hf:" + json.dumps(GPT2))
    model, tokens = choice.build(), torch.zeros(1, choice.seq_len + 1, dtype=torch.long)
    counted = torch_counted_flops_per_token(
        lambda: loss_fn(choice.logits(model, tokens[:, :-1]), tokens[:, 1:]).backward(), choice.seq_len)
    assert flops_per_token(choice.spec).model == pytest.approx(counted, rel=1e-6)
    llama = choose("hf:" + json.dumps(LLAMA)).spec
    assert (llama.ffn_gated, llama.kv_heads, llama.ffn_hidden, llama.tied_embeddings) == (True, 2, 128, False)
    # Phi-3's gate is fused into one gate_up_proj: counted as a plain MLP, its MFU was 15% low
    phi3 = choose("hf:" + json.dumps({**LLAMA, "model_type": "phi3", "pad_token_id": 0})).spec
    assert flops_per_token(phi3).model == flops_per_token(llama).model
    # a mixture of experts' experts are not in a dense count: no MFU, where a dense count halved it
    mixtral = choose("hf:" + json.dumps({**LLAMA, "model_type": "mixtral", "num_local_experts": 4,
                                         "num_experts_per_tok": 2}))
    assert not mixtral.counts_flops and mixtral.spec is not None  # which still sizes its memory
    assert choose("hf:" + json.dumps(LLAMA)).counts_flops


def test_the_simulator_prices_the_model_train_builds():
    """A config's own head width is the model's (Qwen3's and Gemma's heads are wider than hidden /
    heads); read as hidden / heads, the simulator priced another model."""
    from shardwire.sim.architecture import architecture
    from shardwire.sim.inputs import load_model

    config = json.dumps({**LLAMA, "head_dim": 32, "tie_word_embeddings": False})
    with torch.device("meta"):
        built = choose("hf:" + config).build()
    assert architecture(load_model("hf:" + config), 2).params == sum(p.numel() for p in built.parameters())
    # a learned position table has the config's rows, whatever length trains
    gpt2 = "hf:" + json.dumps({**GPT2, "n_positions": 64})
    assert {architecture(load_model(gpt2, seq_len), 2).params for seq_len in (16, 32, 64)} == {
        architecture(load_model(gpt2, 64), 2).params}


@pytest.mark.parametrize("config, left", [
    (LLAMA, "tie_word_embeddings"),
    ({"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 8, "num_hidden_layers": 2, "vocab_size": 256},
     "intermediate_size, num_key_value_heads, tie_word_embeddings"),
    ({**LLAMA, "model_type": "qwen3", "tie_word_embeddings": True}, "head_dim"),
], ids=["llama", "mistral", "qwen3"])
def test_the_simulator_refuses_sizes_a_config_leaves_to_its_type(config, left):
    """Its type's defaults are transformers' config class's (Mistral's MLP is 14,336 wide): guessed
    as GPT-2's, the simulator priced another model than train builds, 34 times smaller."""
    from shardwire.sim.inputs import load_model
    from shardwire.sim.specs import SpecError

    with pytest.raises(SpecError, match=rf"^its config leaves {left} to {config['model_type']}'s defaults, which "
                                        rf"transformers' config class for {config['model_type']} holds: give"):
        load_model("hf:" + json.dumps(config))
    assert load_model("hf:" + json.dumps(GPT2)).tied_embeddings  # GPT-2's family: the reader's own defaults


@pytest.mark.parametrize("config, said", [
    ({**GPT2, "model_type": "gpt_neox"}, "its model_type 'gpt_neox' is not one whose shape the simulator knows"),
    ({**LLAMA, "tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
], ids=["another family", "a tie given as text"])
def test_the_simulator_refuses_what_it_would_price_as_another_model(config, said):
    """Another family was priced as GPT-2 (a Mixtral's experts left out: 5 times too small); a tie
    given as "false" as tied."""
    from shardwire.sim.inputs import load_model
    from shardwire.sim.specs import SpecError

    with pytest.raises(SpecError, match=said):
        load_model("hf:" + json.dumps(config))
    gpt2 = load_model("hf:" + json.dumps({**GPT2, "head_dim": 96}))  # a key GPT-2's model does not read
    assert gpt2.head_width == 16


def test_a_config_difference_names_the_model_type_first_and_no_default_of_one_side_alone():
    from shardwire.models.choice import config_difference
    assert config_difference(LLAMA, {**LLAMA, "rms_norm_eps": 1e-5}) == "rms_norm_eps 1e-06 -> 1e-05"
    assert config_difference(LLAMA, {**GPT2}).startswith("model_type 'llama' -> 'gpt2'")  # not what follows from it
    # one side transformers cannot read: both compared as written, not one with its defaults filled in
    assert config_difference({**LLAMA, "model_type": "nonesuch"}, LLAMA) == "model_type 'nonesuch' -> 'llama'"
    assert config_difference(LLAMA, dict(LLAMA)) is None
    # who saved it, and in what dtype: the same model trains either way
    assert config_difference(LLAMA, {**LLAMA, "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"}) is None


@pytest.mark.parametrize("dtype", [{"torch_dtype": "bfloat16"}, {"dtype": "int8"}])
def test_a_config_saved_in_another_dtype_builds_fp32_master_weights(dtype):
    choice = choose("hf:" + json.dumps({**LLAMA, **dtype}))
    with torch.device("meta"):
        assert {p.dtype for p in choice.build().parameters()} == {torch.float32}
