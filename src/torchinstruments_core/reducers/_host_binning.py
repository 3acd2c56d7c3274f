"""Histograms of an all-finite CPU tensor: the grid from host numbers, the bins block by block.

``_binning`` builds the grid from 0-d tensors, a score of tiny torch operations that cost more
than binning a 131,072-entry tensor. When the statistics pass has already read the min and the
max on the host (``PreparedTensor.host_summary``), this module does the same float operations
on numpy scalars of the working dtype (bit for bit the same grid, so the same bins and edges)
and bins with numpy arithmetic, which has no dispatch cost per call, counting with
``torch.bincount`` on a shared view (twice as fast as numpy's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from torchinstruments_core.reducers._host import HOST_BLOCK

if TYPE_CHECKING:
    from numpy.typing import NDArray


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


def host_histogram_counts(
    values: torch.Tensor, lo: float, hi: float, bins: int, chunk_size: int
) -> torch.Tensor:
    """``histogram_counts`` of an all-finite flat CPU tensor whose min and max are known.

    Args:
        values: The flat float32 or float64 CPU tensor, every entry finite.
        lo: Its smallest entry.
        hi: Its largest entry.
        bins: Number of bins.
        chunk_size: Elements per block (at most ``HOST_BLOCK``, to stay in the L2 cache).

    Returns:
        The ``bins + 4`` packed values of ``histogram_counts``, in the working dtype.
    """
    entries: NDArray[np.floating] = values.numpy()
    dtype = entries.dtype.type
    grid = host_grid(lo, hi, bins, dtype)
    size = min(chunk_size, HOST_BLOCK, entries.size)
    offsets = np.empty(size, dtype=dtype)
    # torch's bincount (numpy's is 2x slower), a quarter faster on bytes than on int32
    buckets = torch.empty(size, dtype=torch.uint8 if bins < 255 else torch.int32)
    index = buckets.numpy()
    counts = torch.zeros(bins + 1, dtype=torch.int64)
    half = dtype(0.5)
    for start in range(0, entries.size, size):
        block = entries[start : start + size]
        part = offsets[: block.size]
        np.multiply(block, half, out=part)
        np.subtract(part, grid.half_lo, out=part)
        np.multiply(part, grid.scale, out=part)
        np.copyto(index[: block.size], part, casting="unsafe")  # truncates toward zero
        counts += torch.bincount(buckets[: block.size], minlength=bins + 1)
    # the top bucket (the max, up to rounding) joins the last bin
    binned = counts.numpy()
    packed = np.empty(bins + 4, dtype=dtype)
    packed[:3] = (grid.lo, grid.hi, grid.scale)
    packed[3 : 2 + bins] = binned[: bins - 1]
    packed[2 + bins] = binned[bins - 1] + binned[bins]
    packed[3 + bins] = 0
    return torch.from_numpy(packed)
