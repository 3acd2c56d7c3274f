"""The old names of renamed arguments and properties still work, warn, and name the new one."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from helpers import mlp
from lightning_helpers import Regressor, loader, trainer
from torchinstruments_accelerate import TelemetryTracker
from torchinstruments_core import AlwaysSampler, ConfigurationError, by_name, inject_observer
from torchinstruments_core.adapter import TelemetryOptions
from torchinstruments_core.testing import RecordingSink
from torchinstruments_lightning import TelemetryMonitor

ADAPTERS = [TelemetryOptions, TelemetryMonitor, TelemetryTracker]


def _focus(**arguments: Any) -> tuple[str, ...]:
    with inject_observer(mlp(), sink=RecordingSink(), **arguments) as observer:
        return observer.focus_layer_names


def test_histogram_selector_is_focus_selector_with_a_warning() -> None:
    """inject_observer(histogram_selector=...) picks the same layers, warning at the caller."""
    with pytest.warns(DeprecationWarning, match="use `focus_selector`") as warned:
        old = _focus(histogram_selector=by_name("2"))
    assert warned[0].filename == __file__
    assert old == _focus(focus_selector=by_name("2")) == ("2",)


def test_max_histogram_modules_is_max_focus_layers_with_a_warning() -> None:
    """inject_observer(max_histogram_modules=...) caps the same layers, warning at the caller."""
    with pytest.warns(DeprecationWarning, match="use `max_focus_layers`") as warned:
        old = _focus(max_histogram_modules=1)
    assert warned[0].filename == __file__
    assert old == _focus(max_focus_layers=1)
    assert len(old) == 1


@pytest.mark.parametrize(
    "arguments",
    [
        {"histogram_selector": by_name("0"), "focus_selector": by_name("2")},
        {"max_histogram_modules": 1, "max_focus_layers": 2},
    ],
)
def test_an_argument_under_both_names_raises(arguments: dict[str, Any]) -> None:
    """Old and new name together: ConfigurationError naming both, in every constructor."""
    old, new = arguments
    message = f"`{old}` is the deprecated name of `{new}`; pass only `{new}`"
    with pytest.raises(ConfigurationError, match=message):
        inject_observer(mlp(), sink=RecordingSink(), **arguments)
    for adapter in ADAPTERS:
        with pytest.raises(ConfigurationError, match=message):
            adapter(**arguments)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_adapters_take_the_old_focus_names_with_a_warning(adapter: Any) -> None:
    """Each adapter moves the old names' values to the new ones and warns at the caller."""
    selector = by_name("net.*")
    with pytest.warns(DeprecationWarning, match="is deprecated; use") as warned:
        options = adapter(histogram_selector=selector, max_histogram_modules=3)
    assert [str(w.message).split(": ", 1)[1] for w in warned] == [
        "the argument `histogram_selector` is deprecated; use `focus_selector`",
        "the argument `max_histogram_modules` is deprecated; use `max_focus_layers`",
    ]
    assert {w.filename for w in warned} == {__file__}
    assert (options.focus_selector, options.max_focus_layers) == (selector, 3)
    assert (options.histogram_selector, options.max_histogram_modules) == (None, None)


def test_log_to_trackers_is_log_to_loggers_with_a_warning() -> None:
    """TelemetryTracker(log_to_trackers=False) turns routing off, warns; both names raise."""
    with pytest.warns(DeprecationWarning, match="use `log_to_loggers`") as warned:
        tracker = TelemetryTracker(log_to_trackers=False)
    assert warned[0].filename == __file__
    assert tracker.log_to_loggers is False
    assert tracker.log_to_trackers is None
    with pytest.raises(ConfigurationError, match="deprecated name of `log_to_loggers`"):
        TelemetryTracker(log_to_trackers=True, log_to_loggers=False)


def test_histogram_layer_names_is_focus_layer_names_with_a_warning() -> None:
    """Observer.histogram_layer_names returns focus_layer_names and warns at the caller."""
    with inject_observer(mlp(), sink=RecordingSink(), max_focus_layers=2) as observer:
        with pytest.warns(DeprecationWarning, match="use Observer.focus_layer_names") as warned:
            names = observer.histogram_layer_names
        assert names == observer.focus_layer_names
        assert len(names) == 2
    assert warned[0].filename == __file__


def test_samples_taken_is_next_sample_id_with_a_warning() -> None:
    """Observer.samples_taken returns next_sample_id (counting first_sample_id) and warns."""
    model = mlp()
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, first_sample_id=5) as observer:
        model(torch.randn(2, 4))
        with pytest.warns(DeprecationWarning, match="use Observer.next_sample_id") as warned:
            taken = observer.samples_taken
        assert taken == observer.next_sample_id == 6
    assert warned[0].filename == __file__


def test_a_checkpoint_that_says_samples_taken_is_continued(tmp_path: pathlib.Path) -> None:
    """Callback state saved before the rename (``samples_taken``) still sets the first sample id."""
    monitor = TelemetryMonitor(every_n_steps=2)
    monitor.load_state_dict({"samples_taken": 7, "run_id": "earlier", "run_name": "first"})
    trainer(tmp_path, max_steps=4, logger=False, callbacks=[monitor]).fit(Regressor(), loader())
    assert monitor.state_dict()["next_sample_id"] == 7 + 2 * 2  # steps 0, 2: sample and step record
    assert monitor.run_directory is not None
    assert monitor.run_directory.name == "first-resumed-1"
