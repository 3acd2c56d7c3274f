"""Pure tensor reductions of a ``PreparedTensor``, computed on its device without a host sync.

On an accelerator (``prepared.all_finite is None``) nothing here calls ``.item()`` or ``.cpu()``,
branches on a tensor's value, indexes with a boolean mask, calls an op that reads its input on
the host (``bincount``, ``nonzero``), or builds a tensor from host data: each of those would make
the host wait for the device. On the CPU, where reading a value is free, all-finite tensors skip
the masking work and some statistics are computed by numpy or in Python floats.

Large tensors are processed in chunks of ``chunk_size`` elements, so the extra memory a reduction
needs is about one chunk's worth of working-dtype temporaries, whatever the tensor's size.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from torchinstruments_core.reducers._edges import histogram_edges
from torchinstruments_core.reducers.base import CHUNK_SIZE

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from torchinstruments_core.reducers.base import PreparedTensor

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

DEFAULT_SAMPLE_SIZE = 32768
"""Entries sorted per tensor for quantiles: rank error below 0.015 with probability 1 - 7.9e-7."""


class _Partial(NamedTuple):
    """Count, mean and sum of squared deviations of a chunk's finite entries; mean 0 if none."""

    size: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor


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


_SQUARES_BLOCK = 2**17
"""Entries per dot product in ``_sum_of_squares``: float32 accumulation stays within ~1e-7."""

_CONDITIONING = 4.0
"""``sum(x**2) - n * mean**2`` is used for the variance only where ``mean**2 <= 4 * variance``."""


def _sum_of_squares(chunk: torch.Tensor) -> float:
    """The sum of squares of a CPU tensor, in float64, from blocked BLAS dot products.

    One dot product over millions of float32 entries loses ~1e-5 to its float32 accumulators;
    blocks of ``_SQUARES_BLOCK`` keep each partial accurate and add them in float64.
    """
    total = 0.0
    for start in range(0, chunk.numel(), _SQUARES_BLOCK):
        block = chunk[start : start + _SQUARES_BLOCK]
        total += torch.dot(block, block).item()
    return total


def _host_moments(prepared: PreparedTensor, chunk_size: int) -> torch.Tensor | None:
    """``moments`` of an all-finite CPU tensor, in Python floats; ``None`` if its sum overflowed.

    ``M2 = sum(x**2) - sum(x) * mean`` costs one fast blocked dot product instead of a pass that
    writes the deviations and two that read them, and is accurate to ~1e-6 where the mean is not
    large against the spread; elsewhere (``mean**2 > 4 * variance``) the squared deviations
    from the mean are summed chunk by chunk. The eight values become one tensor at the end
    instead of passing through a dozen scalar kernels.
    """
    count = prepared.numel
    total = float(prepared.total)
    if not math.isfinite(total):
        return None
    mean = total / count
    m2 = _sum_of_squares(prepared.values) - total * mean
    if not (math.isfinite(m2) and m2 > 0.0 and mean * mean * count <= _CONDITIONING * m2):
        # shift by the mean rounded to the working dtype, then correct for the rounding
        shift = float(torch.tensor(mean, dtype=prepared.values.dtype))
        squares = sum(
            float((chunk - shift).square_().sum()) for chunk, _ in _chunks(prepared, chunk_size)
        )
        m2 = max(squares - count * (mean - shift) ** 2, 0.0)
    zeros = sum(_zero_count(chunk) for chunk, _ in _chunks(prepared, chunk_size))
    lo, hi = (float(bound) for bound in prepared.finite_range)
    variance = m2 / count
    values = [
        mean,
        math.sqrt(variance),
        lo,
        hi,
        zeros / count,
        0.0,
        math.sqrt(variance + mean * mean),
        max(abs(lo), abs(hi)),
    ]
    return torch.tensor(values, dtype=prepared.values.dtype)


def _chunk_partial(chunk: torch.Tensor, mask: torch.Tensor | None) -> _Partial:
    """First pass: count and mean; second: the sum of squared deviations."""
    if mask is None:
        count = torch.full((), chunk.numel(), dtype=torch.int64, device=chunk.device)
        mean = chunk.sum() / chunk.numel()
        deviations = chunk - mean
    else:
        count = torch.count_nonzero(mask)
        # clamp keeps an empty chunk at mean 0 instead of NaN, so the combination can skip it
        mean = torch.where(mask, chunk, 0).sum() / count.clamp(min=1)
        # non-finite entries take the mean's place: a zero deviation
        deviations = torch.where(mask, chunk, mean).sub_(mean)
    return _Partial(count, mean, deviations.square_().sum())


