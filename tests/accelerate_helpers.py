"""A small model, a training loop and readers for the TelemetryTracker tests."""

from __future__ import annotations

import pathlib
from typing import Any

import polars as pl
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.tracking import GeneralTracker
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments_accelerate import TelemetryTracker


class Regressor(nn.Module):
    """Two linear layers; names ``net.0``, ``net.1``, ``net.2``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Tagged(nn.Module):
    """A regressor whose layer ``tag`` outputs the batch's number, column 0 of its input.

    The telemetry of ``tag`` (``max_abs`` of its output) then says which batch a sample was.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tag = nn.Identity()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tag(x[:, :1])
        return self.net(x[:, 1:])


def tagged_loader(batches: int = 32, batch_size: int = 4) -> DataLoader[Any]:
    """Batches for ``Tagged``: batch ``i`` carries ``i`` in column 0 of every row."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batches * batch_size, 5, generator=generator)
    x[:, 0] = torch.arange(batches).repeat_interleave(batch_size).float()
    return DataLoader(TensorDataset(x, x[:, 1:].sum(1, keepdim=True)), batch_size=batch_size)


class RecordingTracker(GeneralTracker):  # type: ignore[misc]
    """A tracker that takes scalars only and remembers every ``log`` call."""

    name = "recording"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[dict[str, Any], int | None]] = []

    @property
    def tracker(self) -> list[tuple[dict[str, Any], int | None]]:
        return self.calls

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.calls.append((dict(values), step))


def tensorboard_accelerator(
    root: pathlib.Path, telemetry: TelemetryTracker, accumulation: int
) -> Accelerator:
    """Accelerate's examples' set-up: TensorBoard and ``telemetry`` under ``root``, trackers on."""
    accelerator = Accelerator(
        cpu=True,
        log_with=["tensorboard", telemetry],
        project_dir=root,
        gradient_accumulation_steps=accumulation,
    )
    accelerator.init_trackers("exp")
    return accelerator


def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide singletons, as Accelerate's own test cases do."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def loader(batches: int = 16, batch_size: int = 4) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batches * batch_size, 4, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)


def train(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: DataLoader[Any],
    *,
    steps: int,
    user_step: int | None = None,
) -> None:
    """The loop of Accelerate's examples; logs the loss at ``user_step + k + 1`` after step k."""
    completed = 0
    for x, y in data:
        with accelerator.accumulate(model):
            loss = (model(x).float() - y).square().mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed += 1
            if user_step is not None:
                accelerator.log({"loss": loss.item()}, step=user_step + completed)
            if completed == steps:
                return
    raise AssertionError("the loader ran out before the last step")


def setup(
    root: pathlib.Path,
    telemetry: TelemetryTracker,
    *,
    log_with: list[Any],
    watch: bool = True,
    **kwargs: Any,
) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer, DataLoader[Any]]:
    """An Accelerator on the CPU with ``log_with``, trackers started, objects prepared, watched."""
    accelerator = Accelerator(cpu=True, log_with=log_with, project_dir=root, **kwargs)
    accelerator.init_trackers("exp")
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    prepared = accelerator.prepare(model, optimizer, loader(batches=64))
    if watch:
        telemetry.watch(prepared[0], accelerator=accelerator)
    return accelerator, *prepared


def events(folder: pathlib.Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "histograms": 0})
    accumulator.Reload()
    return accumulator


def samples(folder: pathlib.Path, kind: str | None = "forward") -> pl.DataFrame:
    """``samples.parquet``: the forward samples (``kind=None``: the step records too)."""
    frame = pl.read_parquet(folder / "samples.parquet")
    return frame if kind is None else frame.filter(pl.col("kind") == kind)


def hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def two_process_run(root: str, policy: str) -> None:
    """One process of the two-process test: TensorBoard and telemetry, five optimizer steps.

    The loop logs step k + 1 after step k (``accelerator.log`` runs on the main process only).
    """
    telemetry = TelemetryTracker(every_n_steps=2, rank_policy=policy)
    accelerator, model, optimizer, data = setup(
        pathlib.Path(root), telemetry, log_with=["tensorboard", telemetry]
    )
    train(accelerator, model, optimizer, data, steps=5, user_step=0)
    accelerator.end_training()
    telemetry.finish()  # Accelerate finishes trackers on the main process only
