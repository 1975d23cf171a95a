"""A unit: modules whose parameters are gathered, used and released together.

Typically a unit is one transformer block; everything outside every unit forms the root unit. A unit
holds one ``FlatParam`` per (dtype, requires_grad) group of its parameters, which in a usual model
means exactly one, so gathering a unit is one all-gather and reducing it one reduce-scatter.

A unit's backward is over, and its parameters can be released, once every trainable buffer's flat
gradient is complete: every use of a trainable view feeds that gradient. Frozen views feed none, so a
unit with frozen parameters also waits for the gradient of its forward inputs, which autograd
computes only after every path through the unit (``INPUTS``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardwire.comm.communicator import Pending
from shardwire.engine.flat_param import FlatParam, Span


# The signal, besides its trainable buffers' gradients, that a unit with frozen parameters awaits.
INPUTS = "inputs"


class Unit:
    def __init__(self, index: int, name: str, module: nn.Module, flats: list[FlatParam]):
        self.index = index
        self.name = name
        self.module = module
        self.flats = flats
        self.has_frozen = any(not flat.requires_grad for flat in flats)
        self._in_flight: list[Pending] = []
        self._allocated = False
        self._signals: set[FlatParam | str] = set()  # what the backward of the last forward sends
        self._awaiting: set[FlatParam | str] = set()  # of those, what the backward running has not sent yet

    @property
    def is_gathered(self) -> bool:
        """The full parameters are allocated: being gathered, or ready."""
        return self._allocated

    def gather(self, *, backward: bool = False) -> None:
        """Start gathering (no-op if already gathered or being gathered); for ``backward``, from the
        secondary shards where forward kept them."""
        if not self._allocated:
            self._in_flight = [flat.gather(backward=backward) for flat in self.flats]
            self._allocated = True

    def wait(self) -> None:
        """Block until this unit's gathers have landed (CPU) / order compute after them (CUDA)."""
        in_flight, self._in_flight = self._in_flight, []
        for pending in in_flight:
            pending.wait()

    def copy_out(self, copying: Span) -> None:
        """After ``wait``: copy each gather that arrived out of the gathered buffer into the one the
        modules view (``FlatParam.copy_out``), inside ``copying``; nothing where none needs it."""
        waiting = [flat for flat in self.flats if flat.needs_copy_out]
        if waiting:
            with copying():
                for flat in waiting:
                    flat.copy_out()

    def keep_secondary(self) -> None:
        """After forward, keep what backward gathers from under ``hybrid_secondary``."""
        for flat in self.flats:
            flat.keep_secondary()

    def drop_secondary(self) -> None:
        for flat in self.flats:
            flat.drop_secondary()

    def free(self) -> None:
        """Release the gathered parameters (after any gather still writing into them)."""
        if self._allocated:
            self.wait()
            for flat in self.flats:
                flat.free()
            self._allocated = False

    def show(self, on_grad: Callable[["Unit", FlatParam, tuple[torch.Tensor, ...]], None] | None) -> None:
        """Expose the gathered parameters to the modules; with ``on_grad``, as views whose completed
        gradients are reported as ``on_grad(unit, flat, grads)``."""
        self._signals = set()
        for flat in self.flats:
            if on_grad is not None and flat.requires_grad:
                self._signals.add(flat)
                flat.show(lambda grads, flat=flat: on_grad(self, flat, grads))
            else:
                flat.show(None)

    def reveal(self) -> None:
        """Expose the parameters of the last ``show`` again, after they were gathered anew."""
        for flat in self.flats:
            flat.reveal()

    def await_inputs(self) -> None:
        """Make the end of backward through the unit's forward inputs (``INPUTS``) a condition of
        its release too."""
        self._signals.add(INPUTS)

    def expect_backward(self) -> None:
        """A backward starts: await every signal of the last forward (each backward through its graph,
        a second one through a retained graph too, sends them all again)."""
        self._awaiting = set(self._signals)

    def arrived(self, signal: FlatParam | str) -> bool:
        """Note that ``signal`` (a buffer whose gradient is complete, or ``INPUTS``) arrived; True
        once all have, i.e. when this unit's backward is over and its parameters can be released."""
        self._awaiting.discard(signal)
        return not self._awaiting

    def __repr__(self) -> str:
        return f"Unit({self.name!r})"
