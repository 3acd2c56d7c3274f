"""What each choice of optimizer step signals adds to a sampled step, in one process.

    uv run python benchmarks/step_signal_cost.py [--workload mlp] [--rounds 30]

The adapters record every optimizer step signal by default (``step_signals``: the parameters,
the gradients the optimizer uses, the updates and the optimizer's state, each with its rows and,
for the focus layers, histograms). A user who samples densely may record fewer. Here one plain
copy of a workload and one observed copy per choice below train side by side in one process,
each with its own run directory: every round runs each observed copy's sampled step and then its
unsampled step, and the plain copy's step, in an order that rotates every round (two processes
differ by more than these choices do; ``paired.py``'s docstring). The choices:

- ``none``: the optimizer not given, the forward samples only (what ``paired.py`` measures);
- ``gradient``: ``("parameter_gradient",)``;
- ``gradient, update``: ``("parameter_gradient", "update")`` (the update needs a copy of each
  parameter before the step, kept between recorded steps on the CPU);
- ``all``: the adapters' default.

Reported per choice: the sampled step over the round's plain step (median of the rounds, with
the interquartile range), over the same copy's own unsampled step of the round (the copies'
memory alone makes copies differ by up to about 15 %), and what that median ratio adds to the
median plain step, in milliseconds.
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

CHOICES: dict[str, tuple[str, ...] | None] = {
    "none": None,
    "gradient": ("parameter_gradient",),
    "gradient, update": ("parameter_gradient", "update"),
    "all": ("parameter", "parameter_gradient", "update", "optimizer_state"),
}
"""Each configuration's ``step_signals``; ``None``: no optimizer given."""


def measure(name: str, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Each choice's sampled steps, the unsampled steps after them and the plain ones (s)."""
    import torchinstruments_core as core

    def observer(signals: tuple[str, ...] | None) -> Any:
        def make(copy: Any, folder: Path) -> Any:
            if signals is None:
                return core.inject_observer(copy.model, output_dir=folder)
            return core.inject_observer(
                copy.model, output_dir=folder, optimizer=copy.optimizer, step_signals=signals
            )

        return make

    return alternate(name, {label: observer(s) for label, s in CHOICES.items()}, rounds, warmup)


def _ratio(values: list[float], base: list[float]) -> tuple[float, float, float]:
    ratios = [value / other for value, other in zip(values, base, strict=True)]
    quartiles = statistics.quantiles(ratios, n=4)
    return statistics.median(ratios), quartiles[0], quartiles[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", nargs="+", default=["mlp"], choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="rounds, and at least 3 s")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"\n{args.rounds} rounds, {torch.get_num_threads()} thread(s), torch {torch.__version__}")
    print(
        "\n| workload | step signals | sampled / plain (IQR) | sampled / its unsampled |"
        " added (ms) |\n|---|---|---|---|---|"
    )
    for name in args.workload:
        times = measure(name, args.rounds, args.warmup)
        base = times["plain"]
        plain_ms = statistics.median(base) * 1e3
        for label in CHOICES:
            sampled = times[label]
            median, low, high = _ratio(sampled, base)
            own, _, _ = _ratio(sampled, times[f"{label} after"])
            added = (median - 1) * plain_ms
            print(
                f"| {name} ({plain_ms:.1f} ms) | {label} | {median:.3f}x ({low:.3f}-{high:.3f}) |"
                f" {own:.3f}x | {added:+.2f} |"
            )


if __name__ == "__main__":
    main()
