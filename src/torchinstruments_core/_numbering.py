"""Number an adapter's steps the way the user's own logging numbers them.

An adapter counts optimizer steps itself (0, 1, 2 …) and samples on that count, but the user logs
the same steps under numbers of their own: 0- or 1-based, from an offset, before or after
``optimizer.step()``. The telemetry of a step belongs next to the user's values of that step, so
its samples take the user's number.

The rule: step ``s``'s *window* runs from its first training forward (one with gradients enabled)
to the first training forward of a later step. The first ``log(step=u)`` inside the window
numbers ``s`` as ``u``, whether it came before the optimizer step (between the forward and the
step) or after it (before the next forward). A step whose window closes without a log counts on
from the last log: ``s + (u - t)`` for the last logged step ``t`` (``u`` of a log before any
forward, which numbers step 0 unless its window has a log of its own; ``s`` with no log at all).

``StepNumbering`` follows the windows; ``HoldingSink`` holds a step's samples until its number
is known (its first log, its window's end, or the end of the run) and then passes them on with
``step`` set to the user's number and ``optimizer_step`` to the adapter's count.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import warnings
from typing import TYPE_CHECKING

from torchinstruments_core._config import ErrorPolicy
from torchinstruments_core._exceptions import (
    ObservationError,
    ObservationWarning,
    raise_collected,
)
from torchinstruments_core._locks import lock

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchinstruments_core._records import RunInfo, SampleRecord
    from torchinstruments_core.sinks import Sink

# Numbers are kept for this many recent steps: a sample arriving later than that (it never does
# in practice, a transfer lands within a step or two) counts on from the last log instead.
_KEPT_STEPS = 1024
# At most this many samples wait: beyond it (a model that never runs a training forward, so that
# no window opens) every waiting sample leaves, numbered as things stand.
MAX_HELD_SAMPLES = 1024


class StepNumbering:
    """The user's number of each of the adapter's steps, from the user's ``log(step=...)`` calls.

    Args:
        training_forwards: Returns how many training forwards the model ran so far
            (``Observer.training_forwards``); compared between events, it tells whether the
            current step has begun. Evaluation under ``torch.no_grad`` does not end a window.
    """

    def __init__(self, training_forwards: Callable[[], int]) -> None:
        self._forwards = training_forwards
        self._step = 0
        self._forwards_at_step = training_forwards()
        self._open = -1  # the step whose window is open; -1 before the first forward
        self._offset = 0  # the user's number minus ours, from the last log
        self._numbers: dict[int, int] = {}
        self._lock = lock()  # number() may run on an autograd thread (a sample's end)

    @property
    def step(self) -> int:
        """The adapter's current step: optimizer steps ended so far."""
        return self._step

    def logged(self, user_step: int) -> None:
        """The user logged with ``step=user_step``: it numbers the step whose window is open."""
        with self._lock:
            self._follow_forwards()
            if self._open < 0:
                self._offset = user_step  # before any forward: step 0's, until its window says
            elif self._open not in self._numbers:
                self._numbers[self._open] = user_step
                self._offset = user_step - self._open

    def stepped(self) -> None:
        """The current step ended (the optimizer stepped); its window stays open until a forward."""
        with self._lock:
            self._follow_forwards()
            self._forwards_at_step = self._forwards()
            self._step += 1
            while self._numbers and next(iter(self._numbers)) < self._step - _KEPT_STEPS:
                del self._numbers[next(iter(self._numbers))]

    def number(self, step: int, *, final: bool = False) -> int | None:
        """The user's number of ``step``; ``None`` while its window may still receive a log.

        With ``final`` (the run ends) a step whose window is still open is numbered as it stands.
        """
        with self._lock:
            self._follow_forwards()
            known = self._numbers.get(step)
            if known is not None:
                return known
            if step >= self._open and not final:
                return None
            number = step + self._offset
            if step >= self._step - _KEPT_STEPS:
                self._numbers[step] = number  # later samples of the step get the same number
            return number

    def _follow_forwards(self) -> None:
        if self._forwards() <= self._forwards_at_step or self._open == self._step:
            return
        # The current step has begun: the windows before it close, numbered as they stand, so
        # that a sample arriving late (a transfer still in flight) takes the same number.
        for closed in range(max(self._open, 0), self._step):
            self._numbers.setdefault(closed, closed + self._offset)
        self._open = self._step


