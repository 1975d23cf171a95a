"""The model keeps its own parameters after ``shard``: names, param groups, frozen weights, state dicts.

Each sharded run is compared with a single process training the same model on the whole global batch.
"""

from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import shardwire
from harness import run_workers
from shardwire.comm.errors import ScheduleMismatchError
from shardwire.engine.shard import engine_of
from shardwire.models.gpt import GPT, PRESETS, Block, loss_fn

pytestmark = pytest.mark.slow

STEPS = 4
LOCAL_BATCH = 2
FOUR_BLOCKS = dataclasses.replace(PRESETS["tiny"], layers=4)


def mismatch(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-5) -> float:
    """The worst element's difference in units of ``torch.allclose``'s tolerance: at most 1 is close.

    The absolute tolerance is for elements near zero (biases start there), where Adam turns the
    rounding noise of a sum over ranks into updates of up to 1e-6 per step. A parameter in the wrong
    group moves 2e-3 (the other learning rate) or 6e-5 (decay 1.0 at lr 3e-3 on weights of 0.02)
    per step, far outside it."""
    return ((actual - expected).abs() / (atol + rtol * expected.abs())).max().item()


def token_batches(world: int, vocab: int, seq_len: int):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (world * LOCAL_BATCH, seq_len + 1), generator=gen) for _ in range(STEPS)]


def by_dimensions(name: str, param: nn.Parameter) -> bool:
    """nanoGPT's rule: decay matrices, not biases and norms (by the parameter's shape in the model)."""
    return param.dim() >= 2


def by_name(name: str, param: nn.Parameter) -> bool:
    """The Hugging Face Trainer's rule: no decay for biases and norms, told by name."""
    return not any(word in name for word in ("bias", "norm", "ln_"))


def train(model, batches, rows, forward, sharded: bool, decayed=by_dimensions) -> list[torch.Tensor]:
    """AdamW in decay / no-decay groups with two learning rates, over the trainable parameters;
    ``rows`` of each global batch are this process's, ``forward(model, tokens)`` gives the logits.
    Returns each step's loss, averaged over the ranks when ``sharded``."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([
        {"params": [p for name, p in named if decayed(name, p)], "weight_decay": 1.0, "lr": 3e-3},
        {"params": [p for name, p in named if not decayed(name, p)], "weight_decay": 0.0, "lr": 1e-3},
    ], eps=1e-6)
    losses = []
    for batch in batches:
        local = batch[rows]
        loss = loss_fn(forward(model, local[:, :-1]), local[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # sharded: DTensor norms, the whole model's
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    losses = torch.stack(losses)
    if sharded:
        dist.all_reduce(losses, op=dist.ReduceOp.AVG)
    return losses


def worst_error(rank, world, base, units, forward=lambda model, tokens: model(tokens), vocab=256, seq_len=32,
                decayed=by_dimensions) -> float:
    """Train ``base`` sharded and unsharded; the worst ``mismatch`` of any step's loss or any weight (rank 0)."""
    batches = token_batches(world, vocab, seq_len)
    reference = copy.deepcopy(base)
    expected_losses = train(reference, batches, slice(None), forward, sharded=False, decayed=decayed)
    model = shardwire.shard(copy.deepcopy(base), units=units)
    assert [name for name, _ in model.named_parameters()] == [name for name, _ in base.named_parameters()]
    losses = train(model, batches, slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH), forward, sharded=True,
                   decayed=decayed)
    state = shardwire.full_state_dict(model)
    if rank != 0:
        return 0.0
    expected = reference.state_dict()
    assert state.keys() == expected.keys()
    return max(mismatch(losses, expected_losses),
               *(mismatch(state[key], expected[key]) for key in expected if expected[key].is_floating_point()))


# ------------------------------------------------------------------ LoRA: frozen base, adapters


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update, in the same module."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # not zero, so both adapters train from step 1

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


def lora_gpt() -> GPT:
    """The GPT with LoRA adapters on every block's attention output and MLP input projections, every
    original weight frozen (embeddings included): only the adapters train."""
    model = GPT(FOUR_BLOCKS).requires_grad_(False)
    for block in model.blocks:
        block.attn.proj = LoRALinear(block.attn.proj)
        block.mlp.up = LoRALinear(block.mlp.up)
    return model


