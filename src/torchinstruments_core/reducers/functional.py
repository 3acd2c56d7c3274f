"""Pure tensor reductions of a ``PreparedTensor``, computed on its device without a host sync.

On an accelerator (``prepared.all_finite is None``) nothing here calls ``.item()`` or ``.cpu()``,
branches on a tensor's value, indexes with a boolean mask, calls an op that reads its input on
the host (``bincount``, ``nonzero``), or builds a tensor from host data: each of those would make
the host wait for the device. On the CPU, where reading a value is free, all-finite tensors skip
the masking work and some statistics are computed by numpy or in Python floats.

Large tensors are processed in chunks of ``chunk_size`` elements, so the extra memory a reduction
needs is about one chunk's worth of working-dtype temporaries, whatever the tensor's size.
Quantiles come from a uniform subsample of a fixed size (``DEFAULT_SAMPLE_SIZE``, 8,192
entries; tensors up to that size whole), the same operations on the CPU and on an accelerator,
so their cost does not grow with the tensor and their error bound is one number.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from torchinstruments_core.reducers import _native
from torchinstruments_core.reducers._binning import (
    HISTOGRAM_CHUNK_SIZE,
    count_sorted,
    histogram,
    histogram_counts,
    split_histogram,
)
from torchinstruments_core.reducers._host import host_values
from torchinstruments_core.reducers._scaling import power_of_two_scale, squares_are_safe
from torchinstruments_core.reducers._select import order_statistics
from torchinstruments_core.reducers.base import CHUNK_SIZE

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from numpy.typing import NDArray

    from torchinstruments_core.reducers._host import HostSummary
    from torchinstruments_core.reducers.base import PreparedTensor

MOMENT_METRICS = (
    "mean",
    "std",
    "min",
    "max",
    "zero_fraction",
    "nonfinite_fraction",
    "rms",
    "max_abs",
    "l2_norm",
)
"""Names of the values ``moments`` returns, in order."""

DEFAULT_QUANTILES = (0.25, 0.5, 0.75)

DEFAULT_SAMPLE_SIZE = 8192
"""Subsample per tensor for quantiles (a tensor of at most this many entries is used whole):
rank error below 0.030 with probability 1 - 7.9e-7, typically 0.0048 for a quartile. On the CPU
its quartiles take one vectorized sort (``_select``), about 0.1 ms."""


def subsample_size(numel: int, sample_size: int = DEFAULT_SAMPLE_SIZE) -> int:
    """Entries drawn for the quantiles of a tensor of ``numel`` entries (``numel``: all of them).

    A tensor of at most ``sample_size`` entries is used whole; a larger one, whatever its size,
    is subsampled to ``sample_size`` entries (8,192 by default), on every device alike.
    """
    return min(numel, sample_size)


class _Partial(NamedTuple):
    """Count, mean and sum of squared deviations of a chunk's finite entries; mean 0 if none."""

    size: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor


_CONDITIONING = 4.0
"""``sum(x**2) - n * mean**2`` is used for the variance only where ``mean**2 <= 4 * variance``."""


def _host_moments(prepared: PreparedTensor, chunk_size: int) -> torch.Tensor | None:
    """``moments`` of a CPU tensor from its ``host_summary``; ``None`` without one.

    ``M2 = sum(x**2) - sum(x) * mean`` comes free with the summary's blocked dot products
    instead of a pass that writes the deviations and two that read them, and is accurate to
    ~1e-6 where the mean is not large against the spread; elsewhere (``mean**2 > 4 *
    variance``) the squared deviations from the mean are summed chunk by chunk. The values
    become one tensor at the end instead of passing through a dozen scalar kernels. ``None``
    too where the entries are so large or so small that their squares need scaling
    (``_scaling.squares_are_safe``): ``moments`` then scales them.
    """
    summary = prepared.host_summary
    if summary is None:
        return None
    values = host_moment_values(
        summary,
        prepared.numel,
        prepared.values.dtype,
        lambda shift: shifted_squares(prepared, shift, chunk_size),
    )
    return None if values is None else host_values(values, prepared.values.dtype)


