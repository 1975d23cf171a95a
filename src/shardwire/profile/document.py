"""A profile as every command reads it (``report``, ``simulate --calibrate``): bounded in size,
depth and encoding (``mappings.read_json``), then checked whole against what ``shardwire train
--profile`` writes, so that a profile one command refuses as damaged is never used by another. Free
of torch, as the simulator is."""

from __future__ import annotations

import math
import os
import statistics
import typing

from shardwire.mappings import MappingError, is_number, json_kind, read_json, shown
from shardwire.profile import FORMAT_VERSION, analysis

# The parts of a step a profile times, each with its words.
PARTS = [("forward_s", "forward"), ("backward_s", "backward"), ("clip_s", "clip"),
         ("optimizer_s", "optimizer"), ("other_s", "other compute"), ("wait_s", "waiting for communication")]
# The collectives a profile's timeline names.
OPS = analysis.OPS
# Beyond any time (seconds since boot), byte count or rate a profile holds: a petabyte, 30 million
# years; a larger number overflows a reader's arithmetic (milliseconds, sums) to infinity.
_MEASURE_BOUND = 1e15
# How far a summary's figure may differ from the one its steps give: a writer that rounds its numbers.
_ROUNDING = 1e-6
# The figures of a step a timeline's spans give, as every profile of this format holds them (those
# added since, the copies and the bytes on the wire, are not in the first ones).
_TIMELINE_FIGURES = ("step_s", *(key for key, _ in PARTS), "comm_s", "exposed_comm_s", "overlap_ratio",
                     *(f"{op}_{what}" for op in OPS for what in ("s", "bytes")))


class DamagedProfile(ValueError):
    """A profile no run wrote as it is: the message names the file, what is wrong and what to do."""


def read_profile_document(path: str) -> dict:
    """The profile in the file ``path``, checked whole; ``DamagedProfile`` otherwise."""
    if not os.path.lexists(path):
        raise DamagedProfile(f"{path} does not exist: give the profile.json `shardwire train --profile` wrote, or "
                             f"its run directory")
    try:
        profile = read_json(path, path, kind="profile", remedy="profile the run again")
    except MappingError as err:
        raise DamagedProfile(str(err)) from None
    version = profile.get("version")
    if version is None:
        raise DamagedProfile(f"{path} is not a profile: it holds no format version, which every profile "
                             f"`shardwire train --profile` writes holds")
    if type(version) is not int or version != FORMAT_VERSION:  # true is 1 to Python
        raise DamagedProfile(f"{path} has format version {shown(version)}; this shardwire reads {FORMAT_VERSION}")
    world = profile.get("world_size")
    if type(world) is not int or world < 1:  # a scaling report divides by it
        raise DamagedProfile(f"{path} is damaged (its world_size is {shown(world)}, not a count of ranks); "
                             f"profile the run again")
    if isinstance(profile.get("steps"), list) and not profile["steps"]:
        raise DamagedProfile(f"{path} holds no step (its steps list is empty): profile a run of at least one step")
    if (where := _shape_problem(profile, _PROFILE, "")) is not None:
        raise DamagedProfile(f"{path} is damaged ({where}, unlike a profile of `shardwire train --profile`); "
                             f"profile the run again")
    for part in ("tokens_per_step", "flops_per_token", "peak_tflops_per_worker", "summary", "steps", "timeline"):
        if (where := _not_a_measure(profile.get(part), part)) is not None:
            raise DamagedProfile(f"{path} is damaged ({where}: times, bytes and ratios are numbers from 0 to "
                                 f"{_MEASURE_BOUND:g}); profile the run again")
    if (held := _rank_count_problem(profile, world)) is not None:
        raise DamagedProfile(f"{path} is damaged ({held} for a world_size of {world}); profile the run again")
    if (differs := _steps_problem(profile) or _summary_problem(profile) or _timeline_problem(profile)
            or _metadata_problem(profile["metadata"]) or _job_problem(profile)) is not None:
        raise DamagedProfile(f"{path} is damaged ({differs}); profile the run again")
    return profile


def _job_problem(profile: dict) -> str | None:
    """Where the profile's tokens a step are not its job's, in words, or None: the sequences each
    rank takes a step (``--batch`` x ``--grad-accum``), of the job's length, on every rank. A job that
    records its length (the profiles of `shardwire train --profile` do; one of an earlier version
    may not) is held to it here, for both readers: edited apart, a throughput ten times what ran
    would be drawn. (``simulate --calibrate`` holds one without a length to its model's.)"""
    job = profile["metadata"].get("config")
    counts = [job.get(key) for key in ("batch", "grad_accum", "seq_len")] if isinstance(job, dict) else []
    if not counts or not all(type(count) is int and count > 0 for count in counts):
        return None
    return tokens_problem(profile, *counts)


