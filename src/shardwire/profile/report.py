"""Plots of profiled runs (``shardwire report RUN_DIR [RUN_DIR ...]``).

For each run: the timeline of one typical step (the compute and communication lanes of every rank,
or of rank 0 and the slowest in a world of more than eight), the breakdown of every step, and the
overlap ratio per step. Given several runs of the same job at different world sizes: how step time
and its parts scale with the number of workers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex

from shardwire.engine.fault_tolerance import fault_tolerance_asked
from shardwire.extras import require
from shardwire.files import checkpoint_problem, figure_png, write_atomically
from shardwire.mappings import cut, shown
from shardwire.options import OptionError, check_output_file, check_writable_directory
from shardwire.profile import PROFILE_FILE
from shardwire.profile.document import OPS, PARTS, DamagedProfile, read_profile_document

_PHASE_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "clip": "#8172B3", "optimizer": "#55A868"}
_OP_COLORS = dict(zip(OPS, ("#64B5CD", "#C44E52", "#937860")))
_PART_COLORS = [*_PHASE_COLORS.values(), "#BBBBBB", "#E24A33"]
_MAX_BARS = 400  # steps drawn a bar each in the breakdown; more are drawn as stacked areas
_MAX_TIMELINES = 8  # ranks whose lanes the timeline draws (a figure's height grows with each)


class ReportError(Exception):
    """A run directory that cannot be reported on; the message says why and what to do."""


def load_profile(run_dir: str) -> dict:
    """The profile of ``run_dir``, read and checked as every reader of a profile takes it
    (``document.read_profile_document``)."""
    path = os.path.join(run_dir, PROFILE_FILE)
    if not os.path.lexists(run_dir):
        raise ReportError(f"{cut(run_dir)} does not exist: give the run directory that holds a profile.json "
                          f"(`shardwire train --profile --run-dir DIR` writes one)")
    if not os.path.isdir(run_dir):
        given = (os.path.dirname(run_dir) or ".") if os.path.basename(run_dir) == PROFILE_FILE else None
        raise ReportError(f"{cut(run_dir)} is not a directory: give the run directory " +
                          (f"that holds it, {cut(given)}" if given else "that holds a profile.json"))
    if not os.path.exists(path) and (problem := checkpoint_problem(run_dir)) is not None:
        raise ReportError(f"{cut(run_dir)} has no profile data ({PROFILE_FILE} is missing), and no run writes one "
                          f"there: it {problem}")
    if not os.path.exists(path):
        raise ReportError(
            f"{cut(run_dir)} has no profile data ({PROFILE_FILE} is missing): profile a run with "
            f"`shardwire train --profile --run-dir {shlex.quote(cut(run_dir))}` or Profiler.save({cut(run_dir)!r})"
        )
    try:
        return read_profile_document(path)
    except DamagedProfile as err:
        raise ReportError(str(err)) from None


def write_report(run_dirs: list[str], out: str | None = None) -> list[str]:
    """Plot the profiles of ``run_dirs`` into ``out`` (by default the first run's directory);
    returns the plots' paths."""
    option = "--out" if out is not None else "RUN_DIR (where the plots go without --out)"
    out = run_dirs[0] if out is None else out
    profiles = [load_profile(d) for d in run_dirs]
    plots = []  # (the runs it draws, its path, how to draw it)
    for run_dir, profile, name in zip(run_dirs, profiles, _run_names(run_dirs, profiles)):
        prefix = "" if len(profiles) == 1 else f"{name}-"
        plots += [([run_dir], os.path.join(out, f"{prefix}{name}.png"), functools.partial(draw, profile))
                  for name, draw in (("timeline", _plot_timeline), ("breakdown", _plot_breakdown),
                                     ("overlap", _plot_overlap))]
    if len(profiles) > 1:
        plots.append((run_dirs, os.path.join(out, "scaling.png"), functools.partial(_plot_scaling, profiles)))
    if (other := _another_run(out, run_dirs)) is not None:
        raise ReportError(f"--out {cut(out)} holds the profile of another run ({cut(other)}), whose plots these would "
                          f"replace or sit beside as if they were its own: give another directory")
    try:  # every output checked before any is drawn
        check_writable_directory(out, option)
        for _, path, _ in plots:
            check_output_file(path, f"{option}:", "report-plot", instead="give another directory with --out DIR")
    except OptionError as err:
        raise ReportError(str(err)) from None
    with _damage_reported(run_dirs):
        if len(profiles) > 1:
            _check_comparable(run_dirs, profiles)
    require("matplotlib", "shardwire report").use("Agg")
    written = []
    for runs, path, draw in plots:
        with _damage_reported(runs):
            written.append(draw(path))
    return written


def _another_run(out: str, run_dirs: list[str]) -> str | None:
    """The profile in ``out`` of a run that is not among ``run_dirs``, or None: a run directory's
    plots are named for what they draw (``timeline.png``), as every run's are."""
    profile = os.path.join(out, PROFILE_FILE)
    if not os.path.lexists(profile) or os.path.realpath(out) in {os.path.realpath(d) for d in run_dirs}:
        return None
    return profile


def _run_names(run_dirs: list[str], profiles: list[dict]) -> list[str]:
    """What each run's plots are named for in a report of several: its directory's name, or, where
    two share one (a/run and b/run), that and its world size, which differ between the runs of one
    scaling report; else the second run's plots would replace the first's."""
    names = [os.path.basename(os.path.abspath(run_dir)) for run_dir in run_dirs]  # "." by its name too
    if len(set(names)) == len(names):
        return names
    return [f"{name}-{profile['world_size']}-ranks" for name, profile in zip(names, profiles)]


@contextlib.contextmanager
def _damage_reported(run_dirs: list[str]):
    """A profile.json whose values ``load_profile`` let through but a plot cannot draw (the shape of
    what the plots read is checked there) is reported as damaged, naming the run, in words: never by
    the exception a plot raised, whose name says nothing to the user."""
    try:
        yield
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError, OverflowError):
        where = " or ".join(os.path.join(d, PROFILE_FILE) for d in run_dirs)
        raise ReportError(f"{where} is damaged (it holds values its plots cannot draw); profile the run "
                          f"again") from None


