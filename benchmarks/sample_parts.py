"""What each part of a sampled step costs, found by taking it out: one process, step against step.

    uv run python benchmarks/sample_parts.py [--workload mnist-mlp] [--rounds 400]
        [--sink run-directory|recording]

``sampled_profile.py`` times the observer's functions from the inside. Its timers cost about a
microsecond a call, and they cannot see what a part costs the rest of the step: the kernels'
thread and the run directory's writer process share the cores and the caches with the model.
Here the part is taken out instead. A plain copy of the workload and an observed copy (default
profile) live in one process, and every round the observed copy runs one sampled step in each
configuration below, in an order that rotates from round to round, each followed by an
unsampled step:

- ``observed``: the observer as it is.
- ``no histograms``: every tensor measured without its histogram.
- ``copies and kernels``: every tensor copied, and its default profile (histogram included)
  queued to a queue of the kernels' own, as the observer queues it on a small model; its
  values are never read back, and the queue is waited for after the unsampled step, outside
  the timed steps. No measurement objects: every value of the sample is unavailable.
- ``copies``: the same copies, no kernels.
- ``scaffolding``: no tensor measured. The hooks, the sample, its rows (every value
  unavailable) and their delivery are left.

The stand-ins replace ``Measurer.measure`` while their step runs, and count the entries they
are handed as it does: every configuration's sample goes the way its size chooses (the kernels'
queue for a small one, ``_measure.SMALL_SAMPLE_ENTRIES``), as in the ``observed`` one.

Reported: each configuration's sampled step over the plain step of its round (the median of
the rounds, with the interquartile range), and between two neighbouring lines what the part
that separates them costs, in plain steps: the values' reading back, rows and histograms
(``observed`` against ``no histograms`` and the latter against ``copies and kernels``), the
kernels' work on the other core (``copies and kernels`` against ``copies``), the copies
(against ``scaffolding``), and the scaffolding itself (against ``plain``).
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from _overhead_workloads import WORKLOADS, build
from _warmup import SECONDS, warm_up

from torchinstruments_core import _measure, inject_observer
from torchinstruments_core._measurement import Measurement
from torchinstruments_core._records import UnavailableReason
from torchinstruments_core.reducers import _native
from torchinstruments_core.reducers._fused import _call
from torchinstruments_core.reducers.functional import DEFAULT_SAMPLE_SIZE

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchinstruments_core._measure import Measurer

_REAL = _measure.Measurer.measure


class KernelsOnly:
    """The ``copies (and kernels)`` stand-ins: a copy and a queued profile a tensor, nothing read.

    Each copy goes into a buffer kept for its place in the step, as the observer keeps spares:
    fresh memory would make every copy fault its pages in.
    """

    def __init__(self) -> None:
        self._queue = _native.new_queue()
        self._buffers: dict[int, torch.Tensor] = {}
        self._held: list[_native.Queued] = []
        self._copies = 0  # this step's, for their places

    def measure(
        self, measurer: Measurer, tensor: torch.Tensor, histogram: bool, *, queue: bool = True
    ) -> Measurement:
        """Copy ``tensor`` and, with ``queue``, queue its profile; a measurement with no values."""
        values = tensor.detach().reshape(-1)
        measurer._entries += values.numel()
        place = self._copies
        self._copies += 1
        buffer = self._buffers.get(place)
        if buffer is None or buffer.numel() != values.numel() or buffer.dtype != values.dtype:
            buffer = self._buffers[place] = torch.empty_like(values)
        buffer.copy_(values)
        if not queue:
            return _unavailable(measurer)
        call = _call(
            buffer.numel(), DEFAULT_SAMPLE_SIZE, measurer.histogram.bins if histogram else 0
        )
        seed = 1234 if call.drawn else None
        queued = _native.submit_profile(self._queue, buffer, seed, call.shape)
        self._held.append(queued)
        return _unavailable(measurer)

    def wait(self) -> None:
        """Wait for every queued profile, then let their buffers go to the next step's copies."""
        if self._held and self._held[-1].ticket is not None:
            _native.queue_wait(self._queue, self._held[-1].ticket)
        self._held.clear()
        self._copies = 0

    def close(self) -> None:
        """Stop the queue's thread."""
        _native.queue_close(self._queue)


