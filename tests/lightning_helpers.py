"""A small LightningModule and trainer factory for the callback tests."""

from __future__ import annotations

import pathlib
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(pl.LightningModule):
    """Two linear layers; ``training_step`` calls the submodule, never ``self(x)``."""

    def __init__(
        self, fail_at_step: int | None = None, interrupt_at_step: int | None = None
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.fail_at_step = fail_at_step
        self.interrupt_at_step = interrupt_at_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.fail_at_step:
            raise RuntimeError("failure in training_step")
        if self.global_step == self.interrupt_at_step:
            raise KeyboardInterrupt
        x, y = batch
        loss = (self.net(x) - y).square().mean()
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", (self.net(x) - y).square().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader(batches: int = 16, batch_size: int = 4) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batches * batch_size, 4, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)


def trainer(root: pathlib.Path, **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = {
        "default_root_dir": root,
        "accelerator": "cpu",
        "devices": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "log_every_n_steps": 1,
        "num_sanity_val_steps": 0,
    }
    return pl.Trainer(**(defaults | kwargs))


def telemetry_dir(root: pathlib.Path) -> pathlib.Path:
    """The one run directory written under ``root``."""
    (history,) = [p.parent for p in root.rglob("history.parquet") if "rank-" not in p.parent.name]
    return history
