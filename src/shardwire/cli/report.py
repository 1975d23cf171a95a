"""``shardwire report RUN_DIR [RUN_DIR ...]``: plots of profiled runs (``shardwire.profile.report``),
written beside the first run unless ``--out`` says where."""

from __future__ import annotations

import argparse
import sys

from shardwire.mappings import one_line, refusal
from shardwire.options import argument_text, text
from shardwire.profile.report import ReportError, write_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", type=argument_text,
                        help="directories written by `shardwire train --profile --run-dir RUN_DIR`")
    parser.add_argument("--out", type=text, help="where to write the PNGs (default: the first RUN_DIR)")


def run(args: argparse.Namespace, argv: list[str], checked) -> int:
    """The profiles are checked as they are read: what ``checked`` holds is said once they were."""
    try:
        written = write_report(args.run_dirs, args.out)
    except ReportError as err:
        print(refusal(f"error: {err}"), file=sys.stderr)
        return 2
    checked()
    for path in written:
        print(one_line(str(path)))
    return 0
