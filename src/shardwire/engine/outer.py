"""The outer optimisation of sync every H steps (``shardwire.engine.diloco``): its state and its schedule.

Each trainable flat buffer keeps an ``OuterState`` beside its shard: this rank's slice of the anchor
(the parameters every group last agreed on, in fp32) and of the outer momentum, both shaped like
the shard, so that a checkpoint saves and re-slices them as it does the shard itself. A sync of the
buffer is one all-reduce, between the ranks at this rank's position in every group (the layout's
``replicate`` communicator), of the change since the anchor, quantized as the sync's wire says; it
runs on that communicator's own lane or stream while training goes on, and is applied later by
the outer step.

``OuterLoop`` decides when. The engine tells it when a step's gradients have been reduced (the end
of a backward outside ``no_sync``: an inner step), and calls it when the next forward that records
gradients starts, before its first gather (an evaluation under ``torch.no_grad`` between steps
leaves the syncs to the training forward after it, so every sync is issued inside a step): by then
the inner optimizer has stepped, so the shard holds the step's parameters, and nothing of the
forward has read them yet. There it applies the sync whose time has
come and issues the one that is due, so no optimizer hook and no host synchronization is needed
(on CUDA the compute stream only waits for the all-reduce's event when it applies it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.profiler import record_function

from shardwire.comm.agreement import (agreement_values, fingerprint, number, refuse_another_model,
                                     shapes_fingerprint, values_fingerprint, word_sums)
from shardwire.comm.communicator import Communicator, Pending
from shardwire.comm.quorum import MAX_DROPPED, Quorum, check_received
from shardwire.engine.diloco import DiLoCo
from shardwire.options import SettingError


_MAX_FRAGMENTS = 1 << 20  # above any group's fragment count: what ``_agreed_fragment`` counts down from


class OuterState:
    """The outer optimizer's state of one flat buffer, and the sync in flight, if any: ``change``,
    the change since the anchor being averaged in place, and, for an overlapped sync, ``sent``, the
    shard its eager step gave (what the inner progress made meanwhile is measured from) and, between
    fault-tolerant groups, whose quorum may drop the sync, ``before_eager``, the shard before it."""

    def __init__(self, name: str, shard: torch.Tensor, comm: Communicator, diloco: DiLoCo,
                 residual: torch.Tensor | None):
        self.anchor = shard.detach().float().clone()
        self.momentum = torch.zeros_like(self.anchor)
        # What a checkpoint keeps (``state``), each shaped like the shard, by its dtype.
        self.dtypes = {"anchor": torch.float32, "momentum": torch.float32, "change": torch.float32,
                       "sent": shard.dtype}
        self.change: torch.Tensor | None = None
        self.sent: torch.Tensor | None = None
        self.before_eager: torch.Tensor | None = None
        self._droppable = isinstance(comm, Quorum)
        self.own_squared: torch.Tensor | None = None  # this group's change, squared and summed, at send
        self._tag = f"{name} (sync)"
        self._comm = comm
        self._diloco = diloco
        self._residual = residual  # error feedback of the quantized all-reduce (FlatParam.residuals)
        self._pending: Pending | None = None

    @torch.no_grad()
    def send(self, shard: torch.Tensor, *, eager: bool) -> None:
        """Start averaging the change since the anchor across the groups (DiLoCo's outer gradient,
        ``anchor - shard``). With ``eager``, for a sync that runs behind the inner steps, take the
        outer step at once with this group's own change in place of the average and remember the
        shard it gives, so that the inner steps go on from it and ``apply`` replaces this group's
        change by the average under them."""
        self.change = self.anchor - shard.detach().float()
        self.own_squared = self.change.square().sum()  # for the groups' drift (OuterLoop.metrics)
        self.sent = None
        if eager:
            if self._droppable:  # a dropped sync's eager step is undone, its progress kept
                self.before_eager = shard.detach().clone()
            step = self.momentum.mul(self._diloco.momentum).add_(self.change)
            step = self.change.add(step, alpha=self._diloco.momentum)
            shard.copy_(self.anchor.sub(step, alpha=self._diloco.outer_lr))
            self.sent = shard.detach().clone()
        self._pending = self._comm.all_reduce(self.change, tag=self._tag, op="avg", codec=self._diloco.codec,
                                              residual=self._residual)

    def wait(self) -> None:
        """Let the average arrive (it is applied by ``apply``); a checkpoint saves it so."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    @torch.no_grad()
    def apply(self, shard: torch.Tensor) -> None:
        """The outer step: Nesterov SGD on the anchor with the averaged change as its gradient (as
        ``torch.optim.SGD(nesterov=True)`` steps), then the shard becomes the new anchor, plus the
        inner progress made since the eager step of an overlapped sync."""
        self.wait()
        momentum, lr = self._diloco.momentum, self._diloco.outer_lr
        self.momentum.mul_(momentum).add_(self.change)
        self.anchor.sub_(self.change.add(self.momentum, alpha=momentum), alpha=lr)
        progress = None if self.sent is None else shard - self.sent
        shard.copy_(self.anchor)
        if progress is not None:
            shard.add_(progress)
        self.change = self.sent = self.before_eager = self.own_squared = None

    @torch.no_grad()
    def drop(self, shard: torch.Tensor, *, behind: bool) -> None:
        """Forget the sync sent (its quorum failed): the anchor and the momentum stay, and the
        shard keeps this group's progress for the next sync to average (an overlapped sync's eager
        step undone); a group that was ``behind`` takes the anchor it received instead (its own
        progress is measured from another anchor)."""
        self.wait()
        if behind:
            shard.copy_(self.anchor)
        elif self.before_eager is not None:
            shard.add_(self.before_eager - self.sent)
        self.change = self.sent = self.before_eager = self.own_squared = None

    def state(self) -> dict[str, torch.Tensor]:
        """The anchor and the momentum and, for a sync in flight (``wait`` for it first), its average
        and the shard it was sent from: what a checkpoint keeps."""
        found = {"anchor": self.anchor, "momentum": self.momentum, "change": self.change, "sent": self.sent}
        return {key: value for key, value in found.items() if value is not None}

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor], shard: torch.Tensor) -> None:
        """Restore what ``state`` gave (host tensors); without an anchor (a checkpoint saved without
        sync, weights loaded into the model), start afresh from ``shard``: it is the anchor, with no
        momentum, nothing in flight and no rounding left over from the sync's quantization."""
        self.wait()
        self.before_eager = None  # a fault-tolerant group applies its sync in flight before it saves
        if "anchor" not in state:
            self.anchor.copy_(shard)
            self.momentum.zero_()
            self.change = self.sent = self.own_squared = None
            if self._residual is not None:
                self._residual.zero_()
            return
        self.own_squared = None
        self.anchor.copy_(state["anchor"])
        self.momentum.copy_(state["momentum"])
        self.change = state["change"].to(self.anchor.device) if "change" in state else None
        self.sent = state["sent"].to(shard.device) if "sent" in state else None


