"""The default profile of one CPU tensor in one call of the compiled kernels.

The engine runs its reducers one by one on a ``PreparedTensor``. On the CPU each of them makes a
few calls into the compiled kernels (``_native``) and a few dozen Python operations; on the
reduction worker every call releases the GIL and takes it back, and every stretch of Python holds
it while the training thread waits. When the reducers are the built-in ones (``MomentsReducer``,
``QuantileReducer``, ``HistogramReducer``), ``FusedReductions`` gives the same values from one
kernel call per tensor (``_native.profile``): the same summary, order statistics, grid and bins
as the reducers get from the kernels, then, in the same call, the arithmetic of
``host_moment_values``, ``QuantilePlan.interpolate`` and ``pack_histogram`` with the same float
operations in the working dtype (a mean so large against the spread that the moments need a
second pass leaves them to ``host_moment_values``). Where the reducers would leave the host
shortcuts (a NaN or an infinity, squares that need scaling, a grid too fine for its bins), it
gives nothing and the reducers run as usual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from torchinstruments_core.reducers import _native
from torchinstruments_core.reducers._host import HostSummary
from torchinstruments_core.reducers.base import CHUNK_SIZE
from torchinstruments_core.reducers.functional import (
    DEFAULT_QUANTILES,
    host_moment_values,
    quantile_plan,
    shifted_squares,
    subsample_size,
)
from torchinstruments_core.reducers.histogram import HistogramReducer
from torchinstruments_core.reducers.moments import MomentsReducer
from torchinstruments_core.reducers.quantiles import QuantileReducer

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torchinstruments_core.reducers.base import PreparedTensor, Reducer


class Fused(NamedTuple):
    """One tensor's values as host floats: each reducer's, in their order, and the histogram's.

    The histogram is packed (``pack_histogram``). Each float is a value of the working dtype
    (a float32 read exactly), what reading a tensor of them back with ``tolist`` gives: the
    kernel's buffer is read once, without a tensor per reducer to make and to read back (about
    25 us a tensor in torch calls).
    """

    results: list[list[float]]
    histogram: list[float] | None
    float64: bool
    """Whether the working dtype is float64 (the histogram's edges are searched in it)."""


class FusedReductions:
    """What ``reduce`` computes for reducers that are all built in (see ``plan``).

    Args:
        reducers: ``MomentsReducer`` and ``QuantileReducer`` instances, at most one of each.
        histogram: The histogram reducer.
    """

    def __init__(self, reducers: Sequence[Reducer], histogram: HistogramReducer) -> None:
        self._reducers = tuple(reducers)
        quantiles = [r for r in self._reducers if isinstance(r, QuantileReducer)]
        self._quantiles = quantiles[0] if quantiles else None
        self._moments = any(isinstance(r, MomentsReducer) for r in self._reducers)
        self._bins = histogram.bins

    @classmethod
    def plan(
        cls, reducers: Sequence[Reducer], histogram: HistogramReducer
    ) -> FusedReductions | None:
        """The fused reductions of these reducers, or ``None`` where they are not all built in.

        Built in means of exactly these classes (a subclass may compute something else), at most
        one of each, and the kernels installed.
        """
        kinds = [type(reducer) for reducer in reducers]
        if _native.KERNELS is None or type(histogram) is not HistogramReducer:
            return None
        if any(kind not in (MomentsReducer, QuantileReducer) for kind in kinds):
            return None
        if len(set(kinds)) != len(kinds):
            return None
        return cls(reducers, histogram)

    def reduce(self, prepared: PreparedTensor, with_histogram: bool) -> Fused | None:
        """Every reducer's values (and the histogram's) for ``prepared``, or ``None``.

        ``None`` where the kernels cannot read the tensor or the reducers would not take the
        host shortcuts: the reducers then run on it as usual. The quartiles' subsample is drawn
        through ``prepared.random_index``, as ``QuantileReducer`` draws it, so the reducers
        running after a ``None`` find the same positions.
        """
        values = prepared.values
        if not _native.usable(values):
            return None
        numel, dtype = prepared.numel, values.dtype
        quantiles, size, index, plan = self._quantiles, 0, None, None
        if quantiles is not None:
            size = numel if quantiles.exact else subsample_size(numel, quantiles.sample_size)
            index = None if size == numel else prepared.random_index(size)
            plan = quantile_plan(size, DEFAULT_QUANTILES)
        bins = self._bins if with_histogram else 0
        profiled = _native.profile(values, index, size, plan, bins)
        if profiled.status not in (_native.STATUS_OK, _native.STATUS_MOMENTS_ON_HOST):
            return None
        out = profiled.values
        floats = out.tolist()
        first = _native.MOMENTS
        last = first + (0 if plan is None else len(plan.levels))
        moments = floats[:first]
        if profiled.status == _native.STATUS_MOMENTS_ON_HOST and self._moments:
            found = host_moment_values(
                HostSummary(
                    profiled.total, profiled.squares, profiled.lo, profiled.hi, profiled.zeros
                ),
                numel,
                dtype,
                lambda shift: shifted_squares(prepared, shift, CHUNK_SIZE),
            )
            if found is None:  # squares that need scaling: the reducers scale them
                return None
            moments = np.array(found, dtype=out.dtype).tolist()  # rounded as ``host_values``
        results = [
            floats[first:last] if isinstance(reducer, QuantileReducer) else moments
            for reducer in self._reducers
        ]
        histogram = floats[last:] if bins else None
        return Fused(results, histogram, out.dtype == np.float64)
