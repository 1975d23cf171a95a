"""What ``shardwire simulate`` and ``shardwire plan`` print and save: a prediction explained, a sweep as
a table, a plan and why it wins, JSON, a plot.

JSON of one prediction (times in seconds, memory in GiB per GPU)::

    {"model": {...}, "cluster": {...}, "training": {...},          # the specs as simulated
     "step_time_s", "compute_time_s", "compute": {"forward", "backward", "optimizer"},  # at full rate
     "compute_slowed_s", "compute_slowdown",  # longer for overlapped collectives: s, over compute
     "comm": {"all_gather_s", "reduce_scatter_s", "all_reduce_s"},  # time each lane was busy
     "exposed_comm_s", "exposed_comm": {REASON: s},                 # compute waiting on them
     "bytes_per_step": {"inter_node", "intra_node"},  # through one node's NICs, one GPU's NVLink
     "samples_per_s", "tflops_per_gpu", "hardware_tflops_per_gpu", "mfu",
     "memory_gb_per_gpu", "memory": {PART: GiB, "usable_gb": GiB}, "fits", "shortfall_gb",
     "units": [{"kind", "count", "forward_s", "gather_s", "backward_s", "backward_comm_s"}],
     "verdict": "...", "notes": [...]}

A sweep: ``{"sweep": {"key", "values"}, "points": [PREDICTION + {"scaling_efficiency"}],
"scaling_reference_nodes": 1, "scaling_reference_fits": true}`` (efficiency and its reference only
for sweeps over ``nodes``, else null).

With a failure rate (``--node-mtbf``), a prediction and a plan's best and DiLoCo configurations add
``"failures"`` (``shardwire.sim.failures``; an effective step that is infinite, no step kept, is
null)::

    {"node_mtbf_h", "job_mtbf_h",
     "restart": {"step_time_s", "goodput", "save_every", "young", "checkpoint_bytes",  # per node
                 "save_s", "restart_s", "effective_step_time_s"},
     "live_recovery": {"step_time_s", "goodput", "recovery_bytes", "lost_group_s", "other_group_s",
                       "effective_step_time_s"} or null, "no_live_recovery": "why" or null,
     "assumptions": {"relaunch_s", "storage_GBps", "heartbeat_s"}}
"""

from __future__ import annotations

import dataclasses
import math

from shardwire.extras import require
from shardwire.files import figure_png, write_atomically
from shardwire.sim.explain import format_ms, slowdown_text, unit_budgets, verdict
from shardwire.sim.failures import (HEARTBEAT_S, RELAUNCH_S, STORAGE_GBps, FailureCosts, FailureRate, Restart,
                                    Survival, job_mtbf_s, price)
from shardwire.sim.memory import GIB
from shardwire.sim.planner import Plan, describe_settings, launch, shard_call
from shardwire.sim.predict import Prediction, Sweep
from shardwire.sim.specs import as_dict, spelled
from shardwire.sim.step import layout_plan


def fit_problem(p: Prediction) -> str:
    making = " to make the model (its shards, root and largest unit in fp32)" if p.memory.construction > \
        p.memory.total else ""
    return (f"does not fit: needs {p.memory.peak / GIB:.1f} GiB per GPU{making}, {p.memory.shortfall / GIB:.1f} "
            f"GiB more than the {p.memory.usable / GIB:.1f} GiB usable of {p.cluster.gpu_memory_gb:g} GiB")


def notes(p: Prediction) -> list[str]:
    """What the prediction leaves out for want of a cluster figure, and what it cannot say: how a
    setting that changes the optimisation trains."""
    missing = []
    if (diloco := p.training.diloco_settings) is not None:
        missing.append(f"DiLoCo (sync_every={diloco.sync_every}) changes the optimisation, not only the step: "
                       f"groups train apart between syncs (BENCHMARKS.md measures the validation loss against "
                       f"synchronous training at equal tokens); shardwire plan --exact leaves it out")
    if p.cluster.memory_bandwidth_GBps is None:
        optimizer = "" if p.cluster.optimizer_GBps is not None else ", the optimizer step"
        missing.append(f"memory-bound work (norms, activations, casts{optimizer}) not priced: the cluster gives no "
                       f"memory_bandwidth_GBps")
    if p.training.wire_format.quantized and p.cluster.nodes > 1 and p.cluster.quantize_gelems is None:
        missing.append("quantization kernels not priced: the cluster gives no quantize_gelems")
    return missing


