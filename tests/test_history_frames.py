"""The long table built a batch of samples at a time on the writer thread, and its chunks."""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
from typing import TYPE_CHECKING

import polars as pl
import torch
from torch import nn

from torchinstruments_core import AlwaysSampler, inject_observer
from torchinstruments_core._records import RecordKind, SampleRecord, Signal, StatRow
from torchinstruments_core.run_directory._layout import layout_for
from torchinstruments_core.run_directory._tables import (
    history_frame,
    history_frames,
    history_schema,
    sample_history,
)
from torchinstruments_core.run_directory._writer import BATCH_ROWS, ChunkWriter

if TYPE_CHECKING:
    from collections.abc import Callable


def _record(sample_id: int, *, rows: int = 3) -> SampleRecord:
    stat_rows = [
        StatRow(f"layer.{i}", i % 2, Signal.OUTPUT, "output", "std", float(i), None)
        for i in range(rows)
    ]
    stat_rows.append(
        StatRow("head", 0, Signal.OUTPUT_GRADIENT, "output", "p50", None, "no_gradient")
    )
    return SampleRecord(
        run_id="run",
        rank=0,
        sample_id=sample_id,
        step=None if sample_id % 2 else sample_id * 10,
        timestamp=1_700_000_000.25,
        forward_only=False,
        collection_duration_ms=1.0,
        rows=tuple(stat_rows),
        histograms=(),
        kind=RecordKind.FORWARD,
    )


def test_sample_history_holds_every_row_in_order_with_the_schema() -> None:
    """One sample's frame: one row per ``StatRow``, values in order, integer timestamps.

    Its columns are the history schema's, but for ``timestamp``: microseconds since the epoch,
    made datetimes once per chunk by ``history_frame``.
    """
    import polars as pl

    record = _record(4)
    frame = sample_history(record)
    assert frame.schema == pl.Schema({**history_schema(), "timestamp": pl.Int64()})
    assert frame["timestamp"].to_list() == [1_700_000_000_250_000] * 4
    frame = history_frame([record], {record.sample_id: frame})
    assert frame.schema == history_schema()
    assert frame["layer"].to_list() == [row.layer for row in record.rows]
    assert frame["signal"].to_list() == [row.signal.value for row in record.rows]
    assert frame["value"].to_list() == [row.value for row in record.rows]
    assert frame["unavailable_reason"].to_list() == [None, None, None, "no_gradient"]
    assert frame["step"].to_list() == [40] * 4
    assert frame["timestamp"].dt.epoch("us").to_list() == [1_700_000_000_250_000] * 4


def test_a_chunk_from_built_frames_equals_one_built_at_once() -> None:
    """Frames built on arrival, concatenated, equal the chunk built from the records directly."""
    records = [_record(i, rows=i) for i in range(5)]
    built = {record.sample_id: sample_history(record) for record in records[:3]}
    assert history_frame(records, built).equals(history_frame(records))
    assert history_frame(records).height == sum(len(r.rows) for r in records)
    empty = history_frame([])
    assert empty.height == 0
    assert empty.schema == history_schema()


def _history_beside_recording(
    folder: pathlib.Path, make: Callable[[], nn.Module], batch: tuple[int, int], steps: int
) -> list[tuple[object, ...]]:
    """Sample ``steps`` steps of a model into a run directory and of its twin into a recording.

    Asserts that ``history.parquet`` holds the recording's rows, in order and value for value;
    returns them.
    """
    from torchinstruments_core.testing import RecordingSink

    torch.manual_seed(0)
    model, twin = make(), make()
    twin.load_state_dict(model.state_dict())
    recording = RecordingSink()
    observers = [
        inject_observer(model, sampler=AlwaysSampler(), output_dir=folder),
        inject_observer(twin, sampler=AlwaysSampler(), sink=recording, run_id="x"),
    ]
    for _ in range(steps):
        inputs = torch.randn(*batch)
        model(inputs).square().mean().backward()
        twin(inputs).square().mean().backward()
    for observer in observers:
        observer.remove()
    history = pl.read_parquet(folder / "history.parquet").sort("sample_id", maintain_order=True)
    expected = [dataclasses.astuple(row) for sample in recording.samples for row in sample.rows]
    columns = ["layer", "call_index", "signal", "tensor_path", "metric"]
    assert history.select(columns).rows() == [row[:5] for row in expected]
    assert history["value"].to_list() == [row[5] for row in expected]
    return expected


