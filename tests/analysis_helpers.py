"""Small runs with planted faults, recorded for real, for the analysis tests."""

from __future__ import annotations

import importlib.util
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import polars as pl
import torch
from torch import nn

from torchinstruments_core import EveryNForwardsSampler, inject_observer

FAULT_AT = 4  # the fault starts after this many healthy samples (one sample per step)


class Gain(nn.Module):
    """Multiplies its input by ``gain`` (a plain attribute a test may change between steps)."""

    def __init__(self, gain: float = 1.0) -> None:
        super().__init__()
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def model(*extra: tuple[str, nn.Module]) -> nn.Sequential:
    """``fc1, relu1, fc2, act`` then ``extra`` modules, then ``head`` (named layers)."""
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    layers["fc1"] = nn.Linear(16, 32)
    layers["relu1"] = nn.ReLU()
    layers["fc2"] = nn.Linear(32, 32)
    layers.update(extra)
    layers["head"] = nn.Linear(32, 1)
    return nn.Sequential(layers)


def record(
    out: Path,
    net: nn.Module,
    *,
    steps: int = 12,
    fault: Callable[[nn.Module, int], None] | None = None,
    input_scale: float = 1.0,
    loss_scale: Callable[[int], float] = lambda step: 1.0,
    lr: float = 0.01,
    batch: int = 64,
    optimizer_steps: bool = False,
) -> Path:
    """Train ``net`` for ``steps`` steps sampling every forward; ``fault(net, step)`` runs first.

    ``optimizer_steps``: the optimizer's steps are recorded too (``update_to_weight``...).
    """
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    watched = optimizer if optimizer_steps else None
    sampler = EveryNForwardsSampler(1)
    with inject_observer(net, sampler=sampler, output_dir=out, optimizer=watched):
        for step in range(steps):
            if fault is not None:
                with torch.no_grad():
                    fault(net, step)
            x = torch.randn(batch, 16) * input_scale
            loss = (net(x) - x.sum(dim=1, keepdim=True) / 8).square().mean() * loss_scale(step)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return out


@dataclass(frozen=True, slots=True)
class FrameRun:
    """A run read from frames (several runs relabelled as ranks, or rows added by a test)."""

    path: Path
    history: pl.LazyFrame
    samples: pl.LazyFrame
    layers: Sequence[str]
    complete: bool = True


def load_example() -> ModuleType:
    """``examples/find_problems.py`` as a module."""
    path = Path(__file__).parents[1] / "examples" / "find_problems.py"
    spec = importlib.util.spec_from_file_location("find_problems", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["find_problems"] = module
    spec.loader.exec_module(module)
    return module
