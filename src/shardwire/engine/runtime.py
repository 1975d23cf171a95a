"""The runtime of a sharded model: gathers, prefetches and gradient reductions around each step.

One ``Engine`` lives on each sharded model and is driven entirely by module and autograd hooks,
which move its ``TrainingState`` through a step: idle, forward, awaiting backward, backward, idle.

forward   root pre-forward checks that every parameter is still the engine's
          (``FlatParam.check_parameters``), gathers the root unit and opens a forward ``Pass``, which
          issues the first prefetches; each unit's pre-forward enters the pass (sliding the window),
          waits for its own gather, copies it out into parameter order and exposes its parameters;
          its post-forward hooks the unit's outputs so that backward can announce it and, by the
          rule below, releases its parameters
          (``reshard_after_forward``; under ``hybrid_secondary`` keeping this rank's secondary shard
          for backward to gather from), except the units the backward pass gathers as it opens (the
          first ``max(1, prefetch)`` of the recorded backward order): they stay gathered and the
          step saves their gathers, at no cost in peak memory, since the backward's opening, with
          every activation still alive, holds them anyway (torchtitan keeps the last block
          gathered, and FSDP2 the root).
backward  root post-forward already opened the backward ``Pass`` and issued its first prefetches. A
          unit's outputs receiving their gradient means its backward is next: enter the pass, wait
          for its gather. Its parameters' gradients being complete means its backward is over: copy
          them in rank by rank and start the reduce-scatter asynchronously (under ``hybrid``,
          followed by the all-reduce between groups), release the parameters, and with more than
          ``REDUCTIONS_IN_FLIGHT`` in flight wait for the oldest reduce-scatter (``_scatter_oldest``).
          A callback queued on the autograd engine lands the last reductions when backward ends and
          releases every unit still gathered. Outputs announce each backward that reaches them, so a
          second backward through a retained graph runs the same way, once what nothing announces
          is gathered again (``_open_backward_again``).
sync      under ``hybrid`` with ``diloco``, the end of a backward that reduced gradients is an inner
          step, and the root pre-forward of the next training forward (one that records gradients;
          an evaluation between steps leaves them be), before its first gather, applies and issues
          the syncs between groups that are due (``shardwire.engine.outer``). Fault-tolerant groups
          without DiLoCo meet at every step instead (``shardwire.engine.step_quorum``): the first
          training forward of a step forms its quorum, the end of its backward takes the vote.

Units and models may return anything. Torch's pytree walks the outputs (tuples, lists, dicts,
namedtuples, registered types such as Hugging Face's ``ModelOutput``, each of which says all it holds);
any other object (a dataclass, whose attributes need not be its fields; a key/value cache) is a leaf
the engine cannot look into, which may hide tensors that get gradients. Correctness never depends on
finding them, because outputs only announce where a unit's backward starts. Where it ends is told by
what autograd computes whichever output the gradient came through: its parameters' gradients being
complete (and, for a unit with frozen parameters, its inputs' gradients: ``_BackwardThroughInputs``);
the callback at the end of backward releases whatever is left. So, after a unit's forward:

- if no output can get a gradient (grad is disabled, or every leaf is seen and none needs one), no
  backward will come: the unit is released at once;
- if every output is seen, its tensors that need a gradient announce the backward, so under
  ``reshard_after_forward`` the unit is released now and gathered again when announced;
- if some output is hidden, the unit's backward may start before anything seen announces it, and would
  meet released parameters: the unit stays gathered until its backward is over (or backward ends).
  What is seen still announces it, for the prefetch order.

The model's outputs follow the same rule: a hidden one keeps the step open for a backward that makes
itself known at the first unit it reaches (or is discarded by the next forward).

Everything the order of collectives depends on is the same on every rank as long as every rank runs
the same units in the same order. The passes that record the order check that, with one tiny
all-gather before each collective they issue, and raise an error naming the units if ranks differ;
every forward starts with each communicator of the layout comparing the collectives each rank
issued on it since the last comparison, and the weights it loaded (``Communicator.verify_order``: 8
bytes, no host sync), so a rank that leaves the order later, or loaded weights the others did not,
is caught too; a state dict and a checkpoint compare the same first, waiting for it.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections import deque
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import nn
from torch.autograd import Variable
from torch.profiler import record_function
from torch.utils import _pytree as pytree

from shardwire.comm.communicator import OnIssue, Pending
from shardwire.comm.errors import SAME_SCHEDULE, ScheduleMismatchError
from shardwire.comm.records import CommRecord
from shardwire.engine import guards, released
from shardwire.engine.accumulation import AccumulationCheck
from shardwire.engine.flat_param import FlatParam
from shardwire.engine.layout import Layout
from shardwire.engine.limits import REDUCTIONS_IN_FLIGHT
from shardwire.engine.outer import OuterLoop
from shardwire.engine.step_quorum import StepQuorum
from shardwire.engine.schedule import Pass
from shardwire.engine.unit import INPUTS, Unit

_CHECK_CODES = {"forward": 0, "backward": 1, "reduce": 2}


class TrainingState(enum.Enum):
    """Where the engine is in a step (as FSDP2's ``TrainingState``), set by the hooks that move it
    on and checked by those that need it: a hook that finds another state than its own is a model
    used out of order (a unit called on its own), or a step that did not finish (the next forward
    discards it)."""

    IDLE = "idle"  # between steps
    FORWARD = "forward"  # between the root's pre- and post-forward
    AWAITING_BACKWARD = "awaiting backward"  # forward done; its outputs may yet get gradients
    BACKWARD = "backward"  # in autograd's backward, the callback that ends it queued

Listener = Callable[[str, "str | None", str], None]
# A reduction in flight: the flat buffer, its collectives (FlatParam.reduce) and the share they fill.
Reduction = tuple[FlatParam, list[Pending], torch.Tensor]


# Leaves that cannot hold a tensor: outputs made of these and tensors hide nothing from backward.
_PLAIN_VALUES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


class _Outputs(NamedTuple):
    """What a forward's outputs tell about its backward (the rule in the module's docstring)."""

    needing_grad: list[torch.Tensor]  # the tensors torch's pytree finds that autograd will send gradients to
    hidden: bool  # some leaf is an object pytree cannot look into, which may hold more of them

    @classmethod
    def of(cls, output) -> _Outputs:
        if not torch.is_grad_enabled():
            return cls([], False)  # autograd recorded nothing: no gradient can come
        needing_grad, hidden = [], False
        for leaf in pytree.tree_leaves(output):
            if isinstance(leaf, torch.Tensor):
                if leaf.requires_grad:
                    needing_grad.append(leaf)
            elif not isinstance(leaf, _PLAIN_VALUES):
                hidden = True
        return cls(needing_grad, hidden)

    @property
    def may_get_grad(self) -> bool:
        return bool(self.needing_grad) or self.hidden


class Engine:
    def __init__(
        self,
        root: Unit,
        units: list[Unit],
        *,
        layout: Layout,
        prefetch: int,
        reshard_after_forward: bool,
        input_dtype: torch.dtype | None,
        state_dict_keys: list[str],
    ):
        self.root = root
        self.units = units
        self.layout = layout
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self.input_dtype = input_dtype  # floating-point forward inputs are cast to it
        self.state_dict_keys = state_dict_keys  # the unsharded model's, as names (selection.state_dict_names)
        self.sync_gradients = True
        self._all_units = [root, *units]
        # sync every H steps across groups: the outer optimisation's schedule (None: synchronous)
        self.outer = None if layout.diloco is None else OuterLoop(
            [unit.flats for unit in self._all_units], layout.diloco, layout.world, layout.replicate, layout.quorum)
        # fault-tolerant groups reducing gradients between them at every step: the step's quorum and vote
        self.step_quorum = (StepQuorum(self.flats, layout.quorum, layout.world)
                            if layout.quorum is not None and layout.diloco is None else None)
        # where the groups meet at steps, each backward outside no_sync is one: micro-batches accumulated
        # outside it are said
        meeting = self.outer if self.outer is not None else self.step_quorum
        trained = next((flat for flat in self.flats if flat.requires_grad), None)
        self._accumulation = (AccumulationCheck(trained, meeting.accumulated, says=layout.world.rank == 0)
                              if meeting is not None and trained is not None else None)
        self._order: dict[str, list[Unit] | None] = {"forward": None, "backward": None}
        self._forward: Pass | None = None
        self._backward: Pass | None = None
        self._unannounced: list[Unit] = []  # this forward's units with hidden outputs, gathered until backward
        # reductions in flight, oldest first: those whose reduce-scatter may still hold a unit's whole
        # gradient, and (hybrid) those past it whose all-reduce between groups holds only a share
        self._reductions: deque[Reduction] = deque()
        self._replicating: deque[Reduction] = deque()
        self.state = TrainingState.IDLE
        self._generation = 0  # forwards so far: backward must come from the latest one
        self.checkpointing = None  # the checkpoint package's session (checkpoint.session): saves in flight, claims
        self._listeners: list[Listener] = []

    def __deepcopy__(self, memo):  # reached through the model's hooks, before any placeholder
        released.refuse_copy(self.root.name)

    @property
    def comm(self):
        """The communicator of every rank of the job (set-up, agreement checks, checkpoints)."""
        return self.layout.world

    @property
    def group(self):
        return self.comm.group

    @property
    def device(self) -> torch.device:
        return self.comm.device

    @property
    def flats(self) -> list[FlatParam]:
        return [flat for unit in self._all_units for flat in unit.flats]

    def weights_loaded(self) -> None:
        """Weights written into the model from outside training (``load_state_dict``,
        ``import_state_dict``, a pretrained model's files): under DiLoCo the outer optimisation
        starts afresh from them, or its first sync would pull every group back toward the weights
        the model was built with. Every rank must load alike: the next forward compares that they
        did (``Communicator.note``)."""
        for comm in self.layout.checked_every_step:
            comm.note("weights loaded")
        if self.outer is not None:
            self.outer.restart()

    def compare_ranks(self, since: str, *, now: bool = False) -> None:
        """Compare across ranks what each did ``since`` (the collectives it issued, the weights it
        loaded), before what reads the model's values: a forward, or, waiting for the comparison
        (``now``), a checkpoint, which would otherwise be written before a difference is told."""
        for comm in self.layout.checked_every_step:
            comm.verify_order(since, now=now)

    def install_hooks(self) -> None:
        self.root.module.register_forward_pre_hook(self._root_pre_forward, prepend=True, with_kwargs=True)
        self.root.module.register_forward_hook(self._root_post_forward)
        for unit in self.units:
            unit.module.register_forward_pre_hook(
                functools.partial(self._pre_forward, unit), prepend=True, with_kwargs=True
            )
            unit.module.register_forward_hook(functools.partial(self._post_forward, unit))

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(phase, unit, edge)`` at each edge of the model's and the units' forward
        and backward: ``phase`` is "forward", "backward" or "clip", ``unit`` a unit's name or None
        for the whole model, ``edge`` "start" or "end". A unit's edges enclose its computation, not
        the wait for its parameters. Phase "copy" encloses each copy of a unit's gathered parameters
        into the buffer its modules view, and of a flat buffer's gradient into the order its
        reduce-scatter takes (``unit``: the unit's or the buffer's name). Listeners run on the
        training thread in the hot path: keep them to a timestamp or a CUDA event."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        self._listeners.remove(listener)

    def emit(self, phase: str, unit: str | None, edge: str) -> None:
        for listener in self._listeners:
            listener(phase, unit, edge)

    @contextlib.contextmanager
    def record(self, on_issue: OnIssue | None = None) -> Iterator[list[CommRecord]]:
        """``Communicator.record`` over every communicator of the layout: the records of all the
        collectives issued inside the block, in the order they were issued."""
        records: list[CommRecord] = []

        def issued(record: CommRecord) -> None:
            records.append(record)
            if on_issue is not None:
                on_issue(record)

        with contextlib.ExitStack() as stack:
            for comm in self.layout.communicators:
                stack.enter_context(comm.record(issued))
            yield records

    # ----------------------------------------------------------------------------------- forward

    def _root_pre_forward(self, module: nn.Module, args, kwargs):
        if torch.is_inference_mode_enabled():
            # its gathers would make inference tensors of buffers every later step writes into
            raise RuntimeError("a sharded model does not run under torch.inference_mode(): evaluate it under "
                               "torch.no_grad(), which gathers and frees its parameters the same way")
        if self.state is not TrainingState.IDLE:
            self._discard_unfinished_step()
        self._generation += 1
        self._unannounced = []
        self.emit("forward", None, "start")
        recording = self._order["forward"] is None
        with record_function("shardwire::pre_forward(<root>)"):
            self.compare_ranks("the step before this forward")
            if torch.is_grad_enabled():  # a training forward (not an evaluation)
                for meeting in (self.outer, self.step_quorum):
                    if meeting is not None:
                        meeting.before_forward()
            for flat in self.flats:
                flat.check_parameters()
            guards.refuse_unsharded_parameters(module)
            self._gather(self.root, "forward", check=recording)
            self._forward = Pass(self._order["forward"], self.prefetch, Unit.gather)
            self.state = TrainingState.FORWARD
            self._ready(self.root)
            self.root.show(self._grad_hook())
        if self.input_dtype is None:
            return None
        # every floating-point tensor in them, in any structure pytree walks
        cast = functools.partial(_cast_float, dtype=self.input_dtype)
        return pytree.tree_map_only(torch.Tensor, cast, (args, kwargs))

    def _pre_forward(self, unit: Unit, module: nn.Module, args, kwargs):
        forward = self._forward
        if self._in_recomputation():
            if self._recomputes(unit):
                return None
            raise RuntimeError(
                f"unit {unit.name!r} was run again in backward before backward reached it, as torch's "
                f"checkpoint recomputes a region holding more than the unit, or a reentrant one "
                f"(use_reentrant=True) a forward it ran without gradients: checkpoint each unit alone with "
                f"use_reentrant=False, or give shardwire.shard activation_checkpointing=True"
            )
        if self.state is not TrainingState.FORWARD:
            raise RuntimeError(
                f"unit {unit.name!r} was called outside the sharded model's forward: call the model "
                f"(the module passed to shardwire.shard), not its units on their own"
            )
        with record_function(f"shardwire::pre_forward({unit.name})"):
            forward.enter(unit)
            self._gather(unit, "forward", check=forward.recording)
            self._ready(unit)
            unit.show(self._grad_hook())
            routed = None
            if unit.has_frozen and torch.is_grad_enabled():
                routed = self._announce_backward_through_inputs(unit, (args, kwargs))
        self.emit("forward", unit.name, "start")
        return routed

    def _announce_backward_through_inputs(self, unit: Unit, inputs):
        """Route the unit's forward inputs that need a gradient through an identity whose backward
        reports ``INPUTS`` to the unit: it runs once backward has passed through all of the unit."""
        leaves, spec = pytree.tree_flatten(inputs)
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        if not positions:
            return None
        unit.await_inputs()
        done = functools.partial(self._inputs_done, self._generation, unit)
        routed = _BackwardThroughInputs.apply(done, *(leaves[i] for i in positions))
        for i, tensor in zip(positions, routed):
            leaves[i] = tensor
        return pytree.tree_unflatten(leaves, spec)

    def _in_recomputation(self) -> bool:
        """Whether a unit called now is called by autograd in this step's backward: torch's activation
        checkpointing recomputing its forward (``torch.utils.checkpoint`` or ``checkpoint_wrapper``
        around it, as FSDP2 scripts apply it)."""
        return self.state is TrainingState.BACKWARD and torch._C._current_graph_task_id() != -1

    def _recomputes(self, unit: Unit) -> bool:
        """Whether this call of ``unit`` is a recomputation it can run as it is, its hooks doing
        nothing: the unit's backward has gathered and shown its parameters, the views its forward
        used."""
        return (self._in_recomputation() and self._backward is not None and unit in self._backward.seen
                and unit.is_gathered)

    def _post_forward(self, unit: Unit, module: nn.Module, args, output):
        if self._recomputes(unit):  # asked again, not remembered: a recomputation may stop early, raising
            return output
        self.emit("forward", unit.name, "end")
        outputs = _Outputs.of(output)
        _on_each_backward(outputs.needing_grad, functools.partial(self._pre_backward, self._generation, unit))
        if not outputs.may_get_grad:
            unit.free()  # no backward will come
        elif self.reshard_after_forward and not outputs.hidden and not self._backward_opens_with(unit):
            unit.keep_secondary()
            unit.free()  # gathered again when its outputs announce its backward
        # otherwise it stays gathered until its backward is over
        if outputs.hidden:
            self._unannounced.append(unit)
        return output

    def _root_post_forward(self, module: nn.Module, args, output):
        forward, self._forward = self._forward, None
        if forward.changed_order():
            self._order["forward"] = forward.seen
        ran = set(forward.seen)
        for unit in self.units:
            if unit not in ran:
                unit.free()  # prefetched for an order this pass did not follow
        outputs = _Outputs.of(output)
        if outputs.may_get_grad:
            self._open_backward()
            self.state = TrainingState.AWAITING_BACKWARD
            # backward starts when the outputs get gradients (through hidden ones: at the first unit reached)
            _on_each_backward(outputs.needing_grad, functools.partial(self._enter_backward, self._generation))
        else:
            self.state = TrainingState.IDLE
            self._release_all()
        self.emit("forward", None, "end")
        return output

    # ---------------------------------------------------------------------------------- backward

    def _grad_hook(self):
        """What a unit's parameters report their complete gradients to in this forward, if any."""
        if not torch.is_grad_enabled():
            return None
        return functools.partial(self._on_grad, self._generation)

    def _enter_backward(self, generation: int) -> Pass:
        if generation != self._generation:
            raise RuntimeError(
                "backward reached a forward of this sharded model that a later forward replaced: shardwire "
                "runs each backward before the next forward (call backward first, or put the batches "
                "through one forward)"
            )
        if self.state is not TrainingState.BACKWARD:
            if self._accumulation is not None and self.sync_gradients:
                self._accumulation.backward_starts()
            Variable._execution_engine.queue_callback(self._finish_backward)
            self.state = TrainingState.BACKWARD
            self.emit("backward", None, "start")
        if self._backward is None:
            self._open_backward_again()
        return self._backward

    def _open_backward(self) -> None:
        """Start a backward pass along the recorded order, each unit awaiting all its gradients."""
        self._backward = Pass(self._order["backward"], self.prefetch, _gather_for_backward)
        for unit in self._all_units:
            unit.expect_backward()

    def _open_backward_again(self) -> None:
        """Open a backward that the forward did not open: above all another one through a graph an
        earlier backward kept (``loss.backward(retain_graph=True)``). It trains as autograd does for an
        unsharded model, its gradients added to the earlier one's, because nothing of a unit's backward
        depends on being the first: its outputs announce it again, its parameters are gathered again
        from the shard, and its complete gradients are reduced and added to ``.grad``. What the earlier
        backward found gathered must be gathered again before autograd reaches it, since nothing
        announces it: the root unit, whose computation (a model's head) backward reaches first, and the
        units whose outputs are hidden."""
        self._open_backward()
        for unit in (self.root, *self._unannounced):
            self._gather(unit, "backward", check=self._backward.recording)
            self._ready(unit)
            unit.reveal()

    def _pre_backward(self, generation: int, unit: Unit) -> None:
        backward = self._enter_backward(generation)
        with record_function(f"shardwire::pre_backward({unit.name})"):
            backward.enter(unit)
            self._gather(unit, "backward", check=backward.recording)
            self._ready(unit)
            unit.reveal()
        self.emit("backward", unit.name, "start")

    def _on_grad(self, generation: int, unit: Unit, flat: FlatParam, grads: tuple[torch.Tensor, ...]) -> None:
        backward = self._enter_backward(generation)
        with record_function(f"shardwire::post_backward({flat.name})"):
            if self.sync_gradients:
                if backward.recording:
                    self._check_agreement("reduce", unit)
                copying = functools.partial(self._span, "copy", flat.name)
                self._reductions.append((flat, *flat.reduce(grads, copying)))
                while len(self._reductions) > REDUCTIONS_IN_FLIGHT:
                    self._scatter_oldest()
            else:
                flat.accumulate(grads)
        self._arrived(unit, flat)

    def _inputs_done(self, generation: int, unit: Unit) -> None:
        self._enter_backward(generation)
        self._arrived(unit, INPUTS)

    def _arrived(self, unit: Unit, signal) -> None:
        if unit.arrived(signal):
            self.emit("backward", unit.name, "end")
            unit.free()

    def _finish_backward(self) -> None:
        """The end of backward: land the reductions in flight and release every unit still gathered (one
        that backward did not reach, or a frozen one kept gathered whose inputs need no gradient). No
        gradient is left to reduce here: each was reduced when autograd completed it."""
        self.state = TrainingState.IDLE
        backward, self._backward = self._backward, None
        if backward is not None and backward.changed_order():
            self._order["backward"] = backward.seen
        with record_function("shardwire::finish_backward"):
            for reductions in (self._replicating, self._reductions):
                while reductions:
                    flat, pendings, share = reductions.popleft()
                    flat.land(pendings, share)
            for comm in self.layout.reducing:
                comm.join()
        if self.sync_gradients:
            for meeting in (self.outer, self.step_quorum):
                if meeting is not None:
                    meeting.step_done()
            if self._accumulation is not None:
                self._accumulation.backward_done()
        self._release_all()
        self.emit("backward", None, "end")

    # ----------------------------------------------------------------------------------- helpers

    def _ready(self, unit: Unit) -> None:
        """Wait for ``unit``'s gathers and copy them out for its modules (the profiler's ``copy``)."""
        unit.wait()
        unit.copy_out(functools.partial(self._span, "copy", unit.name))

    @contextlib.contextmanager
    def _span(self, phase: str, unit: str) -> Iterator[None]:
        """The listeners' edges of ``phase`` of ``unit`` around the block."""
        self.emit(phase, unit, "start")
        try:
            yield
        finally:
            self.emit(phase, unit, "end")

    def _gather(self, unit: Unit, phase: str, *, check: bool) -> None:
        if not unit.is_gathered:
            if check:
                self._check_agreement(phase, unit)
            unit.gather(backward=phase == "backward")

    def _scatter_oldest(self) -> None:
        """Wait for the oldest reduce-scatter, which bounds the unit gradients held in flight. A
        reduction that goes on to an all-reduce between groups (``hybrid``) holds only this rank's
        share from there, so it stays in flight, however slow the link between groups, and lands
        at the end of backward."""
        reduction = self._reductions.popleft()
        flat, pendings, share = reduction
        if len(pendings) == 1:
            flat.land(pendings, share)
        else:
            pendings[0].wait()
            self._replicating.append(reduction)

    def _discard_unfinished_step(self) -> None:
        """Forget a step that did not finish: a forward or backward that raised, or a forward whose
        backward never ran (an evaluation with grad enabled). Its reductions are waited for, since
        every rank issued them, but not added to any gradient."""
        self._forward = self._backward = None
        self.state = TrainingState.IDLE
        try:
            for reductions in (self._replicating, self._reductions):
                while reductions:
                    _, pendings, _ = reductions.popleft()
                    for pending in pendings:
                        pending.wait()
        finally:
            self._replicating.clear()
            self._reductions.clear()
            self._release_all()

    def _backward_opens_with(self, unit: Unit) -> bool:
        """``unit`` is one the backward pass gathers as it opens: one of the first ``max(1,
        prefetch)`` of the recorded backward order (False until a backward has recorded it)."""
        opening = (self._order["backward"] or [])[: max(1, self.prefetch)]
        return any(unit is first for first in opening)

    def _release_all(self) -> None:
        for unit in self._all_units:
            unit.free()
            unit.drop_secondary()

    def _check_agreement(self, phase: str, unit: Unit) -> None:
        """Before a collective of a recording pass: make sure every rank is about to run the same one."""
        if self.comm.world == 1:
            return
        # one tag for every check, so that what differs is compared, and named, here
        rows = [tuple(row) for row in self.comm.all_gather_values(
            [_CHECK_CODES[phase], unit.index], tag="unit order check")]
        if len(set(rows)) > 1:
            phases = {code: name for name, code in _CHECK_CODES.items()}
            plan = "; ".join(
                f"rank {r} would {phases[code]} {self._all_units[index].name!r}"
                for r, (code, index) in enumerate(rows)
            )
            raise ScheduleMismatchError(
                f"ranks disagree on the next unit: {plan}. {SAME_SCHEDULE}"
            )


class _BackwardThroughInputs(torch.autograd.Function):
    """The identity on tensors; its backward calls ``done()`` when their gradients are complete."""

    @staticmethod
    def forward(ctx, done, *tensors):
        ctx.done = done
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.done()
        return (None, *grads)


def _gather_for_backward(unit: Unit) -> None:
    unit.gather(backward=True)


def _cast_float(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _on_each_backward(tensors: list[torch.Tensor], fn: Callable[[], None]) -> None:
    """Call ``fn()`` in each backward that reaches any of ``tensors``, once however many it reaches:
    once per backward rather than once per forward, so that a second backward through a retained
    graph is announced too."""
    if tensors:
        torch.autograd.graph.register_multi_grad_hook(tensors, lambda grad: fn(), mode="any")
