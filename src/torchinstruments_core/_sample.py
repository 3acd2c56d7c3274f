"""One sample: the measurements of a root forward and of the backward through its graph.

A step record (the tensors of one optimizer step) is a ``Sample`` of kind ``RecordKind.STEP``:
it is measured, transferred, built and delivered the same way.

A sample gathers device-side measurements while the forward and the backward run, then closes: its
device tensors start crossing to the host in one transfer, and once they have landed ``build``
turns them into a ``SampleRecord`` of rows and histograms.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from torchinstruments_core._locks import lock
from torchinstruments_core._measurement import shareable
from torchinstruments_core._recompute import RecomputeLedger
from torchinstruments_core._records import (
    HistogramRecord,
    RecordKind,
    SampleRecord,
    Signal,
    StatRow,
    UnavailableReason,
)
from torchinstruments_core._rows import RowPart, SampleRows, row_parts
from torchinstruments_core._torch_private import version
from torchinstruments_core._transfer import HostTransfer
from torchinstruments_core.reducers._binning import split_histograms

if TYPE_CHECKING:
    from collections.abc import Iterator

    from torch.utils.hooks import RemovableHandle

    from torchinstruments_core._background import ReductionWorker
    from torchinstruments_core._capture import GradientSlot
    from torchinstruments_core._measurement import Measurement
    from torchinstruments_core._native_worker import NativeWorker
    from torchinstruments_core._profile import CallProfile, Stamp


@dataclass(frozen=True, slots=True)
class Site:
    """Where a tensor was observed: module, call, signal and position in the output.

    For a parameter: the module owning it, call 0, its signal and its name (``weight``).
    """

    layer: str
    call_index: int
    signal: Signal
    tensor_path: str


class _Taken(NamedTuple):
    """A tensor a sample measured, and the measurement (see ``Sample.measured``)."""

    tensor: weakref.ref[torch.Tensor]
    version: int
    scale: object
    histogram: bool
    measurement: Measurement


class _Landed(NamedTuple):
    """A measurement's values on the host."""

    n_finite: float | None
    results: list[list[float] | None]
    histogram: list[float] | None


