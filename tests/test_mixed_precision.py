import pytest
import torch

from shardwire import MixedPrecision


def test_names_and_policies():
    assert MixedPrecision.parse(None) == MixedPrecision()
    assert MixedPrecision.parse("fp32") == MixedPrecision()
    assert MixedPrecision.parse("bf16") == MixedPrecision(torch.bfloat16, torch.float32)
    assert MixedPrecision.parse("FP16") == MixedPrecision(torch.float16, torch.float32)
    policy = MixedPrecision(torch.bfloat16, torch.bfloat16)
    assert MixedPrecision.parse(policy) is policy


def test_unknown_name_says_what_is_accepted():
    with pytest.raises(ValueError, match="'int8' is not understood.*bf16"):
        MixedPrecision.parse("int8")
