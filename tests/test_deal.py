"""The data of fault-tolerant groups (``shardwire.training.deal``), dealt at their meetings: groups
that die, are dropped, come back behind or restart from checkpoints, played out with a stand-in for
torchft's quorum, and every block of an epoch's order trained once by a step the run keeps.
(``tests/faults/test_fault_tolerant_groups.py`` runs the same through ``shardwire train`` and torchft.)"""

from __future__ import annotations

import threading

import pytest
import torch

from shardwire.options import SettingError
from shardwire.training.data import ByteCorpus, epoch_starts
from shardwire.training.deal import Deal, schedule_of

BATCH, ACCUM = 2, 2  # sequences per micro-batch of a group, micro-batches per step: blocks of 4
DATA = {"name": "tok.bin", "tokens": 1_000, "sampled": "0123456789abcdef"}  # the corpus every group trains on


class Positions:
    """A corpus that reads out the positions it is asked for."""

    def windows(self, positions, seq_len, *, seed):
        return torch.tensor(positions)


class Meeting:
    """``OuterLoop``'s part: the steps done, a meeting every ``every`` steps, votes ``lag`` after."""

    def __init__(self, every: int, lag: int):
        self.steps, self.every, self.lag = 0, every, lag

    def next_meeting(self) -> int:
        return (self.steps // self.every + 1) * self.every

    def voted_after(self) -> int:
        return self.steps + self.lag


class Room:
    """One quorum: its groups give their values to ``agree`` and get the most of the participants'."""

    def __init__(self, size: int):
        self.barrier, self.given, self.lock = threading.Barrier(size), [], threading.Lock()


class Quorum:
    """torchft's part, as ``Deal`` sees it."""

    def __init__(self):
        self.meet, self.registered, self.failed = None, {}, False
        self.member, self.recovered, self.room = (0, 1), False, None

    def attend(self, meet):
        self.meet = meet

    def register(self, key, state, load):
        self.registered[key] = (state, load)

    def agree(self, values):
        if not self.recovered:
            with self.room.lock:
                self.room.given.append(values)
        self.room.barrier.wait()
        return [max(column) for column in zip(*self.room.given)]


class Group:
    def __init__(self, name: str, every: int = 3, lag: int = 0):
        self.name, self.meeting, self.quorum = name, Meeting(every, lag), Quorum()
        self.deal = Deal(self.quorum, self.meeting, Positions(), batch=BATCH, grad_accum=ACCUM, seq_len=8, seed=0,
                         schedule="--steps 40", data=DATA)
        self.steps: list[tuple[int, list[int]]] = []  # (step, blocks read) of each step trained

    def train(self, steps: int) -> None:
        for _ in range(steps):
            positions = [int(p) for micro in range(ACCUM) for p in self.deal.batch(micro, slice(0, BATCH))]
            assert positions[::ACCUM * BATCH] == [positions[0]] and positions[0] % (ACCUM * BATCH) == 0
            self.steps.append((self.meeting.steps, positions))
            self.meeting.steps += 1

    def blocks(self) -> list[int]:
        return [positions[0] // (ACCUM * BATCH) for _, positions in self.steps]


def meet(groups: list[Group], behind: tuple[Group, ...] = ()) -> None:
    """One quorum of ``groups``, in their order; those ``behind`` receive the first other's ledger,
    taken as the quorum forms, and its steps at the vote."""
    room = Room(len(groups))
    source = next(group for group in groups if group not in behind)
    ledger = source.quorum.registered["data"][0]()
    for place, group in enumerate(groups):
        group.quorum.member, group.quorum.recovered, group.quorum.room = (place, len(groups)), group in behind, room
    threads = [threading.Thread(target=group.quorum.meet) for group in groups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for group in behind:
        group.meeting.steps = source.meeting.steps
        group.quorum.registered["data"][1](ledger)


def test_a_lost_groups_blocks_are_dealt_again_and_a_group_back_behind_takes_its_share():
    a, b, c = Group("a"), Group("b"), Group("c")
    meet([a, b, c])
    for group in (a, b, c):
        group.train(3)
    meet([a, b, c])
    a.train(3), b.train(3)
    c.train(1)  # then killed: its step is lost with it
    lost = c.blocks()[-1:]
    meet([a, b])  # c is gone: the others take its three blocks first
    assert a.blocks()[-3:] + b.blocks()[-3:] == [9, 10, 11, 12, 13, 14]
    a.train(3), b.train(3)
    back = Group("c")  # restarted with nothing: behind at the next meeting
    meet([a, back, b], behind=(back,))
    for group in (a, back, b):
        group.train(3)
    meet([a, back, b])
    kept = a.blocks() + b.blocks() + c.blocks()[:-1] + back.blocks()
    assert sorted(kept) == list(range(len(kept)))  # each block once, none skipped
    assert lost[0] in kept and back.blocks() == [24, 25, 26]


def test_a_dropped_step_is_dealt_again_and_a_group_behind_is_dealt_from_the_vote_on():
    """Meeting at every step (fault-tolerant HSDP): the vote comes after the step."""
    a, b = Group("a", every=1, lag=1), Group("b", every=1, lag=1)
    meet([a, b])
    a.train(1), b.train(1)
    meet([a, b])
    dropped = [int(group.deal.batch(0, slice(0, 1))[0]) // 4 for group in (a, b)]
    assert dropped == [2, 3]  # read, then the vote drops the step: no step is counted, and it runs again
    meet([a, b])
    a.train(1), b.train(1)
    assert a.blocks()[-1:] + b.blocks()[-1:] == dropped
    late = Group("late", every=1, lag=1)
    meet([a, late, b], behind=(late,))  # its first step's contribution is nothing: its block is not kept
    unkept = late.deal.state()["dealt"][1]
    assert late.deal.batch(0, slice(0, BATCH)) is None
    a.train(1), b.train(1)
    late.meeting.steps += 1  # its step, with the others' state loaded at the vote
    meet([a, late, b])
    assert unkept == [5] and a.deal.state()["dealt"][0] == [5]  # the late group's, dealt again
    for group in (a, b, late):
        group.train(1)
    assert sorted(a.blocks() + b.blocks() + late.blocks()) == list(range(9))


def test_a_group_back_behind_at_a_sync_applied_later_keeps_only_its_steps_after_the_vote():
    """DiLoCo with fragment_sync_delay=2: a group behind at a meeting takes the others' state at the
    vote 2 steps on; its steps before it are replaced, so their blocks are dealt again. One that
    rejoins at its first step (``join``, voted at once) keeps every step."""
    a, b = Group("a", every=5, lag=2), Group("b", every=5, lag=2)
    meet([a, b])
    a.train(5), b.train(5)
    cut = Group("cut", every=5, lag=2)  # back from a cut: behind, its vote 2 steps after the meeting
    meet([a, cut, b], behind=(cut,))
    cut.meeting.steps += 2  # the two steps before its vote, trained on windows drawn at random
    assert cut.deal.batch(0, slice(0, BATCH)) is not None
    a.train(5), b.train(5), cut.train(3)
    meet([a, cut, b])
    assert sorted(a.blocks() + b.blocks() + cut.blocks()) == [*range(15), *range(17, 25)]
    assert a.deal.state()["dealt"][0][:2] == [15, 16]  # cut's first two, dealt again first
    for group in (a, cut, b):
        group.train(5)
    joined = Group("joined", every=5, lag=0)  # a restart meets at its first step, voted there
    meet([a, cut, b, joined], behind=(joined,))
    for group in (a, cut, b, joined):
        group.train(5)
    meet([a, cut, b, joined])
    trained = a.blocks() + b.blocks() + cut.blocks() + joined.blocks()
    assert sorted(trained) == list(range(len(trained))) and len(joined.blocks()) == 5


def test_a_failed_meeting_keeps_what_was_trained_before_it():
    a, b = Group("a", every=1, lag=1), Group("b", every=1, lag=1)
    meet([a, b])
    a.train(1), b.train(1)
    for group in (a, b):  # the next meeting fails: the vote drops its step, which runs again
        group.quorum.failed = True
    meet([a, b])
    assert a.deal.batch(0, slice(0, BATCH)) is None
    for group in (a, b):
        group.quorum.failed = False
    meet([a, b])
    a.train(1), b.train(1)
    assert sorted(a.blocks() + b.blocks()) == [0, 1, 2, 3]  # blocks 0 and 1, kept, are not dealt again


def test_groups_restarted_from_checkpoints_of_one_step_deal_as_they_would_have(tmp_path):
    a, b = Group("a"), Group("b")
    meet([a, b])
    a.train(3), b.train(3)
    saved = [group.deal.state() for group in (a, b)]
    meet([a, b])
    a.train(3), b.train(3)
    fresh = [Group("a"), Group("b")]
    for group, state in zip(fresh, saved):
        group.deal.load_state(state)
        group.meeting.steps = 3
    meet(fresh)
    for group in fresh:
        group.train(3)
    assert [g.blocks()[-3:] for g in fresh] == [g.blocks()[-3:] for g in (a, b)]


def _meet_with_errors(a: Group, b: Group) -> list[str]:
    """What each of two groups meeting once raised."""
    errors = []

    def meeting(group):
        try:
            group.quorum.meet()
        except SettingError as err:
            errors.append(str(err))

    room = Room(2)
    for place, group in enumerate((a, b)):
        group.quorum.member, group.quorum.room = (place, 2), room
    threads = [threading.Thread(target=meeting, args=(group,)) for group in (a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_groups_that_take_other_batches_are_told_to_give_the_same():
    a, b = Group("a"), Group("b")
    b.deal = Deal(b.quorum, b.meeting, Positions(), batch=BATCH + 1, grad_accum=ACCUM, seq_len=8, seed=0,
                  schedule="--steps 40", data=DATA)
    errors = _meet_with_errors(a, b)
    assert sorted(errors) == [f"the fault-tolerant groups that met take from 4 to 6 sequences a step, this one {mine}: "
                              f"give every group as many ranks and the same --batch and --grad-accum"
                              for mine in (4, 6)]


@pytest.mark.parametrize("training, schedules", [
    (None, ("--steps 40 --eval-every 0", "--steps 60 --eval-every 0")),
    (None, ("--steps 40 --eval-every 10", "--steps 40 --eval-every 0")),
    ("--lr 0.003", ("--steps 40", "--steps 60"))])
def test_groups_given_another_schedule_are_both_refused(training, schedules):
    """A group given fewer steps would end at a sync of the others' after more steps, taking their
    model without its own last steps; one given more would train on alone. Under DiLoCo (no
    ``training``), one evaluating at other steps would save checkpoints holding other syncs."""
    a, b = Group("a"), Group("b")
    for group, given in zip((a, b), schedules):
        group.deal = Deal(group.quorum, group.meeting, Positions(), batch=BATCH, grad_accum=ACCUM, seq_len=8, seed=0,
                          schedule=given, data=DATA, training=training)
    errors = _meet_with_errors(a, b)
    assert sorted(errors) == sorted(f"other fault-tolerant groups were given another schedule than this one's "
                                    f"({given}): give every group the same" for given in schedules)


def test_the_schedule_compared_holds_eval_every_only_where_groups_sync_every_few_steps():
    """An evaluation takes the sync due at its step under DiLoCo; groups meeting at every step hold
    no sync apart from their steps."""
    assert schedule_of(40, 10, diloco=True) == "--steps 40 --eval-every 10"
    assert schedule_of(40, 10, diloco=False) == "--steps 40"


def test_groups_on_other_data_are_both_refused():
    """Blocks are dealt by position: groups on other data would each read their own under one deal."""
    a, b = Group("a"), Group("b")
    for group, tokens in ((a, 200_000), (b, 300_000)):
        group.deal = Deal(group.quorum, group.meeting, Positions(), batch=BATCH, grad_accum=ACCUM, seq_len=8, seed=0,
                          schedule="--steps 40", data={**DATA, "tokens": tokens})
    errors = _meet_with_errors(a, b)
    assert sorted(errors) == [f"other fault-tolerant groups train on other data than this one's (tok.bin, {tokens} "
                              f"tokens, fingerprint 0123456789abcdef): give every group the same --data and --tokenizer"
                              for tokens in ("200,000", "300,000")]
    a, b = Group("a"), Group("b")  # of one length, other contents
    for group, sampled in ((a, "0000000000000000"), (b, "1111111111111111")):
        group.deal = Deal(group.quorum, group.meeting, Positions(), batch=BATCH, grad_accum=ACCUM, seq_len=8, seed=0,
                          schedule="--steps 40", data={**DATA, "sampled": sampled})
    assert len(_meet_with_errors(a, b)) == 2


@pytest.mark.parametrize("seq_len, seed", [(16, 0), (8, 7)])
def test_groups_that_cut_the_data_otherwise_are_both_refused(seq_len, seed):
    """A position is a sequence only with the same --seq-len, and an epoch's order is the seed's."""
    a, b = Group("a"), Group("b")
    b.deal = Deal(b.quorum, b.meeting, Positions(), batch=BATCH, grad_accum=ACCUM, seq_len=seq_len, seed=seed,
                  schedule="--steps 40", data=DATA)
    errors = _meet_with_errors(a, b)
    assert sorted(errors) == sorted(f"other fault-tolerant groups cut the data into other sequences than this one's "
                                    f"(--seq-len {length}, --seed {number}): give every group the same"
                                    for length, number in ((8, 0), (seq_len, seed)))


def test_groups_averaging_gradients_that_would_step_otherwise_are_told_to_give_the_same():
    """Each group steps its own optimizer with the average: another rate would part their models."""
    a, b = Group("a"), Group("b")
    for group, lr in ((a, "0.003"), (b, "0.01")):
        group.deal = Deal(group.quorum, group.meeting, Positions(), batch=BATCH, grad_accum=ACCUM, seq_len=8, seed=0,
                          schedule="--steps 40", data=DATA, training=f"--lr {lr}")
    errors = _meet_with_errors(a, b)
    assert sorted(errors) == [f"other fault-tolerant groups step with other settings than this one's (--lr {lr}), or "
                              f"sync every few steps (diloco), so that their models, averaging gradients, would part: "
                              f"give every group the same, and the same diloco or none"
                              for lr in ("0.003", "0.01")]


def test_groups_that_sync_every_few_steps_and_groups_that_meet_at_every_step_are_both_refused():
    """At every meeting, not only the job's first: groups resumed from checkpoints never meet at the
    first, and the group that sees no difference would wait for the other for ever."""
    a, b = Group("a"), Group("b")
    b.deal = Deal(b.quorum, b.meeting, Positions(), batch=BATCH, grad_accum=ACCUM, seq_len=8, seed=0,
                  schedule="--steps 40",
                  data=DATA, training="--lr 0.003")
    errors = _meet_with_errors(a, b)
    assert sorted(errors) == [
        "other fault-tolerant groups average their gradients at every step, where this one syncs every few steps "
        "(diloco): give every group the same diloco, or none",
        "other fault-tolerant groups step with other settings than this one's (--lr 0.003), or sync every few steps "
        "(diloco), so that their models, averaging gradients, would part: give every group the same, and the same "
        "diloco or none"]


@pytest.mark.parametrize("state", [{"next": -1}, {"next": 3, "first": 0, "returned": [], "dealt": [[0]], "member": 4},
                                   "a list", {"next": 3, "first": 0, "returned": ["x"], "dealt": [], "member": None}])
def test_a_checkpoints_deal_not_shaped_as_one_saved_is_refused(state):
    with pytest.raises(ValueError, match="not one shardwire train saved"):
        Group("a").deal.load_state(state)


def test_an_epoch_is_every_sequence_of_the_split_once_in_an_order_of_the_seed():
    corpus = ByteCorpus(bytes(range(256)) * 40, "bytes", 16)
    length = len(corpus.splits["train"])
    count = (length - 1) // 16
    first, second = (epoch_starts(list(range(epoch * count, (epoch + 1) * count)), length, 16, seed=1)
                     for epoch in (0, 1))
    assert sorted(first) == sorted(second) == list(range(0, count * 16, 16)) and first != second
    assert first != epoch_starts(list(range(count)), length, 16, seed=2)
    windows = corpus.windows([0, count], 16, seed=1)
    assert windows.shape == (2, 17) and torch.equal(windows[0], corpus.splits["train"][first[0]:first[0] + 17].long())


@pytest.mark.parametrize("count", [1, 2, 3, 1000, 4097])
def test_every_count_of_sequences_is_permuted_whole(count):
    """The Feistel network's cycle-walk lands on every sequence once, at any count."""
    assert sorted(epoch_starts(list(range(count)), count * 8 + 1, 8, seed=5)) == list(range(0, count * 8, 8))
