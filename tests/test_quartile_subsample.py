"""The quartiles' fixed subsample: exact up to 8,192 entries, within the stated bound past it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torchinstruments_core import _sharded
from torchinstruments_core.reducers import PreparedTensor, QuantileReducer, _select
from torchinstruments_core.reducers.functional import (
    DEFAULT_SAMPLE_SIZE,
    quantiles,
    subsample_size,
)

# every test once with the compiled CPU kernels and once through numpy and torch
pytestmark = pytest.mark.usefixtures("reduction_path")

LEVELS = (0.25, 0.5, 0.75)
SHAPES = ("normal", "lognormal", "relu", "bimodal", "few_values")
M = 8192
EPS = 0.030
"""The stated DKW bound for the default subsample, ``sqrt(14.7456 / (2 * M))``: it fails with
probability 7.9e-7 per tensor."""
MEAN_ERROR = sum(math.sqrt(2 / math.pi * q * (1 - q) / M) for q in LEVELS) / len(LEVELS)
"""The expected absolute rank error of the three quartiles, averaged: 0.0040 (0.0057 were the
subsample half as large)."""


def _prepare(tensor: torch.Tensor, seed: int = 0) -> PreparedTensor:
    return PreparedTensor(tensor, torch.Generator(tensor.device).manual_seed(seed))


def _shaped(shape: str, base: torch.Tensor) -> torch.Tensor:
    """Standard normal ``base`` turned into one of the named distributions, in float32."""
    return {
        "normal": base,
        "lognormal": base.exp(),
        "relu": base.clamp(min=0),
        "bimodal": base + torch.where(base > 0.3, 6.0, -6.0),
        "few_values": base.mul(2).round(),
    }[shape].float()


def _rank_errors(tensor: torch.Tensor, values: torch.Tensor) -> list[float]:
    """How far, in rank, each value is from its level's quantile of the finite entries.

    The rank of a value is the interval ``[F(v-), F(v)]`` of the exact distribution, so ties
    (ReLU zeros, few distinct values) count as exact where the level falls inside them.
    """
    array = tensor.detach().double().reshape(-1).numpy()
    ordered = np.sort(array[np.isfinite(array)])
    got = values.double().numpy()
    below = np.searchsorted(ordered, got, side="left") / ordered.size
    through = np.searchsorted(ordered, got, side="right") / ordered.size
    return [
        max(low - level, level - high, 0.0)
        for level, low, high in zip(LEVELS, below, through, strict=True)
    ]


def test_the_subsample_is_8192_entries_whatever_the_size() -> None:
    """Whole up to ``sample_size`` (8,192 by default); ``sample_size`` entries past it."""
    assert DEFAULT_SAMPLE_SIZE == M
    assert math.isclose(math.sqrt(14.7456 / (2 * M)), EPS)
    assert 2 * math.exp(-2 * M * EPS**2) < 7.9e-7
    assert QuantileReducer().sample_size == 8192
    assert [subsample_size(n) for n in (1, 5000, 8192)] == [1, 5000, 8192]
    assert [subsample_size(n) for n in (8193, 98_304, 262_144, 20_000_000)] == [8192] * 4
    assert subsample_size(5000, 1000) == 1000
    assert subsample_size(10**6, 100_000) == 100_000
    assert subsample_size(500, 100_000) == 500


@pytest.mark.parametrize("device_path", [False, True])
@pytest.mark.parametrize("numel", [8193, 300_000])
def test_a_larger_tensor_draws_8192_positions(
    numel: int, device_path: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default reducer gathers exactly 8,192 entries, on the host and the masked path."""
    sizes: list[int] = []
    original = PreparedTensor.random_index

    def spying(self: PreparedTensor, size: int) -> torch.Tensor:
        sizes.append(size)
        return original(self, size)

    monkeypatch.setattr(PreparedTensor, "random_index", spying)
    prepared = _prepare(torch.randn(numel, generator=torch.Generator().manual_seed(numel)))
    if device_path:
        prepared.__dict__["all_finite"] = None  # the accelerators' path: finiteness unknown
    QuantileReducer().reduce(prepared)
    assert sizes == [8192]


@pytest.mark.parametrize("numel", [1, 2, 999, 8191, 8192])
def test_at_most_8192_entries_give_numpys_exact_quartiles(numel: int) -> None:
    """Up to 8,192 entries the default quartiles are numpy's, bit for bit in float64.

    With non-finite entries among them, the masked path gives numpy's quartiles of the finite
    ones to rounding.
    """
    generator = torch.Generator().manual_seed(numel)
    tensor = torch.randn(numel, generator=generator, dtype=torch.float64).exp()
    reduced = QuantileReducer().reduce(_prepare(tensor, seed=numel))
    np.testing.assert_array_equal(reduced.numpy(), np.quantile(tensor.numpy(), LEVELS))
    if numel > 2:
        tensor[::7] = math.nan
        tensor[1::11] = math.inf
        finite = tensor.numpy()[np.isfinite(tensor.numpy())]
        reduced = QuantileReducer().reduce(_prepare(tensor, seed=numel))
        np.testing.assert_allclose(reduced.numpy(), np.quantile(finite, LEVELS), rtol=1e-12)


