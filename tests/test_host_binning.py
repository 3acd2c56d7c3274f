"""The CPU histogram's host grid and numpy binning against the torch path they replace."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchinstruments_core.reducers import _binning, _edges
from torchinstruments_core.reducers._host_binning import host_grid, host_histogram_counts
from torchinstruments_core.reducers.base import PreparedTensor


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
