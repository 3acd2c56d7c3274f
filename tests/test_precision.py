"""``precision_reducers()``: kurtosis and the bf16/fp16/fp8 range fractions, against float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import torchinstruments_core
from torchinstruments_core import AlwaysSampler, StatRow, inject_observer
from torchinstruments_core.reducers import (
    FORMATS,
    PrecisionReducer,
    PreparedTensor,
    Reducer,
    default_reducers,
    precision_reducers,
)
from torchinstruments_core.reducers._precision import PRECISION_METRICS, precision_statistics
from torchinstruments_core.testing import RecordingSink

PATHS = ["host", "device"]


def _prepared(tensor: torch.Tensor, path: str) -> PreparedTensor:
    prepared = PreparedTensor(tensor, torch.Generator().manual_seed(0))
    if path == "device":  # the masked path every accelerator runs (see test_reducers)
        prepared.__dict__["all_finite"] = None
    return prepared


def _reference(values: np.ndarray) -> list[float]:
    """Excess kurtosis (population moments) and each format's fractions, in float64 numpy."""
    finite = values[np.isfinite(values)]
    top = float(np.abs(finite).max()) if finite.size else 0.0
    scaled = finite / top if top else finite  # kurtosis is scale-free; float64 powers stay finite
    deviations = scaled - scaled.mean() if finite.size else scaled
    m2, m4 = np.mean(deviations**2), np.mean(deviations**4)
    kurtosis = m4 / m2**2 - 3 if finite.size and m2 > 0 else math.nan
    magnitude = np.abs(finite)
    result = [float(kurtosis)]
    for form in FORMATS:
        result.append(np.count_nonzero(magnitude > form.max) / values.size)
        below = (magnitude > 0) & (magnitude < form.smallest_subnormal)
        result.append(np.count_nonzero(below) / values.size)
    return result


def _mixed(dtype: torch.dtype, numel: int = 200_003) -> torch.Tensor:
    """Log-uniform magnitudes over the dtype's range, random signs, zeros and thresholds."""
    generator = torch.Generator().manual_seed(17)
    info = torch.finfo(dtype)
    low, high = math.log2(info.smallest_normal * info.eps), math.log2(info.max) - 0.01
    exponents = torch.rand(numel, generator=generator, dtype=torch.float64) * (high - low) + low
    signs = torch.randint(0, 2, (numel,), generator=generator, dtype=torch.float64) * 2 - 1
    values = (signs * torch.exp2(exponents)).to(dtype)
    values[::29] = 0.0
    edges = [v for f in FORMATS for v in (f.max, f.smallest_subnormal)]
    edges = [v for v in edges if v <= info.max]
    for at, value in enumerate(edges):
        above = torch.nextafter(
            torch.tensor(value, dtype=dtype), torch.tensor(math.inf, dtype=dtype)
        )
        below = torch.nextafter(torch.tensor(value, dtype=dtype), torch.tensor(0.0, dtype=dtype))
        values[7 * at : 7 * at + 3] = torch.stack([torch.tensor(value, dtype=dtype), above, below])
    return values


def test_the_format_constants_are_torch_finfo() -> None:
    """Each format's largest finite value and smallest subnormal are those of its torch dtype."""
    assert [f.name for f in FORMATS] == ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]
    for form in FORMATS:
        info = torch.finfo(getattr(torch, form.dtype))
        assert form.max == info.max, form
        assert form.smallest_subnormal == info.smallest_normal * info.eps, form
    assert [f.max for f in FORMATS] == [3.3895313892515355e38, 65504.0, 448.0, 57344.0]
    assert [f.smallest_subnormal for f in FORMATS] == [2**-133, 2**-24, 2**-9, 2**-16]


def test_the_metric_names_are_documented_and_opt_in() -> None:
    """Nine readable names, none of them a default; the reducer set is exported at the top."""
    assert PRECISION_METRICS[0] == "kurtosis"
    assert "fp16_overflow_fraction" in PRECISION_METRICS
    assert "fp8_e4m3_underflow_fraction" in PRECISION_METRICS
    assert len(PRECISION_METRICS) == 1 + 2 * len(FORMATS)
    defaults = {m for r in default_reducers() for m in r.metrics}
    assert not defaults & set(PRECISION_METRICS)
    (reducer,) = precision_reducers()
    assert isinstance(reducer, Reducer)
    assert reducer.metrics == PRECISION_METRICS
    assert torchinstruments_core.precision_reducers is precision_reducers
    documented = PrecisionReducer.__doc__ or ""
    for form in FORMATS:
        assert f"``{form.name}``" in documented
    assert "<format>_overflow_fraction" in documented
    assert "<format>_underflow_fraction" in documented


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_fractions_and_kurtosis_match_float64(path: str, dtype: torch.dtype) -> None:
    """Across the dtype's whole range, entries on and beside every threshold included.

    Fractions are exact (counts over all entries); the kurtosis matches to rounding.
    """
    tensor = _mixed(dtype)
    tensor[5], tensor[6] = math.nan, -math.inf
    result = precision_statistics(_prepared(tensor, path), chunk_size=65_536)
    expected = _reference(tensor.to(torch.float64).numpy())
    assert result.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    np.testing.assert_allclose(result[1:].numpy(), expected[1:], rtol=1e-6, atol=0)
    assert result[0].item() == pytest.approx(expected[0], rel=1e-4)


