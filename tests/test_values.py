"""What reaches the rows: values that agree with float64 references, nulls with a reason, no NaN."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import OrderedDict
from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch import nn

from helpers import FailingReducer, FailingSink
from torchinstruments_core import (
    AlwaysSampler,
    ObservationError,
    ObservationWarning,
    StatRow,
    inject_observer,
)
from torchinstruments_core.testing import RecordingSink

# every test once with the compiled CPU kernels and once through numpy and torch
pytestmark = pytest.mark.usefixtures("reduction_path")

METRICS = (
    "mean",
    "std",
    "min",
    "max",
    "zero_fraction",
    "nonfinite_fraction",
    "rms",
    "max_abs",
    "l2_norm",
    "p25",
    "p50",
    "p75",
)


class Emit(nn.Module):
    """Returns whatever it is given, so a test controls the observed output exactly."""

    def forward(self, value: Any) -> Any:
        return value


def _observe(value: Any, **kwargs: Any) -> list[StatRow]:
    model = Emit()
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, **kwargs):
        model(value)
    return sink.rows


def _by_metric(rows: list[StatRow], path: str = "output") -> dict[str, StatRow]:
    return {row.metric: row for row in rows if row.tensor_path == path}


def _train(model: nn.Module, *, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(2, 2)).sum().backward()


def _scaled_norm(finite: np.ndarray) -> float:
    """``sqrt(sum(x**2))`` in float64, divided by the largest magnitude first: no overflow."""
    top = float(np.abs(finite).max())
    return math.sqrt(((finite / top) ** 2).sum()) * top if top else 0.0


def _reference(x: np.ndarray) -> dict[str, float]:
    finite = x[np.isfinite(x)]
    return {
        "mean": finite.mean(),
        "std": finite.std(),
        "min": finite.min(),
        "max": finite.max(),
        "zero_fraction": float((x == 0).mean()),
        "nonfinite_fraction": float((~np.isfinite(x)).mean()),
        "rms": math.sqrt((finite**2).mean()),
        "max_abs": np.abs(finite).max(),
        "l2_norm": _scaled_norm(finite),
        "p25": np.quantile(finite, 0.25),
        "p50": np.quantile(finite, 0.5),
        "p75": np.quantile(finite, 0.75),
    }


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_every_metric_agrees_with_a_float64_reference(dtype: torch.dtype) -> None:
    """All twelve metrics of an output, through the engine, match numpy in float64.

    The quartiles exactly too: 8,151 entries, within the default subsample's 8,192.
    """
    x = (torch.randn(247, 33, dtype=torch.float64) * 3 + 1).to(dtype)
    x[0, :5] = 0
    x[1, 0], x[1, 1], x[1, 2] = float("nan"), float("inf"), float("-inf")
    rows = _by_metric(_observe(x))
    expected = _reference(x.to(torch.float64).numpy())
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert set(rows) == set(METRICS)
    for metric, value in expected.items():
        assert rows[metric].value == pytest.approx(value, rel=tolerance, abs=tolerance), metric


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (torch.empty(0), "empty_tensor"),
        (torch.arange(6), "unsupported_dtype"),
        (torch.ones(3, dtype=torch.bool), "unsupported_dtype"),
        (torch.zeros(2, 2).to_sparse(), "sparse_tensor"),
        (torch.zeros(2, 2, device="meta"), "meta_tensor"),
    ],
)
def test_tensors_that_cannot_be_reduced_give_nulls_with_a_reason(
    value: torch.Tensor, reason: str
) -> None:
    """Empty, integer, bool, sparse and meta tensors: every metric null with its reason."""
    rows = _observe(value)
    assert [r.metric for r in rows] == list(METRICS)
    assert {(r.value, r.unavailable_reason) for r in rows} == {(None, reason)}


def test_no_finite_entries_gives_null_statistics_and_real_fractions() -> None:
    """With no finite entry the statistics are null (no_finite_values); fractions stay exact."""
    rows = _by_metric(
        _observe(torch.tensor([float("nan"), float("inf"), float("-inf"), float("nan")]))
    )
    assert rows["nonfinite_fraction"].value == 1.0
    assert rows["zero_fraction"].value == 0.0
    for metric in ("mean", "std", "min", "max", "rms", "max_abs", "l2_norm", "p25", "p50", "p75"):
        assert rows[metric].value is None
        assert rows[metric].unavailable_reason == "no_finite_values"


def test_all_zeros() -> None:
    """A tensor of zeros: zero_fraction 1, every statistic 0 (a real zero, not a made-up one)."""
    rows = _by_metric(_observe(torch.zeros(10, 10)))
    assert rows["zero_fraction"].value == 1.0
    zeros = ("mean", "std", "min", "max", "rms", "max_abs", "l2_norm", "p50")
    assert {rows[m].value for m in zeros} == {0.0}


def test_value_is_null_exactly_when_a_reason_is_given_and_never_nan() -> None:
    """Across mixed outputs, value is None iff unavailable_reason is set, and no value is NaN."""
    mixed = (torch.randn(4), torch.empty(0), torch.tensor([float("nan")]), torch.arange(3))
    rows = _observe(mixed)
    assert rows
    for row in rows:
        assert (row.value is None) == (row.unavailable_reason is not None)
        assert row.value is None or math.isfinite(row.value)


class Pair(NamedTuple):
    hidden: torch.Tensor
    cell: torch.Tensor


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    extras: list[torch.Tensor]


class ModelOutput(OrderedDict[str, Any]):
    """The shape of a Hugging Face ModelOutput: an ordered dict of named tensors."""


def test_tensor_paths_in_nested_outputs() -> None:
    """Paths name where each tensor sits in tuples, lists, dicts, dataclasses and named tuples."""
    value = (
        torch.ones(1),
        {"hidden": torch.ones(1), "skip": "text", "none": None},
        Pair(torch.ones(1), torch.ones(1)),
        Output(torch.ones(1), [torch.ones(1), torch.ones(1)]),
        ModelOutput(logits=torch.ones(1), loss=torch.ones(())),
    )
    paths = list(dict.fromkeys(r.tensor_path for r in _observe(value)))
    assert paths == [
        "output.0",
        "output.1.hidden",
        "output.2.hidden",
        "output.2.cell",
        "output.3.logits",
        "output.3.extras.0",
        "output.3.extras.1",
        "output.4.logits",
        "output.4.loss",
    ]
    assert next(r.tensor_path for r in _observe(torch.ones(1))) == "output"


def test_std_is_accurate_when_the_mean_dominates() -> None:
    """Std of 1000 + N(0, 1) in float32 has no E[x^2] - E[x]^2 cancellation."""
    x = 1000.0 + torch.randn(1_000_000)
    rows = _by_metric(_observe(x))
    reference = x.to(torch.float64).std(unbiased=False).item()
    assert rows["std"].value == pytest.approx(reference, rel=1e-4)


def test_reducer_error_under_warn_records_the_reason_and_warns_once() -> None:
    """A failing reducer: null values with reducer_error, one warning, training goes on."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    sink = RecordingSink()
    observer = inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, reducers=[FailingReducer()]
    )
    with pytest.warns(ObservationWarning, match="a reducer failed on 0 call 0 output") as caught:
        _train(model, steps=3)
    observer.remove()
    assert len([w for w in caught if issubclass(w.category, ObservationWarning)]) == 1
    assert len(sink.samples) == 3
    reasons = {r.unavailable_reason for r in sink.rows}
    assert reasons == {"reducer_error: RuntimeError: boom"}


