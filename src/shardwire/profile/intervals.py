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


def subtract(spans: Iterable[Span], minus: Iterable[Span]) -> list[Span]:
    """The parts of ``spans`` not covered by ``minus``, as disjoint sorted spans."""
    result: list[Span] = []
    holes = merge(minus)
    for start, end in merge(spans):
        cursor = start
        for hole_start, hole_end in holes:
            if hole_end <= cursor or hole_start >= end:
                continue
            if hole_start > cursor:
                result.append((cursor, hole_start))
            cursor = max(cursor, hole_end)
        if cursor < end:
            result.append((cursor, end))
    return result


def clip(spans: Iterable[Span], window: Span) -> list[Span]:
    """``spans`` cut to ``window``."""
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in spans if min(e, hi) > max(s, lo)]
