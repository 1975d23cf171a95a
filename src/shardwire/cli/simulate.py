"""``shardwire simulate``: predict a sharded job's step on a cluster, explain it, sweep a setting.

    shardwire simulate --model t5-11b --cluster ibm-a100-ethernet --training ibm-t5-11b-batch50-sliding \
        --sweep nodes=1,2,4,8,16,32,64 --plot t5-11b.png
    shardwire simulate --model gpt-1.3b --cluster a100-100gbe --nodes 8 --node-mtbf 6000   # and its failures

Exit status: 0, or 1 when a configuration does not fit in GPU memory (the prediction is still
printed, with how much is missing), or 2 for input that cannot be simulated.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings

from shardwire.cli import refused
from shardwire.extras import require
from shardwire.mappings import refusal, shown
from shardwire.options import OptionError, check_output_file, text
from shardwire.renamed import warn_renamed
from shardwire.sim import inputs, report
from shardwire.sim.calibrate import FITTED_KEYS
from shardwire.sim.predict import predict, sweep
from shardwire.sim.specs import RENAMED_KEYS, SpecError, TrainingSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    inputs.add_arguments(parser)
    parser.add_argument("--sweep", metavar="KEY=V1,V2,...",
                        help="predict each value of one cluster or training setting, e.g. nodes=1,2,4,8 "
                             "(with scaling efficiency against 1 node for nodes)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the report")
    parser.add_argument("--plot", metavar="PNG", type=text, help="with --sweep: plot step time and scaling to this file")


def check_options(args: argparse.Namespace) -> None:
    """What ``--print-config`` checks before it prints: the options together and the specs they
    give, refused in the words and with the status of a run."""
    with refused(SpecError):
        _checked(args)


def _checked(args: argparse.Namespace):
    """The specs, failure rate and sweep (KEY, values) the arguments give, once the options are known to go
    together."""
    if args.plot and not args.sweep:
        raise SpecError("--plot draws a sweep: add --sweep KEY=V1,V2,...")
    if args.plot:
        require("matplotlib", "--plot")
        try:
            check_output_file(args.plot, "--plot", "sweep-plot")
        except OptionError as err:
            raise SpecError(str(err)) from None
    swept = parse_sweep(args.sweep) if args.sweep else None
    if swept and args.nodes is not None and swept[0] == "nodes":
        warnings.warn(f"--nodes {args.nodes} is replaced by each node count of --sweep nodes=...: leave out --nodes",
                      stacklevel=1)
    if swept and args.calibrate and (key := swept[0]) in FITTED_KEYS:
        raise SpecError(f"--calibrate fits the compute model to the profile, and --sweep {key}=... would replace part "
                        f"of that fit, predicting a GPU that is neither: sweep {key} without --calibrate, or sweep "
                        f"another setting")
    model, cluster, training = inputs.load_arguments(args)
    rate = inputs.load_failure_rate(args)
    if swept and rate is not None:
        raise SpecError("--node-mtbf prices the failures of one configuration: leave out --sweep")
    return model, cluster, training, rate, swept


def run(args: argparse.Namespace, argv: list[str], checked) -> int:
    try:
        model, cluster, training, rate, swept = _checked(args)
        checked()
        if swept:
            key, values = swept
            result = sweep(model, cluster, training, key, values)
            print(json.dumps(report.sweep_json(result), indent=1) if args.json else report.sweep_text(result))
            if args.plot:
                try:
                    report.plot_sweep(result, args.plot)
                except OSError as err:  # the one output policy's refusal says what to do
                    raise SpecError(f"--plot: {err}") from None
            labelled = [(f"at {key}={v}: ", p) for v, p in zip(values, result.points, strict=True)]
        else:
            prediction = predict(model, cluster, training)
            print(json.dumps(report.prediction_json(prediction, rate), indent=1) if args.json
                  else report.prediction_text(prediction, rate))
            labelled = [("", prediction)]
    except SpecError as err:
        print(refusal(f"error: {err}"), file=sys.stderr)
        return 2
    missing = [(label, p) for label, p in labelled if not p.memory.fits]
    for label, p in missing:
        print(refusal(f"error: {label}{report.fit_problem(p)}"), file=sys.stderr)
    return 1 if missing else 0


def parse_sweep(text: str) -> tuple[str, list]:
    """``KEY=V1,V2,...`` -> (KEY, values), each value a JSON scalar where it is one (4, 0.5, true),
    else the word itself (block). An empty value (``1,,2``: an unset variable) would be a row the
    user did not mean, a number past a float's range one of infinity."""
    key, sep, listed = text.partition("=")
    words = [v.strip() for v in listed.split(",")]
    if not sep or not key.strip() or not any(words):
        raise SpecError(f"--sweep takes KEY=V1,V2,... (e.g. nodes=1,2,4,8), got {shown(text)}")
    if "" in words:
        raise SpecError(f"--sweep {shown(text)} has an empty value: give each value once, separated by commas")
    values = [_scalar(word) for word in words]
    for word, value in zip(words, values):
        if isinstance(value, float) and not math.isfinite(value):
            raise SpecError(f"--sweep value {shown(word)} is not a finite number")
        if isinstance(value, str) and word.lstrip("+-").isdigit():  # past Python's bound on a whole number's digits
            raise SpecError(f"--sweep value {shown(word)} has {len(word.lstrip('+-')):,} digits, more than any "
                            f"setting takes")
    key = key.strip()
    if (new := RENAMED_KEYS[TrainingSpec].get(key)) is not None:  # swept under its old name as it is given
        warn_renamed(f"--sweep: {key} is renamed {new}")
        key = new
    return key, values


def _scalar(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text
