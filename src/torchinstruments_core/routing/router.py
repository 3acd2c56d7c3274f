"""``LoggerRouter``: a sink that puts each sample's key scalars and histograms into trainer loggers.

Keys follow ``<prefix>/<layer>/<signal>/<metric>`` (a call other than the first adds
``/call_<k>`` after the signal, a tensor inside a nested output its path), and the histogram of a
focus tensor is ``<prefix>/<layer>/<signal>/histogram``. Two summaries per sample:
``<prefix>/nonfinite_tensors`` (how many observed tensors held NaN or Inf, over all layers) and
``<prefix>/collection_duration_ms``. The step is the trainer's step, else the sample id.

A step record (the rows of an optimizer step) goes the same way: its rows' keys name the
parameter (``<prefix>/<layer>/parameter/weight/rms``) and its summaries are
``<prefix>/step/nonfinite_tensors`` and ``<prefix>/step/collection_duration_ms``.
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING

from torchinstruments_core._exceptions import ConfigurationError, raise_collected
from torchinstruments_core._signals import RecordKind, Signal, fixed_root, routed_by_default
from torchinstruments_core.routing.base import summary_scalars, tensor_key

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from torchinstruments_core._records import HistogramRecord, RunInfo, SampleRecord, StatRow
    from torchinstruments_core.routing.base import Target

DEFAULT_SCALAR_METRICS = ("rms", "max_abs", "nonfinite_fraction")


class LoggerRouter:
    """Routes a chosen subset of each sample into targets, so a 500-layer model floods nothing.

    Args:
        targets: Where to write (see ``routing.targets``), or a function returning them, called
            at each write, for a trainer whose loggers appear or close while the model is observed.
        prefix: First part of every key.
        scalar_metrics: Metrics logged as scalars.
        scalar_layers: ``"focus"`` (default: the histogram layers, at most 8), ``"all"``, or glob
            patterns of layer names.
        histograms: Also log the focus layers' histograms (to targets that take them).
        signals: Names of the signals routed (default: those whose definition in ``Signal``
            says routed, today all of them).
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
        scalars = self._scalars(sample)
        histograms = self._histograms(sample.histograms) if self.histograms else {}
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
        """The scalar keys a sample's first call of every module's whole tensor produces.

        For documentation: step records, whose keys name each parameter, are not listed.
        """
        self.open(run)
        keys = [f"{self.prefix}/nonfinite_tensors", f"{self.prefix}/collection_duration_ms"]
        whole = [s for s in self.signals if s.kind is RecordKind.FORWARD and s.tensor_root]
        for layer in run.layers:
            if layer.name in self._layers:
                for signal in whole:
                    key = tensor_key(layer.name, 0, signal, fixed_root(signal))
                    keys += [
                        f"{self.prefix}/{key}/{m}" for m in run.metrics if m in self.scalar_metrics
                    ]
        return keys

    def _scalars(self, sample: SampleRecord) -> dict[str, float]:
        scalars: dict[str, float] = {}
        for row in sample.rows:
            routed = row.metric in self.scalar_metrics and row.layer in self._layers
            if routed and row.value is not None and row.signal in self.signals:
                scalars[f"{self.prefix}/{_key(row)}/{row.metric}"] = row.value
        return scalars | summary_scalars(sample, self.prefix)

    def _histograms(self, records: Sequence[HistogramRecord]) -> dict[str, HistogramRecord]:
        return {
            f"{self.prefix}/{_key(record)}/histogram": record
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


def _key(item: StatRow | HistogramRecord) -> str:
    return tensor_key(item.layer, item.call_index, item.signal, item.tensor_path)
