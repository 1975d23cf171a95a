"""The CUDA/NCCL suite: run where a GPU is, skipped with one line of reason everywhere else."""

import pathlib

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (the CUDA/NCCL path); none is visible")
    here = pathlib.Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(skip)