def host_moment_values(
    summary: HostSummary,
    count: int,
    dtype: torch.dtype,
    shifted_squares: Callable[[float], float],
) -> list[float] | None:
    """``moments``' nine values from a CPU tensor's one-pass summary, as Python floats.

    ``None`` where the entries are so large or so small that their squares need scaling
    (``_scaling.squares_are_safe``); where the kernels squared and summed each entry in
    float64 (``HostSummary.float64``), a float32 tensor's tiny entries need none.
    ``shifted_squares(shift)`` is the sum of the squared entries minus ``shift`` (a second
    pass, for a mean large against the spread).

    Args:
        summary: The tensor's ``HostSummary``.
        count: Its entries.
        dtype: Its working dtype.
        shifted_squares: The second pass, called only where the first does not suffice.
    """
    lo, hi = summary.lo, summary.hi
    max_abs = max(abs(lo), abs(hi))
    if not squares_are_safe(max_abs, count, dtype, float64_sums=summary.float64):
        return None
    mean = summary.total / count
    m2 = summary.squares - summary.total * mean
    if not (math.isfinite(m2) and m2 > 0.0 and mean * mean * count <= _CONDITIONING * m2):
        # shift by the mean rounded to the working dtype, then correct for the rounding
        shift = float(_NUMPY_FLOATS[dtype](mean))
        # a product, not ``**``: libm's pow may round otherwise, and the kernels multiply
        m2 = max(shifted_squares(shift) - count * ((mean - shift) * (mean - shift)), 0.0)
    variance = m2 / count
    return [
        mean,
        math.sqrt(variance),
        lo,
        hi,
        summary.zeros / count,
        0.0,
        math.sqrt(variance + mean * mean),
        max_abs,
        math.sqrt(summary.squares),  # squares_are_safe bounds the sum of squares
    ]


def shifted_squares(prepared: PreparedTensor, shift: float, chunk_size: int) -> float:
    """The sum of ``(x - shift)**2`` over the entries.

    In float64 in one pass of the kernels where they read the tensor (``_native
    .shifted_squares``: the loop their ``profile`` runs, so a kernel call and the reducers give
    the same moments); otherwise chunk by chunk, each chunk's sum in float.
    """
    if _native.usable(prepared.values):
        return _native.shifted_squares(prepared.values, shift)
    return sum(float((chunk - shift).square_().sum()) for chunk, _ in prepared.chunks(chunk_size))


def _chunk_partial(chunk: torch.Tensor, mask: torch.Tensor | None, scale: torch.Tensor) -> _Partial:
    """Count, then mean and sum of squared deviations of the entries times ``scale``.

    The scaled copy doubles as the deviations' buffer: one temporary per chunk.
    """
    if mask is None:
        count = torch.full((), chunk.numel(), dtype=torch.int64, device=chunk.device)
        scaled = chunk * scale
        mean = scaled.sum() / chunk.numel()
        deviations = scaled.sub_(mean)
    else:
        count = torch.count_nonzero(mask)
        scaled = torch.where(mask, chunk, 0).mul_(scale)
        # clamp keeps an empty chunk at mean 0 instead of NaN, so the combination can skip it
        mean = scaled.sum() / count.clamp(min=1)
        # non-finite entries (held as 0) get a zero deviation
        deviations = scaled.sub_(mean).mul_(mask)
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
    if chunk.device.type == "cpu":  # see _host.summarize: numpy's compare and count are SIMD
        return int(np.count_nonzero(chunk.numpy() == 0))
    # count_nonzero needs no temporary, and counts NaN as nonzero as it should
    return chunk.numel() - torch.count_nonzero(chunk)


