"""torchinstruments_core: passive, sampled telemetry of a PyTorch model's activations and gradients.

Attach with ``inject_observer(model, ...)``; remove with ``remove_observer(model)``. The package
imports only torch; optional writers import their backends when used.
"""

from torchinstruments_core._exceptions import (
    ConfigurationError,
    MissingDependencyError,
    NonFiniteError,
    ObservationError,
    ObservationWarning,
    ObserverAlreadyAttachedError,
    RunDirectoryExistsError,
    TorchInstrumentsError,
)
from torchinstruments_core._inject import inject_observer, remove_observer
from torchinstruments_core._observer import Observer
from torchinstruments_core._records import (
    HistogramRecord,
    LayerInfo,
    RecordKind,
    RunInfo,
    SampleRecord,
    Signal,
    StatRow,
    UnavailableReason,
)
from torchinstruments_core._step_records import StepTensor
from torchinstruments_core._version import __version__ as __version__
from torchinstruments_core.reducers import (
    HistogramReducer,
    MomentsReducer,
    QuantileReducer,
    Reducer,
    default_reducers,
    precision_reducers,
)
from torchinstruments_core.samplers import (
    AlwaysSampler,
    EveryNForwardsSampler,
    IntervalSampler,
    Sampler,
)
from torchinstruments_core.selectors import Selector, all_of, any_of, by_name, by_type, leaf_modules
from torchinstruments_core.sinks import Sink

__all__ = [
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
]
