"""Reading the simulator's inputs: preset names, inline JSON or YAML, files, and bench results.

``--model``, ``--cluster`` and ``--training`` each take a preset name, a JSON or YAML mapping
written inline, or the path of a JSON or YAML file. A mapping with a ``preset`` key starts from
that preset and changes the keys it gives (``{preset: a100-100gbe, nodes: 16}``). A cluster's
``gpu`` key names a GPU preset whose figures it takes, except those the mapping gives itself
(``{preset: a100-100gbe, gpu: h100-sxm}``); its ``collectives`` key names the collective library it runs,
whose figures (``shardwire.sim.specs.COLLECTIVES``) it takes likewise (``{preset: a100-efa-400,
collectives: smddp}``): the library is set on the preset first, and the mapping's own keys change the
result. ``--model`` also takes what ``shardwire train --model``
takes: the project's GPT sizes and ``hf:`` with a Hugging Face config (``shardwire.sim.huggingface``);
``--seq-len`` changes the model's sequence length. ``--calibrate profile.json`` fits the cluster's
GPU to a profile of one GPU (``shardwire.sim.calibrate``). ``--node-mtbf`` (and ``--save-every``)
give a failure rate, whose cost ``shardwire.sim.failures`` prices.

``--cluster-from bench.json`` replaces the cluster's nodes, GPUs per node and both network levels
with what ``shardwire bench --json`` measured (schema ``shardwire.bench/1``, in
``shardwire.bench.report``): from the latency-bandwidth fit ``t = alpha + S / beta`` of the
all-gather and reduce-scatter of a group of ``k`` ranks, busbw = beta (k-1)/k (nccl-tests' factor)
and latency per step = alpha / (k-1), averaged over the two operations. The ``intra`` group gives
the intra-node level, the ``inter`` group (one rank per node) the inter-node level. Collectives
measured as the engine runs them on gloo (``--impl shardwire``) cross the levels hierarchically;
others (NCCL's, gloo's own) by a ring. Where the bench measured contention (``--contention``), a
level's ``compute_share`` and ``bandwidth_share`` are those measured of its group's all-gather
(``world``'s when that group's was not measured); elsewhere the cluster's own stay.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import statistics
import warnings
from collections.abc import Mapping
from typing import Any

from shardwire.bench.metrics import fit_latency_bandwidth
from shardwire.bench.schema import SCHEMA as BENCH_SCHEMA
from shardwire.mappings import (
    MappingError,
    Missing,
    cut,
    field,
    is_number,
    one_line,
    read_file,
    read_json,
    read_mapping,
    shown,
)
from shardwire.options import spec_text, text
from shardwire.sim import huggingface
from shardwire.sim.calibrate import calibrated, read_profile
from shardwire.sim.failures import FailureRate
from shardwire.sim.presets import GPUS, PRESETS
from shardwire.sim.specs import (MAX_NAME, LIMITS, ClusterSpec, LinkSpec, ModelSpec, SpecError, TrainingSpec, as_dict,
                                 parse)

_LINK_OPS = ("all_gather", "reduce_scatter")
_LEAST_INTERCEPT_S = -0.1  # a fit's intercept below this is no fit of measured times
_REFIT_AGREE = 1e-6  # how far a bench fit may be from the refit of its results: the same arithmetic
# Bench results: a thousand sizes of every operation on every group, in both forms, are a few MB.
MAX_BENCH_BYTES = 64 << 20


def load_spec(kind: str, text: str):
    """The ``kind`` spec ("model", "cluster" or "training") that ``text`` names or describes."""
    return load_spec_given(kind, text)[0]


def load_spec_given(kind: str, text: str) -> tuple[Any, frozenset[str]]:
    """``load_spec``'s spec, and the keys ``text`` changes in the preset it starts from (none for a
    preset named alone, or a spec of its own, which must give every key), for a command to say which
    of them another option replaces."""
    presets = PRESETS[kind]
    if text in presets:
        return presets[text], frozenset()
    if kind == "model" and text.startswith(huggingface.HF_PREFIX):
        return load_model(text), frozenset()
    if os.path.exists(text) and not os.path.isdir(text):  # a pipe too (<(...)), read within bounds as a file is
        with _spec_errors():
            data = read_mapping(read_file(text, f"{kind} file {text}"), f"{kind} file {text}")
        name = os.path.splitext(os.path.basename(text))[0]
    elif text.lstrip().startswith("{") or ":" in text:
        with _spec_errors():
            data, name = read_mapping(text, f"inline {kind}"), None
    elif text.endswith((".json", ".yaml", ".yml")):
        raise SpecError(f"{kind} file {text} does not exist")
    else:
        raise SpecError(
            f"unknown {kind} preset {shown(text)}; known presets: {', '.join(presets)} "
            f"(or give a JSON/YAML mapping inline, or the path of a file holding one)"
        )
    given = dict(data)
    if "preset" in data:
        base = data.pop("preset")
        if not isinstance(base, str) or base not in presets:
            raise SpecError(f"unknown {kind} preset {shown(base)}; known presets: {', '.join(presets)}")
        changed = f"{base}, changed" if data else base
        start = as_dict(presets[base])
        if kind == "model":  # sizes that follow others where the preset left them to: they follow the changes
            start.update({key: None for key, derived in (("ffn_hidden", 4 * start["hidden"]),
                                                         ("kv_heads", start["heads"]),
                                                         ("decoder_layers", start["layers"]),
                                                         ("decoder_seq_len", start["seq_len"])) if start[key] == derived})
            if data and "params" not in data:  # the preset's published count is of its sizes, not the changed ones
                start["params"] = None
        if kind == "cluster" and "collectives" in data:  # the preset as the library runs it, which the mapping changes
            start = as_dict(parse(kind, {**start, "collectives": data["collectives"]}, name=base))
        data = {**_merged(start, data), "name": data.get("name") or name or changed}
    if kind == "cluster" and "gpu" in given:
        data = {**data, **{key: value for key, value in _gpu(given["gpu"]).items() if key not in given}}
    changes = frozenset(map(str, given)) - {"preset", "name"} if "preset" in given else frozenset()
    return parse(kind, data, name=name), changes


def load_model(text: str, seq_len: int | None = None) -> ModelSpec:
    """The model ``text`` names (a preset, ``hf:`` and a Hugging Face config, a mapping or a file), at
    ``seq_len`` tokens per sequence when given."""
    if text.startswith(huggingface.HF_PREFIX):
        source = text[len(huggingface.HF_PREFIX):]
        try:
            fields = huggingface.read_config(source)
            huggingface.check_sizes(fields)
            if (problem := huggingface.shape_problem(fields)) is not None:
                raise ValueError(problem)
            family = cut(fields["model_type"], 60)  # shape_problem refuses a config that names none
            return huggingface.spec_from_config(fields, name=f"hf:{family}",
                                                seq_len=huggingface.seq_len_of(fields, seq_len))
        except ValueError as err:
            raise SpecError(str(err)) from None
    model = load_spec("model", text)
    if seq_len is None:
        return model
    # a table of learned positions grows with the sequence: the count stated at the model's own no
    # longer holds at another, and is not the user's to check
    stated = (model.params if not model.learned_positions or model.positions is not None or seq_len == model.seq_len
              else None)
    return parse("model", {**as_dict(model), "seq_len": seq_len, "params": stated})


def _gpu(name) -> dict:
    if not isinstance(name, str) or name not in GPUS:
        raise SpecError(f"unknown GPU preset {shown(name)}; known GPUs: {', '.join(GPUS)}")
    return GPUS[name]


# The cluster's keys a bench document may give (``cluster_from_bench``): a level only where the bench spans it.
MEASURED_BY_BENCH = frozenset({"nodes", "gpus_per_node", "intra_node", "inter_node", "algorithm"})


def cluster_from_bench(path: str, cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` with the nodes, GPUs per node and network levels that a bench JSON measured."""
    with _spec_errors():
        doc = read_json(path, f"bench results {path}", kind="bench result",
                        remedy="give the file `shardwire bench --json` wrote", limit=MAX_BENCH_BYTES)
    if doc.get("schema") != BENCH_SCHEMA:
        raise SpecError(f"{path} is not `shardwire bench --json` output (schema {BENCH_SCHEMA!r})")
    try:
        return cluster_from_bench_document(doc, path, cluster)
    except Missing as err:
        raise SpecError(f"{path}: {err}, unlike schema {BENCH_SCHEMA!r}: was it edited?") from None
    except (KeyError, TypeError) as err:  # deeper in its fits: named as Python does
        raise SpecError(f"{path} holds {shown(str(err))} where schema {BENCH_SCHEMA!r} has another value: "
                        f"was it edited?") from None


