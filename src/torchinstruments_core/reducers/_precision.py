"""Kurtosis and low-precision range fractions of a tensor, in one fused pass over its chunks.

Each chunk is read once for everything: its magnitudes are bucketed against every format's
thresholds at once (one ``bucketize`` into ten buckets, one count), and its scaled copy gives
the chunk's count, mean and central power sums of order 2, 3 and 4. On the CPU the chunks are
``HOST_BLOCK`` entries, so the chunk's temporaries stay in the L2 cache between those steps.
What ``PreparedTensor`` already holds is shared with the other reducers: the working-dtype copy,
the finite mask, and the finite range (whose ``max_abs`` sets the power-of-two scale).

Nothing here reads a value on the host: no ``.item()``, no branch on a value, no ``bincount``
off the CPU (see ``functional``'s module docstring). The threshold tensor is built once per
device and dtype and cached.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from torchinstruments_core.reducers._binning import _count
from torchinstruments_core.reducers._formats import FORMATS
from torchinstruments_core.reducers._host import HOST_BLOCK
from torchinstruments_core.reducers._scaling import power_of_two_scale
from torchinstruments_core.reducers.base import CHUNK_SIZE

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torchinstruments_core.reducers.base import PreparedTensor

PRECISION_METRICS: tuple[str, ...] = (
    "kurtosis",
    *(f"{f.name}_{kind}_fraction" for f in FORMATS for kind in ("overflow", "underflow")),
)
"""Names of the values ``precision_statistics`` returns, in order."""


class _Power(NamedTuple):
    """Count, mean and central power sums of order 2, 3, 4 of a chunk's finite entries."""

    size: torch.Tensor
    mean: torch.Tensor
    s2: torch.Tensor
    s3: torch.Tensor
    s4: torch.Tensor


@functools.cache
def _thresholds(dtype: torch.dtype) -> tuple[tuple[float, ...], tuple[int, ...], tuple[int, ...]]:
    """Sorted bucket boundaries, and where each format's underflow and overflow bound sits.

    Boundary 0 is ``0`` (bucket 0 holds the zeros); an underflow bound is the float just below
    the smallest subnormal (``|x| <= bound`` is ``|x| < smallest subnormal``), an overflow
    bound the largest finite value (``|x| > max`` overflows).
    """
    below = [
        torch.nextafter(
            torch.tensor(f.smallest_subnormal, dtype=dtype), torch.zeros((), dtype=dtype)
        )
        for f in FORMATS
    ]
    bounds = [0.0, *(float(b) for b in below), *(f.max for f in FORMATS)]
    ordered = sorted(set(bounds))
    under = tuple(ordered.index(float(b)) for b in below)
    over = tuple(ordered.index(f.max) for f in FORMATS)
    return tuple(ordered), under, over


