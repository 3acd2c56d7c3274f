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

The metrics are columns, not objects (``MetricColumns``): each statistic is a numpy array with a
row per metric, and a sample's rows are folded in together, a few array operations for all its
metrics. Folding them one by one in Python cost the writer about 1.45 us a row, the largest part
of its work on a sample of a few hundred rows (a small GPT's 768: 1.1 ms of its 2.9 ms); the
arithmetic is the same, row for row, so the statistics are too. A sample's key columns are
compared with those of the last tables of as many rows (a sample's, a step record's), and mapped
to rows of the arrays only when none is the same.

Per sample, ``collection_duration_ms`` is summarized apart (``Durations``): its mean, median
(exact up to ``RESERVOIR`` samples, from a reservoir beyond), max and total. The median is the
figure to quote: the first sample pays one-time costs (allocations, kernel warm-up) that can be a
hundred times a later sample's and dominate the mean of a short run.
"""

from __future__ import annotations

import math
import random
from array import array
from typing import TYPE_CHECKING, Any

import numpy as np

from torchinstruments_core._rows import row_parts
from torchinstruments_core._signals import RecordKind

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

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
_KEY_COLUMNS = ROW_COLUMNS[:5]
_LAYOUTS = 8
"""The tables' key columns remembered (``RunAggregates.add_table``), the oldest forgotten first."""
_STATISTICS = ("mean", "std", "min", "max", "p25", "p50", "p75", "early_mean", "recent_mean")


class MetricColumns:
    """Running summaries of many metrics, a row of numpy arrays each.

    ``fold`` takes one value (or one unavailable value and its reason) for each of several
    distinct metrics at once; ``summary`` gives one metric's ``result.json`` entry. The arrays
    grow by doubling, in metrics and in the values kept for the windows and the reservoir.

    Args:
        seed: Seeds the reservoir's draws.
    """

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)
        self.unavailable = np.zeros(0, np.int64)
        self.n = np.zeros(0, np.int64)
        self.mean = np.zeros(0)
        self.m2 = np.zeros(0)
        self.low = np.zeros(0)
        self.high = np.zeros(0)
        self.first = np.zeros((0, 0))  # the first WINDOW values, in order
        self.recent = np.zeros((0, 0))  # the last WINDOW values, value k at column k % WINDOW
        self.reservoir = np.zeros((0, 0))  # Algorithm R: every value kept with equal probability
        self.reasons: dict[int, dict[str, int]] = {}

    def grow(self, metrics: int) -> None:
        """Make room for ``metrics`` metrics (rows), new ones empty."""
        size = len(self.n)
        if metrics <= size:
            return
        size = max(metrics, 2 * size, 16)
        for name in ("unavailable", "n", "mean", "m2"):
            setattr(self, name, _longer(getattr(self, name), size, 0))
        self.low = _longer(self.low, size, math.inf)
        self.high = _longer(self.high, size, -math.inf)
        for name in ("first", "recent", "reservoir"):
            setattr(self, name, _longer(getattr(self, name), size, 0.0))

    def fold(
        self,
        ids: np.ndarray,
        values: np.ndarray,
        available: np.ndarray,
        reasons: Sequence[str | None],
    ) -> None:
        """Fold in ``values[k]`` into metric ``ids[k]``: the ids are distinct.

        ``available[k]`` false: the value is unavailable, for ``reasons[k]`` (the reasons are
        read only there; ``None`` counts as ``"unknown"``).
        """
        if not available.all():
            missing = np.flatnonzero(~available)
            self.unavailable[ids[missing]] += 1
            for index, row in zip(ids[missing].tolist(), missing.tolist(), strict=True):
                counts = self.reasons.setdefault(index, {})
                reason = reasons[row] or "unknown"
                counts[reason] = counts.get(reason, 0) + 1
            ids, values = ids[available], values[available]
        if not len(ids):
            return
        n = self.n[ids] + 1
        self.n[ids] = n
        mean = self.mean[ids]
        delta = values - mean
        mean = mean + delta / n  # Welford, as a loop over the values would do it
        self.m2[ids] += delta * (values - mean)
        self.mean[ids] = mean
        self.low[ids] = np.fmin(self.low[ids], values)  # a NaN value is no extreme
        self.high[ids] = np.fmax(self.high[ids], values)
        position = n - 1
        self._widen(int(position.max()) + 1)
        early = position < WINDOW
        self.first[ids[early], position[early]] = values[early]
        self.recent[ids, position % WINDOW] = values
        kept = position < RESERVOIR
        self.reservoir[ids[kept], position[kept]] = values[kept]
        if not kept.all():
            late = ~kept
            slots = self._rng.integers(0, n[late])  # value k replaces one with probability R/k
            chosen = slots < RESERVOIR
            self.reservoir[ids[late][chosen], slots[chosen]] = values[late][chosen]

    def summary(self, index: int) -> dict[str, Any]:
        """The ``result.json`` entry of metric ``index``."""
        n = int(self.n[index])
        entry: dict[str, Any] = {
            "count": n + int(self.unavailable[index]),
            "unavailable": int(self.unavailable[index]),
            "unavailable_reasons": dict(sorted(self.reasons.get(index, {}).items())),
        }
        if n == 0:
            return entry | dict.fromkeys(_STATISTICS)
        window = min(max(1, math.ceil(n / 10)), WINDOW)
        ordered = sorted(self.reservoir[index, : min(n, RESERVOIR)].tolist())
        recent = self.recent[index, [k % WINDOW for k in range(n - window, n)]].tolist()
        return entry | {
            "mean": float(self.mean[index]),
            "std": math.sqrt(max(float(self.m2[index]) / n, 0.0)),
            "min": float(self.low[index]),
            "max": float(self.high[index]),
            "p25": _quantile(ordered, 0.25),
            "p50": _quantile(ordered, 0.5),
            "p75": _quantile(ordered, 0.75),
            "early_mean": math.fsum(self.first[index, :window].tolist()) / window,
            "recent_mean": math.fsum(recent) / window,
        }

    def _widen(self, values: int) -> None:
        """Keep room for ``values`` values a metric in the windows and the reservoir."""
        width = self.reservoir.shape[1]
        if values <= width:
            return
        width = min(max(values, 2 * width, 16), RESERVOIR)
        rows = len(self.n)
        self.reservoir = _wider(self.reservoir, rows, width)
        self.first = _wider(self.first, rows, min(width, WINDOW))
        self.recent = _wider(self.recent, rows, min(width, WINDOW))