def test_the_run_directory_history_matches_the_samples(tmp_path: pathlib.Path) -> None:
    """A run written through the writer process holds exactly the rows of its samples."""

    def small() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    assert _history_beside_recording(tmp_path / "run", small, (8, 4), 4)


def test_a_batchs_frames_are_each_samples_own() -> None:
    """One frame built for a batch, sliced: each slice equals the frame of its sample alone."""
    records = [_record(i, rows=i) for i in range(6)]
    frames = history_frames(records)
    assert [frame.height for frame in frames] == [len(record.rows) for record in records]
    for frame, record in zip(frames, records, strict=True):
        assert frame.equals(sample_history(record))


def _taking_writer(tmp_path: pathlib.Path) -> ChunkWriter:
    """A writer whose thread never starts: ``_take`` is called as its thread would."""
    layout = layout_for(tmp_path / "run", rank=0, per_rank=False)
    return ChunkWriter(layout, chunk_rows=10**6, flush_seconds=30.0, queue_size=8)


def test_samples_are_built_a_batch_at_a_time_and_let_their_rows_go(
    tmp_path: pathlib.Path,
) -> None:
    """Samples wait with their rows until ``BATCH_ROWS`` rows, then are built and let them go.

    The sample that reaches it has the whole batch built, each sample's rows in its own frame.
    """
    writer = _taking_writer(tmp_path)
    rows = 999  # with the record's gradient row, 1,000 a sample
    records = [_record(i, rows=rows) for i in range(BATCH_ROWS // 1000 + 1)]
    for record in records[:-1]:
        writer._take(record)
    assert all(held.history is None and held.record.rows for held in writer._buffer)
    writer._take(records[-1])
    assert not writer._unbuilt
    for held, record in zip(writer._buffer, records, strict=True):
        assert held.record.rows == ()
        assert held.history is not None
        assert held.history.equals(sample_history(record))
        assert held.rows == len(record.rows)


def test_a_sample_polars_cannot_take_fails_alone(tmp_path: pathlib.Path) -> None:
    """A batch with a row Polars cannot take is built sample by sample.

    The others get their frames; that one keeps its rows (its chunk's write then fails and
    reports it).
    """
    writer = _taking_writer(tmp_path)
    bad = dataclasses.replace(
        _record(1),
        rows=(StatRow("layer", 0, Signal.OUTPUT, "output", "mean", "one", None),),  # type: ignore[arg-type]
    )
    for record in (_record(0), bad, _record(2)):
        writer._take(record)
    writer._build()
    built = [held.history is not None for held in writer._buffer]
    assert built == [True, False, True]
    assert writer._buffer[1].record.rows == bad.rows


def test_a_run_across_many_batches_holds_every_row_and_counts_it(tmp_path: pathlib.Path) -> None:
    """Samples enough for several ``BATCH_ROWS`` batches, through the writer process.

    history.parquet holds them row for row as the recording sink got them, and result.json
    counts every value of every metric.
    """
    import json

    def tanh_mlp() -> nn.Sequential:
        widths = [16, 32, 32, 32, 8]
        layers: list[nn.Module] = []
        for width_in, width_out in itertools.pairwise(widths):
            layers += [nn.Linear(width_in, width_out), nn.Tanh()]
        return nn.Sequential(*layers)

    rows = _history_beside_recording(tmp_path / "run", tanh_mlp, (4, 16), 90)
    assert len(rows) > 3 * BATCH_ROWS
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    counts = [
        entry["count"]
        for layer in result["layers"]
        for measurement in layer["measurements"]
        for entry in measurement["metrics"].values()
    ]
    assert len(counts) > 100
    assert set(counts) == {90}