def moments(prepared: PreparedTensor, *, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Scale and range statistics of the finite entries, and the zero and non-finite fractions.

    Every tensor with a finite entry gets finite statistics, however large or small its
    entries (float32 near 3.4e38 or 1e-45, float64 near 1.8e308): the sums run on the entries
    times a power of two that brings the largest magnitude into ``[1, 2)`` (exact, computed on
    the device from the bits of ``max_abs``), and the results are divided by it. The variance is
    computed per chunk in two passes (mean, then squared deviations) and the chunks are combined
    with Chan et al.'s parallel formula, so it stays accurate when the mean is large against the
    spread. Counts are int64 and only become floating point in the last division. On the CPU an
    all-finite tensor of ordinary magnitude (the common case, known from its sums) skips every
    mask and the scaling, and where the mean is not large against the spread the squared
    deviations come from blocked dot products: everything from one pass, block by block
    (``PreparedTensor.host_summary``).

    Args:
        prepared: The tensor to reduce.
        chunk_size: Elements per chunk; it bounds the temporary memory.

    Returns:
        A tensor of ``len(MOMENT_METRICS)`` values in the working dtype, in the order of
        ``MOMENT_METRICS``: mean, population std, min, max, zero_fraction, nonfinite_fraction,
        rms, max_abs, l2_norm. The fractions are over all entries (NaN is not a zero); the rest
        are over the finite entries, and NaN when there are none. ``l2_norm`` is
        ``sqrt(sum(x**2))`` of the finite entries (what ``torch.nn.utils.clip_grad_norm_``
        reports for one tensor), from the same partial sums as ``rms``: no extra pass. It is
        infinite only where the true norm exceeds the working dtype's largest float (float32:
        3.4e38), as ``torch.linalg.vector_norm``'s is.

    Raises:
        ValueError: If ``chunk_size`` is not positive.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if prepared.all_finite:  # only ever true on the CPU
        host = _host_moments(prepared, chunk_size)
        if host is not None:
            return host
    dtype = prepared.values.dtype
    lo, hi = prepared.finite_range
    max_abs = torch.maximum(lo.abs(), hi.abs())  # inf when there is no finite entry
    scale = power_of_two_scale(max_abs)
    partials: list[_Partial] = []
    zeros = torch.zeros((), dtype=torch.int64, device=prepared.device)
    for chunk, mask in prepared.chunks(chunk_size):
        partials.append(_chunk_partial(chunk, mask, scale))
        zeros += _zero_count(chunk)
    size, mean, m2 = _combine(partials)
    # in the scaled domain |mean| <= max_abs and std, rms <= max_abs: rounding must not push
    # a result past the largest entry (or past the largest float, once divided by scale)
    bound = max_abs * scale
    mean = torch.minimum(torch.maximum(mean, lo * scale), hi * scale)
    variance = m2 / size.to(dtype)
    # sum(x**2) = M2 + n * mean**2, in the scaled domain where it cannot overflow; between
    # max_abs and sqrt(n) * max_abs, and only the division by scale can pass the largest float
    l2_norm = (m2 + size.to(dtype) * mean.square()).sqrt()
    l2_norm = torch.minimum(torch.maximum(l2_norm, bound), bound * size.to(dtype).sqrt())
    present = size > 0
    lo, hi, max_abs = (torch.where(present, value, math.nan) for value in (lo, hi, max_abs))
    return torch.stack(
        [
            mean / scale,
            torch.minimum(variance.sqrt(), bound) / scale,
            lo,
            hi,
            zeros.to(dtype) / prepared.numel,
            (prepared.numel - prepared.n_finite).to(dtype) / prepared.numel,
            torch.minimum((variance + mean.square()).sqrt(), bound) / scale,
            max_abs,
            l2_norm / scale,
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
    size = subsample_size(prepared.numel, sample_size)
    if exact or size == prepared.numel:
        return prepared.values, None if prepared.all_finite else prepared.finite
    sample = prepared.values.index_select(0, prepared.random_index(size))
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
    # where the span overflows (ends of opposite sign near the largest float), lerp in halves
    result = torch.where(span.isfinite(), result, _halved_lerp(low, high, gamma))
    return torch.where(n_finite > 0, result, math.nan)


def _halved_lerp(low: torch.Tensor, high: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``low + (high - low) * gamma`` on halves, which cannot overflow; exact doubling back."""
    half_low, half_high = low * 0.5, high * 0.5
    half = half_low + (half_high - half_low) * gamma
    return torch.minimum(torch.maximum(half, half_low), half_high) * 2


def quantiles(
    prepared: PreparedTensor,
    qs: Sequence[float] = DEFAULT_QUANTILES,
    *,
    sample_size: int = DEFAULT_SAMPLE_SIZE,
    exact: bool = False,
) -> torch.Tensor:
    """Quantiles of the finite entries, with numpy's default (``linear``) interpolation.

    Tensors of more than ``sample_size`` entries are subsampled uniformly with replacement, using
    ``prepared.generator`` (never the global random state), to ``m = sample_size`` entries (8,192
    by default, whatever the tensor's size; ``subsample_size``); smaller tensors are used whole,
    so their quantiles are exact. Error bound: with ``m`` finite values in the subsample, the
    Dvoretzky-Kiefer-Wolfowitz inequality gives that the returned ``q``-quantile lies between the
    true ``(q - eps)`` and ``(q + eps)`` quantiles (give or take the ``1/m`` in rank of one
    interpolation step) with probability at least ``1 - 2 * exp(-2 * m * eps**2)``, for all
    levels at once: ``eps = sqrt(14.7456 / (2 * m))`` for ``1 - 7.9e-7``, which for the default
    ``m = 8192`` is ``eps = 0.030``. The typical rank error of a quartile is
    ``sqrt(q * (1 - q) / m)``: 0.0048 (0.0055 for the median). A larger ``sample_size`` narrows
    both as ``1 / sqrt(m)`` (``m = 32768``: 0.015 and 0.0024) at the cost of a slower selection.

    Unlike ``torch.quantile`` there is no size limit: non-finite entries are keyed to ``+inf``
    and sorted last, and the interpolation positions come from the on-device finite count.

    Args:
        prepared: The tensor to reduce.
        qs: Quantile levels in [0, 1].
        sample_size: Subsample size; tensors of at most this many entries are used whole, larger
            ones are subsampled to it (see above).
        exact: Sort every entry whatever the size (memory and time grow with the tensor).

    Returns:
        A tensor of ``len(qs)`` values in the working dtype, NaN when the (sub)sample holds no
        finite value.

    Raises:
        ValueError: If a level is outside [0, 1] or ``sample_size`` is not positive.
    """
    _check_quantile_args(qs, sample_size)
    if prepared.all_finite and _native.usable(prepared.values):  # only ever true on the CPU
        return _native_quantiles(prepared, qs, sample_size, exact)
    sample, mask = _quantile_sample(prepared, sample_size, exact)
    if mask is None and prepared.all_finite:  # only ever true on the CPU
        return _host_quantiles(sample, qs)
    if mask is None:
        n_finite = torch.full((), sample.numel(), dtype=torch.int64, device=sample.device)
        keyed = sample
    else:
        n_finite = torch.count_nonzero(mask)
        keyed = torch.where(mask, sample, math.inf)
    return _interpolate(_sort(keyed), n_finite, qs)


def _native_quantiles(
    prepared: PreparedTensor, qs: Sequence[float], sample_size: int, exact: bool
) -> torch.Tensor:
    """``_host_quantiles`` of the same subsample, selected by the compiled kernels in place.

    The subsample's entries are read at their positions (no gathered copy in torch) and the
    wanted order statistics selected in C: the same entries, so the same quartiles.
    """
    size = prepared.numel if exact else subsample_size(prepared.numel, sample_size)
    index = None if size == prepared.numel else prepared.random_index(size)
    plan = quantile_plan(size, tuple(qs))
    ordered = _native.order_statistics(prepared.values, index, size, plan.ranks)
    return host_values(plan.interpolate(ordered, prepared.values.dtype), prepared.values.dtype)


class QuantilePlan(NamedTuple):
    """Where numpy's ``linear`` quantiles of a sorted ``size``-entry sample read it.

    ``ranks`` are the sorted entries needed (ascending, each once); each level interpolates
    between two of them with a weight computed once.
    """

    ranks: NDArray[np.int64]
    levels: tuple[tuple[float, int, int], ...]
    """Per level: the weight ``gamma``, the positions in ``ranks`` of its low and high entry."""
    table: NDArray[np.float64]
    """``levels`` flat, as float64 (three a level), for the compiled kernels (``_native``)."""

    def interpolate(self, ordered: Sequence[float], dtype: torch.dtype) -> list[float]:
        """The quantiles from the entries at ``ranks``, lerped in the working dtype.

        The same float operations as ``_interpolate`` on the sorted tensor: float64 positions,
        numpy's two-sided lerp in the working dtype, halves where the span overflows.
        """
        float_type = _NUMPY_FLOATS[dtype]
        result = []
        with np.errstate(over="ignore"):  # an overflowing span is handled below
            for gamma_value, low_at, high_at in self.levels:
                gamma = float_type(gamma_value)
                low, high = float_type(ordered[low_at]), float_type(ordered[high_at])
                span = high - low
                if not np.isfinite(span):
                    half_low, half_high = low * float_type(0.5), high * float_type(0.5)
                    half = min(max(half_low + (half_high - half_low) * gamma, half_low), half_high)
                    result.append(float(half * 2))
                elif gamma >= 0.5:
                    result.append(float(high - span * (1 - gamma)))
                else:
                    result.append(float(low + span * gamma))
        return result


_NUMPY_FLOATS: dict[torch.dtype, type[np.floating]] = {
    torch.float32: np.float32,
    torch.float64: np.float64,
}


@functools.lru_cache(maxsize=256)
def quantile_plan(size: int, qs: Sequence[float]) -> QuantilePlan:
    """The ``QuantilePlan`` of levels ``qs`` over a sorted sample of ``size`` entries."""
    last = size - 1
    positions = [last * q for q in qs]
    belows = [min(math.floor(position), last) for position in positions]
    ranks = sorted({*belows, *(min(below + 1, last) for below in belows)})
    at = {rank: place for place, rank in enumerate(ranks)}
    levels = tuple(
        (position - below, at[below], at[min(below + 1, last)])
        for position, below in zip(positions, belows, strict=True)
    )
    table = np.array([value for level in levels for value in level], dtype=np.float64)
    return QuantilePlan(np.array(ranks, dtype=np.int64), levels, table)


def _host_quantiles(sample: torch.Tensor, qs: Sequence[float]) -> torch.Tensor:
    """``_interpolate`` of an all-finite CPU tensor, with the positions in Python.

    The same floats as ``_interpolate`` of the sorted tensor (float64 positions, the lerp in the
    working dtype), without its dozen small kernels per tensor: only the two entries around each
    position are read, from numpy's sort of the subsample or, past 18,432 entries, a selection
    that never sorts it whole (``_select.order_statistics``).
    """
    values = (sample if sample.is_contiguous() else sample.contiguous()).numpy()
    plan = quantile_plan(values.size, tuple(qs))
    found = order_statistics(values, plan.ranks.tolist())
    ordered = [found[rank] for rank in plan.ranks.tolist()]
    return host_values(plan.interpolate(ordered, sample.dtype), sample.dtype)


def _sort(values: torch.Tensor) -> torch.Tensor:
    """Ascending sort; on the CPU through numpy, whose vectorized sort is 20-30x faster."""
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.sort(values.contiguous().numpy()))
    return torch.sort(values).values


__all__ = [
    "DEFAULT_QUANTILES",
    "DEFAULT_SAMPLE_SIZE",
    "HISTOGRAM_CHUNK_SIZE",
    "MOMENT_METRICS",
    "count_sorted",
    "histogram",
    "histogram_counts",
    "moments",
    "quantiles",
    "split_histogram",
    "subsample_size",
]
