"""A contiguous run of a tensor's flattened elements, as rectangular boxes of the tensor.

A rank's part of a parameter is a run of the parameter's elements in row-major order: it may start
and end mid-row. Checkpoint formats that reshard (DCP) describe what a rank holds as boxes of the
tensor in its own shape, so the run is cut into boxes: in a matrix, a partial first row, whole rows
and a partial last row; in more dimensions the partial rows recurse into the lower dimensions, so
at most ``2 * ndim - 1`` boxes. Each box is itself a contiguous run, so it is a view of the part.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class Box:
    """A box of a tensor (``offsets`` and ``sizes`` per dimension) and where its elements lie in the
    run: ``[start, end)``, counted from the run's first element."""

    offsets: torch.Size
    sizes: torch.Size
    start: int
    end: int


def boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """The boxes of a tensor of ``shape`` that together hold its flattened elements ``[start, end)``,
    in order; none for an empty run."""
    found, at = [], 0
    for offsets, sizes in _cut(tuple(shape), start, end):
        volume = math.prod(sizes)
        found.append(Box(torch.Size(offsets), torch.Size(sizes), at, at + volume))
        at += volume
    return found


def _cut(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    row = math.prod(shape[1:])  # elements under one index of the first dimension
    rest = shape[1:]
    cut = []
    if start % row:  # the run starts mid-row: that row's part, cut in the lower dimensions
        first, stop = start // row, min(end, (start // row + 1) * row)
        cut += [((first, *o), (1, *s)) for o, s in _cut(rest, start - first * row, stop - first * row)]
        start = stop
    whole = end // row * row
    if start < whole:  # whole rows
        cut.append(((start // row, *[0] * len(rest)), (whole // row - start // row, *rest)))
        start = whole
    if start < end:  # the run ends mid-row
        last = start // row
        cut += [((last, *o), (1, *s)) for o, s in _cut(rest, 0, end - last * row)]
    return cut
