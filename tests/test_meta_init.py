"""A model built on the meta device is made by ``shard`` a unit at a time: its values bit-equal to the
whole model materialized and initialised the same way, on every rank and layout, and no rank's
memory ever holds more than its shards and about one unit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwire
from harness import peak_allocated, run_workers
from shardwire.models.gpt import GPT, PRESETS, Block, GPTConfig

HF_CONFIGS = {
    "llama": {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64},
    "qwen2": {"model_type": "qwen2", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": True},
    "gpt2": {"model_type": "gpt2", "vocab_size": 128, "n_embd": 32, "n_layer": 3, "n_head": 4, "n_positions": 64,
             "bos_token_id": 0, "eos_token_id": 0},
}
SEED = 3


def _builders() -> dict:
    """Each model's meta build and the initialisation ``shard`` is given for it (None: the default)."""
    builders = {"gpt": (lambda: GPT(PRESETS["tiny"]), lambda model: model.init_module)}
    try:
        import transformers
    except ImportError:
        return builders
    for name, config in HF_CONFIGS.items():
        config = transformers.AutoConfig.for_model(**config)
        builders[name] = (lambda config=config: transformers.AutoModelForCausalLM.from_config(config),
                          lambda model: None)
    return builders


def _reference(build, init_of) -> nn.Module:
    """The whole model made the same way: ``to_empty``, its ties restored, then the initialisation."""
    with torch.device("meta"):
        model = build()
    ties = _ties(model)
    model.to_empty(device="cpu")
    for name, target in ties.items():  # to_empty gives each place a tensor of its own
        module, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module), attr, model.get_parameter(target))
    torch.manual_seed(SEED)
    init = init_of(model)
    if init is not None:
        model.apply(init)
    else:
        model.initialize_weights()
    return model


def _ties(model: nn.Module) -> dict[str, str]:
    """Each name of a parameter that has an earlier name, with that earlier name."""
    first: dict[int, str] = {}
    ties = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            ties[name] = first[id(param)]
        else:
            first[id(param)] = name
    return ties


def _made_on_meta(rank, world, group_size):
    """Each model built on the meta device and sharded; what differs from the reference, by model."""
    differences = {}
    for name, (build, init_of) in _builders().items():
        reference = _reference(build, init_of)
        with torch.device("meta"):
            model = build()
        # rank 0's generator decides the values; another rank's own is left as it was
        torch.manual_seed(SEED if rank == 0 else 1000 + rank)
        before = torch.get_rng_state()
        layout = "full" if group_size == world else "hybrid"
        shardwire.shard(model, units=[Block] if name == "gpt" else None, init=init_of(model), layout=layout,
                        shard_group_size=group_size)
        if rank != 0:
            assert torch.equal(torch.get_rng_state(), before), "a rank's own generator was moved"
        expected = dict(reference.named_parameters())
        made = {key: param.full_tensor() for key, param in model.named_parameters()}
        wrong = [key for key, value in expected.items() if not torch.equal(made[key], value)]
        wrong += [key for key, value in reference.named_buffers() if not torch.equal(model.get_buffer(key), value)]
        assert made.keys() == expected.keys()
        differences[name] = wrong
        if name == "gpt":  # tied as built: the head is the embedding
            assert model.head.weight.param_name == "tok_emb.weight"
    return differences


@pytest.mark.slow
@pytest.mark.parametrize("world, group_size", [(1, 1), (2, 2)], ids=["world-1", "full-2"])
def test_meta_models_are_made_bit_equal_to_the_whole_model_initialised(world, group_size):
    for differences in run_workers(world, _made_on_meta, group_size):
        assert differences == {name: [] for name in differences}
    assert len(differences) == (4 if _has_transformers() else 1)


