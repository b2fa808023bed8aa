"""Interleaved timing and the statistics reported for it."""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

THREADS = 1  # intra-op threads per process (per rank in multi-rank runs), fixed for every run

T = TypeVar("T")


@dataclass(frozen=True)
class Stats:
    """Median, quartiles and extremes of one series of measurements."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        if len(values) == 1:
            q1 = q3 = values[0]
        else:
            q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(statistics.median(values), q1, q3, min(values), max(values), len(values))


def interleave(
    a: Callable[[], T], b: Callable[[], T], *, rounds: int, warmup: int = 2
) -> tuple[list[T], list[T]]:
    """Time ``a`` and ``b`` alternately, ``rounds`` times each, after ``warmup`` untimed rounds.

    The order flips every round (A B, B A, A B, ...), so neither side always
    runs second, right after the other has warmed or dirtied the caches.
    Returns the two series, paired by round.
    """
    for _ in range(warmup):
        a()
        b()
    times_a: list[T] = []
    times_b: list[T] = []
    for index in range(rounds):
        if index % 2 == 0:
            times_a.append(a())
            times_b.append(b())
        else:
            times_b.append(b())
            times_a.append(a())
    return times_a, times_b


def per_call(
    fn: Callable[[], object], calls: int, clock: Callable[[], float] = time.process_time
) -> Callable[[], float]:
    """Return a block that calls ``fn`` ``calls`` times and returns the seconds per call.

    The default clock is this process's CPU time: with one torch thread, a
    training step is CPU-bound, and CPU time does not count the moments a
    shared machine gives the core to another process. Pass
    ``time.perf_counter`` for wall time.
    """

    def block() -> float:
        start = clock()
        for _ in range(calls):
            fn()
        return (clock() - start) / calls

    return block


@contextlib.contextmanager
def fixed_threads(threads: int = THREADS) -> Iterator[None]:
    """Pin torch's intra-op threads (and flush denormals) for the duration of a benchmark."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)  # a converging toy model must not slow down on denormals
    try:
        yield
    finally:
        torch.set_num_threads(before)
        torch.set_flush_denormal(False)


def bootstrap_median(
    values: Sequence[float], *, draws: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """A 95 % percentile-bootstrap interval of the median of ``values``."""
    generator = random.Random(seed)
    medians = sorted(
        statistics.median(generator.choices(values, k=len(values))) for _ in range(draws)
    )
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def rotate(
    blocks: Sequence[Callable[[], float]], *, rounds: int, warmup: int = 2
) -> list[list[float]]:
    """Time every block once per round, the order rotating by one each round, after ``warmup``."""
    for _ in range(warmup):
        for block in blocks:
            block()
    times: list[list[float]] = [[] for _ in blocks]
    for index in range(rounds):
        shift = index % len(blocks)
        for which in [*range(shift, len(blocks)), *range(shift)]:
            times[which].append(blocks[which]())
    return times