def prediction_json(p: Prediction, rate: FailureRate | None = None) -> dict:
    """``p`` as plain data, with what failures at ``rate`` cost it where one is given."""
    comm = p.comm_s
    return {
        "model": as_dict(p.model), "cluster": as_dict(p.cluster), "training": as_dict(p.training),
        "step_time_s": p.step_time_s,
        "compute_time_s": p.compute_time_s,
        "compute": dict(p.timeline.compute),
        "compute_slowed_s": p.compute_slowed_s,
        "compute_slowdown": p.compute_slowdown,
        "comm": {f"{op}_s": seconds for op, seconds in comm.items()},
        "exposed_comm_s": p.exposed_comm_s,
        "exposed_comm": p.exposed_by_reason,
        "bytes_per_step": {"inter_node": p.timeline.link_bytes["inter"], "intra_node": p.timeline.link_bytes["intra"]},
        "samples_per_s": p.samples_per_step / p.step_time_s,
        "tflops_per_gpu": p.tflops_per_gpu,
        "hardware_tflops_per_gpu": p.hardware_tflops_per_gpu,
        "mfu": p.mfu,
        "memory_gb_per_gpu": p.memory.total / GIB,
        "memory": {**{k: v / GIB for k, v in p.memory.parts.items()}, "usable_gb": p.memory.usable / GIB},
        "construction_gb_per_gpu": p.memory.construction / GIB,
        "fits": p.memory.fits,
        "shortfall_gb": p.memory.shortfall / GIB,
        "units": [dataclasses.asdict(b) for b in unit_budgets(p)],
        "verdict": verdict(p),
        "notes": notes(p),
        **_failures_entry(p, rate),
    }


def sweep_json(s: Sweep) -> dict:
    points = [prediction_json(p) for p in s.points]
    if s.scaling_efficiency is not None:
        for point, efficiency in zip(points, s.scaling_efficiency, strict=True):
            point["scaling_efficiency"] = efficiency
    return {
        "sweep": {"key": s.key, "values": s.values},
        "points": points,
        "scaling_reference_nodes": None if s.reference is None else s.reference.cluster.nodes,
        "scaling_reference_fits": None if s.reference is None else s.reference.memory.fits,
    }


