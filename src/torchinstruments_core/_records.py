"""The records that cross from the engine to sinks: one sample, its rows and its histograms.

Rows form one long table (``history.parquet``): one row per scalar, ``value`` is ``None``
exactly when ``unavailable_reason`` is set. A record is a forward sample or an optimizer step's
record (``SampleRecord.kind``); both go through the same sinks. The signals are defined in
``_signals``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import TYPE_CHECKING

from torchinstruments_core._signals import RecordKind, Signal

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "STEP_SKIPPED",
    "HistogramRecord",
    "LayerInfo",
    "RecordKind",
    "RunInfo",
    "SampleRecord",
    "Signal",
    "StatRow",
    "UnavailableReason",
]


class UnavailableReason(StrEnum):
    """Why a value could not be computed. A reducer error carries its message after a colon."""

    EMPTY_TENSOR = "empty_tensor"
    NO_FINITE_VALUES = "no_finite_values"
    NON_FINITE_RESULT = "non_finite_result"
    UNSUPPORTED_DTYPE = "unsupported_dtype"
    SPARSE_TENSOR = "sparse_tensor"
    META_TENSOR = "meta_tensor"
    TENSOR_SUBCLASS = "tensor_subclass"
    PARTIAL_DTENSOR = "partial_dtensor"
    SHARDED_TENSOR = "sharded_tensor"
    """A reducer other than the moments and quartiles has no combination across shards."""
    NO_GRADIENT = "no_gradient"
    MODIFIED_IN_PLACE = "modified_in_place"
    """A tensor the CPU reduction worker read without a copy (a gradient, an output) changed in
    place before that was checked (``Measurer.measure(shared=True)``; an optimizer's gradient
    reduced during its step, ``_step_tensors.leaves_gradients``): its values could mix the old
    and the new."""
    REDUCER_ERROR = "reducer_error"


@dataclass(frozen=True, slots=True)
class StatRow:
    """One scalar of one tensor of one module call within a sample (or of one parameter).

    In a step record ``layer`` is the module owning the parameter, ``tensor_path`` the
    parameter's name within it (``weight``) and ``call_index`` 0.
    """

    layer: str
    call_index: int
    signal: Signal
    tensor_path: str
    metric: str
    value: float | None
    unavailable_reason: str | None


@dataclass(frozen=True, slots=True)
class HistogramRecord:
    """A fixed-bin histogram of the finite entries of one tensor.

    ``edges`` has one more entry than ``counts``; ``nonfinite_count`` entries were left out.
    """

    layer: str
    call_index: int
    signal: Signal
    tensor_path: str
    edges: tuple[float, ...]
    counts: tuple[float, ...]
    nonfinite_count: int

    def __reduce__(self) -> tuple[type[HistogramRecord], tuple[object, ...]]:
        """Pickled as its fields, in order, for the run directory's writer process.

        The slots dataclass's own ``__getstate__`` lists its fields at every call: pickling a
        CNN sample's 16 histograms took 141 us that way, 78 us this way, on the training thread.
        """
        return (HistogramRecord, _HISTOGRAM_FIELDS(self))


_HISTOGRAM_FIELDS = operator.attrgetter(*(field.name for field in fields(HistogramRecord)))


@dataclass(frozen=True, slots=True)
class SampleRecord:
    """Everything measured for one sample: a root forward and the backward through its graph.

    The same record carries a *step record* (``kind`` is ``RecordKind.STEP``): the rows of one
    optimizer step (parameters and what belongs to them), which take their ids from the same
    sequence as the samples, so ``(run_id, rank, sample_id)`` stays a unique key.

    Attributes:
        run_id: Identifier of the run (per process unless the caller passed one to every rank).
        rank: Global rank of the process that took the sample.
        sample_id: 0, 1, 2 … within the run and rank, shared by samples and step records.
        step: The trainer step the sample belongs to, ``None`` without a trainer.
        timestamp: Seconds since the epoch when the root forward (or the step record) began.
        forward_only: No gradient reached any observed output of this sample; always ``False``
            for a step record.
        collection_duration_ms: Host time spent observing this sample (hooks, reductions launched,
            transfer), so the cost of telemetry is visible.
        rows: The scalars, in the order they were measured: a sequence of ``StatRow`` (the
            engine's records keep them as a few columns per tensor until a row is read, see
            ``_rows.SampleRows``; equal to a tuple of the same rows).
        histograms: Histograms of the focus modules.
        optimizer_step: The adapter's own count of optimizer steps (0, 1, 2 … since it began
            observing) when ``step`` is the user's number for that step (the Accelerate tracker
            numbers steps as ``accelerator.log(step=...)`` does); ``None`` otherwise.
        kind: ``RecordKind.FORWARD`` for a sample, ``RecordKind.STEP`` for a step record.
        note: Why a step record has no rows, when it stands for an optimizer step that did not
            run (``STEP_SKIPPED``); ``None`` otherwise.
        scope: Where the loggers put this sample's keys under their prefix, when the trainer
            step has samples of different kinds (``phase_2``, the second forward and backward
            of a manual-optimization step: ``<prefix>/phase_2/...``); ``None``: the prefix
            itself. Not in the run directory, where the sample id tells them apart.
    """

    run_id: str
    rank: int
    sample_id: int
    step: int | None
    timestamp: float
    forward_only: bool
    collection_duration_ms: float
    rows: Sequence[StatRow]
    histograms: tuple[HistogramRecord, ...]
    optimizer_step: int | None = None
    kind: RecordKind = RecordKind.FORWARD
    note: str | None = None
    scope: str | None = None


STEP_SKIPPED = "optimizer_step_skipped"
"""The ``note`` of a sampled trainer step in which no watched optimizer stepped: the fp16
``GradScaler`` found inf or NaN gradients and skipped ``optimizer.step()`` (or the trainer skipped
the step). Such a step record has no rows."""


@dataclass(frozen=True, slots=True)
class LayerInfo:
    """One selected module, as the run's catalog lists it.

    ``parameter_names`` are the names of the module's own parameters (``weight``, ``bias``):
    the ``tensor_path`` of its rows in step records.
    """

    name: str
    type_name: str
    parameter_count: int
    histogram: bool
    parameter_names: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What a sink learns when the run opens: identity, rank and the module catalog.

    ``rank_policy`` is ``"rank0"`` (one process writes) or ``"all"`` (every rank writes its own
    files).
    """

    run_id: str
    rank: int
    world_size: int
    rank_policy: str
    model_class: str
    sampling_policy: str
    layers: tuple[LayerInfo, ...]
    metrics: tuple[str, ...]
