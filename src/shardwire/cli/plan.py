"""``shardwire plan``: the fastest settings that fit, and why they win.

    shardwire plan --model gpt-1.3b --cluster a100-100gbe --nodes 4 --global-batch 256 --exact

Exit status: 0, or 2 when the input cannot be planned for (including when nothing fits).
"""

from __future__ import annotations

import argparse
import json
import sys

from shardwire.cli import refused
from shardwire.mappings import refusal
from shardwire.sim import inputs
from shardwire.sim.planner import check_global_batch, plan
from shardwire.sim.report import plan_json, plan_text
from shardwire.sim.specs import SpecError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    inputs.add_arguments(parser)
    parser.add_argument("--global-batch", type=int, required=True,
                        help="sequences per optimizer step, all GPUs together")
    parser.add_argument("--exact", action="store_true",
                        help="exact collectives only: no quantized wire, which is lossy, and no DiLoCo (sync every H "
                             "steps) offered (it changes the optimisation)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the report")
    parser.epilog = ("--training gives what is not searched (precision, compilation); micro-batch, layout, "
                     "prefetch, activation checkpointing and, on several nodes, the wire are searched, and the "
                     "rest is what the engine runs; on several nodes the fastest hybrid configuration under DiLoCo "
                     "(--diloco sync_every=20) is offered beside the choice. Each choice comes with the torchrun "
                     "command that runs it on every node. --node-mtbf prices node failures for the choice and the "
                     "DiLoCo one: restarting from a checkpoint, and recovering the lost group live.")


def check_options(args: argparse.Namespace) -> None:
    """What ``--print-config`` checks before it prints: the specs, the failure rate and the global
    batch against the cluster, refused in the words and with the status of a run."""
    with refused(SpecError):
        _checked(args)


def _checked(args: argparse.Namespace):
    """The specs and failure rate the arguments give, the global batch checked against the cluster."""
    model, cluster, training = inputs.load_arguments(args)
    rate = inputs.load_failure_rate(args)
    check_global_batch(args.global_batch, cluster)
    return model, cluster, training, rate


def run(args: argparse.Namespace, argv: list[str], checked) -> int:
    try:
        model, cluster, training, rate = _checked(args)
        checked()
        result = plan(model, cluster, args.global_batch, training, exact=args.exact)
        shown = (json.dumps(plan_json(result, args.global_batch, args.model, rate), indent=1) if args.json
                 else plan_text(result, args.global_batch, args.model, rate))
    except SpecError as err:
        print(refusal(f"error: {err}"), file=sys.stderr)
        return 2
    print(shown)
    return 0
