"""A failing sink or logger target never starves the others, and its error keeps its type."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers import mlp
from torchinstruments_core import (
    AlwaysSampler,
    ObservationError,
    ObservationWarning,
    inject_observer,
)
from torchinstruments_core.routing import LoggerRouter
from torchinstruments_core.sinks import MultiSink
from torchinstruments_core.testing import RecordingSink


class QuotaExceeded(Exception):
    """An exception whose constructor takes two arguments (rebuilding it from a message fails)."""

    def __init__(self, used: int, limit: int) -> None:
        super().__init__(f"{used} of {limit} bytes used")
        self.used, self.limit = used, limit


class QuotaSink(RecordingSink):
    """A sink whose every method raises ``QuotaExceeded``."""

    def open(self, run: Any) -> None:
        raise QuotaExceeded(10, 5)

    def write(self, sample: Any) -> None:
        raise QuotaExceeded(10, 5)

    def close(self) -> None:
        raise QuotaExceeded(10, 5)


class QuotaTarget:
    """A logger target that raises ``QuotaExceeded``."""

    def log(self, scalars: Any, histograms: Any, step: int) -> None:
        raise QuotaExceeded(1, 0)


class KeepingTarget:
    """A logger target that keeps the steps it was given."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def log(self, scalars: Any, histograms: Any, step: int) -> None:
        self.steps.append(step)


def _train(model: torch.nn.Module, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()


def test_every_sink_gets_every_sample_when_an_earlier_one_fails() -> None:
    """The sinks after a failing one receive every sample, opened and closed as usual."""
    model, after = mlp(), RecordingSink()
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=MultiSink([QuotaSink(), after]))
    with pytest.warns(ObservationWarning, match="QuotaExceeded: 10 of 5 bytes used"):
        _train(model, steps=3)
    with pytest.warns(ObservationWarning, match="could not close: QuotaExceeded"):
        observer.remove()
    assert [s.sample_id for s in after.samples] == [0, 1, 2]
    assert after.run is not None
    assert after.closed


def test_one_failure_is_raised_with_its_own_type_and_the_sink_named() -> None:
    """Under error_policy='raise' the cause is the sink's own exception, not a rebuilt one."""
    model, after = mlp(), RecordingSink()
    sink = MultiSink([QuotaSink(), after])
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink, error_policy="raise")
    with pytest.raises(ObservationError) as raised:
        model(torch.randn(2, 4))
    with pytest.raises(ObservationError):
        observer.remove()  # closing fails the same way; the hooks are gone all the same
    assert not observer.attached
    cause = raised.value.__cause__
    assert isinstance(cause, QuotaExceeded)
    assert (cause.used, cause.limit) == (10, 5)
    assert any("QuotaSink" in note for note in getattr(cause, "__notes__", []))


def test_several_failures_are_raised_together() -> None:
    """Two failing sinks: an ExceptionGroup holding both original exceptions."""
    sink = MultiSink([QuotaSink(), QuotaSink(), RecordingSink()])
    with pytest.raises(ExceptionGroup) as raised:
        sink.close()
    assert [type(e) for e in raised.value.exceptions] == [QuotaExceeded, QuotaExceeded]
    assert sink.sinks[2].closed  # type: ignore[attr-defined]


def test_every_logger_target_gets_the_sample_when_an_earlier_one_fails() -> None:
    """LoggerRouter writes to every target before raising the failing one's own error."""
    model, kept = mlp(), KeepingTarget()
    router = LoggerRouter([QuotaTarget(), kept])
    with (
        pytest.raises(ObservationError) as raised,
        inject_observer(model, sampler=AlwaysSampler(), sink=router, error_policy="raise"),
    ):
        model(torch.randn(2, 4)).sum().backward()
    assert isinstance(raised.value.__cause__, QuotaExceeded)
    assert kept.steps == [0]
