"""The supported import surface, locked: every package's ``__all__``, the errors and the version.

Adding or removing a public name is a deliberate change: update ``SURFACES`` with it (and the
CHANGELOG), as httpx does in its ``tests/test_exported_members.py``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import torchinstruments_core
from torchinstruments_core import _version

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

SURFACES: dict[str, list[str]] = {
    "torchinstruments_core": [
        "AlwaysSampler",
        "ConfigurationError",
        "EveryNForwardsSampler",
        "HistogramRecord",
        "HistogramReducer",
        "IntervalSampler",
        "LayerInfo",
        "MissingDependencyError",
        "MomentsReducer",
        "NonFiniteError",
        "ObservationError",
        "ObservationWarning",
        "Observer",
        "ObserverAlreadyAttachedError",
        "QuantileReducer",
        "RecordKind",
        "Reducer",
        "RunDirectoryExistsError",
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
        "precision_reducers",
        "remove_observer",
    ],
    "torchinstruments_core.adapter": [
        "ErrorPolicy",
        "HoldingSink",
        "NonFinitePolicy",
        "NonFiniteWatch",
        "OptimizerClock",
        "PartCalls",
        "RankPolicy",
        "RunFolder",
        "StepNumbering",
        "TelemetryOptions",
        "TriggeredSchedule",
        "check_optimizers",
        "loss_scale_reader",
        "new_run_id",
        "run_folder",
    ],
    "torchinstruments_core.reducers": [
        "DEFAULT_METRICS",
        "FORMATS",
        "FloatFormat",
        "HistogramReducer",
        "MomentsReducer",
        "PrecisionReducer",
        "PreparedTensor",
        "QuantileReducer",
        "Reducer",
        "default_reducers",
        "precision_reducers",
        "working_dtype",
    ],
    "torchinstruments_core.routing": [
        "DEFAULT_SCALAR_METRICS",
        "LoggerRouter",
        "ScalarTarget",
        "SummaryWriterTarget",
        "Target",
        "WandbRunTarget",
        "log_event",
        "tensor_key",
    ],
    "torchinstruments_core.run_directory": [
        "QUERIES",
        "QUERY_PRELUDE",
        "RunDirectorySink",
        "RunFolder",
        "RunLayout",
        "RunState",
        "RunStatus",
        "escape_text",
        "existing_run",
        "fresh_folder",
        "history_schema",
        "inspect_run",
        "markdown_cell",
        "markdown_code",
        "next_free_folder",
        "repair",
        "resumed_folder",
        "safe_name",
        "samples_schema",
        "scan_samples",
        "summarize_run",
    ],
    "torchinstruments_core.samplers": [
        "AlwaysSampler",
        "EveryNForwardsSampler",
        "IntervalSampler",
        "Sampler",
    ],
    "torchinstruments_core.selectors": [
        "Selector",
        "SelectorFn",
        "all_of",
        "any_of",
        "by_name",
        "by_type",
        "leaf_modules",
    ],
    "torchinstruments_core.sinks": ["MultiSink", "Sink"],
    "torchinstruments_core.testing": ["RecordingSink", "TensorMemory", "tensor_memory"],
    "torchinstruments_lightning": ["FabricTelemetry", "TelemetryMonitor"],
    "torchinstruments_accelerate": ["TelemetryTracker"],
    "torchinstruments_transformers": ["TelemetryCallback"],
}

PACKAGES = sorted(name for name in SURFACES if hasattr(importlib.import_module(name), "__path__"))


def _public_attributes(module: types.ModuleType) -> list[str]:
    """Names a reader of ``module`` takes as public: not its submodules, not ``annotations``.

    ``from __future__ import annotations`` binds ``annotations`` in the module's namespace.
    """
    return sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and name != "annotations"
    )


@pytest.mark.parametrize("module_name", sorted(SURFACES))
def test_all_is_the_locked_sorted_list(module_name: str) -> None:
    """``__all__`` holds exactly the locked names, sorted: adding or removing one fails here."""
    module = importlib.import_module(module_name)
    assert module.__all__ == sorted(module.__all__)
    assert module.__all__ == SURFACES[module_name]


@pytest.mark.parametrize("module_name", sorted(SURFACES))
def test_every_exported_name_imports(module_name: str) -> None:
    """Each name in ``__all__`` resolves, and a star import gives exactly those names."""
    module = importlib.import_module(module_name)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    namespace: dict[str, object] = {}
    exec(f"from {module_name} import *", namespace)
    assert sorted(set(namespace) - {"__builtins__"}) == module.__all__


@pytest.mark.parametrize("package_name", PACKAGES)
def test_a_package_exports_nothing_outside_all(package_name: str) -> None:
    """A package's ``__init__`` defines no public name that ``__all__`` leaves out."""
    package = importlib.import_module(package_name)
    assert _public_attributes(package) == package.__all__