def cluster_from_bench_document(doc: Mapping, path: str, cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` with the nodes, GPUs per node and network levels of a bench document (``path``
    names where it came from)."""
    fits, settings = field(doc, "fit"), field(doc, "context", "settings")
    for key, value in (("fit", fits), ("context.settings", settings), ("contention", doc.get("contention") or {})):
        if not isinstance(value, Mapping):
            raise Missing(f"its {key} is {shown(value)}, not a mapping")
    if (measured_as := _measured_otherwise(doc, settings)) is not None:
        raise SpecError(f"{path} {measured_as}")
    nodes, per_node = field(doc, "context", "nodes"), field(doc, "context", "ranks_per_node")
    for key, value in (("nodes", nodes), ("ranks_per_node", per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise Missing(f"its context.{key} is {shown(value)}, not a whole number of at least 1")
    if (world := field(doc, "context", "world")) != nodes * per_node:
        raise Missing(f"its context.world is {shown(world)}, where its {nodes} nodes of {per_node} ranks make "
                      f"{nodes * per_node}")
    levels, kept = {}, []
    groups = _context_groups(doc)
    for level, group, needed in (("intra_node", "intra", per_node > 1), ("inter_node", "inter", nodes > 1)):
        # the world's group is this level's where the other level has one rank: one rank a node, or one node
        alone = needed and (per_node == 1 or nodes == 1)
        measured_as = "world" if alone and not fits.get(group) else group
        group_fits = fits.get(measured_as) or {}
        if not isinstance(group_fits, Mapping):
            raise Missing(f"its fit.{measured_as} is {shown(group_fits)}, not a mapping")
        ranks = groups[measured_as][0] if measured_as in groups else None
        link = _link_from_fits(group_fits, measured_as, ranks, nodes * per_node, doc.get("results"))
        if link is None and needed:
            named = " ".join(name for name, spans in (("intra", per_node > 1), ("inter", nodes > 1)) if spans)
            raise SpecError(
                f"{path} has no usable all_gather or reduce_scatter fit for the {group!r} group; measure "
                f"it with `shardwire bench --groups {named} --ops all_gather reduce_scatter --json bench.json` "
                f"on the nodes it describes (a group of ranks on one node needs 2 there, one across nodes 2 "
                f"nodes: under their launcher, or `shardwire testbed run`), and give that file"
            )
        own = getattr(cluster, level)
        # a level the bench did not span (the other nodes of a one-node bench) keeps the cluster's shares
        measured = _contention(doc.get("contention") or {}, group, groups) if needed else {}
        # a share of 1 (nothing left to the other side) is kept just under it, where rates stay finite
        shares = {key: min(measured.get(key, getattr(own, key)), LIMITS[key].high)
                  for key in ("compute_share", "bandwidth_share")}
        levels[level] = dataclasses.replace(
            own, **({} if link is None else {"busbw_GBps": link.busbw_GBps, "latency_us": link.latency_us}),
            **shares)
        if link is None:
            kept.append(level.replace("_", "-"))
    engine_on_gloo = field(doc, "context", "backend") == "gloo" and settings.get("impl") == "shardwire"
    return parse("cluster", {
        **as_dict(cluster), "nodes": nodes, "gpus_per_node": per_node,
        "intra_node": as_dict(levels["intra_node"]), "inter_node": as_dict(levels["inter_node"]),
        "algorithm": "hierarchical" if engine_on_gloo else "ring",
        "name": _measured_name(cluster.name, path, kept),
    })


def _measured_name(name: str, path: str, kept: list[str]) -> str:
    """The name of cluster ``name`` measured by the bench at ``path``, saying which levels it did not
    measure (``kept``: the cluster's own), cut short within a spec name's bound (a name the user did
    not write is never refused)."""
    unmeasured = f" ({' and '.join(kept)} link{'s' * (len(kept) > 1)} not measured)" if kept else ""
    return cut(f"{name} measured by {one_line(os.path.basename(path))}{unmeasured}", MAX_NAME)


def _measured_otherwise(doc: Mapping, settings: Mapping) -> str | None:
    """How a bench document was measured so that its rates are not its links' (the words follow its
    path), or None: through a quantized wire (its times are of packed bytes, and a simulated wire
    would pack them again), with results that were wrong (a network or transport that corrupts
    data), or combining the ranks' times otherwise than by the slowest, which sets a collective's
    end."""
    rows = list(_rows(doc.get("results")))
    wire = settings.get("wire")
    if quantized := next((f"{op} on {group}" for group, op, row in rows if row.get("wire_bytes") is not None), None):
        through = f"sent its {quantized} through a quantized wire (its rows' wire_bytes)"
    elif wire not in (None, "none") and doc["context"].get("nodes") != 1:  # on one node no wire quantizes
        through = f"was measured with --wire {shown(wire)}"
    else:
        through = None
    if through is not None:
        return (f"{through}: its times are of quantized collectives, where the simulator prices a wire from the "
                f"link's own rate; measure it again without --wire")
    if (combine := settings.get("combine", "max")) != "max":
        return (f"was measured with --combine {shown(combine)}: a collective ends when its slowest rank does, which "
                f"--combine max (the default) measures; measure it again without --combine")
    for group, op, row in rows:
        for point in (row.get("out_of_place"), row.get("in_place")):
            wrong = point.get("wrong") if isinstance(point, Mapping) else None
            if wrong is not None and (type(wrong) is not int or wrong < 0):
                raise Missing(f"its {shown(op)} on the {shown(group)} group at {shown(row.get('bytes'))} bytes "
                              f"records {shown(wrong)} wrong elements, not a count")
            if wrong:
                return (f"records wrong results ({shown(wrong)} elements of its {shown(op)} on the {shown(group)} "
                        f"group at {shown(row.get('bytes'))} bytes, --check): timings of a transport that "
                        f"corrupts data are not its links'; find the cause, and measure again")
    return None


def _rows(results):
    """(group, op, row) for each size's row of a bench's ``results``, what is not of their shape
    passed over (its fits' check names it)."""
    for group, ops in (results.items() if isinstance(results, Mapping) else ()):
        for op, rows in (ops.items() if isinstance(ops, Mapping) else ()):
            rows = rows if isinstance(rows, list) else ()
            yield from ((group, op, row) for row in rows if isinstance(row, Mapping))


def _contention(contention: Mapping, group: str, groups: Mapping[str, tuple[int, int]]) -> Mapping:
    """What ``--contention`` measured of ``group``'s all-gather, else of the world's, else nothing.
    Each share is the median of its members' (``shardwire.bench.contention``), each within [0, 1]:
    one edited apart from them would slow the simulated compute by what no member measured; its
    members are the ranks of the group's instances (``groups``: each measured group's ranks and
    members, ``_context_groups``), and the median times it was measured from (``alone_s``,
    ``beside_s``) are the positive times the bench always records beside it."""
    if unmeasured := [name for name in contention if name != "workload" and name not in groups]:
        raise Missing(f"its contention has {shown(unmeasured[0])}, a group it did not measure (its groups: "
                      f"{', '.join(groups)})")
    for name in (group, "world"):
        if measured := contention.get(name):
            if not isinstance(measured, Mapping):
                raise Missing(f"its contention.{name} is {shown(measured)}, not a mapping")
            ranks, members = groups[name]
            if measured.get("ranks", ranks) != ranks:
                raise Missing(f"its contention.{name}.ranks is {shown(measured['ranks'])}, where its context's "
                              f"{name} group has {ranks}")
            for share, each_key in (("compute_share", "rank_shares"), ("bandwidth_share", "rank_bandwidth_shares")):
                if share not in measured:
                    continue
                found, each = measured[share], measured.get(each_key)
                if not (isinstance(each, list) and each and all(is_number(v) and 0 <= v <= 1 for v in each)):
                    raise Missing(f"its contention.{name}.{each_key} is {shown(each)}, not a list of shares from 0 "
                                  f"to 1")
                if len(each) != members:
                    raise Missing(f"its contention.{name}.{each_key} holds {len(each)} shares, where its context's "
                                  f"{name} group has {members} members")
                median = statistics.median(each)
                if not (is_number(found) and math.isclose(found, median, rel_tol=_REFIT_AGREE, abs_tol=1e-12)):
                    raise Missing(f"its contention.{name}.{share} is {shown(found)}, where the median of its "
                                  f"{each_key} is {median:.6g}")
            if "compute_share" in measured:
                # not compared with the share: the members' median times need not give their median share
                alone, beside = measured.get("alone_s"), measured.get("beside_s")
                if not all(is_number(t) and 0 < t < math.inf for t in (alone, beside)):
                    raise Missing(f"its contention.{name} gives alone_s {shown(alone)} and beside_s {shown(beside)}, "
                                  f"not the positive times its compute_share was measured from")
            return measured
    return {}


def _context_groups(doc: Mapping) -> dict[str, tuple[int, int]]:
    """Each group a bench document measured (``context.groups``, which bench always records), by
    name: its ranks, and how many ranks its measured instances hold together (``members``: the intra
    group of 2 nodes of 2 ranks has 4)."""
    recorded = doc["context"].get("groups")
    if not isinstance(recorded, Mapping) or not recorded:
        raise Missing(f"its context.groups is {shown(recorded)}, not a mapping of the groups it measured")
    groups = {}
    for name, group in recorded.items():
        ranks = group.get("ranks") if isinstance(group, Mapping) else None
        members = group.get("members") if isinstance(group, Mapping) else None
        if not (type(ranks) is int and ranks >= 1 and isinstance(members, list) and members
                and all(isinstance(m, list) and len(m) == ranks for m in members)):
            raise Missing(f"its context.groups.{name} is {shown(group)}, not a group's ranks and its instances' "
                          f"members")
        groups[name] = (ranks, sum(map(len, members)))
    return groups


def _link_from_fits(fits: Mapping, group: str, ranks: int | None, world: int, results) -> LinkSpec | None:
    """The link the all-gather and reduce-scatter fits of ``group`` describe (of ``ranks``, where the
    document records them, and of ``world`` at most), or None where no fit says it (a group of one
    rank; a time that did not grow with size). A value no fit has, or a fit its ``results`` do not
    give, is ``Missing``: the document was edited or damaged."""
    links = []
    for op in _LINK_OPS:
        fit, where = fits.get(op), f"fit.{group}.{op}"
        if not fit:
            continue
        if not isinstance(fit, Mapping):
            raise Missing(f"its {where} is {shown(fit)}, not a mapping")
        if missing := [key for key in ("ranks", "alpha_s", "beta_Bps") if key not in fit]:
            raise Missing(f"its {where} has no {', '.join(missing)}")
        k, alpha, beta = fit["ranks"], fit["alpha_s"], fit["beta_Bps"]
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= world:
            raise Missing(f"its {where}.ranks is {shown(k)}, not a whole number from 1 to the {world} ranks it ran")
        if ranks is not None and k != ranks:
            raise Missing(f"its {where}.ranks is {k}, where its context's {group} group has {ranks}")
        # a least-squares intercept may fall a little below zero (read as none), never seconds below
        if not (is_number(alpha) and _LEAST_INTERCEPT_S <= alpha < math.inf):
            raise Missing(f"its {where}.alpha_s is {shown(alpha)}, not a fitted latency in seconds")
        if beta is not None and not (is_number(beta) and 0 < beta < math.inf):
            raise Missing(f"its {where}.beta_Bps is {shown(beta)}, not a positive rate in bytes per second (or null)")
        if (differs := _refit_problem(fit, results, group, op)) is not None:
            raise Missing(f"its {where} {differs}")
        if beta and k > 1:
            links.append((beta * (k - 1) / k / 1e9, max(0.0, alpha) / (k - 1) * 1e6))
    if not links:
        return None
    return LinkSpec(busbw_GBps=sum(b for b, _ in links) / len(links),
                    latency_us=sum(a for _, a in links) / len(links))


def _refit_problem(fit: Mapping, results, group: str, op: str) -> str | None:
    """Where ``fit`` is not the fit of the times ``results`` hold for ``group``'s ``op`` at its
    placement, in words, or None. bench writes the fit of its own rows: one edited apart from
    them (a rate 7,000 times what any size reached) would set the simulated network's speed with a
    figure no size measured."""
    try:
        rows = results[group][op]
        sizes = [row["bytes"] for row in rows]
        seconds = [row[fit["placement"]]["time_us"] * 1e-6 for row in rows]
    except (KeyError, TypeError):
        return f"stands for no results of its own (results.{group}.{op} holds no times at its placement)"
    if not all(is_number(value) and 0 <= value < math.inf for value in (*sizes, *seconds)):
        return f"stands for results that are not sizes and times (results.{group}.{op} holds {shown(seconds)} s)"
    try:
        refit = fit_latency_bandwidth(sizes, seconds)
    except (ValueError, ZeroDivisionError):
        return f"stands for no results of its own (results.{group}.{op} holds no times at its placement)"
    if refit is None or fit.get("points") != refit.points:
        return f"counts {shown(fit.get('points'))} sizes, where its results hold {len(rows)}"
    beta = math.inf if fit["beta_Bps"] is None else fit["beta_Bps"]
    for key, value, given in (("alpha_s", refit.alpha, fit["alpha_s"]), ("beta_Bps", refit.beta, beta)):
        if not math.isclose(given, value, rel_tol=_REFIT_AGREE, abs_tol=1e-15):
            return f"has {key} {given:.6g}, where its results give {value:.6g}"
    return None


@contextlib.contextmanager
def _spec_errors():
    """Input that cannot be read as a mapping is input that cannot be simulated."""
    try:
        yield
    except MappingError as err:
        raise SpecError(str(err)) from None


def _merged(base: dict, changes: Mapping) -> dict:
    """``base`` with ``changes``; a nested mapping (a network level) is changed key by key."""
    merged = dict(base)
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The input options ``shardwire simulate`` and ``shardwire plan`` share."""
    parser.add_argument("--model", required=True, type=spec_text,
                        help=f"preset ({', '.join(PRESETS['model'])}), hf:CONFIG (a Hugging Face config.json, its "
                             f"directory, or inline JSON), JSON/YAML, or a file")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (overrides the model's)")
    parser.add_argument("--cluster", required=True, type=spec_text,
                        help=f"preset ({', '.join(PRESETS['cluster'])}), JSON/YAML, or a file")
    parser.add_argument("--training", default="default", type=spec_text,
                        help=f"preset ({', '.join(PRESETS['training'])}), JSON/YAML, or a file (default: default)")
    parser.add_argument("--nodes", type=int, help="number of nodes (overrides the cluster's)")
    parser.add_argument("--cluster-from", metavar="BENCH_JSON", type=text,
                        help="take nodes, GPUs per node and both network levels from `shardwire bench --json` output")
    parser.add_argument("--calibrate", metavar="PROFILE_JSON", type=text,
                        help="fit the GPU's compute model to a profile of one GPU of that kind (the profile.json of "
                             "`shardwire train --profile` or its --run-dir, or of benchmarks/gpu_single.py --trace)")
    parser.add_argument("--node-mtbf", type=float, metavar="HOURS",
                        help="a node's mean time between failures: price what failures cost, restarting from a "
                             "checkpoint and, under DiLoCo, recovering the lost group live (--fault-tolerance)")
    parser.add_argument("--save-every", type=int, metavar="STEPS",
                        help="with --node-mtbf: steps between checkpoints (default: Young's interval, the one that "
                             "loses the least)")


def load_arguments(args: argparse.Namespace) -> tuple[ModelSpec, ClusterSpec, TrainingSpec]:
    """(model, cluster, training) from the options of ``add_arguments``; raises ``SpecError``."""
    if args.seq_len is not None and args.seq_len < 1:
        raise SpecError(f"--seq-len must be at least 1, got {args.seq_len}")
    model = load_model(args.model, args.seq_len)
    cluster, given = load_spec_given("cluster", args.cluster)
    training = load_spec("training", args.training)
    if args.calibrate:
        cluster = calibrated(cluster, read_profile(args.calibrate, load_model), args.calibrate)
    if args.cluster_from:
        measured = cluster_from_bench(args.cluster_from, cluster)
        if replaced := sorted(key for key in given & MEASURED_BY_BENCH
                              if getattr(measured, key) != getattr(cluster, key)):
            warnings.warn(f"--cluster-from {one_line(args.cluster_from)} replaces the --cluster's "
                          f"{', '.join(replaced)} with what it measured; leave them out of --cluster")
        cluster = measured
    if args.nodes is not None:
        cluster = parse("cluster", {**as_dict(cluster), "nodes": args.nodes})
    return model, cluster, training


def load_failure_rate(args: argparse.Namespace) -> FailureRate | None:
    """The failure rate ``--node-mtbf`` and ``--save-every`` give (None without them); raises ``SpecError``."""
    if args.node_mtbf is None:
        if args.save_every is not None:
            raise SpecError("--save-every sets the checkpoints of --node-mtbf's pricing: give --node-mtbf HOURS too")
        return None
    return FailureRate(args.node_mtbf, args.save_every)
