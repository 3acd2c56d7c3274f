"""``LoggerRouter``: a sink that puts each sample's key scalars and histograms into trainer loggers.

Keys follow ``<prefix>/<layer>/<signal>/<metric>`` (a call other than the first adds
``/call_<k>`` after the signal, a tensor inside a nested output its path), and the histogram of a
focus tensor is ``<prefix>/<layer>/<signal>/histogram``. Two summaries per sample:
``<prefix>/nonfinite_tensors`` (how many observed tensors held NaN or Inf, over all layers) and
``<prefix>/collection_duration_ms``. The step is the trainer's step, else the sample id.

A forward-only sample (no backward reached it: an evaluation batch, a forward under
``torch.no_grad``) has its keys under ``<prefix>/forward_only/`` instead
(``<prefix>/forward_only/<layer>/output/rms``, ``<prefix>/forward_only/nonfinite_tensors``): it
often shares its step with a training sample (a validation pass at a sampled step, an
evaluation batch inside one), and under the same keys the loggers would show the two models'
states, train and eval mode, as one curve. A sample with a ``scope`` (``SampleRecord.scope``:
the later phases of a manual-optimization step, ``phase_2`` …) has it after that:
``<prefix>/phase_2/<layer>/output/rms``.

A step record (the rows of an optimizer step) goes the same way, with the metrics its signals'
definitions name (``SignalSpec.routed_metrics``, ``SignalSpec.model_metrics``) rather than
``scalar_metrics``: its rows' keys name the parameter
(``<prefix>/<layer>/parameter_gradient/weight/rms``,
``<prefix>/<layer>/update/weight/update_to_weight``), its whole-model rows are
``<prefix>/model/<signal>/<metric>`` (``<prefix>/model/parameter_gradient/l2_norm``), and its
summaries are ``<prefix>/step/nonfinite_tensors`` and ``<prefix>/step/collection_duration_ms``.
"""

from __future__ import annotations

import fnmatch
import itertools
from typing import TYPE_CHECKING

from torchinstruments_core._exceptions import ConfigurationError, raise_collected
from torchinstruments_core._rows import row_parts
from torchinstruments_core._signals import (
    ALL_PARAMETERS,
    MODEL_LAYER,
    RecordKind,
    Signal,
    routed_by_default,
)
from torchinstruments_core.routing.base import summary_keys, summary_scalars, tensor_key

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from torchinstruments_core._records import HistogramRecord, RunInfo, SampleRecord
    from torchinstruments_core._rows import RowPart
    from torchinstruments_core.routing.base import Target

DEFAULT_SCALAR_METRICS = ("rms", "max_abs", "nonfinite_fraction")
FORWARD_ONLY_SCOPE = "forward_only"
"""The part of a forward-only sample's keys after the prefix (see the module's docstring)."""


