"""The CPU histogram's host grid and numpy binning against the torch path they replace."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from torchinstruments_core.reducers import _binning, _edges
from torchinstruments_core.reducers._bin_keys import PAIRS_FROM, bin_keys, lane_pattern
from torchinstruments_core.reducers._host_binning import BLOCK, host_grid, host_histogram_counts
from torchinstruments_core.reducers.base import PreparedTensor

# every test once with the compiled CPU kernels and once through numpy and torch
pytestmark = pytest.mark.usefixtures("reduction_path")


def _torch_path(values: torch.Tensor, bins: int) -> torch.Tensor:
    """``histogram_counts``' packed result computed with the 0-d tensor grid and torch binning."""
    prepared = PreparedTensor(values, torch.Generator())
    grid = _binning._grid(values.min(), values.max(), bins)
    counts = _binning._bin_counts(prepared, grid, 2**15)
    parameters = torch.stack([grid.lo, grid.hi, grid.scale])
    return torch.cat([parameters, counts.to(values.dtype), torch.zeros(1, dtype=values.dtype)])


def _cases(dtype: torch.dtype) -> list[torch.Tensor]:
    finfo = torch.finfo(dtype)
    top, tiny = finfo.max, finfo.tiny
    edge = [
        [top, top, top],
        [top, -top],
        [top, top * 0.99],
        [-top, -top * 0.999999],
        [1e8, 1e8 + 16],
        [0.0, tiny],
        [tiny / 4, tiny / 2],
        [3.0] * 5,
        [-0.0, 0.0],
    ]
    rng = np.random.default_rng(7)
    cases = [torch.tensor(values, dtype=dtype) for values in edge]
    cases.append(torch.randn(100_000, dtype=dtype))
    for _ in range(60):
        exponent = rng.uniform(-40, 38)
        shift = rng.standard_normal() * 10 ** rng.uniform(-40, 38)
        noise = rng.standard_normal(int(rng.integers(1, 3000))) * 10**exponent + shift
        cases.append(torch.from_numpy(noise).to(dtype))
    return [case[torch.isfinite(case)] for case in cases if torch.isfinite(case).any()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_host_histogram_matches_the_torch_grid_and_binning_bit_for_bit(dtype: torch.dtype) -> None:
    """The host path's lo, hi, scale and counts equal the torch path's exactly, at every scale.

    Covers constant and narrow tensors (widened), the ends of the float range (widened
    inward), subnormals, and random data from 1e-40 to 1e38, with 1 to 1,000 bins.
    """
    for values in _cases(dtype):
        for bins in (1, 7, 64, 1000):
            host = host_histogram_counts(
                values, float(values.min()), float(values.max()), bins, 2**15
            )
            assert torch.equal(host, _torch_path(values, bins)), (values[:4], bins)


@pytest.mark.usefixtures("without_kernels")  # numpy's search, through its guess
def test_edges_from_a_wrong_guess_equal_those_from_the_float64_estimate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The float32 edge guess only speeds the search: from guesses far off, the edges are the same.

    The estimate worked back through the binning's roundings lands on the threshold itself
    nearly always; a guess hundreds of floats away (what the nominal edge used to give near
    zero) or at the grid's low end goes through the bracket search and finds the same edges.
    """
    rng = np.random.default_rng(11)
    grids = []
    for _ in range(40):
        ends = rng.standard_normal(2) * 10 ** rng.uniform(-30, 30)
        lo, hi = float(ends.min()), float(ends.max())
        grid = host_grid(lo, hi, 64, np.float32)
        grids.append((float(grid.lo), float(grid.hi), float(grid.scale)))
    expected = [_edges.histogram_edges(*grid, 64) for grid in grids]
    estimate = _edges._guess32
    for shift in (300, -5000, 10**6):
        monkeypatch.setattr(_edges, "_guess32", lambda f, t, s=shift: estimate(f, t) + s)
        assert [_edges.histogram_edges(*grid, 64) for grid in grids] == expected
    for lo, hi, _scale in grids:
        values = rng.uniform(lo, hi, 5000).astype(np.float32)
        counts = host_histogram_counts(
            torch.from_numpy(values), float(values.min()), float(values.max()), 64, 2**15
        )
        packed = counts.tolist()
        edges = _edges.histogram_edges(packed[0], packed[1], packed[2], 64)
        assert (
            np.histogram(values, bins=np.array(edges, dtype=np.float32))[0].tolist() == packed[3:67]
        )


def _relu_like(numel: int, dtype: type[np.floating], seed: int) -> np.ndarray:
    """Half zeros, the rest a peaked gradient-like spread: the repeats that lanes are for."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(numel) * rng.standard_normal(numel) ** 3
    values[rng.random(numel) < 0.5] = 0
    return values.astype(dtype)


def _numpy_counts(values: np.ndarray, packed: torch.Tensor, bins: int) -> list[float]:
    """numpy.histogram of ``values`` with the edges that ``packed``'s grid defines."""
    lo, hi, scale = packed[:3].tolist()
    edges = _edges.histogram_edges(lo, hi, scale, bins, float64=values.dtype == np.float64)
    expected: list[float] = np.histogram(values, bins=np.array(edges, values.dtype))[0].tolist()
    return expected


@pytest.mark.parametrize("numel", [20_001, PAIRS_FROM + 5])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bins", [1, 2, 84, 85, 127, 128, 10_921, 10_922, 65_536])
def test_every_key_layout_counts_like_numpy_histogram(
    dtype: type[np.floating], bins: int, numel: int
) -> None:
    """Every key layout counts what numpy.histogram and the torch binning count.

    Single keys with three lanes as bytes (up to 84 bins) or int16 (up to 10,921), int32 keys
    with one lane (up to 65,536), and for large tensors paired bytes with three lanes (up to
    84 bins) or two (up to 127); on zeros and a narrow peak with the histogram's own edges
    (ties) added.
    """
    values = _relu_like(numel, dtype, bins)
    tensor = torch.from_numpy(values)
    packed = host_histogram_counts(tensor, values.min(), values.max(), bins, 2**20)
    lo, hi, scale = packed[:3].tolist()
    edges = _edges.histogram_edges(lo, hi, scale, bins, float64=dtype == np.float64)
    on_edges = np.concatenate([values, np.array(edges[1:-1], dtype)])
    packed = host_histogram_counts(
        torch.from_numpy(on_edges), on_edges.min(), on_edges.max(), bins, 2**20
    )
    assert packed[3 : 3 + bins].tolist() == _numpy_counts(on_edges, packed, bins)
    assert torch.equal(packed, _torch_path(torch.from_numpy(on_edges), bins))


@pytest.mark.parametrize("bins", [64, 1000])
@pytest.mark.parametrize(
    "numel", [1, 2, 3, 17, BLOCK - 1, BLOCK + 1, 2 * BLOCK + 3, PAIRS_FROM + 1]
)
def test_counts_do_not_depend_on_how_entries_are_split(bins: int, numel: int) -> None:
    """Counts do not depend on the span and block lengths, and equal numpy's.

    Spans of any length (odd ones padded to complete their last pair), blocks that start at
    any phase of the lane pattern.
    """
    values = _relu_like(numel, np.float32, numel)
    tensor = torch.from_numpy(values)
    whole = host_histogram_counts(tensor, values.min(), values.max(), bins, 2**20)
    assert whole[3 : 3 + bins].tolist() == _numpy_counts(values, whole, bins)
    for chunk_size in (1, 2, 3, 5, 2001, BLOCK - 1, BLOCK + 1):
        if numel // chunk_size > 200:  # a bincount per span: keep the test short
            continue
        split = host_histogram_counts(tensor, values.min(), values.max(), bins, chunk_size)
        assert torch.equal(split, whole), chunk_size


def test_lane_pattern_gives_neighbours_different_tables() -> None:
    """Neighbouring keys differ in lane, and the lane pattern repeats every period.

    So a run of one bin (pairs of bytes, or single keys) increments ``lanes`` different
    counters in turn.
    """
    for bins, entries in itertools.product((64, 100, 1000), (1, PAIRS_FROM)):
        keys = bin_keys(bins, entries)
        bins_of = np.zeros(6 * keys.period, dtype=keys.dtype)
        found = keys.view(bins_of + lane_pattern(keys, bins_of.size)[: bins_of.size])
        per_key = np.unique(found[: keys.lanes]).size
        assert per_key == keys.lanes
        assert (found[keys.lanes :] == found[: -keys.lanes]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shift", [0, 300, -5000])
@pytest.mark.usefixtures("without_kernels")  # numpy's search, through its guess
def test_edges_searched_together_equal_edges_searched_one_by_one(
    monkeypatch: pytest.MonkeyPatch, dtype: type[np.floating], shift: int
) -> None:
    """A sample's histograms share one edge search: each gets the edges it gets alone.

    Grids of every scale, narrow ones (widened), the ends of the float range and a grid with no
    finite entry go through one search; wrong guesses send them through the bracket search,
    where each grid's targets are narrowed with that grid's own bin function.
    """
    if shift:
        estimate = _edges._guess32
        monkeypatch.setattr(_edges, "_guess32", lambda f, t, s=shift: estimate(f, t) + s)
    rng = np.random.default_rng(12)
    largest = float(np.finfo(dtype).max)
    for bins in (1, 7, 64, 4099):
        ranges = [(-largest, largest), (largest, largest)]
        for trial in range(12):
            ends = rng.standard_normal(2) * 10 ** rng.uniform(-30, 30)
            ranges.append((float(ends.min()), float(ends.min() if trial % 4 else ends.max())))
        grids = [(math.nan, math.nan, math.nan)]
        for lo, hi in ranges:
            grid = host_grid(lo, hi, bins, dtype)
            grids.append((float(grid.lo), float(grid.hi), float(grid.scale)))
        float64 = dtype is np.float64
        together = _edges.histograms_edges(grids, bins, float64=float64)
        alone = [_edges.histogram_edges(*grid, bins, float64=float64) for grid in grids]
        assert np.array_equal(np.array(together), np.array(alone), equal_nan=True), bins
        assert all(math.isnan(edge) for edge in together[0])


@pytest.mark.parametrize("bins", [1, 64, 127, 1000])
@pytest.mark.usefixtures("without_kernels")
def test_small_tensors_count_by_one_bincount_with_the_same_counts(
    bins: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to ``DIRECT_ENTRIES`` entries one ``np.bincount`` counts the bins; past it, the keys.

    At both sides of the boundary the packed result equals the torch path's bit for bit, on
    ReLU-like data with ties on the histogram's edges.
    """
    from torchinstruments_core.reducers import _host_binning

    taken: list[str] = []
    for name in ("_count_directly", "_count_with_keys"):
        real = getattr(_host_binning, name)

        def spy(*args: object, _real: object = real, _name: str = name) -> object:
            taken.append(_name)
            return _real(*args)  # type: ignore[operator]

        monkeypatch.setattr(_host_binning, name, spy)
    for numel in (_host_binning.DIRECT_ENTRIES, _host_binning.DIRECT_ENTRIES + 1, 3):
        values = _relu_like(numel, np.float32, bins)
        tensor = torch.from_numpy(values)
        packed = host_histogram_counts(tensor, values.min(), values.max(), bins, 2**20)
        assert torch.equal(packed, _torch_path(tensor, bins))
    assert taken == ["_count_directly", "_count_with_keys", "_count_directly"]


def test_a_grid_too_fine_for_float32_raises_instead_of_dropping_the_largest_entry() -> None:
    """Millions of bins: float32 rounding can put the max past the last bin; that is an error.

    The torch path and the keyed path fail there too; ``HistogramReducer`` allows 65,536 bins.
    """
    values = torch.tensor([-95.55243682861328, -89.88875579833984, -134.5279083251953])
    values = torch.cat([values, torch.tensor([-73.3188705444336, -236.2941436767578])])
    bins = 2**23 + 1
    with pytest.raises(ValueError, match="past the last"):
        host_histogram_counts(values, float(values.min()), float(values.max()), bins, 2**15)
