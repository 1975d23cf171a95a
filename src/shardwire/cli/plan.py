"""``shardwire plan``: the fastest settings that fit, and why they win.

    shardwire plan --model llama2-7b --cluster a100-100gbe --nodes 4 --global-batch 256

Exit status: 0, or 2 when the input cannot be planned for (including when nothing fits).
"""

from __future__ import annotations

import argparse
import json
import sys

from shardwire.sim import inputs
from shardwire.sim.planner import plan
from shardwire.sim.report import plan_json, plan_text
from shardwire.sim.specs import SpecError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    inputs.add_arguments(parser)
    parser.add_argument("--global-batch", type=int, required=True,
                        help="sequences per optimizer step, all GPUs together")
    parser.add_argument("--exact", action="store_true",
                        help="only settings that train as synchronous full-precision training does: no quantized "
                             "wire, no sync every H steps (both change the optimisation)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the report")
    parser.epilog = ("--training gives what is not searched (precision, kernel efficiency); micro-batch, "
                     "layout, prefetch, activation checkpointing and, on several nodes, the wire and sync every "
                     "H steps are searched, and the rest is what the engine runs.")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        model, cluster, training = inputs.load_arguments(args)
        result = plan(model, cluster, args.global_batch, training, exact=args.exact)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan_json(result, args.global_batch), indent=1))
    else:
        print(plan_text(result, args.global_batch))
    return 0
