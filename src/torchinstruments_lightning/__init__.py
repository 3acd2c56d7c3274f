"""torchinstruments_lightning: the ``TelemetryMonitor`` callback for Lightning's ``Trainer``."""

from torchinstruments_core import __version__ as __version__
from torchinstruments_lightning.monitor import TelemetryMonitor

__all__ = ["TelemetryMonitor"]
