"""The run directory, read back with real readers: polars, json, TensorBoard's EventAccumulator."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments_core import (
    AlwaysSampler,
    EveryNForwardsSampler,
    ObservationError,
    ObservationWarning,
    SampleRecord,
    StatRow,
    inject_observer,
)
from torchinstruments_core._exceptions import RunDirectoryExistsError
from torchinstruments_core._signals import Signal
from torchinstruments_core.reducers import DEFAULT_METRICS
from torchinstruments_core.run_directory import (
    QUERIES,
    QUERY_PRELUDE,
    RunDirectorySink,
    history_schema,
    samples_schema,
)

if TYPE_CHECKING:
    from collections.abc import Callable


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.last = nn.Linear(8, 2)
        self.never = nn.Linear(2, 2)  # selected but never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.act(self.first(x)))


def _train(model: nn.Module, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(8, 4)).square().mean().backward()


def _train_slowly(model: nn.Module, *, steps: int) -> None:
    """Train with pauses, so the background writer gets to fail and report it."""
    for _ in range(steps):
        _train(model, 1)
        time.sleep(0.02)


def _train_until(model: nn.Module, done: Callable[[], bool], *, seconds: float = 60) -> None:
    """Train slowly until ``done()``, at most ``seconds``.

    For what the background writer reports: its process may still be starting (importing
    Polars takes over a second on a slow machine), and samples wait for it meanwhile.
    """
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        _train_slowly(model, steps=1)


def _strict_json(path: pathlib.Path) -> dict[str, Any]:
    def refuse(constant: str) -> None:
        raise AssertionError(f"non-strict JSON constant {constant}")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture
def finished_run(tmp_path: pathlib.Path) -> pathlib.Path:
    """A run of 6 samples of Net, removed (finalized)."""
    model = Net()
    with inject_observer(model, sampler=AlwaysSampler(), output_dir=tmp_path / "stats"):
        _train(model, 6)
    return tmp_path / "stats"


def test_history_has_the_fixed_schema(finished_run: pathlib.Path) -> None:
    """history.parquet has exactly the long table's columns and dtypes, value null iff a reason."""
    history = pl.read_parquet(finished_run / "history.parquet")
    assert history.schema == pl.Schema(
        {  # type: ignore[arg-type]  # a class and an instance: no common type inferred
            "run_id": pl.String,
            "rank": pl.Int32,
            "sample_id": pl.Int64,
            "step": pl.Int64,
            "timestamp": pl.Datetime("us", "UTC"),
            "layer": pl.String,
            "call_index": pl.Int32,
            "signal": pl.String,
            "tensor_path": pl.String,
            "metric": pl.String,
            "value": pl.Float64,
            "unavailable_reason": pl.String,
        }
    )
    assert history.height == 6 * 3 * 2 * len(
        DEFAULT_METRICS
    )  # samples x layers x signals x metrics
    assert (
        history.filter(
            pl.col("value").is_null() != pl.col("unavailable_reason").is_not_null()
        ).height
        == 0
    )
    assert sorted(history["sample_id"].unique()) == list(range(6))
    assert history["step"].null_count() == history.height
    assert not (finished_run / "history.parts").exists()
    samples = pl.read_parquet(finished_run / "samples.parquet")
    assert samples["sample_id"].to_list() == list(range(6))
    assert samples["forward_only"].to_list() == [False] * 6


def test_result_json_aggregates_every_layer(finished_run: pathlib.Path) -> None:
    """result.json is strict JSON listing every selected layer; aggregates match the history."""
    result = _strict_json(finished_run / "result.json")
    assert result["status"] == "complete"
    assert [layer["name"] for layer in result["layers"]] == ["first", "act", "last", "never"]
    assert result["layers"][3]["measurements"] == []
    assert result["samples"]["count"] == 6
    measurement = result["layers"][0]["measurements"][0]
    assert (measurement["call_index"], measurement["signal"], measurement["tensor_path"]) == (
        0,
        "output",
        "output",
    )
    stats = measurement["metrics"]["std"]
    history = pl.read_parquet(finished_run / "history.parquet")
    values = (
        history.filter(
            (pl.col("layer") == "first")
            & (pl.col("signal") == "output")
            & (pl.col("metric") == "std")
        )
        .sort("sample_id")["value"]
        .to_numpy()
    )
    assert stats["count"] == 6
    assert stats["unavailable"] == 0
    assert stats["mean"] == pytest.approx(values.mean())
    assert stats["std"] == pytest.approx(values.std())
    assert stats["min"] == pytest.approx(values.min())
    assert stats["p75"] == pytest.approx(np.quantile(values, 0.75))
    assert stats["early_mean"] == pytest.approx(values[0])
    assert stats["recent_mean"] == pytest.approx(values[-1])


