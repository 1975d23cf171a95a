"""The Ray Train example: two CPU workers train the GPT through ``TorchTrainer``, in the process group
Ray made, and report the same losses as the same script run by torchrun on two gloo ranks."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("ray.train.torch", reason="the ray extra is not installed (pip install -e '.[ray]')")
pytestmark = pytest.mark.slow

CONFIG = {"model": "tiny", "steps": 6, "batch": 4, "lr": 3e-3}
EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "ray_train.py"


def example():
    spec = importlib.util.spec_from_file_location("ray_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def under_torchrun() -> list[dict]:
    """The example's reports as ``torchrun --nproc-per-node 2 examples/ray_train.py`` prints them."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
         *[f"--{key}={value}" for key, value in CONFIG.items()]],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    lines = re.findall(r"^step (\d+): loss (\S+)$", done.stdout, re.MULTILINE)
    return [{"step": int(step), "loss": float(loss)} for step, loss in lines]


def test_ray_trains_as_torchrun_does(tmp_path):
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
    plain = under_torchrun()
    assert [r["step"] for r in records] == [r["step"] for r in plain] == list(range(1, 7))
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in plain], rel=1e-5)
    assert records[-1]["loss"] < records[0]["loss"]
