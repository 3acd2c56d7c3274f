"""The edges of a histogram, found on the host from the three numbers that define its bins.

A histogram's bins are those of ``bin_of(x) = clamp((x * 0.5 - lo * 0.5) * scale, 0, bins - 1)``
truncated, computed on the tensor's device in the working dtype. The function is non-decreasing
(each rounded operation is), so bin ``i`` holds exactly the entries from the first float that
reaches it (its threshold) up to the next threshold. This module finds the thresholds with
numpy, doing the same float operations in the same dtype as the device did, so they are the
device's thresholds bit for bit; on an accelerator that replaces a hundred tiny kernels per
histogram with a few microseconds of host work after the sample's transfer. The histograms of
a sample are searched together (``histograms_edges``): one set of array operations for all of
them instead of one per histogram, which would cost about 60 us each on the training thread.
With the compiled kernels (``_native``) each threshold is bisected in C instead: the same
definition (the first float that reaches the bin), so the same edges, in about 2 us a histogram.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from torchinstruments_core.reducers import _native

if TYPE_CHECKING:
    from collections.abc import Sequence

    from numpy.typing import NDArray

_WAY_BITS = 8
_WAYS = 2**_WAY_BITS
"""Keys probed per step of the search: each step shrinks a bracket 256-fold."""
_NEAR = 2
"""The keys within two of the nominal edge are probed first: they nearly always hold it."""
_TARGETS_PER_SEARCH = 2048
"""Thresholds searched at once: the probes of one step stay within 4 MiB whatever the bins."""


class _Floats:
    """The floats of one dtype as int64 keys in their order, and the bin functions over them.

    One bin function per target: ``half_lo`` and ``scale`` hold each target's grid, so the
    thresholds of many histograms are searched at once.
    """

    def __init__(
        self,
        dtype: type[np.floating],
        half_lo: NDArray[np.floating],
        scale: NDArray[np.floating],
        bins: int,
    ) -> None:
        self.dtype = dtype
        self.bits = 32 if dtype is np.float32 else 64
        self.half = dtype(0.5)
        self.half_lo = half_lo
        self.scale = scale
        self.top = bins - 1

    def take(self, index: NDArray[np.int64] | slice) -> _Floats:
        """The bin functions of the targets at ``index``."""
        return _Floats(self.dtype, self.half_lo[index], self.scale[index], self.top + 1)

    def keys(self, values: NDArray[np.floating]) -> NDArray[np.int64]:
        """``a < b`` exactly when ``key(a) < key(b)`` (``-0.0`` and ``0.0`` share key 0)."""
        signed = np.int32 if self.bits == 32 else np.int64
        bits = np.asarray(values, dtype=self.dtype).view(signed).astype(np.int64)
        magnitude = bits & (2 ** (self.bits - 1) - 1)
        return np.where(bits < 0, -magnitude, bits)

    def floats(self, keys: NDArray[np.int64]) -> NDArray[np.floating]:
        """The floats of ``keys``; a negative float's bits are its magnitude and the sign bit."""
        if self.bits == 32:
            return np.where(keys < 0, -keys - 2**31, keys).astype(np.int32).view(np.float32)
        return np.where(keys < 0, -keys | np.int64(-(2**63)), keys).view(np.float64)

    def reached(self, keys: NDArray[np.int64], targets: NDArray[np.floating]) -> NDArray[np.bool_]:
        """Whether the float of each key falls in its target bin or a later one.

        ``keys`` holds one row per target (or one key per target, when 1-D).
        """
        shape = (-1,) + (1,) * (keys.ndim - 1)
        half_lo, scale = self.half_lo.reshape(shape), self.scale.reshape(shape)
        offsets = (self.floats(keys) * self.half - half_lo) * scale
        reached: NDArray[np.bool_] = np.clip(offsets, 0, self.top) >= targets
        return reached


def histogram_edges(
    lo: float, hi: float, scale: float, bins: int, *, float64: bool = False
) -> list[float]:
    """The ``bins + 1`` edges of a histogram: ``lo``, the threshold of each later bin, ``hi``.

    Args:
        lo: The grid's lower end, as the device computed it (``histogram_counts``' first value).
        hi: Its upper end (the second value).
        scale: ``bins / (hi / 2 - lo / 2)`` as the device computed it (the third value).
        bins: Number of bins.
        float64: Whether the device worked in float64 (float64 input); float32 otherwise.

    Returns:
        The edges as Python floats, non-decreasing, so that ``numpy.histogram(x, bins=edges)``
        gives the device's counts; all NaN when ``lo`` or ``hi`` is not finite (no finite entry).

    Each inner threshold is searched from a bracket of 256 floats around its nominal value
    ``lo + (hi - lo) * i / bins``, which holds it unless rounding moved it further (near zero,
    where floats are dense, it may), then from all of ``[lo, hi]``: ``bin_of(lo)`` is 0 and
    ``(hi - lo) * scale`` rounds to within a few epsilons of ``bins``, so ``hi`` reaches the last
    bin. Only the brackets still wider than one float take another step.
    """
    return histograms_edges([(lo, hi, scale)], bins, float64=float64)[0]


