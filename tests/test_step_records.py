"""Step records: an optimizer step's rows beside the samples, through every sink.

A step record is measured through ``Observer.record_step`` and read back with the real readers:
polars for history.parquet and samples.parquet, json for result.json, TensorBoard's
EventAccumulator, and a recording logger target behind ``LoggerRouter``.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import polars as pl
import pytest
import torch
from torch import nn

from helpers import mlp
from torchinstruments_core import (
    AlwaysSampler,
    ConfigurationError,
    RecordKind,
    Signal,
    StepTensor,
    inject_observer,
)
from torchinstruments_core.routing import LoggerRouter
from torchinstruments_core.run_directory import scan_samples, summarize_run
from torchinstruments_core.testing import RecordingSink


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 8)
        self.last = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.first(x)))


class Recorder:
    """A logger target that keeps what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], list[str], int]] = []

    def log(self, scalars: Any, histograms: Any, step: int) -> None:
        self.calls.append((dict(scalars), sorted(histograms), step))


def _parameters(module: nn.Module, layer: str, *, histogram: bool = False) -> list[StepTensor]:
    return [
        StepTensor(layer, Signal.PARAMETER, name, parameter.detach(), histogram=histogram)
        for name, parameter in module.named_parameters()
    ]


def _sampled_step(observer: Any, model: nn.Module, step: int) -> None:
    observer.begin_step(step, sample=True)
    model(torch.randn(3, 4)).sum().backward()
    observer.end_step()


def test_step_record_lands_in_history_and_samples(tmp_path: pathlib.Path) -> None:
    """A step record's rows: own id, kind "step", the step, layer = owner, path = parameter."""
    model = Net()
    with inject_observer(model, output_dir=tmp_path / "run") as observer:
        _sampled_step(observer, model, 5)
        record_id = observer.record_step(5, _parameters(model.first, "first"))
        _sampled_step(observer, model, 6)
        assert observer.next_sample_id == 3
    assert record_id == 1
    samples = pl.read_parquet(tmp_path / "run" / "samples.parquet").sort("sample_id")
    assert samples.select("sample_id", "kind", "step", "forward_only").rows() == [
        (0, "forward", 5, False),
        (1, "step", 5, False),
        (2, "forward", 6, False),
    ]
    assert samples.select("run_id", "rank", "sample_id").is_unique().all()
    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    step_rows = history.filter(pl.col("sample_id") == 1)
    assert set(step_rows["signal"]) == {"parameter"}
    assert set(step_rows["layer"]) == {"first"}
    assert set(step_rows["call_index"]) == {0}
    assert set(step_rows["step"]) == {5}
    assert sorted(set(step_rows["tensor_path"])) == ["bias", "weight"]
    weight_max = step_rows.filter((pl.col("tensor_path") == "weight") & (pl.col("metric") == "max"))
    assert weight_max["value"].item() == pytest.approx(model.first.weight.max().item())
    assert set(history.filter(pl.col("sample_id") != 1)["signal"]) == {"output", "output_gradient"}


def test_result_json_counts_step_records_apart_from_samples(tmp_path: pathlib.Path) -> None:
    """result.json: samples count only forwards; step records have their own count and rows."""
    model = Net()
    with inject_observer(model, output_dir=tmp_path / "run") as observer:
        _sampled_step(observer, model, 0)
        observer.record_step(0, _parameters(model.last, "last"))
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["samples"]["count"] == 1
    assert result["step_records"]["count"] == 1
    kinds = {entry["name"]: entry["kind"] for entry in result["signals"]}
    assert kinds["output"] == kinds["output_gradient"] == "forward"
    assert kinds["parameter"] == "step"
    last = next(layer for layer in result["layers"] if layer["name"] == "last")
    parameters = [m for m in last["measurements"] if m["signal"] == "parameter"]
    assert [(m["call_index"], m["tensor_path"]) for m in parameters] == [(0, "weight"), (0, "bias")]
    assert parameters[0]["metrics"]["max"]["count"] == 1


def _gradients(module: torch.nn.Module, layer: str) -> list[StepTensor]:
    return [
        StepTensor(layer, Signal.PARAMETER_GRADIENT, name, torch.randn_like(p), histogram=True)
        for name, p in module.named_parameters()
    ]


