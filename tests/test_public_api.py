"""The supported import surface, locked."""

from __future__ import annotations

import subprocess
import sys

import torchinstruments_core


def test_exported_names() -> None:
    """The package exports exactly these names, sorted."""
    assert torchinstruments_core.__all__ == sorted(torchinstruments_core.__all__)
    assert torchinstruments_core.__all__ == [
        "AlwaysSampler",
        "ConfigurationError",
        "EveryNForwardsSampler",
        "HistogramRecord",
        "HistogramReducer",
        "IntervalSampler",
        "LayerInfo",
        "MissingDependencyError",
        "MomentsReducer",
        "ObservationError",
        "ObservationWarning",
        "Observer",
        "ObserverAlreadyAttachedError",
        "QuantileReducer",
        "RecordKind",
        "Reducer",
        "RunInfo",
        "SampleRecord",
        "Sampler",
        "Selector",
        "Signal",
        "Sink",
        "StatRow",
        "StepTensor",
        "TorchInstrumentsError",
        "UnavailableReason",
        "all_of",
        "any_of",
        "by_name",
        "by_type",
        "default_reducers",
        "inject_observer",
        "leaf_modules",
        "remove_observer",
    ]
    for name in torchinstruments_core.__all__:
        assert getattr(torchinstruments_core, name) is not None


def test_exception_tree() -> None:
    """Every error derives from TorchInstrumentsError; configuration errors are ValueErrors."""
    from torchinstruments_core import (
        ConfigurationError,
        MissingDependencyError,
        ObservationError,
        ObserverAlreadyAttachedError,
        TorchInstrumentsError,
    )

    for error in (
        ConfigurationError,
        MissingDependencyError,
        ObservationError,
        ObserverAlreadyAttachedError,
    ):
        assert issubclass(error, TorchInstrumentsError)
    assert issubclass(ConfigurationError, ValueError)
    assert issubclass(MissingDependencyError, ImportError)


def test_import_pulls_in_no_optional_backend() -> None:
    """Importing the core imports no lightning, accelerate, wandb, polars or tensorboard."""
    code = (
        "import sys, torchinstruments_core;"
        "bad = [m for m in ('lightning', 'pytorch_lightning', 'accelerate', 'wandb', 'polars', "
        "'tensorboard', 'tensorboardX') if m in sys.modules];"
        "print(','.join(bad))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""


def test_lightning_surface() -> None:
    """The Lightning adapter exports exactly its callback (Accelerate: see test_accelerate.py)."""
    import torchinstruments_lightning

    assert torchinstruments_lightning.__all__ == ["TelemetryMonitor"]
