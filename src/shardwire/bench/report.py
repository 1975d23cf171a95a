"""What ``shardwire bench`` prints and saves: nccl-tests' table, the summary and fit of each
operation, and the same numbers as JSON, CSV and a plot.

The JSON document (``--json``) is read by the simulator; its schema, ``shardwire.bench/1``::

    {
      "schema": "shardwire.bench/1",
      "context": {
        "world": 4, "nodes": 2, "ranks_per_node": 2, "backend": "nccl",
        "devices": {"NVIDIA H100 80GB HBM3": 4}, "hosts": ["node0", "node1"],
        "torch": "2.6.0", "nccl": "2.21.5" | null,
        "env": {"NCCL_SOCKET_IFNAME": "eth0", ...},      # the transport variables that are set
        "groups": {"world": {"ranks": 4, "members": [[0, 1, 2, 3]]},
                   "intra": {"ranks": 2, "members": [[0, 1], [2, 3]]},   # measured at once
                   "inter": {"ranks": 2, "members": [[0, 2]]}},
        "settings": {"ops": [...], "dtype": "float32", "redop": "sum", "root": 0, "impl": "torch",
                     "wire": "none",                       # --wire (shardwire.comm.wire)
                     "warmup": 5, "iters": 20, "blocking": false, "check": true, "combine": "max",
                     "sizes": [1024, ...]},
        "command": "shardwire bench ..."
      },
      "results": {GROUP: {OP: [                          # one entry per size, ascending
        {"bytes": S, "wire_bytes": S' | null, "count": 256, "dtype": "float32", "redop": "sum" | null,
         "root": 0 | null, "out_of_place": POINT | null, "in_place": POINT | null}]}},   # null: no such form
      "summary": {GROUP: {OP: {
        "ranks": 4, "placement": "out_of_place",
        "peak_busbw_GBps": 9.1, "peak_bytes": S,
        "bytes_to_80pct": S, "bytes_to_90pct": S,        # smallest sizes reaching 80 / 90 % of peak
        "avg_busbw_GBps_from_1MiB": 8.7 | null}}},
      "fit": {GROUP: {OP: {                              # t(S) = alpha_s + S / beta_Bps
        "ranks": 4, "placement": "out_of_place", "alpha_s": 3.1e-05,
        "beta_Bps": 1.1e+10 | null,                      # null: time did not grow with size
        "r2": 0.998, "points": 17} | null}},             # null: fewer than two sizes
      "contention": {                                    # only with --contention (shardwire.bench.contention)
        "workload": {"op": "matmul", "n": 1024, "dtype": "float32", "count": 8},
        GROUP: {"ranks": 4, "all_gather_bytes": S,
                "alone_s": 0.31, "beside_s": 0.42,        # the workload's time, median over the members
                "compute_share": 0.26,                   # 1 - alone / beside, median over the members
                "rank_shares": [0.25, ...],              # each member's, in group order
                "all_gather_s": 0.05,                    # one all-gather alone, median over the members
                "bandwidth_share": 0.3,                  # what the workload took from the all-gathers
                "rank_bandwidth_shares": [0.3, ...]}}
    }

    POINT = {"time_us": 812.4, "algbw_GBps": 5.2, "busbw_GBps": 9.1, "wrong": 0 | null}

S is nccl-tests' size of the operation in bytes (see ``metrics``), on which algbw and busbw are
computed whatever the wire; S' the same size as it was sent where ``--wire`` quantized it (the
bytes a rank sent are S' times what they would be for S), null otherwise; GB/s are 10^9 bytes/s;
``wrong`` is null when the run did not check results (on a quantized wire it counts elements
moved by more than quantization can move them).
"""

from __future__ import annotations

import csv
import io
import math

from shardwire.bench.metrics import LatencyBandwidthFit
from shardwire.bench.ops import OPERATIONS, OUT_OF_PLACE
from shardwire.bench.schema import SCHEMA
from shardwire.bench.sweep import PLACEMENTS, OpResult, Point, Row
from shardwire.extras import require
from shardwire.files import figure_png

GB = 1e9

_COLUMNS = "{:>12} {:>12} {:>13} {:>6} {:>5}"
_FORM_COLUMNS = "  {:>8} {:>7} {:>7} {:>6}"