def tokens_problem(profile: dict, batch: int, accumulation: int, seq_len: int) -> str | None:
    """Where ``batch`` x ``accumulation`` sequences of ``seq_len`` tokens on each rank are not the
    profile's tokens a step, in words, or None."""
    tokens = batch * accumulation * seq_len * profile["world_size"]
    if tokens == profile["tokens_per_step"]:
        return None
    return (f"its job, {batch} x {accumulation} sequences of {seq_len} tokens on each of {profile['world_size']} "
            f"ranks, is {tokens:,} tokens a step, where its tokens_per_step is {shown(profile['tokens_per_step'])}")


def _metadata_problem(metadata: dict) -> str | None:
    """Where the metadata's model or precision is not its job's (``config``), in words, or None. The
    profiler writes both from the job: ``report`` compares runs by them and ``simulate --calibrate``
    fits the job, so an edit of one would have the two commands take the profile for different jobs.
    Profiles of races (``bench``) hold no job, and nothing to compare."""
    job = metadata.get("config")
    if not isinstance(job, dict):
        return None
    if not isinstance(metadata.get("model_spec", {}), dict | None):
        return f"its metadata's model_spec is {shown(metadata['model_spec'])}, not a model's description"
    for key in ("model", "precision"):
        if key in metadata and not isinstance(metadata[key], str):
            return f"its metadata's {key} is {shown(metadata[key])}, not a name"
        if key in metadata and key in job and metadata[key] != job[key]:
            return f"its metadata's {key} is {shown(metadata[key])}, where the job it ran has {shown(job[key])}"
    return None


def _steps_problem(profile: dict) -> str | None:
    """Where a step's figures are not what its ranks' give, in words, or None. The profiler splits
    each rank's step into its parts (what the others leave is its wait), so they add up to its step
    time, and writes each figure of a step as the least, median and most over its ranks: a rank's
    part edited apart from its step (a forward five times as long) would be drawn, and calibrate
    the simulator, as if measured."""
    numbers = [step["step"] for step in profile["steps"]]
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        return f"its steps are numbered {shown(numbers, 60)}, where a run's steps follow one another"
    for step in profile["steps"]:
        for rank, figures in enumerate(step["ranks"]):
            missing = next((name for name in _RANK_FIGURES if not is_number(figures.get(name))), None)
            if missing is not None:
                return f"its step {step['step']}'s rank {rank} has {shown(figures.get(missing))} for {missing}"
            parts = math.fsum(figures[key] for key, _ in PARTS)
            if not math.isclose(parts, figures["step_s"], rel_tol=_ROUNDING, abs_tol=1e-9):
                return (f"its step {step['step']}'s rank {rank} has parts adding up to {parts:.6g} s in a step of "
                        f"{figures['step_s']:.6g} s")
            if (apart := _communication_problem(figures)) is not None:
                return f"its step {step['step']}'s rank {rank} has {apart}"
        for name in _FIGURES:
            values = [figures[name] for figures in step["ranks"]]
            for stat, value in (("min", min(values)), ("median", statistics.median(values)), ("max", max(values))):
                if not math.isclose(step["figures"][name][stat], value, rel_tol=_ROUNDING, abs_tol=1e-12):
                    return (f"its step {step['step']}'s {name} {stat} is {step['figures'][name][stat]:.6g}, where "
                            f"its ranks give {value:.6g}")
    return None


def _communication_problem(figures: dict) -> str | None:
    """Where a rank's communication figures of a step contradict each other, in words, or None. The
    profiler takes them from one set of spans (``analysis.breakdown``): the time some collective was
    in flight within the step, the part of it no compute hid (spent waiting), each collective's own
    time within it, and the overlap ratio, the hidden part of it."""
    comm, exposed = figures["comm_s"], figures["exposed_comm_s"]
    if comm > figures["step_s"] * (1 + _ROUNDING):
        return f"communication of {comm:.6g} s in a step of {figures['step_s']:.6g} s"
    if exposed > comm * (1 + _ROUNDING) + 1e-12 or exposed > figures["wait_s"] * (1 + _ROUNDING) + 1e-9:
        return (f"{exposed:.6g} s of communication exposed, more than its {comm:.6g} s of communication or its "
                f"{figures['wait_s']:.6g} s of waiting")
    if op := next((op for op in OPS if is_number(figures.get(f"{op}_s"))
                   and figures[f"{op}_s"] > comm * (1 + _ROUNDING) + 1e-12), None):
        return f"{figures[f'{op}_s']:.6g} s of {op}, more than its {comm:.6g} s of communication"
    overlap = 1 - exposed / comm if comm > 0 else 1.0
    if not math.isclose(figures["overlap_ratio"], overlap, rel_tol=_ROUNDING, abs_tol=1e-9):
        return (f"an overlap ratio of {figures['overlap_ratio']:.6g}, where its {exposed:.6g} s exposed of "
                f"{comm:.6g} s of communication give {overlap:.6g}")
    return None


