"""Interval arithmetic over (start, end) spans: how long something was in progress, and how much of
it another activity covered."""

from __future__ import annotations

from collections.abc import Iterable

Span = tuple[float, float]


def merge(spans: Iterable[Span]) -> list[Span]:
    """Disjoint, sorted spans covering exactly the time covered by ``spans``."""
    merged: list[list[float]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def total(spans: Iterable[Span]) -> float:
    """Time during which at least one span was in progress."""
    return sum(end - start for start, end in merge(spans))


def covered(spans: Iterable[Span], by: Iterable[Span]) -> float:
    """Time during which some span of ``spans`` and some span of ``by`` were both in progress."""
    a, b = merge(spans), merge(by)
    i = j = 0
    overlap = 0.0
    while i < len(a) and j < len(b):
        overlap += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return overlap