def format_size(nbytes: int) -> str:
    """Bytes in the largest binary unit they reach: 1000 B, 64 KiB, 1.5 MiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def header_lines(context: dict) -> list[str]:
    settings = context["settings"]
    devices = ", ".join(f"{count} x {name}" for name, count in context["devices"].items())
    env = " ".join(f"{k}={v}" for k, v in sorted(context["env"].items())) or "no NCCL_*, GLOO_* or FI_* variable set"
    sizes = settings["sizes"]
    timing = "blocking (each waited before the next)" if settings["blocking"] else "non-blocking"
    return [
        f"# shardwire bench: {context['world']} ranks = {_plural(context['nodes'], 'node')} x "
        f"{context['ranks_per_node']} ranks, backend {context['backend']}, torch {context['torch']}, "
        f"NCCL {context['nccl'] or '-'}",
        f"# devices: {devices}; hosts: {', '.join(context['hosts'])}",
        f"# env: {env}",
        f"# sizes {format_size(sizes[0])} .. {format_size(sizes[-1])} ({len(sizes)}), {settings['dtype']}, "
        f"redop {settings['redop']}, root {settings['root']}, {_implementations(settings)}",
        f"# warmup {settings['warmup']}, iters {settings['iters']}, {timing}; time: {settings['combine']} over "
        f"ranks; check {'on' if settings['check'] else 'off'}",
    ]


def _implementations(settings: dict) -> str:
    """Whose collectives ran: with ``--impl shardwire`` the engine's transport runs only the operations
    it has (all_gather, reduce_scatter); torch's run the others."""
    if settings["impl"] != "shardwire":
        return f"{settings['impl']} collectives"
    ran = {owner: [op for op in settings["ops"] if OPERATIONS[op].engine == (owner == "shardwire")]
           for owner in ("shardwire", "torch")}
    return "; ".join(f"{owner}'s {', '.join(ops)}" for owner, ops in ran.items() if ops)


def contention_line(group: str, workload: dict, result: dict) -> str:
    """One group's ``--contention`` result (``shardwire.bench.contention``)."""
    shares, bandwidth = result["rank_shares"], result["rank_bandwidth_shares"]
    return (f"# contention {group}: {workload['count']} x {workload['n']}^2 {workload['dtype']} matmuls "
            f"{result['alone_s'] * 1e3:.1f} ms alone, {result['beside_s'] * 1e3:.1f} ms beside an all_gather of "
            f"{format_size(result['all_gather_bytes'])} ({result['all_gather_s'] * 1e3:.1f} ms alone), the members' "
            f"medians: compute share {result['compute_share']:.3f} (the median of each member's own 1 - alone/beside, "
            f"within 0 to 1: {min(shares):.3f} to {max(shares):.3f}), bandwidth share {result['bandwidth_share']:.3f} "
            f"({min(bandwidth):.3f} to {max(bandwidth):.3f})")


def rounding_note(align: int, split: bool, rounded: list[tuple[int, int]]) -> str:
    """Say which asked sizes were rounded up, and why."""
    why = "one element per rank" if split else "whole elements"
    pairs = ", ".join(f"{asked} -> {used}" for asked, used in rounded[:4]) + (", ..." if len(rounded) > 4 else "")
    return f"# note: sizes rounded up to multiples of {align} B ({why}): {pairs}"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def table_head(result: OpResult) -> list[str]:
    title = f"# {result.op} on {result.group} ({result.ranks} ranks)"
    forms = "".join(f"  {'out-of-place':^31}" if p == OUT_OF_PLACE else f"  {'in-place':^31}" for p in PLACEMENTS)
    names = _COLUMNS.format("size", "count", "type", "redop", "root")
    units = _COLUMNS.format("(B)", "(elements)", "", "", "")
    for _ in PLACEMENTS:
        names += _FORM_COLUMNS.format("time", "algbw", "busbw", "#wrong")
        units += _FORM_COLUMNS.format("(us)", "(GB/s)", "(GB/s)", "")
    lines = [title, "#" + " " * (len(_COLUMNS.format(*[""] * 5)) - 1) + forms, "#" + names[1:], "#" + units[1:]]
    return [line.rstrip() for line in lines]


def format_row(result: OpResult, row: Row) -> str:
    line = _COLUMNS.format(row.nbytes, row.count, result.dtype, result.redop or "none",
                           -1 if result.root is None else result.root)
    for placement in PLACEMENTS:
        point = row.points.get(placement)
        if point is None:
            line += _FORM_COLUMNS.format("-", "-", "-", "-")
        else:
            wrong = "N/A" if point.wrong is None else point.wrong
            line += _FORM_COLUMNS.format(_format_us(point.seconds * 1e6), f"{point.algbw / GB:.2f}",
                                         f"{point.busbw / GB:.2f}", wrong)
    return line


def _format_us(us: float) -> str:
    """nccl-tests' time format: fewer decimals as the time grows."""
    return f"{us:.0f}" if us >= 10000 else f"{us:.1f}" if us >= 100 else f"{us:.2f}"


