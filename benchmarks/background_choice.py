"""Where a CPU sample's reductions run, worker thread or hooks, compared in one process.

    uv run python benchmarks/background_choice.py [--workload small-gpt cnn] [--rounds 40]
        [--optimizer]

``background_reductions`` decides where a CPU sample's tensors are reduced: on the Python
reduction worker, beside the model (``None``, the default, where torch's threads leave a core
free; ``True``: always), or in the hooks, on the training thread (``False``). The worker's
Python holds the GIL between its reductions' calls, and each time one of the training thread's
operations ends it may have to win the GIL back and wait for a thread to wake; the hooks make
the training thread do the reductions itself, on data it has just written. Which costs less
depends on the model (many short operations, or few long reductions) and on the machine (how
long a thread's wake takes: ``gil_handoff.py``).

Here one plain copy of a workload and one observed copy per choice train side by side in one
process (``_rounds.alternate``: every round each observed copy's sampled step and its next,
unsampled step, and the plain copy's step, in an order that rotates every round). A small
sample's tensors go to the kernels' queue whatever the choice (``_measure.SMALL_SAMPLE_ENTRIES``,
with ``None`` and ``True``), so the choice matters for the larger samples. Reported per choice:
the sampled step over the round's plain step (median, interquartile range), the step after it,
and the median of the rounds' differences from the default.
"""

from __future__ import annotations

import argparse
import statistics
from typing import TYPE_CHECKING, Any

import torch
from _overhead_workloads import WORKLOADS
from _rounds import alternate

if TYPE_CHECKING:
    from pathlib import Path

CHOICES: dict[str, bool | None] = {"default (None)": None, "hooks (False)": False}
"""Each configuration's ``background_reductions``."""


def measure(name: str, rounds: int, warmup: int, optimizer: bool) -> dict[str, list[float]]:
    """Each choice's sampled steps, the unsampled steps after them and the plain ones (s)."""
    import torchinstruments_core as core

    def observer(background: bool | None) -> Any:
        def make(copy: Any, folder: Path) -> Any:
            given = {"optimizer": copy.optimizer} if optimizer else {}
            return core.inject_observer(
                copy.model, output_dir=folder, background_reductions=background, **given
            )

        return make

    return alternate(name, {label: observer(b) for label, b in CHOICES.items()}, rounds, warmup)


def _ratios(values: list[float], base: list[float]) -> list[float]:
    return [value / other for value, other in zip(values, base, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", nargs="+", default=["small-gpt"], choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="rounds, and at least 3 s")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--optimizer", action="store_true", help="also record the optimizer step signals"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    signals = ", optimizer step signals" if args.optimizer else ""
    print(f"\n{args.rounds} rounds, {torch.get_num_threads()} thread(s){signals}")
    print(
        "\n| workload | background_reductions | sampled / plain (IQR) | the step after |"
        " median of the differences from the default |\n|---|---|---|---|---|"
    )
    default = next(iter(CHOICES))
    for name in args.workload:
        times = measure(name, args.rounds, args.warmup, args.optimizer)
        base = times["plain"]
        plain_ms = statistics.median(base) * 1e3
        first = _ratios(times[default], base)
        for label in CHOICES:
            ratios = _ratios(times[label], base)
            low, _, high = statistics.quantiles(ratios, n=4)
            after = statistics.median(_ratios(times[f"{label} after"], base))
            difference = statistics.median(a - b for a, b in zip(ratios, first, strict=True))
            print(
                f"| {name} ({plain_ms:.1f} ms) | {label} | {statistics.median(ratios):.3f}x"
                f" ({low:.3f}-{high:.3f}) | {after:.3f}x | {difference:+.3f}x |"
            )


if __name__ == "__main__":
    main()
