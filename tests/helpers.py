"""Small models and sinks shared by the engine tests."""

from __future__ import annotations

import torch
from torch import nn

from torchinstruments_core.testing import RecordingSink


class CountingReducer:
    """A reducer that counts its calls (to prove that unsampled forwards run none)."""

    metrics = ("count_probe",)

    def __init__(self) -> None:
        self.calls = 0

    def reduce(self, tensor: object) -> torch.Tensor:
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
