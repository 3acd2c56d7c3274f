"""Helpers for users' own tests: a sink that keeps every sample in memory, and a CPU memory probe.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from torchinstruments_core import AlwaysSampler, inject_observer
    >>> sink = RecordingSink()
    >>> model = nn.Linear(3, 2)
    >>> with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
    ...     _ = model(torch.ones(1, 3))
    >>> len(sink.samples), sink.samples[0].forward_only, sink.closed
    (1, True, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.profiler import ProfilerActivity, profile

from torchinstruments_core._locks import lock
from torchinstruments_core._signals import tensor_root_of
from torchinstruments_core._torch_private import memory_events

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchinstruments_core._records import RunInfo, SampleRecord, StatRow

__all__ = ["RecordingSink", "TensorMemory", "tensor_memory"]


class RecordingSink:
    """Keeps the run's description and every sample, in delivery order."""

    def __init__(self) -> None:
        self.run: RunInfo | None = None
        self.samples: list[SampleRecord] = []
        self.closed = False
        self._lock = lock()

    def open(self, run: RunInfo) -> None:
        """Remember the run."""
        self.run = run

    def write(self, sample: SampleRecord) -> None:
        """Keep the sample."""
        with self._lock:
            self.samples.append(sample)

    def close(self) -> None:
        """Mark the run closed."""
        self.closed = True

    @property
    def rows(self) -> list[StatRow]:
        """Every row of every sample, in order."""
        return [row for sample in self.samples for row in sample.rows]

    def value(
        self,
        layer: str,
        signal: str,
        metric: str,
        *,
        sample_id: int | None = None,
        call_index: int = 0,
        tensor_path: str | None = None,
    ) -> float | None:
        """The value of one metric; from the last sample unless ``sample_id`` is given.

        ``tensor_path`` defaults to the signal's whole tensor (``output`` for the output and its
        gradient); a parameter's signal needs the parameter's name (``weight``).

        Raises:
            KeyError: No such row.
        """
        tensor_path = tensor_path or tensor_root_of(signal)
        samples = (
            self.samples
            if sample_id is None
            else [s for s in self.samples if s.sample_id == sample_id]
        )
        for sample in reversed(samples):
            for row in sample.rows:
                if (row.layer, row.signal, row.metric) == (layer, signal, metric) and (
                    row.call_index,
                    row.tensor_path,
                ) == (call_index, tensor_path):
                    return row.value
        raise KeyError((layer, signal, metric, sample_id, call_index, tensor_path))


@dataclass(frozen=True, slots=True)
class TensorMemory:
    """Tensor memory that a function allocated on the CPU, in bytes above what it started with."""

    peak: int
    """The most that was allocated at any moment while it ran."""
    net: int
    """What was still allocated when it returned (negative when it freed more than it made)."""


def tensor_memory(fn: Callable[[], object]) -> TensorMemory:
    """Run ``fn`` under the torch profiler and measure the CPU tensor memory it allocated.

    The CPU allocator keeps no peak statistic (CUDA's is ``torch.cuda.max_memory_allocated``);
    the profiler's memory events give the running total of every allocation and free instead.
    Use it to check what instrumentation costs, e.g. that a sampled step's ``peak`` exceeds an
    unsampled one's by at most one activation in float32, and that its ``net`` is the same.
    What it cannot see:

    - the frees of tensors allocated while no profiler ran, before the first profiled call of
      the process or between two (torch warns of a block of unknown size): when ``fn`` frees
      what an earlier call made (a training step frees the previous step's gradients), profile
      the earlier call too and measure the second;
    - allocations made by other threads (the profiler follows the calling thread, and the
      backward on the CPU runs there);
    - memory numpy allocates, even when wrapped in a tensor (``torch.from_numpy``);
    - other devices: CUDA has ``torch.cuda.max_memory_allocated``.

    The profiler slows ``fn`` down: do not time it here.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        fn()
    total = peak = 0
    for _, size in memory_events(profiler):
        total += size
        peak = max(peak, total)
    return TensorMemory(peak=peak, net=total)
