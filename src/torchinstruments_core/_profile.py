"""Time and memory of each module call of a sampled forward and its backward (``profile=True``).

A call's forward runs from its forward pre-hook to its forward hook; its backward from the first
gradient reaching one of its outputs to the last gradient reaching one of its inputs (the tensor
hooks that record gradients). Both are inclusive of the modules the call runs.

Every point is a ``Stamp``: a sequence number (the order in which the host took the points) and
a time, ``time.perf_counter`` on the CPU or a CUDA event recorded on the current stream, whose
elapsed times are read on the host only once the sample's transfer has landed (nothing waits for
the device). The observer's own work inside a window (measuring the tensors of the calls inside
it) is stamped too and subtracted, so a call's time is the model's (see ``Overhead``). Memory on
CUDA comes from ``_peaks``.
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from torchinstruments_core._peaks import PeakTracker, Window
from torchinstruments_core._records import Signal, StatRow, UnavailableReason

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

TIME_METRIC = "ms"
"""The metric of ``time`` rows: milliseconds."""

_FORWARD, _BACKWARD = Signal.TIME.spec.paths

Mark = float | torch.cuda.Event
"""A point in time: ``perf_counter`` seconds, or a CUDA event recorded on the stream."""


@dataclass(frozen=True, slots=True)
class Stamp:
    """A point of a sampled step: the order the host took it in, and its time."""

    seq: int
    at: Mark


def elapsed_ms(start: Stamp, end: Stamp) -> float:
    """Milliseconds from ``start`` to ``end``; CUDA events must both have completed."""
    if isinstance(start.at, float) and isinstance(end.at, float):
        return (end.at - start.at) * 1000.0
    assert isinstance(start.at, torch.cuda.Event)
    assert isinstance(end.at, torch.cuda.Event)
    return float(start.at.elapsed_time(end.at))


class Overhead:
    """The observer's own work in a sample, as intervals, to subtract from the calls' windows.

    Args:
        intervals: ``(began, ended)`` of each piece of the observer's work, not overlapping.
    """

    __slots__ = ("_cumulative", "_ends", "_starts")

    def __init__(self, intervals: Iterable[tuple[Stamp, Stamp]]) -> None:
        ordered = sorted(intervals, key=lambda interval: interval[0].seq)
        self._starts = [began.seq for began, _ in ordered]
        self._ends = [ended.seq for _, ended in ordered]
        durations = (elapsed_ms(began, ended) for began, ended in ordered)
        self._cumulative = [0.0, *itertools.accumulate(durations)]

    def within(self, start: Stamp, end: Stamp) -> float:
        """Milliseconds of the intervals that lie entirely between ``start`` and ``end``."""
        first = bisect.bisect_right(self._starts, start.seq)
        last = bisect.bisect_left(self._ends, end.seq)
        return self._cumulative[last] - self._cumulative[first] if last > first else 0.0


@dataclass(slots=True, eq=False)
class CallProfile:
    """The stamps and memory windows of one module call in a sample.

    Attributes:
        layer: The module's name.
        call_index: Which call of it in the sample.
        device: The CUDA device the call runs on; ``None`` elsewhere (time only).
        forward: The start and end of its forward.
        backward: The start of its backward, then each gradient reaching one of its inputs.
        backward_expected: Some output of the call waits for a gradient.
        inputs_expected: How many of its input tensors wait for a gradient.
    """

    layer: str
    call_index: int
    device: torch.device | None
    forward: list[Stamp] = field(default_factory=list)
    backward: list[Stamp] = field(default_factory=list)
    forward_memory: Window | None = None
    backward_memory: Window | None = None
    backward_expected: bool = False
    inputs_expected: int = 0
    inputs_arrived: int = 0

    def rows(self, overhead: Overhead, *, backward: bool) -> Iterator[StatRow]:
        """The ``time`` and ``memory`` rows; the backward's only when a backward ran.

        A forward that raised has no end: its call gives no rows.
        """
        if len(self.forward) < 2:
            return
        yield self._time(_FORWARD, self.forward, overhead)
        if self.forward_memory is not None:
            yield from self.forward_memory.rows(self.layer, self.call_index, _FORWARD)
        if not (backward and self.backward_expected):
            return
        yield self._time(_BACKWARD, self.backward, overhead)
        if self.device is not None:
            window = self.backward_memory or Window(0, 0)
            yield from window.rows(self.layer, self.call_index, _BACKWARD)

    def _time(self, path: str, stamps: list[Stamp], overhead: Overhead) -> StatRow:
        if len(stamps) < 2:  # no gradient reached its inputs: its backward's end is unknown
            reason = UnavailableReason.NO_GRADIENT
            return StatRow(
                self.layer, self.call_index, Signal.TIME, path, TIME_METRIC, None, reason
            )
        start, end = stamps[0], stamps[-1]
        value = max(elapsed_ms(start, end) - overhead.within(start, end), 0.0)
        return StatRow(self.layer, self.call_index, Signal.TIME, path, TIME_METRIC, value, None)


def events(stamps: Iterable[Stamp]) -> Iterator[torch.cuda.Event]:
    """The CUDA events among ``stamps``: they must complete before their times are read."""
    for stamp in stamps:
        if isinstance(stamp.at, torch.cuda.Event):
            yield stamp.at


class CallProfiler:
    """Takes the stamps and memory readings of the calls of sampled forwards and backwards.

    One per observer; it keeps one ``PeakTracker`` per CUDA device.
    """

    __slots__ = ("_sequence", "_trackers")

    def __init__(self) -> None:
        self._sequence = itertools.count()
        self._trackers: dict[torch.device, PeakTracker] = {}

    def stamp(self, device: torch.device | None) -> Stamp:
        """Now: a CUDA event recorded on ``device``'s current stream, or ``perf_counter``."""
        if device is None:
            return Stamp(next(self._sequence), time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        return Stamp(next(self._sequence), event)

    def start_forward(self, profile: CallProfile) -> Stamp:
        """The call's forward starts now."""
        if profile.device is not None:
            profile.forward_memory = self._tracker(profile.device).open()
        profile.forward.append(self.stamp(profile.device))
        return profile.forward[0]

    def end_forward(self, profile: CallProfile) -> Stamp:
        """The call's forward ends now."""
        end = self.stamp(profile.device)
        profile.forward.append(end)
        if profile.forward_memory is not None and profile.device is not None:
            self._tracker(profile.device).read(profile.forward_memory, close=True)
        return end

    def cross(self, boundary: list[tuple[CallProfile, bool]]) -> None:
        """A gradient reached a tensor: the backward of each ``(call, ends)`` ends or starts.

        One stamp for all of them; the ends are read before the starts open.
        """
        now = self.stamp(boundary[0][0].device)
        for profile, ends in boundary:
            if ends:
                self._input_gradient(profile, now)
        for profile, ends in boundary:
            if not ends:
                self._output_gradient(profile, now)

    def _output_gradient(self, profile: CallProfile, now: Stamp) -> None:
        """A gradient reached one of the call's outputs: the first one starts its backward."""
        if profile.backward:
            return
        if profile.device is not None:
            profile.backward_memory = self._tracker(profile.device).open()
        profile.backward.append(now)

    def _input_gradient(self, profile: CallProfile, now: Stamp) -> None:
        """A gradient reached one of the call's inputs: the last one ends its backward."""
        if not profile.backward:
            return  # no output of the call took a gradient: its backward has no start
        profile.backward.append(now)
        profile.inputs_arrived += 1
        if profile.backward_memory is not None and profile.device is not None:
            done = profile.inputs_arrived >= profile.inputs_expected
            self._tracker(profile.device).read(profile.backward_memory, close=done)

    def forget(self, profile: CallProfile) -> None:
        """Stop tracking the call's memory (its sample closed)."""
        if profile.device is None:
            return
        for window in (profile.forward_memory, profile.backward_memory):
            if window is not None:
                self._tracker(profile.device).forget(window)

    def _tracker(self, device: torch.device) -> PeakTracker:
        tracker = self._trackers.get(device)
        if tracker is None:
            tracker = self._trackers.setdefault(device, PeakTracker(device))
        return tracker


def call_device(
    tensors: Iterator[torch.Tensor], module: torch.nn.Module | None
) -> torch.device | None:
    """The CUDA device a call runs on (its first input tensor's, else its first parameter's).

    ``None`` for a call on another device: it is timed with ``perf_counter``, without memory.
    """
    device = next((t.device for t in tensors), None)
    if device is None and module is not None:
        device = next((p.device for p in module.parameters()), None)
    return device if device is not None and device.type == "cuda" else None
