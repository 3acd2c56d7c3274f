"""Histograms on the tensor's device: the bins of every entry counted, edges left to the host.

An entry's bin comes from arithmetic on the entry alone, never from comparing it to an edge; the
edges are the thresholds of that arithmetic, which ``_edges.histogram_edges`` finds from the
grid's three numbers after the sample's transfer. Nothing here makes the host wait for an
accelerator except ``histogram``, which fills in the edges for direct use.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from torchinstruments_core.reducers._edges import histogram_edges, histograms_edges
from torchinstruments_core.reducers._host import HOST_BLOCK
from torchinstruments_core.reducers._host_binning import host_histogram_counts
from torchinstruments_core.reducers.base import CHUNK_SIZE

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torchinstruments_core.reducers.base import PreparedTensor

HISTOGRAM_CHUNK_SIZE = CHUNK_SIZE // 4
"""Binning holds two chunk-sized buffers (offsets and bins) and, with a mask, the mask's inverse:
with chunks a quarter as long its temporaries stay within those of the other reductions. On the
CPU the chunks are ``HOST_BLOCK`` entries, to stay in the L2 cache."""


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

    def offset(self, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Into ``out``: a float in ``[0, bins]`` per finite entry, its integer part the bin."""
        return torch.mul(values, 0.5, out=out).sub_(self.half_lo).mul_(self.scale)


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


class _Scratch(NamedTuple):
    """Buffers reused by every chunk of a tensor: no fresh pages to fault in per chunk."""

    offsets: torch.Tensor
    buckets: torch.Tensor


def _bucket_index(
    chunk: torch.Tensor, mask: torch.Tensor | None, grid: _Grid, scratch: _Scratch
) -> torch.Tensor:
    """The int32 bucket of each entry: its bin, or ``bins`` for the max (folded later).

    With a mask, bucket 0 holds the non-finite entries and bin ``i`` is bucket ``i + 1``.
    """
    size = chunk.numel()
    offsets = grid.offset(chunk, scratch.offsets[:size])
    if mask is not None:
        offsets.masked_fill_(mask.logical_not(), -1)
    index = scratch.buckets[:size]
    index.copy_(offsets)  # truncates toward zero, as .to(torch.int32) does
    return index if mask is None else index.add_(1)


def _bin_counts(prepared: PreparedTensor, grid: _Grid, chunk_size: int) -> torch.Tensor:
    """The int64 counts of the finite entries in each bin of the grid."""
    masked = int(not prepared.all_finite)
    buckets = masked + grid.bins + 1
    device = prepared.device
    counts = torch.zeros(buckets, dtype=torch.int64, device=device)
    if device.type == "cpu":  # blocks that stay in L2 across binning's five passes
        chunk_size = min(chunk_size, HOST_BLOCK)
    size = min(chunk_size, prepared.numel)
    scratch = _Scratch(
        torch.empty(size, dtype=prepared.values.dtype, device=device),
        torch.empty(size, dtype=torch.int32, device=device),
    )
    for chunk, mask in prepared.chunks(chunk_size):
        counts += _count(_bucket_index(chunk, mask, grid, scratch), buckets)
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
    binned without a mask, its grid computed from the host min and max of the statistics pass
    (``_host_binning``: the same operations, the same bits).

    Args:
        prepared: The tensor to reduce.
        bins: Number of bins.
        chunk_size: Elements per chunk; it bounds the temporary memory.

    Returns:
        A tensor of ``bins + 4`` values in the working dtype: the grid's ``lo``, ``hi`` and
        ``scale`` (NaN when there is no finite entry), ``bins`` counts, then the number of
        non-finite entries.

    Raises:
        ValueError: If ``bins`` or ``chunk_size`` is not positive.
    """
    if bins < 1:
        raise ValueError(f"bins must be a positive int, got {bins!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    summary = prepared.host_summary
    if summary is not None:  # all finite on the CPU, min and max already on the host
        return host_histogram_counts(prepared.values, summary.lo, summary.hi, bins, chunk_size)
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
    return split_histograms([(packed, bins, float64)])[0]


def split_histograms(
    histograms: Sequence[tuple[Sequence[float], int, bool]],
) -> list[tuple[list[float], list[float], float]]:
    """``split_histogram`` of each ``(packed, bins, float64)``, the edges searched together.

    Histograms of the same bins and dtype share one search (``_edges.histograms_edges``): a
    sample's histograms cost about a fifth of what they cost one by one.
    """
    groups: dict[tuple[int, bool], list[int]] = {}
    for index, (_, bins, float64) in enumerate(histograms):
        groups.setdefault((bins, float64), []).append(index)
    edges: list[list[float]] = [[] for _ in histograms]
    for (bins, float64), members in groups.items():
        grids = [(histograms[i][0][0], histograms[i][0][1], histograms[i][0][2]) for i in members]
        found = histograms_edges(grids, bins, float64=float64)
        for index, grid_edges in zip(members, found, strict=True):
            edges[index] = grid_edges
    return [
        (edges[index], list(packed[3 : 3 + bins]), packed[3 + bins])
        for index, (packed, bins, _) in enumerate(histograms)
    ]


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
        ValueError: If ``bins`` or ``chunk_size`` is not positive.
    """
    packed = histogram_counts(prepared, bins, chunk_size=chunk_size)
    float64 = packed.dtype == torch.float64
    lo, hi, scale = packed[:3].tolist()
    edges = histogram_edges(lo, hi, scale, bins, float64=float64)
    edge_tensor = torch.tensor(edges, dtype=packed.dtype, device=packed.device)
    return torch.cat([edge_tensor, packed[3:]])
