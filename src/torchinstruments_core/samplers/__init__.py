"""Samplers decide which root forwards become samples."""

from torchinstruments_core.samplers.base import Sampler
from torchinstruments_core.samplers.builtin import (
    AlwaysSampler,
    EveryNForwardsSampler,
    IntervalSampler,
)

__all__ = ["AlwaysSampler", "EveryNForwardsSampler", "IntervalSampler", "Sampler"]
