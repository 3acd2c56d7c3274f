"""Pure tensor reductions of a ``PreparedTensor``, computed on its device without a host sync.

Nothing here calls ``.item()`` or ``.cpu()``, indexes with a boolean mask, or builds a tensor from
host data on the device: each of those would make the host wait for the accelerator. On the CPU,
where knowing ``all_finite`` is free, the masking work is skipped for all-finite tensors.

Large tensors are processed in chunks of ``chunk_size`` elements, so the extra memory a reduction
needs is about one chunk's worth of working-dtype temporaries, whatever the tensor's size.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from torchinstruments_core.reducers.base import PreparedTensor

CHUNK_SIZE = 2**22
"""Elements per chunk: 16 MiB of float32 temporaries at most, and exact float32 chunk counts."""

HISTOGRAM_CHUNK_SIZE = CHUNK_SIZE // 4
"""Binning holds about four chunk-sized temporaries, so its chunks are a quarter as long."""

MOMENT_METRICS = (
    "mean",
    "std",
    "min",
    "max",
    "zero_fraction",
    "nonfinite_fraction",
    "rms",
    "max_abs",
)
"""Names of the values ``moments`` returns, in order."""

DEFAULT_QUANTILES = (0.25, 0.5, 0.75)


class _Partial(NamedTuple):
    """Statistics of the ``size`` finite entries of a chunk; mean, lo and hi are 0 if none."""

    size: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor


def _chunks(
    prepared: PreparedTensor, chunk_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """Yield views of the values with their finite mask, or ``None`` when all are known finite."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    mask = None if prepared.all_finite else prepared.finite
    for start in range(0, prepared.numel, chunk_size):
        stop = start + chunk_size
        yield prepared.values[start:stop], None if mask is None else mask[start:stop]


def _chunk_partial(chunk: torch.Tensor, mask: torch.Tensor | None) -> _Partial:
    """First pass: count and mean; second pass: min, max and the sum of squared deviations."""
    if mask is None:
        count = torch.full((), chunk.numel(), dtype=torch.int64, device=chunk.device)
        mean = chunk.sum() / chunk.numel()
        deviations = chunk - mean
        lo, hi = torch.aminmax(chunk)
    else:
        count = torch.count_nonzero(mask)
        # clamp keeps an empty chunk at mean 0 instead of NaN, so the combination can skip it
        mean = torch.where(mask, chunk, 0).sum() / count.clamp(min=1)
        # non-finite entries take the mean's place: a zero deviation, and never the min or max
        deviations = torch.where(mask, chunk, mean)
        lo, hi = torch.aminmax(deviations)
        deviations.sub_(mean)
    return _Partial(count, mean, deviations.square_().sum(), lo, hi)


def _combine(partials: Sequence[_Partial]) -> _Partial:
    """Chan et al.'s parallel formula over all chunks at once; the result has NaNs when empty.

    ``M2 = sum(M2_i) + sum(n_i * (mean_i - mean)**2)``; a single chunk passes through exactly
    (its weight is ``n / n == 1``).
    """
    counts, means, m2s, los, his = (torch.stack(column) for column in zip(*partials, strict=True))
    total = counts.sum()
    present = total > 0
    sizes = counts.to(means.dtype)
    mean = (sizes / total.clamp(min=1).to(means.dtype) * means).sum()
    m2 = m2s.sum() + (sizes * (means - mean).square()).sum()
    nonempty = counts > 0
    lo = torch.where(nonempty, los, math.inf).amin()
    hi = torch.where(nonempty, his, -math.inf).amax()
    nan = math.nan
    return _Partial(
        total,
        torch.where(present, mean, nan),
        torch.where(present, m2, nan),
        torch.where(present, lo, nan),
        torch.where(present, hi, nan),
    )


