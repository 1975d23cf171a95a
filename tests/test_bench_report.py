"""What ``shardwire bench`` prints and saves: the JSON schema the simulator reads, the CSV, the
plot, files that are never half-written, and one real run of the command end to end."""

from __future__ import annotations

import csv
import io
import json
import math
import subprocess
import sys

import pytest

from shardwire.bench import report
from shardwire.bench.metrics import bandwidth
from shardwire.bench.ops import IN_PLACE, OUT_OF_PLACE
from shardwire.bench.sweep import OpResult, Point, Row

POINT_KEYS = {"time_us", "algbw_GBps", "busbw_GBps", "wrong"}
ROW_KEYS = {"bytes", "wire_bytes", "count", "dtype", "redop", "root", OUT_OF_PLACE, IN_PLACE}
SUMMARY_KEYS = {"ranks", "placement", "peak_busbw_GBps", "peak_bytes", "bytes_to_80pct", "bytes_to_90pct",
                "avg_busbw_GBps_from_1MiB"}
FIT_KEYS = {"ranks", "placement", "alpha_s", "beta_Bps", "r2", "points"}
CONTEXT_KEYS = {"world", "nodes", "ranks_per_node", "backend", "devices", "hosts", "torch", "nccl", "env",
                "groups", "settings", "command"}
SETTINGS_KEYS = {"ops", "dtype", "redop", "root", "impl", "wire", "warmup", "iters", "blocking", "check", "combine",
                 "sizes"}


def assert_bench_schema(doc: dict) -> None:
    """``doc`` follows schema shardwire.bench/1 exactly (shardwire.bench.report's module docstring)."""
    assert set(doc) == {"schema", "context", "results", "summary", "fit"}
    assert doc["schema"] == "shardwire.bench/1"
    context = doc["context"]
    assert set(context) == CONTEXT_KEYS
    assert context["world"] == context["nodes"] * context["ranks_per_node"]
    assert all(isinstance(n, int) and n > 0 for n in context["devices"].values())
    assert set(context["settings"]) == SETTINGS_KEYS
    groups = context["groups"]
    assert set(doc["results"]) == set(doc["summary"]) == set(doc["fit"]) == set(groups) <= {"world", "intra", "inter"}
    for group, ops in doc["results"].items():
        assert set(ops) == set(doc["summary"][group]) == set(doc["fit"][group])
        ranks = groups[group]["ranks"]
        assert all(len(members) == ranks for members in groups[group]["members"])
        for op, rows in ops.items():
            assert [row["bytes"] for row in rows] == sorted(row["bytes"] for row in rows)
            for row in rows:
                assert set(row) == ROW_KEYS
                assert isinstance(row["bytes"], int) and isinstance(row["count"], int)
                points = [row[form] for form in (OUT_OF_PLACE, IN_PLACE) if row[form] is not None]
                assert points, "every size has at least one form"
                for point in points:
                    assert set(point) == POINT_KEYS
                    assert point["time_us"] > 0 and point["busbw_GBps"] >= 0
                    assert point["algbw_GBps"] == pytest.approx(row["bytes"] / point["time_us"] / 1e3)
                    assert point["wrong"] is None or isinstance(point["wrong"], int)
            summary = doc["summary"][group][op]
            assert set(summary) == SUMMARY_KEYS and summary["ranks"] == ranks
            busbws = [row[summary["placement"]]["busbw_GBps"] for row in rows]
            assert summary["peak_busbw_GBps"] == pytest.approx(max(busbws))
            assert summary["bytes_to_80pct"] <= summary["bytes_to_90pct"] <= summary["peak_bytes"]
            fit = doc["fit"][group][op]
            if fit is not None:
                assert set(fit) == FIT_KEYS and fit["ranks"] == ranks
                assert fit["alpha_s"] >= 0 and (fit["beta_Bps"] is None or fit["beta_Bps"] > 0)
                assert fit["points"] == len(rows)