def describe_setup(p: Prediction, swept: str | None = None) -> list[str]:
    """The model, cluster and training simulated, one line each (``swept``: the key a sweep varies,
    named as swept instead of given the first point's value)."""
    m, c, t = p.model, p.cluster, p.training

    def setting(key: str, text: str) -> str:
        return f"swept {key}" if key == swept else text

    limiter = "sliding window" if t.limiter == "sliding" else "block-and-flush limiter"
    groups, plan = "", layout_plan(c, t)
    # groups left to their default are a node's GPUs: a sweep of those sweeps the groups
    groups_swept = swept == "shard_group_size" or (swept == "gpus_per_node" and t.shard_group_size is None)
    if plan.grouped:
        groups = " in swept groups" if groups_swept else f" in groups of {plan.group}"
    if t.layout == "zero1":  # nothing to gather or release: the groups split the optimizer state only
        bucket = "" if t.reduce_bucket_elements is None else f" in buckets of {t.reduce_bucket_elements:,}"
        split = f"optimizer state split{groups}" if groups else "optimizer state whole (one GPU)"
        layout = f"layout zero1: {split}, gradients all-reduced over every GPU{bucket}"
    else:
        layout = f"layout {t.layout}{groups}, {'reshard' if t.reshards else 'keep'} after forward"
    checkpointing = f"activation checkpointing {'on' if t.activation_checkpointing else 'off'}"
    reducing = " (each reduced)" if t.reduce_each_micro_batch else ""
    gathers = ""
    if t.gathers_per_unit != 1 or swept == "gathers_per_unit":
        gathers = ", " + setting("gathers_per_unit", f"{t.gathers_per_unit} gathers per unit")
    return [
        f"model     {m.name}: {p.arch.params / 1e9:.3g}B parameters, {len(p.arch.units)} block units + root",
        f"cluster   {c.name}: {setting('nodes', f'{c.nodes} node' + 's' * (c.nodes != 1))} x "
        f"{setting('gpus_per_node', f'{c.gpus_per_node} GPU' + 's' * (c.gpus_per_node != 1))}, "
        f"{setting('peak_tflops', f'{c.peak_tflops:g} TFLOP/s')} and "
        f"{setting('gpu_memory_gb', f'{c.gpu_memory_gb:g} GiB')} each; "
        f"intra-node {c.intra_node.busbw_GBps:g} GB/s, "
        f"{c.intra_node.latency_us:g} us; inter-node {c.inter_node.busbw_GBps:g} GB/s, "
        f"{c.inter_node.latency_us:g} us per step; {c.algorithm} collectives"
        + ("" if c.collectives == "nccl" else f" ({c.collectives})"),
        f"training  {t.name}: {setting('micro_batch', f'micro-batch {t.micro_batch}')} x "
        f"{setting('grad_accum', str(t.grad_accum))} per GPU{reducing}, {setting('layout', layout)}, "
        + ("" if t.layout == "zero1" else  # nothing gathered: no gather schedule
           f"{setting('prefetch', f'prefetch {t.prefetch}')} ({setting('limiter', limiter)}{gathers}), ") +
        f"{setting('precision', t.precision)}{' (fp8 gathers)' if t.fp8_all_gather else ''} "
        f"(reduce {setting('reduce_precision', t.reduce_precision)}), wire {t.wire}"
        f"{'' if t.diloco == 'none' else f', diloco {t.diloco}'}, "
        f"{setting('activation_checkpointing', checkpointing)}{', compiled' if t.compile else ''}",
    ]


def prediction_text(p: Prediction, rate: FailureRate | None = None) -> str:
    """``p`` explained, with what failures at ``rate`` cost it where one is given."""
    compute = p.timeline.compute
    comm = p.comm_s
    exposed = ", ".join(f"{reason} {s:.3g}" for reason, s in p.exposed_by_reason.items()) or "none"
    parts = sorted(p.memory.parts.items(), key=lambda item: -item[1])
    memory = ", ".join(f"{name.replace('_', ' ')} {b / GIB:.2f}" for name, b in parts if b > 0)
    recomputing = " (with recomputation)" if p.training.activation_checkpointing else ""
    lines = describe_setup(p) + [
        "",
        f"step time      {p.step_time_s:10.4g} s",
        f"  compute      {p.compute_time_s:10.4g} s   forward {compute['forward']:.4g}, backward "
        f"{compute['backward']:.4g}{recomputing}, optimizer {compute['optimizer']:.3g}",
        f"  slowed       {p.compute_slowed_s:10.4g} s   {slowdown_text(p)}",
        f"  exposed comm {p.exposed_comm_s:10.4g} s   {exposed}",
        f"comm busy      all-gather {comm['all_gather']:.4g} s, reduce-scatter {comm['reduce_scatter']:.4g} s, "
        f"all-reduce {comm['all_reduce']:.4g} s",
        f"bytes moved    {p.timeline.link_bytes['inter'] / 1e9:.4g} GB per step through each node's NICs, "
        f"{p.timeline.link_bytes['intra'] / 1e9:.4g} GB through each GPU's intra-node links",
        f"throughput     {p.samples_per_step / p.step_time_s:.4g} samples/s; {p.tflops_per_gpu:.4g} TFLOP/s per GPU"
        + (f" (with recomputation {p.hardware_tflops_per_gpu:.4g})" if recomputing else "")
        + f", MFU {100 * p.mfu:.1f}%",
        f"memory         {p.memory.total / GIB:.2f} GiB per GPU of {p.memory.usable / GIB:.1f} usable: "
        f"{'fits' if p.memory.fits else 'DOES NOT FIT'} ({memory})",
        "",
        "per unit       forward: compute  all-gather   backward: compute  all-gather+reduce",
    ]
    for b in unit_budgets(p):
        lines.append(
            f"  {b.kind:<8} x{b.count:<3} {format_ms(b.forward_s):>17} {format_ms(b.gather_s):>11} "
            f"{format_ms(b.backward_s):>19} {format_ms(b.backward_comm_s):>18}"
        )
    lines += ["", verdict(p), *(f"note: {n}" for n in notes(p))]
    if rate is not None:
        lines += failures_text([("", price(p, rate))])
    return "\n".join(lines)


