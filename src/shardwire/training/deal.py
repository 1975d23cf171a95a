"""The data of fault-tolerant groups, dealt at each of their meetings: within an epoch no sequence
twice, and those of steps a failure lost dealt again.

Without fault tolerance a run's batches are a pure function of the seed and the step, each group of
a job taking its rows. Groups that come and go cannot share out such a function: how many there are
changes at every failure. So their data is read by position instead (``data.epoch_starts``: the
train split cut into sequences, each epoch in an order drawn from the run's seed), and the positions
are dealt in *blocks*, one step of one group's batches each (``--grad-accum`` x ``--batch`` x its
ranks), at every meeting of the groups: each sync's quorum under DiLoCo, each step's otherwise.

* **The deal.** Every group of the quorum, one that is behind included, receives a block for each
  step until the next meeting, by its place among them (``Quorum.member``).
* **What was kept.** The groups first agree (``Quorum.agree``) on which blocks of the last deal each
  group of the last meeting trained on in steps it still holds: none for a group that is gone or
  behind (its steps are replaced by the others'), nor for a step the vote dropped, nor for the
  steps before the vote at which a group behind took the others' state. The blocks nobody kept go
  back, and are dealt first; fresh blocks follow, from the highest cursor any group holds.
* **One ledger.** The cursor, the blocks given back and the last deal are the same in every group. A
  group that is behind receives them from a live peer as they were when the meeting formed, and deals
  that meeting again itself; until then it trains on windows drawn at random, in steps its recovery
  throws away. A checkpoint records the ledger, so that groups restarted from checkpoints of one step
  deal as they would have.

What this does not cover: a step counts as kept once its group reaches the next meeting with it, so a
group lost after that, before a sync carrying the step commits (a sync the vote dropped, fragments
still to come), takes its blocks' share of the model with it. A failure within a meeting's own
agreement keeps what was trained before it, but its group trains on windows drawn at random until
the next meeting; and where it struck some of a group's ranks and not others, or some groups and
not others, their ledgers part, and blocks can be dealt twice until a recovery brings one back.
Each meeting adds one all-reduce of about 2 KB between the groups.
"""

from __future__ import annotations

import typing

import torch

from shardwire.comm.agreement import agreement_values, fingerprint
from shardwire.comm.quorum import Quorum
from shardwire.engine.checkpoint import schema
from shardwire.mappings import cut
from shardwire.options import SettingError

MAX_GROUPS = 256  # groups one meeting's agreement has room for
MAX_BLOCKS = 2**24 - 2  # the blocks a run deals: ``Quorum.agree`` takes counts under 2^24
_OWN_WAY = "each group steps its own way between syncs (DiLoCo)"  # what DiLoCo's groups compare of their stepping


class Meeting(typing.Protocol):
    """Where the groups meet: ``OuterLoop`` under DiLoCo, ``StepQuorum`` otherwise."""

    steps: int  # the steps done

    def next_meeting(self) -> int:
        """The steps done at the next meeting."""

    def voted_after(self) -> int:
        """The steps done at the vote on the meeting forming now."""


class _Met(typing.NamedTuple):
    """A meeting's agreement, kept until the ledger it deals from is at hand."""
    place: int  # this group's among the meeting's
    places: int  # the groups of the meeting, those behind included
    ahead: int  # steps until the next meeting: the blocks each group is dealt
    cursor: int  # the highest next fresh block
    used: list[tuple[int, int]]  # by place in the last deal: the blocks kept, as a range of its blocks
    replaced: int  # this group's steps before its vote, which a group behind does not keep


def schedule_of(steps: int, eval_every: int, *, diloco: bool) -> str:
    """The options that set when fault-tolerant groups end and what their checkpoints hold, as a
    ``Deal`` compares them: ``--steps``, and under DiLoCo ``--eval-every`` (an evaluation takes the
    sync due at its step)."""
    return f"--steps {steps}" + (f" --eval-every {eval_every}" if diloco else "")


