"""Plots of profiled runs (``shardwire report RUN_DIR [RUN_DIR ...]``).

For each run: the timeline of one typical step (the compute and communication lanes of every rank,
or of rank 0 and the slowest in a world of more than eight), the breakdown of every step, and the
overlap ratio per step. Given several runs of the same job at different world sizes: how step time
and its parts scale with the number of workers.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import typing

from shardwire.extras import require
from shardwire.files import checkpoint_problem, figure_png, write_atomically
from shardwire.mappings import MappingError, cut, is_number, json_kind, read_json, shown
from shardwire.options import OptionError, check_output_file, check_writable_directory
from shardwire.profile import PROFILE_FILE
from shardwire.profile.profiler import FORMAT_VERSION

_PHASE_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "clip": "#8172B3", "optimizer": "#55A868"}
_OP_COLORS = {"all_gather": "#64B5CD", "reduce_scatter": "#C44E52", "all_reduce": "#937860"}
_PARTS = [("forward_s", "forward"), ("backward_s", "backward"), ("clip_s", "clip"),
          ("optimizer_s", "optimizer"), ("other_s", "other compute"), ("wait_s", "waiting for communication")]
_PART_COLORS = [*_PHASE_COLORS.values(), "#BBBBBB", "#E24A33"]
_MAX_BARS = 400  # steps drawn a bar each in the breakdown; more are drawn as stacked areas
_MAX_TIMELINES = 8  # ranks whose lanes the timeline draws (a figure's height grows with each)
# Beyond any time (seconds since boot), byte count or rate a profile holds: a petabyte, 30 million
# years; a larger number overflows the plots' arithmetic (milliseconds, sums) to infinity.
_MEASURE_BOUND = 1e15


class ReportError(Exception):
    """A run directory that cannot be reported on; the message says why and what to do."""


def load_profile(run_dir: str) -> dict:
    """The profile of ``run_dir``, read as every profile is (``mappings.read_json``: bounded in size,
    depth and encoding; a FIFO nobody writes to is empty, a device is read to the bound)."""
    path = os.path.join(run_dir, PROFILE_FILE)
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
            f"`shardwire train --profile --run-dir {cut(run_dir)}` or Profiler.save({cut(run_dir)!r})"
        )
    try:
        profile = read_json(path, path, kind="profile", remedy="profile the run again")
    except MappingError as err:
        raise ReportError(str(err)) from None
    version = profile.get("version")
    if type(version) is not int or version != FORMAT_VERSION:  # true is 1 to Python
        raise ReportError(f"{path} has format version {shown(version)}; this shardwire reads {FORMAT_VERSION}")
    world = profile.get("world_size")
    if type(world) is not int or world < 1:  # a scaling report divides by it
        raise ReportError(f"{path} is damaged (its world_size is {shown(world)}, not a count of ranks); "
                          f"profile the run again")
    if isinstance(profile.get("steps"), list) and not profile["steps"]:
        raise ReportError(f"{path} holds no step (its steps list is empty), so there is nothing to plot: profile "
                          f"a run of at least one step")
    if (where := _shape_problem(profile, _PROFILE, "")) is not None:
        raise ReportError(f"{path} is damaged ({where}, unlike a profile of `shardwire train --profile`); profile "
                          f"the run again")
    for part in ("tokens_per_step", "flops_per_token", "peak_tflops_per_worker", "summary", "steps", "timeline"):
        if (where := _not_a_measure(profile.get(part), part)) is not None:
            raise ReportError(f"{path} is damaged ({where}: times, bytes and ratios are numbers from 0 to "
                              f"{_MEASURE_BOUND:g}); profile the run again")
    if (held := _rank_count_problem(profile, world)) is not None:
        raise ReportError(f"{path} is damaged ({held} for a world_size of {world}); profile the run again")
    return profile


def _rank_count_problem(profile: dict, world: int) -> str | None:
    """Where a profile of the shape ``_PROFILE`` holds other than one entry per rank, in words (``its
    step 3 holds 3 ranks' figures``), or None. The profiler gathers every rank's timeline and figures
    of every step, so a rank missing (or one too many) is a damaged file, never a run's: drawn, the
    plots would leave that rank out of the spread over ranks without a word."""
    held = [("its timeline", profile["timeline"]["ranks"], "steps"),
            *((f"its step {step['step']}", step["ranks"], "figures") for step in profile["steps"])]
    return next((f"{where} holds {len(ranks)} ranks' {what}" for where, ranks, what in held if len(ranks) != world),
                None)


class _Each(typing.NamedTuple):
    """A list of items of one shape, at least ``least`` of them."""
    shape: object
    least: int = 0


class _Span(typing.NamedTuple):
    """A span of a timeline, written as a list: its ``fields`` first, then (with ``more``, after any
    further fields) its start and end, in seconds, the end not before the start."""
    fields: tuple
    more: bool = False


_NUMBER, _RATIO, _COUNT = "a finite number", "a ratio from 0 to 1", "a whole number"
_NAME, _ANY = "a name", "anything"
_SPREAD = {"min": _NUMBER, "median": _NUMBER, "max": _NUMBER}  # one figure over the ranks
_FIGURES = {**{key: _SPREAD for key in ("step_s", *(key for key, _ in _PARTS))},
            "overlap_ratio": dict.fromkeys(_SPREAD, _RATIO)}
# What the plots read of a profile, each value of the kind they read it as: a mapping holds the
# keys listed (and may hold others); a tuple lists the names a value may be.
_PROFILE = {
    "device": _ANY,
    "tokens_per_step": _NUMBER,
    "metadata": {},
    "summary": {"figures": _FIGURES, "tokens_per_s": _NUMBER},
    "steps": _Each({"step": _COUNT, "figures": _FIGURES, "ranks": _Each({})}, least=1),  # each rank's figures
    "timeline": {"step": _COUNT, "ranks": _Each({
        "start": _NUMBER,
        "phases": _Each(_Span((_NAME, _ANY))),  # phase, unit (None for the step's own)
        "waits": _Each(_Span((_ANY,))),  # what was waited for
        "comms": _Each(_Span((tuple(_OP_COLORS),), more=True)),  # op, tag, bytes, bytes on the wire
    }, least=1)},
}


def _shape_problem(value, shape, where: str) -> str | None:
    """Where ``value`` is not of ``shape`` (``_PROFILE``'s kinds), in words (``steps.3.figures has no
    step_s``), or None: a profile edited or of another tool is refused by what it lacks before any
    plot reads it, never by the exception a plot would raise."""
    named = where or "the profile"
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return f"{named} is {json_kind(value)}, not a mapping"
        for key, inner in shape.items():
            if key not in value:
                return f"{named} has no {key}"
            if (found := _shape_problem(value[key], inner, f"{where}.{key}" if where else key)) is not None:
                return found
        return None
    if isinstance(shape, _Each):
        if not isinstance(value, list):
            return f"{named} is {json_kind(value)}, not a list"
        if len(value) < shape.least:
            return f"{named} is an empty list"
        return next((found for index, item in enumerate(value)
                     if (found := _shape_problem(item, shape.shape, f"{where}.{index}")) is not None), None)
    if isinstance(shape, _Span):
        least = len(shape.fields) + 2
        if not isinstance(value, list) or len(value) < least or (len(value) > least and not shape.more):
            return f"{named} is {shown(value)}, not a span of {least}{' or more' if shape.more else ''} values"
        kinds = {**dict(enumerate(shape.fields)), len(value) - 2: _NUMBER, len(value) - 1: _NUMBER}
        if (found := next((problem for index, inner in kinds.items()
                           if (problem := _shape_problem(value[index], inner, f"{where}.{index}")) is not None),
                          None)) is not None:
            return found
        start, end = value[-2:]
        return f"{named} ends at {end:g} s, before it starts at {start:g} s" if end < start else None
    if isinstance(shape, tuple):
        return None if isinstance(value, str) and value in shape else \
            f"{named} is {shown(value)}, not one of {', '.join(shape)}"
    finite = is_number(value) and math.isfinite(value)
    wrong = {_NUMBER: not finite,
             _RATIO: not (finite and 0 <= value <= 1 + 1e-9),  # a quotient of two sums of one time, rounded
             _COUNT: type(value) is not int, _NAME: not isinstance(value, str), _ANY: False}[shape]
    return f"{named} is {shown(value)}, not {shape}" if wrong else None


# Keys whose values are measured: seconds and bytes, each a number (or its min, median and max).
_MEASURED = ("_s", "_bytes")


def _not_a_measure(value, where: str) -> str | None:
    """Where in ``value`` (a part of a profile) a number is no time, byte count or ratio a profiler
    measures: NaN, negative or past ``_MEASURE_BOUND`` would be drawn as if measured (or overflow
    the plot's arithmetic), and text where a time or a byte count belongs would fail the plot. None
    where every one is."""
    if isinstance(value, dict):
        for key, item in value.items():
            inside = f"{where}.{str(key)[:40]}"
            if str(key).endswith(_MEASURED) and not isinstance(item, dict) and not is_number(item):
                return f"{inside} is {shown(item)}"
            if (found := _not_a_measure(item, inside)) is not None:
                return found
        return None
    if isinstance(value, list):
        return next((found for index, item in enumerate(value)
                     if (found := _not_a_measure(item, f"{where}.{index}")) is not None), None)
    return f"{where} is {shown(value)}" if is_number(value) and not 0 <= value < _MEASURE_BOUND else None


def write_report(run_dirs: list[str], out: str) -> list[str]:
    profiles = [load_profile(d) for d in run_dirs]
    plots = []  # (the runs it draws, its path, how to draw it)
    for run_dir, profile, name in zip(run_dirs, profiles, _run_names(run_dirs, profiles)):
        prefix = "" if len(profiles) == 1 else f"{name}-"
        plots += [([run_dir], os.path.join(out, f"{prefix}{name}.png"), functools.partial(draw, profile))
                  for name, draw in (("timeline", _plot_timeline), ("breakdown", _plot_breakdown),
                                     ("overlap", _plot_overlap))]
    if len(profiles) > 1:
        plots.append((run_dirs, os.path.join(out, "scaling.png"), functools.partial(_plot_scaling, profiles)))
    try:  # every output checked before any is drawn
        check_writable_directory(out, "--out")
        for _, path, _ in plots:
            check_output_file(path, "--out:", "png")
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


def _check_comparable(run_dirs: list[str], profiles: list[dict]) -> None:
    """Runs in one scaling plot must be the same job at different world sizes."""
    def job(p):
        return {"model": p["metadata"].get("model"),
                "tokens per step and rank": p["tokens_per_step"] // p["world_size"],
                "precision": p["metadata"].get("precision"), "device": p["device"]}

    reference = job(profiles[0])
    for run_dir, profile in zip(run_dirs[1:], profiles[1:]):
        for key, value in job(profile).items():
            if value != reference[key]:
                raise ReportError(
                    f"runs differ in {key}: {run_dirs[0]} has {shown(reference[key])}, {run_dir} has {shown(value)}; "
                    f"a scaling report compares one job at several world sizes"
                )
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
    parts = [[s["figures"][key]["median"] * 1e3 for s in steps] for key, _ in _PARTS]
    labels = [label for _, label in _PARTS]
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
    for (key, label), color in zip(_PARTS, _PART_COLORS):
        values = [p["summary"]["figures"][key]["median"] * 1e3 for p in profiles]
        ax.bar([str(w) for w in worlds], values, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("workers")
    ax.set_ylabel("ms per step (median)")
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
    write_atomically(path, figure_png(fig))
    return path
