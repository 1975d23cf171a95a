"""shardwire under Ray Train: a ``TorchTrainer`` runs ``train`` on each of its workers, in the
process group Ray has already made (gloo for CPU workers, NCCL for GPU ones), which
``shardwire.shard`` joins as it would torchrun's.

    pip install -e '.[ray]'
    python examples/ray_train.py --workers 2               # CPU workers on this machine
    python examples/ray_train.py --workers 16 --gpu        # one GPU per worker, on a Ray cluster
    torchrun --nproc-per-node 2 examples/ray_train.py      # the same training, without Ray
"""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

import shardwire
from shardwire import worker
from shardwire.launch import under_launcher
from shardwire.models.gpt import GPT, PRESETS, Block, loss_fn
from shardwire.training.data import load_corpus


def train(config: dict, report: Callable[[dict], None], device: torch.device) -> None:
    """Train the GPT preset ``config["model"]`` for ``config["steps"]`` steps of ``config["batch"]``
    sequences per rank, reporting the loss averaged over ranks after each step. Whoever launched
    the workers made the process group: this runs the same under Ray and under torchrun."""
    model_config = PRESETS[config["model"]]
    torch.manual_seed(0)
    model = shardwire.shard(GPT(model_config).to(device), units=[Block])
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    corpus = load_corpus(None, model_config.seq_len)
    rank, world, batch = dist.get_rank(), dist.get_world_size(), config["batch"]
    for step in range(config["steps"]):
        rows = slice(rank * batch, (rank + 1) * batch)
        tokens = corpus.batch(step, batch * world, model_config.seq_len, rows=rows).to(device)
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        report({"step": step + 1, "loss": mean.item() / world})


def ray_worker(config: dict) -> list[dict]:
    """Train on one Ray worker, reporting to Ray as it goes; returns the reports (Ray hands the first
    worker's to ``fit``)."""
    import ray.train
    import ray.train.torch

    reports = []

    def report(metrics: dict) -> None:
        reports.append(metrics)
        ray.train.report(metrics)

    train(config, report, ray.train.torch.get_device())
    return reports


def fit(config: dict, workers: int, gpu: bool = False, storage: str | None = None) -> list[dict]:
    """Run ``train`` on ``workers`` Ray workers (results under ``storage``, default Ray's); every
    report, in order."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(ray_worker, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=workers, use_gpu=gpu),
                           run_config=RunConfig(name="shardwire", storage_path=storage))
    return trainer.fit().return_value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="Ray workers (under torchrun: its world)")
    parser.add_argument("--gpu", action="store_true", help="one GPU per Ray worker (under torchrun: where CUDA is)")
    parser.add_argument("--model", default="small", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8, help="sequences per worker")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    config = {"model": args.model, "steps": args.steps, "batch": args.batch, "lr": args.lr}
    if under_launcher():  # started by torchrun: its process group, its devices, no Ray
        device = worker.worker_device("auto")
        with worker.process_group(device, datetime.timedelta(minutes=10)):
            records = []
            train(config, records.append, device)
            if dist.get_rank() != 0:
                return
    else:
        records = fit(config, args.workers, args.gpu)
    for record in records:
        print(f"step {record['step']}: loss {record['loss']:.6f}")


if __name__ == "__main__":
    main()
