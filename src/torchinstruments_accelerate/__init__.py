"""torchinstruments_accelerate: the ``TelemetryTracker`` for ``Accelerator(log_with=[...])``."""

from torchinstruments_accelerate.tracker import TelemetryTracker
from torchinstruments_core import __version__ as __version__

__all__ = ["TelemetryTracker"]