def test_reducer_error_under_raise_stops() -> None:
    """error_policy='raise' turns a failing reducer into ObservationError."""
    model = nn.Linear(2, 2)
    with (
        inject_observer(
            model,
            sampler=AlwaysSampler(),
            sink=RecordingSink(),
            reducers=[FailingReducer()],
            error_policy="raise",
        ),
        pytest.raises(ObservationError, match="RuntimeError: boom"),
    ):
        model(torch.randn(2, 2))


def test_sink_failure_under_warn_keeps_training() -> None:
    """A sink that cannot write: one warning saying the sample is lost, training goes on."""
    model = nn.Linear(2, 2)
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=FailingSink())
    with pytest.warns(
        ObservationWarning, match="could not write sample 0.*OSError: disk full.*lost"
    ):
        _train(model, steps=3)
    observer.remove()


def test_sink_failure_under_raise_stops() -> None:
    """error_policy='raise' turns a failing sink into ObservationError where the sample closes."""
    model = nn.Linear(2, 2)
    observer = inject_observer(
        model, sampler=AlwaysSampler(), sink=FailingSink(), error_policy="raise"
    )
    with pytest.raises(ObservationError, match="could not write sample 0: OSError: disk full"):
        model(torch.randn(2, 2)).sum().backward()  # closes at the end of the backward
    with torch.no_grad(), pytest.raises(ObservationError, match="sample 1: OSError"):
        model(torch.randn(2, 2))  # a forward-only sample closes with the forward
    model(torch.randn(2, 2))  # its graph is freed at once: delivered at the next safe point
    with pytest.raises(ObservationError, match="sample 2: OSError"):
        observer.flush()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        observer.remove()


