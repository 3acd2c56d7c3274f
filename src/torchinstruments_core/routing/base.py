"""The target extension point: where routed scalars and histograms are written.

A target is one destination the trainer already has: a TensorBoard ``SummaryWriter``, a W&B run,
or anything that takes a dict of scalars (a CSV or MLflow logger, an Accelerate tracker).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torchinstruments_core._exceptions import raise_collected
from torchinstruments_core._rows import row_parts
from torchinstruments_core._signals import (
    ALL_PARAMETERS,
    MODEL_KEY,
    MODEL_LAYER,
    RecordKind,
    tensor_root_of,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from torchinstruments_core._records import HistogramRecord, SampleRecord


@runtime_checkable
class Target(Protocol):
    """Receives the scalars and histograms of one sample, at one step."""

    def log(
        self, scalars: Mapping[str, float], histograms: Mapping[str, HistogramRecord], step: int
    ) -> None:
        """Write ``scalars`` and ``histograms`` (by key) at ``step``."""
        ...


def log_event(targets: Iterable[Target], key: str, text: str, step: int) -> None:
    """Put an event (a one-line ``text``) into every target at ``step``.

    Every target gets the scalar ``<key>_onset`` = 1 (so scalar-only loggers such as CSV or
    MLflow mark the step too); a target with a ``log_text(key, text, step)`` method
    (TensorBoard, W&B) also gets the text under ``key``.

    Raises:
        Exception: The one target's own error if one failed (the others still got the event),
            an ``ExceptionGroup`` of them if several did.
    """
    errors: list[Exception] = []
    for target in targets:
        try:
            target.log({f"{key}_onset": 1.0}, {}, step)
            log_text = getattr(target, "log_text", None)
            if log_text is not None:
                log_text(key, text, step)
        except Exception as error:  # every target gets the event before anything is raised
            error.add_note(f"raised by the logger target {type(target).__name__}")
            errors.append(error)
    raise_collected(errors, f"{len(errors)} logger targets failed at step {step}")


def tensor_key(layer: str, call_index: int, signal: str, tensor_path: str) -> str:
    """``<layer>/<signal>``, plus ``/call_<k>`` and ``/<tensor_path>`` where not the default.

    The default path is the signal's whole tensor (its ``tensor_root``: ``output`` for
    ``output`` and ``output_gradient``); a parameter's signal always names the parameter. A step
    record's whole-model rows (layer ``<model>``, every parameter ``*``) are ``model/<signal>``.

    Example:
        >>> tensor_key("encoder.0", 0, "output", "output")
        'encoder.0/output'
        >>> tensor_key("attn", 1, "output_gradient", "output.0")
        'attn/output_gradient/call_1/output.0'
        >>> tensor_key("encoder.0", 0, "parameter", "weight")
        'encoder.0/parameter/weight'
        >>> tensor_key("<model>", 0, "update", "*")
        'model/update'
    """
    if layer == MODEL_LAYER and tensor_path == ALL_PARAMETERS:
        return f"{MODEL_KEY}/{signal}"
    key = f"{layer}/{signal}"
    if call_index:
        key += f"/call_{call_index}"
    if tensor_path != tensor_root_of(signal):
        key += f"/{tensor_path}"
    return key


def summary_keys(prefix: str, kind: RecordKind) -> tuple[str, str]:
    """The keys of a record's two summaries (see ``summary_scalars``).

    Example:
        >>> summary_keys("telemetry", RecordKind.STEP)
        ('telemetry/step/nonfinite_tensors', 'telemetry/step/collection_duration_ms')
    """
    scope = prefix if kind is RecordKind.FORWARD else f"{prefix}/{kind}"
    return f"{scope}/nonfinite_tensors", f"{scope}/collection_duration_ms"


def summary_scalars(record: SampleRecord, prefix: str) -> dict[str, float]:
    """The two summaries of a record: how many tensors held NaN or Inf, and its collection time.

    A sample's are ``<prefix>/nonfinite_tensors`` and ``<prefix>/collection_duration_ms``; a
    step record's ``<prefix>/step/nonfinite_tensors`` and ``<prefix>/step/…``, so that the two
    records of one trainer step never overwrite each other's.

    Example:
        >>> from torchinstruments_core import RecordKind, SampleRecord
        >>> record = SampleRecord("r", 0, 3, 7, 0.0, False, 1.5, (), (), kind=RecordKind.STEP)
        >>> summary_scalars(record, "telemetry")
        {'telemetry/step/nonfinite_tensors': 0.0, 'telemetry/step/collection_duration_ms': 1.5}
    """
    nonfinite_key, duration_key = summary_keys(prefix, record.kind)
    nonfinite = sum(
        1
        for part in row_parts(record.rows)
        for metric, value in zip(part.metrics, part.values, strict=True)
        if metric == "nonfinite_fraction" and value
    )
    return {nonfinite_key: float(nonfinite), duration_key: record.collection_duration_ms}
