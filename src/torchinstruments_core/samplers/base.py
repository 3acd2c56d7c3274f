"""The sampler extension point: which root forwards become samples.

A sampler is asked once per root forward of the observed model, with the index of that forward
(0, 1, 2 … counting every root forward since injection, sampled or not). An adapter that knows the
trainer's step drives the observer directly instead (``Observer.begin_step``), and the sampler is
then no longer consulted.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Sampler(Protocol):
    """Decides whether a root forward is sampled."""

    def should_sample(self, forward_index: int) -> bool:
        """Return whether root forward number ``forward_index`` is sampled."""
        ...
