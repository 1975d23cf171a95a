import pytest
from torch import nn

from shardwire.engine.selection import assign_params, select_units
from shardwire.models.gpt import GPT, PRESETS, Block, MLP


def names(selected):
    return [name for name, _ in selected]


def test_default_units_are_the_blocks_of_module_lists():
    model = GPT(PRESETS["tiny"])
    assert names(select_units(model, None)) == ["blocks.0", "blocks.1", "blocks.2"]


def test_default_on_a_model_without_module_list_is_one_root_unit():
    assert select_units(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), None) == []


def test_classes_and_predicates_select_the_same_units():
    model = GPT(PRESETS["tiny"])
    by_class = select_units(model, [Block])
    by_predicate = select_units(model, lambda m: isinstance(m, Block))
    assert names(by_class) == names(by_predicate) == ["blocks.0", "blocks.1", "blocks.2"]


def test_selection_errors_say_what_is_wrong():
    model = GPT(PRESETS["tiny"])
    with pytest.raises(ValueError, match="selects no module"):
        select_units(model, lambda m: False)
    with pytest.raises(ValueError, match="selects no module"):
        select_units(model, [nn.Conv2d])
    with pytest.raises(ValueError, match="units nest: 'blocks.0.mlp' lies inside 'blocks.0'"):
        select_units(model, [Block, MLP])
    with pytest.raises(ValueError, match="model itself"):
        select_units(model, [GPT])
    with pytest.raises(TypeError, match="list of nn.Module classes or a predicate"):
        select_units(model, ["Block"])


def test_tied_parameters_are_stored_once_in_the_root():
    model = GPT(PRESETS["tiny"])
    owned = assign_params(model, ["blocks.0", "blocks.1", "blocks.2"])
    root_names = [entry.names for entry in owned[""]]
    assert ["tok_emb.weight", "head.weight"] in root_names
    assert sum(len(entries) for entries in owned.values()) == len(list(model.parameters()))


def test_a_parameter_shared_by_two_units_moves_to_the_root():
    model = GPT(PRESETS["tiny"])
    model.blocks[1].mlp.up.weight = model.blocks[0].mlp.up.weight
    owned = assign_params(model, ["blocks.0", "blocks.1", "blocks.2"])
    root_names = [entry.names for entry in owned[""]]
    assert ["blocks.0.mlp.up.weight", "blocks.1.mlp.up.weight"] in root_names
    assert all("mlp.up.weight" not in n for entry in owned["blocks.0"] for n in entry.names)
