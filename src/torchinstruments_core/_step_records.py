"""Step records: the rows of one optimizer step, beside the per-forward samples.

A step record holds what belongs to an optimizer step rather than to a forward: a parameter, its
gradient, its update, the optimizer's state (signals of kind ``RecordKind.STEP``). Its rows sit in
the same long table: ``layer`` is the module owning the parameter, ``tensor_path`` the parameter's
name within it (``weight``), ``call_index`` 0. It takes its id from the samples' sequence, so
``(run_id, rank, sample_id)`` stays a unique key, and ``samples.parquet`` says ``kind="step"``.

It is a ``Sample`` of kind ``STEP``: measured on the tensors' devices, moved to the host in one
transfer, and delivered through the same queue and sink as the samples (see ``_delivery``).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from torchinstruments_core._exceptions import ConfigurationError
from torchinstruments_core._failures import REDUCER_CONSEQUENCE
from torchinstruments_core._measurement import Measurement, ReducerResult, reducer_error_reason
from torchinstruments_core._probe import measure_site
from torchinstruments_core._sample import Sample, Site
from torchinstruments_core._sharded import ShardedBatch, is_sharded
from torchinstruments_core._signals import RecordKind, Signal, signals_of

if TYPE_CHECKING:
    from collections.abc import Iterable

    from torchinstruments_core._failures import FailureReport
    from torchinstruments_core._measure import Measurer


@dataclass(frozen=True, slots=True)
class StepTensor:
    """One tensor of an optimizer step to measure into its step record.

    Attributes:
        layer: The clean name of the module owning the parameter (``encoder.0``).
        signal: A signal of kind ``RecordKind.STEP`` (``Signal.PARAMETER``).
        name: The parameter's name within its module (``weight``): the row's ``tensor_path``.
        tensor: The tensor, on any device; it is only read.
        histogram: Also compute its histogram.
        extra_metrics: Further metrics of the tensor, computed by the caller
            (``update_to_weight`` on an update), as ``(metric, value)`` pairs: each a device
            scalar, or a host float where the kernels summed it on the CPU (``_step_math``).
        scale: Measure the tensor divided by this (a loss scale), on its device.
        in_place: Nothing changes the tensor until its reduction has run, so it is reduced
            where it is, without a copy (``Measurer.measure``): an update, the optimizer's
            state after the update (the post-hook measures them and delivers the record before
            it returns), a parameter's copy taken for its update (waited for before the update
            is formed in it, ``_step_tensors.updates``), a gradient (waited for before the
            optimizer runs, or before its post-hook returns where the optimizer only reads
            it, ``_step_tensors.gradient_tensors``).

    Raises:
        ConfigurationError: ``signal`` belongs to forward samples.
    """

    layer: str
    signal: Signal
    name: str
    tensor: torch.Tensor
    histogram: bool = False
    extra_metrics: tuple[tuple[str, torch.Tensor | float], ...] = ()
    scale: torch.Tensor | None = None
    in_place: bool = False

    def __post_init__(self) -> None:
        if Signal(self.signal).kind is not RecordKind.STEP:
            choices = [s.value for s in signals_of(RecordKind.STEP)]
            raise ConfigurationError.invalid("signal", str(self.signal), choices)


@dataclass(frozen=True, slots=True)
class StepScalars:
    """Scalars of a step record computed by the caller, not by the reducers (whole-model rows).

    Attributes:
        layer: The row's ``layer`` (``MODEL_LAYER`` for the whole model).
        signal: A signal of kind ``RecordKind.STEP``.
        name: The row's ``tensor_path`` (``ALL_PARAMETERS``).
        metrics: The metric names, one per entry of ``values``.
        values: The values, in the order of ``metrics``: a 1-D device tensor, or host floats
            (computed from the kernels' host sums alone, ``_step_math.whole_update``).
        n_finite: How many finite entries the values describe (a device scalar, or a host
            float beside host values): a non-finite value of a set without finite entries reads
            ``no_finite_values``, else ``non_finite_result``.
    """

    layer: str
    signal: Signal
    name: str
    metrics: tuple[str, ...]
    values: torch.Tensor | list[float]
    n_finite: torch.Tensor | float


@dataclass(frozen=True, slots=True)
class UnavailableRow:
    """A row of a step record without values, and why (whole-model rows that cannot be made).

    Attributes:
        layer: The row's ``layer`` (``MODEL_LAYER``).
        signal: A signal of kind ``RecordKind.STEP``.
        name: The row's ``tensor_path`` (``ALL_PARAMETERS``).
        metrics: The metric names.
        reason: An ``UnavailableReason``.
    """

    layer: str
    signal: Signal
    name: str
    metrics: tuple[str, ...]
    reason: str


class StepRecorder:
    """Measures the tensors of one optimizer step into a step record, on their devices.

    A sharded tensor (a ``DTensor`` with a ``Shard`` placement) is reduced to this rank's partial
    statistics; ``combine`` joins every rank's, for all of a record's sharded tensors at once,
    with one collective per process group (see ``_sharded``). A record that does not write (a
    rank that does not observe, ``writes=False``) measures only its sharded tensors, so that it
    joins the collectives the observing ranks run.

    Args:
        measurer: Reduces each tensor, as it does the samples' tensors.
        failures: Where a failing reducer is reported.
    """

    __slots__ = ("_batches", "_failures", "_measurer")

    def __init__(self, measurer: Measurer, failures: FailureReport) -> None:
        self._measurer = measurer
        self._failures = failures
        self._batches: dict[int, ShardedBatch] = {}

    def open(self, record_id: int, step: int | None) -> Sample:
        """A new, empty step record with id ``record_id`` for trainer step ``step``."""
        return Sample(record_id, step, time.time(), None, kind=RecordKind.STEP)

    def measure(
        self,
        record: Sample,
        tensors: Iterable[StepTensor | StepScalars | UnavailableRow],
        *,
        writes: bool = True,
    ) -> dict[int, Measurement]:
        """Reduce each tensor into ``record`` (its values stay on the device until delivery).

        Returns:
            The measurement of each ``StepTensor`` reduced here, by the id of its tensor (a
            sharded one's partial is left out: it is complete only once combined).
        """
        started = time.perf_counter()
        measured: dict[int, Measurement] = {}
        for item in tensors:
            site = Site(item.layer, 0, item.signal, item.name)
            if isinstance(item, StepTensor) and is_sharded(item.tensor):
                record.add(site, self._partial(record, item, site))
            elif not writes:
                continue
            elif isinstance(item, StepScalars):
                record.add(site, _scalars(item))
            elif isinstance(item, UnavailableRow):
                record.add(site, Measurement(item.reason, item.metrics))
            else:
                measurement = measure_site(
                    self._measurer,
                    self._failures,
                    item.tensor,
                    site,
                    item.histogram,
                    item.scale,
                    step=True,
                    in_place=item.in_place,
                )
                if item.extra_metrics:
                    measurement.then(functools.partial(_add_extra, item.extra_metrics))
                record.add(site, measurement)
                measured[id(item.tensor)] = measurement
        record.duration_s += time.perf_counter() - started
        return measured

    def combine(self, record: Sample) -> None:
        """Join the other ranks' partials of ``record``'s sharded tensors (collectives here)."""
        batch = self._batches.pop(id(record), None)
        if batch is None:
            return
        started = time.perf_counter()
        try:
            batch.combine()
        except Exception as error:  # observing must never break the training step
            self._failures.failed(
                "combining sharded tensors across ranks", error, "sharded", REDUCER_CONSEQUENCE
            )
            batch.fail(reducer_error_reason(error))
        record.duration_s += time.perf_counter() - started

    def _partial(self, record: Sample, item: StepTensor, site: Site) -> Measurement:
        batch = self._batches.setdefault(id(record), ShardedBatch())
        try:
            # extra metrics are per-shard ratios (update_to_weight): not those of the whole
            # tensor, so a sharded tensor has none; no histogram either (see _sharded)
            return batch.add(self._measurer, item.tensor, item.scale)
        except Exception as error:
            where = f"{site.layer} {site.signal} {site.tensor_path}"
            self._failures.failed(
                f"a sharded tensor failed on {where}", error, "sharded", REDUCER_CONSEQUENCE
            )
            reason = reducer_error_reason(error)
            return Measurement(reason, self._measurer.metrics, errors=[error])


def _scalars(item: StepScalars) -> Measurement:
    if not isinstance(item.values, torch.Tensor):  # host floats: nothing to transfer
        result = ReducerResult(item.metrics, list(item.values))
        n_finite = item.n_finite
        finite = float(n_finite.item()) if isinstance(n_finite, torch.Tensor) else float(n_finite)
        return Measurement(None, item.metrics, n_finite=finite, results=[result])
    values = item.values.detach().reshape(-1)
    result = ReducerResult(item.metrics, values)
    counted = item.n_finite
    if not isinstance(counted, torch.Tensor):
        counted = torch.tensor(counted, dtype=values.dtype, device=values.device)
    return Measurement(None, item.metrics, n_finite=counted.detach(), results=[result])


def _add_extra(
    extra: tuple[tuple[str, torch.Tensor | float], ...], measurement: Measurement
) -> None:
    """Append ``extra``'s values to a complete measurement that has values.

    Host floats beside a measurement of host floats (the kernels reduced it on the CPU) are
    appended as they are; otherwise each value becomes a scalar on the measurement's device.
    """
    if measurement.reason is not None:
        return
    names = tuple(name for name, _ in extra)
    n_finite, device = measurement.n_finite, None
    if isinstance(n_finite, torch.Tensor):
        device = n_finite.device
    elif n_finite is not None:  # host floats: the compiled kernels reduced it on the CPU
        if all(isinstance(value, float) for _, value in extra):
            measurement.results.append(ReducerResult(names, [float(v) for _, v in extra]))
            measurement.metrics = (*measurement.metrics, *names)
            return
        device = torch.device("cpu")
    dtype = torch.float32 if device is not None and device.type == "mps" else torch.float64
    values = torch.stack([_scalar(value, device, dtype) for _, value in extra])
    measurement.results.append(ReducerResult(names, values))
    measurement.metrics = (*measurement.metrics, *names)


def _scalar(
    value: torch.Tensor | float, device: torch.device | None, dtype: torch.dtype
) -> torch.Tensor:
    """``value`` as a 0-d tensor of ``dtype`` on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(device, dtype)
    return torch.tensor(value, dtype=dtype, device=device)