class Sample:
    """The open state of one sample. Thread-safe: gradients may arrive on autograd threads."""

    def __init__(
        self,
        sample_id: int,
        step: int | None,
        timestamp: float,
        gradient_scale: float | torch.Tensor | None,
        kind: RecordKind = RecordKind.FORWARD,
    ) -> None:
        self.sample_id = sample_id
        self.kind = kind
        self.step = step
        # A forward with autograd on whose modules compute outputs without it: see _recompute.
        self.grad_enabled = torch.is_grad_enabled()
        self.recompute = RecomputeLedger()
        self.timestamp = timestamp
        self.gradient_scale = gradient_scale
        self.lock = lock()
        self.closed = False
        self.backward_task: int | None = None
        self.duration_s = 0.0
        self.note: str | None = None  # a step record's note (see ``SampleRecord.note``)
        self.scope: str | None = None  # the loggers' key scope (see ``SampleRecord.scope``)
        self._calls: dict[str, int] = {}
        # each site's measurement, and whether its histogram (if any) is the site's to deliver
        self._measured: list[tuple[Site, Measurement, bool]] = []
        self._taken: dict[int, _Taken] = {}  # by the id of the tensor measured (``measured``)
        self._expected_gradients: list[tuple[Site, tuple[str, ...]]] = []
        self._received: set[Site] = set()
        self.handles: list[RemovableHandle] = []
        # profile=True: each call's time and memory; calls whose forward runs, per module, with
        # the call index their pre-hook took (see ``open_call``)
        self.profiles: list[CallProfile] = []
        self.overhead: list[tuple[Stamp, Stamp]] = []  # the observer's own work, stamped
        # the hook stamping each tensor's crossing calls, by id (checked against the weakref)
        self.boundaries: dict[int, tuple[weakref.ref[torch.Tensor], GradientSlot]] = {}
        self._open_calls: dict[str, list[tuple[int, CallProfile | None]]] = {}
        # Held while the forward runs; afterwards only the gradient hooks hold it (see Observer).
        self.sentinel: object | None = None
        # outputs copied for the worker, with their version: did the forward change them after?
        # Each is held (a detached alias, sharing its version) or, past the bytes allowed for
        # holding (``OutputProbe``), only weakly referenced.
        self.unverified: list[tuple[Site, torch.Tensor | weakref.ref[torch.Tensor], int]] = []
        self.held_bytes = 0

    def next_call_index(self, layer: str) -> int:
        """The call index of the next call of ``layer`` within this sample."""
        index = self._calls.get(layer, 0)
        self._calls[layer] = index + 1
        return index

    def open_call(self, layer: str, call_index: int, profile: CallProfile | None) -> None:
        """A call of ``layer`` started (its forward pre-hook): keep its index until it ends."""
        self._open_calls.setdefault(layer, []).append((call_index, profile))
        if profile is not None:
            self.profiles.append(profile)

    def end_call(self, layer: str) -> tuple[int, CallProfile | None]:
        """A call of ``layer`` ends (its forward hook): the index ``open_call`` gave it.

        Without a pre-hook (inputs and profile off, or a sample opened mid-forward) the call
        takes its index now.
        """
        calls = self._open_calls.get(layer)
        if calls:
            return calls.pop()
        return self.next_call_index(layer), None

    def add(self, site: Site, measurement: Measurement, *, histogram: bool = True) -> None:
        """Keep a measurement until the sample closes; after that it is dropped.

        A closed sample's values are already crossing to the host: a gradient that arrives late
        (another thread, a second backward) must not join them. A dropped measurement is still
        settled, so that a reducer that failed on it is reported. ``histogram``: whether the
        measurement's histogram, if it has one, is delivered for ``site`` (a measurement taken
        for a focus layer and reused for another layer's site has one that site did not ask
        for).
        """
        with self.lock:
            dropped = self.closed
            if not dropped:
                self._measured.append((site, measurement, histogram))
                if site.signal.gradient_of is not None:
                    self._received.add(site)
            # one the sample holds already (reused) is settled by whoever closed the sample
            ours = dropped and any(m is measurement for _, m, _ in self._measured)
        if dropped and not ours:  # still told: a reducer that failed on it is reported, as inline
            error = measurement.settle()
            if error is not None:
                raise error

    def measured(
        self, tensor: torch.Tensor, histogram: bool, scale: float | torch.Tensor | None
    ) -> Measurement | None:
        """The measurement this sample took of ``tensor`` already, if it holds for it now.

        A module's input is often the previous module's output, a module may return its input
        (``nn.Identity``, ``nn.Dropout(p=0)``), and the gradient flowing into such a tensor
        reaches the hooks of each site it was observed at: the same tensor, measured again.
        Its measurement stands if the tensor is that very object (alive), its version counter
        has not moved since (no in-place op changed it), it was divided by the same ``scale``
        object, and it has a histogram if ``histogram`` asks for one; never once the sample
        has closed. Only tensors whose in-place changes move their version are remembered
        (``_measurement.shareable``). A write that bypasses torch's in-place operators (through
        ``.data``, a numpy view) is not seen, as it is not by the reduction worker reading a
        tensor in place.
        """
        taken = self._taken.get(id(tensor))
        if self.closed or taken is None or taken.tensor() is not tensor:
            return None
        if taken.scale is not scale:
            return None
        if (histogram and not taken.histogram) or version(tensor) != taken.version:
            return None
        return taken.measurement

    def remember(
        self,
        tensor: torch.Tensor,
        histogram: bool,
        scale: float | torch.Tensor | None,
        measurement: Measurement,
        *,
        groups: bool | None = None,
    ) -> None:
        """Note that ``measurement`` is of ``tensor`` as it is now, for ``measured``.

        ``groups``: whether a process group is up, if the caller knows (``shareable``).
        """
        if shareable(tensor, groups=groups):
            self._taken[id(tensor)] = _Taken(
                weakref.ref(tensor), version(tensor), scale, histogram, measurement
            )

    def expect_gradient(self, site: Site, metrics: tuple[str, ...]) -> None:
        """Note that a gradient hook waits on ``site``; if none arrives, its rows say so."""
        self._expected_gradients.append((site, metrics))

    @property
    def expects_gradients(self) -> bool:
        """Whether a gradient hook waits on some output of this sample."""
        return bool(self._expected_gradients)

    @property
    def forward_only(self) -> bool:
        """Whether no backward reached this sample (never, for a step record)."""
        return self.kind is RecordKind.FORWARD and self.backward_task is None

    def settle(self) -> Exception | None:
        """Wait for the reduction worker to fill in every measurement (``Measurement.settle``).

        Returns the first error of what the measurements deferred (a reducer's failure
        reported as an error), for the caller to raise once the sample is queued.

        Each worker is waited for once, up to the last of this sample's jobs, before any
        measurement settles: the kernels' queue then has the waiting thread run the jobs its
        own thread has not started (``_native.queue_wait``), where one wait per job would wait
        for the job that thread is running, one after the other.
        """
        distinct = self._distinct()
        last: dict[int, tuple[ReductionWorker | NativeWorker, int]] = {}
        for measurement in distinct:
            worker, ticket = measurement.worker, measurement.ticket
            if worker is not None and ticket is not None:
                known = last.get(id(worker))
                if known is None or known[1] < ticket:
                    last[id(worker)] = (worker, ticket)
        for worker, ticket in last.values():
            worker.wait(ticket)
        errors = [measurement.settle() for measurement in distinct]
        return next((error for error in errors if error is not None), None)

    def _distinct(self) -> list[Measurement]:
        """Each measurement once (one may stand for several sites), in the order first added."""
        return list({id(m): m for _, m, _ in self._measured}.values())

    def start_transfer(self) -> HostTransfer:
        """Start moving every device value of this sample to the host (once ``settle``d)."""
        return HostTransfer(list(self._device_tensors()), list(self._events()))

    def _events(self) -> Iterator[torch.cuda.Event]:
        from torchinstruments_core._profile import events

        for profile in self.profiles:
            yield from events((*profile.forward, *profile.backward))
        yield from events(stamp for interval in self.overhead for stamp in interval)

    def _device_tensors(self) -> Iterator[torch.Tensor]:
        """The values of each distinct measurement, in the order ``_landed`` reads them.

        Only tensors: the values the compiled kernels gave are host floats already.
        """
        for measurement in self._distinct():
            if isinstance(measurement.n_finite, torch.Tensor):
                yield measurement.n_finite  # 0-d: the transfer reads it without a reshape
            for result in measurement.results:
                if isinstance(result.values, torch.Tensor):
                    yield result.values
            if isinstance(measurement.histogram, torch.Tensor):
                yield measurement.histogram

    def build(self, transfer: HostTransfer, *, run_id: str, rank: int) -> SampleRecord:
        """Turn the landed values into the sample's record (its rows kept as ``RowPart``s)."""
        host = iter(transfer.wait())
        landed = {id(m): _landed(m, host) for m in self._distinct()}
        parts: list[RowPart] = []
        packed: list[tuple[Site, list[float], Measurement]] = []
        for site, measurement, histogram in self._measured:
            values = landed[id(measurement)]
            parts.append(_part(site, measurement, values))
            if histogram and values.histogram is not None:
                packed.append((site, values.histogram, measurement))
        histograms = _histograms(packed)
        if not self.forward_only:
            parts.extend(self._missing_gradient_parts())
        if self.profiles:  # their CUDA events completed with the transfer
            parts.extend(row_parts(tuple(self._profile_rows())))
        return SampleRecord(
            run_id=run_id,
            rank=rank,
            sample_id=self.sample_id,
            step=self.step,
            timestamp=self.timestamp,
            forward_only=self.forward_only,
            collection_duration_ms=self.duration_s * 1000.0,
            rows=SampleRows(parts),
            histograms=tuple(histograms),
            kind=self.kind,
            note=self.note,
            scope=self.scope,
        )

    def _profile_rows(self) -> Iterator[StatRow]:
        from torchinstruments_core._profile import Overhead

        overhead = Overhead(self.overhead)
        for profile in self.profiles:
            yield from profile.rows(overhead, backward=not self.forward_only)

    def _missing_gradient_parts(self) -> Iterator[RowPart]:
        for site, metrics in self._expected_gradients:
            if site not in self._received:
                missing = (None,) * len(metrics)
                reasons = (UnavailableReason.NO_GRADIENT,) * len(metrics)
                yield RowPart(*_where(site), metrics, missing, reasons)