def test_result_json_counts_unavailable_values_with_reasons(tmp_path: pathlib.Path) -> None:
    """Unavailable values are counted per reason; no NaN or Infinity is written."""

    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * float("nan")

    model = nn.Sequential(nn.Linear(2, 2), Broken())
    with inject_observer(model, sampler=AlwaysSampler(), output_dir=tmp_path / "run"):
        for _ in range(3):
            with torch.no_grad():
                model(torch.randn(2, 2))
    result = _strict_json(tmp_path / "run" / "result.json")
    mean = result["layers"][1]["measurements"][0]["metrics"]["mean"]
    assert mean["unavailable"] == 3
    assert mean["unavailable_reasons"] == {"no_finite_values": 3}
    assert mean["mean"] is None
    assert result["layers"][1]["measurements"][0]["metrics"]["nonfinite_fraction"]["mean"] == 1.0


def test_index_md_shows_each_column_s_dtype_as_polars_prints_it(
    finished_run: pathlib.Path,
) -> None:
    """index.md's schema tables, written without polars, show polars' own dtypes."""
    index = (finished_run / "index.md").read_text()
    for schema in (history_schema(), samples_schema()):
        for name, dtype in schema.items():
            assert f"| `{name}` | {dtype} |" in index
    assert "| `timestamp` | Datetime(time_unit='us', time_zone='UTC') |" in index


def test_a_run_imports_no_polars_in_the_training_process_until_it_ends(
    tmp_path: pathlib.Path,
) -> None:
    """Sampled steps never import polars where the model trains; finishing the run does.

    The run directory opens in the first sampled forward, on the training thread: importing
    polars there (for index.md's schema tables) held that step up for about half a second.
    """
    code = f"""
import sys, torch
from torch import nn
from torchinstruments_core import inject_observer
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
observer = inject_observer(model, output_dir={str(tmp_path / "run")!r})
for step in range(4):
    observer.begin_step(step, sample=True)
    model(torch.randn(3, 4)).sum().backward()
    observer.end_step()
observer.flush()
print("during", "polars" in sys.modules)
observer.remove()
print("after", "polars" in sys.modules)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert result.stdout.split() == ["during", "False", "after", "True"]
    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    assert history.schema == history_schema()
    assert history["sample_id"].n_unique() == 4


def test_index_md_queries_run_against_the_run(
    finished_run: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every query that index.md shows runs against the run it describes."""
    index = (finished_run / "index.md").read_text()
    for heading in (
        "## Schema of history.parquet",
        "## Observed modules",
        "| `never` | Linear | 6 |",
    ):
        assert heading in index
    assert f"torch {torch.__version__}" in index
    assert "sampling: AlwaysSampler()" in index
    blocks = re.findall(r"```python\n(.*?)```", index, flags=re.DOTALL)
    assert blocks[0].strip() == QUERY_PRELUDE
    assert [b.strip() for b in blocks[1:]] == [code.strip() for _, code in QUERIES]
    monkeypatch.chdir(finished_run)
    namespace: dict[str, object] = {}
    exec(blocks[0], namespace)
    for block in blocks[1:]:
        exec(block, namespace)
    outliers = namespace["outliers"]
    assert isinstance(outliers, pl.DataFrame)
    assert set(outliers["layer"]) == {"first", "act", "last"}


