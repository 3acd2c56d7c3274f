"""Train a small MLP with Accelerate, TensorBoard and TelemetryTracker, then read the telemetry.

    python examples/accelerate_training.py
    accelerate launch --cpu --num_processes 2 examples/accelerate_training.py
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_training.py --cpu \
        --rank-policy all     # two CPU processes, one directory per rank (gloo)

(``accelerate launch --cpu`` starts a single process unless MPI is configured; two processes on
the CPU need the torchrun launcher of ``--multi_gpu`` and ``Accelerator(cpu=True)``.)

A synthetic regression task on the CPU (a few seconds), two micro-batches per optimizer step,
telemetry of every 20th optimizer step routed into Accelerate's TensorBoard tracker. Ends by
printing where the files are, how to open TensorBoard, and a per-layer table of the run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments_accelerate import TelemetryTracker
from torchinstruments_core.run_directory import summarize_run


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project-dir", type=Path, default=Path("runs/accelerate_training"))
    parser.add_argument("--every-n-steps", type=int, default=20)
    parser.add_argument("--rank-policy", choices=["rank0", "all"], default="rank0")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--cpu", action="store_true", help="Accelerator(cpu=True)")
    args = parser.parse_args()

    telemetry = TelemetryTracker(every_n_steps=args.every_n_steps, rank_policy=args.rank_policy)
    accelerator = Accelerator(
        cpu=args.cpu,
        log_with=["tensorboard", telemetry],
        project_dir=args.project_dir,
        gradient_accumulation_steps=2,
    )
    accelerator.init_trackers("mlp", config={"lr": 3e-3, "every_n_steps": args.every_n_steps})
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(synthetic_data(), batch_size=32, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    telemetry.watch(model, accelerator=accelerator)  # every process; routing on the main one

    completed_steps = 0
    for _ in range(args.epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                accelerator.log({"train/loss": loss.item()}, step=completed_steps)
    accelerator.end_training()
    telemetry.finish()  # end_training() finishes trackers on the main process only

    if accelerator.is_main_process and telemetry.run_directory is not None:
        folder = telemetry.run_directory
        run = folder / "rank-000" if args.rank_policy == "all" else folder
        print(f"\n{completed_steps} optimizer steps; telemetry of every {args.every_n_steps}th in")
        print(f"  {folder}/  (history.parquet, samples.parquet, result.json, index.md)")
        print(f"TensorBoard (loss and telemetry): tensorboard --logdir {args.project_dir}\n")
        print(summarize_run(run))


if __name__ == "__main__":
    main()
