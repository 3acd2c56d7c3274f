"""Power-of-two scaling, so that the squares and sums of any finite tensor stay finite and exact.

Squaring a float32 entry above about 1.8e19 overflows, so does summing many entries near 3.4e38,
and squaring one below about 1e-19 loses bits or underflows to zero (float64: 1.3e154 and 1e-154).
Multiplying every entry by a power of two that brings the largest magnitude into ``[1, 2)`` moves
the whole computation to where none of that happens, and is exact: only the exponents change.
Entries more than 2**126 below the largest may flush to zero on the way, which changes no
statistic by a representable amount. Dividing the results by the same power of two is exact too,
and since ``std``, ``rms`` and ``|mean|`` never exceed ``max_abs``, the results are finite.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class _Layout(NamedTuple):
    """Where a float's exponent sits: the integer type of its bits, mantissa bits and bias."""

    bits: torch.dtype
    mantissa: int
    bias: int


_LAYOUTS = {
    torch.float32: _Layout(torch.int32, 23, 127),
    torch.float64: _Layout(torch.int64, 52, 1023),
}


def power_of_two_scale(max_abs: torch.Tensor) -> torch.Tensor:
    """The power of two ``s`` with ``max_abs * s`` in ``[1, 2)``, as a 0-d tensor on its device.

    Computed from the bits of ``max_abs``, with no host read and no rounding: ``s`` is always a
    normal float of the working dtype (clamped to ``[2**-126, 2**127]`` in float32), so a zero
    or subnormal ``max_abs`` gets the largest and an infinite or NaN one the smallest.

    Args:
        max_abs: A non-negative 0-d float32 or float64 tensor.
    """
    layout = _LAYOUTS[max_abs.dtype]
    top = 2 * layout.bias
    field = (max_abs.view(layout.bits) >> layout.mantissa) & (top + 1)
    return ((top - field).clamp(1, top) << layout.mantissa).view(max_abs.dtype)


def squares_are_safe(
    max_abs: float, numel: int, dtype: torch.dtype, *, float64_sums: bool = False
) -> bool:
    """Whether sums of squares of ``numel`` entries up to ``max_abs`` need no scaling.

    True when the squares of the entries that matter (within ``2**-12`` of the largest) are
    normal floats and ``4 * numel * max_abs**2`` (deviations from a mean are at most twice the
    largest entry) stays below the dtype's maximum; an all-zero tensor needs no scaling either.
    ``float64_sums``: each entry was squared and summed in float64 (the compiled kernels): a
    float32 entry however small then has a normal square, and only the upper bound holds
    (results past it must round to float32 as the scaled path rounds them).
    """
    info = torch.finfo(dtype)
    low = math.sqrt(info.smallest_normal / info.eps)
    high = math.sqrt(info.max / (4 * numel))
    if max_abs == 0.0 or low <= max_abs < high:
        return True
    return float64_sums and dtype == torch.float32 and max_abs < low
