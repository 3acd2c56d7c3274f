"""What the run directory's writer costs the training thread: two sinks side by side, one process.

    uv run python benchmarks/writer_cost.py [--workload cnn] [--rounds 60]
        [--a process|thread|recording] [--b recording|process|thread] [--warmup-seconds 3]

Three copies of a workload (same seed, weights and batches) live in one process: one plain, and
two observed with the default profile, one writing to sink ``a``, the other to sink ``b``:
``process``, the run directory with its writer in a process of its own (the default);
``thread``, the run directory written from a thread of this process; ``recording``, the
``RecordingSink``, which keeps the records in memory and writes nothing. Each round runs one step
of each in an order that rotates: the plain step, and for each observed copy a sampled step
followed by its next (unsampled) step, where what a sample leaves behind lands. Reported: the
median of each ratio to the plain step of the same round, and the median and mean of the
per-round difference between ``a`` and ``b``, which is what sink ``a`` costs beyond sink ``b``.
The rounds are timed after a warm-up of at least ``--warmup`` rounds and ``--warmup-seconds``
(``_warmup``): a run directory's writer process starts meanwhile, and a sample that waits for
it would count against the writer. Runs before 2026-12-05 warmed up for three rounds only.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from _overhead_workloads import WORKLOADS, build
from _side_by_side import observed_steps, rotating_ratios
from _warmup import SECONDS

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
    parser.add_argument("--warmup", type=int, default=3, help="rounds first, at the least")
    parser.add_argument(
        "--warmup-seconds", type=float, default=SECONDS, help="and at least this long"
    )
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
        ratios = rotating_ratios(
            plain,
            {kind: observed_steps(observers[kind], copies[kind], (True, False)) for kind in copies},
            rounds=args.rounds,
            warmup=args.warmup,
            warmup_seconds=args.warmup_seconds,
            label=args.workload,
        )
        sampled = {kind: [sequence[0] for sequence in ratios[kind]] for kind in copies}
        after = {kind: [sequence[1] for sequence in ratios[kind]] for kind in copies}
        for observer in observers.values():
            observer.remove()
    print(f"\n{WORKLOADS[args.workload].description}; {args.rounds} rounds\n")
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
