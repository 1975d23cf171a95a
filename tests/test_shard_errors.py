"""Bad input to the engine gets a clear error that says what was wrong and what to do."""

import datetime
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import shardwire
from harness import CheckpointedGPT
from shardwire import worker
from shardwire.models.gpt import GPT, PRESETS, Block


def tiny_gpt():
    torch.manual_seed(0)
    return GPT(PRESETS["tiny"])


@pytest.fixture
def world_of_one():
    """The process group of one rank that shard starts where none is, for what torch builds before it."""
    worker.ensure_initialized(torch.device("cpu"), datetime.timedelta(seconds=60))


@pytest.mark.slow
def test_world_of_one_without_a_process_group_trains():
    script = textwrap.dedent("""
        import torch, torch.distributed as dist, shardwire
        from shardwire.models.gpt import GPT, PRESETS, loss_fn
        assert not dist.is_initialized()
        model = shardwire.shard(GPT(PRESETS["tiny"]))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tokens = torch.randint(0, 256, (4, 33))
        losses = []
        for _ in range(5):
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward(); opt.step(); opt.zero_grad(); losses.append(loss.item())
        assert dist.get_world_size() == 1 and losses[-1] < losses[0], losses
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={"PATH": "/usr/bin:/bin"})
    assert result.stdout.strip() == "ok", result.stderr


def test_parameters_on_several_devices():
    model = tiny_gpt()
    model.blocks[1].to("meta")
    with pytest.raises(ValueError, match=r"several devices \(cpu: .*; meta: blocks\.1\..*move the whole model"):
        shardwire.shard(model)


def test_sharding_twice():
    model = shardwire.shard(tiny_gpt())
    with pytest.raises(ValueError, match="this model is already sharded"):
        shardwire.shard(model)


def test_sharding_a_model_whose_submodule_is_sharded():
    model = tiny_gpt()
    shardwire.shard(model.blocks[0])
    with pytest.raises(ValueError, match="submodule 'blocks.0' is already sharded"):
        shardwire.shard(model)


@pytest.mark.parametrize("where, message", [
    ("blocks.0", "its submodule 'blocks.0' went through torch's fully_shard: remove the fully_shard calls"),
    ("", "this model went through torch's fully_shard: remove the fully_shard calls"),
])
def test_a_model_fully_sharded_by_fsdp2_is_refused(world_of_one, where, message):
    """A port from FSDP2 that kept a fully_shard call: its DTensors failed deep inside torch."""
    from torch.distributed.fsdp import fully_shard

    model = tiny_gpt()
    fully_shard(model.get_submodule(where))
    with pytest.raises(ValueError, match=message):
        shardwire.shard(model, units=[Block])


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_a_model_wrapped_by_fsdp1_is_refused(world_of_one, use_orig_params):
    """It was taken as a model, its flat parameters as the model's own: trained to other losses than
    the model's, or failed deep inside FSDP1's backward."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapped = FullyShardedDataParallel(tiny_gpt(), device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    with pytest.raises(ValueError, match=r"^this model went through torch's FullyShardedDataParallel \(FSDP1\), which "
                                         r"flattened its parameters in place: build the model again without it"):
        shardwire.shard(wrapped, units=[Block])
    if not use_orig_params:  # the module inside holds one flat parameter, which would train nothing
        with pytest.raises(ValueError, match=r"^its parameter '_flat_param' went through torch's "
                                             r"FullyShardedDataParallel \(FSDP1\)"):
            shardwire.shard(wrapped.module, units=[Block])


def test_a_model_of_dtensors_is_refused(world_of_one):
    from torch.distributed.tensor import DeviceMesh, Replicate, distribute_tensor

    model = nn.Sequential(nn.Linear(4, 4))
    mesh = DeviceMesh("cpu", [0])
    model[0].weight = nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh, [Replicate()]))
    with pytest.raises(ValueError, match=r"parameter '0\.weight' is already a DTensor \(tensor parallelism"):
        shardwire.shard(model)


def test_unit_selection_errors_reach_the_caller():
    with pytest.raises(ValueError, match="selects no module"):
        shardwire.shard(tiny_gpt(), units=lambda m: False)
    with pytest.raises(ValueError, match="units nest"):
        shardwire.shard(tiny_gpt(), units=[Block, nn.LayerNorm])