@pytest.mark.parametrize("numel", [8193, 60_000])
@pytest.mark.parametrize("shape", SHAPES)
def test_subsampled_quartiles_keep_the_stated_rank_bound(shape: str, numel: int) -> None:
    """Over 40 tensors per shape, every subsampled quartile is within the DKW bound of 0.030.

    The bound ``eps = sqrt(14.7456 / (2 * 8192))`` fails with probability 7.9e-7 per tensor.
    The mean error stays within a quarter above its expected value for ``m = 8192``: a subsample
    half as large fails that on the shapes without ties (ties only lower the error).
    """
    generator = torch.Generator().manual_seed(len(shape))
    errors: list[float] = []
    for trial in range(40):
        tensor = _shaped(shape, torch.randn(numel, generator=generator, dtype=torch.float64))
        errors += _rank_errors(tensor, quantiles(_prepare(tensor, seed=trial), LEVELS))
    assert max(errors) <= EPS
    assert np.mean(errors) <= 1.25 * MEAN_ERROR


def test_the_default_subsample_takes_one_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    """8,192 entries are sorted whole (no pilot); the bracketed path starts at 18,432."""
    assert DEFAULT_SAMPLE_SIZE < _select._DIRECT

    def no_pilot(*args: object) -> dict[int, float]:
        raise AssertionError("the bracketed path ran for the default subsample")

    monkeypatch.setattr(_select, "_bracketed", no_pilot)
    tensor = torch.randn(10**6, generator=torch.Generator().manual_seed(1))
    prepared = _prepare(tensor)
    assert prepared.all_finite
    assert quantiles(prepared).isfinite().all()


@pytest.mark.parametrize("kwargs", [{"sample_size": 32768}, {"exact": True}])
@pytest.mark.usefixtures("without_kernels")
def test_larger_selections_take_the_bracketed_path(
    kwargs: dict[str, int | bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A larger ``sample_size`` or ``exact=True`` selects through the pilot, exactly."""
    calls: list[int] = []
    original = _select._bracketed

    def counting(*args: object) -> dict[int, float]:
        calls.append(1)
        return original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_select, "_bracketed", counting)
    tensor = torch.randn(100_000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    result = QuantileReducer(**kwargs).reduce(_prepare(tensor))  # type: ignore[arg-type]
    assert calls
    if kwargs.get("exact"):
        np.testing.assert_array_equal(result.numpy(), np.quantile(tensor.numpy(), LEVELS))


def _pooled(tensor: torch.Tensor, sizes: list[int], seed: int) -> torch.Tensor:
    """The sharded quartiles of ``tensor`` split into shards of ``sizes``, on one process.

    What ``ShardedBatch`` runs, without the collective: every shard's ``_partial`` with the
    slots the largest shard needs (``_slots``), stacked as the ``all_gather`` would.
    """
    numel, size = tensor.numel(), DEFAULT_SAMPLE_SIZE
    slots = min(max(sizes), -(-size * max(sizes) // numel))
    generator = torch.Generator().manual_seed(seed)
    shards = tensor.split(sizes)
    table = torch.stack([_sharded._partial(s, slots, numel, size, generator) for s in shards])
    used = table[:, _sharded._STATS - 1]  # the last statistic: the slots a shard filled
    return _sharded._pooled_quartiles(table, used)


@pytest.mark.parametrize("sizes", [[100_002, 100_001], [30_000] * 3 + [10_003] * 5])
@pytest.mark.parametrize("shape", SHAPES)
def test_pooled_shard_quartiles_keep_the_sharded_bound(shape: str, sizes: list[int]) -> None:
    """Over 25 tensors split on 2 or 8 ranks, each pooled quartile is within 0.030 + W / 8192.

    That is ``_sharded``'s Hoeffding bound for the default subsample, failing with probability
    2.4e-6 per tensor; each rank sends ``ceil(8192 * n_i / N)`` entries. The mean error is
    checked as unsharded.
    """
    generator = torch.Generator().manual_seed(len(sizes) + len(shape))
    errors: list[float] = []
    for trial in range(25):
        base = torch.randn(sum(sizes), generator=generator, dtype=torch.float64)
        tensor = _shaped(shape, base)
        errors += _rank_errors(tensor, _pooled(tensor, sizes, trial))
    assert max(errors) <= EPS + len(sizes) / M
    assert np.mean(errors) <= 1.25 * MEAN_ERROR


def test_a_small_sharded_tensor_sends_every_entry() -> None:
    """At most 8,192 entries in all: every shard is sent whole and the quartiles are exact."""
    tensor = torch.randn(8192, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    pooled = _pooled(tensor, [4096, 3000, 1096], 0)
    np.testing.assert_allclose(pooled.numpy(), np.quantile(tensor.numpy(), LEVELS), rtol=1e-12)
