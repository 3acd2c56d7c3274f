"""What the Lightning monitor costs as users run it: defaults, a TensorBoardLogger, one process.

    uv run python benchmarks/lightning_cost.py [--workload mnist-mlp] [--steps 600]
        [--every 50] [--repeats 2]

``paired.py`` times the core observer with the run directory. A ``TelemetryMonitor`` with its
defaults does more on a sampled step: it records the optimizer step signals (the parameters,
their gradients, the update and Adam's moments, ``step_signals``) and routes each sample's
scalars and focus histograms, and the step record's, into the trainer's loggers on the
training thread. Here a workload of ``benchmarks/`` trains in ``Trainer.fit`` with a
``TensorBoardLogger``, in three configurations, each fit ``--steps`` optimizer steps, the
configurations alternating ``--repeats`` times in one process:

- ``plain``: no monitor;
- ``monitor``: ``TelemetryMonitor(every_n_steps=--every)``, its defaults otherwise;
- ``no loggers``: the same with ``log_to_loggers=False`` (the run directory only).

A callback times each batch from ``on_train_batch_start`` to ``on_train_batch_end``, placed
after the monitor's, so a sample's close and delivery are in its batch. The first quarter of
each fit is left out (the writer process starts then). Fits run one after another, and on a
shared machine one fit's batches can run 10 % faster or slower than the next's, so each fit's
sampled batch (the median at the sampled places, every ``--every``-th) and the batch right
after it (where what the sample left to other threads lands) are divided by the median of
that fit's other batches; the plain fit's places are divided alike, which shows the spread.
Reported per configuration: those two ratios (the median over the fits), the milliseconds of
the sampled batch and of the other batches, and the cost of one sample in 50 steps (the
adapters' default), computed as ``1 + (sampled - 1 + after - 1) / 50``: what an unsampled
step costs the observer (microseconds, ``paired.py``) is left out.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import lightning as L
import torch
from _overhead_workloads import WORKLOADS, build
from torch.utils.data import DataLoader

from torchinstruments_lightning import TelemetryMonitor

CONFIGURATIONS = ("plain", "monitor", "no loggers")


class _Module(L.LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        workload = build(name, torch.device("cpu"))
        self.model, self._loss = workload.model, workload.loss_fn
        self.batches = workload.batches

    def training_step(self, batch: Any, _index: int) -> torch.Tensor:
        x, y = batch
        return self._loss(self.model, x, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class _Timer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._started = 0.0

    def on_train_batch_start(self, *_args: Any) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, *_args: Any) -> None:
        self.times.append(time.perf_counter() - self._started)


def _fit(name: str, configuration: str, steps: int, every: int) -> list[float]:
    """Each batch's seconds in one fit of ``steps`` steps."""
    module = _Module(name)
    batches = module.batches
    # batch_size=None: the workload's batches as they are, one a step
    steps_batches = [batches[index % len(batches)] for index in range(steps)]
    loader: DataLoader[Any] = DataLoader(steps_batches, batch_size=None)  # type: ignore[arg-type]
    timer = _Timer()
    callbacks: list[L.Callback] = [timer]
    if configuration != "plain":
        monitor = TelemetryMonitor(every_n_steps=every, log_to_loggers=configuration == "monitor")
        callbacks.insert(0, monitor)
    with tempfile.TemporaryDirectory() as folder:
        trainer = L.Trainer(
            default_root_dir=folder,
            max_steps=steps,
            callbacks=callbacks,
            logger=L.pytorch.loggers.TensorBoardLogger(folder),
            accelerator="cpu",
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            log_every_n_steps=50,
        )
        trainer.fit(module, loader)
    return timer.times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="mnist-mlp", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    times: dict[str, list[list[float]]] = {name: [] for name in CONFIGURATIONS}
    for repeat in range(args.repeats):
        for configuration in CONFIGURATIONS:
            print(f"{args.workload}: {configuration}, fit {repeat + 1}/{args.repeats}", flush=True)
            times[configuration].append(_fit(args.workload, configuration, args.steps, args.every))
    skip = args.steps // 4
    print(f"\n{WORKLOADS[args.workload].description}; Trainer.fit, TensorBoardLogger, ", end="")
    print(f"{args.steps} steps a fit, {args.repeats} fits each, one step in {args.every} sampled\n")
    print(
        "| configuration | sampled batch over the others | the batch after it | "
        "sampled batch (ms) | other batches (ms) | one sample in 50 steps (computed) |"
    )
    print("|---|---|---|---|---|---|")
    for configuration in CONFIGURATIONS:
        sampled, after, sampled_ms, others_ms = [], [], [], []
        for fit in times[configuration]:
            kept = list(enumerate(fit))[skip:]
            others = statistics.median(t for i, t in kept if i % args.every > 1)
            at = statistics.median(t for i, t in kept if i % args.every == 0)
            sampled.append(at / others)
            after.append(statistics.median(t for i, t in kept if i % args.every == 1) / others)
            sampled_ms.append(at * 1e3)
            others_ms.append(others * 1e3)
        ratio, next_ratio = statistics.median(sampled), statistics.median(after)
        fifty = 1 + (ratio - 1 + next_ratio - 1) / 50
        print(
            f"| {configuration} | {ratio:.3f}x | {next_ratio:.3f}x | "
            f"{statistics.median(sampled_ms):.2f} | {statistics.median(others_ms):.2f} | "
            f"{fifty:.4f}x |"
        )


if __name__ == "__main__":
    main()