def _longer(column: np.ndarray, rows: int, fill: float) -> np.ndarray:
    grown = np.full((rows, *column.shape[1:]), fill, dtype=column.dtype)
    grown[: len(column)] = column
    return grown


def _wider(columns: np.ndarray, rows: int, width: int) -> np.ndarray:
    if columns.shape[1] >= width:
        return columns
    grown = np.zeros((rows, width))
    grown[:, : columns.shape[1]] = columns
    return grown


def _quantile(ordered: list[float], q: float) -> float:
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class Durations:
    """The samples' collection times: count, total, max, and a reservoir for the median."""

    def __init__(self, seed: int = 0) -> None:
        self.count = 0
        self.total = 0.0
        self.high = -math.inf
        self.reservoir = array("d")
        self._rng = random.Random(seed)

    def add(self, duration_ms: float) -> None:
        """Count one sample's collection time."""
        self.count += 1
        self.total += duration_ms
        self.high = max(self.high, duration_ms)
        if len(self.reservoir) < RESERVOIR:
            self.reservoir.append(duration_ms)
            return
        slot = self._rng.randrange(self.count)  # Algorithm R, as ``MetricColumns.fold``
        if slot < RESERVOIR:
            self.reservoir[slot] = duration_ms

    def summary(self) -> dict[str, float | None]:
        """Mean, median, max and total (``None`` for the first three without samples)."""
        if not self.count:
            return {"mean": None, "median": None, "max": None, "total": self.total}
        return {
            "mean": self.total / self.count,
            "median": _quantile(sorted(self.reservoir), 0.5),
            "max": self.high,
            "total": self.total,
        }


