"""``NonFiniteWatch``: the live half of "where did training go wrong?", shared by the adapters.

It sits among the sinks, so it sees every delivered record on the training thread, and it reads
the trainer's loss once per step. Two things follow:

- A sample with NaN or Inf values (``find_onset``) is named in the log (WARNING) and in the
  trainer's loggers (``log_event``) once per episode: until a later sample is finite again, the
  next non-finite samples are not reported again. Under ``on_nonfinite="stop"`` or ``"raise"``
  the adapter learns of it from ``act()`` at its next hook.
- A non-finite loss, or a non-finite sample, starts a dense window in the schedule
  (``TriggeredSchedule``): the following steps are all sampled, so the onset is recorded at full
  resolution. Again once per episode of non-finite losses (or samples).

The loss check never waits for the device: ``check_loss`` starts ``isfinite`` on the loss's
device and an asynchronous copy of the one boolean (into pinned memory on CUDA, with an event),
and the next ``begin_step`` reads it only if it has landed. A plain CPU loss is read at once.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch

from torchinstruments_core._config import NonFinitePolicy
from torchinstruments_core._exceptions import NonFiniteError
from torchinstruments_core._nonfinite import find_onset
from torchinstruments_core._signals import RecordKind
from torchinstruments_core.routing.base import log_event

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

    from torchinstruments_core._nonfinite import NonFiniteOnset
    from torchinstruments_core._options import TriggeredSchedule
    from torchinstruments_core._records import RunInfo, SampleRecord
    from torchinstruments_core.routing import Target

log = logging.getLogger("torchinstruments")


class NonFiniteWatch:
    """Reports non-finite samples and turns on dense sampling; a ``Sink`` among the sinks.

    Args:
        schedule: Which steps are sampled; the watch starts its dense windows.
        policy: What a non-finite sample does (``NonFinitePolicy``).
        targets: The trainer's loggers as routing targets, or a function returning them.
        prefix: The event goes under ``<prefix>/nonfinite`` (text) and
            ``<prefix>/nonfinite_onset`` (scalar).
        owner: The adapter's name, first in every message.
    """

    def __init__(
        self,
        schedule: TriggeredSchedule,
        *,
        policy: NonFinitePolicy,
        targets: Sequence[Target] | Callable[[], Iterable[Target]] = (),
        prefix: str = "telemetry",
        owner: str = "torchinstruments",
    ) -> None:
        self.schedule = schedule
        self.policy = policy
        self._targets = targets
        self._key = f"{prefix.rstrip('/')}/nonfinite"
        self._owner = owner
        self._step = 0
        self._loss: _PendingFlag | None = None
        self._loss_bad = False
        self._samples_bad = False  # an episode is under way
        # the trainer step of the samples seen last, and whether one of them was non-finite
        self._sample_step: int | None = None
        self._step_bad = False
        self._unhandled: NonFiniteOnset | None = None
        self.onsets: list[NonFiniteOnset] = []

    # -- the adapter's side -------------------------------------------------------------------

    def begin_step(self, step: int) -> bool:
        """Note that the trainer's step ``step`` begins; whether it is sampled.

        Reads the previous step's loss check first (if it has landed), so a non-finite loss at
        step ``s`` has step ``s + 1`` sampled.
        """
        if self._loss is not None and self._loss.ready():
            finite, self._loss = self._loss.read(), None
            self._loss_seen(finite)
        self._step = step
        return self.schedule.is_sampled(step)

    def check_loss(self, loss: Any) -> None:
        """Start checking the loss of the step in progress (a float or a one-element tensor).

        A float or a plain CPU tensor is read here (its one value, no tensor op); on another
        device ``isfinite`` starts there and the next ``begin_step`` reads it if it has landed.
        Anything else (``None``, a dict without a loss) is ignored. Nothing waits for the device.
        """
        if isinstance(loss, float):
            self._loss_seen(math.isfinite(loss))
        elif type(loss) is torch.Tensor and loss.is_cpu and _is_scalar_tensor(loss):
            # in host memory already: its value is read at once, which waits for nothing (a flag
            # tensor made and read cost an MNIST-sized MLP's step about 0.1 ms, cold, in the loop)
            self._loss_seen(math.isfinite(loss.item()))
        elif self._loss is None and _is_scalar_tensor(loss):
            # (a copy still in flight keeps its place: nothing ever waits for the device)
            self._loss = _PendingFlag(torch.isfinite(loss.detach()).reshape(()))

    def check_logged(self, values: Mapping[str, Any]) -> None:
        """``check_loss`` on every value logged under a key containing ``loss`` (any case)."""
        for key, value in values.items():
            if "loss" in str(key).lower():
                self.check_loss(value)

    def act(self) -> bool:
        """Handle the onset reported since the last call: whether the trainer should stop.

        Raises:
            NonFiniteError: Under ``on_nonfinite="raise"``, naming the step and the layers.
        """
        onset, self._unhandled = self._unhandled, None
        if onset is None:
            return False
        if self.policy is NonFinitePolicy.RAISE:
            raise NonFiniteError(f"{self._owner}: {onset.message()}", onset)
        return self.policy is NonFinitePolicy.STOP

    # -- the sink's side ----------------------------------------------------------------------

    def open(self, run: RunInfo) -> None:
        """Nothing to prepare."""

    def write(self, sample: SampleRecord) -> None:
        """Look for non-finite values in a delivered record; report an episode's first.

        An episode ends with a trainer step whose samples are all finite, seen once a sample
        of another step comes: a step with several samples (a manual-optimization step's
        phases, a validation beside a training sample) is non-finite if one of them is. A
        sample without a step is a step of its own.
        """
        if sample.kind is not RecordKind.FORWARD:
            return  # a step record neither starts nor ends an episode
        onset = find_onset(sample)
        # the adapter's own count where the step is the user's number (Accelerate), which a
        # loop may repeat (step=epoch)
        step = sample.optimizer_step if sample.optimizer_step is not None else sample.step
        if step is None or step != self._sample_step:
            if not self._step_bad:  # the step before ended with every sample finite
                self._samples_bad = False
            self._sample_step, self._step_bad = step, False
        if onset is None:
            return
        self._step_bad = True
        if self._samples_bad:
            return
        self._samples_bad = True
        if step is not None:
            self._trigger(step, "a sampled step held non-finite values")
        if self.policy is not NonFinitePolicy.IGNORE:
            self._report(onset, sample.step if sample.step is not None else sample.sample_id)

    def close(self) -> None:
        """Nothing to release."""

    def _report(self, onset: NonFiniteOnset, step: int) -> None:
        self.onsets.append(onset)
        self._unhandled = onset
        message = f"{self._owner}: {onset.message()}"
        log.warning(message)
        targets = self._targets() if callable(self._targets) else self._targets
        log_event(targets, self._key, message, step)

    def _loss_seen(self, finite: bool) -> None:
        if not finite and not self._loss_bad:
            self._trigger(self._step, "the loss became non-finite")
        self._loss_bad = not finite

    def _trigger(self, step: int, reason: str) -> None:
        last = self.schedule.trigger(step)
        if last is not None:
            log.info(
                "%s: %s at step %d: sampling every step until step %d",
                *(self._owner, reason, step, last),
            )


def _is_scalar_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()


class _PendingFlag:
    """A device boolean on its way to the host: read only once it has landed."""

    __slots__ = ("_event", "_host")

    def __init__(self, flag: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if flag.device.type == "cuda":
            self._host = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._host.copy_(flag, non_blocking=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record(torch.cuda.current_stream(flag.device))
        else:
            # another device's (a CPU tensor subclass's): read a step later
            self._host = flag

    def ready(self) -> bool:
        return self._event is None or bool(self._event.query())  # type: ignore[no-untyped-call]

    def read(self) -> bool:
        return bool(self._host.item())
