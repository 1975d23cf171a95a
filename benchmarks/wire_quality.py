"""Training quality on a quantized wire: the default ``shardwire train`` job at full precision and on
each wire, same seeds, 2 ranks placed as 2 nodes, so that every byte the ranks exchange crosses
"nodes" and is quantized.

    python benchmarks/wire_quality.py --out-dir benchmarks/results/wire

Each run is two ``torchrun --nnodes 2 --nproc-per-node 1`` launchers on this machine (loopback
between them; the link's speed does not change what is computed), running ``python -m shardwire
train`` with its defaults plus ``--wire``, a validation loss every ``--eval-every`` steps and the
training loss of every step. Targets (relative to the full-precision run):

* final validation loss within 1% with int8 parameters and int8 gradients, within 2% with int4
  gradients;
* no spike: after step 50, no step's training loss more than 10% above the full-precision run's at
  the same step.

Full precision with another seed runs too, to show how far the loss moves for reasons that have
nothing to do with the wire, and int4 gradients without error feedback, to show what the feedback
is for; neither has a target. The final validation loss is the one taken at the last step.
It writes quality.json (every loss), quality.md (the table) and quality.png (the curves).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measure import losses, train_on_nodes, write_report  # noqa: E402

# Each run: its label, its --wire, the other options it adds, and its target (None: none).
RUNS = {
    "none": ("none", [], None),  # full precision: the reference
    "none, seed 1": ("none", ["--seed", "1"], None),  # how far another seed alone moves the loss
    "int8": ("int8", [], 0.01),
    "params=int8,grads=int4": ("params=int8,grads=int4", [], 0.02),
    "params=int8,grads=int4,error_feedback=off": ("params=int8,grads=int4,error_feedback=off", [], None),
}
SPIKE_AFTER, SPIKE_RATIO = 50, 1.10


def run_job(wire: str, train_args: list[str]) -> dict:
    """Two launchers of one rank each, as two nodes; rank 0's losses, parsed from its progress lines."""
    output = train_on_nodes(2, 1, ["--backend", "gloo", "--wire", wire, *train_args], what=f"with --wire {wire}")
    train_loss, val_loss, _ = losses(output)
    if not train_loss or max(train_loss) not in val_loss:
        raise RuntimeError(f"no validation loss at the last step in the output of the run with --wire {wire} "
                           f"(give --eval-every a divisor of the steps):\n{output[-2000:]}")
    return {"train_loss": train_loss, "val_loss": val_loss, "final_val_loss": val_loss[max(train_loss)]}


def verdicts(runs: dict[str, dict]) -> list[dict]:
    reference = runs["none"]
    rows = []
    for label, run in runs.items():
        relative = run["final_val_loss"] / reference["final_val_loss"] - 1
        excess = max(run["train_loss"][step] / loss for step, loss in reference["train_loss"].items()
                     if step > SPIKE_AFTER) - 1
        tolerance = RUNS[label][2]
        rows.append({
            "run": label,
            "final_val_loss": run["final_val_loss"],
            "relative_to_full_precision": relative,
            "worst_train_loss_excess_after_50": excess,
            "target": tolerance,
            "met": None if tolerance is None else abs(relative) <= tolerance and excess <= SPIKE_RATIO - 1,
        })
    return rows


def table(rows: list[dict], command: str) -> str:
    lines = [f"`{command}`", "",
             "| run | final validation loss | vs full precision | worst training loss after step 50 "
             "(vs full precision's at that step) | target | met |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        target = "reference" if row["run"] == "none" else (
            "none (for comparison)" if row["target"] is None else f"within {row['target']:.0%}, no step > +10%")
        met = "" if row["met"] is None else ("yes" if row["met"] else "no")
        lines.append(f"| {row['run']} | {row['final_val_loss']:.4f} | {row['relative_to_full_precision']:+.2%} "
                     f"| {row['worst_train_loss_excess_after_50']:+.1%} | {target} | {met} |")
    return "\n".join(lines)


def plot(runs: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (val_axes, train_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    reference = runs["none"]["train_loss"]
    for label, run in runs.items():
        steps = sorted(run["val_loss"])
        val_axes.plot(steps, [run["val_loss"][s] for s in steps], marker=".", label=label)
        after = [s for s in sorted(run["train_loss"]) if s > SPIKE_AFTER]
        train_axes.plot(after, [run["train_loss"][s] / reference[s] for s in after], label=label, linewidth=0.8)
    val_axes.set(xlabel="step", ylabel="validation loss", title="validation loss")
    train_axes.axhline(SPIKE_RATIO, color="red", linestyle=":", label="spike bound")
    train_axes.set(xlabel="step", ylabel="training loss / full precision's",
                   title=f"training loss against full precision's (after step {SPIKE_AFTER})")
    for axes in (val_axes, train_axes):
        axes.legend(fontsize=8)
        axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default="benchmarks/results/wire")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("train_args", nargs="*", help="more `shardwire train` options, after --")
    args = parser.parse_args()
    if "none" not in args.runs:
        parser.error("--runs must include none, the reference")
    train_args = ["--eval-every", str(args.eval_every), "--log-every", "1", *args.train_args]
    runs = {}
    for label in args.runs:
        wire, extra, _ = RUNS[label]
        runs[label] = run_job(wire, [*train_args, *extra])
        print(f"{label}: final validation loss {runs[label]['final_val_loss']:.4f}", file=sys.stderr, flush=True)
    command = " ".join(["python", "benchmarks/wire_quality.py", *sys.argv[1:]])
    rows = verdicts(runs)
    write_report(args.out_dir, "quality", {"command": command, "train_args": train_args, "runs": runs, "rows": rows},
                 table(rows, command), lambda path: plot(runs, path))


if __name__ == "__main__":
    main()
