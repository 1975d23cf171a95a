"""A step's micro-batches accumulated outside ``no_sync`` where every backward counts as a step.

Outside fault tolerance and DiLoCo, accumulating gradients over several backward passes without
``no_sync`` only reduces each of them, as under DDP: correct, if slower. Where the groups meet at
steps, every backward outside ``no_sync`` is one: under DiLoCo an inner step (the syncs come that
many times as often, between micro-batches), between fault-tolerant groups meeting at every step a
step they vote on (a vote dropped drops the micro-batches before it too). Nothing fails; the
training is silently another. ``AccumulationCheck`` says so, once.

It is told by a gradient buffer of this rank's: where a backward starts and the gradient the last
one left is still there, the same tensor (no ``zero_grad`` set it to None), its values are read:
not all zero, the backward adds to it. Zeros are gradients zeroed in place
(``zero_grad(set_to_none=False)``), or a buffer whose gradient happened to be zero; after
``_READS`` such reads the run is taken to zero in place, and no more is read. So a run pays at most
that many host synchronizations for it, and none where its gradients are set to None.
"""

from __future__ import annotations

import warnings
import weakref

import torch

_READS = 3  # reads of an untouched gradient that found zeros, after which the run is taken to zero in place


class AccumulationCheck:
    """Watches ``flat``'s gradients on this rank; says ``accumulated`` (what it does where the
    groups meet) on rank 0 (``says``) where a backward adds to the last one's."""

    def __init__(self, flat, accumulated: str, *, says: bool):
        self._param = next((param for param in flat.params if param.to_local().numel()), None)
        self._accumulated, self._says = accumulated, says
        self._left: weakref.ref | None = None  # the gradient the last backward left, by weak reference
        self._reads = _READS

    def backward_done(self) -> None:
        """The end of a backward outside ``no_sync``: remember its gradient (a weak reference, which
        a gradient set to None and freed never matches)."""
        left = self._gradient()
        self._left = None if left is None else weakref.ref(left)

    def backward_starts(self) -> None:
        """The start of a backward outside ``no_sync``: where the last one's gradient is still there,
        read whether it holds anything."""
        left, self._left = self._left, None
        now = self._gradient()
        if self._reads == 0 or left is None or now is None or left() is not now:
            return
        buffer = now if now._base is None else now._base  # the flat's whole share, which ``land`` slices
        if not bool(buffer.count_nonzero()):
            self._reads -= 1
            return
        self._reads = 0
        if self._says:
            warnings.warn(f"this backward adds to the gradients of the one before it, outside no_sync: "
                          f"{self._accumulated}; if they are micro-batches of one step, run all but each step's "
                          f"last backward under shardwire.no_sync(model)", stacklevel=1)

    def _gradient(self) -> torch.Tensor | None:
        """The watched parameter's gradient as a plain tensor (a DTensor's local part), or None."""
        grad = None if self._param is None else self._param.grad
        return getattr(grad, "_local_tensor", grad)