class LoggerRouter:
    """Routes a chosen subset of each sample into targets, so a 500-layer model floods nothing.

    Args:
        targets: Where to write (see ``routing.targets``), or a function returning them, called
            at each write, for a trainer whose loggers appear or close while the model is observed.
        prefix: First part of every key.
        scalar_metrics: Metrics logged as scalars, for the signals whose definition names none
            of its own (the forward ones; a step record's ``parameter_gradient`` routes ``rms``
            and its ``update`` ``update_to_weight``, see ``SignalSpec.routed_metrics``).
        scalar_layers: ``"focus"`` (default: the histogram layers, at most 8), ``"all"``, or glob
            patterns of layer names.
        histograms: Also log the focus layers' histograms (to targets that take them).
        signals: Names of the signals routed (default: those whose definition in ``Signal``
            says routed: ``output``, ``output_gradient``, ``parameter_gradient``, ``update``).
    """

    def __init__(
        self,
        targets: Sequence[Target] | Callable[[], Iterable[Target]],
        *,
        prefix: str = "telemetry",
        scalar_metrics: Sequence[str] = DEFAULT_SCALAR_METRICS,
        scalar_layers: str | Sequence[str] = "focus",
        histograms: bool = True,
        signals: Sequence[str] | None = None,
    ) -> None:
        if isinstance(scalar_metrics, str):
            raise ConfigurationError.invalid("scalar_metrics", scalar_metrics, "a list of names")
        if isinstance(scalar_layers, str) and scalar_layers not in ("focus", "all"):
            raise ConfigurationError.invalid(
                "scalar_layers", scalar_layers, "'focus', 'all' or a list of glob patterns"
            )
        self._targets = targets if callable(targets) else tuple(targets)
        self.prefix = prefix.rstrip("/")
        self.scalar_metrics = frozenset(scalar_metrics)
        self.scalar_layers = scalar_layers
        self.histograms = histograms
        self.signals = _signals(signals)
        self._layer_metrics = {s: _layer_metrics(s, self.scalar_metrics) for s in self.signals}
        self._model_metrics = {s: frozenset(s.spec.model_metrics) for s in self.signals}
        self._layers: frozenset[str] = frozenset()

    def open(self, run: RunInfo) -> None:
        """Learn which layers have scalars routed."""
        names = [layer.name for layer in run.layers]
        if self.scalar_layers == "focus":
            names = [layer.name for layer in run.layers if layer.histogram]
        elif self.scalar_layers != "all":
            patterns = list(self.scalar_layers)
            names = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        self._layers = frozenset(names)

    def write(self, sample: SampleRecord) -> None:
        """Write the sample's routed scalars and histograms to every target.

        Raises:
            Exception: The one target's own error if one target failed (the others still got the
                sample), an ``ExceptionGroup`` of them if several did.
        """
        step = sample.step if sample.step is not None else sample.sample_id
        prefix = self._prefix_of(sample)
        scalars = self._scalars(sample, prefix)
        histograms = self._histograms(sample.histograms, prefix) if self.histograms else {}
        errors: list[Exception] = []
        for target in self.targets:
            try:
                target.log(scalars, histograms, step)
            except Exception as error:  # every target gets the sample before anything is raised
                error.add_note(f"raised by the logger target {type(target).__name__}")
                errors.append(error)
        raise_collected(errors, f"{len(errors)} logger targets failed at step {step}")

    @property
    def targets(self) -> tuple[Target, ...]:
        """The targets the next write goes to."""
        return tuple(self._targets()) if callable(self._targets) else self._targets

    def close(self) -> None:
        """Nothing to do: the targets belong to the trainer, which closes them."""

    def scalar_keys(self, run: RunInfo) -> list[str]:
        """The scalar keys routed for the first call of every module's whole tensor.

        For documentation: a sample's keys, then a step record's (each parameter the catalog
        names of a routed layer, then the whole-model rows).
        """
        self.open(run)
        routed = [layer for layer in run.layers if layer.name in self._layers]
        keys = list(summary_keys(self.prefix, RecordKind.FORWARD))
        for layer, signal in itertools.product(routed, self._of_kind(RecordKind.FORWARD)):
            if signal.tensor_root is not None:
                keys += self._keys(layer.name, signal, signal.tensor_root, run.metrics)
        keys += summary_keys(self.prefix, RecordKind.STEP)
        for layer, signal in itertools.product(routed, self._of_kind(RecordKind.STEP)):
            for name in layer.parameter_names:
                keys += self._keys(layer.name, signal, name, run.metrics)
        for signal in self._of_kind(RecordKind.STEP):
            key = tensor_key(MODEL_LAYER, 0, signal, ALL_PARAMETERS)
            keys += [f"{self.prefix}/{key}/{metric}" for metric in signal.spec.model_metrics]
        return keys

    def _of_kind(self, kind: RecordKind) -> list[Signal]:
        return [signal for signal in self.signals if signal.kind is kind]

    def _keys(self, layer: str, signal: Signal, path: str, metrics: Sequence[str]) -> list[str]:
        """The keys of one tensor's routed metrics, in the order of its definition or the run's."""
        own = signal.spec.routed_metrics
        ordered = own if own is not None else [m for m in metrics if m in self.scalar_metrics]
        key = tensor_key(layer, 0, signal, path)
        return [f"{self.prefix}/{key}/{metric}" for metric in ordered]

    def _prefix_of(self, sample: SampleRecord) -> str:
        """``prefix`` (``<prefix>/forward_only`` for a forward-only sample), then its scope."""
        prefix = f"{self.prefix}/{FORWARD_ONLY_SCOPE}" if sample.forward_only else self.prefix
        return prefix if sample.scope is None else f"{prefix}/{sample.scope}"

    def _scalars(self, sample: SampleRecord, prefix: str) -> dict[str, float]:
        """The routed rows' values by key, read from the rows' parts (no ``StatRow`` made)."""
        scalars: dict[str, float] = {}
        for part in row_parts(sample.rows):
            routed = self._routed_metrics(part)
            if not routed:
                continue
            key = f"{prefix}/{_key(part)}"
            for metric, value in zip(part.metrics, part.values, strict=True):
                if value is not None and metric in routed:
                    scalars[f"{key}/{metric}"] = value
        return scalars | summary_scalars(sample, prefix)

    def _routed_metrics(self, part: RowPart) -> frozenset[str]:
        """The metrics routed for the tensor of ``part`` (none for a layer not routed)."""
        if part.layer == MODEL_LAYER:
            return self._model_metrics.get(part.signal, frozenset())
        if part.layer not in self._layers:
            return frozenset()
        return self._layer_metrics.get(part.signal, frozenset())

    def _histograms(
        self, records: Sequence[HistogramRecord], prefix: str
    ) -> dict[str, HistogramRecord]:
        return {
            f"{prefix}/{_key(record)}/histogram": record
            for record in records
            if record.signal in self.signals
        }

    def __repr__(self) -> str:
        if callable(self._targets):
            return f"LoggerRouter(<looked up at each write>, prefix={self.prefix!r})"
        names = ", ".join(type(t).__name__ for t in self._targets)
        return f"LoggerRouter([{names}], prefix={self.prefix!r})"


def _signals(signals: Sequence[str] | None) -> tuple[Signal, ...]:
    if signals is None:
        return routed_by_default()
    known = {signal.value: signal for signal in Signal}
    if isinstance(signals, str) or any(s not in known for s in signals):
        raise ConfigurationError.invalid("signals", signals, f"a list of names among {list(known)}")
    return tuple(known[s] for s in signals)


def _layer_metrics(signal: Signal, scalar_metrics: frozenset[str]) -> frozenset[str]:
    own = signal.spec.routed_metrics
    return scalar_metrics if own is None else frozenset(own)


def _key(item: RowPart | HistogramRecord) -> str:
    return tensor_key(item.layer, item.call_index, item.signal, item.tensor_path)
