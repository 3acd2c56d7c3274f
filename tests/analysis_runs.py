"""Runs made for the analysis tests: real observers on small models, or rank folders by hand."""

from __future__ import annotations

from typing import TYPE_CHECKING

import polars as pl
import torch
from torch import nn

from torchinstruments_core import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments_core.run_directory import RunDirectorySink, history_schema

if TYPE_CHECKING:
    from pathlib import Path


class Blowup(nn.Module):
    """Identity until armed; then its output is multiplied by inf (a forward NaN/Inf source)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float("inf") if self.armed else x


class _InfGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class GradientBlowup(nn.Module):
    """Identity in the forward; once armed its backward multiplies the gradient by inf."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _InfGradient.apply(x) if self.armed else x.clone()


def blowup_model(kind: type[nn.Module] = Blowup) -> nn.Sequential:
    """``0`` Linear, ``1`` ReLU, ``2`` the blowup, ``3`` Linear, ``4`` Tanh."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), kind(), nn.Linear(8, 3), nn.Tanh())


def train(model: nn.Sequential, folder: Path, *, healthy: int, broken: int = 0, scale: float = 1.0):
    """Sample every step: ``healthy`` steps, then ``broken`` with the blowup armed."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = RunDirectorySink(folder, tensorboard=False)
    observer = inject_observer(model, sampler=EveryNForwardsSampler(1), sink=sink)
    try:
        for step in range(healthy + broken):
            blowup = model[2]
            assert isinstance(blowup, Blowup | GradientBlowup)
            blowup.armed = step >= healthy
            run_step(model, optimizer, scale)
    finally:
        remove_observer(observer)


def run_step(model: nn.Module, optimizer: torch.optim.Optimizer, scale: float = 1.0) -> None:
    torch.manual_seed(1)
    loss = model(torch.randn(16, 4) * scale).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def write_rank_folders(root: Path, values: dict[int, list[float]], layers: list[str]) -> None:
    """A finished two-rank run by hand: ``rank-NNN/`` each with history and result.json.

    Rank ``r`` has one sample per entry of ``values[r]``; every layer's ``output`` ``rms`` is
    that entry times (layer position + 1).
    """
    import json

    for rank, per_sample in values.items():
        folder = root / f"rank-{rank:03d}"
        folder.mkdir(parents=True)
        rows = [
            {
                "run_id": "hand",
                "rank": rank,
                "sample_id": sample,
                "step": sample * 10,
                "timestamp": None,
                "layer": layer,
                "call_index": 0,
                "signal": "output",
                "tensor_path": "output",
                "metric": "rms",
                "value": value * (position + 1),
                "unavailable_reason": None,
            }
            for sample, value in enumerate(per_sample)
            for position, layer in enumerate(layers)
        ]
        pl.DataFrame(rows, schema=history_schema()).write_parquet(folder / "history.parquet")
        result = {"status": "complete", "layers": [{"name": name} for name in layers]}
        (folder / "result.json").write_text(json.dumps(result))
