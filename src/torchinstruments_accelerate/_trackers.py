"""Map an ``Accelerator``'s trackers to the core's routing targets."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accelerate.tracking import TensorBoardTracker, WandBTracker  # type: ignore[import-untyped]

from torchinstruments_core.routing import ScalarTarget, SummaryWriterTarget, WandbRunTarget

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from torchinstruments_core import HistogramRecord
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


class AcceleratorTrackers:
    """A routing target standing for every tracker of an ``Accelerator`` but the telemetry's own.

    The trackers are looked up at each write, so ``watch`` may come before ``init_trackers``;
    ``close`` stops the routing (``end_training`` may already have closed the other trackers).

    Args:
        accelerator: The ``Accelerator`` whose ``trackers`` receive the samples.
        skip_name: Trackers with this ``name`` (the telemetry trackers) are left out.
    """

    def __init__(self, accelerator: Any, *, skip_name: str) -> None:
        self.accelerator = accelerator
        self.skip_name = skip_name
        self.closed = False

    def log(
        self, scalars: Mapping[str, float], histograms: Mapping[str, HistogramRecord], step: int
    ) -> None:
        """Write to each tracker; the first failure is raised once every tracker had its turn."""
        if self.closed:
            return
        others = (t for t in self.accelerator.trackers if t.name != self.skip_name)
        failure: Exception | None = None
        for target in tracker_targets(others):
            try:
                target.log(scalars, histograms, step)
            except Exception as error:
                failure = failure or error
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Route nothing from now on."""
        self.closed = True
