"""Fault-tolerant groups that average their gradients at every step: torchft's fault-tolerant HSDP.

Under ``layout="hybrid"`` with ``fault_tolerance`` and no DiLoCo, each job is one group that shards
the model among its ranks, and the groups reduce each gradient shard between them at every step,
as the groups of one hybrid job do, but over the quorum of the groups alive at that step
(``shardwire.comm.quorum``) rather than a fixed process group. ``StepQuorum`` says when: a quorum
at the first training forward of each step (before any collective of it), the all-reduce of each
gradient shard over it as backward reduces the shard (``Layout.gradient_replicas``), and the
quorum's commit vote at the end of the step's backward, before the optimizer steps.

A step the vote drops (a group failed in it) leaves no gradients: they are set to None, which
torch's optimizers skip, and the step is not counted, so ``shardwire train`` runs it again (its data
dealt again, ``shardwire.training.deal``); no group's parameters move but those of a group that is
behind. That group (restarted, or back from a cut) takes part in its first step's all-reduces with
nothing of its own and, at the vote, receives from a live peer at its position the parameters of
its shards, what
``recover_with`` names (the optimizer's state, the learning-rate schedule) and the count of steps:
its optimizer then steps with the others' average, and it leaves the step holding the same model
as they do. Steps dropped ``MAX_DROPPED`` times in a row stop the run: the groups' all-reduce
fails whatever the quorum (say, groups of different sizes), which no retry mends.

Per step, the link between the groups carries every gradient shard, where DiLoCo's syncs carry a
change every H steps: this is for groups joined by links fast enough for hybrid's per-step
reduction, which a lost group must not stop.
"""

from __future__ import annotations

import torch

from shardwire.comm.agreement import agreement_values, refuse_another_model, shapes_fingerprint, values_fingerprint
from shardwire.comm.communicator import Communicator
from shardwire.comm.quorum import MAX_DROPPED, Quorum, check_received
from shardwire.options import SettingError


class StepQuorum:
    """The fault-tolerant groups' meeting at every step (see the module's docstring)."""

    def __init__(self, flats: list, quorum: Quorum, group: Communicator):
        """``group``: this group's ranks (the job), which refuse a model the others cannot average with
        together."""
        self.quorum = quorum
        self.steps = 0  # steps committed (``resume``: those of a checkpoint)
        self.committed = True  # whether the last step's vote kept it
        self._flats = flats
        self._open = False  # a step's quorum is formed, its vote not yet taken
        self._dropped_in_a_row = 0
        self._skipped = 0  # steps this group's recoveries moved it forward since the last ``metrics``
        self._group = group
        self._shapes = agreement_values(shapes_fingerprint(flats, group.world))
        quorum.meets("at every step")
        quorum.register("shardwire", self._recovery_state, self._load_recovery_state)
        quorum.attend(self._compare_models)

    def resume(self, steps: int) -> None:
        """Count on from a checkpoint of ``steps`` steps, as torchft's manager does too: the
        lighthouse takes a group that counts fewer steps than the others for one that is behind, so
        a group resumed from an older checkpoint receives their state instead of averaging with it."""
        self.steps = steps
        self.quorum.load_state([steps, 0])

    def next_meeting(self) -> int:
        """The steps done at the groups' next meeting after this one: at the next step."""
        return self.steps + 1

    def voted_after(self) -> int:
        """The steps done when the vote on the meeting forming now is taken: after its step."""
        return self.steps + 1

    def before_forward(self) -> None:
        """A training forward: the first of a step (of its micro-batches) forms the step's quorum."""
        if not self._open:
            self.quorum.start()
            self._open = True

    def _compare_models(self) -> None:
        """At each quorum of the job's first step, compare this group's model with the others': a
        model of other shapes cannot be averaged, and averaging gradients keeps the groups' models the
        same only where they start so (a group that is behind is not compared: it receives the
        others'). Only there, so that no step after pays for it: the quorum's step is the same in
        every group of it, so all of them compare, or none. By 32-bit fingerprints
        (``agreement_values``)."""
        if self.quorum.step != 0:
            return
        compare = not self.quorum.recovered
        values = agreement_values(values_fingerprint([flat.shard for flat in self._flats]) if compare else None)
        agreed = self.quorum.agree([*self._shapes, *values])
        refuse_another_model(agreed, self._shapes, values if compare else None, self.quorum.failed, self._group,
                             "averaging their gradients")

    @property
    def accumulated(self) -> str:
        """What a step's micro-batches accumulated outside ``no_sync`` do here
        (``shardwire.engine.accumulation``)."""
        return ("between fault-tolerant groups meeting at every step each is a step they vote on, and a vote "
                "dropped drops the gradients of the micro-batches before it too")

    def step_done(self) -> None:
        """The end of a step's backward, its gradients reduced: the vote. A group behind loads the
        others' state in it; a dropped step's gradients are set to None."""
        self._open = False
        self.committed = self.quorum.commit()
        if self.committed:
            self.steps += 1
            self._dropped_in_a_row = 0
            return
        for flat in self._flats:
            for param in flat.params:
                param.grad = None
        self._dropped_in_a_row += 1
        if self._dropped_in_a_row == MAX_DROPPED:
            raise SettingError(f"the fault-tolerant groups dropped {MAX_DROPPED} steps in a row (step "
                               f"{self.steps + 1}): their all-reduce fails whichever groups meet; give every group as "
                               f"many ranks and the same model and settings, and see the first group's log for the "
                               f"failure")

    def _recovery_state(self) -> dict:
        """What a group that is behind receives from this one (host tensors): the steps committed
        and this rank's shards, as they are before the step's optimizer step."""
        return {"steps": self.steps, "shards": [flat.shard.detach().to("cpu", copy=True) for flat in self._flats]}

    def _load_recovery_state(self, state: dict) -> None:
        check_received([flat.shard for flat in self._flats], state["shards"])
        for flat, shard in zip(self._flats, state["shards"]):
            with torch.no_grad():
                flat.shard.copy_(shard)
        self._skipped += state["steps"] - self.steps
        self.steps = state["steps"]

    def metrics(self) -> dict[str, float]:
        """Since the last call: ``Quorum.take_metrics`` and the steps recoveries moved this group
        forward; the same keys as ``OuterLoop.metrics`` gives between fault-tolerant groups."""
        found = {**self.quorum.take_metrics(), "skipped_steps": self._skipped}
        self._skipped = 0
        return found
