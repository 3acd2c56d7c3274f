"""What a thread computing beside the training thread costs it through the GIL, by call length.

    uv run python benchmarks/gil_handoff.py [--ops 2000] [--repeats 3] [--kinds sleep ...]

The training thread runs ``--ops`` rounds of three small torch operations (a 64x192 by 192x192
matmul, a ReLU and an add: the size of a small GPT's layers, each a few to tens of
microseconds), first alone, then beside a second thread (or process) that runs one kind of
call in a loop:

- ``sleep``: sleeps 1 ms at a time, holding nothing (a thread that merely exists);
- ``long call``: sums 4 Mi entries, about a millisecond with the GIL released throughout;
- ``torch 98k``: sums 98,304 entries, about 10 us a call;
- ``numpy 98k``: numpy's min of the same entries;
- ``reducers 98k``: the default reducers (moments, quartiles) on tensors of 98,304 entries,
  one tensor after another, as the CPU reduction worker runs them on a small GPT's tensors:
  a score of calls of 5-50 us a tensor, with Python between them;
- ``reducers, process``: the same in another process, which shares the caches and the memory
  bandwidth but not the GIL.

Each kind is measured against its own run alone just before it, so drift between kinds does
not enter its ratio. Reported per kind: the training loop's wall time and the training
thread's CPU time, alone and beside it, the wall ratio and the wall time added per training
operation. On the 2-core machine of the README a thread in long GIL-free calls costs the
training loop nothing, while one in calls of about 10 us costs it about as much as the same
work in pure numpy: every time an operation of the training thread ends, it may have to win
the GIL back.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Callable
    from multiprocessing.synchronize import Event as ProcessEvent

KINDS = ("sleep", "long call", "torch 98k", "numpy 98k", "reducers 98k", "reducers, process")
_ENTRIES = 98_304
"""Entries of most of the small GPT's observed tensors (batch 8, sequence 64, width 192)."""


@dataclass(frozen=True, slots=True)
class Timing:
    """The training loop's medians: wall seconds and the training thread's CPU seconds."""

    wall: float
    cpu: float


def _training_loop(ops: int) -> Callable[[], tuple[float, float]]:
    """``ops`` rounds of three small torch operations; returns (wall, thread CPU) seconds."""
    inputs, weight = torch.randn(64, 192), torch.randn(192, 192)

    def run() -> tuple[float, float]:
        started, cpu = time.perf_counter(), time.thread_time()
        for _ in range(ops):
            hidden = torch.relu(inputs @ weight)
            hidden = hidden + 1
        return time.perf_counter() - started, time.thread_time() - cpu

    return run


def _background_call(kind: str) -> Callable[[], object]:
    """One call of ``kind``, to be repeated by the background thread or process."""
    if kind == "sleep":
        return lambda: time.sleep(0.001)
    if kind == "long call":
        large = torch.randn(4 * 2**20)
        return large.sum
    values = torch.randn(_ENTRIES)
    if kind == "torch 98k":
        return values.sum
    if kind == "numpy 98k":
        return values.numpy().min
    return _reducing(values)


def _reducing(values: torch.Tensor) -> Callable[[], object]:
    """The default scalar reducers on a fresh ``PreparedTensor`` of ``values`` each call."""
    from torchinstruments_core.reducers import MomentsReducer, PreparedTensor, QuantileReducer

    generator = torch.Generator().manual_seed(0)
    reducers = (MomentsReducer(), QuantileReducer())

    def reduce() -> object:
        with torch.no_grad():
            prepared = PreparedTensor(values, generator, {})
            return [reducer.reduce(prepared) for reducer in reducers]

    return reduce


def _loop(kind: str, stop: threading.Event | ProcessEvent) -> None:
    """Repeat one call of ``kind`` until ``stop`` is set (the background thread or process)."""
    torch.set_num_threads(1)
    call = _background_call(kind)
    while not stop.is_set():
        call()


def _median(samples: list[tuple[float, float]]) -> Timing:
    return Timing(
        statistics.median(wall for wall, _ in samples), statistics.median(c for _, c in samples)
    )


def _beside(kind: str, run: Callable[[], tuple[float, float]], repeats: int) -> Timing:
    """The training loop's timing while ``kind`` runs in another thread or process."""
    stop: threading.Event | ProcessEvent
    worker: threading.Thread | multiprocessing.process.BaseProcess
    if kind.endswith("process"):
        context = multiprocessing.get_context("spawn")
        stop = context.Event()
        worker = context.Process(target=_loop, args=("reducers 98k", stop), daemon=True)
    else:
        stop = threading.Event()
        worker = threading.Thread(target=_loop, args=(kind, stop), daemon=True)
    worker.start()
    time.sleep(3.0 if kind.endswith("process") else 0.2)  # a spawned child imports torch first
    try:
        return _median([run() for _ in range(repeats)])
    finally:
        stop.set()
        worker.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, default=2000, help="rounds of the training loop")
    parser.add_argument("--repeats", type=int, default=3, help="timed loops per measurement")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS, metavar="KIND")
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = _training_loop(args.ops)
    run()  # warm-up
    operations = 3 * args.ops
    print(f"training loop: {operations} small torch operations; 1 torch thread\n")
    print(
        "| beside it | alone: wall (ms) | beside: wall (ms) | CPU alone/beside (ms) "
        "| wall ratio | added per operation (us) |"
    )
    print("|---|---|---|---|---|---|")
    for kind in args.kinds:
        alone = _median([run() for _ in range(args.repeats)])
        busy = _beside(kind, run, args.repeats)
        added = (busy.wall - alone.wall) / operations * 1e6
        print(
            f"| {kind} | {alone.wall * 1e3:.0f} | {busy.wall * 1e3:.0f} "
            f"| {alone.cpu * 1e3:.0f}/{busy.cpu * 1e3:.0f} | {busy.wall / alone.wall:.2f}x "
            f"| {added:.1f} |"
        )


if __name__ == "__main__":
    main()
