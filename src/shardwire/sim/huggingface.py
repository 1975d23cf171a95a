"""A Hugging Face causal LM's ``config.json`` as the simulator describes a model: ``shardwire simulate
--model hf:...`` and ``shardwire plan`` take what ``shardwire train --model hf:...`` takes.

The sizes go by the names Llama's and GPT-2's configs give them (``num_hidden_layers`` or
``n_layer``, ...). What a config leaves out is its model type's default, which only transformers'
config class for that type knows (a Mistral's MLP of 14,336, a Llama's untied head). The config is
read without torch or transformers, so that both commands start at once: one that leaves such a
size out is refused, not guessed (``shape_problem``). Which families have a gated MLP and RMSNorm
is a fact of their modelling code, not of the config: ``GATED_RMSNORM_FAMILIES`` lists the
``model_type``s built so (Llama and its descendants), and GPT-2 has a 4 h GELU MLP, LayerNorm and
a tied head; another family is refused (``shape_problem``): its shape is its modelling code's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from shardwire.mappings import MAX_TEXT_BYTES, cut, read_file, shown
from shardwire.sim.specs import MAX_LAYERS, MAX_SEQ_LEN, MAX_VOCAB, MAX_WIDTH, ModelSpec

HF_PREFIX = "hf:"
GATED_RMSNORM_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo", "olmo2", "granite", "phi3")
# Tokens per sequence when none is asked for: the model's positions, at most this many.
DEFAULT_SEQ_LEN = 1024
# The files of a tokenizer that save_pretrained writes beside a model; a directory with one of them
# holds the model's tokenizer, which shardwire train reads its text --data with.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(source: str) -> bool:
    """Whether ``source`` (what follows ``hf:``) is a model directory that holds its tokenizer too."""
    return os.path.isdir(source) and any(os.path.exists(os.path.join(source, name)) for name in TOKENIZER_FILES)


def read_config(source: str) -> dict:
    """The fields of ``source``: a directory holding ``config.json``, a JSON file, or inline JSON, read
    within bounds (size, depth, encoding) as every file a command reads. Raises ``ValueError`` saying
    what is wrong, with ``source`` cut short."""
    if source.lstrip().startswith("{"):
        what = f"hf:{cut(source, 60)}"
        if len(source) > MAX_TEXT_BYTES:
            raise ValueError(f"{what} is longer than {MAX_TEXT_BYTES:,} characters, far more than any config: "
                             f"give its config.json instead")
        fields = _parsed(source, what)
    else:
        path = config_file(source)
        what = f"hf:{cut(source)}"
        if not os.path.lexists(path):
            if path != source:  # a directory
                raise ValueError(f"{what} is a directory without a config.json: give the model's directory, which "
                                 f"holds its config.json, or a config .json")
            raise ValueError(f"{what} does not exist: hf: takes a local directory, a config .json or inline JSON")
        if not os.path.isfile(path):
            raise ValueError(f"{what}: {os.path.basename(path)} is not a regular file: give a config .json or a "
                             f"model directory")
        fields = _parsed(read_file(path, f"{what}: {os.path.basename(path)}"), what)
    if not isinstance(fields, dict):
        raise ValueError(f"{what}: a config is a JSON mapping, got {type(fields).__name__}")
    return fields


def needs_custom_code(auto_map, *, named_in: str | None = None, instead: str = "a model whose architecture") -> str:
    """Why what names custom code (its ``auto_map``, found in the file ``named_in``) is refused: the
    Python files it names would have to run, which shardwire never lets them; ``instead``: what to use."""
    named = f"the auto_map of {named_in} names" if named_in else "auto_map"
    return (f"it needs custom code ({named} {shown(auto_map, 60)}), which shardwire never runs: use {instead} "
            f"transformers itself implements")


def config_file(source: str) -> str:
    """The config file of ``hf:source``: the file itself, or a directory's config.json (a name too long
    for the system is neither, and is reported missing, not raised)."""
    return os.path.join(source, "config.json") if os.path.isdir(source) else source


def _parsed(text: str, what: str):
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} nests deeper than any config: flatten it") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{what}: not JSON ({err})") from None


# The sizes of a causal LM's config, under transformers' common names and GPT-2's, each checked where
# it has it: the least each can be, and the most the simulator takes (far beyond any published model;
# a larger one overflows the sizes torch can allocate, even on the meta device).
_SIZES = (("num_hidden_layers", "n_layer", 1, MAX_LAYERS), ("hidden_size", "n_embd", 1, MAX_WIDTH),
          ("num_attention_heads", "n_head", 1, MAX_WIDTH), ("vocab_size", "vocab_size", 1, MAX_VOCAB),
          ("max_position_embeddings", "n_positions", 1, MAX_SEQ_LEN), ("intermediate_size", "n_inner", 1, MAX_WIDTH),
          ("head_dim", "head_dim", 1, MAX_WIDTH))


def check_sizes(fields: Mapping, written: Mapping | None = None) -> None:
    """Raise a ``ValueError`` naming the first size in a config's ``fields`` that no model can have:
    checked before transformers reads them (a head count of 0 divides by zero there) and before the
    simulator does. Layers are made one by one, even on the meta device, so a billion of them would
    hang whatever builds the model (training, export). Heads that do not divide the width (where no
    ``head_dim`` is given) or that key and value heads do not divide among them are refused too:
    transformers would refuse the first in its own words, and build the second, which fails at its
    first forward; so is a ``tie_word_embeddings`` that is not true or false. ``written``: the config as its file gives it, where ``fields`` are transformers'
    reading of it, so that a size the file leaves to the model's default is named as one."""
    given = {name: next((key for key in (name, alias) if fields.get(key) is not None), None)
             for name, alias, _, _ in _SIZES}
    for name, _, least, most in _SIZES:
        key = given[name]
        if key is None:
            continue
        value = fields[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{key} must be a whole number of at least {least}, got {shown(value)}")
        if value > most:
            what = f"{value:,} layers" if name == "num_hidden_layers" else f"{key} is {value:,}"
            raise ValueError(f"{what}, more than {most:,}, far beyond any published model: give the {key} the "
                             f"model has")

    def said(key: str) -> str:
        default = written is not None and written.get(key) is None
        return f"{key} ({fields[key]}{', its default where the config gives none' if default else ''})"

    hidden, heads = given["hidden_size"], given["num_attention_heads"]
    if fields.get("head_dim") is None and hidden and heads and fields[hidden] % fields[heads]:
        # each head is hidden / heads wide unless the config says otherwise
        raise ValueError(f"{said(hidden)} must be a multiple of {said(heads)}, or give each head's width (head_dim) "
                         f"where the model takes one")
    tied = fields.get("tie_word_embeddings")
    if tied is not None and not isinstance(tied, bool):
        raise ValueError(f"tie_word_embeddings must be true or false, got {shown(tied)}")
    kv_heads = fields.get("num_key_value_heads")
    if kv_heads is not None and (isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1):
        raise ValueError(f"num_key_value_heads must be a whole number of at least 1, got {shown(kv_heads)}")
    if heads and kv_heads is not None and fields[heads] % kv_heads:
        # each key and value head serves a whole number of query heads: attention fails at its first forward
        raise ValueError(f"{said(heads)} must be a multiple of {said('num_key_value_heads')}")


def seq_len_of(fields: Mapping, seq_len: int | None) -> int:
    """Tokens per sequence of a model whose ``fields`` passed ``check_sizes``: as asked, else the
    model's positions up to ``DEFAULT_SEQ_LEN``; raises ``ValueError`` when asked for more than the
    model has."""
    key = next((key for key in ("max_position_embeddings", "n_positions") if fields.get(key) is not None), None)
    positions = DEFAULT_SEQ_LEN if key is None else fields[key]
    length = seq_len or min(positions, DEFAULT_SEQ_LEN)
    if length > positions:
        raise ValueError(f"--seq-len {length} is longer than the {positions} positions the model has")
    return length


# The sizes whose default, where a config leaves them out, is its model type's own: a Mistral's MLP
# is 14,336 wide, a Llama's key and value heads are its heads, its head untied; a Qwen3's heads are
# 128 wide whatever its width. GPT-2's defaults (4 h MLP, every head a key and value head, a tied
# head) are the reader's own.
_DEFAULTED = ("intermediate_size", "num_key_value_heads", "tie_word_embeddings", "head_dim")
# The families whose heads' default width is their own (Gemma's 256, Qwen3's 128), not hidden / heads.
_HEADS_OF_THEIR_OWN_WIDTH = ("gemma", "gemma2", "qwen3")


def shape_problem(fields: Mapping) -> str | None:
    """Why the simulator would price another model than the one a config describes, in words, or
    None. It knows the shapes of GPT-2 and of Llama's family; another family's MLP, norms, attention
    or experts are its modelling code's, which it never reads. And a size a config of Llama's family
    leaves to its model type's default is transformers' config class's, which this reader does not
    import (it runs without torch): a config ``save_pretrained`` wrote gives every size."""
    kind = fields.get("model_type")
    if kind not in (*GATED_RMSNORM_FAMILIES, "gpt2"):
        return (f"its model_type {shown(kind, 60)} is not one whose shape the simulator knows (gpt2, and Llama's "
                f"family: {', '.join(GATED_RMSNORM_FAMILIES)}): describe the model as a mapping instead, "
                f"--model '{{layers: L, hidden: H, heads: A, vocab: V, seq_len: S, ...}}' (docs/simulator.md)")
    left = [key for key in _DEFAULTED if fields.get(key) is None
            and (key != "head_dim" or kind in _HEADS_OF_THEIR_OWN_WIDTH)]
    if kind == "gpt2" or not left:
        return None
    return (f"its config leaves {', '.join(left)} to {kind}'s defaults, which transformers' config class for "
            f"{kind} holds: give {'them' if len(left) > 1 else 'it'} in the config, as save_pretrained writes it")


def spec_from_config(fields: Mapping, *, name: str, seq_len: int, gated: bool | None = None) -> ModelSpec:
    """The decoder ``fields`` describe at ``seq_len`` tokens; ``gated``: whether its MLP is (default:
    by its family). Raises ``ValueError`` when the config names no sizes this reader knows."""
    def first(*keys):
        return next((fields[key] for key in keys if fields.get(key) is not None), None)

    layers, hidden = first("num_hidden_layers", "n_layer"), first("hidden_size", "n_embd")
    heads, vocab = first("num_attention_heads", "n_head"), first("vocab_size")
    if None in (layers, hidden, heads, vocab):
        raise ValueError(f"{name}: its config gives no layers, hidden size, heads or vocabulary under the names "
                         f"Llama's or GPT-2's configs use (num_hidden_layers/n_layer, hidden_size/n_embd, "
                         f"num_attention_heads/n_head, vocab_size)")
    llama_like = fields.get("model_type") in GATED_RMSNORM_FAMILIES
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=first("num_key_value_heads"),
                     head_dim=first("head_dim") if llama_like else None,  # GPT-2's heads are hidden / heads
                     vocab=vocab, seq_len=seq_len, ffn_hidden=first("intermediate_size", "n_inner"),
                     ffn_gated=llama_like if gated is None else gated, norm="rmsnorm" if llama_like else "layernorm",
                     tied_embeddings=bool(fields.get("tie_word_embeddings", True)),
                     learned_positions=not llama_like,  # a table of the config's positions, at any length trained
                     positions=None if llama_like else first("n_positions", "max_position_embeddings"))
