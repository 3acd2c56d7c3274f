"""Online whole-run aggregates behind result.json: exact where promised, bounded otherwise."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from torchinstruments_core.run_directory._aggregate import RESERVOIR, WINDOW, MetricAggregate


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