def _where(site: Site) -> tuple[str, int, Signal, str]:
    return site.layer, site.call_index, site.signal, site.tensor_path


def _landed(measurement: Measurement, host: Iterator[list[float]]) -> _Landed:
    """A measurement's values on the host.

    Its tensors' are read from ``host``, in the order ``_device_tensors`` gave them; host floats
    (the compiled kernels') are taken as they are.
    """
    n_finite = measurement.n_finite
    if isinstance(n_finite, torch.Tensor):
        n_finite = next(host)[0]
    results = [_read(result.values, host) for result in measurement.results]
    return _Landed(n_finite, results, _read(measurement.histogram, host))


def _read(
    values: torch.Tensor | list[float] | None, host: Iterator[list[float]]
) -> list[float] | None:
    """Values of a measurement: a tensor's, next in ``host``; host floats as they are."""
    return next(host) if isinstance(values, torch.Tensor) else values


def _part(site: Site, measurement: Measurement, landed: _Landed) -> RowPart:
    """The rows of one measurement at ``site``, from its values on the host."""
    metrics = measurement.metrics
    if measurement.reason is not None:
        reasons = (measurement.reason,) * len(metrics)
        return RowPart(*_where(site), metrics, (None,) * len(metrics), reasons)
    values: list[float | None] = []
    missing: list[str | None] | None = None  # each value's reason, once one is missing
    for result, got in zip(measurement.results, landed.results, strict=True):
        if got is not None and len(got) != len(result.metrics):
            raise ValueError(f"{len(got)} values for the metrics {result.metrics}")
        if got is not None and all(map(math.isfinite, got)):
            values.extend(got)
            if missing is not None:
                missing.extend([None] * len(got))
            continue
        if missing is None:
            missing = [None] * len(values)
        if got is None:
            values.extend([None] * len(result.metrics))
            missing.extend([result.error] * len(result.metrics))
            continue
        # a value that is not finite: none to take (no finite entries), or one that overflowed
        reason = (
            UnavailableReason.NO_FINITE_VALUES
            if landed.n_finite == 0
            else UnavailableReason.NON_FINITE_RESULT
        )
        for value in got:
            finite = math.isfinite(value)
            values.append(value if finite else None)
            missing.append(None if finite else reason)
    return RowPart(*_where(site), metrics, values, missing)


def _histograms(packed: list[tuple[Site, list[float], Measurement]]) -> list[HistogramRecord]:
    """The records of the sample's histograms.

    The edges the kernels found are taken as they are; the others are searched together.
    """
    searched = iter(
        split_histograms(
            [
                (values, m.histogram_bins, m.histogram_float64)
                for _, values, m in packed
                if m.histogram_edges is None
            ]
        )
    )
    parts = [
        next(searched)
        if m.histogram_edges is None
        else (m.histogram_edges, values[3 : 3 + m.histogram_bins], values[3 + m.histogram_bins])
        for _, values, m in packed
    ]
    return [
        HistogramRecord(
            site.layer,
            site.call_index,
            site.signal,
            site.tensor_path,
            edges=tuple(edges),
            counts=tuple(counts),
            nonfinite_count=int(nonfinite),
        )
        for (site, _, _), (edges, counts, nonfinite) in zip(packed, parts, strict=True)
        # no finite entries: nothing to bin (the rows say no_finite_values). The edges are
        # non-decreasing, so the two ends are finite exactly when all of them are.
        if math.isfinite(edges[0]) and math.isfinite(edges[-1])
    ]
