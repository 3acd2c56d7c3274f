"""torchinstruments_accelerate: the ``TelemetryTracker`` for ``Accelerator(log_with=[...])``."""

from torchinstruments_accelerate.tracker import TelemetryTracker

__all__ = ["TelemetryTracker"]
