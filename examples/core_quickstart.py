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

import polars as pl
import torch
from torch import nn

from torchinstruments_core import EveryNForwardsSampler, inject_observer


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
    header = ("output std", "max_abs/rms", "grad rms", "non-finite")
    print(f"{'layer':<8}{'type':<11}" + "".join(f"{h:>13}" for h in header))
    for layer in result["layers"]:
        metrics = {m["signal"]: m["metrics"] for m in layer["measurements"] if m["call_index"] == 0}
        out, grad = metrics.get("output", {}), metrics.get("output_gradient", {})
        mean = {name: stats.get("mean") for name, stats in out.items()}
        cells = (
            mean.get("std"),
            _ratio(mean.get("max_abs"), mean.get("rms")),
            grad.get("rms", {}).get("mean"),
            out.get("nonfinite_fraction", {}).get("max"),
        )
        print(f"{layer['name']:<8}{layer['type']:<11}" + "".join(_fmt(c) for c in cells))
    first = (
        pl.scan_parquet(output_dir / "history.parquet")
        .filter((pl.col("metric") == "nonfinite_fraction") & (pl.col("value") > 0))
        .sort("sample_id")
        .select("sample_id", "layer", "signal", "value")
        .head(1)
        .collect()
    )
    if first.height:
        row = first.row(0, named=True)
        where = f"sample {row['sample_id']}, layer {row['layer']!r}, {row['signal']}"
        print(f"\nfirst non-finite values: {where}")
    else:
        print("\nno non-finite values in any sampled output or gradient")


def _fmt(value: float | None) -> str:
    return f"{value:>13.4g}" if value is not None else f"{'-':>13}"


def _ratio(max_abs: float | None, rms: float | None) -> float | None:
    return max_abs / rms if max_abs is not None and rms else None


if __name__ == "__main__":
    main()
