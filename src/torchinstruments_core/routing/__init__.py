"""Routing into the loggers a trainer already has: TensorBoard, W&B, and any scalar logger."""

from torchinstruments_core.routing.base import Target, log_event, tensor_key
from torchinstruments_core.routing.router import DEFAULT_SCALAR_METRICS, LoggerRouter
from torchinstruments_core.routing.targets import ScalarTarget, SummaryWriterTarget, WandbRunTarget

__all__ = [
    "DEFAULT_SCALAR_METRICS",
    "LoggerRouter",
    "ScalarTarget",
    "SummaryWriterTarget",
    "Target",
    "WandbRunTarget",
    "log_event",
    "tensor_key",
]
