"""Copies of one workload side by side in one process: one plain, the others observed.

Shared by ``writer_cost.py`` and ``queue_linger.py``, which compare two ways of observing (two
sinks, two queues) against the same plain step. Each round runs the plain step once and each
observed copy's sequence of steps once (``observed_steps``), in an order that rotates from round
to round, so that drift and what a step leaves behind (caches) fall on every copy alike.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from _warmup import SECONDS, warm_up

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from _overhead_workloads import Workload

    from torchinstruments_core import Observer


def observed_steps(
    observer: Observer, workload: Workload, samples: Sequence[bool]
) -> Callable[[], list[float]]:
    """A run of ``workload``'s steps under ``observer``, sampled or not as ``samples`` says.

    Each call runs the whole sequence and returns each step's seconds; the steps are numbered
    on from one call to the next.
    """
    counter = iter(range(10**9))

    def run() -> list[float]:
        times = []
        for sample in samples:
            started = time.perf_counter()
            observer.begin_step(next(counter), sample=sample)
            workload.step()
            observer.end_step()
            times.append(time.perf_counter() - started)
        return times

    return run


def rotating_ratios(
    plain: Workload,
    observed: dict[str, Callable[[], list[float]]],
    *,
    rounds: int,
    warmup: int,
    label: str,
    warmup_seconds: float = SECONDS,
    warmed: Callable[[], object] | None = None,
) -> dict[str, list[list[float]]]:
    """Each observed copy's step times over the plain step of the same round, round by round.

    The warm-up runs first and is left out: at least ``warmup`` rounds and ``warmup_seconds``
    (``_warmup.warm_up``: the run directory's writer process starts meanwhile). A progress line
    counts the measured rounds. ``warmed`` is called once the warm-up is over.

    Returns:
        For each name of ``observed``, one list per measured round: the ratio of each step
        of its sequence to that round's plain step.
    """

    def plain_step() -> list[float]:
        started = time.perf_counter()
        plain.step()
        return [time.perf_counter() - started]

    runs = {"plain": plain_step} | observed
    names = list(runs)

    def run_round(number: int) -> dict[str, list[float]]:
        shift = number % len(names)
        return {name: runs[name]() for name in names[shift:] + names[:shift]}

    first = warm_up(run_round, warmup, warmup_seconds, label)
    if warmed is not None:
        warmed()
    ratios: dict[str, list[list[float]]] = {name: [] for name in observed}
    for number in range(rounds):
        print(f"\r{label}: round {number + 1}/{rounds}", end="", flush=True)
        times = run_round(first + number)
        (base,) = times["plain"]
        for name in observed:
            ratios[name].append([seconds / base for seconds in times[name]])
    print()
    return ratios