def summary_lines(result: OpResult) -> list[str]:
    sat, fit = result.saturation(), result.fit()
    form = result.placement.replace("_", "-")
    average = "-" if sat.avg_busbw_from_1mib is None else f"{sat.avg_busbw_from_1mib / GB:.2f} GB/s"
    lines = [
        f"# {result.op} on {result.group}, {form}: peak busbw {sat.peak_busbw / GB:.2f} GB/s at "
        f"{format_size(sat.peak_bytes)}; 80% of it from {format_size(sat.bytes_to_80pct)}, 90% from "
        f"{format_size(sat.bytes_to_90pct)}; avg busbw over sizes >= 1 MiB: {average}",
    ]
    if fit is not None:
        model = "" if math.isinf(fit.beta) else f" + S / {fit.beta / GB:.3g} GB/s"
        flat = ", time did not grow with size" if math.isinf(fit.beta) else ""
        lines.append(f"# fit: t = {fit.alpha * 1e6:.3g} us{model}  (r2 {fit.r2:.4f}, {fit.points} sizes{flat})")
    largest = result.rows[-1] if result.rows else None
    if largest is not None and largest.wire_nbytes is not None:
        lines.append(f"# on the wire: {largest.wire_nbytes / largest.nbytes:.1%} of the bytes at "
                     f"{format_size(largest.nbytes)} (quantized; algbw and busbw are on the uncompressed size)")
    return lines


def document(context: dict, results: list[OpResult], contention: dict | None = None) -> dict:
    """The JSON document (schema in the module docstring)."""
    doc = {"schema": SCHEMA, "context": context, "results": {}, "summary": {}, "fit": {}}
    if contention is not None:
        doc["contention"] = contention
    for result in results:
        doc["results"].setdefault(result.group, {})[result.op] = [
            {"bytes": row.nbytes, "wire_bytes": row.wire_nbytes, "count": row.count, "dtype": result.dtype,
             "redop": result.redop,
             "root": result.root, **{p: _point_json(row.points.get(p)) for p in PLACEMENTS}}
            for row in result.rows
        ]
        sat = result.saturation()
        doc["summary"].setdefault(result.group, {})[result.op] = {
            "ranks": result.ranks,
            "placement": result.placement,
            "peak_busbw_GBps": sat.peak_busbw / GB,
            "peak_bytes": sat.peak_bytes,
            "bytes_to_80pct": sat.bytes_to_80pct,
            "bytes_to_90pct": sat.bytes_to_90pct,
            "avg_busbw_GBps_from_1MiB": None if sat.avg_busbw_from_1mib is None else sat.avg_busbw_from_1mib / GB,
        }
        doc["fit"].setdefault(result.group, {})[result.op] = _fit_json(result, result.fit())
    return doc


def _point_json(point: Point | None) -> dict | None:
    if point is None:
        return None
    return {"time_us": point.seconds * 1e6, "algbw_GBps": point.algbw / GB, "busbw_GBps": point.busbw / GB,
            "wrong": point.wrong}


def _fit_json(result: OpResult, fit: LatencyBandwidthFit | None) -> dict | None:
    if fit is None:
        return None
    return {"ranks": result.ranks, "placement": result.placement, "alpha_s": fit.alpha,
            "beta_Bps": None if math.isinf(fit.beta) else fit.beta, "r2": fit.r2, "points": fit.points}


CSV_FIELDS = ("group", "ranks", "op", "placement", "bytes", "count", "dtype", "redop", "root",
              "time_us", "algbw_GBps", "busbw_GBps", "wrong")


def csv_text(results: list[OpResult]) -> str:
    """One line per group, operation, size and form (empty cells: not applicable or not checked)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_FIELDS)
    for result in results:
        for row in result.rows:
            for placement, point in row.points.items():
                writer.writerow([
                    result.group, result.ranks, result.op, placement, row.nbytes, row.count, result.dtype,
                    result.redop or "", "" if result.root is None else result.root,
                    f"{point.seconds * 1e6:.3f}", f"{point.algbw / GB:.6g}", f"{point.busbw / GB:.6g}",
                    "" if point.wrong is None else point.wrong,
                ])
    return out.getvalue()


def plot_png(results: list[OpResult]) -> bytes:
    """busbw against size, one panel per measured group and one line per operation."""
    require("matplotlib", "--plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups = list(dict.fromkeys(result.group for result in results))
    figure = Figure(figsize=(6 * len(groups), 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(groups), squeeze=False)[0]
    for ax, group in zip(axes, groups):
        measured = [result for result in results if result.group == group]
        for result in measured:
            sizes, points = result.sizes_and_points()
            label = result.op if result.placement == OUT_OF_PLACE else f"{result.op} (in-place)"
            ax.plot(sizes, [p.busbw / GB for p in points], marker=".", label=label)
        ax.set_xscale("log", base=2)
        ticks = sorted({row.nbytes for result in measured for row in result.rows})
        ticks = ticks[:: max(1, len(ticks) // 8)]
        ax.set_xticks(ticks, [format_size(t).replace(" ", "") for t in ticks], rotation=45)
        ax.minorticks_off()
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{group} ({measured[0].ranks} ranks)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    return figure_png(figure, "bench-plot")