def test_exception_tree() -> None:
    """Every error derives from TorchInstrumentsError and from the builtin a caller expects."""
    from torchinstruments_core import (
        ConfigurationError,
        MissingDependencyError,
        ObservationError,
        ObserverAlreadyAttachedError,
        RunDirectoryExistsError,
        TorchInstrumentsError,
    )

    for error in (
        ConfigurationError,
        MissingDependencyError,
        ObservationError,
        ObserverAlreadyAttachedError,
        RunDirectoryExistsError,
    ):
        assert issubclass(error, TorchInstrumentsError)
    assert issubclass(ConfigurationError, ValueError)
    assert issubclass(MissingDependencyError, ImportError)
    assert issubclass(RunDirectoryExistsError, FileExistsError)


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


def test_the_version_is_the_installed_distributions_everywhere() -> None:
    """Core and adapters report the installed metadata's version, the one in pyproject.toml."""
    import torchinstruments_accelerate
    import torchinstruments_lightning
    import torchinstruments_transformers

    installed = importlib.metadata.version("torchinstruments-suite")
    assert torchinstruments_core.__version__ == installed
    assert torchinstruments_lightning.__version__ == installed
    assert torchinstruments_accelerate.__version__ == installed
    assert torchinstruments_transformers.__version__ == installed
    assert tomllib.loads(PYPROJECT.read_text())["project"]["version"] == installed


def test_a_source_tree_without_metadata_reads_its_pyproject() -> None:
    """Without site-packages (no metadata), the version comes from the tree's pyproject.toml."""
    code = (
        "import importlib.util, sys;"
        f"spec = importlib.util.spec_from_file_location('v', {_version.__file__!r});"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module);"
        "print(module.__version__)"
    )
    # -S: no site-packages, so neither torch nor this distribution's metadata can be found.
    result = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == tomllib.loads(PYPROJECT.read_text())["project"]["version"]


def test_without_metadata_or_pyproject_the_version_says_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No metadata and no pyproject.toml of this distribution: ``0+unknown``, never an error."""

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_version, "version", not_installed)
    other = tmp_path / "pyproject.toml"
    other.write_text('[project]\nname = "someone-else"\nversion = "9.9"\n')
    broken = tmp_path / "broken.toml"
    broken.write_text("[project\n")
    assert _version.find_version(PYPROJECT) == _version.source_tree_version(PYPROJECT)
    for pyproject in (tmp_path / "missing.toml", other, broken):
        assert _version.find_version(pyproject) == _version.UNKNOWN == "0+unknown"


def test_index_md_records_the_version(tmp_path: Path) -> None:
    """The run's index.md names the suite's version as the package reports it."""
    from torchinstruments_core import AlwaysSampler, inject_observer

    model = nn.Linear(3, 2)
    with inject_observer(model, sampler=AlwaysSampler(), output_dir=tmp_path / "run"):
        model(torch.ones(1, 3))
    index = (tmp_path / "run" / "index.md").read_text()
    assert f"- versions: torchinstruments-suite {torchinstruments_core.__version__}," in index
