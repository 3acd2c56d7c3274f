"""torchinstruments_lightning: the ``TelemetryMonitor`` callback for Lightning's ``Trainer``."""

from torchinstruments_lightning.monitor import TelemetryMonitor

__all__ = ["TelemetryMonitor"]