@pytest.mark.parametrize("path", PATHS)
def test_fractions_count_what_a_cast_would_lose(path: str) -> None:
    """Away from the rounding bands, the fractions are the entries a real cast makes inf or 0.

    fp16, bf16 and float8 e5m2 casts give inf beyond the largest value (plus half a unit),
    float8 e4m3fn (no infinity) saturates to ±448; all four give 0 below half the smallest
    subnormal. Entries
    in those bands, which the fractions count by threshold alone, are left out here.
    """
    generator = torch.Generator().manual_seed(3)
    exponents = torch.rand(100_000, generator=generator, dtype=torch.float64) * 300 - 150
    tensor = torch.exp2(exponents)  # float64: bf16's range is float32's, so beyond it too
    for form in FORMATS:
        high_band = (tensor > form.max) & (tensor <= form.max * 1.25)
        tiny = form.smallest_subnormal
        low_band = (tensor < tiny) & (tensor >= tiny * 0.49)
        tensor = tensor[~(high_band | low_band)]
    values = precision_statistics(_prepared(tensor, path)).tolist()
    result = dict(zip(PRECISION_METRICS, values, strict=True))
    for form in FORMATS:
        cast = tensor.to(getattr(torch, form.dtype)).to(torch.float64)
        # e4m3fn has no infinity: torch's cast saturates to ±448 there
        saturated = (cast.abs() == form.max) & (tensor.abs() > form.max)
        lost_high = int((~cast.isfinite() | saturated).sum())
        lost_low = int((cast == 0).sum())
        assert lost_high > 0
        assert lost_low > 0
        assert result[f"{form.name}_overflow_fraction"] * tensor.numel() == pytest.approx(lost_high)
        assert result[f"{form.name}_underflow_fraction"] * tensor.numel() == pytest.approx(lost_low)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("dtype", "magnitude"),
    [
        (torch.float64, 1e300),
        (torch.float64, 1e-300),
        (torch.float32, 3e38),
        (torch.float32, 1e-42),
    ],
)
def test_kurtosis_at_the_ends_of_the_float_range(
    path: str, dtype: torch.dtype, magnitude: float
) -> None:
    """Fourth powers of entries near the largest or smallest floats neither overflow nor vanish."""
    generator = torch.Generator().manual_seed(5)
    values = torch.randn(50_001, generator=generator, dtype=torch.float64).clamp(-4, 4) / 4
    tensor = (values * magnitude).to(dtype)
    tensor[3] = math.nan
    result = precision_statistics(_prepared(tensor, path), chunk_size=16_384)[0].item()
    expected = _reference(tensor.to(torch.float64).numpy())[0]
    assert math.isfinite(result)
    assert result == pytest.approx(expected, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("path", PATHS)
def test_kurtosis_of_known_distributions(path: str) -> None:
    """Excess kurtosis: ~0 for a normal (offset by 1e4 too), ~3 for a Laplace; NaN if constant."""
    generator = torch.Generator().manual_seed(1)
    normal = torch.randn(2_000_000, generator=generator)
    laplace = torch.distributions.Laplace(0.0, 1.0).sample((2_000_000,))
    for tensor, expected in ((normal, 0.0), (normal + 1e4, 0.0), (laplace, 3.0)):
        result = precision_statistics(_prepared(tensor, path))[0].item()
        assert result == pytest.approx(expected, abs=0.05)
    constant = torch.full((1000,), 2.5)
    assert math.isnan(precision_statistics(_prepared(constant, path))[0].item())


def test_the_accelerator_path_never_reads_a_value_on_the_host() -> None:
    """On a meta tensor (which raises on any host read) the reducer runs and stays on the device."""
    tensor = torch.empty(5_000_011, device="meta")
    values = PrecisionReducer().reduce(PreparedTensor(tensor, torch.Generator()))
    assert values.device.type == "meta"
    assert values.shape == (len(PRECISION_METRICS),)


def _observed_rows(bias: list[float]) -> dict[str, StatRow]:
    """The rows of a zero-weight ``Linear`` whose outputs are its ``bias``, three times over."""
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.tensor(bias))
    sink = RecordingSink()
    reducers = (*default_reducers(), *precision_reducers())
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, reducers=reducers):
        model(torch.randn(3, 4))
    return {r.metric: r for r in sink.rows if str(r.signal) == "output"}


def test_the_rows_of_an_observed_model_carry_the_precision_metrics() -> None:
    """Through ``inject_observer``, each tensor gets the nine rows beside the defaults.

    The fractions are exact; a constant output's kurtosis is null with ``non_finite_result``.
    """
    bias = [0.0, 1e5, 1e-30, 1.0]
    rows = _observed_rows(bias)
    assert set(PRECISION_METRICS) <= set(rows)
    assert rows["fp16_overflow_fraction"].value == 0.25
    assert rows["fp8_e4m3_overflow_fraction"].value == 0.25
    assert rows["bf16_overflow_fraction"].value == 0.0
    assert rows["bf16_underflow_fraction"].value == 0.0
    assert rows["fp16_underflow_fraction"].value == 0.25
    expected = _reference(np.array(bias * 3))[0]
    assert rows["kurtosis"].value == pytest.approx(expected, rel=1e-5)
    constant = _observed_rows([1.0] * 4)
    assert constant["kurtosis"].value is None
    assert constant["kurtosis"].unavailable_reason == "non_finite_result"
    assert constant["fp16_overflow_fraction"].value == 0.0
