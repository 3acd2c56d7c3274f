"""The per-layer table a training script prints at the end of a run."""

from __future__ import annotations

import pathlib

import torch
from torch import nn

from torchinstruments_core import AlwaysSampler, inject_observer
from torchinstruments_core.run_directory import summarize_run


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features_with_a_long_name = nn.Conv2d(1, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.features_with_a_long_name(x)))


def test_summary_names_whole_types_and_says_the_columns_are_run_means(
    tmp_path: pathlib.Path,
) -> None:
    """Type and layer names appear whole; the first line says the columns average 3 samples."""
    model = Classifier()
    with inject_observer(model, sampler=AlwaysSampler(), output_dir=tmp_path / "run"):
        for _ in range(3):
            model(torch.randn(2, 1, 8, 8)).sum().backward()
    lines = summarize_run(tmp_path / "run").splitlines()
    assert "means over the run's 3 samples" in lines[0]
    assert lines[2].split()[:2] == ["layer", "type"]
    rows = {line.split()[0]: line.split()[1] for line in lines[3:-1]}
    assert rows["features_with_a_long_name"] == "Conv2d"
    assert rows["pool"] == "AdaptiveAvgPool2d"
    assert rows["head.1"] == "Linear"
