"""The selection behind the CPU quartiles: a few entries of the sorted array, without sorting."""

from __future__ import annotations

import numpy as np
import pytest

from torchinstruments_core.reducers import _select
from torchinstruments_core.reducers._select import order_statistics


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    normal = rng.standard_normal(40_000)
    return {
        "normal": normal.astype(np.float32),
        "relu": np.maximum(normal, 0).astype(np.float32),
        "constant": np.full(40_000, 3.5, dtype=np.float32),
        "sorted": np.sort(normal).astype(np.float32),
        "reversed": np.sort(normal)[::-1].astype(np.float32),
        "few_values": np.round(normal).astype(np.float64),
        "heavy_tails": rng.standard_cauchy(50_000).astype(np.float32),
        "small": normal[:1000].astype(np.float32),
        "extremes": np.concatenate([normal * 1e37, [-3.4e38, 3.4e38]]).astype(np.float32),
    }


def _ranks(size: int) -> list[int]:
    last = size - 1
    belows = [int(last * q) for q in (0.0, 0.25, 0.5, 0.75, 1.0)]
    return [*belows, *(min(b + 1, last) for b in belows)]


@pytest.mark.parametrize("name", sorted(_arrays()))
def test_order_statistics_equal_the_sorted_entries(name: str) -> None:
    """Every requested rank gets exactly ``np.sort(values)[rank]``, ties and extremes included."""
    values = _arrays()[name]
    before = values.copy()
    found = order_statistics(values, _ranks(values.size))
    expected = np.sort(values)
    assert {rank: expected[rank] for rank in _ranks(values.size)} == found
    assert np.array_equal(values, before)  # the input is not reordered


def test_missed_brackets_fall_back_to_the_whole_array(monkeypatch: pytest.MonkeyPatch) -> None:
    """With brackets too narrow to hold their entries, the result is still exact."""
    monkeypatch.setattr(_select, "_SPREAD", 0.0)
    values = np.random.default_rng(3).standard_normal(50_000).astype(np.float32)
    missed = []
    original = _select._bracketed

    def bracketed(*args: object) -> dict[int, float]:
        found = original(*args)  # type: ignore[arg-type]
        missed.append(not found)
        return found

    monkeypatch.setattr(_select, "_bracketed", bracketed)
    ranks = [int(49_999 * q) + d for q in (0.1, 0.25, 0.5, 0.75, 0.9) for d in (0, 1)]
    found = order_statistics(values, ranks)
    assert any(missed)
    expected = np.sort(values)
    assert found == {rank: expected[rank] for rank in ranks}
