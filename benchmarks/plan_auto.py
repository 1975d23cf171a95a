"""A run that plans itself against the layouts run by hand, on the emulated cluster.

    python benchmarks/plan_auto.py --links 1gbit 100mbit --clusters 2x1 2x2 \
        --out benchmarks/results/plan-auto/plan-auto.json     # as root: it brings testbeds up and down

For each link rate and cluster (nodes x ranks per node), ``shardwire train`` of the same job runs
with ``--plan auto`` and then with each exact layout given by hand: ``full`` (reshard after forward
and not), ``hybrid`` in groups of a node's ranks (reshard and not), ``hybrid_secondary``. Each run's
step is the median of its logged intervals' mean step (``--log-jsonl``) after the first interval,
which holds the start-up; the planned run's is taken the same way, after its plan. With
``--repeats N`` the whole round runs N times in turn and each configuration's step is the median of
its N runs: on a shared machine one run can be slowed by a fifth, which is more than the layouts
differ. The table sets the planned run's step against the fastest layout run by hand: the target
is within 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys

SHARDWIRE = [sys.executable, "-m", "shardwire"]
HAND = {
    "full": ["--layout", "full", "--reshard"],
    "full, keep": ["--layout", "full", "--no-reshard"],
    "hybrid": ["--layout", "hybrid", "--reshard"],
    "hybrid, keep": ["--layout", "hybrid", "--no-reshard"],
    "hybrid_secondary": ["--layout", "hybrid_secondary", "--reshard"],
}
TARGET = 0.10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", nargs="+", default=["1gbit", "100mbit"])
    parser.add_argument("--clusters", nargs="+", default=["2x1", "2x2"])
    parser.add_argument("--model", default="medium")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every configuration, in turn")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    logs = out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    job = ["train", "--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", "4",
           "--log-every", "5", "--eval-batches", "1"]
    rows = []
    for link in args.links:
        for shape in args.clusters:
            nodes, per_node = map(int, shape.split("x"))
            subprocess.run([*SHARDWIRE, "testbed", "up", "--nodes", str(nodes), "--link", link], check=True,
                           capture_output=True)
            rounds = []
            try:
                for round_ in range(args.repeats):
                    suffix = f"-{round_ + 1}" if args.repeats > 1 else ""
                    rounds.append({name: _run(job + flags, per_node, logs / f"{link}-{shape}-{_stem(name)}{suffix}")
                                   for name, flags in {"plan auto": ["--plan", "auto"], **HAND}.items()})
            finally:
                subprocess.run([*SHARDWIRE, "testbed", "down"], check=True, capture_output=True)
            rows.append(_row(link, shape, rounds))
            print(_line(rows[-1]), flush=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print("\n".join(_table(rows)))


def _run(argv: list[str], per_node: int, stem: pathlib.Path) -> dict:
    """One ``shardwire train`` on the testbed: its median step after the first interval, and what
    ``--plan`` printed."""
    jsonl = stem.with_suffix(".jsonl")
    jsonl.unlink(missing_ok=True)
    done = subprocess.run([*SHARDWIRE, "testbed", "run", "--nproc-per-node", str(per_node), "--", "-m", "shardwire",
                           *argv, "--log-jsonl", str(jsonl.resolve())], capture_output=True, text=True)
    stem.with_suffix(".out").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: see {stem.with_suffix('.out')}")
    intervals = [json.loads(line)["step_time_s"] for line in jsonl.read_text().splitlines()]
    run = {"step_s": statistics.median(intervals[1:]), "intervals_s": intervals}
    if (chose := re.search(r"plan auto: chose (.*), predicted step ([\d.e-]+) s", done.stdout)) is not None:
        run |= {"chose": chose[1], "predicted_s": float(chose[2])}
    return run


def _stem(name: str) -> str:
    """A configuration's name as its logs' file names spell it (``full-keep``, ``plan-auto``)."""
    return name.replace(", ", "-").replace(" ", "-")


def _row(link: str, shape: str, rounds: list[dict]) -> dict:
    """The configurations' median steps over the rounds; the plan's choice and prediction are its
    first round's (a different choice in a later round is kept in ``rounds_s``)."""
    steps = {name: [runs[name]["step_s"] for runs in rounds] for name in rounds[0]}
    median = {name: statistics.median(values) for name, values in steps.items()}
    hand = {name: value for name, value in median.items() if name != "plan auto"}
    best = min(hand, key=hand.get)
    planned = rounds[0]["plan auto"]
    return {"link": link, "cluster": shape, "hand_s": hand, "best": best, "chose": planned["chose"],
            "chosen_each_round": [runs["plan auto"]["chose"] for runs in rounds],
            "planned_s": median["plan auto"], "predicted_s": planned["predicted_s"],
            "vs_best": median["plan auto"] / hand[best] - 1, "rounds_s": steps}


def _line(row: dict) -> str:
    return (f"{row['cluster']} @{row['link']}: plan auto chose {row['chose']} ({row['planned_s'] * 1e3:.0f} ms, "
            f"predicted {row['predicted_s'] * 1e3:.0f}); best by hand {row['best']} "
            f"({row['hand_s'][row['best']] * 1e3:.0f} ms): {row['vs_best']:+.1%}")


def _table(rows: list[dict]) -> list[str]:
    names = list(HAND)
    lines = ["| cluster | " + " | ".join(names) + " | plan auto chose | its step | predicted | against the best |",
             "|---" * (len(names) + 5) + "|"]
    for r in rows:
        cells = [f"{r['hand_s'][n] * 1e3:.0f} ms" + (" (best)" if n == r["best"] else "") for n in names]
        within = "yes" if r["vs_best"] <= TARGET else "no"
        lines.append(f"| {r['cluster']} @{r['link']} | " + " | ".join(cells) + f" | `{r['chose']}` | "
                     f"{r['planned_s'] * 1e3:.0f} ms | {r['predicted_s'] * 1e3:.0f} ms | {r['vs_best']:+.1%} ({within}) |")
    return lines


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
