"""What an observer is made of besides the model, validated by ``inject_observer``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torchinstruments_core._signals import RecordKind, Signal, signals_of

if TYPE_CHECKING:
    from torchinstruments_core._config import ErrorPolicy, RankPolicy
    from torchinstruments_core._layers import Layer
    from torchinstruments_core._measure import Measurer
    from torchinstruments_core.samplers import Sampler
    from torchinstruments_core.sinks import Sink


@dataclass(frozen=True, slots=True)
class ObserverConfig:
    """Everything an observer needs besides the model, validated by ``inject_observer``."""

    layers: list[Layer]
    sampler: Sampler
    measurer: Measurer
    sink: Sink
    rank_policy: RankPolicy
    error_policy: ErrorPolicy
    capture_direct_forwards: bool
    run_id: str
    first_sample_id: int = 0
    step_signals: frozenset[Signal] = field(
        default_factory=lambda: frozenset(signals_of(RecordKind.STEP))
    )
