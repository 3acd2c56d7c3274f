"""Histograms of an all-finite CPU tensor: the grid from host numbers, the bins block by block.

With the compiled kernels (``_native``) the grid and the bins are one call, the same float
operations in C (``_kernels.c``) with the same results. Without them:
``_binning`` builds the grid from 0-d tensors, a score of tiny torch operations that cost more
than binning a 131,072-entry tensor. When the statistics pass has already read the min and the
max on the host (``PreparedTensor.host_summary``), this module does the same float operations
on numpy scalars of the working dtype (bit for bit the same grid, so the same bins and edges)
and bins with numpy arithmetic into preallocated buffers (no dispatch cost per call, no
temporaries). Past ``DIRECT_ENTRIES`` entries it counts with ``torch.bincount`` on a shared view
(twice as fast as numpy's) of keys that pair neighbouring entries and spread repeats over lanes
(``_bin_keys``); up to it, one ``np.bincount`` of the bins is faster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from torchinstruments_core.reducers import _native
from torchinstruments_core.reducers._bin_keys import BinKeys, bin_keys, lane_pattern
from torchinstruments_core.reducers._host import HOST_BLOCK

if TYPE_CHECKING:
    from numpy.typing import NDArray

BLOCK = HOST_BLOCK // 2
"""Entries binned at a time: with their offsets, their bins and the key table beside them, half a
statistics block keeps binning's working set in the L2 cache (5 % faster than a whole one)."""


DIRECT_ENTRIES = 8192
"""Entries up to which one ``np.bincount`` counts the bins: the lanes and pairs of ``_bin_keys``
pay on large tensors and cost more than they save on small ones (64 bins, the whole
``host_histogram_counts``: 28 µs against 75 µs at 4,096 entries, 20 against 61 at 256; the
keys cost the most with many bins). The counts are the same either way: those of the same
bins."""


class HostGrid(NamedTuple):
    """``_binning._Grid``'s numbers as numpy scalars of the working dtype."""

    lo: np.floating
    hi: np.floating
    half_lo: np.floating
    scale: np.floating


def host_grid(lo: float, hi: float, bins: int, dtype: type[np.floating]) -> HostGrid:
    """``_binning._grid`` on host scalars: the same operations in the same dtype and order.

    Args:
        lo: The smallest entry (a value of ``dtype``).
        hi: The largest entry.
        bins: Number of bins.
        dtype: ``np.float32`` or ``np.float64``, the working dtype.
    """
    finfo = np.finfo(dtype)
    low, high = dtype(lo), dtype(hi)
    with np.errstate(over="ignore"):
        narrow = (high - low) < dtype(4 * bins / float(finfo.max))
        width = max(abs(low), abs(high)) * finfo.eps
        pad = max(width, dtype(0.5)) if narrow else dtype(0)
        wide_low, wide_high = low - pad, high + pad
        if np.isinf(wide_high):  # at the ends of the float range, widen inward
            wide_low, wide_high = low - dtype(2) * pad, high
        elif np.isinf(wide_low):
            wide_low, wide_high = low, high + dtype(2) * pad
        half_lo = wide_low * dtype(0.5)
        # ``bins / tensor`` in torch is ``tensor.reciprocal() * bins``
        scale = (dtype(1) / (wide_high * dtype(0.5) - half_lo)) * dtype(bins)
    return HostGrid(wide_low, wide_high, half_lo, scale)


class _Scratch(NamedTuple):
    """The buffers of one histogram: a block's offsets, and the bins of a span of entries."""

    offsets: NDArray[np.floating]
    bins: NDArray[np.integer]


def host_histogram_counts(
    values: torch.Tensor, lo: float, hi: float, bins: int, chunk_size: int
) -> torch.Tensor:
    """``histogram_counts`` of an all-finite flat CPU tensor whose min and max are known.

    Up to ``DIRECT_ENTRIES`` entries the bins are computed at once and one ``np.bincount``
    counts them. Past it, they are computed block by block (``BLOCK`` entries, in the L2 cache)
    into a buffer of ``chunk_size`` entries, whose keys (``_bin_keys``) one ``torch.bincount``
    counts.

    Args:
        values: The flat float32 or float64 CPU tensor, every entry finite.
        lo: Its smallest entry.
        hi: Its largest entry.
        bins: Number of bins.
        chunk_size: Past ``DIRECT_ENTRIES``, entries whose bins are held and counted at once
            (one byte each up to 84 bins, or 127 for large tensors, two up to 10,921, else
            four).

    Raises:
        ValueError: If ``bins`` is so large that rounding in the float32 grid puts the
            largest entry past the last bin (millions of bins; ``HistogramReducer`` allows
            65,536), as the other ways of counting fail there too.

    Returns:
        The ``bins + 4`` packed values of ``histogram_counts``, in the working dtype.
    """
    if _native.usable(values):
        status, (grid_lo, grid_hi, _, scale), counts = _native.histogram(values, lo, hi, bins)
        if status == _native.STATUS_BIN_OVERFLOW:
            raise ValueError(_TOO_FINE.format(bins=bins))
        return pack_histogram((grid_lo, grid_hi, scale), counts, bins, values.dtype)
    entries: NDArray[np.floating] = values.numpy()
    dtype = entries.dtype.type
    grid = host_grid(lo, hi, bins, dtype)
    if entries.size <= DIRECT_ENTRIES:
        binned = _count_directly(entries, grid, bins)
    else:
        binned = _count_with_keys(entries, grid, bins, chunk_size)
    return pack_histogram(
        (float(grid.lo), float(grid.hi), float(grid.scale)), binned, bins, values.dtype
    )


