"""Train a small MLP with Lightning Fabric, TensorBoard, CSV and FabricTelemetry, then read it.

    python examples/fabric_training.py
    python examples/fabric_training.py --devices 2 --rank-policy all   # two CPU processes (gloo)

A synthetic regression task on the CPU (a few seconds), two micro-batches per optimizer step
(``fabric.no_backward_sync``), telemetry of every 20th optimizer step routed into Fabric's
TensorBoard and CSV loggers. The loop has no telemetry call in it: ``fabric.setup`` attaches the
callback. Ends by printing where the files are, how to open TensorBoard, and a per-layer table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers.csv_logs import CSVLogger
from lightning.fabric.loggers.tensorboard import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments_core.run_directory import summarize_run
from torchinstruments_lightning import FabricTelemetry

ACCUMULATE = 2


def synthetic_data(samples: int = 4096) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=generator)
    w = torch.randn(16, 4, generator=generator)
    return TensorDataset(x, torch.sin(x @ w) + 0.1 * torch.randn(samples, 4, generator=generator))


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(),
        nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU(),
        nn.Linear(64, 4),
    )  # fmt: skip


def train(fabric: Fabric, epochs: int) -> int:
    """An ordinary Fabric loop; returns the number of optimizer steps."""
    model = mlp()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    loader = fabric.setup_dataloaders(DataLoader(synthetic_data(), batch_size=32, shuffle=True))
    optimizer_steps = 0
    for _ in range(epochs):
        for i, (x, y) in enumerate(loader):
            stepping = (i + 1) % ACCUMULATE == 0
            with fabric.no_backward_sync(model, enabled=not stepping):
                loss = nn.functional.mse_loss(model(x), y)
                fabric.backward(loss / ACCUMULATE)
            if stepping:
                # the telemetry's step is this count (0, 1, 2 … before the step): log under it
                fabric.log("train/loss", loss.item(), step=optimizer_steps)
                optimizer.step()
                optimizer.zero_grad()
                optimizer_steps += 1
    fabric.call("on_train_end")  # finishes the telemetry: the run directory is final
    for logger in fabric.loggers:
        logger.finalize("success")
    return optimizer_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("runs/fabric_training"))
    parser.add_argument("--every-n-steps", type=int, default=20)
    parser.add_argument("--rank-policy", choices=["rank0", "all"], default="rank0")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    telemetry = FabricTelemetry(every_n_steps=args.every_n_steps, rank_policy=args.rank_policy)
    tensorboard = TensorBoardLogger(args.root, name="tensorboard")
    fabric = Fabric(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp_spawn" if args.devices > 1 else "auto",
        callbacks=[telemetry],
        loggers=[tensorboard, CSVLogger(args.root, name="csv")],
    )
    # Resolved before the launch, so that spawned processes and this one agree on version_N.
    log_dir = Path(tensorboard.log_dir)
    # Under ddp_spawn the processes train with copies of the telemetry: read the folder instead.
    steps = fabric.launch(train, args.epochs)
    folder = log_dir / "telemetry"
    run = folder / "rank-000" if args.rank_policy == "all" else folder
    print(f"\n{steps} optimizer steps; telemetry of every {args.every_n_steps}th in")
    print(f"  {folder}/  (history.parquet, samples.parquet, result.json, index.md)")
    print(f"TensorBoard (loss and telemetry): tensorboard --logdir {log_dir}\n")
    print(summarize_run(run))


if __name__ == "__main__":
    main()