def test_histograms_of_focus_modules() -> None:
    """Focus modules get a fixed-bin histogram of each output and gradient, counts summing up."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    sink = RecordingSink()
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, histogram_bins=10, max_focus_layers=1
    ):
        model(torch.randn(16, 4)).sum().backward()
    histograms = sink.samples[0].histograms
    assert [(h.layer, str(h.signal)) for h in histograms] == [
        ("0", "output"),
        ("0", "output_gradient"),
    ]
    for histogram in histograms:
        assert len(histogram.edges) == 11
        assert sum(histogram.counts) == 16 * 8
        assert histogram.nonfinite_count == 0


EDGE_CASES = [
    (torch.float32, 1e20),  # squares overflow float32
    (torch.float32, 3e38),  # so does the sum
    (torch.float32, 1e-30),  # squares underflow to zero
    (torch.float32, 1e-42),  # the entries are subnormal
    (torch.bfloat16, 1e37),
    (torch.float16, 6e4),
    (torch.float16, 1e-7),
    (torch.float64, 1e300),
    (torch.float64, 1e-300),
]


def _exact_reference(x: np.ndarray) -> dict[str, float]:
    """Mean, std and rms of float64 entries computed exactly (fractions), rounded once."""
    entries = [Fraction(float(v)) for v in x]
    mean = sum(entries, Fraction(0)) / len(entries)
    variance = sum(((e - mean) ** 2 for e in entries), Fraction(0)) / len(entries)
    squares = sum((e * e for e in entries), Fraction(0))
    with localcontext() as context:
        context.prec = 40

        def sqrt(value: Fraction) -> float:
            return float((Decimal(value.numerator) / Decimal(value.denominator)).sqrt())

        return {
            "mean": float(mean),
            "std": sqrt(variance),
            "rms": sqrt(squares / len(entries)),
            "l2_norm": sqrt(squares),
        }


@pytest.mark.parametrize(("dtype", "magnitude"), EDGE_CASES)
@pytest.mark.parametrize("nonfinite", [False, True])
def test_every_finite_tensor_gets_finite_statistics(
    dtype: torch.dtype, magnitude: float, nonfinite: bool
) -> None:
    """Entries near the largest or smallest floats still give every statistic, to rounding.

    Mean, std, rms and l2_norm are checked against an exact (fraction) reference of the entries
    as given, also with a NaN and an infinity among them (the masked path accelerators run).
    The one exception is an ``l2_norm`` past the working dtype's largest float (float32 entries
    near 3e38): it is infinite, as ``torch.linalg.vector_norm``'s, so null with its reason.
    """
    generator = torch.Generator().manual_seed(3)
    x = (torch.rand(3001, generator=generator, dtype=torch.float64) * 1.6 - 0.6) * magnitude
    x = x.to(dtype)
    if nonfinite:
        x[5], x[17] = math.nan, -math.inf
    rows = _by_metric(_observe(x))
    entries = x.to(torch.float64).numpy()
    with np.errstate(over="ignore"):  # float64 squares overflow: the exact reference has them
        expected = _reference(entries)
    expected.update(_exact_reference(entries[np.isfinite(entries)]))
    tolerance = 1e-12 if dtype == torch.float64 else 2e-6
    working = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32)
    spacing = 2 * working.smallest_normal * working.eps  # results below it round to subnormals
    for metric, value in expected.items():
        if metric == "l2_norm" and value > working.max:  # the true norm is past the dtype
            assert rows[metric].unavailable_reason == "non_finite_result"
            continue
        assert rows[metric].unavailable_reason is None, (metric, rows[metric])
        assert rows[metric].value == pytest.approx(value, rel=tolerance, abs=spacing), metric


def test_values_at_the_top_of_the_float32_range() -> None:
    """Entries at float32's largest finite value: mean, std, rms and quartiles all finite."""
    top = torch.finfo(torch.float32).max
    x = torch.tensor([top, -top, top, top, -top])
    rows = _by_metric(_observe(x))
    # sqrt(5) * top is past float32: the one metric that cannot be held
    assert rows.pop("l2_norm").unavailable_reason == "non_finite_result"
    assert all(row.unavailable_reason is None for row in rows.values())
    assert rows["mean"].value == pytest.approx(top / 5)
    assert rows["rms"].value == pytest.approx(top)
    assert rows["std"].value == pytest.approx(np.float64(top) * math.sqrt(24) / 5)
    assert rows["p50"].value == pytest.approx(top)
    assert rows["p25"].value == pytest.approx(-top)
