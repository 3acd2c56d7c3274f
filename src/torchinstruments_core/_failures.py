"""The error policy: how a failure while observing reaches the user.

Under ``error_policy="warn"`` (the default) a failure warns once per cause (not once per step)
and training goes on; under ``"raise"`` it raises ``ObservationError`` from the original error.
Every part of the observer reports its failures here, with the consequence for the run.
"""

from __future__ import annotations

import warnings

from torchinstruments_core._config import ErrorPolicy
from torchinstruments_core._exceptions import ObservationError, ObservationWarning

REDUCER_CONSEQUENCE = "the values it could not compute are recorded as unavailable"
SINK_CONSEQUENCE = "what the sink did not take is lost"
SCALE_CONSEQUENCE = "this sample records its gradients as they are, still scaled"
OBSERVE_CONSEQUENCE = "the values of that output this sample could not take are missing"


class FailureReport:
    """Turns failures into one warning per cause, or into ``ObservationError``.

    Owns the error policy and the causes already warned about; nothing else.

    Args:
        policy: ``ErrorPolicy.WARN`` or ``ErrorPolicy.RAISE``.
    """

    __slots__ = ("_warned", "raises")

    def __init__(self, policy: ErrorPolicy) -> None:
        self.raises = policy is ErrorPolicy.RAISE
        self._warned: set[str] = set()

    def failed(self, what: str, error: BaseException, key: str, consequence: str) -> None:
        """Report that ``what`` failed with ``error``.

        Args:
            what: What could not be done, for the message.
            error: The exception it raised.
            key: The cause: a second failure with the same key warns no more.
            consequence: What the failure means for the recorded values.

        Raises:
            ObservationError: Under ``error_policy="raise"``, from ``error``.
        """
        message = f"torchinstruments: {what}: {type(error).__name__}: {error}"
        if self.raises:
            raise ObservationError(message) from error
        if key not in self._warned:  # one warning per cause, not one per step
            self._warned.add(key)
            warnings.warn(
                f"{message}. Training continues; {consequence}. Further failures of this kind "
                "are not reported again. Pass error_policy='raise' to stop instead.",
                ObservationWarning,
                stacklevel=2,
            )
