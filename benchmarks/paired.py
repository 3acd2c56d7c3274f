"""The overhead targets, measured step against step in one process: unsampled and sampled steps.

    uv run python benchmarks/paired.py [--workload transformer] [--rounds 40] [--compile]

``overhead.py`` gives every configuration a fresh process, which is right for memory and for
comparing tools, but on a shared machine the speed of two processes can differ by 10 %, more
than the 1 % an unsampled step may cost. Here two copies of the same workload (same seed, same
weights, same batches) live in one process: one plain, one observed (default profile, run
directory). Each round runs one step of each configuration: plain, observed but not sampled,
observed and sampled, in an order that rotates every round, so that drift and what a step
leaves behind (caches, the writer thread) fall on every configuration alike. Step time is wall
time (``time.perf_counter``): what the training loop waits, including any wait for the GIL
while the run directory's writer thread works.

With ``--compile`` both copies are ``torch.compile``d (inductor) and the observed one is
observed as ``inject_observer(torch.compile(model))``.

Reported: each configuration's median step; each ratio as the median of the per-round ratios,
with the interquartile range of those ratios. The sampled step carries everything a sample
costs on the training thread (hooks, reductions, the handover to the writer).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _overhead_workloads import WORKLOADS, Workload, build

CONFIGURATIONS = ("plain", "unsampled", "sampled")


def _step(
    configuration: str, plain: Workload, observed: Workload, observer: object, step: int
) -> float:
    workload = plain if configuration == "plain" else observed
    started = time.perf_counter()
    if configuration != "plain":
        observer.begin_step(step, sample=configuration == "sampled")  # type: ignore[attr-defined]
    workload.step()
    if configuration != "plain":
        observer.end_step()  # type: ignore[attr-defined]
    return time.perf_counter() - started


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, q2, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="transformer", choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--exact-quartiles", action="store_true", help="QuantileReducer(exact=True): sort it all"
    )
    parser.add_argument("--sink", choices=["run-directory", "recording"], default="run-directory")
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile both models; observe the compiled"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from torchinstruments_core import MomentsReducer, QuantileReducer, inject_observer

    device = torch.device("cpu")
    plain, observed = build(args.workload, device), build(args.workload, device)
    if args.compile:
        plain.model = torch.compile(plain.model)  # type: ignore[assignment]
        observed.model = torch.compile(observed.model)  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as folder:
        reducers = [MomentsReducer(), QuantileReducer(exact=True)] if args.exact_quartiles else None
        observer = inject_observer(
            observed.model, output_dir=Path(folder) / "run", reducers=reducers
        )
        times: dict[str, list[float]] = {name: [] for name in CONFIGURATIONS}
        for index in range(args.warmup + args.rounds):
            order = CONFIGURATIONS[index % 3 :] + CONFIGURATIONS[: index % 3]
            round_times = {name: _step(name, plain, observed, observer, index) for name in order}
            if index >= args.warmup:
                for name, seconds in round_times.items():
                    times[name].append(seconds)
            print(f"round {index + 1}/{args.warmup + args.rounds}", file=sys.stderr, end="\r")
        observer.remove()  # type: ignore[attr-defined]
    print(file=sys.stderr)
    quartiles = "exact quartiles" if args.exact_quartiles else "default profile"
    print(f"{WORKLOADS[args.workload].description}; {args.threads} thread(s), {args.rounds} rounds")
    compiled = ", both models compiled (inductor)" if args.compile else ""
    print(f"observed with the {quartiles}, {args.sink}{compiled}")
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}\n")
    print("| configuration | median step (ms) | ratio to plain, median of rounds | IQR of ratios |")
    print("|---|---|---|---|")
    for name in CONFIGURATIONS:
        median = statistics.median(times[name]) * 1000
        ratios = [t / p for t, p in zip(times[name], times["plain"], strict=True)]
        q1, q2, q3 = _quartiles(ratios)
        print(f"| {name} | {median:.1f} | {q2:.3f}x | {q1:.3f}-{q3:.3f} |")


if __name__ == "__main__":
    main()
