"""Small models and sinks shared by the engine tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from torchinstruments_core.testing import RecordingSink

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchinstruments_core import Observer
    from torchinstruments_core.reducers import PreparedTensor


class CountingReducer:
    """A reducer that counts its calls (to prove that unsampled forwards run none)."""

    metrics = ("count_probe",)

    def __init__(self) -> None:
        self.calls = 0

    def reduce(self, tensor: PreparedTensor) -> torch.Tensor:
        self.calls += 1
        values = tensor.values
        return values.new_zeros(1)


class FailingReducer:
    """A reducer that always raises."""

    metrics = ("fails",)

    def reduce(self, tensor: object) -> torch.Tensor:
        raise RuntimeError("boom")


class FailingSink(RecordingSink):
    """A sink whose ``write`` raises."""

    def write(self, sample: object) -> None:
        raise OSError("disk full")


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def rows_of(sink: RecordingSink, sample_id: int | None = None) -> list[tuple[str, int, str, str]]:
    """(layer, call_index, signal, tensor_path) of every row, deduplicated, in order."""
    seen: dict[tuple[str, int, str, str], None] = {}
    for sample in sink.samples:
        if sample_id is None or sample.sample_id == sample_id:
            for row in sample.rows:
                seen[(row.layer, row.call_index, str(row.signal), row.tensor_path)] = None
    return list(seen)


def values_by_row(sink: RecordingSink) -> dict[tuple[int, str, str, str, str], float | None]:
    """Every recorded value, keyed by sample id, layer, signal, tensor path and metric."""
    return {
        (sample.sample_id, row.layer, str(row.signal), row.tensor_path, row.metric): row.value
        for sample in sink.samples
        for row in sample.rows
    }


def train_side_by_side(
    pairs: list[tuple[Observer, nn.Module]],
    x: torch.Tensor,
    steps: int,
    sampled: Callable[[int], bool],
    after_step: Callable[[int], None] | None = None,
) -> None:
    """Step every ``(observer, model)`` pair on ``x``; ``sampled(step)`` picks the sampled steps."""
    for step in range(steps):
        for observer, model in pairs:
            observer.begin_step(step, sample=sampled(step))
            model(x).square().mean().backward()
            observer.end_step()
        if after_step is not None:
            after_step(step)


def floats(values: torch.Tensor | list[float] | float | None) -> list[float]:
    """A measurement's values as floats.

    A tensor's are read back; host floats (the compiled kernels' values of a CPU tensor) are
    taken as they are.
    """
    assert values is not None
    if isinstance(values, torch.Tensor):
        listed = values.tolist()
        return listed if isinstance(listed, list) else [listed]
    return values if isinstance(values, list) else [values]
