"""The data of fault-tolerant groups, dealt at each of their meetings: within an epoch no sequence
twice, and those of steps a failure lost dealt again.

Without fault tolerance a run's batches are a pure function of the seed and the step, each group of
a job taking its rows. Groups that come and go cannot share out such a function: how many there are
changes at every failure. So their data is read by position instead (``data.epoch_starts``: the train
split cut into sequences, each epoch in an order drawn from the run's seed), and the positions are
dealt in *blocks*, one step of one group's batches each (``--grad-accum`` x ``--batch`` x its
ranks), at every meeting of the groups: each sync's quorum under DiLoCo, each step's otherwise.

* **The deal.** Every group of the quorum receives as many blocks as there are steps until the next
  meeting, by its place among them (``Quorum.member``); a group that is behind, only for the steps
  from the meeting's vote on, where it takes the others' state (before it, its steps are replaced).
* **What was kept.** The groups first agree (``Quorum.agree``) on how many blocks of the last deal
  each group of the last meeting trained on in steps it still holds: 0 for a group that is gone, is
  behind (its steps are replaced by the others') or whose step was dropped. The blocks nobody kept
  go back, and are dealt first; fresh blocks follow, from the highest cursor any group holds.
* **One ledger.** The cursor, the blocks given back and the last deal are the same in every group. A
  group that is behind receives them from a live peer as they were when the meeting formed, and deals
  that meeting again itself; until then it trains on windows drawn at random, steps its recovery
  throws away. A checkpoint records the ledger, so that groups restarted from checkpoints of one step
  deal as they would have.

What this does not cover: a step counts as kept once its group reaches the next meeting with it, so a
group lost after that, before a sync carrying the step commits (a sync the vote dropped, fragments
still to come), takes its blocks' share of the model with it; a failure within a meeting's own
agreement can leave the groups' ledgers apart, dealing a lost group's blocks twice, and the groups
it struck train on windows drawn at random until the next meeting.
"""

from __future__ import annotations

import itertools

import torch

from shardwire.comm.quorum import Quorum
from shardwire.options import SettingError

MAX_GROUPS = 256  # groups one meeting's agreement has room for
MAX_BLOCKS = 2**24 - 2  # the blocks a run deals: ``Quorum.agree`` takes counts under 2^24


