"""DiLoCo's trends across runs of ``benchmarks/sync_quality.py``: the gap to synchronous training against
H, against the outer learning rate, and against the number of groups, one point per seed.

    python benchmarks/sync_trends.py RESULTS/sync.json ... --out-dir benchmarks/results/sync-trends

Each ``sync.json`` is one invocation of ``sync_quality.py``: its clusters' runs, each measured against
the synchronous run of the same cluster and seed (``--seed`` among its train options, 0 without).
A run's settings are the sync's defaults, then the invocation's ``--base``, then its own label; a
"synchronous, seed 1" run is that cluster's own spread and is left out. It writes trends.md (every
point, and the mean over seeds) and trends.png (the three panels).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measure import write_report  # noqa: E402


# Labels use torchft's names; results recorded before them, the old ones: both read alike.
_KEYS = {"sync_every": "every", "fragment_sync_delay": "overlap"}


def points(path: str) -> list[dict]:
    """One point per sync run of ``path``: its groups, settings, seed and gap."""
    with open(path) as f:
        record = json.load(f)
    words = shlex.split(record["command"])
    seed = int(words[words.index("--seed") + 1]) if "--seed" in words else 0
    base = words[words.index("--base") + 1] if "--base" in words else ""
    found = []
    for row in record["rows"]:
        if row["run"].startswith("synchronous"):
            continue
        settings = {"every": 20, "fragments": 1, "wire": "int4", "outer_lr": 0.7, "momentum": 0.9, "overlap": 0}
        for item in filter(None, f"{base},{row['run']}".split(",")):
            key, _, value = item.partition("=")
            key = _KEYS.get(key, key)
            settings[key] = value if key == "wire" else float(value)
        nodes, _ = row["cluster"].split("x")
        found.append({"groups": int(nodes), "seed": seed, "gap": row["relative_to_synchronous"], **settings})
    return found


def table(found: list[dict]) -> str:
    by_setting = collections.defaultdict(dict)
    for p in found:
        key = (p["groups"], int(p["every"]), p["outer_lr"], p["momentum"], int(p["fragments"]), int(p["overlap"]),
               p["wire"])
        by_setting[key][p["seed"]] = p["gap"]
    lines = ["| groups | H | outer lr | momentum | fragments | overlap | wire | seed 0 | seed 1 | mean |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(by_setting):
        gaps = by_setting[key]
        cells = [f"{gaps[s]:+.2%}" if s in gaps else "" for s in (0, 1)]
        mean = sum(gaps.values()) / len(gaps)
        lines.append("| " + " | ".join(str(k) for k in key) + f" | {cells[0]} | {cells[1]} | {mean:+.2%} |")
    return "\n".join(lines)


def plot(found: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    whole = [p for p in found
             if p["fragments"] == 1 and p["overlap"] == 0 and p["momentum"] == 0.9 and p["wire"] == "int4"]
    panels = [
        ("gap against H (2 groups, outer lr 0.7)", "H",
         [p for p in whole if p["groups"] == 2 and p["outer_lr"] == 0.7], "every", "seed"),
        ("gap against the outer lr (2 groups)", "outer learning rate",
         [p for p in whole if p["groups"] == 2], "outer_lr", "every"),
        ("gap against the groups (H = 20, outer lr 0.7)", "groups",
         [p for p in whole if p["every"] == 20 and p["outer_lr"] == 0.7], "groups", "seed"),
    ]
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4))
    for axis, (title, xlabel, chosen, x, series) in zip(axes, panels):
        for name in sorted({p[series] for p in chosen}):
            by_x = collections.defaultdict(list)  # the mean over seeds, where the series is not a seed
            for p in chosen:
                if p[series] == name:
                    by_x[p[x]].append(100 * p["gap"])
            line = sorted((at, sum(gaps) / len(gaps)) for at, gaps in by_x.items())
            label = f"seed {name}" if series == "seed" else f"H = {int(name)} (mean over seeds)"
            axis.plot([a for a, _ in line], [b for _, b in line], marker="o", label=label)
        axis.axhline(0, color="grey", linewidth=0.8)
        axis.set(title=title, xlabel=xlabel, ylabel="final validation loss vs synchronous (%)")
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="sync.json files of sync_quality.py")
    parser.add_argument("--out-dir", default="benchmarks/results/sync-trends")
    args = parser.parse_args()
    found = [p for path in args.results for p in points(path)]
    command = "python benchmarks/sync_trends.py " + " ".join(args.results)
    write_report(args.out_dir, "trends", {"command": command, "points": found}, f"`{command}`\n\n{table(found)}",
                 lambda path: plot(found, path))


if __name__ == "__main__":
    main()