class HoldingSink:
    """Holds each sample until ``numbering`` knows its step's number, then passes it to ``sink``.

    Samples leave in the order they came. ``release`` is for the adapter to call after each
    ``numbering`` event (a log, a step's end): it passes on what became known; ``close`` passes
    on the rest, numbered as things stand, before closing ``sink``. A sample without a step
    passes at once, unchanged.

    Args:
        sink: Where the numbered samples go (the run directory and the logger routing, so that
            both see the user's number).
        numbering: The adapter's numbering; ``SampleRecord.step`` is taken as its step.
        error_policy: What a failing ``sink`` does during ``release`` (outside the observer,
            which handles failures of ``write`` and ``close``): warn once, or raise
            ``ObservationError``.
    """

    def __init__(
        self,
        sink: Sink,
        numbering: StepNumbering,
        *,
        error_policy: ErrorPolicy = ErrorPolicy.WARN,
    ) -> None:
        self.sink = sink
        self.numbering = numbering
        self._error_policy = error_policy
        self._held: collections.deque[SampleRecord] = collections.deque()
        self._lock = threading.RLock()  # write() may come from an autograd thread
        self._warned = False

    def open(self, run: RunInfo) -> None:
        """Open ``sink``."""
        self.sink.open(run)

    def write(self, sample: SampleRecord) -> None:
        """Pass ``sample`` on, numbered, once its step's number is known; hold it until then."""
        with self._lock:
            self._held.append(sample)
            self._pass_known(final=len(self._held) > MAX_HELD_SAMPLES)

    def release(self) -> None:
        """Pass on the held samples whose number became known. Never raises under ``"warn"``."""
        try:
            with self._lock:
                self._pass_known(final=False)
        except Exception as error:
            self._failed(error)

    def close(self) -> None:
        """Pass on every held sample, then close ``sink``."""
        with self._lock:
            try:
                self._pass_known(final=True)
            finally:
                self.sink.close()

    def _pass_known(self, *, final: bool) -> None:
        """Pass on the held samples whose number is known (all of them when ``final``).

        A sample ``sink`` fails to take does not hold back the ones after it: each is passed on
        (a ``MultiSink`` gives each to every sink, so a logger that fails, such as a W&B run
        finished before the telemetry closed, costs the run directory nothing), and the
        failures are raised once all have gone.
        """
        errors: list[Exception] = []
        while self._held:
            sample = self._held[0]
            if sample.step is not None:
                number = self.numbering.number(sample.step, final=final)
                if number is None:
                    break  # later samples are of the same step or a later one
                sample = dataclasses.replace(sample, step=number, optimizer_step=sample.step)
            self._held.popleft()
            try:
                self.sink.write(sample)
            except Exception as error:
                errors.append(error)
        first = errors[0] if errors else None
        raise_collected(
            errors,
            f"the sink failed to take {len(errors)} samples ({type(first).__name__}: {first})",
        )

    def _failed(self, error: Exception) -> None:
        message = (
            f"torchinstruments: the sink {type(self.sink).__name__} could not write a sample: "
            f"{type(error).__name__}: {error}"
        )
        if self._error_policy is ErrorPolicy.RAISE:
            raise ObservationError(message) from error
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"{message}. Training continues; what the sink did not take is lost. Further "
                "failures of this kind are not reported again. Pass error_policy='raise' to stop "
                "instead.",
                ObservationWarning,
                stacklevel=3,
            )

    def __repr__(self) -> str:
        return f"HoldingSink({self.sink!r})"
