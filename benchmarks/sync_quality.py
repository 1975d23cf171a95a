"""Training quality of sync every H steps (DiLoCo, Streaming DiLoCo) against synchronous training at
equal tokens, and the bytes each sends across nodes per token.

    python benchmarks/sync_quality.py --out-dir benchmarks/results/sync
    python benchmarks/sync_quality.py --clusters 2x1 --parallel 8 --out-dir benchmarks/results/sync-medium \
        -- --model medium --batch 4 --steps 300

Each cluster NODESxRANKS is emulated on this machine as NODES torchrun launchers of RANKS workers each
(loopback between them; a link's speed changes no value computed), running ``python -m shardwire
train --layout hybrid --shard-group-size RANKS``: a group is a node, so what crosses between the
groups travels, quantized or not, as it would between nodes. Per cluster the reference is synchronous
training (hybrid: each gradient shard all-reduced between the groups at every step, which between
nodes of one rank is DDP), with another seed beside it to show how far the loss moves for reasons
that have nothing to do with syncing; then sync every H steps for each ``--every`` and
``--fragments`` with the sync's other settings at their defaults (int4 with error feedback, plain
averaging, each sync overlapped with the inner steps until the next fragment's) or as ``--base``
sets them, and the ``--also`` settings. Every run of a cluster trains on the same tokens: the
same steps, batch and ranks. ``--parallel`` runs that many at once (each worker takes one thread):
on a machine with as many cores as their workers, what each computes is the same.

Loss: the final validation loss is the one the job prints at its end, after ``diloco_sync`` made the
groups one model; the curves are the validation losses every ``--eval-every`` steps (under sync, the
mean over the groups' own models, which differ between syncs).

Synchronous first (``--after-synchronous N``, post-local SGD): each sync setting also runs resumed
from the synchronous run's checkpoint of step N, so that the groups train together for N steps and
apart after (``shardwire train`` resumes a checkpoint saved without ``--diloco`` into a sync: its
parameters become the anchor). Its bytes per token count the N synchronous steps at the synchronous
run's rate.

Bytes: every step is profiled (``--profile``). The all-reduces between the groups are what crosses
nodes (the gradient norm's scalar all-reduce within a group adds 8 bytes a step), counted as the
engine's ``CommRecord`` counts them (wire bytes, in nccl-tests' size of an all-reduce). Bytes per
token: their mean per step over the tokens of a step, the syncs' steady rate; the final
``diloco_sync``, one more all-reduce of the whole model, is not in it.

Targets (from the issue): final validation loss at most 2% above synchronous training's (a lower
one meets it too); at least 100x fewer bytes across nodes per token than synchronous training (DDP
between nodes of one rank).
It writes sync.json (every loss and byte count), sync.md (the table) and sync.png (the curves).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measure import losses, train_on_nodes, write_report  # noqa: E402

LOSS_TOLERANCE, BYTES_FACTOR = 0.02, 100


def run_job(cluster: str, sync: str, train_args: list[str]) -> dict:
    """One run on ``cluster`` (NODESxRANKS) with ``--diloco sync``: rank 0's losses, the bytes its
    all-reduces sent per step, from its profile, and the steps it ran."""
    nodes, ranks = (int(n) for n in cluster.split("x"))
    what = f"on {cluster} with --diloco {sync}"
    with tempfile.TemporaryDirectory() as run_dir:
        output = train_on_nodes(nodes, ranks, ["--backend", "gloo", "--layout", "hybrid", "--shard-group-size",
                                               str(ranks), "--diloco", sync, "--profile", "--run-dir", run_dir,
                                               *train_args], what=what)
        with open(os.path.join(run_dir, "profile.json")) as f:
            profile = json.load(f)
    train_loss, val_loss, final = losses(output)
    if final is None:
        raise RuntimeError(f"no final validation loss in the output of the run {what}:\n{output[-2000:]}")
    sent = [_rank_0(step)["all_reduce_wire_bytes"] for step in profile["steps"]]
    return {"train_loss": train_loss, "val_loss": val_loss, "final_val_loss": final, "steps": len(sent),
            "all_reduce_wire_bytes_per_step": sum(sent) / len(sent),
            "tokens_per_step": profile["tokens_per_step"] / (nodes * ranks)}  # rank 0's


def _rank_0(step: dict) -> dict:
    ranks = step["ranks"]
    return ranks[0] if isinstance(ranks, list) else ranks["0"]


def runs_of(args, checkpoints: str) -> tuple[list[tuple], list[tuple]]:
    """(cluster, label, --diloco, more options, resumed from step) of every run: those that start
    afresh, each cluster's reference first (saving its checkpoints in ``checkpoints/CLUSTER`` for
    ``--after-synchronous``), then those resumed from them."""
    syncs = [f"sync_every={every},fragments={fragments}" for every in args.every for fragments in args.fragments]
    syncs = [(sync, f"{args.base},{sync}" if args.base else sync) for sync in [*syncs, *args.also]]
    saving = []
    if args.after_synchronous:
        saving = ["--save-every", str(math.gcd(*args.after_synchronous)), "--keep", "0"]
    fresh, resumed = [], []
    for cluster in args.clusters:
        fresh += [(cluster, "synchronous", "none", ["--checkpoint-dir", os.path.join(checkpoints, cluster), *saving]
                   if saving else [], None),
                  (cluster, "synchronous, seed 1", "none", ["--seed", "1"], None)]
        fresh += [(cluster, label, sync, [], None) for label, sync in syncs]
        resumed += [(cluster, f"{label} after {step} synchronous steps", sync, [], step)
                    for step in args.after_synchronous for label, sync in syncs]
    return fresh, resumed


def resume(checkpoints: str, cluster: str, step: int, label: str) -> list[str]:
    """Options that resume a run from the synchronous run's checkpoint of ``step`` alone: a directory
    of its own holding a copy of that checkpoint (the run then saves only at its end)."""
    saved = os.path.join(checkpoints, cluster, f"step_{step:08d}")
    if not os.path.isdir(saved):
        raise SystemExit(f"the synchronous run on {cluster} saved no checkpoint at step {step}: "
                         f"--after-synchronous takes steps before the job's last")
    directory = os.path.join(checkpoints, f"{cluster} {label}")
    shutil.copytree(saved, os.path.join(directory, os.path.basename(saved)))
    return ["--checkpoint-dir", directory, "--save-every", "1000000000"]


def with_synchronous_start(run: dict, reference: dict, step: int) -> dict:
    """A run resumed at ``step`` as the whole job: the reference's first ``step`` steps, their losses
    and bytes, before its own."""
    steps = step + run["steps"]
    sent = step * reference["all_reduce_wire_bytes_per_step"] + run["steps"] * run["all_reduce_wire_bytes_per_step"]
    before = {key: {s: loss for s, loss in reference[key].items() if s <= step} for key in ("train_loss", "val_loss")}
    return {**run, "steps": steps, "all_reduce_wire_bytes_per_step": sent / steps, "synchronous_steps": step,
            "train_loss": {**before["train_loss"], **run["train_loss"]},
            "val_loss": {**before["val_loss"], **run["val_loss"]}}


def rows_of(results: dict[str, dict[str, dict]]) -> list[dict]:
    rows = []
    for cluster, runs in results.items():
        reference = runs["synchronous"]
        reference_bytes = reference["all_reduce_wire_bytes_per_step"] / reference["tokens_per_step"]
        for label, run in runs.items():
            relative = run["final_val_loss"] / reference["final_val_loss"] - 1
            per_token = run["all_reduce_wire_bytes_per_step"] / run["tokens_per_step"]
            synced = not label.startswith("synchronous")
            # one node (one group: Lookahead against data parallelism) sends nothing across nodes
            fewer = reference_bytes / per_token if per_token else math.inf
            rows.append({
                "cluster": cluster, "run": label, "final_val_loss": run["final_val_loss"],
                "relative_to_synchronous": relative, "bytes_per_token": per_token,
                "fewer_bytes_than_synchronous": fewer,
                "met": None if not synced else relative <= LOSS_TOLERANCE and fewer >= BYTES_FACTOR,
            })
    return rows


def table(rows: list[dict], command: str) -> str:
    lines = [f"`{command}`", "",
             "| cluster | run | final validation loss | vs synchronous | bytes across nodes per token | "
             "fewer than synchronous | at most 2% above, 100x fewer |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        met = "" if row["met"] is None else ("yes" if row["met"] else "no")
        lines.append(f"| {row['cluster']} | {row['run']} | {row['final_val_loss']:.4f} | "
                     f"{row['relative_to_synchronous']:+.2%} | {row['bytes_per_token']:.1f} | "
                     f"{row['fewer_bytes_than_synchronous']:.0f}x | {met} |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for panel, (cluster, runs) in zip(axes[0], results.items()):
        for label, run in runs.items():
            steps = sorted(run["val_loss"])
            style = "-" if label.startswith("synchronous") else "--"
            panel.plot(steps, [run["val_loss"][s] for s in steps], style, marker=".", label=label, linewidth=1)
        panel.set(xlabel="step", ylabel="validation loss", title=f"{cluster}: validation loss against synchronous")
        panel.legend(fontsize=7)
        panel.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default="benchmarks/results/sync")
    parser.add_argument("--clusters", nargs="+", default=["2x1", "4x1"], help="NODESxRANKS each")
    parser.add_argument("--every", nargs="+", type=int, default=[5, 20, 50])
    parser.add_argument("--fragments", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--also", nargs="*", help="more --diloco settings to run on each cluster",
                        default=["sync_every=20,fragments=4,fragment_sync_delay=0",
                                 "sync_every=20,fragments=4,wire=none",
                                 "sync_every=20,fragments=4,outer_lr=0.7,momentum=0.9"])
    parser.add_argument("--base", default="", help="key=value settings of every sync run, before its own "
                                                   "(which win), e.g. outer_lr=0.7,momentum=0.9")
    parser.add_argument("--after-synchronous", nargs="*", type=int, default=[], metavar="N",
                        help="also run each sync setting resumed from the synchronous run's step N")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--parallel", type=int, default=1, help="runs at once")
    parser.add_argument("train_args", nargs="*", help="more `shardwire train` options, after --")
    args = parser.parse_args()
    if any(step < 1 for step in args.after_synchronous):
        parser.error(f"--after-synchronous takes steps from 1, got {args.after_synchronous}")
    train_args = ["--eval-every", str(args.eval_every), "--log-every", str(args.eval_every), *args.train_args]
    results: dict[str, dict[str, dict]] = {}

    def run(spec: tuple) -> None:
        cluster, label, sync, extra, step = spec
        if step is not None:
            extra = resume(checkpoints, cluster, step, label)
        result = run_job(cluster, sync, [*train_args, *extra])
        if step is not None:
            result = with_synchronous_start(result, results[cluster]["synchronous"], step)
        print(f"{cluster} {label}: final validation loss {result['final_val_loss']:.4f}, "
              f"{result['all_reduce_wire_bytes_per_step'] / result['tokens_per_step']:.1f} bytes across nodes "
              f"per token", file=sys.stderr, flush=True)
        results.setdefault(cluster, {})[label] = result

    with tempfile.TemporaryDirectory() as checkpoints, ThreadPoolExecutor(args.parallel) as pool:
        fresh, resumed = runs_of(args, checkpoints)
        for phase in (fresh, resumed):  # the resumed runs start from the references' checkpoints
            list(pool.map(run, phase))
    results = {cluster: {label: results[cluster][label] for c, label, *_ in fresh + resumed if c == cluster}
               for cluster in args.clusters}  # in the order of the runs, not of their ends
    command = " ".join(["python", "benchmarks/sync_quality.py", *sys.argv[1:]])
    rows = rows_of(results)
    write_report(args.out_dir, "sync", {"command": command, "train_args": train_args, "runs": results, "rows": rows},
                 table(rows, command), lambda path: plot(results, path))


if __name__ == "__main__":
    main()