# The options of `shardwire train` that set what a step computes and sends, as a profile's job
# records them: runs that differ in any are not one job at several world sizes. (Its sequence
# length is in its FLOPs per token, which count attention; the size of a hybrid layout's groups
# follows the nodes, as the world does.)
_JOB_OPTIONS = ("model", "units", "batch", "grad_accum", "precision", "prefetch", "reshard", "layout", "wire",
                "diloco", "fault_tolerance", "clip", "activation_checkpointing", "compile")


def _check_comparable(run_dirs: list[str], profiles: list[dict]) -> None:
    """Runs in one scaling plot must be the same job at different world sizes: alike in every option
    that sets a step's work (``_JOB_OPTIONS``, from the job a profile of `shardwire train --profile`
    records; a bench race's records none, and its model and precision where it has them)."""
    def job(p):
        metadata = p["metadata"]
        recorded = metadata.get("config") if isinstance(metadata.get("config"), dict) else {}
        flops = p.get("flops_per_token")
        found = {"model": recorded.get("model", metadata.get("model")),
                 # an hf: directory edited between two runs names two models
                 "the model's description": metadata.get("model_spec"),
                 "tokens per step and rank": p["tokens_per_step"] // p["world_size"],
                 "FLOPs per token": flops.get("model") if isinstance(flops, dict) else flops,
                 "precision": recorded.get("precision", metadata.get("precision")), "device": p["device"]}
        found.update({f"--{name.replace('_', '-')}": recorded.get(name) for name in _JOB_OPTIONS
                      if name not in found})
        # asked for or not: where the lighthouse was is no other job
        found["--fault-tolerance"] = "asked" if fault_tolerance_asked(recorded.get("fault_tolerance")) else "none"
        return found

    reference = job(profiles[0])
    for run_dir, profile in zip(run_dirs[1:], profiles[1:]):
        for key, value in job(profile).items():
            if key == "the model's description" and None in (value, reference[key]):
                continue  # a profile written before it was recorded: its FLOPs per token compare
            if isinstance(value, dict) and isinstance(reference[key], dict) and value != reference[key]:
                keys = sorted(k for k in {*value, *reference[key]} if value.get(k) != reference[key].get(k))
                model = reference["model"]
                changed = " (its directory changed between them?)" if str(model).startswith("hf:") else ""
                raise ReportError(f"runs differ in the model: {run_dirs[0]} and {run_dir} ran models that differ in "
                                  f"{cut(', '.join(map(str, keys)))}{changed}; a scaling report compares one job at "
                                  f"several world sizes")
            if value != reference[key]:
                raise ReportError(
                    f"runs differ in {key}: {run_dirs[0]} has {shown(reference[key])}, {run_dir} has {shown(value)}; "
                    f"a scaling report compares one job at several world sizes"
                )
    runs = [os.path.realpath(run_dir) for run_dir in run_dirs]
    if len(set(runs)) != len(runs):
        twice = next(run_dir for run_dir, run in zip(run_dirs, runs) if runs.count(run) > 1)
        raise ReportError(f"{twice} is given twice (under one name or two): give each run once")
    sizes = [p["world_size"] for p in profiles]
    if len(set(sizes)) != len(sizes):
        raise ReportError(f"two runs have the same world size ({shown(sizes)}); give one run per world size")


