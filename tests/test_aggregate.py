"""Online whole-run aggregates behind result.json: exact where promised, bounded otherwise."""

from __future__ import annotations

import dataclasses
import math
import pickle
import random
from collections.abc import Iterable

import numpy as np
import polars as pl
import pytest

from torchinstruments_core import SampleRecord, StatRow
from torchinstruments_core._signals import RecordKind, Signal
from torchinstruments_core.run_directory._aggregate import (
    RESERVOIR,
    WINDOW,
    Durations,
    Key,
    MetricColumns,
    RunAggregates,
)
from torchinstruments_core.run_directory._tables import sample_history


def _fold(values: list[float | None]) -> dict[str, object]:
    """One metric's summary, its values folded in one at a time."""
    columns = MetricColumns()
    columns.grow(1)
    for value in values:
        number = math.nan if value is None else value
        reason = None if value is not None else "no_finite_values"
        columns.fold(
            np.zeros(1, np.int64), np.array([number]), np.array([value is not None]), [reason]
        )
    return columns.summary(0)


def test_small_runs_are_exact() -> None:
    """Up to RESERVOIR values every statistic equals numpy's (population std, linear quartiles)."""
    values = list(np.random.default_rng(1).normal(5, 2, size=500))
    summary = _fold([*values[:250], None, *values[250:]])
    x = np.array(values)
    assert summary["count"] == 501
    assert summary["unavailable"] == 1
    assert summary["unavailable_reasons"] == {"no_finite_values": 1}
    for name, expected in {
        "mean": x.mean(),
        "std": x.std(),
        "min": x.min(),
        "max": x.max(),
        "p25": np.quantile(x, 0.25),
        "p50": np.quantile(x, 0.5),
        "p75": np.quantile(x, 0.75),
        "early_mean": x[:50].mean(),
        "recent_mean": x[-50:].mean(),
    }.items():
        assert summary[name] == pytest.approx(expected, rel=1e-12), name


def test_long_runs_stay_bounded_and_within_the_stated_error() -> None:
    """Past RESERVOIR values memory stays fixed; moments exact, quartiles within 0.03 in rank."""
    x = np.random.default_rng(2).standard_normal(50_000)
    columns = MetricColumns()
    columns.grow(1)
    for value in x:
        columns.fold(np.zeros(1, np.int64), np.array([value]), np.ones(1, bool), ())
    assert columns.reservoir.shape[1] == RESERVOIR
    assert columns.first.shape[1] == columns.recent.shape[1] == WINDOW
    summary = columns.summary(0)
    assert summary["mean"] == pytest.approx(x.mean(), abs=1e-12)
    assert summary["std"] == pytest.approx(x.std(), rel=1e-9)
    for q in (0.25, 0.5, 0.75):
        got = summary[f"p{round(q * 100)}"]
        assert np.quantile(x, q - 0.03) <= got <= np.quantile(x, q + 0.03)
    assert summary["early_mean"] == pytest.approx(x[:WINDOW].mean())
    assert summary["recent_mean"] == pytest.approx(x[-WINDOW:].mean())


def test_only_unavailable_values_give_null_statistics() -> None:
    """A metric that never had a value reports its counts and null statistics, never NaN."""
    summary = _fold([None, None])
    assert summary["count"] == 2
    assert summary["mean"] is None
    assert all(v is None or not isinstance(v, float) or math.isfinite(v) for v in summary.values())


def _record(
    sample_id: int,
    rng: random.Random,
    kind: RecordKind,
    layers: tuple[str, ...] = ("encoder.0", "head"),
) -> SampleRecord:
    rows = []
    for layer in layers:
        for signal in (Signal.OUTPUT, Signal.OUTPUT_GRADIENT):
            for metric in ("mean", "rms", "p50"):
                missing = rng.random() < 0.2
                rows.append(
                    StatRow(
                        layer,
                        sample_id % 2,
                        signal,
                        "output",
                        metric,
                        None if missing else rng.gauss(0.0, 1.0),
                        "no_finite_values" if missing else None,
                    )
                )
    return SampleRecord(
        "run", 0, sample_id, sample_id, 0.0, False, rng.random(), tuple(rows), (), kind=kind
    )


def test_folding_a_samples_table_equals_folding_its_rows() -> None:
    """``add(sample, history)``, as the run directory's writer calls it, matches the rows exactly.

    The writer keeps only a sample's table once it is built, so result.json must not change
    when its aggregates come from the table's columns instead of the row objects.
    """
    rng = random.Random(3)
    records = [
        _record(n, rng, RecordKind.STEP if n % 5 == 4 else RecordKind.FORWARD) for n in range(40)
    ]
    from_rows, from_tables = RunAggregates(seed=1), RunAggregates(seed=1)
    for record in records:
        from_rows.add(record)
        from_tables.add(dataclasses.replace(record, rows=()), sample_history(record))
    assert list(from_tables.summaries()) == list(from_rows.summaries())
    assert len(from_rows.summaries()) == 24  # 2 layers, 2 calls, 2 signals, 3 metrics
    assert from_tables.summaries() == from_rows.summaries()
    assert from_tables.sample_summary() == from_rows.sample_summary()
    assert from_tables.step_record_summary() == from_rows.step_record_summary()


