"""The numbers ``shardwire bench`` reports, defined as nccl-tests defines them.

For an operation of size ``S`` bytes that takes ``t`` seconds on a group of ``n`` ranks:

* **algbw** = S / t. ``S`` is the size of the operation's whole buffer: for all_gather the gathered
  output, for reduce_scatter the input that is scattered, for all_to_all one rank's whole input
  (as nccl-tests: not one rank's piece of it).
* **busbw** = algbw x factor, where the factor turns the algorithm's bandwidth into the bandwidth each
  rank's link must carry with an optimal algorithm, so that every operation can be compared with
  the hardware's peak (nccl-tests' doc/PERFORMANCE.md derives them):

  ======================================  =============
  operation                               factor
  ======================================  =============
  all_reduce                              2 (n-1) / n
  all_gather, reduce_scatter, all_to_all  (n-1) / n
  broadcast, reduce, sendrecv             1
  ======================================  =============

* **t** is the mean over the timed iterations on each rank, combined over the group's ranks by
  their maximum (by default: a collective is done only when its slowest rank is, so that is the
  time it took for everyone), minimum or mean. nccl-tests averages by default and offers rank 0's,
  the minimum or the maximum with its ``-a`` option.

From a sweep of sizes for one operation:

* **peak busbw**, the smallest sizes whose busbw reaches 80 % and 90 % of it (how soon the network
  saturates), and the mean busbw over sizes of at least 1 MiB (latency-bound sizes left out);
* a **latency-bandwidth fit** t(S) = alpha + S / beta: least squares on the relative error, so
  that small sizes (which set alpha) weigh as much as large ones (which set beta).

Bandwidths are in bytes per second here; the report prints and stores GB/s (10^9 bytes/s).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

MIB = 1 << 20

_BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}
OPS = tuple(_BUS_FACTORS)


def bus_factor(op: str, ranks: int) -> float:
    """busbw / algbw for ``op`` on ``ranks`` ranks."""
    return _BUS_FACTORS[op](ranks)


@dataclasses.dataclass(frozen=True)
class Bandwidth:
    algbw: float  # bytes/s
    busbw: float  # bytes/s


def bandwidth(op: str, nbytes: int, seconds: float, ranks: int) -> Bandwidth:
    algbw = nbytes / seconds
    return Bandwidth(algbw=algbw, busbw=algbw * bus_factor(op, ranks))


COMBINE = ("max", "min", "avg")


def combine_ranks(times: list[float], how: str) -> float:
    """One time from each rank's mean time: their max (default), min or mean."""
    if how == "max":
        return max(times)
    if how == "min":
        return min(times)
    if how == "avg":
        return sum(times) / len(times)
    raise ValueError(f"unknown way to combine times {how!r}; expected one of {COMBINE}")


@dataclasses.dataclass(frozen=True)
class Saturation:
    """How an operation's busbw grows with size."""

    peak_busbw: float  # bytes/s
    peak_bytes: int
    bytes_to_80pct: int  # the smallest size whose busbw is at least 80 % of the peak
    bytes_to_90pct: int
    avg_busbw_from_1mib: float | None  # mean busbw over sizes >= 1 MiB; None if the sweep has none


def saturation(sizes: list[int], busbws: list[float]) -> Saturation:
    """Summarize a sweep given as ascending ``sizes`` and their busbw."""
    peak = max(busbws)

    def first_reaching(fraction: float) -> int:
        return next(s for s, b in zip(sizes, busbws) if b >= fraction * peak)

    large = [b for s, b in zip(sizes, busbws) if s >= MIB]
    return Saturation(
        peak_busbw=peak,
        peak_bytes=sizes[busbws.index(peak)],
        bytes_to_80pct=first_reaching(0.8),
        bytes_to_90pct=first_reaching(0.9),
        avg_busbw_from_1mib=sum(large) / len(large) if large else None,
    )


@dataclasses.dataclass(frozen=True)
class LatencyBandwidthFit:
    """t(S) = alpha + S / beta, fitted to a sweep."""

    alpha: float  # seconds
    beta: float  # bytes/s; math.inf when time did not grow with size over the sweep
    r2: float  # coefficient of determination of the (relative-error) fit
    points: int

    def predict(self, nbytes: float) -> float:
        return self.alpha + nbytes / self.beta


def fit_latency_bandwidth(sizes: list[int], seconds: list[float]) -> LatencyBandwidthFit | None:
    """Least-squares fit of t = alpha + S / beta, weighting each point by 1 / t^2.

    Plain least squares would fit only the largest sizes (their absolute errors dwarf a small size's
    whole time) and leave alpha to noise; relative errors let every decade of sizes count alike.
    alpha is kept >= 0 and 1/beta >= 0: when the unconstrained fit breaks one, that parameter is
    pinned at 0 and the other refitted. None when the sweep has fewer than two distinct sizes.
    """
    s = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if len(np.unique(s)) < 2:
        return None
    w2 = 1.0 / t**2
    design = np.stack([np.ones_like(s), s], axis=1) / t[:, None]
    (alpha, per_byte), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if per_byte <= 0:  # flat over the sweep: latency only
        per_byte = 0.0
        alpha = np.sum(w2 * t) / np.sum(w2)
    elif alpha < 0:  # no measurable latency: bandwidth only
        alpha = 0.0
        per_byte = np.sum(w2 * s * t) / np.sum(w2 * s * s)
    residual = np.sum(w2 * (t - alpha - per_byte * s) ** 2)
    spread = np.sum(w2 * (t - np.sum(w2 * t) / np.sum(w2)) ** 2)
    return LatencyBandwidthFit(
        alpha=float(alpha),
        beta=math.inf if per_byte == 0 else float(1.0 / per_byte),
        r2=float(1.0 - residual / spread) if spread > 0 else 1.0,
        points=len(sizes),
    )
