"""Observe a plain PyTorch training loop with torchinstruments_core, then read the run.

    uv run examples/core_quickstart.py                 # a healthy run
    uv run examples/core_quickstart.py --explode-at 150  # the learning rate jumps at step 150:
                                                       # find the first layer that went non-finite

Trains a small MLP on a synthetic regression task on the CPU (a few seconds), samples every 10th
forward, and prints where the files are, how to open TensorBoard, and a per-layer table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from torchinstruments_core import EveryNForwardsSampler, inject_observer
from torchinstruments_core.run_directory import summarize_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--explode-at", type=int, default=None, help="multiply the lr by 1e4 here")
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args()
    output_dir = args.output_dir or Path("runs") / time.strftime("quickstart-%Y%m%d-%H%M%S")

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 128),
        nn.GELU(),
        nn.LayerNorm(128),
        nn.Linear(128, 128),
        nn.GELU(),
        nn.Linear(128, 1),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    target = torch.randn(32, 1)

    with inject_observer(model, sampler=EveryNForwardsSampler(10), output_dir=output_dir):
        for step in range(args.steps):
            if step == args.explode_at:
                for group in optimizer.param_groups:
                    group["lr"] *= 1e4
            x = torch.randn(64, 32)
            loss = (model(x) - x @ target).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    report(output_dir)


def report(output_dir: Path) -> None:
    result = json.loads((output_dir / "result.json").read_text())
    print(f"\nrun {result['run_id']}: {result['samples']['count']} samples in {output_dir}/")
    for name in ("history.parquet", "result.json", "index.md", "tensorboard/"):
        print(f"  {output_dir / name}")
    print(f"TensorBoard: tensorboard --logdir {output_dir / 'tensorboard'}\n")
    print(summarize_run(output_dir))


if __name__ == "__main__":
    main()