def _combine(partials: Sequence[_Partial]) -> _Partial:
    """Chan et al.'s parallel formula over all chunks at once; mean and m2 are NaN when empty.

    ``M2 = sum(M2_i) + sum(n_i * (mean_i - mean)**2)``; a single chunk passes through exactly
    (its weight is ``n / n == 1``).
    """
    if len(partials) == 1:
        size, mean, m2 = partials[0]
        present = size > 0
        return _Partial(size, torch.where(present, mean, math.nan), m2)
    counts, means, m2s = (torch.stack(column) for column in zip(*partials, strict=True))
    total = counts.sum()
    present = total > 0
    sizes = counts.to(means.dtype)
    mean = (sizes / total.clamp(min=1).to(means.dtype) * means).sum()
    m2 = m2s.sum() + (sizes * (means - mean).square()).sum()
    return _Partial(total, torch.where(present, mean, math.nan), torch.where(present, m2, math.nan))


def _zero_count(chunk: torch.Tensor) -> torch.Tensor | int:
    """How many entries equal zero (NaN does not)."""
    if chunk.device.type == "cpu":
        # numpy compares and counts with SIMD; torch.count_nonzero branches on every entry on the
        # CPU and is 3 to 20 times slower, the most where zeros and nonzeros mix (ReLU, dropout)
        return int(np.count_nonzero(chunk.numpy() == 0))
    # count_nonzero needs no temporary, and counts NaN as nonzero as it should
    return chunk.numel() - torch.count_nonzero(chunk)


def moments(prepared: PreparedTensor, *, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Scale and range statistics of the finite entries, and the zero and non-finite fractions.

    The variance is computed per chunk in two passes (mean, then squared deviations) and the
    chunks are combined with Chan et al.'s parallel formula, so it stays accurate when the mean is
    large against the spread. Counts are int64 and only become floating point in the last division.
    On the CPU an all-finite tensor (the common case, known from its sum) skips every mask, and
    where the mean is not large against the spread the squared deviations come from one blocked
    dot product: four fast passes (sum, min and max, squares, zeros) in all.

    Args:
        prepared: The tensor to reduce.
        chunk_size: Elements per chunk; it bounds the temporary memory.

    Returns:
        A tensor of ``len(MOMENT_METRICS)`` values in the working dtype, in the order of
        ``MOMENT_METRICS``: mean, population std, min, max, zero_fraction, nonfinite_fraction,
        rms, max_abs. The fractions are over all entries (NaN is not a zero); the rest are over the
        finite entries, and NaN when there are none.
    """
    if prepared.all_finite:  # only ever true on the CPU
        host = _host_moments(prepared, chunk_size)
        if host is not None:
            return host
    dtype = prepared.values.dtype
    partials: list[_Partial] = []
    zeros = torch.zeros((), dtype=torch.int64, device=prepared.device)
    for chunk, mask in _chunks(prepared, chunk_size):
        partials.append(_chunk_partial(chunk, mask))
        zeros += _zero_count(chunk)
    size, mean, m2 = _combine(partials)
    variance = m2 / size.to(dtype)
    present = size > 0
    lo, hi = (torch.where(present, bound, math.nan) for bound in prepared.finite_range)
    return torch.stack(
        [
            mean,
            variance.sqrt(),
            lo,
            hi,
            zeros.to(dtype) / prepared.numel,
            (prepared.numel - prepared.n_finite).to(dtype) / prepared.numel,
            (variance + mean.square()).sqrt(),
            torch.maximum(lo.abs(), hi.abs()),
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
    sample = prepared.values.index_select(0, prepared.random_index(sample_size))
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
    sample_size: int = DEFAULT_SAMPLE_SIZE,
    exact: bool = False,
) -> torch.Tensor:
    """Quantiles of the finite entries, with numpy's default (``linear``) interpolation.

    Tensors of more than ``sample_size`` entries are subsampled uniformly with replacement, using
    ``prepared.generator`` (never the global random state). Error bound: with ``m`` finite values
    in the subsample, the Dvoretzky-Kiefer-Wolfowitz inequality gives that the returned
    ``q``-quantile lies between the true ``(q - eps)`` and ``(q + eps)`` quantiles (give or take
    the ``1/m`` in rank of one interpolation step) with probability at least
    ``1 - 2 * exp(-2 * m * eps**2)``, for all levels at once. For the default ``m = 32768`` and
    ``eps = 0.015`` that is ``1 - 2 * exp(-14.7456) = 1 - 7.9e-7``; for ``eps = 0.01``,
    ``1 - 2.85e-3``. The typical rank error of a quartile is ``sqrt(q * (1 - q) / m)``, 0.0024.

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
    if mask is None and prepared.all_finite:  # only ever true on the CPU
        return _host_quantiles(_sort(sample), qs)
    if mask is None:
        n_finite = torch.full((), sample.numel(), dtype=torch.int64, device=sample.device)
        keyed = sample
    else:
        n_finite = torch.count_nonzero(mask)
        keyed = torch.where(mask, sample, math.inf)
    return _interpolate(_sort(keyed), n_finite, qs)


def _host_quantiles(ordered: torch.Tensor, qs: Sequence[float]) -> torch.Tensor:
    """``_interpolate`` of a sorted, all-finite CPU tensor, with the positions in Python.

    The same floats as ``_interpolate`` (float64 positions, the lerp in the working dtype),
    without its dozen small kernels per tensor.
    """
    values = ordered.numpy()
    last = values.size - 1
    result = []
    for q in qs:
        position = last * q
        below = min(math.floor(position), last)
        gamma = values.dtype.type(position - below)
        low, high = values[below], values[min(below + 1, last)]
        span = high - low
        result.append(high - span * (1 - gamma) if gamma >= 0.5 else low + span * gamma)
    return torch.tensor(result, dtype=ordered.dtype)


def _sort(values: torch.Tensor) -> torch.Tensor:
    """Ascending sort; on the CPU through numpy, whose vectorized sort is 20-30x faster."""
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.sort(values.contiguous().numpy()))
    return torch.sort(values).values


