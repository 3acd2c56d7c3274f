"""Sinks receive finished samples."""

from torchinstruments_core.sinks.base import Sink

__all__ = ["Sink"]
