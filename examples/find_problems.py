"""Plant six common training faults, record each run, and let the findings name them.

    uv run examples/find_problems.py --out runs/find_problems
    uv run --with "matplotlib>=3.8" examples/find_problems.py --out runs/find_problems  # + plots

Each fault runs three times on the CPU (a second or two each): ``baseline`` (no fault),
``broken`` (the fault starts after four healthy samples) and ``fixed`` (the same accident, with
the fix in place). Every forward is sampled; after each run the script prints the findings
(``torchinstruments_analysis.findings.find``) and, with matplotlib installed, writes a report
folder (heatmaps, chosen layers over steps, ``findings.md``) per run.

The faults and their fixes:

- ``dead_relu``: a large negative bias is injected into ``fc2``, so every unit of ``relu2`` is
  inactive (``dead_units``). Fix: a ``LayerNorm`` before the ReLU removes the shift.
- ``sigmoid_saturation``: the weights of ``fc2`` are scaled up 100 times, so ``sigmoid`` sits at
  0 and 1 (``saturation``). Fix: a ``LayerNorm`` before the sigmoid.
- ``growing_scale``: ``gain`` multiplies its output by a factor that doubles every step (a gain
  updated with ``*=`` instead of ``=``) (``scale_drift``). Fix: the gain is set, not multiplied.
- ``invalid_log``: the data starts holding negative values, and ``log`` takes their logarithm
  (``nonfinite_onset``, first in ``log``). Fix: ``log`` clamps its input to a small positive value.
- ``detached_branch``: ``branch_b``'s output is detached from the graph, so its layers get no
  gradient (``gradient_lost``). Fix: no detach.
- ``learning_rate``: a schedule multiplies the learning rate by 10 at every step (``lr *= 10``
  instead of ``lr = peak``), so each update becomes a large part of its weight
  (``update_to_weight``, recorded by ``inject_observer(..., optimizer=optimizer)``). Fix: the
  schedule sets the learning rate to its peak (twice the base), once.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from enum import StrEnum
from pathlib import Path

import torch
from torch import nn

from torchinstruments_analysis.findings import Rule, find
from torchinstruments_analysis.read import open_run
from torchinstruments_core import EveryNForwardsSampler, inject_observer

HEALTHY_SAMPLES = 4  # the fault starts after this many healthy samples (one per step)
STEPS = 12


class Fault(StrEnum):
    DEAD_RELU = "dead_relu"
    SIGMOID_SATURATION = "sigmoid_saturation"
    GROWING_SCALE = "growing_scale"
    INVALID_LOG = "invalid_log"
    DETACHED_BRANCH = "detached_branch"
    LEARNING_RATE = "learning_rate"


class Variant(StrEnum):
    BASELINE = "baseline"
    BROKEN = "broken"
    FIXED = "fixed"


# the rule that names each fault and the layer it names first (gradients: in backward order)
EXPECTED: dict[Fault, tuple[Rule, str]] = {
    Fault.DEAD_RELU: (Rule.DEAD_UNITS, "relu2"),
    Fault.SIGMOID_SATURATION: (Rule.SATURATION, "sigmoid"),
    Fault.GROWING_SCALE: (Rule.SCALE_DRIFT, "gain"),
    Fault.INVALID_LOG: (Rule.NONFINITE_ONSET, "log"),
    Fault.DETACHED_BRANCH: (Rule.GRADIENT_LOST, "branch_b.1"),
    Fault.LEARNING_RATE: (Rule.UPDATE_TO_WEIGHT, "head"),
}


class Gain(nn.Module):
    """Multiplies by a gain; ``grow`` doubles it (the bug) or keeps it at 2 (the fix)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = 1.0

    def step(self, *, grow: bool) -> None:
        self.gain = self.gain * 2 if grow else 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Log(nn.Module):
    """``log(x)``, clamping ``x`` to a small positive value when ``clamp`` (the fix)."""

    def __init__(self, *, clamp: bool) -> None:
        super().__init__()
        self.clamp = clamp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x.clamp_min(1e-6) if self.clamp else x)


