"""Reducers: the on-device statistics computed for each observed tensor.

Add a reducer by implementing the ``Reducer`` protocol in ``base.py``; pure tensor functions live in
``functional.py`` and the classes here are thin, configured wrappers around them.
"""

from __future__ import annotations

from torchinstruments_core.reducers.base import PreparedTensor, Reducer, working_dtype
from torchinstruments_core.reducers.histogram import HistogramReducer
from torchinstruments_core.reducers.moments import MomentsReducer
from torchinstruments_core.reducers.quantiles import QuantileReducer

__all__ = [
    "HistogramReducer",
    "MomentsReducer",
    "PreparedTensor",
    "QuantileReducer",
    "Reducer",
    "default_reducers",
    "working_dtype",
]


def default_reducers() -> tuple[Reducer, ...]:
    """The reducers run when none are configured.

    Together they give eleven metrics: ``mean``, ``std``, ``min``, ``max``, ``p25``, ``p50``,
    ``p75``, ``zero_fraction``, ``nonfinite_fraction``, ``rms`` and ``max_abs``.
    """
    return (MomentsReducer(), QuantileReducer())
