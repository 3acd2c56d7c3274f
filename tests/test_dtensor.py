"""DTensor outputs and gradients: measured from the local tensor, never by communicating."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from torchinstruments_core import AlwaysSampler, inject_observer
from torchinstruments_core.testing import RecordingSink

tensor_api = pytest.importorskip("torch.distributed.tensor")
mesh_api = pytest.importorskip("torch.distributed.device_mesh")


class ToDTensor(nn.Module):
    """Makes its input the local tensor of a DTensor with the given placement."""

    def __init__(self, placement: object) -> None:
        super().__init__()
        self.placement = placement

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = mesh_api.init_device_mesh("cpu", (dist.get_world_size(),))
        return tensor_api.DTensor.from_local(x, mesh, [self.placement], run_check=False)


class ToLocal(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to_local()  # type: ignore[attr-defined]


def _model(placement: object) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), ToDTensor(placement), ToLocal())


def _moments(x: torch.Tensor) -> dict[str, float]:
    x = x.detach().double().reshape(-1)
    return {
        "mean": x.mean().item(),
        "std": x.std(unbiased=False).item(),
        "max_abs": x.abs().max().item(),
    }


def _observe(model: nn.Module, x: torch.Tensor) -> RecordingSink:
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, rank_policy="all"):
        model(x).square().sum().backward()
    return sink


def _values(sink: RecordingSink, layer: str, signal: str) -> dict[str, float | None]:
    return {r.metric: r.value for r in sink.rows if (r.layer, str(r.signal)) == (layer, signal)}


def _reasons(sink: RecordingSink, layer: str) -> set[str | None]:
    return {r.unavailable_reason for r in sink.rows if r.layer == layer}


@pytest.fixture
def one_process_group(tmp_path: pathlib.Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("placement", ["replicate", "shard"])
def test_a_dtensor_output_and_its_gradient_are_measured(placement: str) -> None:
    """A Replicate or Shard DTensor gives the statistics of its local tensor, forward and back.

    On one rank the local tensor is the whole tensor, so the rows equal the statistics of the
    values the module produced, and of the gradient the loss sends back (``2 * output``).
    """
    kinds = {"replicate": tensor_api.Replicate(), "shard": tensor_api.Shard(0)}
    model = _model(kinds[placement])
    x = torch.randn(5, 4)
    sink = _observe(model, x)
    output = model[0](x)
    for signal, expected in (
        ("output", _moments(output)),
        ("output_gradient", _moments(2 * output)),
    ):
        got = _values(sink, "1", signal)
        for metric, value in expected.items():
            assert got[metric] == pytest.approx(value, rel=1e-6), (signal, metric)
    assert all((r.value is None) == (r.unavailable_reason is not None) for r in sink.rows)


@pytest.mark.usefixtures("one_process_group")
def test_a_partial_dtensor_has_no_value() -> None:
    """A Partial DTensor's local tensor is an unreduced summand: partial_dtensor, no warning."""
    model = _model(tensor_api.Partial())
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        model(torch.randn(5, 4))
    assert _reasons(sink, "1") == {"partial_dtensor"}
    assert all(r.value is None for r in sink.rows if r.layer == "1")


def _shard_worker(rank: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rdv", rank=rank, world_size=2)
    try:
        model = _model(tensor_api.Shard(0))
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
        sink = _observe(model, x)
        result = {"rows": _values(sink, "1", "output"), "expected": _moments(model[0](x))}
        pathlib.Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_sharded_dtensor_gives_each_rank_its_own_shard(tmp_path: pathlib.Path) -> None:
    """On two gloo ranks, each rank's rows describe its own shard: no collective, no hang."""
    mp.spawn(_shard_worker, args=(str(tmp_path),), nprocs=2, join=True)  # type: ignore[attr-defined]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for result in results:
        for metric, value in result["expected"].items():
            assert result["rows"][metric] == pytest.approx(value, rel=1e-6), metric
    assert results[0]["rows"]["mean"] != pytest.approx(results[1]["rows"]["mean"])