def _parity(rank, world):
    torch.manual_seed(0)
    errors = {"gpt, two groups": worst_error(rank, world, GPT(FOUR_BLOCKS), [Block])}
    base = lora_gpt()
    errors["lora"] = worst_error(rank, world, base, [Block])
    # An optimizer given every parameter steps only the adapters: frozen ones get no gradient, no
    # state, and keep their values.
    model = shardwire.shard(copy.deepcopy(base), units=[Block])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in token_batches(world, 256, 32):
        local = batch[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
        loss_fn(model(local[:, :-1]), local[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    stepped = {name for name, p in model.named_parameters() if p in optimizer.state}
    held = {name for name, p in model.named_parameters() if p.numel() > 0}
    state = shardwire.full_state_dict(model)
    frozen = {name for name, p in base.named_parameters() if not p.requires_grad}
    assert stepped == held - frozen
    if rank == 0:
        assert frozen and all(torch.equal(state[name], base.state_dict()[name]) for name in frozen)
        assert all(not torch.equal(state[name], p) for name, p in base.named_parameters() if p.requires_grad)
    return errors


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_param_groups_and_frozen_weights_match_a_single_process(world):
    """AdamW with decay / no-decay groups at two learning rates, on the GPT and on a LoRA model (a
    frozen base linear and trainable adapters in every block); world 3 pads the buffers."""
    for rank, errors in enumerate(run_workers(world, _parity, timeout=300)):
        for case, error in errors.items():
            assert error <= 1, f"world {world}, rank {rank}, {case}: {error:.1f} times the tolerance"


# ----------------------------------------------- a frozen unit is released after its backward


def _gathered_during_backward(rank, world):
    """Freeze blocks 1 and 2 whole; the embedding before them and the blocks after stay trainable,
    so backward passes through the frozen blocks to reach the embedding."""
    torch.manual_seed(0)
    model = GPT(FOUR_BLOCKS)
    for block in model.blocks[1:3]:
        block.requires_grad_(False)
    model = shardwire.shard(model, units=[Block])
    engine = engine_of(model)
    seen = {}

    def at_block0_backward(block, args, output):
        def record(grad):  # block 0's backward is next: blocks 2 and 1 are done
            seen["gathered"] = [unit.name for unit in engine.units if unit.is_gathered]
        output.register_hook(record)

    model.blocks[0].register_forward_hook(at_block0_backward)
    batch = token_batches(world, 256, 32)[0][rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
    loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
    grads = {name: p.grad is not None for name, p in model.named_parameters()}
    return seen["gathered"], grads


def test_a_frozen_unit_is_released_once_backward_has_passed_it():
    gathered, grads = run_workers(2, _gathered_during_backward)[0]
    assert "blocks.1" not in gathered and "blocks.2" not in gathered, gathered
    assert not any(grads[name] for name in grads if name.startswith(("blocks.1.", "blocks.2.")))
    assert grads["tok_emb.weight"], "backward went on through the frozen blocks to the embedding"


# --------------------------------------------------------------------------- state dicts


def _state_dicts(rank, world):
    torch.manual_seed(0)
    reference = GPT(FOUR_BLOCKS)
    model = shardwire.shard(copy.deepcopy(reference), units=[Block])
    initial = shardwire.full_state_dict(model)

    # DTensors of the whole shapes under the model's names, over this rank's rows; torch.save keeps them
    parts = model.state_dict()
    assert list(parts) == list(reference.state_dict())
    assert all(isinstance(parts[name], DTensor) and parts[name].shape == p.shape
               for name, p in reference.named_parameters())
    buffer = io.BytesIO()
    torch.save(parts, buffer)
    saved_parts = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)

    batch = token_batches(world, 256, 32)[0][rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
    optimizer.step()
    moved = shardwire.full_state_dict(model)

    model.load_state_dict(saved_parts)  # the parts back, strict
    restored = shardwire.full_state_dict(model)
    whole = [moved]
    dist.broadcast_object_list(whole, src=0)  # rank 0's whole state dict, on every rank
    model.load_state_dict(whole[0])
    reloaded = shardwire.full_state_dict(model)

    reassembled = {name: value.full_tensor() for name, value in model.state_dict().items()
                   if isinstance(value, DTensor)}

    # assign=True (FSDP2's load into a model made on the meta device), of parts and of whole tensors:
    # copied into the flat buffers, the module keeping its parameters, which train on
    held = list(model.parameters())
    model.load_state_dict(saved_parts, assign=True)
    assigned_parts = shardwire.full_state_dict(model)
    model.load_state_dict(whole[0], assign=True)
    assigned_whole = shardwire.full_state_dict(model)
    assert all(now is before for now, before in zip(model.parameters(), held))
    loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
    if rank != 0:
        return True
    assert all(torch.equal(assigned_parts[k], initial[k]) for k in initial)
    assert all(torch.equal(assigned_whole[k], moved[k]) for k in moved)
    unsharded = GPT(FOUR_BLOCKS)
    unsharded.load_state_dict(moved, strict=True)
    assert not all(torch.equal(moved[k], initial[k]) for k in initial)
    assert all(torch.equal(restored[k], initial[k]) for k in initial)
    for state in (reloaded, unsharded.state_dict()):
        assert all(torch.equal(state[k], moved[k]) for k in moved)
    assert all(torch.equal(reassembled[k], moved[k]) for k in reassembled)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_state_dict_round_trips_in_parts_and_whole(world):
    run_workers(world, _state_dicts)


def _loaded_on_rank_0(rank, world, then):
    """The DDP habit: weights loaded on rank 0 alone, then ``then``: what each rank was told."""
    torch.manual_seed(0)
    pretrained = GPT(FOUR_BLOCKS).state_dict()
    model = shardwire.shard(GPT(FOUR_BLOCKS), units=[Block])
    if rank == 0:
        model.load_state_dict(pretrained)
    try:
        if then == "forward":
            model(torch.zeros(1, 8, dtype=torch.long))
        elif then == "state dict":
            shardwire.full_state_dict(model)
        else:
            shardwire.save_checkpoint(f"{then}/checkpoint", model, step=0)
    except ScheduleMismatchError as err:
        return str(err)
    return "nothing"


@pytest.mark.parametrize("then", ["forward", "state dict", "checkpoint"])
def test_weights_loaded_on_some_ranks_alone_are_refused_before_they_are_read(then, tmp_path):
    """Each rank keeps its own rows of what it loads: loaded on rank 0 alone, the model was half the
    weights loaded and half the ones before, silently."""
    said = run_workers(2, _loaded_on_rank_0, str(tmp_path) if then == "checkpoint" else then)
    for rank, message in enumerate(said):
        assert message.startswith(f"rank {rank}: ranks issued different collectives, or loaded weights "
                                  f"(load_state_dict) on some ranks and not others, in "), message
    assert not (tmp_path / "checkpoint").exists()


# -------------------------------------------------------------- Hugging Face models, unmodified


def hf_model(transformers, kind: str):
    """A small ``kind`` model built from its config as it comes, ``use_cache`` included: its outputs carry
    a key/value cache, an object the engine cannot look into. No dropout, for parity."""
    if kind == "t5":
        config = transformers.T5Config(vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                       num_decoder_layers=2, num_heads=2, relative_attention_num_buckets=8,
                                       dropout_rate=0.0, decoder_start_token_id=0)
    elif kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                                         eos_token_id=2)
    else:
        config = transformers.AutoConfig.for_model(kind, num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                                                   max_position_embeddings=64)
    assert config.use_cache
    if kind == "t5":
        return transformers.T5ForConditionalGeneration(config)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _hf_parity(rank, world, kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = hf_model(transformers, kind)
    classes = {type(module).__name__: type(module) for module in model.modules()}
    units = [classes[name] for name in model._no_split_modules]  # the transformer block
    if kind == "t5":  # encoder and decoder read the same tokens
        forward = lambda model, tokens: model(input_ids=tokens, decoder_input_ids=tokens).logits  # noqa: E731
    else:
        forward = lambda model, tokens: model(tokens).logits  # noqa: E731
    return worst_error(rank, world, model, units, forward, vocab=128, seq_len=16, decayed=by_name)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2", "t5"])
def test_hugging_face_models_train_with_named_groups(kind):
    """Unmodified, ``use_cache`` on: the key/value cache in the outputs is a leaf the engine cannot
    look into, and training matches an unsharded run."""
    pytest.importorskip("transformers", reason="transformers is an optional extra: pip install 'shardwire[hf]'")
    for rank, error in enumerate(run_workers(2, _hf_parity, kind, timeout=300)):
        assert error <= 1, f"{kind}, rank {rank}: {error:.1f} times the tolerance"