class Deal:
    """This rank's share of the blocks dealt to its group (see the module's docstring).

    ``meeting`` is where the groups meet: ``OuterLoop`` under DiLoCo, ``StepQuorum`` otherwise; its
    ``steps`` are the steps done, and ``next_meeting()`` the steps done at the next meeting.
    ``batch`` sequences make one of the group's micro-batches, ``block`` the blocks' size (a step's
    micro-batches)."""

    def __init__(self, quorum: Quorum, meeting, corpus, *, batch: int, grad_accum: int, seq_len: int, seed: int):
        self._quorum, self._meeting, self._corpus = quorum, meeting, corpus
        self._batch, self.block, self._seq_len, self._seed = batch, batch * grad_accum, seq_len, seed
        # The ledger, the same in every group: the next fresh block, the blocks given back, and the
        # last deal by place in its meeting.
        self._next = 0
        self._returned: list[int] = []
        self._dealt: list[list[int]] = []
        # This group's own: its place in the last deal (None: none it still holds), the step its
        # blocks begin at, and a meeting it deals again once the ledger arrives (behind).
        self._member: int | None = None
        self._first = 0
        self._pending: tuple[int, int, int, int, list[int], list[int]] | None = None
        quorum.attend(self._meet)
        quorum.register("data", self._ledger, self._load_ledger)

    def batch(self, micro: int, rows: slice) -> torch.Tensor | None:
        """This rank's ``rows`` of micro-batch ``micro`` of the step the meeting has come to, from
        the blocks dealt to its group; None where it holds none (behind, awaiting the others'
        ledger; or a failure struck the meeting)."""
        if self._pending is not None or self._member is None:
            return None
        blocks, index = self._dealt[self._member], self._meeting.steps - self._first
        if not 0 <= index < len(blocks):
            raise RuntimeError(f"step {self._meeting.steps} is not among the {len(blocks)} steps dealt to this "
                               f"group from step {self._first}")
        start = blocks[index] * self.block + micro * self._batch
        return self._corpus.windows(list(range(start + rows.start, start + rows.stop)), self._seq_len,
                                    seed=self._seed)

    def state(self) -> dict:
        """The ledger and this group's place in it, for a checkpoint."""
        return {**self._ledger(), "member": self._member, "first": self._first}

    def load_state(self, state: dict | None) -> None:
        """Restore ``state`` (None: a checkpoint saved without fault tolerance; the groups deal from
        the start of the first epoch)."""
        if state is None:
            return
        if not _is_deal(state):
            raise ValueError("its data deal (fault-tolerant groups) is not one shardwire train saved")
        self._pending = None
        self._load_ledger(state)
        self._member, self._first = state["member"], state["first"]

    def _meet(self) -> None:
        """At a quorum: agree on who takes part, what the last deal's groups kept and when the next
        meeting and this one's vote come, and deal."""
        if self._quorum.failed:
            self._lost()
            return
        member, members = self._quorum.member
        if members > MAX_GROUPS:
            raise SettingError(f"{members} fault-tolerant groups met, more than the {MAX_GROUPS} whose data one "
                               f"meeting can deal: run fewer, larger groups")
        steps = self._meeting.steps
        present, kept = [0] * MAX_GROUPS, [0] * MAX_GROUPS  # a group behind gives nothing: the others' count
        if not self._quorum.recovered:
            present[member] = 1
            if self._member is not None:
                kept[self._member] = steps - self._first + 1  # 0: not kept
        ahead, lag, cursor, most, fewest, *agreed = self._quorum.agree(
            [self._meeting.next_meeting() - steps, self._meeting.voted_after() - steps, self._next, self.block,
             MAX_BLOCKS - self.block, *present, *kept])
        if self._quorum.failed:
            self._lost()
            return
        fewest = MAX_BLOCKS - fewest
        if not most == fewest == self.block:
            raise SettingError(f"the other fault-tolerant groups take {fewest} to {most} sequences a step, this "
                               f"one {self.block}: give every group as many ranks and the same --batch and "
                               f"--grad-accum")
        self._pending = (member, ahead, lag, cursor, agreed[:members], agreed[MAX_GROUPS:])
        if not self._quorum.recovered:
            self._deal(steps)

    def _lost(self) -> None:
        """A failure struck the meeting before its deal: this group holds no blocks until the next
        (``batch`` gives None, and the loop draws at random), and reports none kept there."""
        self._member, self._pending = None, None

    def _deal(self, at: int) -> None:
        """Deal the meeting formed after ``at`` steps: to each group as many blocks as steps until
        the next meeting, but to one behind only from the vote on, where it takes the others' state
        (steps before it are replaced by theirs)."""
        member, ahead, lag, cursor, present, kept = self._pending
        self._pending = None
        back = [block for blocks, count in zip(self._dealt, kept) for block in blocks[max(count - 1, 0):]]
        self._returned = sorted(self._returned + back)
        self._next = max(self._next, cursor)
        counts = [ahead if taking_part else max(ahead - lag, 0) for taking_part in present]
        again, self._returned = self._returned[:sum(counts)], self._returned[sum(counts):]
        fresh = sum(counts) - len(again)
        if self._next + fresh > MAX_BLOCKS:
            raise SettingError(f"the fault-tolerant groups have dealt {self._next:,} steps of data, as many as a run "
                               f"can: resume from a checkpoint without --fault-tolerance to train on")
        blocks = again + list(range(self._next, self._next + fresh))
        self._next += fresh
        ends = list(itertools.accumulate(counts))
        self._dealt = [blocks[end - count : end] for count, end in zip(counts, ends)]
        self._member, self._first = member, at + (0 if present[member] else lag)

    def _ledger(self) -> dict:
        """The ledger as it stands (a live peer's, sent to a group behind as the meeting forms), and
        the meeting's step."""
        return {"next": self._next, "returned": list(self._returned), "dealt": [list(b) for b in self._dealt],
                "at": self._meeting.steps}

    def _load_ledger(self, state: dict) -> None:
        self._next, self._returned = state["next"], list(state["returned"])
        self._dealt = [list(blocks) for blocks in state["dealt"]]
        if self._pending is not None:  # behind: the meeting it was dealt at, dealt again on the others' ledger
            self._deal(state["at"])


def _is_deal(state: object) -> bool:
    """Whether ``state``, read from a checkpoint, is shaped as ``Deal.state`` writes it."""
    def counts(values: object) -> bool:
        return isinstance(values, list) and all(type(value) is int and 0 <= value <= MAX_BLOCKS for value in values)

    return (isinstance(state, dict) and counts([state.get("next"), state.get("first")])
            and counts(state.get("returned")) and isinstance(state.get("dealt"), list)
            and len(state["dealt"]) <= MAX_GROUPS and all(counts(blocks) for blocks in state["dealt"])
            and (state.get("member") is None or counts([state["member"]]) and state["member"] < len(state["dealt"])))
