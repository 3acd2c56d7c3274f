"""torchinstruments_transformers: the ``TelemetryCallback`` for ``Trainer(callbacks=[...])``."""

from torchinstruments_core import __version__ as __version__
from torchinstruments_transformers.callback import TelemetryCallback

__all__ = ["TelemetryCallback"]