def _unavailable(measurer: Measurer) -> Measurement:
    return Measurement(reason=UnavailableReason.EMPTY_TENSOR, metrics=measurer.metrics)


def _stand_ins(kernels: KernelsOnly) -> dict[str, Callable[..., Measurement]]:
    """``Measurer.measure`` of each configuration."""

    def no_histograms(self: Measurer, tensor: torch.Tensor, **options: Any) -> Measurement:
        return _REAL(self, tensor, **{**options, "with_histogram": False})

    def copied(queue: bool) -> Callable[..., Measurement]:
        def measure(self: Measurer, tensor: torch.Tensor, **options: Any) -> Measurement:
            if not tensor.is_floating_point() or tensor.device.type != "cpu" or not tensor.numel():
                return _unavailable(self)
            return kernels.measure(self, tensor, options["with_histogram"], queue=queue)

        return measure

    def scaffolding(self: Measurer, tensor: torch.Tensor, **options: Any) -> Measurement:
        self._entries += tensor.numel()
        return _unavailable(self)

    return {
        "observed": _REAL,
        "no histograms": no_histograms,
        "copies and kernels": copied(queue=True),
        "copies": copied(queue=False),
        "scaffolding": scaffolding,
    }


def measure(name: str, rounds: int, sink: str) -> dict[str, list[float]]:
    """Per configuration, its sampled steps over the round's plain step."""
    plain, observed = build(name, torch.device("cpu")), build(name, torch.device("cpu"))
    kernels = KernelsOnly()
    stand_ins = _stand_ins(kernels)
    ratios: dict[str, list[float]] = {configuration: [] for configuration in stand_ins}
    with tempfile.TemporaryDirectory() as folder:
        destination: dict[str, Any] = {"output_dir": Path(folder) / "run"}
        if sink == "recording":
            from torchinstruments_core.testing import RecordingSink

            destination = {"sink": RecordingSink()}
        observer = inject_observer(observed.model, **destination)
        step = 0

        def run(sampled: bool) -> float:
            nonlocal step
            started = time.perf_counter()
            observer.begin_step(step, sample=sampled)
            observed.step()
            observer.end_step()
            step += 1
            return time.perf_counter() - started

        try:
            warm_up(lambda warm: run(warm % 2 == 0), 3 * len(stand_ins), SECONDS, name)
            order = list(stand_ins)
            for round_ in range(rounds):
                started = time.perf_counter()
                plain.step()
                plain_s = time.perf_counter() - started
                for configuration in order[round_ % len(order) :] + order[: round_ % len(order)]:
                    _measure.Measurer.measure = stand_ins[configuration]  # type: ignore[method-assign]
                    try:
                        ratios[configuration].append(run(True) / plain_s)
                        run(False)
                    finally:
                        _measure.Measurer.measure = _REAL  # type: ignore[method-assign]
                    kernels.wait()
        finally:
            observer.remove()
            kernels.close()
    return ratios


def report(name: str, ratios: dict[str, list[float]], sink: str, rounds: int) -> None:
    """Print each configuration's ratio and what separates it from the next line."""
    print(f"{name}: {WORKLOADS[name].description}; {sink} sink, {rounds} rounds")
    print(f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)\n")
    print("| configuration | sampled step over plain (IQR) | what it adds to the line below |")
    print("|---|---|---|")
    medians = {configuration: statistics.median(values) for configuration, values in ratios.items()}
    lines = [*medians, "plain"]
    for configuration, below in itertools.pairwise(lines):
        q1, _, q3 = statistics.quantiles(ratios[configuration], n=4)
        lower = 1.0 if below == "plain" else medians[below]
        cost = medians[configuration] - lower
        print(
            f"| {configuration} | {medians[configuration]:.3f}x ({q1:.3f}-{q3:.3f}) "
            f"| {cost:+.3f} plain steps |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    on_cpu = sorted(name for name, spec in WORKLOADS.items() if not spec.cuda_only)
    parser.add_argument("--workload", default="mnist-mlp", choices=on_cpu)
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sink", choices=["run-directory", "recording"], default="run-directory")
    args = parser.parse_args()
    if _native.KERNELS is None or not _native.QUEUE:
        raise SystemExit("the compiled kernels and their queue are needed (see the README)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    report(args.workload, measure(args.workload, args.rounds, args.sink), args.sink, args.rounds)


if __name__ == "__main__":
    main()
