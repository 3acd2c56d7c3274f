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

import functools
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
    from collections.abc import Callable, Sequence

    from torchinstruments_core.reducers.base import PreparedTensor, Reducer
    from torchinstruments_core.reducers.functional import QuantilePlan


class Fused(NamedTuple):
    """One tensor's values as host floats: each reducer's, in their order, and the histogram's.

    The histogram is packed (``pack_histogram``). Each float is a value of the working dtype
    (a float32 read exactly), what reading a tensor of them back with ``tolist`` gives: the
    kernel's buffer is read once, without a tensor per reducer to make and to read back (about
    25 us a tensor in torch calls).
    """

    results: list[list[float]]
    histogram: list[float] | None
    edges: list[float] | None
    """The histogram's ``bins + 1`` edges, as ``_edges.histograms_edges`` gives them, found by
    the kernels; ``None`` without a histogram."""
    float64: bool
    """Whether the working dtype is float64 (the histogram's edges are searched in it)."""


class _Call(NamedTuple):
    """What ``FusedReductions.reduce`` asks the kernels for a tensor of one size."""

    numel: int
    """Entries of the tensor."""
    drawn: bool
    """Whether the subsample is drawn (fewer entries than the tensor's)."""
    last: int
    """Where the quantiles end in the kernels' values (the histogram follows)."""
    shape: _native.ProfileShape
    """The subsample's size, its quantile plan, the bins, and the buffers' lengths."""

    @property
    def size(self) -> int:
        """Entries in the quartiles' subsample (0: no quartiles)."""
        return self.shape.size

    @property
    def plan(self) -> QuantilePlan | None:
        """The ``quantile_plan`` of the subsample (``None``: no quartiles)."""
        return self.shape.plan

    @property
    def bins(self) -> int:
        """Histogram bins (0: no histogram)."""
        return self.shape.bins


@functools.lru_cache(maxsize=256)
def _call(numel: int, sample_size: int | None, bins: int) -> _Call:
    """The ``_Call`` for ``numel`` entries; ``sample_size`` ``None`` for no quartiles, 0 exact.

    Worked out once per size (a model measures a few sizes a step), not once per tensor.
    """
    if sample_size is None:
        return _Call(numel, False, _native.MOMENTS, _native.profile_shape(0, None, bins))
    size = numel if sample_size == 0 else subsample_size(numel, sample_size)
    plan = quantile_plan(size, DEFAULT_QUANTILES)
    shape = _native.profile_shape(size, plan, bins)
    return _Call(numel, size != numel, _native.MOMENTS + len(plan.levels), shape)


class FusedReductions:
    """What ``reduce`` computes for reducers that are all built in (see ``plan``).

    Args:
        reducers: ``MomentsReducer`` and ``QuantileReducer`` instances, at most one of each.
        histogram: The histogram reducer.
    """

    def __init__(self, reducers: Sequence[Reducer], histogram: HistogramReducer) -> None:
        self._reducers = tuple(reducers)
        quantiles = [r for r in self._reducers if isinstance(r, QuantileReducer)]
        # ``_call``'s key: None without quartiles, 0 for exact ones, else the subsample's size
        self._sample_size: int | None = None
        if quantiles:
            self._sample_size = 0 if quantiles[0].exact else quantiles[0].sample_size
        self._moments = any(isinstance(r, MomentsReducer) for r in self._reducers)
        self._quantile_places = tuple(isinstance(r, QuantileReducer) for r in self._reducers)
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

    def call(self, numel: int, with_histogram: bool) -> _Call:
        """What to ask the kernels for a tensor of ``numel`` entries (``reduce``, ``finish``)."""
        return _call(numel, self._sample_size, self._bins if with_histogram else 0)

    def reduce(self, prepared: PreparedTensor, with_histogram: bool) -> Fused | None:
        """Every reducer's values (and the histogram's) for ``prepared``, or ``None``.

        ``None`` where the kernels cannot read the tensor or the reducers would not take the
        host shortcuts: the reducers then run on it as usual. The quartiles' subsample is drawn
        through ``prepared.random_index``, as ``QuantileReducer`` draws it, so the reducers
        running after a ``None`` find the same positions. On the hooks' path of a small model
        this Python is about as long as the kernels' call: it does what varies per tensor only.
        """
        values = prepared.values
        if not _native.usable(values):
            return None
        call = self.call(prepared.numel, with_histogram)
        index = prepared.random_index(call.size) if call.drawn else None
        profiled = _native.profile(values, index, call.shape)
        return self.finish(profiled, call, lambda: prepared)

    def finish(
        self, profiled: _native.Profiled, call: _Call, prepared: Callable[[], PreparedTensor]
    ) -> Fused | None:
        """The values of ``profiled``, the kernels' output for ``call``, or ``None`` (``reduce``).

        ``prepared`` gives the tensor, for moments the kernels left to the host (squares that
        need scaling in the working dtype; the kernels make the second pass about the mean
        themselves since layout 4); it is called only then. The kernels' sums are float64
        entry by entry, so ``host_moment_values`` computes a float32 tensor's moments from them
        however small its entries (``HostSummary.float64``: Adam's second moment of a bias
        before a BatchNorm, about 1e-20, took the reducers' scaled path at 0.36 ms a tensor);
        squares that still need scaling (entries near the dtype's largest, tiny float64 ones)
        give ``None``, and the reducers scale them.
        """
        status = profiled.status
        if status != _native.STATUS_OK and status != _native.STATUS_MOMENTS_ON_HOST:
            return None
        floats = profiled.values.tolist()
        float64 = profiled.values.dtype == np.float64
        if status == _native.STATUS_OK or not self._moments:
            return Fused(*self.values(floats, call), float64)
        tensor = prepared()
        found = host_moment_values(
            HostSummary(*profiled.summary(), float64=True),
            call.numel,
            tensor.values.dtype,
            lambda shift: shifted_squares(tensor, shift, CHUNK_SIZE),
        )
        if found is None:  # squares that need scaling: the reducers scale them
            return None
        moments = np.array(found, dtype=profiled.values.dtype).tolist()  # as ``host_values``
        return Fused(*self.values(floats, call, moments), float64)

    def values(
        self, floats: list[float], call: _Call, moments: list[float] | None = None
    ) -> tuple[list[list[float]], list[float] | None, list[float] | None]:
        """Each reducer's values, the packed histogram and its edges, in the kernels' ``floats``.

        ``floats``: the values of a ``profile`` for ``call`` that finished
        (``_native.STATUS_OK``), as a list; ``moments``: the nine moments where the host
        computed them instead (``STATUS_MOMENTS_ON_HOST``). The histogram and its edges are
        ``None`` without one.
        """
        first, last = _native.MOMENTS, call.last
        if moments is None:
            moments = floats[:first]
        quantiles = floats[first:last]
        results = [quantiles if place else moments for place in self._quantile_places]
        bins = call.bins
        if not bins:
            return results, None, None
        edges_at = last + bins + 4  # the edges follow the packed histogram
        return results, floats[last:edges_at], floats[edges_at : edges_at + bins + 1]
