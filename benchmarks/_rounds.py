"""Observed copies of a workload beside a plain one, in one process, rounds rotating.

What ``versus.py`` (two revisions' observers) and ``step_signal_cost.py`` (one observer per
choice of step signals) share: every round runs each observed copy's sampled step, then its
next (unsampled) step, and the plain copy's step, in an order that rotates every round, after a
warm-up (``_warmup``); each observer writes its own run directory, removed at the end.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from _overhead_workloads import build
from _warmup import SECONDS, warm_up

if TYPE_CHECKING:
    from collections.abc import Callable


def alternate(
    name: str,
    observe: dict[str, Callable[[Any, Path], Any]],
    rounds: int,
    warmup: int,
) -> dict[str, list[float]]:
    """Each copy's steps, in seconds, ``rounds`` rounds.

    Args:
        name: The workload (``_overhead_workloads.WORKLOADS``).
        observe: For each label, what observes a copy: called with the copy (a ``Workload``)
            and the run directory's path, it returns the observer.
        rounds: Rounds timed, after the warm-up.
        warmup: Rounds of warm-up, at least ``SECONDS`` of them.

    Returns:
        ``"plain"``: the plain steps; each label: its sampled steps; ``"<label> after"``: the
        unsampled step after each.
    """
    plain = build(name, torch.device("cpu"))
    copies = {label: build(name, torch.device("cpu")) for label in observe}
    folders = {label: tempfile.mkdtemp(prefix="observed-") for label in observe}
    observers = {
        label: make(copies[label], Path(folders[label]) / "run") for label, make in observe.items()
    }
    number = 0

    def step(label: str, sample: bool) -> float:
        nonlocal number
        started = time.perf_counter()
        if label == "plain":
            plain.step()
        else:
            observers[label].begin_step(number, sample=sample)
            copies[label].step()
            observers[label].end_step()
            number += 1
        return time.perf_counter() - started

    labels = ["plain", *observe]
    times: dict[str, list[float]] = {key: [] for key in labels}
    times.update({f"{label} after": [] for label in observe})
    try:

        def warm_round(index: int) -> None:
            for label in labels:
                step(label, index % 2 == 0 and label != "plain")

        warm_up(warm_round, warmup, SECONDS, name)
        for index in range(rounds):
            print(f"\r{name}: round {index + 1}/{rounds}", end="", file=sys.stderr)
            shift = index % len(labels)
            for label in labels[shift:] + labels[:shift]:
                times[label].append(step(label, label != "plain"))
                if label != "plain":
                    times[f"{label} after"].append(step(label, False))
        print(file=sys.stderr)
    finally:
        for observer in observers.values():
            observer.remove()
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)
    return times