@pytest.mark.slow
@pytest.mark.parametrize("world, group_size", [(3, 3), (4, 2)], ids=["full-3", "hybrid-2x2"])
def test_meta_models_are_made_bit_equal_on_more_ranks_and_hybrid(world, group_size):
    for differences in run_workers(world, _made_on_meta, group_size, timeout=300):
        assert differences == {name: [] for name in differences}


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _peak_growth(rank, world, on_meta):
    """MiB this rank's tensors grew by at most while a 400 MB GPT was built and sharded, and its
    shards' and a unit's MiB (``harness.peak_allocated``: what torch allocated, whether or not it
    was written)."""
    with torch.device("meta"):  # loads what sharding first uses (DTensor, the mesh), outside the count
        small = GPT(PRESETS["tiny"])
    shardwire.shard(small, units=[Block], init=small.init_module)
    config = GPTConfig(vocab_size=256, seq_len=64, layers=8, hidden=1024, heads=8, dropout=0.0)
    built = []

    def build() -> None:
        with torch.device("meta" if on_meta else "cpu"):
            model = GPT(config)
        built.append(shardwire.shard(model, units=[Block], init=model.init_module if on_meta else None))

    peak = peak_allocated(build) / 2**20
    model = built[0]
    shards = sum(p.to_local().numel() * 4 for p in model.parameters()) / 2**20
    unit = sum(p.numel() * 4 for p in model.blocks[0].parameters()) / 2**20
    return peak, shards, unit


@pytest.mark.slow
def test_making_a_meta_model_holds_its_shards_and_about_one_unit():
    (grown, shards, unit), _ = run_workers(2, _peak_growth, True)
    whole = 2 * shards
    # the shards and the unit being cut, its flat buffers holding nothing until they are gathered:
    # never the whole model (the shards 193 MiB, a unit 48; the root's 0.3)
    assert grown <= shards + unit + 4 < whole, (grown, shards, unit)
    (eager, _, _), _ = run_workers(2, _peak_growth, False)
    assert eager >= whole, (eager, whole)  # the test measures what it should: an eager build holds it whole


class _Masked(nn.Module):
    """A block whose causal mask is computed in ``__init__``: empty when built on the meta device."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)


def test_a_buffer_the_initialisation_leaves_unset_is_an_error():
    with torch.device("meta"):
        model = nn.Sequential(nn.ModuleList([_Masked(), _Masked()]))
    with pytest.raises(ValueError, match=r"buffer\(s\) '0.0.mask', '0.1.mask' were left unset.*reset_parameters"):
        shardwire.shard(model)


def test_an_initialisation_that_writes_a_unit_already_made_is_an_error():
    with torch.device("meta"):
        model = GPT(PRESETS["tiny"])

    def late(module):  # the model's own init reaching into its blocks, after they were made
        model.init_module(module)
        if isinstance(module, GPT):
            nn.init.zeros_(module.blocks[0].mlp.up.weight)

    with pytest.raises(ValueError, match=r"initialisation of the model \(GPT\) writes a parameter of 'blocks.0'"):
        shardwire.shard(model, units=[Block], init=late)


def test_init_and_device_are_for_meta_models():
    with pytest.raises(ValueError, match="init= initialises a model built on the meta device.*on cpu"):
        shardwire.shard(GPT(PRESETS["tiny"]), init=lambda module: None)
    with torch.device("meta"):
        model = GPT(PRESETS["tiny"])
    with pytest.raises(ValueError, match="device='meta' has no storage"):
        shardwire.shard(model, device="meta")
    with pytest.raises(ValueError, match=r"^device='z+\.\.\.z+' is not a device: pass e.g. 'cuda'"):
        shardwire.shard(model, device="z" * 3000)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda', but torch sees no CUDA device here"):
            shardwire.shard(model, device="cuda")


class _Scaled(nn.Module):
    """A parameter of its own that no reset_parameters sets, and an integer buffer made in __init__."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.ones(4))
        self.codes = nn.Parameter(torch.arange(4), requires_grad=False)  # an integer parameter
        self.register_buffer("order", torch.arange(4).flip(0))

    def forward(self, x):
        return self.lin(x)[:, self.order] * self.gain


