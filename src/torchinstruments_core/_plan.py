"""The step plan: which root forwards are samples.

Without an adapter the sampler decides, forward by forward. Once an adapter announces a step
(``Observer.begin_step``) the plan follows the adapter instead: every root forward of a sampled
step is sampled, none of an unsampled one, and none between ``end_step`` and the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchinstruments_core.samplers import Sampler


@dataclass(frozen=True, slots=True)
class _Step:
    step: int | None
    sample: bool


_IDLE = _Step(step=None, sample=False)  # between an end_step and the next begin_step


class StepPlan:
    """Owns the sampling decision: the sampler's, or the adapter's step once announced.

    Args:
        sampler: Consulted for each root forward until the first ``begin``.

    Attributes:
        sampling: Whether a sampled step is in progress (its next micro-batch needs the hooks);
            an attribute, not a property: every step reads it.
    """

    __slots__ = ("_current", "_sampler", "sampling")

    def __init__(self, sampler: Sampler) -> None:
        self._sampler = sampler
        self._current: _Step | None = None  # None: no adapter has announced a step
        self.sampling = False

    def begin(self, step: int, *, sample: bool) -> None:
        """Make ``step`` current: its root forwards are sampled exactly when ``sample``."""
        self._current = _Step(step=step, sample=sample)
        self.sampling = sample

    def end(self) -> int | None:
        """End the current step; return it (``None`` if there was none)."""
        ended, self._current = self._current, _IDLE
        self.sampling = False
        return None if ended is None else ended.step

    def samples(self, forward_index: int) -> bool:
        """Whether the root forward numbered ``forward_index`` is a sample."""
        current = self._current
        if current is None:
            return self._sampler.should_sample(forward_index)
        return current.sample

    @property
    def step(self) -> int | None:
        """The trainer step of the coming forwards, if an adapter announced one."""
        return None if self._current is None else self._current.step

    @property
    def policy(self) -> str:
        """The sampling policy in words, for the run's description."""
        if self._current is not None:
            return "step-driven by the trainer adapter"
        return repr(self._sampler)