class TwoBranches(nn.Module):
    """A trunk feeding two branches whose sum feeds the head; ``detach`` cuts branch b off."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.branch_a = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
        self.branch_b = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)
        self.detach = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        b = self.branch_b(h)
        return self.head(self.branch_a(h) + (b.detach() if self.detach else b))


def build(fault: Fault, variant: Variant) -> nn.Module:
    """The model of a fault; the fixed variant carries the fix."""
    fixed = variant is Variant.FIXED
    if fault is Fault.DETACHED_BRANCH:
        return TwoBranches()
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    if fault is Fault.INVALID_LOG:
        layers["log"] = Log(clamp=fixed)
    layers["fc1"] = nn.Linear(16, 32)
    layers["relu1"] = nn.ReLU()
    layers["fc2"] = nn.Linear(32, 32)
    if fixed and fault in (Fault.DEAD_RELU, Fault.SIGMOID_SATURATION):
        layers["norm"] = nn.LayerNorm(32)
    if fault is Fault.SIGMOID_SATURATION:
        layers["sigmoid"] = nn.Sigmoid()
    else:
        layers["relu2"] = nn.ReLU()
    if fault is Fault.GROWING_SCALE:
        layers["gain"] = Gain()
    layers["head"] = nn.Linear(32, 1)
    return nn.Sequential(layers)


def base_lr(fault: Fault) -> float:
    """The learning rate before any accident.

    The learning-rate fault starts from 1e-3: at 0.01 every update of ``head.weight`` is already
    ~7% of the weight on this data, near the ``update_to_weight`` band's top (0.1).
    """
    return 1e-3 if fault is Fault.LEARNING_RATE else 0.01


@torch.no_grad()
def inject(
    fault: Fault, variant: Variant, model: nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> None:
    """The accident of ``fault`` at ``step`` (from the first step after the healthy samples)."""
    if variant is Variant.BASELINE or step < HEALTHY_SAMPLES:
        return
    if fault is Fault.LEARNING_RATE:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * 10 if variant is Variant.BROKEN else 2 * base_lr(fault)
        return
    if fault is Fault.GROWING_SCALE:
        model.get_submodule("gain").step(grow=variant is Variant.BROKEN)  # type: ignore[operator]
    elif fault is Fault.DETACHED_BRANCH:
        model.detach = variant is Variant.BROKEN  # type: ignore[assignment]
    elif step == HEALTHY_SAMPLES and fault is Fault.DEAD_RELU:
        model.get_submodule("fc2").bias.sub_(100.0)
    elif step == HEALTHY_SAMPLES and fault is Fault.SIGMOID_SATURATION:
        model.get_submodule("fc2").weight.mul_(100.0)


def batch(fault: Fault, variant: Variant, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets; the invalid-log data turns negative after the healthy samples."""
    x = torch.rand(64, 16) + 0.5
    if fault is Fault.INVALID_LOG and variant is not Variant.BASELINE and step >= HEALTHY_SAMPLES:
        x[0, 0] = -1.0
    return x, x.sum(dim=1, keepdim=True) / 8


def record(fault: Fault, variant: Variant, out: Path) -> Path:
    """Train one variant of one fault for ``STEPS`` steps, sampling every forward."""
    torch.manual_seed(0)
    model = build(fault, variant)
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr(fault))
    run_dir = out / fault / variant
    # the optimizer's steps are recorded (update_to_weight) where a fault needs them
    steps = optimizer if fault is Fault.LEARNING_RATE else None
    sampler = EveryNForwardsSampler(1)
    with inject_observer(model, sampler=sampler, output_dir=run_dir, optimizer=steps):
        for step in range(STEPS):
            inject(fault, variant, model, optimizer, step)
            x, y = batch(fault, variant, step)
            loss = (model(x) - y).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return run_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/find_problems"))
    parser.add_argument("--fault", choices=[f.value for f in Fault], action="append")
    args = parser.parse_args()
    for fault in [Fault(f) for f in args.fault or Fault]:
        runs = {variant: record(fault, variant, args.out) for variant in Variant}
        for variant, run_dir in runs.items():
            findings = find(open_run(run_dir))
            print(f"\n== {fault} / {variant}: {findings.height} findings ({run_dir})")
            for row in findings.iter_rows(named=True):
                print(f"  [{row['rule']}] {row['message']}")
        write_plots(fault, runs, args.out / fault)


def write_plots(fault: Fault, runs: dict[Variant, Path], out: Path) -> None:
    """A report folder for the broken run and baseline against broken side by side."""
    from torchinstruments_analysis.plots import plot, report

    rule, _ = EXPECTED[fault]
    signal, metric = ("output", "zero_fraction") if rule is Rule.DEAD_UNITS else ("output", "rms")
    try:
        folder = report(open_run(runs[Variant.BROKEN]), out / "report")
        pair = [open_run(runs[Variant.BASELINE]), open_run(runs[Variant.BROKEN])]
        figures = plot(pair, out / "compare", metric=metric, signal=signal)
    except ImportError as error:
        print(f"  no plots: {error}")
        return
    print(f"  report: {folder / 'index.md'}; baseline against broken: {figures[0]}")


if __name__ == "__main__":
    main()