@functools.lru_cache(maxsize=16)
def _boundaries(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The boundaries as a tensor on ``device``: built from host data once, then reused."""
    return torch.tensor(_thresholds(dtype)[0], dtype=dtype, device=device)


def _chunk_buckets(
    chunk: torch.Tensor, mask: torch.Tensor | None, boundaries: torch.Tensor
) -> torch.Tensor:
    """How many entries fall in each bucket of ``|x|``; non-finite entries count as zeros."""
    magnitude = chunk.abs() if mask is None else torch.where(mask, chunk, 0).abs_()
    index = torch.bucketize(magnitude, boundaries, out_int32=True)
    return _count(index, boundaries.numel() + 1)


def _chunk_powers(chunk: torch.Tensor, mask: torch.Tensor | None, scale: torch.Tensor) -> _Power:
    """The chunk's ``_Power`` of the entries times ``scale`` (deviations at most 4: no overflow)."""
    if mask is None:
        size = torch.full((), chunk.numel(), dtype=torch.int64, device=chunk.device)
        scaled = chunk * scale
    else:
        size = torch.count_nonzero(mask)
        scaled = torch.where(mask, chunk, 0).mul_(scale)
    mean = scaled.sum() / size.clamp(min=1)
    deviations = scaled.sub_(mean) if mask is None else scaled.sub_(mean).mul_(mask)
    squares = deviations.square()
    return _Power(
        size,
        mean,
        squares.sum(),
        torch.dot(squares, deviations),
        torch.dot(squares, squares),
    )


def _kurtosis(powers: Sequence[_Power]) -> torch.Tensor:
    """Excess kurtosis of all chunks: the power sums moved from each chunk's mean to the mean.

    With ``d = mean_i - mean`` and ``sum(x - mean_i) == 0`` over chunk ``i``:
    ``S2 = sum(s2_i + n_i d**2)`` and ``S4 = sum(s4_i + 4 d s3_i + 6 d**2 s2_i + n_i d**4)``;
    the kurtosis is ``n * S4 / S2**2 - 3``, NaN when ``S2`` is 0 or there is no finite entry.
    """
    sizes, means, s2, s3, s4 = (torch.stack(column) for column in zip(*powers, strict=True))
    total = sizes.sum()
    weights = sizes.to(means.dtype)
    mean = (weights / total.clamp(min=1).to(means.dtype) * means).sum()
    shift = means - mean
    m2 = (s2 + weights * shift.square()).sum()
    m4 = (s4 + 4 * shift * s3 + 6 * shift.square() * s2 + weights * shift.square().square()).sum()
    kurtosis = total.to(means.dtype) * m4 / m2.square() - 3
    return torch.where((total > 0) & (m2 > 0), kurtosis, math.nan)


def _fractions(counts: torch.Tensor, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each format's overflow and underflow fraction of all ``numel`` entries, from the buckets."""
    _, under, over = _thresholds(dtype)
    below = counts.cumsum(0).to(dtype)  # below[i]: entries with |x| <= boundary i
    zeros = below[0]
    result: list[torch.Tensor] = []
    for under_at, over_at in zip(under, over, strict=True):
        result += [(numel - below[over_at]) / numel, (below[under_at] - zeros) / numel]
    return result


def precision_statistics(prepared: PreparedTensor, *, chunk_size: int = 0) -> torch.Tensor:
    """Excess kurtosis of the finite entries; each format's overflow and underflow fraction.

    Values, in the order of ``PRECISION_METRICS``: ``kurtosis`` (Fisher's excess kurtosis
    ``m4 / m2**2 - 3`` with population moments, 0 for a normal distribution, as
    ``scipy.stats.kurtosis`` gives by default; NaN for a constant tensor or one without finite
    entries), then for each of ``_formats.FORMATS`` (bf16, fp16, fp8_e4m3, fp8_e5m2):
    ``<format>_overflow_fraction``, the finite entries with ``|x| > max``, and
    ``<format>_underflow_fraction``, the entries with ``0 < |x| < smallest_subnormal``; both
    over all entries, non-finite ones included in the denominator only. A cast rounds to
    nearest, so entries within half a unit of the last place above ``max`` still land on
    ``max``, and those from half the smallest subnormal up to it on the subnormal: the
    fractions count strictly by the thresholds, an upper bound on what a cast loses. (torch's
    cast to ``float8_e4m3fn``, which has no infinity, saturates at ±448: there "overflow" is
    clipping.)

    The kurtosis runs on the entries times the power of two that brings ``max_abs`` into
    ``[1, 2)`` (it is scale-free, so nothing is divided back): fourth powers cannot overflow.

    Args:
        prepared: The tensor to reduce.
        chunk_size: Entries per chunk; 0 picks ``HOST_BLOCK`` on the CPU, ``CHUNK_SIZE`` elsewhere.

    Returns:
        A tensor of ``len(PRECISION_METRICS)`` values in the working dtype, on its device.

    Raises:
        ValueError: If ``chunk_size`` is negative.
    """
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be a positive int or 0, got {chunk_size!r}")
    size = chunk_size or (HOST_BLOCK if prepared.device.type == "cpu" else CHUNK_SIZE)
    dtype = prepared.values.dtype
    boundaries = _boundaries(prepared.device, dtype)
    lo, hi = prepared.finite_range
    scale = power_of_two_scale(torch.maximum(lo.abs(), hi.abs()))
    counts = torch.zeros(boundaries.numel() + 1, dtype=torch.int64, device=prepared.device)
    powers: list[_Power] = []
    for chunk, mask in prepared.chunks(size):
        counts += _chunk_buckets(chunk, mask, boundaries)
        powers.append(_chunk_powers(chunk, mask, scale))
    return torch.stack([_kurtosis(powers), *_fractions(counts, prepared.numel, dtype)])
