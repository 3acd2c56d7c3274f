"""Whole-parameter statistics of sharded tensors: partial results per rank, one collective per step.

Under sharded training (FSDP's ``fully_shard``, tensor parallelism) a parameter, its gradient,
its update and its optimizer state are ``DTensor``s whose local tensor is one rank's shard. In a
step record their rows describe the whole tensor:

1. ``partial`` reduces this rank's shard on its device into a fixed-size float64 vector: entry
   count, finite count, zero count, finite min and max, the mean and the sum of squared
   deviations of the finite entries times a power of two (``_scaling``), that power, and a
   subsample of the shard for the quartiles, padded to a size every rank computes alike from
   the global shape (``_slots``).
2. ``ShardedBatch.combine`` concatenates the vectors of all sharded tensors of the step (same
   order on every rank: the same model and optimizer) and runs ONE ``all_gather`` per process
   group (one per step for FSDP), then combines on the device: counts, min, max, zeros and
   non-finite counts exactly, mean and variance with Chan's formula after moving every rank's
   scaled sums to the largest rank's power of two (exact: only exponents change).
3. The quartiles come from the pooled subsamples. Rank ``i`` of ``W`` with ``n_i`` of the ``N``
   entries draws ``k_i = ceil(m * n_i / N)`` of its entries uniformly with replacement (``m``
   the reducer's ``sample_size``); a tensor of at most ``m`` entries sends every entry, so its
   quartiles are exact, as unsharded. Otherwise each pooled entry's indicator is an independent
   term of weight ``1 / K`` (``K = sum(k_i) >= m``), and the strata's weights ``k_i / K`` differ
   from ``n_i / N`` by ``(f_i - F * n_i / N) / K`` (``f_i = k_i - m * n_i / N`` in ``[0, 1)``,
   ``F = K - m`` in ``[0, W)``): the pooled CDF is off the tensor's by at most the sum of the
   positive differences, ``F / K < W / m``. By Hoeffding's inequality each quartile's rank error
   exceeds ``eps + W / m`` with probability at most ``2 * exp(-2 * m * eps**2)``, so all three
   stay within it with probability at least ``1 - 6 * exp(-2 * m * eps**2)``: for the default
   ``m = 8192`` and ``eps = 0.030`` (the unsharded bound), ``1 - 6 * exp(-14.7456) = 1 - 2.4e-6``,
   so within ``0.030 + W / 8192`` (0.0302 for two ranks, 0.0310 for eight). A subsampled
   tensor adds ``ceil(8192 * largest shard / N)`` slots per rank to the collective.

Every rank of the group must call ``combine`` for the same steps, whether it writes rows or not
(``rank_policy="rank0"``): the lifecycle opens a non-writing step record on the other ranks for
exactly that (see ``SampleLifecycle.open_step``). A ``DTensor`` in a forward sample (an
activation) is still measured from this rank's shard: a module hook never communicates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from torchinstruments_core._measurement import Measurement, ReducerResult
from torchinstruments_core._plain import dtensor_placements
from torchinstruments_core._records import UnavailableReason
from torchinstruments_core.reducers import MomentsReducer, QuantileReducer, working_dtype
from torchinstruments_core.reducers._scaling import power_of_two_scale
from torchinstruments_core.reducers.base import PreparedTensor
from torchinstruments_core.reducers.functional import (
    DEFAULT_QUANTILES,
    _chunk_partial,
    _combine,
    quantiles,
)

if TYPE_CHECKING:
    import torch.distributed as dist

    from torchinstruments_core._measure import Measurer
    from torchinstruments_core.reducers import Reducer

_STATS = 9  # numel, n_finite, zeros, lo, hi, mean, m2, scale, slots used


@dataclass(slots=True)
class _Pending:
    """One sharded tensor waiting for the step's collective: its partial and its rows' holder."""

    partial: torch.Tensor
    slots: int
    reducers: tuple[Reducer, ...]
    measurement: Measurement
    dtype: torch.dtype
    """The working dtype: the combined values are rounded to it, as the unsharded ones are."""


@dataclass(slots=True)
class ShardedBatch:
    """The sharded tensors of one step record: one collective per process group combines them."""

    pending: dict[int, list[_Pending]] = field(default_factory=dict)
    groups: dict[int, dist.ProcessGroup] = field(default_factory=dict)

    def add(
        self, measurer: Measurer, tensor: torch.Tensor, scale: float | torch.Tensor | None
    ) -> Measurement:
        """Reduce this rank's shard of ``tensor`` now; its rows get values at ``combine``."""
        group = _group(tensor)
        measurement = Measurement(None, measurer.metrics)
        size = _sample_size(measurer)
        slots = _slots(tensor, size)
        with torch.no_grad():
            local = _local(tensor, scale)
            generator = measurer.generator(local.device)
            partial = _partial(local, slots, tensor.numel(), size, generator)
        pending = _Pending(partial, slots, measurer.reducers, measurement, local.dtype)
        self.groups[id(group)] = group
        self.pending.setdefault(id(group), []).append(pending)
        return measurement

    def fail(self, reason: str) -> None:
        """Give every pending tensor ``reason`` instead of values (the collective failed)."""
        for items in self.pending.values():
            for item in items:
                item.measurement.reason = reason
        self.pending.clear()
        self.groups.clear()

    def combine(self) -> None:
        """One ``all_gather`` per process group, then every pending tensor's values, on device."""
        import torch.distributed as dist

        for key, items in self.pending.items():
            group = self.groups[key]
            packed = torch.cat([item.partial for item in items])
            gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, packed, group=group)
            table = torch.stack(gathered)  # one row per rank
            offset = 0
            for item in items:
                width = _STATS + item.slots
                with torch.no_grad():
                    _fill(item, table[:, offset : offset + width])
                offset += width
        self.pending.clear()
        self.groups.clear()


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` with a ``Shard`` placement and no ``Partial`` one."""
    placements = dtensor_placements(tensor)
    if placements is None:
        return False
    shard = any(p.is_shard() for p in placements)  # type: ignore[attr-defined]
    return shard and not any(p.is_partial() for p in placements)  # type: ignore[attr-defined]


def holds_shards(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any parameter ``optimizer`` steps is sharded (``is_sharded``)."""
    return any(is_sharded(p) for group in optimizer.param_groups for p in group["params"])


def _group(tensor: torch.Tensor) -> dist.ProcessGroup:
    """The process group spanning the tensor's mesh (the default group for a multi-dim mesh)."""
    import torch.distributed as dist

    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    if mesh.ndim == 1:
        return mesh.get_group()  # type: ignore[no-any-return]
    if mesh.size() != dist.get_world_size():
        raise ValueError("a multi-dimensional mesh must span every rank to be combined")
    return dist.group.WORLD  # type: ignore[return-value]


def _contributes(tensor: torch.Tensor) -> bool:
    """Whether this rank's shard counts: on a ``Replicate`` mesh dim only coordinate 0's does."""
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate() or []
    placements = tensor.placements  # type: ignore[attr-defined]
    return all(c == 0 for c, p in zip(coordinate, placements, strict=False) if p.is_replicate())


def _local(tensor: torch.Tensor, scale: float | torch.Tensor | None) -> torch.Tensor:
    """This rank's entries, flat, in the working dtype, over ``scale``; none from a replica."""
    local: torch.Tensor = tensor.to_local().detach()  # type: ignore[attr-defined]
    local = local.reshape(-1).to(working_dtype(local.dtype))
    if not _contributes(tensor):
        local = local[:0]
    if isinstance(scale, torch.Tensor):
        return local / scale.detach().reshape(()).to(local.device, local.dtype)
    return local if scale is None else local / scale


def _sample_size(measurer: Measurer) -> int:
    """The quartile reducer's sample size; every entry (exact) when it sorts whole tensors."""
    for reducer in measurer.reducers:
        if isinstance(reducer, QuantileReducer):
            return 2**62 if reducer.exact else reducer.sample_size
    return 0


def _slots(tensor: torch.Tensor, size: int) -> int:
    """Subsample slots per rank: enough for the largest shard's share, alike on every rank.

    A shard along a dim split ``w`` ways holds at most ``ceil(d / w)`` of its ``d`` rows
    (``torch.chunk``'s split, the one ``DTensor`` uses), placement after placement.
    """
    shape = list(tensor.shape)
    mesh_shape = tensor.device_mesh.shape  # type: ignore[attr-defined]
    for ways, placement in zip(mesh_shape, tensor.placements, strict=True):  # type: ignore[attr-defined]
        if placement.is_shard():
            dim = placement.dim
            shape[dim] = -(-shape[dim] // ways)
    largest = math.prod(shape)
    numel = tensor.numel()
    if numel <= size:
        return largest
    return min(largest, -(-size * largest // numel))


def _partial(
    local: torch.Tensor, slots: int, numel: int, size: int, generator: torch.Generator
) -> torch.Tensor:
    """This shard's ``_STATS`` statistics and ``slots`` subsample entries, as float64."""
    device, count = local.device, local.numel()
    stats = torch.zeros(_STATS, dtype=torch.float64, device=device)
    sample = torch.full((slots,), math.nan, dtype=torch.float64, device=device)
    if count == 0:
        stats[3], stats[4], stats[7] = math.inf, -math.inf, 1.0
        return torch.cat([stats, sample])
    prepared = PreparedTensor(local, generator)
    lo, hi = prepared.finite_range
    scale = power_of_two_scale(torch.maximum(lo.abs(), hi.abs()))
    parts = [_chunk_partial(chunk, mask, scale) for chunk, mask in prepared.chunks(2**22)]
    n_finite, mean, m2 = _combine(parts)
    zeros = count - torch.count_nonzero(local)  # NaN is not a zero
    used = count if numel <= size else min(slots, -(-size * count // numel))
    drawn = local if used == count else local[prepared.random_index(used)]
    sample[:used] = drawn.to(torch.float64)
    values = [count, n_finite, zeros, lo, hi, mean.nan_to_num(0.0), m2.nan_to_num(0.0), scale, used]
    stats = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    return torch.cat([stats, sample])


def _fill(item: _Pending, table: torch.Tensor) -> None:
    """Set ``item.measurement``'s values from the ranks' rows of its partials."""
    numel, n_finite, zeros, lo, hi, means, m2s, scales, used = table[:, :_STATS].unbind(1)
    total, finite = numel.sum(), n_finite.sum()
    low, high = lo.min(), hi.max()
    # the power of the rank with the largest magnitude: every rank's scaled sums move to it
    has_finite = n_finite > 0
    top = torch.where(has_finite, scales, math.inf).min()
    ratio = torch.where(has_finite, top / scales, 0.0)
    mean = (n_finite * means * ratio).sum() / finite.clamp(min=1)
    m2 = (m2s * ratio.square() + n_finite * (means * ratio - mean).square()).sum()
    variance = m2 / finite
    statistics = torch.stack(
        [
            mean / top,
            variance.sqrt() / top,
            low,
            high,
            (variance + mean.square()).sqrt() / top,
            torch.maximum(low.abs(), high.abs()),
            (m2 + finite * mean.square()).sqrt() / top,
        ]
    )
    mean_, std, low_, high_, rms, max_abs, l2_norm = torch.where(
        finite > 0, statistics, math.nan
    ).unbind()
    dtype = item.dtype  # the counts are exact; divided in the working dtype, as unsharded
    fractions = (
        zeros.sum().to(dtype) / total.to(dtype),
        (total - finite).to(dtype) / total.to(dtype),
    )
    finite_stats = torch.stack([mean_, std, low_, high_]).to(dtype)
    others = torch.stack([rms, max_abs, l2_norm]).to(dtype)
    moments = torch.cat([finite_stats, torch.stack(fractions), others])
    measurement = item.measurement
    measurement.n_finite = finite.to(torch.int64)
    extra = measurement.results  # metrics added to the step tensor, after the reducers'
    measurement.results = [*_results(item.reducers, moments, table, used), *extra]


def _pooled_quartiles(table: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """The quartiles of every rank's subsample together; padding and non-finite entries dropped."""
    slots = table[:, _STATS:]
    valid = torch.arange(slots.shape[1], device=slots.device) < used.unsqueeze(1)
    pooled = torch.where(valid, slots, math.nan).reshape(-1)
    sample = PreparedTensor(pooled, torch.Generator(pooled.device))
    sample.__dict__["all_finite"] = None  # the masked path: the NaN padding is no entry
    return quantiles(sample, DEFAULT_QUANTILES, exact=True)


def _results(
    reducers: tuple[Reducer, ...], moments: torch.Tensor, table: torch.Tensor, used: torch.Tensor
) -> list[ReducerResult]:
    """One result per reducer, in the measurer's order: combined values or ``sharded_tensor``."""
    results: list[ReducerResult] = []
    for reducer in reducers:
        if isinstance(reducer, MomentsReducer):
            results.append(ReducerResult(reducer.metrics, moments))
        elif isinstance(reducer, QuantileReducer):
            results.append(ReducerResult(reducer.metrics, _pooled_quartiles(table, used)))
        else:
            reason = UnavailableReason.SHARDED_TENSOR
            results.append(ReducerResult(reducer.metrics, None, reason))
    return results
