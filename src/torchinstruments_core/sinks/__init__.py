"""Sinks receive finished samples."""

from torchinstruments_core.sinks.base import Sink
from torchinstruments_core.sinks.multi import MultiSink

__all__ = ["MultiSink", "Sink"]
