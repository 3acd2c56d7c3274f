"""What the run directory's writer costs the training thread: two sinks side by side, one process.

    uv run python benchmarks/writer_cost.py [--workload cnn] [--rounds 60]
        [--a process|thread|recording] [--b recording|process|thread]

Three copies of a workload (same seed, weights and batches) live in one process: one plain, and
two observed with the default profile, one writing to sink ``a``, the other to sink ``b``:
``process``, the run directory with its writer in a process of its own (the default);
``thread``, the run directory written from a thread of this process; ``recording``, the
``RecordingSink``, which keeps the records in memory and writes nothing. Each round runs one step
of each in an order that rotates: the plain step, and for each observed copy a sampled step
followed by its next (unsampled) step, where what a sample leaves behind lands. Reported: the
median of each ratio to the plain step of the same round, and the median and mean of the
per-round difference between ``a`` and ``b``, which is what sink ``a`` costs beyond sink ``b``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from _overhead_workloads import WORKLOADS, build

if TYPE_CHECKING:
    from torchinstruments_core import Observer
    from torchinstruments_core.sinks import Sink

SINKS = ("process", "thread", "recording")


def _sink(kind: str, folder: Path) -> Sink:
    from torchinstruments_core.run_directory import RunDirectorySink
    from torchinstruments_core.testing import RecordingSink

    if kind == "recording":
        return RecordingSink()
    return RunDirectorySink(folder / kind, writer=kind)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="cnn", choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--a", choices=SINKS, default="process")
    parser.add_argument("--b", choices=SINKS, default="recording")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.a == args.b:
        parser.error("--a and --b must differ")
    torch.set_num_threads(args.threads)
    from torchinstruments_core import inject_observer

    device = torch.device("cpu")
    plain = build(args.workload, device)
    with tempfile.TemporaryDirectory() as folder:
        copies = {kind: build(args.workload, device) for kind in (args.a, args.b)}
        observers: dict[str, Observer] = {
            kind: inject_observer(copies[kind].model, sink=_sink(kind, Path(folder)))
            for kind in copies
        }
        steps = dict.fromkeys(copies, 0)

        def observed(kind: str) -> tuple[float, float]:
            times = []
            for sample in (True, False):
                started = time.perf_counter()
                observers[kind].begin_step(steps[kind], sample=sample)
                copies[kind].step()
                observers[kind].end_step()
                times.append(time.perf_counter() - started)
                steps[kind] += 1
            return times[0], times[1]

        def plain_step() -> tuple[float, float]:
            started = time.perf_counter()
            plain.step()
            return time.perf_counter() - started, 0.0

        runs = {"plain": plain_step} | {kind: lambda kind=kind: observed(kind) for kind in copies}
        names = list(runs)
        sampled: dict[str, list[float]] = {kind: [] for kind in copies}
        after: dict[str, list[float]] = {kind: [] for kind in copies}
        total = args.warmup + args.rounds
        for number in range(total):
            print(f"\r{args.workload}: round {number + 1}/{total}", end="", flush=True)
            order = names[number % 3 :] + names[: number % 3]
            times = {name: runs[name]() for name in order}
            if number < args.warmup:
                continue
            base = times["plain"][0]
            for kind in copies:
                sampled[kind].append(times[kind][0] / base)
                after[kind].append(times[kind][1] / base)
        for observer in observers.values():
            observer.remove()
    print(f"\n\n{WORKLOADS[args.workload].description}; {args.rounds} rounds\n")
    print("| sink | sampled step | the step after it |")
    print("|---|---|---|")
    for kind in copies:
        print(
            f"| {kind} | {statistics.median(sampled[kind]):.3f}x | "
            f"{statistics.median(after[kind]):.3f}x |"
        )
    difference = [a - b for a, b in zip(sampled[args.a], sampled[args.b], strict=True)]
    print(
        f"\nsampled step, {args.a} minus {args.b}, per round: median "
        f"{statistics.median(difference):+.3f}, mean {statistics.mean(difference):+.3f}"
    )


if __name__ == "__main__":
    main()