@pytest.mark.parametrize("kwargs, message", [
    (dict(prefetch=-1), "prefetch must be a non-negative integer"),
    (dict(prefetch=True), "prefetch must be a non-negative integer .*, got True"),
    (dict(reshard_after_forward="no"), "reshard_after_forward must be True or False, got 'no'"),
    (dict(reshard_after_forward=8), "got 8 .*FSDP2's integer.*layout='hybrid_secondary'"),
    (dict(activation_checkpointing=2), "activation_checkpointing must be True or False, got 2"),
    (dict(activation_checkpointing="no"), "activation_checkpointing must be True or False, got 'no'"),
    (dict(mixed_precision="int4"), "mixed_precision='int4' is not understood"),
    (dict(mixed_precision="x" * 5000), r"mixed_precision='x+\.\.\.x+' is not understood"),
    (dict(layout="y" * 3000), r"layout must be one of .*, got 'y+\.\.\.y+'$"),
    (dict(timeout=0), "timeout must be a positive number of seconds"),
    (dict(compile="max-autotune"), "compile='max-autotune' is not understood: pass True, or a dict"),
    (dict(compile={"mod": "max-autotune"}), "torch.compile takes no 'mod'; its keyword arguments are"),
])
def test_bad_options(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message) as raised:
        shardwire.shard(tiny_gpt(), **kwargs)
    assert len(str(raised.value)) < 400


def test_compile_options_torch_refuses_leave_the_model_as_it_was():
    model = tiny_gpt()
    with pytest.raises(RuntimeError, match="Unrecognized mode=fastest"):
        shardwire.shard(model, compile={"mode": "fastest"})
    shardwire.shard(model)


def test_a_model_without_parameters():
    with pytest.raises(ValueError, match="has no parameters to shard"):
        shardwire.shard(nn.ReLU())


def test_helpers_on_an_unsharded_model():
    for helper in (lambda m: shardwire.clip_grad_norm_(m, 1.0), shardwire.full_state_dict):
        with pytest.raises(ValueError, match="GPT is not sharded: call shardwire.shard"):
            helper(tiny_gpt())


def test_calling_a_unit_on_its_own():
    model = shardwire.shard(tiny_gpt(), units=[Block])
    with pytest.raises(RuntimeError, match="'blocks.0' was called outside the sharded model's forward"):
        model.blocks[0](torch.zeros(1, 4, 32))


def test_the_models_forward_called_as_a_method_is_told_to_call_the_model():
    """``model.forward(x)`` (a generation loop's way) runs none of the hooks that gather the units: the
    error, raised at the first released weight, said the weights exist only in the forward it was in."""
    model = shardwire.shard(tiny_gpt(), units=[Block])
    with pytest.raises(RuntimeError, match=r"as calling the model runs them \(model\(x\); model.forward\(x\) runs "
                                           r"no hooks to gather them\)"):
        model.forward(torch.zeros(1, 4, dtype=torch.long))


def _all(blocks):
    """One region around every block."""
    def run(x):
        for block in blocks:
            x = block(x)
        return x
    return [run]


@pytest.mark.parametrize("regions, reentrant", [(_all, True), (_all, False), (lambda blocks: blocks[:1], True)],
                         ids=["reentrant around every block", "around every block", "reentrant around one"])
def test_a_checkpoint_that_cannot_recompute_a_unit_is_refused_naming_the_one_that_works(world_of_one, regions,
                                                                                         reentrant):
    """A reentrant checkpoint runs a unit's forward without gradients, and one region around several
    units recomputes them before backward reaches them, their parameters released: said so, not as a
    unit called on its own (one non-reentrant checkpoint around each unit, FSDP2 scripts' way, trains:
    tests/test_engine_correctness.py)."""
    torch.manual_seed(0)
    model = shardwire.shard(CheckpointedGPT(PRESETS["tiny"], regions, use_reentrant=reentrant), units=[Block])
    tokens = torch.randint(0, PRESETS["tiny"].vocab_size, (2, 8))
    with pytest.raises(RuntimeError, match=r"unit 'blocks.\d' was run again in backward before backward reached "
                                           r"it, as torch's checkpoint .* checkpoint each unit alone with "
                                           r"use_reentrant=False, or give shardwire.shard activation_checkpointing"):
        model(tokens).sum().backward()