def test_tensorboard_holds_histograms_at_the_sample_ids(finished_run: pathlib.Path) -> None:
    """tensorboard/ has one histogram tag per focus layer and signal, at each sample id."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(
        str(finished_run / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0}
    )
    events.Reload()
    tags = events.Tags()["histograms"]
    assert "telemetry/first/output/histogram" in tags
    assert "telemetry/last/output_gradient/histogram" in tags
    histogram = events.Histograms("telemetry/first/output/histogram")
    assert [event.step for event in histogram] == list(range(6))
    assert histogram[0].histogram_value.num == 8 * 8
    assert [e.step for e in events.Scalars("telemetry/collection_duration_ms")] == list(range(6))
    assert "telemetry/first/output/rms" in events.Tags()["scalars"]


def test_result_json_lists_the_catalog_while_running(tmp_path: pathlib.Path) -> None:
    """Before removal result.json holds the layer catalog with empty measurements."""
    model = Net()
    with inject_observer(model, sampler=AlwaysSampler(), output_dir=tmp_path / "run"):
        _train(model, 1)
        result = _strict_json(tmp_path / "run" / "result.json")
        assert result["status"] == "running"
        assert [layer["name"] for layer in result["layers"]] == ["first", "act", "last", "never"]
        assert all(layer["measurements"] == [] for layer in result["layers"])
        assert [layer["parameters"] for layer in result["layers"]] == [40, 0, 18, 6]


def test_chunks_are_readable_while_training_runs(tmp_path: pathlib.Path) -> None:
    """Completed chunks appear in history.parts/ during the run and read with scan_parquet."""
    model = Net()
    sink = RunDirectorySink(tmp_path / "run", chunk_rows=1, flush_seconds=0.05)
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        _train(model, 4)
        parts = tmp_path / "run" / "history.parts"
        deadline = time.monotonic() + 20
        while len(list(parts.glob("history-*.parquet"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        frame = pl.scan_parquet(parts / "history-*.parquet").collect()
        assert sorted(frame["sample_id"].unique()) == [0, 1, 2, 3]
        assert all(not p.name.endswith(".tmp") for p in parts.glob("*.parquet"))
    assert pl.read_parquet(tmp_path / "run" / "history.parquet").height == frame.height


def test_a_new_run_never_overwrites_an_old_one(finished_run: pathlib.Path) -> None:
    """Injecting into a folder that holds a run raises at once, naming the folder."""
    before = (finished_run / "history.parquet").read_bytes()
    with pytest.raises(RunDirectoryExistsError, match="already holds a run"):
        inject_observer(Net(), output_dir=finished_run)
    assert (finished_run / "history.parquet").read_bytes() == before
    with pytest.raises(FileExistsError):
        RunDirectorySink(finished_run)


def test_a_run_without_samples_still_writes_its_files(tmp_path: pathlib.Path) -> None:
    """Removing an observer that took no sample writes an empty history, result and index."""
    inject_observer(
        Net(), sampler=EveryNForwardsSampler(10, offset=5), output_dir=tmp_path / "run"
    ).remove()
    assert pl.read_parquet(tmp_path / "run" / "history.parquet").height == 0
    assert _strict_json(tmp_path / "run" / "result.json")["samples"]["count"] == 0


def test_vanished_folder_under_warn_keeps_training(tmp_path: pathlib.Path) -> None:
    """The run folder vanishes mid-run: a warning says which samples were lost; training goes on."""
    model = Net()
    # TensorBoard's own writer thread dies noisily when its folder vanishes; this is about ours.
    sink = RunDirectorySink(tmp_path / "run", chunk_rows=1, flush_seconds=0.05, tensorboard=False)
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    _train(model, 1)
    (tmp_path / "run").rename(tmp_path / "gone")  # the folder vanishes from under the writer
    with pytest.warns(ObservationWarning, match=r"samples? .* were not written") as caught:
        _train_until(model, lambda: any("were not written" in str(w.message) for w in caught))
    with pytest.warns(ObservationWarning, match="could not close"):
        observer.remove()


def test_unwritable_chunk_folder_under_raise_stops(tmp_path: pathlib.Path) -> None:
    """A chunk that cannot be written raises ObservationError under error_policy='raise'."""
    model = Net()
    sink = RunDirectorySink(tmp_path / "run", chunk_rows=1, flush_seconds=0.05, tensorboard=False)
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink, error_policy="raise")
    _train(model, 1)
    parts = tmp_path / "run" / "history.parts"
    parts.rename(tmp_path / "moved")  # atomic, unlike deleting while the writer writes
    parts.write_text("not a folder")  # every later chunk write fails
    with pytest.raises(ObservationError, match="were not written"):
        _train_slowly(model, steps=100)
    with pytest.raises(ObservationError):
        observer.remove()
    assert not observer.attached


def test_tensorboard_uses_the_trainer_step_when_there_is_one(tmp_path: pathlib.Path) -> None:
    """Under step-driven sampling, histograms and rows carry the trainer step, not the sample id."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = Net()
    with inject_observer(model, output_dir=tmp_path / "run") as observer:
        for step in range(0, 50, 10):
            observer.begin_step(step, sample=step % 20 == 0)
            _train(model, 1)
            observer.end_step()
    events = EventAccumulator(
        str(tmp_path / "run" / "tensorboard"), size_guidance={"histograms": 0}
    )
    events.Reload()
    assert [e.step for e in events.Histograms("telemetry/first/output/histogram")] == [0, 20, 40]
    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    assert sorted(history["step"].unique()) == [0, 20, 40]


