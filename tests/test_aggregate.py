"""Online whole-run aggregates behind result.json: exact where promised, bounded otherwise."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest

from torchinstruments_core import SampleRecord, StatRow
from torchinstruments_core._signals import RecordKind, Signal
from torchinstruments_core.run_directory._aggregate import (
    RESERVOIR,
    WINDOW,
    MetricAggregate,
    RunAggregates,
)
from torchinstruments_core.run_directory._tables import sample_history


def _fold(values: list[float | None]) -> dict[str, object]:
    aggregate = MetricAggregate()
    rng = random.Random(0)
    for value in values:
        aggregate.add(value, None if value is not None else "no_finite_values", rng)
    return aggregate.summary()


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
    aggregate = MetricAggregate()
    rng = random.Random(0)
    for value in x:
        aggregate.add(float(value), None, rng)
    assert len(aggregate.reservoir) == RESERVOIR
    assert len(aggregate.first) == len(aggregate.recent) == WINDOW
    summary = aggregate.summary()
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


def _record(sample_id: int, rng: random.Random, kind: RecordKind) -> SampleRecord:
    rows = []
    for layer in ("encoder.0", "head"):
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
    assert list(from_tables.metrics) == list(from_rows.metrics)
    assert len(from_rows.metrics) == 24  # 2 layers, 2 calls, 2 signals, 3 metrics
    for key, aggregate in from_rows.metrics.items():
        assert from_tables.metrics[key].summary() == aggregate.summary(), key
    assert from_tables.sample_summary() == from_rows.sample_summary()
    assert from_tables.step_record_summary() == from_rows.step_record_summary()