def moments(prepared: PreparedTensor, *, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Scale and range statistics of the finite entries, and the zero and non-finite fractions.

    The variance is computed per chunk in two passes (mean, then squared deviations) and the
    chunks are combined with Chan et al.'s parallel formula, so it stays accurate when the mean is
    large against the spread. Counts are int64 and only become floating point in the last division.

    Args:
        prepared: The tensor to reduce.
        chunk_size: Elements per chunk; it bounds the temporary memory.

    Returns:
        A tensor of ``len(MOMENT_METRICS)`` values in the working dtype, in the order of
        ``MOMENT_METRICS``: mean, population std, min, max, zero_fraction, nonfinite_fraction,
        rms, max_abs. The fractions are over all entries (NaN is not a zero); the rest are over the
        finite entries, and NaN when there are none.
    """
    dtype = prepared.values.dtype
    partials: list[_Partial] = []
    zeros = torch.zeros((), dtype=torch.int64, device=prepared.device)
    for chunk, mask in _chunks(prepared, chunk_size):
        partials.append(_chunk_partial(chunk, mask))
        # count_nonzero needs no temporary, and counts NaN as nonzero as it should
        zeros += chunk.numel() - torch.count_nonzero(chunk)
    total = _combine(partials)
    variance = total.m2 / total.size.to(dtype)
    nonfinite = prepared.numel - prepared.n_finite
    return torch.stack(
        [
            total.mean,
            variance.sqrt(),
            total.lo,
            total.hi,
            zeros.to(dtype) / prepared.numel,
            nonfinite.to(dtype) / prepared.numel,
            (variance + total.mean.square()).sqrt(),
            torch.maximum(total.lo.abs(), total.hi.abs()),
        ]
    )


def _check_quantile_args(qs: Sequence[float], sample_size: int) -> None:
    """Reject quantile levels outside [0, 1] and non-positive sample sizes."""
    if not qs or any(not 0.0 <= q <= 1.0 for q in qs):
        raise ValueError(f"qs must be a non-empty sequence of levels in [0, 1], got {qs!r}")
    if sample_size < 1:
        raise ValueError(f"sample_size must be a positive int, got {sample_size!r}")


def _quantile_sample(
    prepared: PreparedTensor, sample_size: int, exact: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The entries to take quantiles of, and their finite mask (``None`` when all are finite)."""
    if exact or prepared.numel <= sample_size:
        return prepared.values, None if prepared.all_finite else prepared.finite
    index = torch.randint(
        prepared.numel,
        (sample_size,),
        generator=prepared.generator,
        device=prepared.device,
    )
    sample = prepared.values[index]
    return sample, None if prepared.all_finite else torch.isfinite(sample)


def _interpolate(
    ordered: torch.Tensor, n_finite: torch.Tensor, qs: Sequence[float]
) -> torch.Tensor:
    """Numpy's ``linear`` quantiles of the first ``n_finite`` entries of a sorted 1-D tensor.

    Positions are float64 like numpy's (MPS has no float64, so float32 there), and the lerp is
    numpy's two-sided one, so float64 input gives bit-identical results.
    """
    position_dtype = torch.float32 if ordered.device.type == "mps" else torch.float64
    last = n_finite - 1
    # one kernel per level: a tensor built from host data would make the host wait on the device
    positions = torch.stack([last.to(position_dtype) * q for q in qs])
    below = positions.floor()
    gamma = (positions - below).to(ordered.dtype)
    below_index = below.long().clamp(max=last).clamp_(min=0)
    above_index = (below_index + 1).clamp(max=last).clamp_(min=0)
    low, high = ordered[below_index], ordered[above_index]
    span = high - low
    result = torch.where(gamma >= 0.5, high - span * (1 - gamma), low + span * gamma)
    return torch.where(n_finite > 0, result, math.nan)


def quantiles(
    prepared: PreparedTensor,
    qs: Sequence[float] = DEFAULT_QUANTILES,
    *,
    sample_size: int = 65536,
    exact: bool = False,
) -> torch.Tensor:
    """Quantiles of the finite entries, with numpy's default (``linear``) interpolation.

    Tensors of more than ``sample_size`` entries are subsampled uniformly with replacement, using
    ``prepared.generator`` (never the global random state). Error bound: with ``m`` finite values
    in the subsample, the Dvoretzky-Kiefer-Wolfowitz inequality gives that the returned
    ``q``-quantile lies between the true ``(q - eps)`` and ``(q + eps)`` quantiles (give or take
    the ``1/m`` in rank of one interpolation step) with probability at least
    ``1 - 2 * exp(-2 * m * eps**2)``, for all levels at once. For ``m = 65536`` and ``eps = 0.01``
    that is ``1 - 2 * exp(-13.1072) = 1 - 4.06e-6`` (0.99999594).

    Unlike ``torch.quantile`` there is no size limit: non-finite entries are keyed to ``+inf``
    and sorted last, and the interpolation positions come from the on-device finite count.

    Args:
        prepared: The tensor to reduce.
        qs: Quantile levels in [0, 1].
        sample_size: Largest number of entries sorted; larger tensors are subsampled.
        exact: Sort every entry whatever the size (memory and time grow with the tensor).

    Returns:
        A tensor of ``len(qs)`` values in the working dtype, NaN when the (sub)sample holds no
        finite value.

    Raises:
        ValueError: If a level is outside [0, 1] or ``sample_size`` is not positive.
    """
    _check_quantile_args(qs, sample_size)
    sample, mask = _quantile_sample(prepared, sample_size, exact)
    if mask is None:
        n_finite = torch.full((), sample.numel(), dtype=torch.int64, device=sample.device)
        keyed = sample
    else:
        n_finite = torch.count_nonzero(mask)
        keyed = torch.where(mask, sample, math.inf)
    return _interpolate(_sort(keyed), n_finite, qs)


def _sort(values: torch.Tensor) -> torch.Tensor:
    """Ascending sort; on the CPU through numpy, whose vectorized sort is 20-30x faster."""
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64):
        import numpy as np

        return torch.from_numpy(np.sort(values.contiguous().numpy()))
    return torch.sort(values).values


