"""The Ray Train example: two CPU workers train the GPT through ``TorchTrainer``, in the process group
Ray made, and report the same losses as the same function on two gloo ranks started without Ray."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import sys
import tempfile

import pytest
import torch

from harness import run_workers

pytest.importorskip("ray.train.torch", reason="the ray extra is not installed (pip install -e '.[ray]')")
pytestmark = pytest.mark.slow

CONFIG = {"model": "tiny", "steps": 6, "batch": 4, "lr": 3e-3}


def example():
    path = pathlib.Path(__file__).parents[1] / "examples" / "ray_train.py"
    spec = importlib.util.spec_from_file_location("ray_train", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def without_ray(rank, world):
    reports = []
    example().train(CONFIG, reports.append, torch.device("cpu"))
    return reports


def test_ray_trains_as_a_plain_process_group_does(tmp_path):
    import ray

    sessions = tempfile.mkdtemp(prefix="ray-")  # short: Ray's sockets live under it (108-byte limit)
    examples = str(pathlib.Path(__file__).parents[1] / "examples")  # where Ray's workers import it from
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=sessions,
             runtime_env={"env_vars": {"PYTHONPATH": examples}})
    try:
        records = example().fit(CONFIG, workers=2, storage=str(tmp_path))
    finally:
        ray.shutdown()
        shutil.rmtree(sessions, ignore_errors=True)
    plain = run_workers(2, without_ray)[0]
    assert [r["step"] for r in records] == [r["step"] for r in plain] == list(range(1, 7))
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in plain], rel=1e-5)
    assert records[-1]["loss"] < records[0]["loss"]