def sweep_text(s: Sweep) -> str:
    efficiency = s.scaling_efficiency
    header = (f"{s.key:>14} {'GPUs':>5} {'step s':>9} {'compute s':>9} {'slowed s':>9} {'exposed s':>9} "
              f"{'gather s':>9} "
              f"{'reduce s':>9} {'TFLOP/s':>8} {'MFU':>6} {'GiB/GPU':>8} {'fits':>4}")
    if efficiency is not None:
        header += f" {'scaling':>8}"
    values = ", ".join(spelled(v) for v in s.values)
    lines = [*describe_setup(s.points[0], swept=s.key), f"sweep     {s.key} = {values} (rows below)", "", header]
    for i, p in enumerate(s.points):
        comm = p.comm_s
        row = (f"{spelled(s.values[i]):>14} {p.cluster.world:>5} {p.step_time_s:>9.4g} {p.compute_time_s:>9.4g} "
               f"{p.compute_slowed_s:>9.3g} {p.exposed_comm_s:>9.3g} {comm['all_gather']:>9.4g} "
               f"{comm['reduce_scatter'] + comm['all_reduce']:>9.4g} {p.tflops_per_gpu:>8.4g} {100 * p.mfu:>5.1f}% "
               f"{p.memory.total / GIB:>8.2f} {'yes' if p.memory.fits else 'NO':>4}")
        if efficiency is not None:
            row += f" {100 * efficiency[i]:>7.1f}%"
        lines.append(row)
    if efficiency is not None and all(p is not s.reference for p in s.points):
        lines.append(f"(scaling against 1 node: {s.reference.step_time_s:.4g} s per step, simulated for reference)")
    if efficiency is not None and not s.reference.memory.fits:
        lines.append("(the 1-node reference does not fit in memory: its simulated speed is still the reference)")
    # what bounds the step where it scales least (the last value given, where scaling is not measured)
    least = min(range(len(s.points)), key=efficiency.__getitem__) if efficiency is not None else len(s.points) - 1
    lines += ["", f"at {s.key}={spelled(s.values[least])}: {verdict(s.points[least])}"]
    lines += [f"note: {n}" for n in notes(s.points[0])]
    return "\n".join(lines)