def _finite_range(prepared: PreparedTensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of the finite entries; ``(inf, -inf)`` when there are none."""
    los: list[torch.Tensor] = []
    his: list[torch.Tensor] = []
    for chunk, mask in _chunks(prepared, chunk_size):
        if mask is None:
            lo, hi = torch.aminmax(chunk)
        else:
            lo = torch.where(mask, chunk, math.inf).amin()
            hi = torch.where(mask, chunk, -math.inf).amax()
        los.append(lo)
        his.append(hi)
    return torch.stack(los).amin(), torch.stack(his).amax()


class _Grid(NamedTuple):
    """Evenly spaced bins: edge ``i`` is ``lo + span * (i / bins)``, the last one exactly ``hi``."""

    lo: torch.Tensor
    span: torch.Tensor
    hi: torch.Tensor
    bins: int

    def edge(self, steps: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Edges at float ``steps``, in ``out`` if given (it may be ``steps``).

        The operations are those that made ``edges``, so the floats are equal.
        """
        return torch.div(steps, self.bins, out=out).mul_(self.span).add_(self.lo)


def _grid(lo: torch.Tensor, hi: torch.Tensor, bins: int) -> _Grid:
    """The grid over ``[lo, hi]``, widened around a single value so that every bin has width."""
    # 0.5 as asked for, or one relative epsilon where |v| is too large for 0.5 to change v
    pad = torch.where(lo == hi, (lo.abs() * torch.finfo(lo.dtype).eps).clamp(min=0.5), 0)
    lo, hi = lo - pad, hi + pad
    return _Grid(lo, hi - lo, hi, bins)


def _edges(grid: _Grid, n_finite: torch.Tensor) -> torch.Tensor:
    """The ``bins + 1`` edges of the grid; NaN when there is no finite value."""
    steps = torch.arange(grid.bins + 1, dtype=grid.lo.dtype, device=grid.lo.device)
    edges = grid.edge(steps)
    edges[-1] = grid.hi
    return torch.where(n_finite > 0, edges, math.nan)


def count_sorted(index: torch.Tensor, n_buckets: int) -> torch.Tensor:
    """Count the occurrences of ``0 .. n_buckets - 1`` in ``index`` by sorting, as int64.

    ``index_add_`` and ``scatter_add_`` raise on CUDA under
    ``torch.use_deterministic_algorithms(True)``; sorting and ``searchsorted`` do not, and give the
    same counts.
    """
    ordered = torch.sort(index).values
    boundaries = torch.arange(n_buckets + 1, dtype=index.dtype, device=index.device)
    return torch.searchsorted(ordered, boundaries).diff()


def _count(index: torch.Tensor, n_buckets: int) -> torch.Tensor:
    """Count the occurrences of ``0 .. n_buckets - 1`` in ``index``, as int64."""
    if index.is_cuda and torch.are_deterministic_algorithms_enabled():
        return count_sorted(index, n_buckets)
    counts = torch.zeros(n_buckets, dtype=torch.int64, device=index.device)
    ones = torch.ones((), dtype=torch.int64, device=index.device).expand(index.numel())
    return counts.index_add_(0, index, ones)


def _bucket_index(chunk: torch.Tensor, mask: torch.Tensor | None, grid: _Grid) -> torch.Tensor:
    """Bucket 0 for a non-finite entry, ``i + 1`` for one in bin ``i``, as int32.

    The arithmetic guess can be one bin off next to an edge, so it is checked against the edges
    themselves, as ``numpy.histogram`` does; ``torch.bucketize`` would be exact but is several
    times slower on the CPU.
    """
    last = grid.bins - 1
    guess = (chunk - grid.lo).mul_(grid.bins / grid.span).floor_().clamp_(0, last)
    edge = torch.empty_like(guess)
    guess.add_(chunk < grid.edge(guess, out=edge), alpha=-1)
    guess.add_((chunk >= grid.edge(torch.add(guess, 1, out=edge), out=edge)) & (guess < last))
    if mask is not None:
        guess.masked_fill_(mask.logical_not(), -1)
    return guess.to(torch.int32).add_(1)


def _bin_counts(prepared: PreparedTensor, grid: _Grid, chunk_size: int) -> torch.Tensor:
    """The int64 counts of the finite entries in each bin of the grid."""
    counts = torch.zeros(grid.bins + 1, dtype=torch.int64, device=prepared.device)
    for chunk, mask in _chunks(prepared, chunk_size):
        counts += _count(_bucket_index(chunk, mask, grid), grid.bins + 1)
    # bucket 0 collected the non-finite entries
    return counts[1:]


def histogram(
    prepared: PreparedTensor, bins: int = 64, *, chunk_size: int = HISTOGRAM_CHUNK_SIZE
) -> torch.Tensor:
    """A ``bins``-bin histogram of the finite entries over their ``[min, max]``, packed flat.

    Bins are half-open ``[e_i, e_i+1)`` except the last, which includes the max, as in
    ``numpy.histogram``. A constant tensor gets the range ``[v - 0.5, v + 0.5]`` (wider where
    ``v +- 0.5`` would round to ``v``). Counts are exact int64 until packed into the working dtype
    (exact up to 2**24 per bin in float32). The edges are not finite if ``max - min`` overflows the
    working dtype.

    Args:
        prepared: The tensor to reduce.
        bins: Number of bins.
        chunk_size: Elements per chunk; it bounds the temporary memory.

    Returns:
        A tensor of ``2 * bins + 2`` values in the working dtype: ``bins + 1`` edges (NaN when
        there is no finite entry), ``bins`` counts, then the number of non-finite entries.

    Raises:
        ValueError: If ``bins`` is not positive.
    """
    if bins < 1:
        raise ValueError(f"bins must be a positive int, got {bins!r}")
    dtype = prepared.values.dtype
    grid = _grid(*_finite_range(prepared, chunk_size), bins)
    counts = _bin_counts(prepared, grid, chunk_size)
    nonfinite = prepared.numel - prepared.n_finite
    edges = _edges(grid, prepared.n_finite)
    return torch.cat([edges, counts.to(dtype), nonfinite.to(dtype).reshape(1)])
