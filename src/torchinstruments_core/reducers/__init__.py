"""Reducers: the on-device statistics computed for each observed tensor.

Add a reducer by implementing the ``Reducer`` protocol in ``base.py``; pure tensor functions live in
``functional.py`` and the classes here are thin, configured wrappers around them.
"""

from __future__ import annotations

from torchinstruments_core.reducers.base import PreparedTensor, Reducer, working_dtype
from torchinstruments_core.reducers.histogram import HistogramReducer
from torchinstruments_core.reducers.moments import MomentsReducer
from torchinstruments_core.reducers.precision import (
    FORMATS,
    FloatFormat,
    PrecisionReducer,
    precision_reducers,
)
from torchinstruments_core.reducers.quantiles import QuantileReducer

__all__ = [
    "DEFAULT_METRICS",
    "FORMATS",
    "FloatFormat",
    "HistogramReducer",
    "MomentsReducer",
    "PrecisionReducer",
    "PreparedTensor",
    "QuantileReducer",
    "Reducer",
    "default_reducers",
    "precision_reducers",
    "working_dtype",
]


def default_reducers() -> tuple[Reducer, ...]:
    """The reducers run when none are configured.

    Together they give the twelve metrics of ``DEFAULT_METRICS``: ``mean``, ``std``, ``min``,
    ``max``, ``zero_fraction``, ``nonfinite_fraction``, ``rms``, ``max_abs``, ``l2_norm``
    (``MomentsReducer``), and ``p25``, ``p50``, ``p75`` (``QuantileReducer``).
    """
    return (MomentsReducer(), QuantileReducer())


DEFAULT_METRICS: tuple[str, ...] = tuple(m for r in default_reducers() for m in r.metrics)
"""The metric names of ``default_reducers()``, in the order of their rows."""
