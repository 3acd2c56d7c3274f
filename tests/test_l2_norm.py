"""``l2_norm``: the default metric people compare with ``clip_grad_norm_`` and Lightning's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from torchinstruments_core import AlwaysSampler, inject_observer
from torchinstruments_core.reducers import DEFAULT_METRICS, PreparedTensor
from torchinstruments_core.reducers.functional import MOMENT_METRICS, moments
from torchinstruments_core.testing import RecordingSink

L2 = MOMENT_METRICS.index("l2_norm")


def _prepared(tensor: torch.Tensor, path: str) -> PreparedTensor:
    prepared = PreparedTensor(tensor, torch.Generator().manual_seed(0))
    if path == "device":  # the masked path every accelerator runs (see test_reducers)
        prepared.__dict__["all_finite"] = None
    return prepared


def _exact_norm(values: np.ndarray) -> float:
    """The float64 norm of the finite entries, divided by the largest magnitude first."""
    finite = values[np.isfinite(values)]
    top = float(np.abs(finite).max())
    return math.sqrt(float(np.sum((finite / top) ** 2))) * top if top else 0.0


def test_l2_norm_is_a_default_metric() -> None:
    """``l2_norm`` is among the default metrics, right after ``max_abs``."""
    assert "l2_norm" in DEFAULT_METRICS
    assert MOMENT_METRICS[-2:] == ("max_abs", "l2_norm")


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_l2_norm_equals_vector_norm_and_clip_grad_norm(path: str, dtype: torch.dtype) -> None:
    """On both paths the norm equals ``torch.linalg.vector_norm`` and ``clip_grad_norm_``'s total.

    Both references run in float64 on the same entries; the metric runs in the working dtype.
    """
    generator = torch.Generator().manual_seed(7)
    tensor = (torch.randn(300_007, generator=generator, dtype=torch.float64) * 0.3 + 0.1).to(dtype)
    result = moments(_prepared(tensor, path))[L2].item()
    reference = torch.linalg.vector_norm(tensor.to(torch.float64)).item()
    parameter = nn.Parameter(torch.zeros(tensor.shape, dtype=torch.float64))
    parameter.grad = tensor.to(torch.float64)
    clipped = nn.utils.clip_grad_norm_([parameter], max_norm=math.inf).item()
    # float32 block dot products on the CPU shortcut: ~1e-6, as for rms
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert clipped == pytest.approx(reference, rel=1e-14)
    assert result == pytest.approx(reference, rel=tolerance)


@pytest.mark.parametrize("path", ["host", "device"])
def test_l2_norm_counts_only_the_finite_entries(path: str) -> None:
    """NaN and infinities are left out of the norm, as out of every statistic; none: NaN."""
    tensor = torch.tensor([3.0, math.nan, 4.0, -math.inf, 0.0])
    assert moments(_prepared(tensor, path))[L2].item() == pytest.approx(5.0)
    nothing = torch.tensor([math.nan, math.inf])
    assert math.isnan(moments(_prepared(nothing, path))[L2].item())


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize(
    ("dtype", "magnitude"),
    [
        (torch.float64, 1e300),
        (torch.float64, 1e-300),
        (torch.float64, 1e-310),  # subnormal float64
        (torch.float32, 1e20),
        (torch.float32, 1e-30),
        (torch.float32, 1e-42),  # subnormal float32
        (torch.float16, 6e4),
    ],
)
def test_l2_norm_at_the_ends_of_the_float_range(
    path: str, dtype: torch.dtype, magnitude: float
) -> None:
    """Entries whose squares overflow or vanish still give the norm to rounding, both paths.

    The same power of two that scales ``rms`` scales the squares; a NaN among the entries
    sends the host path down the masked one too.
    """
    generator = torch.Generator().manual_seed(9)
    values = (torch.rand(50_001, generator=generator, dtype=torch.float64) * 1.6 - 0.6) * magnitude
    tensor = values.to(dtype)
    tensor[11] = math.nan
    result = moments(_prepared(tensor, path), chunk_size=16_384)[L2].item()
    expected = _exact_norm(tensor.to(torch.float64).numpy())
    info = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32)
    assert math.isfinite(result)
    assert result == pytest.approx(expected, rel=1e-12 if dtype == torch.float64 else 2e-6)
    assert expected < info.max


@pytest.mark.parametrize("path", ["host", "device"])
def test_a_norm_past_float32_is_infinite_like_vector_norm(path: str) -> None:
    """Where the true norm exceeds float32's largest float, the metric is inf, as torch's is."""
    top = torch.finfo(torch.float32).max
    tensor = torch.full((5,), top)
    assert moments(_prepared(tensor, path))[L2].item() == math.inf
    assert torch.linalg.vector_norm(tensor).item() == math.inf


def test_gradient_rows_carry_the_norm_clip_grad_norm_reports() -> None:
    """Through the engine, a layer's ``output_gradient`` norm is ``clip_grad_norm_`` of it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    sink = RecordingSink()
    captured: list[torch.Tensor] = []

    def keep_gradient(_module: nn.Module, _inputs: object, output: torch.Tensor) -> None:
        output.register_hook(captured.append)

    model[0].register_forward_hook(keep_gradient)
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        model(torch.randn(32, 8)).square().sum().backward()
    row = next(
        r
        for r in sink.rows
        if (r.layer, str(r.signal), r.metric) == ("0", "output_gradient", "l2_norm")
    )
    holder = nn.Parameter(torch.zeros_like(captured[0]))
    holder.grad = captured[0].clone()
    assert row.value == pytest.approx(nn.utils.clip_grad_norm_([holder], math.inf).item(), 1e-6)