def test_the_training_thread_waits_only_when_the_queue_is_full(tmp_path: pathlib.Path) -> None:
    """With the writer stalled, put() returns at once until queue_size samples wait, then blocks."""
    import threading

    from torchinstruments_core import SampleRecord
    from torchinstruments_core.run_directory._layout import layout_for
    from torchinstruments_core.run_directory._writer import ChunkWriter

    release = threading.Event()
    writer = ChunkWriter(
        layout_for(tmp_path / "run", rank=0, per_rank=False),
        chunk_rows=1,
        flush_seconds=30.0,
        queue_size=2,
        on_sample=[lambda _sample: release.wait(timeout=30)],  # type: ignore[list-item]
    )
    writer.start()
    sample = SampleRecord("r", 0, 0, None, 0.0, True, 1.0, (), ())
    started = time.monotonic()
    for _ in range(3):  # one taken by the stalled writer, two waiting in the queue
        writer.put(sample)
    assert time.monotonic() - started < 1.0
    blocked = threading.Thread(target=writer.put, args=(sample,))
    blocked.start()
    blocked.join(timeout=0.5)
    assert blocked.is_alive(), "put() should wait while the queue is full"
    release.set()
    blocked.join(timeout=10)
    assert not blocked.is_alive()
    assert writer.finish().samples_written == 4


def test_the_writer_lets_a_samples_rows_go_once_its_table_is_built(tmp_path: pathlib.Path) -> None:
    """Only the table of a sample waits for its chunk: its rows are freed, its counts still right.

    Row objects kept until a chunk is written (30 seconds of samples) made Python's garbage
    collector run full collections of every object of the process; the aggregates of
    result.json then come from the table, and every count from the number of rows.
    """
    from torchinstruments_core.run_directory._layout import layout_for
    from torchinstruments_core.run_directory._writer import ChunkWriter

    seen: list[int] = []
    written: list[tuple[SampleRecord, pl.DataFrame | None]] = []
    writer = ChunkWriter(
        layout_for(tmp_path / "run", rank=0, per_rank=False),
        chunk_rows=1_000_000,
        flush_seconds=30.0,
        queue_size=8,
        on_sample=[lambda sample: seen.append(len(sample.rows))],
        on_written=[lambda record, history: written.append((record, history))],
    )
    writer.start()
    rows = tuple(
        StatRow("layer", 0, Signal.OUTPUT, "output", metric, float(n), None)
        for n, metric in enumerate(DEFAULT_METRICS)
    )
    for sample_id in range(3):
        writer.put(SampleRecord("r", 0, sample_id, sample_id, 0.0, False, 1.0, rows, ()))
    report = writer.finish()
    assert seen == [len(rows)] * 3  # the writer's consumers saw every row
    assert report.samples_written == 3
    assert report.rows_written == 3 * len(rows)
    assert [record.sample_id for record, _ in written] == [0, 1, 2]
    for record, history in written:
        assert record.rows == ()
        assert history is not None
        assert history["value"].to_list() == [row.value for row in rows]
    history = pl.read_parquet(tmp_path / "run" / "history.parts" / "history-*.parquet")
    samples = pl.read_parquet(tmp_path / "run" / "history.parts" / "samples-*.parquet")
    assert history.height == 3 * len(rows)
    assert samples["rows"].to_list() == [len(rows)] * 3
