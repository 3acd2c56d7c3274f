"""One pass over a CPU tensor, block by block, for the statistics the host shortcuts need.

With the compiled kernels (``_native``) the pass is one call that releases the GIL. Without
them it goes block by block through numpy and torch: an activation is usually larger than the
CPU's L2 cache, and read once per statistic (sum, min and max, squares, zeros) it would come
from main memory four times; read block by block, each block is fetched once and the other
three statistics find it in the cache (about 1.5x faster than whole-tensor passes).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from torchinstruments_core.reducers import _native

if TYPE_CHECKING:
    from collections.abc import Sequence

_NUMPY_DTYPES: dict[torch.dtype, type[np.floating]] = {
    torch.float32: np.float32,
    torch.float64: np.float64,
}

HOST_BLOCK = 2**17
"""Entries per block: 512 KiB of float32 stays in L2, and float32 partial sums stay accurate
(each block's sum and dot product carry ~1e-7 relative error; blocks are added in float64)."""


class HostSummary(NamedTuple):
    """What one pass over an all-finite CPU tensor gives, as Python numbers."""

    total: float
    """Sum of the entries (in float64; without the kernels, per-block sums added in float64)."""
    squares: float
    """Sum of the squared entries (likewise; per-block dot products without the kernels)."""
    lo: float
    """The smallest entry."""
    hi: float
    """The largest entry."""
    zeros: int
    """How many entries equal zero."""
    float64: bool = False
    """Whether each entry was squared and summed in float64 (the compiled kernels): then no
    float32 entry's square underflows or overflows, however small or large it is."""


_NO_RANKS = np.empty(0, dtype=np.int64)


def summarize(values: torch.Tensor) -> HostSummary | None:
    """Sum, sum of squares, min, max and zero count of a flat CPU tensor, in one pass.

    Returns ``None`` when a sum is not finite: the tensor holds a NaN or an infinity, or its
    entries are so large that their sum overflows (float64 entries with the kernels; float32
    ones too, in a block's float32 sum, without them).

    Args:
        values: A flat float32 or float64 CPU tensor (a strided view is copied block by block).
    """
    if _native.usable(values):
        reduced = _native.reduce(values, None, 0, _NO_RANKS, 0)
        if reduced.status != _native.STATUS_OK:
            return None
        total, squares, lo, hi = reduced.total, reduced.squares, reduced.lo, reduced.hi
        return HostSummary(total, squares, lo, hi, reduced.zeros, float64=True)
    return _blocked_summary(values)


def _blocked_summary(values: torch.Tensor) -> HostSummary | None:
    """``summarize`` through numpy and torch, block by block (no compiled kernels)."""
    total = squares = 0.0
    lo, hi = math.inf, -math.inf
    zeros = 0
    numel = values.numel()
    for start in range(0, numel, HOST_BLOCK):
        # a strided block (an expanded gradient) loses ~25x accuracy in torch.dot; the copy is
        # an in-cache 512 KiB. Slicing and ``contiguous`` are asked for only where they do
        # something: each torch call releases the GIL (see ``host_values``).
        block = values if numel <= HOST_BLOCK else values[start : start + HOST_BLOCK]
        if not block.is_contiguous():
            block = block.contiguous()
        part = block.sum().item()
        if not math.isfinite(part):  # a finite sum proves every entry of the block finite
            return None
        entries = block.numpy()
        total += part
        # torch's dot runs on torch's threads; numpy's BLAS would start a pool of its own
        squares += torch.dot(block, block).item()
        # numpy's min and max are SIMD reductions, twice as fast as torch.aminmax on a block
        lo = min(lo, float(entries.min()))
        hi = max(hi, float(entries.max()))
        # torch.count_nonzero branches on every entry on the CPU: 3 to 20 times slower, the
        # most where zeros and nonzeros mix (ReLU, dropout)
        zeros += int(np.count_nonzero(entries == 0))
    return HostSummary(total, squares, lo, hi, zeros)


def host_values(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of ``values`` rounded to ``dtype`` (float32 or float64), built by numpy.

    The same values as ``torch.tensor(values, dtype=dtype)`` (both round to nearest), without a
    torch call: on the reduction worker every torch call releases the GIL and takes it back,
    and each time it does, the training thread, whose own operations need the GIL once they
    end, may have to win it back (``benchmarks/gil_handoff.py``). A reduction's small calls
    cost the training thread more than their own time.
    """
    return torch.from_numpy(np.array(values, dtype=_NUMPY_DTYPES[dtype]))


def host_count(count: int) -> torch.Tensor:
    """A 0-d int64 CPU tensor of ``count``, as ``torch.full`` makes it, without a torch call."""
    return torch.from_numpy(np.array(count, dtype=np.int64))