class _Grid(NamedTuple):
    """The bins over ``[lo, hi]``: an entry ``x`` goes to bin ``offset(x)`` truncated.

    The offset is ``(x * 0.5 - lo * 0.5) * scale``: halves cannot overflow where ``hi - lo``
    would, and close values subtract exactly. The top value ``bins`` (reached only by the max,
    up to rounding) joins the last bin. Each rounded operation is non-decreasing, so the bin is
    too, and ``_edges.histogram_edges`` finds the first float of each bin from ``lo``, ``hi`` and
    ``scale`` alone. Every device runs the same operations, so CPU and CUDA give the same bins.
    """

    lo: torch.Tensor
    hi: torch.Tensor
    half_lo: torch.Tensor
    scale: torch.Tensor
    bins: int

    def offset(self, values: torch.Tensor) -> torch.Tensor:
        """A float in ``[0, bins]`` for finite entries, whose integer part is the bin."""
        return torch.mul(values, 0.5).sub_(self.half_lo).mul_(self.scale)


def _grid(lo: torch.Tensor, hi: torch.Tensor, bins: int) -> _Grid:
    """The grid over ``[lo, hi]``, widened when too narrow for ``bins`` bins of finite width."""
    finfo = torch.finfo(lo.dtype)
    # a constant tensor, or a range so small that bins / span would overflow: widen by 0.5 as
    # documented, or by one relative epsilon where |v| is too large for 0.5 to change v
    narrow = (hi - lo) < 4 * bins / finfo.max
    width = torch.maximum(lo.abs(), hi.abs()) * finfo.eps
    pad = torch.where(narrow, width.clamp(min=0.5), 0)
    low, high = lo - pad, hi + pad
    # at the ends of the float range, widen inward instead of overflowing
    lo, hi = (
        torch.where(high.isinf(), lo - 2 * pad, torch.where(low.isinf(), lo, low)),
        torch.where(high.isinf(), hi, torch.where(low.isinf(), hi + 2 * pad, high)),
    )
    half_lo = lo * 0.5
    return _Grid(lo, hi, half_lo, bins / (hi * 0.5 - half_lo), bins)


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
    if index.device.type == "cpu":
        return torch.bincount(index, minlength=n_buckets)  # int32 input: 40 % over index_add_
    if index.is_cuda and torch.are_deterministic_algorithms_enabled():
        return count_sorted(index, n_buckets)
    # bincount reads the index's min and max on the host there: a device sync
    counts = torch.zeros(n_buckets, dtype=torch.int64, device=index.device)
    ones = torch.ones((), dtype=torch.int64, device=index.device).expand(index.numel())
    return counts.index_add_(0, index, ones)


def _bucket_index(chunk: torch.Tensor, mask: torch.Tensor | None, grid: _Grid) -> torch.Tensor:
    """The int32 bucket of each entry: its bin, or ``bins`` for the max (folded later).

    With a mask, bucket 0 holds the non-finite entries and bin ``i`` is bucket ``i + 1``.
    """
    offsets = grid.offset(chunk)
    if mask is None:
        return offsets.to(torch.int32)
    return offsets.masked_fill_(mask.logical_not(), -1).to(torch.int32).add_(1)