def synthetic(group="world", ranks=4, op="all_gather", alpha=20e-6, beta=2e9, forms=(OUT_OF_PLACE, IN_PLACE)):
    """An OpResult whose times follow t = alpha + S / beta exactly."""
    result = OpResult(group=group, ranks=ranks, op=op, dtype="float32", redop=None, root=None, placement=forms[0])
    for k in range(10, 25):
        nbytes = 1 << k
        seconds = alpha + nbytes / beta
        rate = bandwidth(op, nbytes, seconds, ranks)
        point = Point(seconds, rate.algbw, rate.busbw, 0)
        result.rows.append(Row(nbytes=nbytes, count=nbytes // 4 // ranks, points={form: point for form in forms}))
    return result


CONTEXT = {
    "world": 4, "nodes": 2, "ranks_per_node": 2, "backend": "gloo", "devices": {"cpu (test)": 4},
    "hosts": ["a", "b"], "torch": "2.13.0", "nccl": None, "env": {"GLOO_SOCKET_IFNAME": "lo"},
    "groups": {"world": {"ranks": 4, "members": [[0, 1, 2, 3]]}, "inter": {"ranks": 2, "members": [[0, 2]]}},
    "settings": {"ops": ["all_gather", "all_reduce"], "dtype": "float32", "redop": "sum", "root": 0,
                 "impl": "torch", "wire": "none", "warmup": 1, "iters": 2, "blocking": False, "check": True,
                 "combine": "max",
                 "sizes": [1 << k for k in range(10, 25)]},
    "command": "shardwire bench --nproc 4 --ops all_gather all_reduce -w 1 -n 2 --check --groups world inter",
}
RESULTS = [
    synthetic(),
    synthetic(op="all_reduce", forms=(IN_PLACE,)),
    synthetic(group="inter", ranks=2, alpha=80e-6, beta=1e8),
    synthetic(group="inter", ranks=2, op="all_reduce", forms=(IN_PLACE,), alpha=80e-6, beta=1e8),
]


def test_json_document_follows_the_schema_and_carries_the_fit_the_simulator_reads():
    doc = json.loads(json.dumps(report.document(CONTEXT, RESULTS)))  # what a reader of the file gets
    assert_bench_schema(doc)
    fit = doc["fit"]["inter"]["all_gather"]
    assert fit["alpha_s"] == pytest.approx(80e-6) and fit["beta_Bps"] == pytest.approx(1e8)
    assert doc["results"]["world"]["all_reduce"][0][OUT_OF_PLACE] is None
    assert doc["summary"]["world"]["all_reduce"]["placement"] == IN_PLACE
    assert doc["summary"]["world"]["all_gather"]["avg_busbw_GBps_from_1MiB"] is not None


def test_table_rows_follow_nccl_tests_columns_and_mark_missing_forms():
    result = RESULTS[1]
    head = report.table_head(result)
    assert "out-of-place" in head[1] and "in-place" in head[1]
    assert head[2].split() == ["#", "size", "count", "type", "redop", "root"] + ["time", "algbw", "busbw", "#wrong"] * 2
    row = report.format_row(result, result.rows[0]).split()
    assert row[:5] == ["1024", "64", "float32", "none", "-1"]
    assert row[5:9] == ["-"] * 4 and row[-1] == "0"
    summary = "\n".join(report.summary_lines(RESULTS[2]))
    assert "fit: t = 80 us + S / 0.1 GB/s" in summary


def test_the_header_says_whose_collectives_ran_each_operation():
    """--impl shardwire runs only all_gather and reduce_scatter on the engine's transport."""
    assert "torch collectives" in report.header_lines(CONTEXT)[3]
    engine = {**CONTEXT, "settings": {**CONTEXT["settings"], "impl": "shardwire",
                                      "ops": ["all_gather", "all_reduce", "reduce_scatter", "broadcast"]}}
    assert report.header_lines(engine)[3].endswith(
        "shardwire's all_gather, reduce_scatter; torch's all_reduce, broadcast")


def test_csv_has_one_line_per_group_op_size_and_form():
    rows = list(csv.DictReader(io.StringIO(report.csv_text(RESULTS))))
    assert len(rows) == 15 * (2 + 1 + 2 + 1)
    assert set(rows[0]) == set(report.CSV_FIELDS)
    first = rows[0]
    assert [first[k] for k in ("group", "op", "placement", "bytes")] == ["world", "all_gather", OUT_OF_PLACE, "1024"]


def test_plot_is_a_png_with_a_panel_per_group():
    png = report.plot_png(RESULTS)
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.slow
def test_the_command_runs_checks_and_saves_json_csv_and_plot(tmp_path):
    out = {name: tmp_path / f"bench.{name}" for name in ("json", "csv", "png")}
    command = [
        sys.executable, "-m", "shardwire", "bench", "--nproc", "2", "--ops", "all_reduce", "all_gather",
        "-b", "1004", "-e", "64K", "-f", "4", "-w", "1", "-n", "2", "--check",
        "--json", str(out["json"]), "--csv", str(out["csv"]), "--plot", str(out["png"]),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # all_gather cuts the buffer in one float32 per rank: 1004 B rounds up to 1008, and says so
    assert "# note: sizes rounded up to multiples of 8 B (one element per rank): 1004 -> 1008" in done.stdout
    assert "# all_reduce on world (2 ranks)" in done.stdout and "# fit: t =" in done.stdout
    doc = json.loads(out["json"].read_text())
    assert_bench_schema(doc)
    assert [row["bytes"] for row in doc["results"]["world"]["all_gather"]] == [1008, 4016, 16064, 64256]
    assert all(row[IN_PLACE]["wrong"] == 0 for rows in doc["results"]["world"].values() for row in rows)
    assert doc["context"]["backend"] == "gloo" and doc["context"]["world"] == 2
    # the settings the launcher checked, as its workers ran them: a command that runs the same again
    assert doc["context"]["command"].startswith("shardwire bench --ops all_reduce all_gather --min-bytes 1004 "
                                                "--max-bytes 65536 --step-factor 4 --warmup 1 --iters 2 --check")
    assert len(out["csv"].read_text().splitlines()) == 1 + 4 + 4 * 2
    assert out["png"].read_bytes().startswith(b"\x89PNG")
    assert not math.isnan(doc["summary"]["world"]["all_reduce"]["peak_busbw_GBps"])
