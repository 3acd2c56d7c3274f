"""Allocated memory and its peak over windows of a CUDA device's work that may nest or overlap.

The caching allocator keeps one peak since its last reset (``torch.cuda.max_memory_allocated``).
To give each open window its own peak, every time a window opens or is read the peak so far is
folded into every window open at that moment, and the statistic is reset
(``torch.cuda.reset_peak_memory_stats``): a window's peak is then the highest allocation between
its opening and its last reading, inclusive of the windows inside it. Nothing here waits for the
device: the allocator's statistics live on the host.

The reset is the user's too: ``torch.cuda.max_memory_allocated()`` read after a profiled sample
covers only what followed its last reading (the README says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from torchinstruments_core._locks import lock
from torchinstruments_core._records import Signal, StatRow, UnavailableReason

if TYPE_CHECKING:
    from collections.abc import Iterator

ALLOCATED_METRIC = "allocated_delta_mib"
"""Allocated memory at the end of the window minus at its start, MiB."""

PEAK_METRIC = "peak_delta_mib"
"""The peak allocated memory within the window minus at its start, MiB."""

_MIB = float(2**20)


@dataclass(slots=True, eq=False)
class Window:
    """The allocator's readings over one forward or backward of a call, in bytes."""

    start: int
    peak: int
    end: int | None = None

    def rows(self, layer: str, call_index: int, path: str) -> Iterator[StatRow]:
        """The ``memory`` rows of this window; unavailable (``no_gradient``) if never read."""
        if self.end is None:
            reason = UnavailableReason.NO_GRADIENT
            for metric in (ALLOCATED_METRIC, PEAK_METRIC):
                yield StatRow(layer, call_index, Signal.MEMORY, path, metric, None, reason)
            return
        allocated = (self.end - self.start) / _MIB
        peak = (max(self.peak, self.end) - self.start) / _MIB
        yield StatRow(layer, call_index, Signal.MEMORY, path, ALLOCATED_METRIC, allocated, None)
        yield StatRow(layer, call_index, Signal.MEMORY, path, PEAK_METRIC, peak, None)


class PeakTracker:
    """The windows open at once on one CUDA device. Thread-safe: autograd hooks run anywhere."""

    __slots__ = ("_device", "_lock", "_open")

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._lock = lock()
        self._open: list[Window] = []

    def open(self) -> Window:
        """A window that starts now."""
        with self._lock:
            self._fold()
            now = torch.cuda.memory_allocated(self._device)
            window = Window(start=now, peak=now)
            self._open.append(window)
            return window

    def read(self, window: Window, *, close: bool) -> None:
        """Take now as ``window``'s end (so far); stop tracking it when ``close``."""
        with self._lock:
            if window not in self._open:
                return
            self._fold()
            window.end = torch.cuda.memory_allocated(self._device)
            if close:
                self._open.remove(window)

    def forget(self, window: Window) -> None:
        """Stop tracking ``window``; it keeps its last reading."""
        with self._lock:
            if window in self._open:
                self._open.remove(window)

    def _fold(self) -> None:
        peak = torch.cuda.max_memory_allocated(self._device)
        for window in self._open:
            window.peak = max(window.peak, peak)
        torch.cuda.reset_peak_memory_stats(self._device)