def _bin_counts(prepared: PreparedTensor, grid: _Grid, chunk_size: int) -> torch.Tensor:
    """The int64 counts of the finite entries in each bin of the grid."""
    masked = int(not prepared.all_finite)
    buckets = masked + grid.bins + 1
    counts = torch.zeros(buckets, dtype=torch.int64, device=prepared.device)
    for chunk, mask in _chunks(prepared, chunk_size):
        counts += _count(_bucket_index(chunk, mask, grid), buckets)
    # with a mask, bucket 0 collected the non-finite entries; the top bucket joins the last bin
    counts = counts[masked:]
    return torch.cat([counts[:-2], (counts[-2] + counts[-1]).reshape(1)])


def histogram_counts(
    prepared: PreparedTensor, bins: int = 64, *, chunk_size: int = HISTOGRAM_CHUNK_SIZE
) -> torch.Tensor:
    """A ``bins``-bin histogram of the finite entries over their ``[min, max]``, without edges.

    Everything that touches the data, on its device without a host sync; ``histogram_edges``
    turns the first three values into the edges on the host. An entry's bin is
    ``(x - min) * bins / (max - min)`` truncated (computed as ``(x/2 - min/2) * scale``), with no
    comparison to an edge. A constant tensor gets the range ``[v - 0.5, v + 0.5]`` (wider where
    ``v +- 0.5`` would round to ``v``; inward at the ends of the float range), and so does a
    range too narrow for bins of finite width. Counts are exact int64 until packed into the
    working dtype (exact up to 2**24 per bin in float32). On the CPU an all-finite tensor is
    binned without a mask.

    Args:
        prepared: The tensor to reduce.
        bins: Number of bins.
        chunk_size: Elements per chunk; it bounds the temporary memory.

    Returns:
        A tensor of ``bins + 4`` values in the working dtype: the grid's ``lo``, ``hi`` and
        ``scale`` (NaN when there is no finite entry), ``bins`` counts, then the number of
        non-finite entries.

    Raises:
        ValueError: If ``bins`` is not positive.
    """
    if bins < 1:
        raise ValueError(f"bins must be a positive int, got {bins!r}")
    dtype = prepared.values.dtype
    grid = _grid(*prepared.finite_range, bins)
    counts = _bin_counts(prepared, grid, chunk_size)
    present = prepared.n_finite > 0
    parameters = torch.where(present, torch.stack([grid.lo, grid.hi, grid.scale]), math.nan)
    nonfinite = prepared.numel - prepared.n_finite
    return torch.cat([parameters, counts.to(dtype), nonfinite.to(dtype).reshape(1)])


def split_histogram(
    packed: Sequence[float], bins: int, *, float64: bool = False
) -> tuple[list[float], list[float], float]:
    """The edges, counts and non-finite count of a ``histogram_counts`` result read on the host.

    Args:
        packed: The ``bins + 4`` values, as host floats.
        bins: Number of bins.
        float64: Whether the histogram was computed in float64 (float64 input).
    """
    lo, hi, scale = packed[0], packed[1], packed[2]
    edges = histogram_edges(lo, hi, scale, bins, float64=float64)
    return edges, list(packed[3 : 3 + bins]), packed[3 + bins]


def histogram(
    prepared: PreparedTensor, bins: int = 64, *, chunk_size: int = HISTOGRAM_CHUNK_SIZE
) -> torch.Tensor:
    """A ``bins``-bin histogram of the finite entries over their ``[min, max]``, packed flat.

    ``histogram_counts`` with the edges filled in: bins are half-open ``[e_i, e_i+1)`` except the
    last, which includes the max, so the counts equal ``numpy.histogram(x, bins=edges)`` exactly.
    The edges are even up to rounding: each inner edge is the first float that the binning puts
    in its bin (a bisection over the floats for all edges at once, not over the data).

    This reads the grid's three numbers on the host, which waits for an accelerator; the engine
    runs ``histogram_counts`` on the device instead and finds the edges after the sample's
    single transfer.

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
    packed = histogram_counts(prepared, bins, chunk_size=chunk_size)
    float64 = packed.dtype == torch.float64
    lo, hi, scale = packed[:3].tolist()
    edges = histogram_edges(lo, hi, scale, bins, float64=float64)
    edge_tensor = torch.tensor(edges, dtype=packed.dtype, device=packed.device)
    return torch.cat([edge_tensor, packed[3:]])
