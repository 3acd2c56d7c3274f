"""TelemetryMonitor names the first non-finite layer, samples densely after it, stops, raises."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import polars as pl_frame
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from lightning_helpers import loader, telemetry_dir, trainer
from torchinstruments_core import NonFiniteError
from torchinstruments_lightning import TelemetryMonitor

if TYPE_CHECKING:
    import pathlib


class Bomb(nn.Module):
    """Multiplies by NaN once armed: the layer where the forward goes non-finite."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float("nan") if self.armed else x


class Exploding(pl.LightningModule):
    """``net.1`` turns the forward non-finite from ``global_step == from_step`` on."""

    def __init__(self, from_step: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), Bomb(), nn.Linear(8, 1))
        self.from_step = from_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        bomb = self.net[1]
        assert isinstance(bomb, Bomb)
        bomb.armed = self.global_step >= self.from_step
        x, y = batch
        return (self.net(x) - y).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(tmp_path: pathlib.Path, model: Exploding, max_steps: int, **options: Any) -> pl.Trainer:
    monitor = TelemetryMonitor(**options)
    logger = TensorBoardLogger(tmp_path)
    run = trainer(tmp_path, max_steps=max_steps, logger=logger, callbacks=[monitor])
    run.fit(model, loader(batches=32))
    return run


def _sampled_steps(root: pathlib.Path) -> list[int]:
    samples = pl_frame.read_parquet(telemetry_dir(root) / "samples.parquet")
    return sorted(samples.filter(pl_frame.col("kind") == "forward")["step"].to_list())


def _events(root: pathlib.Path) -> EventAccumulator:
    (version,) = root.rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(version.parent), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def test_a_non_finite_sample_is_named_logged_and_sampled_densely(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A NaN sample is named in the log and TensorBoard at its step, then sampled densely.

    The message names the first layer forward and backward; TensorBoard holds the text and the
    onset scalar at that step; the next ``sample_after_nonfinite`` steps are sampled; training
    goes on under ``"warn"``.
    """
    with caplog.at_level(logging.INFO, logger="torchinstruments"):
        run = _fit(tmp_path, Exploding(from_step=5), 10, every_n_steps=5, sample_after_nonfinite=3)
    assert run.global_step == 10
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "TelemetryMonitor: non-finite values at step 5" in warning
    assert "forward: first at 'net.1' output, 100% non-finite (started there" in warning
    assert "backward: first at 'net.2' output_gradient" in warning
    assert any("until step 8" in r.getMessage() for r in caplog.records)
    assert _sampled_steps(tmp_path) == [0, 5, 6, 7, 8]
    events = _events(tmp_path)
    onset = events.Scalars("telemetry/nonfinite_onset")
    assert [(e.step, e.value) for e in onset] == [(5, 1.0)]
    (text,) = events.Tensors("telemetry/nonfinite/text_summary")
    assert text.step == 5
    assert "'net.1' output" in text.tensor_proto.string_val[0].decode()


def test_a_non_finite_loss_samples_the_following_steps(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A NaN loss at an unsampled step (3) has the following steps sampled.

    The first of them, where the NaN has reached the weights, names the first layer ``net.0``
    (and, being non-finite itself, extends the window by one step, to 7).
    """
    with caplog.at_level(logging.INFO, logger="torchinstruments"):
        _fit(tmp_path, Exploding(from_step=3), 8, every_n_steps=10, sample_after_nonfinite=3)
    assert _sampled_steps(tmp_path) == [0, 4, 5, 6, 7]
    assert any("the loss became non-finite at step 3" in r.getMessage() for r in caplog.records)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "non-finite values at step 4" in warning
    assert "forward: first at 'net.0' output" in warning


def test_stop_ends_the_fit_after_the_onset(tmp_path: pathlib.Path) -> None:
    """``on_nonfinite="stop"``: the fit ends after the batch of the onset."""
    run = _fit(tmp_path, Exploding(from_step=5), 20, every_n_steps=5, on_nonfinite="stop")
    assert run.global_step == 6
    assert _sampled_steps(tmp_path) == [0, 5]


def test_raise_ends_the_fit_with_a_complete_run_directory(tmp_path: pathlib.Path) -> None:
    """``on_nonfinite="raise"``: ``NonFiniteError`` out of fit; history.parquet is complete.

    The error names the step and the layer; the monitor's exception hook finalizes the run.
    """
    with pytest.raises(NonFiniteError, match=r"step 5.*'net.1' output"):
        _fit(tmp_path, Exploding(from_step=5), 20, every_n_steps=5, on_nonfinite="raise")
    history = pl_frame.read_parquet(telemetry_dir(tmp_path) / "history.parquet")
    nan_rows = history.filter(
        (pl_frame.col("metric") == "nonfinite_fraction") & (pl_frame.col("value") > 0)
    )
    assert set(nan_rows["step"].to_list()) == {5}
    assert "net.1" in nan_rows["layer"].to_list()
