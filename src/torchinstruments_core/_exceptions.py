"""Exceptions raised by torchinstruments.

The tree::

    TorchInstrumentsError
    ├── ConfigurationError (also a ValueError)   a bad argument, raised at once
    ├── ObserverAlreadyAttachedError             a second observer on the same model
    ├── ObservationError                         observing failed, under error_policy="raise"
    ├── NonFiniteError                           a sample held NaN/Inf, under on_nonfinite="raise"
    ├── RunDirectoryExistsError (also a FileExistsError)  output_dir already holds a run
    └── MissingDependencyError (also an ImportError)  an optional package is not installed

``ObservationWarning`` is the warning issued instead of ``ObservationError`` under the default
``error_policy="warn"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from torchinstruments_core._nonfinite import NonFiniteOnset


class TorchInstrumentsError(Exception):
    """Base class of every error this package raises."""


class ConfigurationError(TorchInstrumentsError, ValueError):
    """An argument has a value that cannot work; raised before anything is attached."""

    @classmethod
    def invalid(
        cls, argument: str, value: object, expected: str | Iterable[str]
    ) -> ConfigurationError:
        """Build the error naming the argument, the value given and what is allowed."""
        allowed = expected if isinstance(expected, str) else ", ".join(repr(e) for e in expected)
        return cls(f"{argument}={value!r} is not valid; expected {allowed}")


class ObserverAlreadyAttachedError(TorchInstrumentsError):
    """The model already has an observer; remove it before injecting another."""


class ObservationError(TorchInstrumentsError):
    """Observing failed (a reducer, a sink) and ``error_policy="raise"`` asked to stop."""


class NonFiniteError(TorchInstrumentsError):
    """A sampled step held NaN or Inf values and ``on_nonfinite="raise"`` asked to stop.

    The message names the step and the first non-finite layer of the forward and the backward;
    ``onset`` holds them (a ``NonFiniteOnset``).
    """

    def __init__(self, message: str, onset: NonFiniteOnset | None = None) -> None:
        super().__init__(message)
        self.onset = onset


class MissingDependencyError(TorchInstrumentsError, ImportError):
    """An optional package is needed for this feature; the message gives the install command."""


class ObservationWarning(UserWarning):
    """Observing failed and training went on; the message says what was lost."""


class RunDirectoryExistsError(TorchInstrumentsError, FileExistsError):
    """The output directory already holds a run; a new run never overwrites or mixes into it."""


def raise_collected(errors: Iterable[Exception], message: str) -> None:
    """Raise nothing, the single error as it is, or an ``ExceptionGroup`` of several.

    For code that must give every receiver its turn before failing (several sinks, several
    logger targets): each error keeps its own type, traceback and cause.
    """
    collected = list(errors)
    if len(collected) == 1:
        raise collected[0]
    if collected:
        raise ExceptionGroup(message, collected)
