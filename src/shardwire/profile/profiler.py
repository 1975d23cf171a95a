"""``Profiler``: where each step's time went, on every rank of a sharded job, cheap enough to leave on.

    profiler = Profiler(model, optimizer, tokens_per_step=batch * seq_len * world,
                        flops=flops_per_token(config.spec()))
    for batch in batches:
        with profiler.step():
            loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
            loss.backward()
            shardwire.clip_grad_norm_(model, 1.0)
            optimizer.step()
            optimizer.zero_grad()
    summary = profiler.save("runs/exp1")   # every rank calls it; rank 0 writes and returns the summary

Inside a step it only takes timestamps (CUDA events on the streams the engine uses, on GPUs), from
the engine's phase edges, the optimizer's step hooks and the collectives' own records: no device or
host synchronisation. ``save`` turns them into figures (see ``analysis``), gathers every rank's on
rank 0 and writes ``profile.json`` (figures per step and rank, their spread over ranks, throughput,
TFLOP/s and MFU) and ``trace.json`` (a Chrome/Perfetto trace).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from shardwire.engine.shard import engine_of
from shardwire.files import OutputRefused, write_atomically
from shardwire.profile import FORMAT_VERSION, PROFILE_FILE, TRACE_FILE, analysis
from shardwire.profile.flops import FlopsPerToken, datasheet_peak_tflops, probe_peak_tflops
from shardwire.profile.recorder import StepRecorder
from shardwire.profile.trace import chrome_trace


class Profiler:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        tokens_per_step: int,
        flops: FlopsPerToken | None = None,
        peak_tflops: float | None = None,
        probe_peak: bool = True,
        warmup_steps: int = 1,
        metadata: dict | None = None,
    ):
        """``tokens_per_step`` is the global batch in tokens. MFU is measured against
        ``peak_tflops`` per worker if given, else against the data-sheet peak of a recognised GPU in
        the model's compute dtype, else against a matrix-multiply probe in that dtype run now on every
        rank (``probe_peak``), else it is reported as unknown. The first ``warmup_steps`` steps (the
        first one records the unit order) are kept in the data but left out of the summary."""
        self._engine = engine_of(model)
        self._group = self._engine.group
        self._world = dist.get_world_size(self._group)
        self._tokens_per_step = tokens_per_step
        self._flops = flops
        self._warmup_steps = warmup_steps
        self._metadata = metadata or {}
        self._peak = self._peak_per_worker(peak_tflops, probe_peak)
        # a barrier: a shared origin for every rank's timeline
        self._engine.comm.all_gather_values([0], tag="profile origin")
        self._recorder = StepRecorder(self._engine.device)
        self._engine.add_listener(self._recorder.on_phase)
        self._hooks = []
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_pre_hook(
                lambda *_: self._recorder.on_phase("optimizer", None, "start")))
            self._hooks.append(optimizer.register_step_post_hook(
                lambda *_: self._recorder.on_phase("optimizer", None, "end")))
        self._next_step = 0

    def _peak_per_worker(self, given: float | None, probe: bool) -> dict:
        if given is not None:
            if given <= 0:
                raise ValueError(f"peak_tflops must be positive, got {given}")
            return {"tflops": given, "source": "given"}
        device = self._engine.device
        dtype = max(self._engine.flats, key=lambda flat: flat.packing.padded_numel).compute_dtype
        known = datasheet_peak_tflops(device, dtype)
        if known is not None:
            return {"tflops": known, "source": f"data sheet of {torch.cuda.get_device_name(device)}, {dtype}"}
        if not probe:
            return {"tflops": None, "source": "unknown: pass peak_tflops or allow the probe"}
        self._engine.comm.all_gather_values([0], tag="peak probe start")  # every rank probes at once
        mflops = round(probe_peak_tflops(device, dtype) * 1e6)
        everyone = [row[0] / 1e6 for row in self._engine.comm.all_gather_values([mflops], tag="peak probe")]
        return {"tflops": statistics.median(everyone), "source": f"{dtype} matrix-multiply probe (median over ranks)"}

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Profile the training step run inside the block (a step that raises is not kept)."""
        with self._engine.record() as records:
            self._recorder.begin_step(self._next_step)
            yield
            self._recorder.end_step(records)
        self._next_step += 1

    def close(self) -> None:
        """Stop listening to the engine and the optimizer."""
        self._engine.remove_listener(self._recorder.on_phase)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def save(self, run_dir: str) -> dict | None:
        """Write ``run_dir/profile.json`` and ``run_dir/trace.json`` on rank 0 (every rank must
        call this); returns the summary on rank 0 and None elsewhere. Where the files cannot be
        written (a full disk) every rank raises rank 0's ``OutputRefused``: none goes on to wait in
        its next collective for a rank 0 that stopped."""
        collected = self.collect()
        refused = None
        if collected is not None:
            profile, per_rank_timelines = collected
            try:
                write_atomically(os.path.join(run_dir, PROFILE_FILE), json.dumps(profile), durable=True)
                write_atomically(os.path.join(run_dir, TRACE_FILE), json.dumps(chrome_trace(per_rank_timelines)),
                                 durable=True)
            except OutputRefused as err:
                refused = err
        said = [refused]
        with self._on_model_device():
            dist.broadcast_object_list(said, src=dist.get_global_rank(self._group, 0), group=self._group)
        if said[0] is not None:
            raise said[0]
        return profile["summary"] if collected is not None else None

    def collect(self) -> tuple[dict, list] | None:
        """The profile (what ``save`` writes as profile.json) and every rank's step timelines, on
        rank 0, None elsewhere (every rank must call this)."""
        timelines = self._recorder.timelines()
        if not timelines:
            raise ValueError("no step was profiled: run training steps inside `with profiler.step():` first")
        figures = [analysis.breakdown(t) for t in timelines]
        gathered = [None] * self._world if dist.get_rank(self._group) == 0 else None
        with self._on_model_device():
            dist.gather_object((timelines, figures), gathered, dst=dist.get_global_rank(self._group, 0),
                               group=self._group)
        if gathered is None:
            return None
        per_rank_timelines = [t for t, _ in gathered]
        per_rank_figures = [f for _, f in gathered]
        steps = [{"step": timelines[i].step, **analysis.across_ranks([ranks[i] for ranks in per_rank_figures])}
                 for i in range(len(timelines))]
        first = analysis.summarised(steps, self._warmup_steps)
        summary = analysis.over_steps(steps[first:])
        summary.update(self.throughput(summary["figures"]["step_s"]["max"]))
        typical = first + analysis.typical(steps[first:])  # for the report's one-step timeline
        profile = {
            "version": FORMAT_VERSION,
            "world_size": self._world,
            "backend": str(dist.get_backend(self._group)),
            "device": self._engine.device.type,
            "tokens_per_step": self._tokens_per_step,
            "warmup_steps": self._warmup_steps,
            "flops_per_token": dataclasses.asdict(self._flops) if self._flops else None,
            "peak_tflops_per_worker": self._peak,
            "metadata": self._metadata,
            "summary": summary,
            "steps": steps,
            "timeline": {"step": steps[typical]["step"],
                         "ranks": [dataclasses.asdict(ranks[typical]) for ranks in per_rank_timelines]},
        }
        return profile, per_rank_timelines

    def _on_model_device(self):
        """Where the objects of a collective go: NCCL stages them on the current device, which must be
        the model's."""
        device = self._engine.device
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    def throughput(self, step_s: float) -> dict:
        """Tokens/s, TFLOP/s per worker and MFU/HFU for a step time (the slowest rank's)."""
        result = {"step_time_s": step_s, "tokens_per_s": self._tokens_per_step / step_s}
        if self._flops is None:
            return result
        per_worker = self._tokens_per_step / self._world / step_s
        result["model_tflops_per_worker"] = self._flops.model * per_worker / 1e12
        result["hardware_tflops_per_worker"] = self._flops.hardware * per_worker / 1e12
        peak = self._peak["tflops"]
        if peak:
            result["mfu"] = result["model_tflops_per_worker"] / peak
            result["hfu"] = result["hardware_tflops_per_worker"] / peak
        return result
