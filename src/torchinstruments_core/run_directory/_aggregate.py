"""Whole-run aggregates of every metric, kept online with bounded memory.

The writer thread feeds every sample through ``RunAggregates``; ``result.json`` is written from it
at the end without reading the history back. Per layer, call, signal, tensor and metric:

- ``count``, ``unavailable`` and ``unavailable_reasons``: exact.
- ``mean``, population ``std`` (Welford), ``min``, ``max`` of the sampled values: exact.
- ``p25``, ``p50``, ``p75``: linearly interpolated quartiles of the sampled values; exact for up to
  ``RESERVOIR`` values, beyond that computed from a uniform reservoir of ``RESERVOIR`` values, whose
  quartiles lie within 0.03 in rank of the exact ones with probability above 0.95
  (Dvoretzky-Kiefer-Wolfowitz: 1 - 2 exp(-2 * 2048 * 0.03**2)).
- ``early_mean`` / ``recent_mean``: means of the first and the last tenth of the values in sample
  order (at least 1 value, at most ``WINDOW`` values each).

Memory per metric is at most ``RESERVOIR + 2 * WINDOW`` floats however long the run.

Per sample, ``collection_duration_ms`` is summarized the same way: its mean, median (exact up to
``RESERVOIR`` samples, from the reservoir beyond), max and total. The median is the figure to
quote: the first sample pays one-time costs (allocations, kernel warm-up) that can be a hundred
times a later sample's and dominate the mean of a short run.
"""

from __future__ import annotations

import math
import random
from array import array
from collections import deque
from typing import TYPE_CHECKING, Any

from torchinstruments_core._signals import RecordKind

if TYPE_CHECKING:
    import polars as pl

    from torchinstruments_core._records import SampleRecord

RESERVOIR = 2048
WINDOW = 256

Key = tuple[str, int, str, str, str]

ROW_COLUMNS = (
    "layer",
    "call_index",
    "signal",
    "tensor_path",
    "metric",
    "value",
    "unavailable_reason",
)
"""The long table's columns that a row's aggregate is keyed by and folds in, in that order."""


class MetricAggregate:
    """Running summary of one metric of one tensor over the run."""

    __slots__ = (
        "count",
        "first",
        "high",
        "low",
        "m2",
        "mean",
        "n",
        "reasons",
        "recent",
        "reservoir",
        "unavailable",
    )

    def __init__(self) -> None:
        self.count = 0
        self.unavailable = 0
        self.reasons: dict[str, int] = {}
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.low = math.inf
        self.high = -math.inf
        self.first = array("d")
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.reservoir = array("d")

    def add(self, value: float | None, reason: str | None, rng: random.Random) -> None:
        """Fold in one sampled value (or one unavailable value and its reason)."""
        self.count += 1
        if value is None:
            self.unavailable += 1
            key = reason or "unknown"
            self.reasons[key] = self.reasons.get(key, 0) + 1
            return
        self.n += 1
        delta = value - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (value - self.mean)
        self.low = min(self.low, value)
        self.high = max(self.high, value)
        if len(self.first) < WINDOW:
            self.first.append(value)
        self.recent.append(value)
        self._sample(value, rng)

    def _sample(self, value: float, rng: random.Random) -> None:
        if len(self.reservoir) < RESERVOIR:
            self.reservoir.append(value)
            return
        slot = rng.randrange(self.n)  # Algorithm R: every value kept with equal probability
        if slot < RESERVOIR:
            self.reservoir[slot] = value

    def summary(self) -> dict[str, Any]:
        """The ``result.json`` entry of this metric."""
        entry: dict[str, Any] = {
            "count": self.count,
            "unavailable": self.unavailable,
            "unavailable_reasons": dict(sorted(self.reasons.items())),
        }
        if self.n == 0:
            return entry | dict.fromkeys(_STATISTICS)
        window = min(max(1, math.ceil(self.n / 10)), WINDOW)
        ordered = sorted(self.reservoir)
        return entry | {
            "mean": self.mean,
            "std": math.sqrt(max(self.m2 / self.n, 0.0)),
            "min": self.low,
            "max": self.high,
            "p25": _quantile(ordered, 0.25),
            "p50": _quantile(ordered, 0.5),
            "p75": _quantile(ordered, 0.75),
            "early_mean": math.fsum(self.first[:window]) / window,
            "recent_mean": math.fsum(list(self.recent)[-window:]) / window,
        }


_STATISTICS = ("mean", "std", "min", "max", "p25", "p50", "p75", "early_mean", "recent_mean")


def _quantile(ordered: list[float], q: float) -> float:
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class RunAggregates:
    """All metric aggregates of a run, in the order their rows first appeared, and sample totals."""

    def __init__(self, *, seed: int = 0) -> None:
        self.metrics: dict[Key, MetricAggregate] = {}
        self.samples = 0
        self.forward_only = 0
        self.duration_ms = 0.0
        self.durations = MetricAggregate()
        self.step_records = 0
        self.step_duration_ms = 0.0
        self._rng = random.Random(seed)

    def add(self, sample: SampleRecord, history: pl.DataFrame | None = None) -> None:
        """Fold in every row of ``sample``; a step record is counted apart from the samples.

        Args:
            sample: The record.
            history: Its rows as the long table (``_tables.sample_history``), read instead of
                ``sample.rows``: the run directory's writer keeps only the table of a sample
                whose chunk is not yet written, so that its rows are freed as soon as the table
                is built (rows that live until a chunk is written make Python's garbage
                collector run its full, slow collections).
        """
        if sample.kind is RecordKind.STEP:
            self.step_records += 1
            self.step_duration_ms += sample.collection_duration_ms
        else:
            self.add_sample(
                forward_only=sample.forward_only, duration_ms=sample.collection_duration_ms
            )
        if history is not None:
            self.add_table(history)
            return
        for row in sample.rows:
            key = (row.layer, row.call_index, row.signal.value, row.tensor_path, row.metric)
            self.add_value(key, row.value, row.unavailable_reason)

    def add_table(self, history: pl.DataFrame) -> None:
        """Fold in the rows of a frame with the long table's columns, in order (others unread)."""
        columns = [history.get_column(name).to_list() for name in ROW_COLUMNS]
        for layer, call, signal, path, metric, value, reason in zip(*columns, strict=True):
            self.add_value((layer, call, signal, path, metric), value, reason)

    def add_sample(self, *, forward_only: bool, duration_ms: float) -> None:
        """Count one sample (``add`` does; ``repair`` calls it with rows read back from disk)."""
        self.samples += 1
        self.forward_only += int(forward_only)
        self.duration_ms += duration_ms
        self.durations.add(duration_ms, None, self._rng)

    def step_record_summary(self) -> dict[str, Any]:
        """Totals over the step records: count and collection time."""
        return {
            "count": self.step_records,
            "collection_duration_ms": {"total": self.step_duration_ms},
        }

    def add_value(self, key: Key, value: float | None, reason: str | None) -> None:
        """Fold in one row: ``key`` is (layer, call_index, signal, tensor_path, metric)."""
        aggregate = self.metrics.get(key)
        if aggregate is None:
            aggregate = self.metrics[key] = MetricAggregate()
        aggregate.add(value, reason, self._rng)

    def sample_summary(self) -> dict[str, Any]:
        """Totals over the samples: count, forward-only count, collection time."""
        durations = self.durations.summary()
        return {
            "count": self.samples,
            "forward_only": self.forward_only,
            "collection_duration_ms": {
                "mean": durations["mean"],
                "median": durations["p50"],
                "max": durations["max"],
                "total": self.duration_ms,
            },
        }