class RunAggregates:
    """All metric aggregates of a run, in the order their rows first appeared, and sample totals."""

    def __init__(self, *, seed: int = 0) -> None:
        self.samples = 0
        self.forward_only = 0
        self.durations = Durations(seed)
        self.step_records = 0
        self.step_duration_ms = 0.0
        self._columns = MetricColumns(seed)
        self._ids: dict[Key, int] = {}  # a metric's row in the columns, in order of appearance
        # by row count, the key columns of the last tables folded in (a sample's, a step
        # record's), their rows' ids, and whether a metric repeats among them
        self._layouts: dict[int, tuple[list[pl.Series], np.ndarray, bool]] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the remembered key columns (the writer process sends the aggregates)."""
        return self.__dict__ | {"_layouts": {}}

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
        keys: list[Key] = []
        values: list[float | None] = []
        reasons: list[str | None] = []
        for part in row_parts(sample.rows):
            where = (part.layer, part.call_index, str(part.signal), part.tensor_path)
            keys += [(*where, metric) for metric in part.metrics]
            values += part.values
            reasons += part.reasons or [None] * len(part.metrics)
        ids = self._key_ids(keys)
        available = np.array([value is not None for value in values], dtype=bool)
        numbers = np.array([math.nan if v is None else v for v in values], dtype=np.float64)
        self._fold(ids, _repeats(ids), numbers, available, reasons)

    def add_table(self, history: pl.DataFrame) -> None:
        """Fold in the rows of a frame with the long table's columns, in order (others unread).

        The frame may hold many samples (``repair`` folds a run's history in batches): a
        metric's values are folded in in the order of the rows.
        """
        keys = [history.get_column(name) for name in _KEY_COLUMNS]
        known = self._layouts.get(history.height)
        if known is not None and all(
            k.equals(seen) for k, seen in zip(keys, known[0], strict=True)
        ):
            ids, repeats = known[1], known[2]
        else:
            ids = self._key_ids(zip(*(key.to_list() for key in keys), strict=True))
            repeats = _repeats(ids)
            self._layouts[history.height] = (keys, ids, repeats)
            if len(self._layouts) > _LAYOUTS:
                del self._layouts[next(iter(self._layouts))]
        value = history.get_column("value")
        values = value.to_numpy().astype(np.float64, copy=False)  # a null as NaN
        available = np.ones(len(values), dtype=bool)
        reasons: Sequence[str | None] = ()
        if value.null_count():  # told from a NaN value, which is a value
            available = np.array([v is not None for v in value.to_list()], dtype=bool)
            reasons = history.get_column("unavailable_reason").to_list()
        self._fold(ids, repeats, values, available, reasons)

    def add_sample(self, *, forward_only: bool, duration_ms: float) -> None:
        """Count one sample (``add`` does; ``repair`` calls it with rows read back from disk)."""
        self.samples += 1
        self.forward_only += int(forward_only)
        self.durations.add(duration_ms)

    def summaries(self) -> dict[Key, dict[str, Any]]:
        """Every metric's ``result.json`` entry, in the order its rows first appeared."""
        return {key: self._columns.summary(index) for key, index in self._ids.items()}

    def step_record_summary(self) -> dict[str, Any]:
        """Totals over the step records: count and collection time."""
        return {
            "count": self.step_records,
            "collection_duration_ms": {"total": self.step_duration_ms},
        }

    def sample_summary(self) -> dict[str, Any]:
        """Totals over the samples: count, forward-only count, collection time."""
        return {
            "count": self.samples,
            "forward_only": self.forward_only,
            "collection_duration_ms": self.durations.summary(),
        }

    def _key_ids(self, keys: Iterable[Key]) -> np.ndarray:
        """The row of each key in the columns; a key seen for the first time gets a new one."""
        known = self._ids
        ids = []
        for key in keys:
            index = known.get(key)
            if index is None:
                index = known[key] = len(known)
            ids.append(index)
        self._columns.grow(len(known))
        return np.array(ids, dtype=np.int64)

    def _fold(
        self,
        ids: np.ndarray,
        repeats: bool,
        values: np.ndarray,
        available: np.ndarray,
        reasons: Sequence[str | None],
    ) -> None:
        """Fold in rows whose metrics may repeat: the k-th rows of every metric together."""
        if not repeats:
            self._columns.fold(ids, values, available, reasons)
            return
        rows = np.arange(len(ids))
        order = np.argsort(ids, kind="stable")
        first = np.r_[True, ids[order][1:] != ids[order][:-1]]
        occurrence = np.empty_like(rows)
        occurrence[order] = rows - np.maximum.accumulate(np.where(first, rows, 0))
        ranked = np.lexsort((rows, occurrence))  # by occurrence, then in the table's order
        bounds = np.flatnonzero(np.diff(occurrence[ranked])) + 1
        for part in np.split(ranked, bounds):
            some = [reasons[k] for k in part.tolist()] if len(reasons) else ()
            self._columns.fold(ids[part], values[part], available[part], some)


def _repeats(ids: np.ndarray) -> bool:
    """Whether a metric has more than one row among ``ids``."""
    return len(np.unique(ids)) != len(ids)