def plot_sweep(s: Sweep, path: str) -> None:
    """Step time split into compute and exposed communication per point, and scaling efficiency
    (or MFU when the sweep is not over nodes), as a PNG."""
    require("matplotlib", "--plot").use("Agg")
    import matplotlib.pyplot as plt

    labels = [spelled(v) for v in s.values]
    compute = [p.compute_time_s for p in s.points]
    exposed = [p.exposed_comm_s for p in s.points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.bar(labels, compute, label="compute")
    left.bar(labels, exposed, bottom=compute, label="exposed communication")
    left.set_xlabel(s.key)
    left.set_ylabel("seconds per step")
    left.legend()
    if s.scaling_efficiency is not None:
        right.plot(labels, [100 * e for e in s.scaling_efficiency], marker="o")
        right.set_ylabel("scaling efficiency (%)")
    else:
        right.plot(labels, [100 * p.mfu for p in s.points], marker="o")
        right.set_ylabel("MFU (%)")
    right.set_ylim(0, 105)
    right.set_xlabel(s.key)
    right.grid(alpha=0.3)
    p = s.points[0]
    fig.suptitle(f"{p.model.name} on {p.cluster.name}, {p.training.name} training")
    fig.tight_layout()
    write_atomically(path, figure_png(fig, "sweep-plot"))


def plan_json(result: Plan, global_batch: int, model_argument: str, rate: FailureRate | None = None) -> dict:
    """The plan as plain data, with what failures at ``rate`` cost the best and the DiLoCo
    configurations where one is given."""
    best = result.best.step_time_s
    return {
        "global_batch": global_batch,
        "notes": result.notes,
        "best": {**_with_run(result.best, model_argument), **_failures_entry(result.best, rate)},
        "runner_up": None if result.runner_up is None else _with_run(result.runner_up, model_argument),
        "alternatives": [
            {"change": a.change, "step_time_s": a.step_time_s, "fits": a.memory.fits,
             "memory_gb_per_gpu": a.memory.total / GIB,
             "slower_by": None if a.step_time_s is None else a.step_time_s / best - 1}
            for a in result.alternatives
        ],
        "candidates": result.candidates,
        "fitting": result.fitting,
        "diloco": None if result.diloco is None else {**_with_run(result.diloco, model_argument),
                                                      **_failures_entry(result.diloco, rate)},
    }


def _with_run(p: Prediction, model_argument: str) -> dict:
    return {**prediction_json(p), "run": dataclasses.asdict(launch(p.training, p.cluster, p.model, model_argument))}


def _how_to_run(p: Prediction, model_argument: str) -> list[str]:
    how = launch(p.training, p.cluster, p.model, model_argument)
    run = f"run:   {how.command}" if how.command else f"not run by shardwire train: {how.unrunnable}"
    lines = [f"          {run}", *([f"          add:   {how.needs}"] if how.command and how.needs else []),
             f"          or:    {shard_call(p.training, p.cluster)}"]
    return lines + ([f"          {how.lossy}"] if how.lossy else [])


def plan_text(result: Plan, global_batch: int, model_argument: str, rate: FailureRate | None = None) -> str:
    """The plan and why it wins, with what failures at ``rate`` cost the best and the DiLoCo
    configurations where one is given."""
    best = result.best
    t = best.training
    setup = describe_setup(best)
    lines = [
        *setup[:2],
        f"search    global batch {global_batch} = {t.micro_batch * t.grad_accum} per GPU; {result.candidates} "
        f"configurations ({', '.join(result.searched)}), {result.fitting} fit in memory",
        *(f"          {n}" for n in result.notes),
        "",
        f"best      {describe_settings(t)}",
        f"          step {best.step_time_s:.4g} s, {best.samples_per_step / best.step_time_s:.4g} samples/s, "
        f"{slowdown_text(best)}, {100 * best.exposed_comm_s / best.step_time_s:.1f}% exposed communication, "
        f"MFU {100 * best.mfu:.1f}%, {best.memory.total / GIB:.1f} of {best.memory.usable / GIB:.1f} GiB usable",
        f"          {verdict(best)}",
        *(f"          note: {n}" for n in notes(best)),
        *_how_to_run(best, model_argument),
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
                      f"({100 * (r.step_time_s / best.step_time_s - 1):+.1f}%)", *_how_to_run(r, model_argument)]
    if result.diloco is not None:
        s = result.diloco
        lines += ["", f"or diloco {describe_settings(s.training)}: {s.step_time_s:.4g} s "
                      f"({100 * (s.step_time_s / best.step_time_s - 1):+.1f}%), "
                      f"{s.timeline.link_bytes['inter'] / 1e9:.4g} GB per step through each node's NICs",
                  *(f"          note: {n}" for n in notes(s)), *_how_to_run(s, model_argument)]
    if rate is not None:
        priced = [("best", best), *([("diloco", result.diloco)] if result.diloco is not None else [])]
        lines += failures_text([(label, price(p, rate)) for label, p in priced])
    return "\n".join(lines)


def failures_text(priced: list[tuple[str, FailureCosts]]) -> list[str]:
    """What failures cost each configuration, a label (``best``, ``diloco``, or none) before each,
    then what the prices assume."""
    first = priced[0][1]
    lines = ["", f"failures  a node lost every {first.rate.node_mtbf_h:,.4g} h on average: the job's {first.nodes} "
                 f"nodes, one every {first.job_mtbf_h:,.4g} h"]
    for label, costs in priced:
        restart = _restart_text(costs.restart, job_mtbf_s(costs.rate.node_mtbf_h, costs.nodes))
        live = _live_recovery_text(costs)
        lines += [f"  {label:<8}{restart}", f"  {'':<8}{live}"]
    lines.append(f"  assumed   a restart relaunches in {RELAUNCH_S:g} s, a node reads and writes checkpoints at "
                 f"{STORAGE_GBps:g} GB/s; torchft's heartbeat timeout is {HEARTBEAT_S:g} s")
    return lines


def _restart_text(restart: Restart, mtbf_s: float) -> str:
    chosen = "Young's interval" if restart.young else "as given"
    kept = _kept(restart)
    if restart.goodput == 0 and not restart.young and restart.restart_s + restart.save_s / 2 < mtbf_s:
        # the interval given is the cause: a shorter one would keep steps (the goodput's last factor)
        kept = ("goodput 0: each failure costs a restart and half a checkpoint interval of steps done again, more "
                "than the time between failures; no step is kept (a smaller --save-every keeps some)")
    return (f"restart from checkpoint  {kept}; a checkpoint every {restart.save_every:,} steps "
            f"({restart.interval_s / 3600:.3g} h, {chosen}), "
            f"{restart.checkpoint_bytes / 1e9:.4g} GB per node: {restart.save_s:.3g} s to save, "
            f"{restart.restart_s:.3g} s to restart")


def _live_recovery_text(costs: FailureCosts) -> str:
    live = costs.live_recovery
    if live is None:
        return f"live recovery            not possible: {costs.no_live_recovery}"
    return (f"live recovery            {_kept(live)}; a failure costs the lost group {live.lost_group_s:.3g} s "
            f"({live.recovery_bytes / 1e9:.4g} GB sent to it), each other {live.other_group_s:.3g} s")


def _kept(survival: Survival) -> str:
    if survival.goodput == 0:
        return "goodput 0: failures come faster than the job recovers, no step is kept"
    return f"goodput {100 * survival.goodput:.3f}%, effective step {survival.effective_step_time_s:.4g} s"


def failures_json(costs: FailureCosts) -> dict:
    """``costs`` as plain data (the module's docstring)."""
    return {
        "node_mtbf_h": costs.rate.node_mtbf_h,
        "job_mtbf_h": costs.job_mtbf_h,
        "restart": _survival_json(costs.restart),
        "live_recovery": None if costs.live_recovery is None else _survival_json(costs.live_recovery),
        "no_live_recovery": costs.no_live_recovery,
        "assumptions": {"relaunch_s": RELAUNCH_S, "storage_GBps": STORAGE_GBps, "heartbeat_s": HEARTBEAT_S},
    }


def _survival_json(survival: Survival) -> dict:
    effective = survival.effective_step_time_s
    return {**dataclasses.asdict(survival), "effective_step_time_s": None if math.isinf(effective) else effective}


def _failures_entry(p: Prediction, rate: FailureRate | None) -> dict:
    """``{"failures": ...}`` for ``p`` at ``rate``; nothing without one."""
    return {} if rate is None else {"failures": failures_json(price(p, rate))}