def test_step_record_reaches_logger_targets_under_parameter_keys() -> None:
    """LoggerRouter: ``<layer>/parameter/<name>/<metric>`` and ``step/`` summaries, at its step.

    ``parameter`` is not routed unless asked for (it goes to the run directory).
    """
    target = Recorder()
    model = mlp()
    router = LoggerRouter([target], signals=["output", "output_gradient", "parameter"])
    with inject_observer(model, sink=router, max_focus_layers=1) as observer:
        _sampled_step(observer, model, 3)
        observer.record_step(3, _parameters(model[0], "0", histogram=True))
    (forward, forward_histograms, forward_step), (scalars, histograms, step) = target.calls
    assert (forward_step, step) == (3, 3)
    assert sorted(scalars) == sorted(
        [
            f"telemetry/0/parameter/{name}/{metric}"
            for name in ("weight", "bias")
            for metric in ("rms", "max_abs", "nonfinite_fraction")
        ]
        + ["telemetry/step/nonfinite_tensors", "telemetry/step/collection_duration_ms"]
    )
    assert scalars["telemetry/0/parameter/weight/max_abs"] == pytest.approx(
        model[0].weight.abs().max().item()  # type: ignore[operator]
    )
    assert histograms == [
        "telemetry/0/parameter/bias/histogram",
        "telemetry/0/parameter/weight/histogram",
    ]
    # the sample of the same step keeps its own summaries: neither overwrites the other's
    assert "telemetry/nonfinite_tensors" in forward
    assert "telemetry/nonfinite_tensors" not in scalars
    assert all("/parameter/" not in key for key in [*forward, *forward_histograms])


def test_step_record_histograms_reach_the_run_tensorboard(tmp_path: pathlib.Path) -> None:
    """The run directory's TensorBoard file holds a routed step signal's histogram and summaries."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = Net()
    with inject_observer(model, output_dir=tmp_path / "run") as observer:
        _sampled_step(observer, model, 4)
        observer.record_step(4, _gradients(model.first, "first"))
    events = EventAccumulator(
        str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0}
    )
    events.Reload()
    histogram = events.Histograms("telemetry/first/parameter_gradient/weight/histogram")
    assert [event.step for event in histogram] == [4]
    assert histogram[0].histogram_value.num == model.first.weight.numel()
    assert [e.step for e in events.Scalars("telemetry/step/collection_duration_ms")] == [4]
    assert "telemetry/first/parameter_gradient/weight/rms" in events.Tags()["scalars"]


def test_step_record_takes_the_next_id_of_the_samples_sequence() -> None:
    """Samples and step records share one id sequence, from ``first_sample_id`` on."""
    sink = RecordingSink()
    model = Net()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, first_sample_id=10) as obs:
        model(torch.randn(2, 4)).sum().backward()
        obs.record_step(None, _parameters(model.first, "first"))
        model(torch.randn(2, 4)).sum().backward()
    assert [(s.sample_id, s.kind) for s in sink.samples] == [
        (10, RecordKind.FORWARD),
        (11, RecordKind.STEP),
        (12, RecordKind.FORWARD),
    ]
    assert sink.value("first", "parameter", "std", tensor_path="bias") == pytest.approx(
        model.first.bias.std(unbiased=False).item()
    )


def test_step_record_after_removal_records_nothing() -> None:
    """A removed observer takes no step record and allocates no id."""
    sink = RecordingSink()
    model = Net()
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    observer.remove()
    assert observer.record_step(0, _parameters(model.first, "first")) is None
    assert sink.samples == []
    assert observer.next_sample_id == 0


def test_step_tensor_refuses_a_forward_signal() -> None:
    """A forward signal in a step record fails at once, naming the argument and the choices."""
    with pytest.raises(ConfigurationError, match=r"signal='output'.*'parameter'"):
        StepTensor("first", Signal.OUTPUT, "weight", torch.zeros(2))


def test_summary_counts_samples_and_names_a_step_record(tmp_path: pathlib.Path) -> None:
    """The summary averages samples only, and names a step record where NaN first appeared."""
    model = Net()
    broken = torch.tensor([1.0, float("nan")])
    with inject_observer(model, output_dir=tmp_path / "run") as observer:
        observer.record_step(2, [StepTensor("first", Signal.PARAMETER, "weight", broken)])
        _sampled_step(observer, model, 2)
    lines = summarize_run(tmp_path / "run").splitlines()
    assert "means over the run's 1 samples" in lines[0]
    assert lines[-1] == (
        "first non-finite values: step record 0 (step 2), layer 'first', parameter"
    )


def test_a_run_without_the_kind_column_reads_as_forward_samples(tmp_path: pathlib.Path) -> None:
    """Old runs: samples.parquet without ``kind`` reads as forward; the summary says sample."""
    model = Net()
    with inject_observer(model, output_dir=tmp_path / "old") as observer:
        observer.begin_step(0, sample=True)
        model(torch.tensor([[float("inf"), 0.0, 0.0, 0.0]])).sum().backward()
        observer.end_step()
        observer.record_step(0, _parameters(model.first, "first"))
    with inject_observer(model, output_dir=tmp_path / "new") as observer:
        observer.record_step(1, _parameters(model.first, "first"))
    old = tmp_path / "old" / "samples.parquet"
    pl.read_parquet(old).filter(pl.col("kind") == "forward").drop("kind").write_parquet(old)
    assert scan_samples(tmp_path / "old").collect()["kind"].to_list() == ["forward"]
    both = scan_samples([old, tmp_path / "new"]).collect()
    assert both.select("kind", "step").rows() == [("forward", 0), ("step", 1)]
    assert "first non-finite values: sample 0 (step 0)" in summarize_run(tmp_path / "old")
