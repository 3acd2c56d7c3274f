"""Map an ``Accelerator``'s trackers to the core's routing targets."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accelerate.tracking import TensorBoardTracker, WandBTracker  # type: ignore[import-untyped]

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