def histograms_edges(
    grids: Sequence[tuple[float, float, float]], bins: int, *, float64: bool = False
) -> list[list[float]]:
    """``histogram_edges`` of several grids of ``bins`` bins, searched together.

    Args:
        grids: Each histogram's ``(lo, hi, scale)``, its first three packed values.
        bins: Number of bins of every one of them.
        float64: Whether the device worked in float64; float32 otherwise.

    Returns:
        The edges of each grid, in the order given: the same floats as ``histogram_edges``.
    """
    dtype: type[np.floating] = np.float64 if float64 else np.float32
    edges = [[math.nan] * (bins + 1) for _ in grids]
    finite = [i for i, (lo, hi, _) in enumerate(grids) if math.isfinite(lo) and math.isfinite(hi)]
    if not finite:
        return edges
    if _native.KERNELS is not None:  # the same edges, bisected in C: 2 us a histogram
        for index in finite:
            edges[index] = _native.edges(*grids[index], bins, float64=float64)
        return edges
    lo, hi, scale = (np.array([grids[i][k] for i in finite], dtype=dtype) for k in range(3))
    per_target = np.repeat(np.arange(len(finite)), bins - 1)  # each grid's bins - 1 targets
    floats = _Floats(dtype, (lo * dtype(0.5))[per_target], scale[per_target], bins)
    targets = np.tile(np.arange(1, bins, dtype=dtype), len(finite))
    first, last = floats.keys(lo)[per_target], floats.keys(hi)[per_target]
    if dtype is np.float32:
        guess = _guess32(floats, targets)
    else:
        half_span = hi[per_target] * floats.half - floats.half_lo
        guess = floats.keys((floats.half_lo + half_span * (targets / dtype(bins))) * dtype(2))
    high = np.empty_like(guess)
    for start in range(0, targets.size, _TARGETS_PER_SEARCH):
        block = slice(start, start + _TARGETS_PER_SEARCH)  # bounds the probes' memory
        high[block] = _thresholds(
            floats.take(block), targets[block], guess[block], first[block], last[block]
        )
    inner = floats.floats(high).astype(np.float64).reshape(len(finite), bins - 1).tolist()
    for row, index in enumerate(finite):
        edges[index] = [float(grids[index][0]), *inner[row], float(grids[index][1])]
    return edges


def _guess32(floats: _Floats, targets: NDArray[np.floating]) -> NDArray[np.int64]:
    """Float32 thresholds worked back through the binning's two roundings, in float64.

    The first difference ``d`` whose product with ``scale`` rounds to the target is within a
    float of ``target / scale``; the first ``x`` whose ``x / 2 - lo / 2`` rounds to ``d`` or
    above lies at the midpoint between ``d`` and the float below it. The guess is nearly always
    the threshold itself (``_thresholds`` checks it): the bracket search is left for the rare
    miss, where the nominal edge ``lo + (hi - lo) * i / bins`` was often hundreds of floats off
    near zero.
    """
    scale = floats.scale
    estimate = (targets.astype(np.float64) / scale.astype(np.float64)).astype(np.float32)
    near = floats.keys(estimate)[:, None] + np.arange(-_NEAR, _NEAR + 1)
    candidates = floats.floats(near).astype(np.float32)
    first = (candidates * scale[:, None] >= targets[:, None]).argmax(axis=1)
    difference = near[np.arange(targets.size), first]
    above = floats.floats(difference).astype(np.float64)
    below = floats.floats(difference - 1).astype(np.float64)
    midpoint = floats.half_lo.astype(np.float64) * 2 + above + below
    return floats.keys(midpoint.astype(np.float32))


def _thresholds(
    floats: _Floats,
    targets: NDArray[np.floating],
    guess: NDArray[np.int64],
    first: NDArray[np.int64],
    last: NDArray[np.int64],
) -> NDArray[np.int64]:
    """The first key reaching each target: next to its guess, else searched from a bracket.

    ``first`` and ``last`` are the keys of each target's grid ends.
    """
    near = np.clip(guess[:, None] + np.arange(-_NEAR, _NEAR + 1), first[:, None], last[:, None])
    reached = floats.reached(near, targets[:, None])
    found = ~reached[:, 0] & reached[:, -1]
    exact: NDArray[np.int64] = near[np.arange(targets.size), reached.argmax(axis=1)]
    if found.all():  # the usual case: every threshold within two keys of its nominal edge
        return exact
    low = np.clip(guess - _WAYS // 2, first, last)
    high = np.clip(guess + _WAYS // 2, first, last)
    valid = ~floats.reached(low, targets) & floats.reached(high, targets)
    low, high = np.where(valid, low, first), np.where(valid, high, last)
    low, high = np.where(found, exact - 1, low), np.where(found, exact, high)
    _search(floats, targets, low, high)
    return high


def _search(
    floats: _Floats, targets: NDArray[np.floating], low: NDArray[np.int64], high: NDArray[np.int64]
) -> None:
    """Narrow every bracket ``(low, high]`` in place to the first key that reaches its target.

    Requires ``not reached(low) and reached(high)``. Float64 brackets are halved until a width
    times the probe count fits in an int64, then cut into ``_WAYS`` parts per step.
    """
    fits = 63 - _WAY_BITS
    halvings = max(0, floats.bits - fits)
    fractions = np.arange(1, _WAYS, dtype=np.int64)
    todo = np.arange(targets.size)
    for step in range(halvings + -(-min(floats.bits, fits) // _WAY_BITS) + 1):
        todo = todo[low[todo] + 1 < high[todo]]  # high - low may overflow an int64
        if todo.size == 0:
            return
        bottom, top, wanted = low[todo], high[todo], targets[todo]
        grids = floats.take(todo)
        if step < halvings:
            middle = (bottom >> 1) + (top >> 1) + (bottom & top & 1)  # floor of the mean, exact
            up = grids.reached(middle, wanted)
            low[todo], high[todo] = np.where(up, bottom, middle), np.where(up, middle, top)
            continue
        inner = bottom[:, None] + (((top - bottom)[:, None] * fractions) >> _WAY_BITS)
        short = (~grids.reached(inner, wanted[:, None])).sum(axis=1)  # probes below the bin
        probes = np.concatenate([bottom[:, None], inner, top[:, None]], axis=1)
        rows = np.arange(todo.size)
        low[todo], high[todo] = probes[rows, short], probes[rows, short + 1]