class _Table(nn.Module):
    """A small integer table whose values include the dtype's largest (255 in uint8)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.empty(256, dtype=torch.uint8))

    def reset_parameters(self):
        self.lin.reset_parameters()
        self.table.copy_(torch.arange(256, dtype=torch.uint8))


def test_a_small_integer_table_holding_its_largest_value_is_set():
    with torch.device("meta"):
        model = _Table()
    shardwire.shard(model, init=lambda m: isinstance(m, _Table) and m.reset_parameters())
    assert torch.equal(model.get_buffer("table"), torch.arange(256, dtype=torch.uint8))


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Scaled() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _set_linears(module):
    if isinstance(module, nn.Linear):
        module.reset_parameters()


@pytest.mark.parametrize("init, unset", [
    (None, r"parameter\(s\) 'blocks\.0\.gain', 'blocks\.0\.codes' were left unset"),
    (lambda m: _set_linears(m) or (isinstance(m, _Scaled) and nn.init.ones_(m.gain)),
     r"parameter\(s\) 'blocks\.0\.codes' were left unset"),
    (lambda m: _set_linears(m) or (isinstance(m, _Scaled) and (nn.init.ones_(m.gain), m.codes.data.zero_())),
     r"buffer\(s\) 'blocks\.0\.order', 'blocks\.1\.order' were left unset"),
    (lambda m: _set_linears(m) or (isinstance(m, _Scaled) and (m.gain.data[:2].fill_(1.0), m.codes.data.zero_())),
     r"parameter\(s\) 'blocks\.0\.gain' were left unset"),  # half of it written
    (lambda m: _set_linears(m) or (isinstance(m, _Scaled) and (nn.init.ones_(m.gain), m.codes[:2].zero_())),
     r"parameter\(s\) 'blocks\.0\.codes' were left unset"),  # half of an integer one written
], ids=["nothing sets a parameter", "nothing sets an integer parameter", "nothing sets an integer buffer",
        "half of a parameter set", "half of an integer parameter set"])
def test_values_the_initialisation_never_writes_are_an_error(init, unset):
    """Uninitialised storage would train as whatever memory held, integer buffers included."""
    with torch.device("meta"):
        model = _Stack()
    with pytest.raises(ValueError, match=unset + ": a model built on the meta device .*reset_parameters"):
        shardwire.shard(model, init=init)


def test_what_the_initialisation_writes_or_assigns_is_the_model():
    def init(module):
        _set_linears(module)
        if isinstance(module, _Scaled):
            module.gain = nn.Parameter(torch.full((4,), 2.0))  # assigned anew, not written in place
            module.codes.data.copy_(torch.arange(4))  # through .data, which no version counter sees
            module.order = torch.arange(4).flip(0)
    with torch.device("meta"):
        model = _Stack()
    shardwire.shard(model, init=init)
    state = shardwire.full_state_dict(model)
    assert torch.equal(state["blocks.1.gain"], torch.full((4,), 2.0))
    assert torch.equal(state["blocks.1.order"], torch.tensor([3, 2, 1, 0]))
    with pytest.raises(ValueError, match=r"initialisation of blocks\.0 \(_Scaled\) replaced it by a 3 torch\.float32, "
                                         r"where the model built it as a 4 torch\.float32 parameter 'gain'"):
        with torch.device("meta"):
            other = _Stack()
        shardwire.shard(other, init=lambda m: _set_linears(m) or (
            isinstance(m, _Scaled) and setattr(m, "gain", nn.Parameter(torch.ones(3)))))
    with pytest.raises(ValueError, match=r"initialisation of blocks\.0 \(_Scaled\) assigned 'gain' with "
                                         r"requires_grad=False, where the model was built with True"):
        with torch.device("meta"):
            other = _Stack()
        shardwire.shard(other, init=lambda m: _set_linears(m) or (
            isinstance(m, _Scaled) and setattr(m, "gain", nn.Parameter(torch.ones(4), requires_grad=False))))
