"""A sample's rows kept as parts (``SampleRows``): a sequence of ``StatRow`` like a tuple.

What reads only columns (the history table, the routed scalars, the non-finite onset, the
summaries) reads the parts and gives what it gives for the same rows as a plain tuple.
"""

from __future__ import annotations

import copy
import math
import pickle
from collections.abc import Mapping

import pytest
import torch
from torch import nn

from torchinstruments_core import (
    AlwaysSampler,
    HistogramRecord,
    LayerInfo,
    RunInfo,
    SampleRecord,
    Signal,
    StatRow,
    UnavailableReason,
    inject_observer,
)
from torchinstruments_core._nonfinite import find_onset
from torchinstruments_core._rows import RowPart, SampleRows, row_parts
from torchinstruments_core.routing import LoggerRouter
from torchinstruments_core.routing.base import summary_scalars
from torchinstruments_core.run_directory._tables import sample_history
from torchinstruments_core.testing import RecordingSink

_METRICS = ("mean", "nonfinite_fraction", "rms")


def _parts() -> list[RowPart]:
    return [
        RowPart("a", 0, Signal.OUTPUT, "output", _METRICS, [1.0, 0.0, 2.0], None),
        RowPart(
            "b",
            1,
            Signal.OUTPUT,
            "output.0",
            _METRICS,
            [None, 0.5, 3.0],
            [UnavailableReason.NO_FINITE_VALUES, None, None],
        ),
        RowPart("a", 0, Signal.OUTPUT_GRADIENT, "output", _METRICS, [None] * 3, ["r"] * 3),
    ]


def _expected() -> tuple[StatRow, ...]:
    no_finite = UnavailableReason.NO_FINITE_VALUES
    return (
        StatRow("a", 0, Signal.OUTPUT, "output", "mean", 1.0, None),
        StatRow("a", 0, Signal.OUTPUT, "output", "nonfinite_fraction", 0.0, None),
        StatRow("a", 0, Signal.OUTPUT, "output", "rms", 2.0, None),
        StatRow("b", 1, Signal.OUTPUT, "output.0", "mean", None, no_finite),
        StatRow("b", 1, Signal.OUTPUT, "output.0", "nonfinite_fraction", 0.5, None),
        StatRow("b", 1, Signal.OUTPUT, "output.0", "rms", 3.0, None),
        *(StatRow("a", 0, Signal.OUTPUT_GRADIENT, "output", m, None, "r") for m in _METRICS),
    )


def test_parts_are_the_rows_of_a_tuple() -> None:
    """Length, order, indexing, slicing, equality and hash are those of the tuple of rows."""
    rows, expected = SampleRows(_parts()), _expected()
    assert len(rows) == len(expected) == 9
    assert tuple(rows) == expected
    assert rows == expected
    assert expected == rows
    assert rows == list(expected)
    assert rows != expected[:-1]
    assert rows[3] == expected[3]
    assert rows[-1] == expected[-1]
    assert rows[2:4] == expected[2:4]
    assert hash(rows) == hash(expected)
    assert SampleRows([]) == ()
    assert "3 parts, 9 rows" in repr(rows)


def test_pickled_rows_come_back_as_a_tuple() -> None:
    """A record crossing processes carries plain rows."""
    record = _record(SampleRows(_parts()))
    again = pickle.loads(pickle.dumps(record))
    assert again.rows == _expected()
    assert isinstance(again.rows, tuple)
    assert again == record


def test_a_pickled_or_copied_histogram_record_is_equal_to_the_original() -> None:
    """``HistogramRecord`` pickles as its fields (``__reduce__``): every one comes back."""
    record = HistogramRecord(
        "block.conv", 2, Signal.OUTPUT_GRADIENT, "0", (0.0, 0.5, 1.0), (3.0, 4.0), nonfinite_count=5
    )
    for again in (pickle.loads(pickle.dumps(record)), copy.copy(record), copy.deepcopy(record)):
        assert again == record
        assert again is not record
        assert again.signal is Signal.OUTPUT_GRADIENT


def test_the_parts_of_a_plain_tuple_are_its_rows() -> None:
    """``row_parts`` of a tuple gives one part per row, with its reason."""
    parts = list(row_parts(_expected()))
    assert len(parts) == 9
    assert [row for part in parts for row in part.rows()] == list(_expected())
    assert parts[0].reasons is None
    assert parts[3].reasons == (UnavailableReason.NO_FINITE_VALUES,)


def _record(rows: object, step: int = 4) -> SampleRecord:
    return SampleRecord("run", 0, 2, step, 1.5, False, 0.7, rows, ())  # type: ignore[arg-type]


@pytest.mark.parametrize("signal", [Signal.OUTPUT, Signal.OUTPUT_GRADIENT])
def test_what_reads_columns_gives_the_same_for_parts_and_rows(signal: Signal) -> None:
    """The history table, routed scalars, summaries and non-finite onset agree on both forms."""
    parts = _parts()
    parts[0] = parts[0]._replace(signal=signal)
    parted = _record(SampleRows(parts))
    plain = _record(tuple(SampleRows(parts)))
    assert sample_history(parted).equals(sample_history(plain))
    assert summary_scalars(parted, "t") == summary_scalars(plain, "t")
    assert find_onset(parted) == find_onset(plain)
    assert find_onset(parted) is not None
    written: list[dict[str, float]] = []

    class Target:
        def log(
            self,
            scalars: Mapping[str, float],
            histograms: Mapping[str, HistogramRecord],
            step: int,
        ) -> None:
            written.append(dict(scalars))

    router = LoggerRouter([Target()], scalar_layers="all", scalar_metrics=("rms", "mean"))
    router.open(_run())
    router.write(parted)
    router.write(plain)
    assert written[0] == written[1]
    key = "telemetry/a/output/rms" if signal is Signal.OUTPUT else "telemetry/a/output_gradient/rms"
    assert written[0][key] == 2.0
    assert written[0]["telemetry/b/output/call_1/output.0/rms"] == 3.0
    assert "telemetry/b/output/call_1/output.0/mean" not in written[0]  # no value: not logged


def _run() -> RunInfo:
    layers = (LayerInfo("a", "Linear", 1, True), LayerInfo("b", "Linear", 1, True))
    return RunInfo("run", 0, 1, "rank0", "Model", "always", layers, _METRICS)


def test_a_sample_s_rows_are_parts_and_equal_what_its_values_give() -> None:
    """The engine's records keep parts; made into rows they hold every value once.

    A model whose output has a NaN: its rows say which values are missing and why.
    """
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    sink = RecordingSink()
    with inject_observer(model, sink=sink, sampler=AlwaysSampler(), background_reductions=False):
        x = torch.randn(5, 4)
        x[:, 0] = math.nan  # every output entry NaN: its statistics have no finite entries
        model(x).sum().backward()
    (sample,) = sink.samples
    assert isinstance(sample.rows, SampleRows)
    rows = list(sample.rows)
    assert len(rows) == len(sample.rows) == sum(len(p.metrics) for p in sample.rows.parts)
    missing = [row for row in rows if row.value is None]
    assert missing
    assert all(row.unavailable_reason for row in missing)
    assert all(row.unavailable_reason is None for row in rows if row.value is not None)
    assert sample_history(sample).height == len(rows)