class Deal:
    """This rank's share of the blocks dealt to its group (see the module's docstring): ``batch``
    sequences make one of the group's micro-batches, ``block`` the blocks' size (a step's
    micro-batches)."""

    def __init__(self, quorum: Quorum, meeting: Meeting, corpus, *, batch: int, grad_accum: int, seq_len: int,
                 seed: int, schedule: str, data: dict, training: str | None = None):
        """``schedule``: the options that set when the groups end and what their checkpoints hold, as
        given (``--steps 40``; under DiLoCo ``--eval-every`` too), which every group must be given
        alike: a group given fewer steps would end at a sync of the others' after more steps, taking
        their model without its own last steps; one evaluating at other steps would save checkpoints
        holding syncs the others' do not (an evaluation takes the sync due at its step), so that
        groups restarted from them would meet a sync apart.
        ``data``: the corpus's identity (``data.identity``), which every group's must share, cut
        into sequences alike (``seq_len``, and ``seed``, which orders each epoch): blocks are dealt
        by position, so groups on other data would each read their own under one deal.
        ``training``: the settings every group must step with (``--lr 0.003 ...``) where the groups
        average gradients at every step, so that they step alike; None where each steps its own."""
        self._quorum, self._meeting, self._corpus = quorum, meeting, corpus
        self._training = training
        # Compared at every meeting, as groups resumed from checkpoints never meet at the first (a
        # group that abstained would not see a difference; every group gives a value): what must be
        # alike in every group, with what a group whose differs is told.
        self._alike = [
            (agreement_values(fingerprint(schedule)),
             f"were given another schedule than this one's ({schedule}): give every group the same"),
            (agreement_values(fingerprint(data["tokens"], data["sampled"])),
             f"train on other data than this one's ({cut(str(data['name']))}, {data['tokens']:,} tokens, "
             f"fingerprint {data['sampled']}): give every group the same --data and --tokenizer"),
            (agreement_values(fingerprint(seq_len, seed)),
             f"cut the data into other sequences than this one's (--seq-len {seq_len}, --seed {seed}): give every "
             f"group the same")]
        self._training_values = agreement_values(fingerprint(training if training is not None else _OWN_WAY))
        self._batch, self.block, self._seq_len, self._seed = batch, batch * grad_accum, seq_len, seed
        # The ledger, the same in every group: the next fresh block, the blocks given back, and the
        # last deal by place in its meeting.
        self._next = 0
        self._returned: list[int] = []
        self._dealt: list[list[int]] = []
        # This group's own: its place in the last deal (None: none it holds), the step its blocks
        # begin at, those it does not keep at the start (steps a recovery replaced) and, after a
        # failure struck a meeting, at the end (steps after it, on windows drawn at random).
        self._place: int | None = None
        self._first = 0
        self._replaced = 0
        self._ended: int | None = None
        self._pending: _Met | None = None  # a meeting to deal again once the ledger arrives (behind)
        quorum.attend(self._meet)
        quorum.register("data", self._ledger, self._load_ledger)

    def batch(self, micro: int, rows: slice) -> torch.Tensor | None:
        """This rank's ``rows`` of micro-batch ``micro`` of the step the meeting has come to, from
        the blocks dealt to its group; None where it holds none for the step (behind, or a failure
        struck the meeting)."""
        if self._pending is not None or self._place is None or self._ended is not None:
            return None
        blocks, index = self._dealt[self._place], self._meeting.steps - self._first
        if index < self._replaced:  # before its vote, a group behind trains what the others' state replaces
            return None
        if index >= len(blocks):
            raise RuntimeError(f"step {self._meeting.steps} is not among the {len(blocks)} steps dealt to this "
                               f"group from step {self._first}")
        start = blocks[index] * self.block + micro * self._batch
        return self._corpus.windows(list(range(start + rows.start, start + rows.stop)), self._seq_len,
                                    seed=self._seed)

    def state(self) -> dict:
        """The ledger and this group's place in it, for a checkpoint."""
        return {"next": self._next, "returned": list(self._returned), "dealt": [list(b) for b in self._dealt],
                "place": self._place, "first": self._first, "replaced": self._replaced, "ended": self._ended}

    def load_state(self, state: dict | None) -> None:
        """Restore ``state`` (None: a checkpoint saved without fault tolerance; the groups deal from
        the start of the first epoch)."""
        if state is None:
            return
        try:
            _check_state(state)
        except ValueError as err:
            raise ValueError(f"its data deal (fault-tolerant groups) is not one shardwire train saved: {err}") from None
        self._pending = None
        self._next, self._returned = state["next"], list(state["returned"])
        self._dealt = [list(blocks) for blocks in state["dealt"]]
        self._place, self._first, self._replaced, self._ended = (state["place"], state["first"], state["replaced"],
                                                                 state["ended"])

    def _used(self) -> tuple[int, int]:
        """The blocks of its last deal this group kept, as a range: those before its vote, where it
        was behind, and those after a failed meeting are not."""
        end = self._meeting.steps - self._first if self._ended is None else self._ended
        return self._replaced, max(end, self._replaced)

    def _meet(self) -> None:
        """At a quorum: agree on what the last deal's groups kept and when the next meeting comes,
        and deal."""
        if self._quorum.failed:
            self._lost()
            return
        place, places = self._quorum.member
        if places > MAX_GROUPS:
            raise SettingError(f"{places} fault-tolerant groups met, more than the {MAX_GROUPS} whose data one "
                               f"meeting can deal: run fewer, larger groups")
        steps = self._meeting.steps
        starts, ends = [0] * MAX_GROUPS, [0] * MAX_GROUPS  # a group behind gives nothing: the others' count
        if not self._quorum.recovered and self._place is not None:
            start, end = self._used()
            starts[self._place], ends[self._place] = start, end + 1  # 0: no block kept
        ahead, cursor, most, fewest, *agreed = self._quorum.agree(
            [self._meeting.next_meeting() - steps, self._next, self.block, MAX_BLOCKS - self.block,
             *(value for values, _ in self._alike for value in values), *self._training_values, *starts, *ends])
        if self._quorum.failed:
            self._lost()
            return
        fewest = MAX_BLOCKS - fewest
        if not most == fewest == self.block:
            raise SettingError(f"the fault-tolerant groups that met take from {fewest} to {most} sequences a step, "
                               f"this one {self.block}: give every group as many ranks and the same --batch and "
                               f"--grad-accum")
        for values, differs in self._alike:
            given, agreed = agreed[:len(values)], agreed[len(values):]
            if given != values:
                raise SettingError(f"other fault-tolerant groups {differs}")
        training, agreed = agreed[:len(self._training_values)], agreed[len(self._training_values):]
        if training != self._training_values and self._training is None:
            raise SettingError("other fault-tolerant groups average their gradients at every step, where this one "
                               "syncs every few steps ({diloco}): give every group the same {diloco}, or none",
                               diloco=("diloco",))
        if training != self._training_values:
            raise SettingError(f"other fault-tolerant groups step with other settings than this one's "
                               f"({self._training}), or sync every few steps ({{diloco}}), so that their models, "
                               f"averaging gradients, would part: give every group the same, and the same "
                               f"{{diloco}} or none", diloco=("diloco",))
        used = [(start, end - 1) if end else (0, 0) for start, end in zip(agreed[:MAX_GROUPS], agreed[MAX_GROUPS:])]
        recovering = self._quorum.recovered
        self._pending = _Met(place, places, ahead, cursor, used,
                             self._meeting.voted_after() - steps if recovering else 0)
        if not recovering:
            self._deal(steps)

    def _lost(self) -> None:
        """A failure struck the meeting before its deal: what this group trained of its blocks stays
        kept; until the next meeting it holds none (``batch`` gives None, and the loop draws at
        random)."""
        if self._place is not None and self._ended is None:
            self._ended = self._used()[1]
        self._pending = None

    def _deal(self, at: int) -> None:
        """Deal the meeting formed after ``at`` steps."""
        met, self._pending = self._pending, None
        back = [block for blocks, (start, end) in zip(self._dealt, met.used) for block in blocks[:start] + blocks[end:]]
        self._returned = sorted(self._returned + back)
        self._next = max(self._next, met.cursor)
        wanted = met.places * met.ahead
        again, self._returned = self._returned[:wanted], self._returned[wanted:]
        fresh = wanted - len(again)
        if self._next + fresh > MAX_BLOCKS:
            raise SettingError(f"the fault-tolerant groups have dealt {self._next:,} steps of data, as many as a run "
                               f"can: resume from a checkpoint without --fault-tolerance to train on")
        blocks = again + list(range(self._next, self._next + fresh))
        self._next += fresh
        self._dealt = [blocks[place * met.ahead : (place + 1) * met.ahead] for place in range(met.places)]
        self._place, self._first, self._replaced, self._ended = met.place, at, met.replaced, None

    def _ledger(self) -> dict:
        """The ledger as it stands (a live peer's, sent to a group behind as the meeting forms), and
        the meeting's step."""
        return {"next": self._next, "returned": list(self._returned), "dealt": [list(b) for b in self._dealt],
                "at": self._meeting.steps}

    def _load_ledger(self, ledger: dict) -> None:
        self._next, self._returned = ledger["next"], list(ledger["returned"])
        self._dealt = [list(blocks) for blocks in ledger["dealt"]]
        if self._pending is not None:  # behind: the meeting it was dealt at, dealt again on the others' ledger
            self._deal(ledger["at"])


def _check_state(state: object) -> None:
    """Refuse ``state``, read from a checkpoint, unless it is shaped as ``Deal.state`` writes it."""
    fields = schema.fields(state, "deal", ("next", "returned", "dealt", "place", "first", "replaced", "ended"))
    for block in (fields["next"], *schema.array(fields["returned"], "deal.returned")):
        schema.integer(block, "a block")
    dealt = schema.array(fields["dealt"], "deal.dealt")
    if len(dealt) > MAX_GROUPS:
        raise ValueError(f"deal.dealt holds {len(dealt)} groups' blocks, more than {MAX_GROUPS}")
    for blocks in dealt:
        for block in schema.array(blocks, "deal.dealt's blocks"):
            schema.integer(block, "a block")
    schema.integer(fields["first"], "deal.first")
    schema.integer(fields["replaced"], "deal.replaced")
    if fields["ended"] is not None:
        schema.integer(fields["ended"], "deal.ended")
    if fields["place"] is not None and schema.integer(fields["place"], "deal.place") >= len(dealt):
        raise ValueError(f"deal.place {fields['place']} is past the {len(dealt)} groups dealt to")