def _summary_problem(profile: dict) -> str | None:
    """Where the summary's figures are not what its steps give, in words, or None. The profiler
    writes each as the median over the steps after its warmup of that step's figure, and the
    throughput from the slowest rank's step time: a summary edited apart from the steps it stands for
    would calibrate the simulator, and be drawn, with figures no step measured."""
    steps = profile["steps"]
    first = analysis.summarised(steps, profile["warmup_steps"])
    summary = profile["summary"]
    for name, stats in _FIGURES.items():
        for stat in stats:
            median = statistics.median(step["figures"][name][stat] for step in steps[first:])
            if not math.isclose(summary["figures"][name][stat], median, rel_tol=_ROUNDING, abs_tol=1e-12):
                return (f"its summary's {name} {stat} is {summary['figures'][name][stat]:.6g}, where the median "
                        f"of its steps' {name} {stat} is {median:.6g}")
    tokens_per_s = profile["tokens_per_step"] / summary["figures"]["step_s"]["max"] \
        if summary["figures"]["step_s"]["max"] > 0 else math.inf
    if not math.isclose(summary["tokens_per_s"], tokens_per_s, rel_tol=_ROUNDING):
        return (f"its summary's tokens_per_s is {summary['tokens_per_s']:.6g}, where its tokens_per_step over "
                f"its step time give {tokens_per_s:.6g}")
    return None


def _timeline_problem(profile: dict) -> str | None:
    """Where the timeline is not the step it names as that step's figures hold it, in words, or None.
    The profiler keeps one step's spans of every rank, each span within its rank's step, and
    computes that step's figures from them (``analysis.breakdown``); the ranks' steps share a
    moment, as ranks that run collectives together do: spans edited apart from the figures (moved,
    stretched past the step, left out), or a rank's step moved apart from the others', would be
    drawn as measured."""
    timeline = profile["timeline"]
    step = next((step for step in profile["steps"] if step["step"] == timeline["step"]), None)
    if step is None:
        return f"its timeline is of step {timeline['step']}, which its steps do not hold"
    ranks = timeline["ranks"]
    last_start = max(range(len(ranks)), key=lambda rank: ranks[rank]["start"])
    first_end = min(range(len(ranks)), key=lambda rank: ranks[rank]["end"])
    if ranks[last_start]["start"] > ranks[first_end]["end"]:
        return (f"its timeline's rank {first_end} ends its step at {ranks[first_end]['end']:.6g} s, before rank "
                f"{last_start} starts it at {ranks[last_start]['start']:.6g} s, where their collectives meet")
    for rank, (spans, figures) in enumerate(zip(ranks, step["ranks"])):
        where = f"its timeline's rank {rank}"
        if spans["step"] != timeline["step"]:
            return f"{where} is of step {spans['step']}, where its timeline is of step {timeline['step']}"
        start, end = spans["start"], spans["end"]
        if outside := next((span for part in ("phases", "waits", "comms") for span in spans[part]
                            if span[-2] < start or span[-1] > end), None):
            return (f"{where} has a span from {outside[-2]:.6g} to {outside[-1]:.6g} s, outside its step "
                    f"({start:.6g} to {end:.6g} s)")
        given = analysis.breakdown(analysis.StepTimeline(spans["step"], start, end, spans["phases"], spans["comms"],
                                                         spans["waits"]))
        for name in _TIMELINE_FIGURES:
            if not (is_number(figures.get(name)) and math.isclose(figures[name], given[name], rel_tol=_ROUNDING,
                                                                  abs_tol=1e-9)):
                return (f"{where} gives {name} {given[name]:.6g}, where its step {step['step']}'s figures have "
                        f"{shown(figures.get(name))}")
    return None


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
_FIGURES = {**{key: _SPREAD for key in ("step_s", *(key for key, _ in PARTS))},
            "overlap_ratio": dict.fromkeys(_SPREAD, _RATIO)}
# What each rank's figures of a step hold, as every profile of this format does.
_RANK_FIGURES = (*_FIGURES, "comm_s", "exposed_comm_s")
# What the plots read of a profile, each value of the kind they read it as: a mapping holds the
# keys listed (and may hold others); a tuple lists the names a value may be.
_PROFILE = {
    "device": _ANY,
    "tokens_per_step": _NUMBER,
    "warmup_steps": _COUNT,
    "metadata": {},
    "summary": {"figures": _FIGURES, "tokens_per_s": _NUMBER},
    "steps": _Each({"step": _COUNT, "figures": _FIGURES, "ranks": _Each({})}, least=1),  # each rank's figures
    "timeline": {"step": _COUNT, "ranks": _Each({
        "step": _COUNT,
        "start": _NUMBER,
        "end": _NUMBER,
        "phases": _Each(_Span((_NAME, _ANY))),  # phase, unit (None for the step's own)
        "waits": _Each(_Span((_ANY,))),  # what was waited for
        "comms": _Each(_Span((OPS, _ANY, _NUMBER), more=True)),  # op, tag, bytes, bytes on the wire (in later profiles)
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
             _COUNT: type(value) is not int or value < 0, _NAME: not isinstance(value, str), _ANY: False}[shape]
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
