"""How many conversations one worker can serve without missing a deadline: measured at start, or given.

A worker's capacity is what admission trusts, so it must be a number measured on this worker's own
device and program, not a guess: the cadence benchmark (``benchmarks/cadence.py``) measures N per GPU
over a minute of real-time traffic, and its N can be given in the worker's config. Without one,
:func:`measure_capacity` takes a short measurement at start: for n = 1, 2, ... it opens n scratch
conversations and runs rounds in which every one of them sends a chunk at the same instant, served
by one thread per lane as traffic would be. A chunk's latency is its completion time from the round's
start (queueing included). The capacity is the largest n whose p99 stays under the deadline (one
chunk period); the sweep stops at the first n over it. All chunks arriving at once is the worst case
of a staggered cadence (the benchmark's arrivals are spread over the period), so the measured N is a
lower bound of the benchmark's: admission errs on the side of no misses.

The sweep is bounded (``max_n``, a few rounds each) so a worker is ready in seconds; a capacity at
that bound says so (``bound="max_n"``: at least that many). On a GPU the session buffers' bytes bound
it too (``bound="memory"``), with a margin for what traffic allocates.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping

__all__ = ["Calibration", "given_capacity", "measure_capacity", "percentile"]

ChunkRunner = Callable[[], None]  # runs the next chunk of one scratch conversation


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]) of ``values`` (the benchmarks' definition)."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


@dataclass(frozen=True)
class Calibration:
    """A worker's capacity and where it came from.

    ``source``: ``"config"`` (given) or ``"calibrated"``. ``bound``: what limited it: ``"deadline"``
    (the next n missed), ``"max_n"`` (the sweep's bound: at least this many), ``"memory"``, or
    ``"config"``. ``p99_ms``/``p50_ms``: per n measured, chunk latency from a round's start.
    """

    capacity: int
    source: str
    bound: str
    deadline_ms: float
    seconds: float = 0.0
    p50_ms: Mapping[int, float] = field(default_factory=dict)
    p99_ms: Mapping[int, float] = field(default_factory=dict)

    def describe(self) -> str:
        if self.source == "config":
            return f"capacity {self.capacity} (given in the worker's config)"
        table = ", ".join(f"n={n}: p99 {v:.1f} ms" for n, v in sorted(self.p99_ms.items()))
        return (f"capacity {self.capacity} (calibrated in {self.seconds:.2f} s against a {self.deadline_ms:.0f} ms "
                f"deadline, bound by {self.bound}; {table})")


def given_capacity(n: int, deadline_s: float) -> Calibration:
    """A capacity from the config (the cadence benchmark's measured N for this GPU and program)."""
    if n < 0:
        raise ValueError(f"capacity must be >= 0, got {n}")
    return Calibration(int(n), "config", "config", deadline_s * 1e3)


def measure_capacity(new_conversation: Callable[[], tuple[ChunkRunner, Callable[[], None]]], *, lanes: int,
                     deadline_s: float, max_n: int = 8, rounds: int = 4,
                     memory_bound: int | None = None) -> Calibration:
    """Sweep n = 1..``max_n`` conversations and return the largest whose p99 chunk latency is under
    ``deadline_s``.

    ``new_conversation()`` opens one scratch conversation and returns (run its next chunk, close it).
    Each n runs one untimed round (new sessions' first calls, allocator growth) and ``rounds`` timed
    ones; a round submits one chunk of every conversation at once to ``lanes`` threads.
    ``memory_bound``: the most conversations the device's memory holds (``None``: no bound).
    """
    t0 = time.perf_counter()
    limit = max_n if memory_bound is None else max(0, min(max_n, memory_bound))
    p50: dict[int, float] = {}
    p99: dict[int, float] = {}
    convs: list[tuple[ChunkRunner, Callable[[], None]]] = []
    capacity, bound = 0, "deadline"
    try:
        with ThreadPoolExecutor(max_workers=max(1, lanes)) as pool:
            for n in range(1, limit + 1):
                while len(convs) < n:
                    convs.append(new_conversation())
                lat: list[float] = []
                for r in range(rounds + 1):
                    start = time.perf_counter()
                    futures = [pool.submit(_timed_from, run, start) for run, _close in convs]
                    done = [f.result() for f in futures]
                    if r:  # the first round is the untimed one
                        lat.extend(done)
                p50[n], p99[n] = percentile(lat, 50) * 1e3, percentile(lat, 99) * 1e3
                if p99[n] > deadline_s * 1e3:
                    break
                capacity = n
            else:
                bound = "max_n" if limit == max_n else "memory"
    finally:
        for _run, close in convs:
            close()
    return Calibration(capacity, "calibrated", bound, deadline_s * 1e3, time.perf_counter() - t0, p50, p99)


def _timed_from(run: ChunkRunner, start: float) -> float:
    run()
    return time.perf_counter() - start