class OuterLoop:
    """When each fragment of the model syncs (``DiLoCo.due``), and the sync in flight.

    ``steps`` counts inner steps: backward passes that reduced gradients. A fragment due after step
    ``t`` is sent when the next forward starts and applied when the forward after step ``t + fragment_sync_delay``
    starts (at once with no delay), before the next fragment is sent. Before each sync, the
    communicators that span the groups (``world`` and ``replicate``) compare the collectives each
    rank issued on them since the last: they carry nothing at the steps between, which therefore
    never wait on the link between groups.
    """

    def __init__(self, flats_by_unit: list[list], diloco: DiLoCo, world: Communicator, replicate: Communicator,
                 quorum: Quorum | None = None):
        synced = [[flat for flat in flats if flat.outer is not None] for flats in flats_by_unit]
        synced = [flats for flats in synced if flats]
        count = diloco.fragments
        self.diloco = diloco
        self._world = world
        self._groups = replicate.world
        # The groups' drift is measured against the average as it arrived: a quantized one's error
        # adds to its norm, and read as the groups agreeing (0 at int4), so it is left out there; and
        # between fault-tolerant groups, where a group alone knows its own change, not the others'.
        self._measures_drift = quorum is None and not replicate.quantizes(diloco.codec)
        self._spanning = [world, replicate]
        self.fragments = [[flat for flats in synced[f::count] for flat in flats] for f in range(count)]
        # what the groups compare at each sync (``_agreed_fragment``): the settings and the model's shapes
        d = diloco
        self._settings = agreement_values(fingerprint(d.sync_every, d.fragments, d.wire, number(d.outer_lr),
                                                      number(d.momentum), d.fragment_sync_delay))
        self._shapes = agreement_values(shapes_fingerprint([flat for flats in synced for flat in flats], world.world))
        self.steps = 0
        self.checked = 0  # the step whose due sync has been issued
        self._sent_at = 0  # the step the last sync was sent at
        self.in_flight: tuple[list, int] | None = None  # (the flats being synced, the step they are applied after)
        # Since the last ``metrics``: the groups' own changes and their average, squared and summed
        # over this rank's shards, on the device (read where the training waits for it anyway).
        self._squares: torch.Tensor | None = None
        self._synced = 0  # fragments' syncs applied since then
        # Fault-tolerant groups (``shardwire.engine.fault_tolerance``): the quorum a sync averages
        # over, in place of ``replicate``; what a sync found, for the log.
        self.quorum = quorum
        self._compared_anchors = False  # whether this process compared its anchors with the other groups'
        self._joined = quorum is None
        self._skipped = 0  # steps this group's recoveries moved it forward since the last ``metrics``
        self._voted_after = 0  # the steps done at the vote of the sync sent last
        self._loads = 0  # weights loaded since shard (``load_state``): ``global_model`` keeps those loaded in it
        if quorum is not None:
            quorum.meets("every few steps (DiLoCo)")
            quorum.register("shardwire", self._recovery_state, self._load_recovery_state)

    def step_done(self) -> None:
        self.steps += 1

    @property
    def accumulated(self) -> str:
        """What a step's micro-batches accumulated outside ``no_sync`` do here
        (``shardwire.engine.accumulation``)."""
        return (f"under DiLoCo each is an inner step, and the syncs come every sync_every={self.diloco.sync_every} "
                f"backward passes rather than steps, between micro-batches")

    def next_meeting(self) -> int:
        """The inner steps done at the groups' next meeting after this one: the next due sync's."""
        return self.diloco.next_due(self.steps)

    def voted_after(self) -> int:
        """The inner steps done when the vote on the meeting forming now is taken (where the sync
        is applied): a group behind receives the others' state there."""
        return self._voted_after

    def before_forward(self) -> None:
        """Apply the sync whose time has come and send those due after the steps since the last
        forward (one, unless a backward outside ``no_sync`` took more than one step), once per step:
        all but the last at once, the last behind the next inner steps as the sync says. A
        fault-tolerant group syncs first at its first step, to meet the other groups (and receive
        their state, if it is behind)."""
        self.join()
        if self.checked == self.steps:
            return
        first, self.checked = self.checked + 1, self.steps
        if self.in_flight is not None and self.steps >= self.in_flight[1]:
            moved = self.steps
            self._apply()
            first += self.steps - moved  # a group that recovered there took the others' schedule: not its syncs
        due = [fragment for step in range(first, self.steps + 1) if (fragment := self.diloco.due(step)) is not None]
        for position, fragment in enumerate(due):
            if self.in_flight is not None:  # sent under another schedule (a resumed run that changed it)
                self._apply()
            lag = self.diloco.fragment_sync_delay if position == len(due) - 1 else 0
            self._send(fragment, eager=lag > 0, applied_after=self.steps + lag)
            if lag == 0:
                self._apply()

    def join(self) -> None:
        """A fault-tolerant group's first sync, before its first step (``shardwire train`` calls it
        before its loop; otherwise the first training forward does): it meets the other groups, and
        a group that is behind receives their state and step here. Being a sync, it is the one due
        now, if any (a run resumed at a multiple of ``sync_every``)."""
        if self._joined:
            return
        self._joined = True
        if self.in_flight is not None:  # resumed with a sync in flight, saved averaged by a run that voted on it
            self._apply(vote=False)
        if self.checked == self.steps > 0:
            # resumed from a checkpoint that holds the sync due at its step (its run's final sync, or
            # one an evaluation took before the save), given more steps: again it would move the
            # model by a step of outer momentum. The groups meet at the next sync, as an uninterrupted
            # run's would (the data up to it was dealt at this one).
            return
        self._send(self.diloco.due(self.steps) or 0, eager=False, applied_after=self.steps)
        self._apply()
        self.checked = self.steps

    def stay_apart(self) -> None:
        """Meet no group in this process, which trains no step: resumed from a fault-tolerant run's
        last checkpoint, whose final sync the groups took already. Its join would sync alone, and
        the outer momentum alone would move the model the groups ended with."""
        self._joined = True
        self.checked = self.steps

    def sync_now(self) -> None:
        """Apply the sync in flight, then sync every fragment at once, waiting for each: afterwards
        every group holds the same model (to evaluate or export the result of training). Between
        fault-tolerant groups a sync the vote drops is sent again until one is kept: after the last
        step no later sync averages what it dropped, and the model the groups agree on (the anchor)
        would leave out every step since their last sync."""
        if self.in_flight is not None:
            self._apply()
        synced = self._synced_after_this_step()
        self.checked = self.steps  # what was due after this step is synced: the next forward sends nothing
        for fragment in range(len(self.fragments)):
            if fragment == synced:
                continue
            for _ in range(MAX_DROPPED):
                self._send(fragment, eager=False, applied_after=self.steps)
                if self._apply():
                    break
            else:
                raise SettingError(f"the fault-tolerant groups dropped their final sync {MAX_DROPPED} times in a row "
                                   f"(after step {self.steps}): their all-reduce fails whichever groups meet; give "
                                   f"every group as many ranks and the same model and settings, and see the first "
                                   f"group's log for the failure")

    def _synced_after_this_step(self) -> int | None:
        """The fragment the sync due after the last step synced already (a save, ``global_model``,
        before this process resumed too), which every group holds alike: syncing it again would
        move it by a step of momentum, so that a run that saved would end apart from one that did
        not. Only where every rank's shards of it are still its anchor (no optimizer step since),
        agreed over the world, so that every rank skips it or none. Between fault-tolerant groups,
        whose syncs are met in one order, none."""
        fragment = self.diloco.due(self.steps)
        if self.quorum is not None or fragment is None or self.checked != self.steps:
            return None
        mine = all(torch.equal(flat.shard, flat.outer.anchor.to(flat.shard.dtype)) for flat in self.fragments[fragment])
        alike = self._world.all_gather_values([int(mine)], tag="fragment synced after this step")
        return fragment if all(row[0] for row in alike) else None

    def restart(self) -> None:
        """Start the outer optimisation afresh from the parameters as they are: after weights were
        loaded into the model (``load_state_dict``, DCP), the change since the old anchor is not
        training's. The sync in flight is dropped (between fault-tolerant groups, applied first:
        its vote is this quorum's), the momentum zeroed, and the schedule starts again."""
        flats = [flat for fragment in self.fragments for flat in fragment]
        if self.quorum is not None and self.in_flight is not None:  # applied to the anchor, not to what was loaded
            loaded = [flat.shard.clone() for flat in flats]
            self._apply()
            with torch.no_grad():
                for flat, shard in zip(flats, loaded):
                    flat.shard.copy_(shard)
        for flat in flats:
            flat.outer.load_state({}, flat.shard)
        self.load_state(None)
        self._compared_anchors = False  # fault-tolerant groups compare what they loaded at their next sync

    def state(self) -> list[int]:
        """The schedule's place, for a checkpoint: the inner steps done, the step whose sync was
        issued, and the step the sync in flight is applied after (-1: none). Call ``settle`` first:
        the flats in flight are those whose ``OuterState`` holds a change."""
        return [self.steps, self.checked, -1 if self.in_flight is None else self.in_flight[1]]

    def load_state(self, state: list[int] | None) -> None:
        """Restore ``state``, once the flats' ``OuterState`` are (None: a checkpoint saved without
        sync; the schedule starts again)."""
        self.steps, self.checked, applied_after = state or (0, 0, -1)
        self._loads += 1
        flats = [flat for fragment in self.fragments for flat in fragment if flat.outer.change is not None]
        self.in_flight = (flats, applied_after) if applied_after >= 0 and flats else None

    def settle(self) -> None:
        """Make the outer state what a checkpoint saves: the sync due after the last step taken is
        issued, as the next training forward would issue it (the same values: nothing changes the
        shards in between), so that a checkpoint saved at a multiple of ``sync_every`` holds it,
        and a load of its global model (another number of groups, an export) the last H steps;
        then the sync in flight arrives, unapplied. Between fault-tolerant groups the due sync is
        left to the next forward, as a group resumed from the checkpoint takes it when it joins
        (``join``), and the sync in flight is applied: its commit vote belongs to this quorum,
        which a resumed run would not be in."""
        if self.quorum is None:
            self.before_forward()
        if self.in_flight is None:
            return
        if self.quorum is not None:
            self._apply()
            return
        for flat in self.in_flight[0]:
            flat.outer.wait()

    def _send(self, fragment: int, *, eager: bool, applied_after: int) -> None:
        """Send ``fragment``'s sync. Fault-tolerant groups syncing in fragments first agree on which
        the quorum syncs: a group that joins (or is behind) meets the others at whichever fragment
        their schedule has come to, and takes theirs."""
        with record_function(f"shardwire::sync(fragment {fragment})"):
            for comm in self._spanning:
                comm.verify_order("the syncs before this one")
            if self.quorum is not None:
                with record_function("shardwire::quorum"):
                    self._voted_after = applied_after
                    self.quorum.start(self.steps)
                    fragment = self._agreed_fragment(fragment)
            elif self._groups > 1:
                self._compare_anchors(self.fragments[fragment])
            flats = self.fragments[fragment]
            for flat in flats:
                flat.outer.send(flat.shard, eager=eager)
        self.in_flight = (flats, applied_after)
        self._sent_at = self.steps

    def _compare_anchors(self, flats: list) -> None:
        """Compare the groups' anchors of the fragment about to sync, which every sync leaves alike,
        so that groups that came apart are refused rather than averaged: weights loaded since the
        last sync (a load starts the outer optimisation of every parameter from the group's own
        values) that differ between groups, or that only some ranks loaded. A 64-bit sum of the
        anchors' words, all-gathered over the world, every rank at every sync, so that no rank
        waits on a collective another skips; read without waiting for it (``refuse_later``), so a
        difference is refused at the sync, or a step or two after it, on every rank alike."""
        mine = word_sums([flat.outer.anchor for flat in flats]).sum().reshape(1)
        everyone = torch.empty(self._world.world, dtype=torch.int64, device=mine.device)
        self._world.all_gather(everyone, mine, tag="anchor check").wait()
        by_group = everyone.view(self._groups, -1)  # the world's ranks in consecutive groups (``groups.blocks``)
        self._world.refuse_later(
            (by_group != by_group[0]).any(),
            "the groups hold different weights to sync from, which would never meet again: weights loaded since "
            "their last sync differ between groups, or only some ranks loaded them (a load starts every parameter's "
            "outer optimisation from the group's own values, those not loaded too): load whole state dicts alike on "
            "every rank, or load inside shardwire.global_model; to restore each group's own model and outer state, "
            "use shardwire.load_checkpoint")

    def _agreed_fragment(self, fragment: int) -> int:
        """The fragment the quorum syncs: the one the groups' schedule has come to (a group that joins
        takes the others'). Groups that sync in different numbers of fragments cannot average one: a
        group whose count is not every other's says so (a group that joins compares its own with
        theirs). Nor can groups with other settings (when they sync, the outer step's rate and
        momentum, the wire) or a model of other shapes (their averages would not line up). At the
        first sync of this process, unless it is behind, its anchors are compared too (every
        fragment's: groups resumed at other inner steps come to other fragments): groups that
        start apart (another seed) would never meet. Each by a 32-bit fingerprint
        (``agreement_values``)."""
        count = len(self.fragments)
        compare = not (self._compared_anchors or self.quorum.recovered)
        anchors = agreement_values(values_fingerprint([flat.outer.anchor for flats in self.fragments for flat in flats])
                                   if compare else None)
        agreed, most, fewest, *highest = self.quorum.agree(
            [fragment, count, _MAX_FRAGMENTS - count, *self._settings, *self._shapes, *anchors])
        fewest = _MAX_FRAGMENTS - fewest
        if not most == fewest == count:
            others = f"{most}" if most == fewest else f"{fewest} to {most}"
            raise SettingError(f"the other fault-tolerant groups sync in {others} fragments, this one in {count}: "
                               f"give every group the same {{diloco}} fragments", diloco=("diloco",))
        if highest[:4] != self._settings:
            raise SettingError(f"the other fault-tolerant groups sync with other settings than this one's {{diloco}} "
                               f"{self.diloco}: give every group the same", diloco=("diloco",))
        self._compared_anchors |= refuse_another_model(highest[4:], self._shapes, anchors if compare else None,
                                                       self.quorum.failed, self._world, "their syncs")
        return agreed

    def _apply(self, *, vote: bool = True) -> bool:
        """Apply the sync in flight; between fault-tolerant groups, if the quorum's ``vote`` keeps it.
        Returns whether it was applied."""
        flats, _ = self.in_flight
        if self.quorum is not None and vote and not self._committed(flats):
            return False
        # A sync sent before a resume from a checkpoint that holds no measure of it goes unmeasured.
        measured = all(flat.outer.own_squared is not None for flat in flats)
        with record_function("shardwire::outer_step"):
            for flat in flats:
                flat.outer.wait()
                if measured:
                    squares = torch.stack([flat.outer.own_squared, flat.outer.change.square().sum()])
                    self._squares = squares if self._squares is None else self._squares.add_(squares)
                flat.outer.apply(flat.shard)
        self.in_flight = None
        self._synced += measured
        return True

    def _committed(self, flats: list) -> bool:
        """Whether the quorum's sync completed everywhere (a group behind loads the others' state
        here); if not, it is dropped and every group goes on from its own parameters."""
        for flat in flats:
            flat.outer.wait()
        behind = self.quorum.recovered
        with record_function("shardwire::quorum_commit"):
            committed = self.quorum.commit()
        if committed:
            return True
        for flat in flats:
            flat.outer.drop(flat.shard, behind=behind)
        self.in_flight = None
        return False

    def _recovery_state(self) -> dict:
        """What a group that is behind receives from this one at a sync (host tensors): the
        schedule and, per flat buffer, the anchor and the outer momentum before this sync."""
        flats = [flat for fragment in self.fragments for flat in fragment]
        return {"schedule": [self.steps, self.checked],
                "outer": [(flat.outer.anchor.cpu(), flat.outer.momentum.cpu()) for flat in flats]}

    def _load_recovery_state(self, state: dict) -> None:
        flats = [flat for fragment in self.fragments for flat in fragment]
        check_received([flat.outer.anchor for flat in flats], [anchor for anchor, _ in state["outer"]])
        for flat, (anchor, momentum) in zip(flats, state["outer"]):
            flat.outer.anchor.copy_(anchor)
            flat.outer.momentum.copy_(momentum)
            # What the groups last agreed on, for every fragment: the one this sync averages
            # becomes its new anchor at the outer step, the others train on from their anchor;
            # an overlapped sync brings no progress of this group's to add.
            with torch.no_grad():
                flat.shard.copy_(anchor)
            flat.outer.sent = flat.outer.before_eager = None
        # The peer's schedule as it sent, moved on by the steps this group has run since it sent
        # (an overlapped sync is applied that many steps later, as the peer's is).
        steps = state["schedule"][0] + self.steps - self._sent_at
        self._skipped += steps - self.steps
        self.steps = self.checked = steps

    def metrics(self) -> dict[str, float]:
        """What a sync of the whole model did, on average over the syncs since the last call (every
        rank calls it: one all-reduce of two numbers): ``outer_grad_norm``, the norm of the averaged
        change (the outer optimizer's gradient), and ``drift``, the root mean square over the groups
        of the distance from each group's change to that average, which says how far apart the
        groups trained, where that average arrives exact (a quantized wire's error would read as the
        groups agreeing). Empty where no sync was applied since (the same on every rank: the schedule
        is shared); a fragment's sync counts as its share of one of the whole model. Between
        fault-tolerant groups, instead of ``drift``: ``Quorum.take_metrics`` and the steps recoveries
        moved this group forward."""
        found = {}
        if self.quorum is not None:  # the quorum's groups and what failures cost, for the log
            found = {**self.quorum.take_metrics(), "skipped_steps": self._skipped}
            self._skipped = 0
        if self._squares is None:
            return found
        squares, self._squares = self._squares, None
        self._world.all_reduce(squares, tag="sync metrics").wait()
        groups = 1 if self.quorum is not None else self._groups  # ``world``: the groups whose changes it adds
        per_sync = len(self.fragments) / (groups * self._synced)
        self._synced = 0
        own, averaged = (value * per_sync for value in squares.tolist())
        found["outer_grad_norm"] = averaged ** 0.5
        if self._measures_drift:
            found["drift"] = max(own - averaged, 0.0) ** 0.5
        return found

    @contextlib.contextmanager
    def global_model(self) -> Iterator[None]:
        """Hold the global model (the anchor, what every group last agreed on) in every shard while
        the block runs, then give each group its own back: to evaluate what the run has trained, as
        DiLoCo's papers do, rather than one group's model. The sync due after the last step is taken
        first, as the next training forward would take it (every rank must enter the block).
        Weights loaded in the block (a state dict, a checkpoint) are every group's model afterwards."""
        self.before_forward()
        flats = [flat for fragment in self.fragments for flat in fragment]
        own = [flat.shard.clone() for flat in flats]
        loads = self._loads
        try:
            with torch.no_grad():
                for flat in flats:
                    flat.shard.copy_(flat.outer.anchor)
            yield
        finally:
            if self._loads == loads:
                with torch.no_grad():
                    for flat, shard in zip(flats, own):
                        flat.shard.copy_(shard)
