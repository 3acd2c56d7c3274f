"""LoggerRouter: which keys reach the targets, and targets looked up at each write."""

from __future__ import annotations

from typing import Any

import torch

from helpers import mlp
from torchinstruments_core import AlwaysSampler, inject_observer
from torchinstruments_core.routing import LoggerRouter


class Recorder:
    """A target that keeps what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], list[str], int]] = []

    def log(self, scalars: Any, histograms: Any, step: int) -> None:
        self.calls.append((dict(scalars), sorted(histograms), step))


def test_focus_scalars_histograms_and_summaries_reach_the_target() -> None:
    """Default routing: the focus layers' three scalars, their histograms, two summaries."""
    target = Recorder()
    model = mlp()
    router = LoggerRouter([target])
    with inject_observer(model, sampler=AlwaysSampler(), sink=router, max_focus_layers=1):
        model(torch.randn(2, 4)).sum().backward()
    ((scalars, histograms, step),) = target.calls
    assert step == 0
    assert histograms == ["telemetry/0/output/histogram", "telemetry/0/output_gradient/histogram"]
    assert sorted(scalars) == sorted(
        [
            f"telemetry/0/{s}/{m}"
            for s in ("output", "output_gradient")
            for m in ("rms", "max_abs", "nonfinite_fraction")
        ]
        + ["telemetry/nonfinite_tensors", "telemetry/collection_duration_ms"]
    )


def test_targets_given_as_a_function_are_looked_up_at_each_write() -> None:
    """A trainer whose loggers appear (or close) mid-run: each write goes to the current ones."""
    first, second = Recorder(), Recorder()
    current: list[Recorder] = []
    model = mlp()
    with inject_observer(model, sampler=AlwaysSampler(), sink=LoggerRouter(lambda: current)):
        model(torch.randn(2, 4)).sum().backward()  # no target yet
        current.append(first)
        model(torch.randn(2, 4)).sum().backward()
        current[:] = [second]
        model(torch.randn(2, 4)).sum().backward()
    assert [call[2] for call in first.calls] == [1]
    assert [call[2] for call in second.calls] == [2]


def test_a_sample_with_a_scope_routes_under_it() -> None:
    """open_sample(scope="phase_2") keys go under ``<prefix>/phase_2/``, after forward_only.

    The step's first sample keeps the prefix itself; a scoped forward-only one has both.
    """
    target = Recorder()
    model = mlp()
    router = LoggerRouter([target])
    with inject_observer(model, sink=router, max_focus_layers=1) as observer:
        observer.begin_step(0, sample=False)
        observer.open_sample(0)
        loss = model(torch.randn(2, 4)).sum()
        observer.finish_forward()
        loss.backward()
        observer.open_sample(0, scope="phase_2")
        loss = model(torch.randn(2, 4)).sum()
        observer.finish_forward()
        loss.backward()
        observer.open_sample(0, lazy=True, scope="phase_3")
        with torch.no_grad():
            model(torch.randn(2, 4))
        observer.finish_forward()
        observer.end_step()
    (first, _, _), (second, second_histograms, _), (third, _, step) = target.calls
    assert step == 0
    assert "telemetry/0/output/rms" in first
    assert not any("phase_" in key for key in first)
    assert "telemetry/phase_2/0/output_gradient/rms" in second
    assert "telemetry/phase_2/nonfinite_tensors" in second
    assert all(key.startswith("telemetry/phase_2/") for key in second)
    assert second_histograms == [
        "telemetry/phase_2/0/output/histogram",
        "telemetry/phase_2/0/output_gradient/histogram",
    ]
    assert "telemetry/forward_only/phase_3/0/output/rms" in third
    assert all(key.startswith("telemetry/forward_only/phase_3/") for key in third)


def test_a_forward_only_sample_has_keys_of_its_own() -> None:
    """A forward without backward (evaluation) routes under ``<prefix>/forward_only/``.

    A training sample's keys are untouched, so the two never share a curve in a logger.
    """
    target = Recorder()
    model = mlp()
    router = LoggerRouter([target])
    with inject_observer(model, sampler=AlwaysSampler(), sink=router, max_focus_layers=1):
        model(torch.randn(2, 4)).sum().backward()
        with torch.no_grad():
            model(torch.randn(2, 4))
    (trained, _, _), (evaluated, histograms, step) = target.calls
    assert step == 1
    assert "telemetry/0/output/rms" in trained
    assert not any(key.startswith("telemetry/forward_only/") for key in trained)
    assert histograms == ["telemetry/forward_only/0/output/histogram"]
    assert sorted(evaluated) == sorted(
        [f"telemetry/forward_only/0/output/{m}" for m in ("rms", "max_abs", "nonfinite_fraction")]
        + [
            "telemetry/forward_only/nonfinite_tensors",
            "telemetry/forward_only/collection_duration_ms",
        ]
    )
