"""The ``Accelerator`` a tracker belongs to, and its trackers as the core's routing targets."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

from accelerate import Accelerator
from accelerate.tracking import TensorBoardTracker, WandBTracker
from accelerate.utils import LoggerType

from torchinstruments_core.routing import ScalarTarget, SummaryWriterTarget, WandbRunTarget

if TYPE_CHECKING:
    from collections.abc import Iterable

    from torchinstruments_core.routing import Target


def tracker_targets(trackers: Iterable[Any]) -> list[Target]:
    """TensorBoard and W&B trackers take histograms and scalars; any other tracker scalars."""
    targets: list[Target] = []
    for tracker in trackers:
        if isinstance(tracker, TensorBoardTracker):
            targets.append(SummaryWriterTarget(tracker.writer))
        elif isinstance(tracker, WandBTracker):
            targets.append(WandbRunTarget(tracker.run, step_key=None))
        else:
            targets.append(ScalarTarget(tracker.log))
    return targets


def has_tensorboard(accelerator: Accelerator) -> bool:
    """Whether ``accelerator`` logs to TensorBoard: in its ``log_with`` or its started trackers.

    ``log_with`` holds ``LoggerType.TENSORBOARD`` (``"tensorboard"``, or ``"all"`` expanded to
    it where tensorboard is installed) or a ``TensorBoardTracker`` itself; ``init_trackers``,
    which may come after ``watch``, makes the trackers.
    """
    held = [*getattr(accelerator, "log_with", ()), *getattr(accelerator, "trackers", ())]
    return any(
        isinstance(tracker, TensorBoardTracker)
        or getattr(tracker, "value", tracker) == LoggerType.TENSORBOARD.value
        for tracker in held
    )


def accelerator_holding(tracker: object) -> tuple[Accelerator | None, int]:
    """The one live ``Accelerator`` whose ``log_with`` or ``trackers`` hold ``tracker``.

    Accelerate keeps no registry of its accelerators (its ``AcceleratorState`` is shared by all
    of them and knows none), so the garbage collector's list of objects is searched, once.

    Returns:
        That accelerator (``None`` unless exactly one holds the tracker) and how many do.
    """
    holders = _holders(tracker)
    if len(holders) > 1:
        holders.clear()
        gc.collect()  # an accelerator left in a reference cycle lives on until a collection
        holders = _holders(tracker)
    return (holders[0] if len(holders) == 1 else None), len(holders)


def _holders(tracker: object) -> list[Accelerator]:
    # type(), not isinstance(): isinstance would read __class__, which a proxy may compute
    return [
        candidate
        for candidate in gc.get_objects()
        if issubclass(type(candidate), Accelerator) and holds(candidate, tracker)
    ]


def lacks(accelerator: object, tracker: object) -> bool:
    """Whether ``accelerator`` is an ``Accelerator`` whose ``log_with`` lacks ``tracker``.

    Anything else (a stand-in with a ``scaler`` and ``trackers``) is taken at its word.
    """
    return issubclass(type(accelerator), Accelerator) and not holds(accelerator, tracker)


def holds(accelerator: Accelerator, tracker: object) -> bool:
    """Whether ``accelerator``'s ``log_with`` (or ``trackers``) holds ``tracker`` itself."""
    held = [*getattr(accelerator, "log_with", ()), *getattr(accelerator, "trackers", ())]
    return any(t is tracker for t in held)
