"""``shardwire plan``: the fastest settings that fit, and why they win.

    shardwire plan --model llama2-7b --cluster a100-100gbe --nodes 4 --global-batch 256

Exit status: 0, or 2 when the input cannot be planned for (including when nothing fits).
"""

from __future__ import annotations

import argparse
import json
import sys

from shardwire.sim import inputs, report
from shardwire.sim.explain import slowdown_text, verdict
from shardwire.sim.memory import GIB
from shardwire.sim.planner import Plan, describe_settings, launch_command, plan, runnable, shard_call
from shardwire.sim.specs import SpecError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    inputs.add_arguments(parser)
    parser.add_argument("--global-batch", type=int, required=True,
                        help="sequences per optimizer step, all GPUs together")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the report")
    parser.epilog = ("--training gives what is not searched (precision, kernel efficiency); micro-batch, "
                     "layout, prefetch, activation checkpointing and, on several nodes, the wire are "
                     "searched, and the rest is what the engine runs.")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        model, cluster, training = inputs.load_arguments(args)
        result = plan(model, cluster, args.global_batch, training)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan_json(result, args.global_batch), indent=1))
    else:
        print(plan_text(result, args.global_batch))
    return 0


def plan_json(result: Plan, global_batch: int) -> dict:
    best = result.best.step_time_s
    return {
        "global_batch": global_batch,
        "best": _with_run(result.best),
        "runner_up": None if result.runner_up is None else _with_run(result.runner_up),
        "alternatives": [
            {"change": a.change, "step_time_s": a.step_time_s, "fits": a.memory.fits,
             "memory_gb_per_gpu": a.memory.total / GIB,
             "slower_by": None if a.step_time_s is None else a.step_time_s / best - 1}
            for a in result.alternatives
        ],
        "candidates": result.candidates,
        "fitting": result.fitting,
    }


def _with_run(p) -> dict:
    options, shard_args = runnable(p.training, p.cluster)
    return {**report.prediction_json(p), "run": {"command": launch_command(p.training, p.cluster),
                                                 "train_options": options, "shard_arguments": shard_args}}


def _how_to_run(p) -> list[str]:
    return [f"          run:   {launch_command(p.training, p.cluster)}",
            f"          or:    {shard_call(p.training, p.cluster)}"]


def plan_text(result: Plan, global_batch: int) -> str:
    best = result.best
    t = best.training
    setup = report.describe_setup(best)
    lines = [
        *setup[:2],
        f"search    global batch {global_batch} = {t.micro_batch * t.grad_accum} per GPU; {result.candidates} "
        f"configurations, {result.fitting} fit in memory",
        "",
        f"best      {describe_settings(t)}",
        f"          step {best.step_time_s:.4g} s, {best.samples_per_step / best.step_time_s:.4g} samples/s, "
        f"{slowdown_text(best)}, {100 * best.exposed_comm_s / best.step_time_s:.1f}% exposed communication, "
        f"MFU {100 * best.mfu:.1f}%, {best.memory.total / GIB:.1f} of {best.memory.usable / GIB:.1f} GiB usable",
        f"          {verdict(best)}",
        *(f"          note: {n}" for n in report.notes(best)),
        *_how_to_run(best),
        "",
        "why: each setting changed alone",
    ]
    for a in sorted(result.alternatives, key=lambda a: (a.step_time_s is None, a.step_time_s or 0)):
        if a.step_time_s is None:
            outcome = (f"does not fit: needs {a.memory.total / GIB:.1f} GiB, "
                       f"{a.memory.shortfall / GIB:.1f} more than usable")
        else:
            outcome = f"{a.step_time_s:.4g} s ({100 * (a.step_time_s / best.step_time_s - 1):+.1f}%)"
        lines.append(f"  {a.change:<44} {outcome}")
    if result.runner_up is not None:
        r = result.runner_up
        lines += ["", f"runner-up {describe_settings(r.training)}: {r.step_time_s:.4g} s "
                      f"({100 * (r.step_time_s / best.step_time_s - 1):+.1f}%)", *_how_to_run(r)]
    return "\n".join(lines)