def _timeline_ranks(ranks: list[dict]) -> list[int]:
    """The ranks whose timelines are drawn: all of a small world; of a larger one rank 0 and those
    whose step ended last (the ones the others waited for), up to ``_MAX_TIMELINES``, in rank order."""
    if len(ranks) <= _MAX_TIMELINES:
        return list(range(len(ranks)))

    def length(rank: int) -> float:
        timeline = ranks[rank]
        ends = [span[-1] for part in ("phases", "waits", "comms") for span in timeline[part]]
        return max(ends, default=timeline["start"]) - timeline["start"]

    slowest = sorted(range(1, len(ranks)), key=length, reverse=True)[: _MAX_TIMELINES - 1]
    return sorted([0, *slowest])


def _plot_timeline(profile: dict, path: str) -> str:
    """Each span drawn as a bar of its lane; the bars of one lane and colour drawn together
    (``broken_barh``), so that a timeline of many thousands of spans draws in a moment."""
    import matplotlib.pyplot as plt

    ranks = profile["timeline"]["ranks"]
    shown_ranks = _timeline_ranks(ranks)
    lanes = ["compute", "all_gather", "reduce_scatter", "all_reduce"]
    fig, ax = plt.subplots(figsize=(13, 1.5 + 1.2 * len(shown_ranks)))
    origin = min(r["start"] for r in ranks)
    bars: dict[tuple, list[tuple[float, float]]] = {}  # (row, height, colour, alpha, edged): (start, width) in ms

    def bar(row: float, height: float, color: str, alpha: float, start: float, end: float, edged: bool = False):
        bars.setdefault((row, height, color, alpha, edged), []).append(((start - origin) * 1e3, (end - start) * 1e3))

    labels = []
    for place, rank in enumerate(shown_ranks):
        timeline, base = ranks[rank], place * (len(lanes) + 1)
        for phase, unit, start, end in timeline["phases"]:
            bar(base, 0.8 if unit is None else 0.5, _PHASE_COLORS.get(phase, "#999999"),
                1.0 if unit is None else 0.6, start, end)
        for _, start, end in timeline["waits"]:
            bar(base, 0.8, "#E24A33", 1.0, start, end)
        for op, *_, start, end in timeline["comms"]:
            bar(base + lanes.index(op), 0.6, _OP_COLORS.get(op, "#999999"), 1.0, start, end, edged=True)
        labels += [(base + i, f"rank {rank} {lane}") for i, lane in enumerate(lanes)]
    for (row, height, color, alpha, edged), spans in bars.items():  # collectives edged, to tell them apart
        ax.broken_barh(spans, (row - height / 2, height), facecolors=color, alpha=alpha,
                       edgecolor="white" if edged else None, linewidth=0.5 if edged else 0)
    ax.set_yticks([y for y, _ in labels], [name for _, name in labels], fontsize=8)
    ax.set_ylim(len(shown_ranks) * (len(lanes) + 1) - 0.5, -0.5)
    ax.set_xlabel("ms since the step started")
    which = "" if len(shown_ranks) == len(ranks) else f", {len(shown_ranks)} of {len(ranks)} ranks: 0 and the slowest"
    ax.set_title(f"step {profile['timeline']['step']}: compute (phases, units lighter, waits red) and "
                 f"collectives{which}")
    ax.autoscale(axis="x")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in [*_PHASE_COLORS.values(), "#E24A33", *_OP_COLORS.values()]]
    ax.legend(handles, [*_PHASE_COLORS, "wait", *_OP_COLORS], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def _plot_breakdown(profile: dict, path: str) -> str:
    import matplotlib.pyplot as plt

    steps = profile["steps"]
    x = [s["step"] for s in steps]
    fig, ax = plt.subplots(figsize=(10, 4))
    parts = [[s["figures"][key]["median"] * 1e3 for s in steps] for key, _ in PARTS]
    labels = [label for _, label in PARTS]
    if len(steps) <= _MAX_BARS:
        bottom = [0.0] * len(steps)
        for values, label, color in zip(parts, labels, _PART_COLORS):
            ax.bar(x, values, bottom=bottom, label=label, color=color, width=0.9)
            bottom = [b + v for b, v in zip(bottom, values)]
    else:  # a bar each is thousands of shapes, which take minutes to draw: the same stacks as areas
        ax.stackplot(x, *parts, labels=labels, colors=_PART_COLORS[:len(parts)])
    ax.plot(x, [s["figures"]["step_s"]["max"] * 1e3 for s in steps], "k.", markersize=2, label="step (slowest rank)")
    ax.set_xlabel("step")
    ax.set_ylabel("ms (median over ranks)")
    ax.set_title("where each step went")
    ax.legend(fontsize=8, ncol=4, loc="upper right")  # "best" searches the points for a place
    return _save(fig, path)


def _plot_overlap(profile: dict, path: str) -> str:
    import matplotlib.pyplot as plt

    steps = profile["steps"]
    x = [s["step"] for s in steps]
    fig, ax = plt.subplots(figsize=(10, 3))
    ratio = [s["figures"]["overlap_ratio"] for s in steps]
    ax.fill_between(x, [r["min"] for r in ratio], [r["max"] for r in ratio], alpha=0.3, label="min-max over ranks")
    ax.plot(x, [r["median"] for r in ratio], label="median over ranks")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("step")
    ax.set_ylabel("communication hidden")
    ax.set_title("overlap ratio: share of communication time hidden behind compute")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _plot_scaling(profiles: list[dict], path: str) -> str:
    import matplotlib.pyplot as plt

    profiles = sorted(profiles, key=lambda p: p["world_size"])
    worlds = [p["world_size"] for p in profiles]
    fig, (ax, tput) = plt.subplots(1, 2, figsize=(11, 4))
    bottom = [0.0] * len(profiles)
    # each run's typical step (after its warmup: the one its timeline draws) as its slowest rank took
    # it, whose parts add up to the step the throughput is of (each part's own median would not)
    steps = [max(next(step for step in p["steps"] if step["step"] == p["timeline"]["step"])["ranks"],
                 key=lambda figures: figures["step_s"]) for p in profiles]
    for (key, label), color in zip(PARTS, _PART_COLORS):
        values = [figures[key] * 1e3 for figures in steps]
        ax.bar([str(w) for w in worlds], values, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("workers")
    ax.set_ylabel("ms per step (typical step, slowest rank)")
    ax.set_title("step time by part")
    ax.legend(fontsize=8)
    tput.plot(worlds, [p["summary"]["tokens_per_s"] for p in profiles], "o-", label="measured")
    ideal = [profiles[0]["summary"]["tokens_per_s"] * w / worlds[0] for w in worlds]
    tput.plot(worlds, ideal, "--", color="gray", label="linear")
    tput.set_xlabel("workers")
    tput.set_ylabel("tokens/s")
    tput.set_title("throughput")
    tput.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: str) -> str:
    """Write a finished figure (whole or not at all) and free it."""
    fig.tight_layout()
    write_atomically(path, figure_png(fig, "report-plot"))
    return path
