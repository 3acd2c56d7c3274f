"""torchinstruments_lightning: ``TelemetryMonitor`` for the ``Trainer``, ``FabricTelemetry``."""

from torchinstruments_core import __version__ as __version__
from torchinstruments_lightning.fabric import FabricTelemetry
from torchinstruments_lightning.monitor import TelemetryMonitor

__all__ = ["FabricTelemetry", "TelemetryMonitor"]