def test_released_parameters_cannot_be_computed_with():
    model = shardwire.shard(tiny_gpt(), units=[Block])
    assert model.blocks[0].mlp.up.weight.shape == (128, 32)
    with pytest.raises(RuntimeError, match="'blocks.0.mlp.up.weight' belongs to sharded unit 'blocks.0', "
                                           "which is not gathered now.*full_state_dict"):
        nn.functional.linear(torch.zeros(1, 32), model.blocks[0].mlp.up.weight)


def test_training_goes_on_after_a_forward_or_backward_that_raised():
    from shardwire.models.gpt import loss_fn

    model = shardwire.shard(tiny_gpt(), units=[Block])
    reference = tiny_gpt()
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))

    def fail(*_):
        raise RuntimeError("boom")

    handle = model.blocks[1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        model(tokens[:, :-1])  # fails halfway through forward
    handle.remove()
    def fail_in_backward(block, args, output):
        output.register_hook(fail)

    handle = model.blocks[0].register_forward_hook(fail_in_backward)
    with pytest.raises(RuntimeError, match="boom"):
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()  # after blocks 2 and 1 reduced
    handle.remove()
    model.zero_grad(set_to_none=True)

    for m in (model, reference):
        loss_fn(m(tokens[:, :-1]), tokens[:, 1:]).backward()
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():  # one rank: each parameter's part is all of it
        grad = param.grad.to_local()
        assert torch.allclose(grad, expected[name].grad, rtol=1e-5, atol=1e-7), name


def test_requires_grad_changed_after_shard_is_an_error_at_the_next_forward():
    from shardwire.models.gpt import loss_fn

    model = shardwire.shard(tiny_gpt(), units=[Block])
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    dict(model.named_parameters())["blocks.1.mlp.up.weight"].requires_grad_(False)
    with pytest.raises(RuntimeError, match="requires_grad of 'blocks.1.mlp.up.weight' was set to False after "
                                           "shardwire.shard: .* set requires_grad before sharding"):
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:])


def test_a_peer_lost_in_the_gradient_norms_all_reduce_is_a_collective_error(monkeypatch):
    """DTensor's all-reduce of the norm raises torch's RuntimeError, which reached the user as a worker's
    traceback from deep inside torch: it is the collective failure every other one is."""
    import torch.distributed as dist

    from shardwire.comm.errors import CollectiveError
    model = shardwire.shard(tiny_gpt())

    def lost(*args, **kwargs):
        raise RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer")

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lost)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    with pytest.raises(CollectiveError, match=r"^rank 1: the gradient norm's all-reduce failed \(Connection closed by "
                                              r"peer\)\. Another rank has probably stopped"):
        shardwire.clip_grad_norm_(model, 1.0)


def test_a_forward_under_inference_mode_is_refused_naming_no_grad():
    """Its gathers made inference tensors of buffers the next step writes into: it failed in a
    collective, blaming another rank."""
    model = shardwire.shard(tiny_gpt(), units=[Block])
    tokens = torch.zeros(1, 8, dtype=torch.long)
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"^a sharded model does not run under "
                                                                   r"torch.inference_mode\(\): evaluate it under "
                                                                   r"torch.no_grad\(\)"):
        model(tokens)
    with torch.no_grad():
        model(tokens)


def test_a_load_into_a_part_of_a_sharded_model_is_refused_naming_the_whole_models_load():
    """Only the whole model's load cuts whole tensors to this rank's rows and tells the engine that
    weights were loaded: into a part, whole tensors failed inside torch, and a load on one rank
    went untold. A module wrapping the whole model (as torch.compile's does) loads through it."""
    model = shardwire.shard(tiny_gpt(), units=[Block])
    part = {key: value.full_tensor() for key, value in model.blocks[0].state_dict().items()}
    with pytest.raises(ValueError, match=r"^load_state_dict of a part of a sharded model \(blocks\.0\) does not load "
                                         r"it: load the part's keys under their whole names \(blocks\.0\.\*\) into "
                                         r"the whole sharded model, with model\.load_state_dict\(state, "
                                         r"strict=False\)$"):
        model.blocks[0].load_state_dict(part)
    model.load_state_dict({f"blocks.0.{key}": value for key, value in part.items()}, strict=False)
    wrapper = nn.ModuleDict({"inner": model})
    wrapper.load_state_dict({f"inner.{key}": value.full_tensor() for key, value in model.state_dict().items()})