_TOO_FINE = "{bins} bins: the grid's rounding put the largest entry past the last"

_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}


def pack_histogram(
    grid: tuple[float, float, float],
    buckets: NDArray[np.integer],
    bins: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``histogram_counts``' packed tensor: the grid's lo, hi and scale, the counts, 0 non-finite.

    Args:
        grid: The grid's lo, hi and scale (values of ``dtype``).
        buckets: ``bins + 1`` counts: the bins', then the max's bucket, which joins the last bin.
        bins: Number of bins.
        dtype: The working dtype, float32 or float64.
    """
    packed = np.empty(bins + 4, dtype=_NUMPY[dtype])
    packed[:3] = grid
    packed[3 : 2 + bins] = buckets[: bins - 1]
    # the top bucket (the max, up to rounding) joins the last bin
    packed[2 + bins] = buckets[bins - 1] + buckets[bins]
    packed[3 + bins] = 0
    return torch.from_numpy(packed)


def _count_directly(entries: NDArray[np.floating], grid: HostGrid, bins: int) -> NDArray[np.int64]:
    """The ``bins + 1`` counts of a small tensor's bins (the top one apart), by one bincount."""
    found = np.empty(entries.size, dtype=np.intp)
    _bins(entries, grid, np.empty(entries.size, entries.dtype), found)
    counts = np.bincount(found, minlength=bins + 1)
    if counts.size > bins + 1:  # would be dropped from the packed counts without a word
        raise ValueError(_TOO_FINE.format(bins=bins))
    return counts


def _count_with_keys(
    entries: NDArray[np.floating], grid: HostGrid, bins: int, chunk_size: int
) -> NDArray[np.int64]:
    """The ``bins + 1`` counts of a tensor's bins, block by block, through ``_bin_keys``."""
    keys = bin_keys(bins, entries.size)
    block = min(chunk_size, BLOCK)
    span = min(chunk_size, entries.size)
    # one more entry than a span, to complete the last pair of an odd span
    scratch = _Scratch(np.empty(min(block, span), entries.dtype), np.empty(span + 1, keys.dtype))
    pattern = lane_pattern(keys, block)
    table = np.zeros(keys.size, dtype=np.int64)
    padding = 0
    for start in range(0, entries.size, span):
        part = entries[start : start + span]
        padding += _count_span(part, grid, keys, scratch, pattern, table)
    return keys.counts(table, padding)


def _count_span(
    entries: NDArray[np.floating],
    grid: HostGrid,
    keys: BinKeys,
    scratch: _Scratch,
    pattern: NDArray[np.integer],
    table: NDArray[np.int64],
) -> int:
    """Add the keys of a span of entries to ``table``; return the padding added (0 or 1)."""
    filled = 0
    block = scratch.offsets.size
    for start in range(0, entries.size, block):
        part = entries[start : start + block]
        found = scratch.bins[filled : filled + part.size]
        _bins(part, grid, scratch.offsets[: part.size], found)
        if keys.lanes > 1:
            phase = filled % keys.period
            np.add(found, pattern[phase : phase + part.size], out=found)
        filled += part.size
    padding = filled % 2 if keys.paired else 0
    scratch.bins[filled : filled + padding] = 0
    counted = keys.view(scratch.bins[: filled + padding])
    table += torch.bincount(torch.from_numpy(counted), minlength=keys.size).numpy()
    return padding


def _bins(
    entries: NDArray[np.floating],
    grid: HostGrid,
    offsets: NDArray[np.floating],
    found: NDArray[np.integer],
) -> None:
    """Into ``found``: the bin of each entry, ``bins`` for the max, with ``offsets`` as scratch.

    The float operations of ``_binning._Grid.offset``, but subtracting ``half_lo`` only when
    it is not zero (``lo`` is 0 after a ReLU): ``v - 0`` is ``v`` up to the sign of a zero, and
    both zeros truncate to bin 0.
    """
    dtype = offsets.dtype.type
    np.multiply(entries, dtype(0.5), out=offsets)
    if grid.half_lo != 0:
        np.subtract(offsets, grid.half_lo, out=offsets)
    np.multiply(offsets, grid.scale, out=offsets)
    np.copyto(found, offsets, casting="unsafe")  # truncates toward zero