def _value_by_value(records: list[SampleRecord]) -> dict[tuple[object, ...], dict[str, object]]:
    """The reference: each metric's values in record order, folded one at a time."""
    values: dict[tuple[object, ...], list[float | None]] = {}
    for record in records:
        for row in record.rows:
            key = (row.layer, row.call_index, row.signal.value, row.tensor_path, row.metric)
            values.setdefault(key, []).append(row.value)
    return {key: _fold(folded) for key, folded in values.items()}


def test_tables_of_two_alternating_layouts_fold_as_value_by_value() -> None:
    """Tables of two row counts and changing keys, alternating, fold as value by value.

    The remembered key columns of a row count are reused only for a table with the same keys,
    and every metric's statistics equal those of its values folded one at a time, in order.
    """
    rng = random.Random(4)
    records = []
    for n in range(60):
        layers = ("encoder.0", "head") if n % 3 else ("encoder.0", "encoder.1", "head")
        records.append(_record(n // 2, rng, RecordKind.FORWARD, layers))  # call (n // 2) % 2
    aggregates = RunAggregates()
    mapped: list[object] = []
    key_ids = aggregates._key_ids

    def counted(keys: Iterable[Key]) -> np.ndarray:
        mapped.append(keys)
        return key_ids(keys)

    aggregates._key_ids = counted  # type: ignore[method-assign]
    for record in records:
        aggregates.add(dataclasses.replace(record, rows=()), sample_history(record))
    assert 4 < len(mapped) < 50  # the keys of most tables were known; of some, not
    expected = _value_by_value(records)
    assert aggregates.summaries() == expected
    assert len(expected) == 36  # 3 layers, 2 calls, 2 signals, 3 metrics
    assert aggregates.samples == 60


def test_a_table_of_many_samples_folds_each_metrics_values_in_order() -> None:
    """A table in which a metric has many rows folds as the samples one by one.

    ``repair`` folds a run's history in batches of many samples; past ``WINDOW`` values too.
    """
    rng = random.Random(5)
    records = [_record(n, rng, RecordKind.FORWARD) for n in range(2 * WINDOW + 40)]
    one_by_one, at_once = RunAggregates(), RunAggregates()
    for record in records:
        one_by_one.add(record)
    at_once.add_table(pl.concat([sample_history(record) for record in records]))
    assert at_once.summaries() == one_by_one.summaries() == _value_by_value(records)


def test_a_nan_value_is_a_value_and_no_extreme() -> None:
    """A NaN value is counted as a value, but min and max stay those of the other values.

    Its mean is NaN (null in result.json); a null is an unavailable value.
    """
    table = pl.concat(
        [sample_history(_record(n, random.Random(n), RecordKind.FORWARD)) for n in range(3)]
    )
    first = (table.get_column("layer") == "head") & (table.get_column("metric") == "mean")
    first &= (table.get_column("signal") == "output") & (table.get_column("call_index") == 0)
    values = [2.0, math.nan]
    table = table.filter(first).with_columns(
        pl.Series("value", values, dtype=pl.Float64),
        pl.lit(None, pl.String).alias("unavailable_reason"),
    )
    table = pl.concat([table, table.head(1).with_columns(pl.lit(None, pl.Float64).alias("value"))])
    aggregates = RunAggregates()
    aggregates.add_table(table)
    (summary,) = aggregates.summaries().values()
    assert summary["count"] == 3
    assert summary["unavailable"] == 1
    assert summary["unavailable_reasons"] == {"unknown": 1}
    assert (summary["min"], summary["max"]) == (2.0, 2.0)
    assert math.isnan(summary["mean"])


def test_aggregates_pickle_without_their_remembered_tables_and_fold_on() -> None:
    """The writer process sends its aggregates back pickled: the copy folds on as the original."""
    rng = random.Random(6)
    records = [_record(n, rng, RecordKind.FORWARD) for n in range(30)]
    original = RunAggregates()
    for record in records[:20]:
        original.add(dataclasses.replace(record, rows=()), sample_history(record))
    copy = pickle.loads(pickle.dumps(original))
    assert copy._layouts == {}
    for aggregates in (original, copy):
        for record in records[20:]:
            aggregates.add(dataclasses.replace(record, rows=()), sample_history(record))
    assert copy.summaries() == original.summaries() == _value_by_value(records)
    assert copy.sample_summary() == original.sample_summary()


def test_durations_give_the_median_to_quote() -> None:
    """Mean, median (exact up to RESERVOIR samples), max and total; nulls without samples."""
    assert Durations().summary() == {"mean": None, "median": None, "max": None, "total": 0.0}
    durations = Durations()
    times = [120.0, 1.0, 3.0, 2.0]
    for duration in times:
        durations.add(duration)
    assert durations.summary() == {"mean": 31.5, "median": 2.5, "max": 120.0, "total": 126.0}
    for duration in np.random.default_rng(7).exponential(1.0, size=3 * RESERVOIR):
        durations.add(float(duration))
    assert len(durations.reservoir) == RESERVOIR
    median = durations.summary()["median"]
    assert median is not None
    assert 0.6 < median < 0.8  # ln 2 = 0.69
