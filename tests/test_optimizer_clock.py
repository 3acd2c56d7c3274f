"""OptimizerClock: the optimizer steps of one model, counted with torch alone."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from torchinstruments_core.adapter import OptimizerClock


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: int = 1) -> None:
    for _ in range(micro_batches):
        model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_plain_loop_ticks_once_per_optimizer_step() -> None:
    """One tick per optimizer step, whatever the number of accumulated micro-batches."""
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ticks: list[None] = []
    clock = OptimizerClock(model, lambda: ticks.append(None))
    for micro_batches in (1, 3, 2):
        _step(model, optimizer, micro_batches)
    clock.remove()
    _step(model, optimizer)  # after remove(): not counted
    clock.remove()  # again: nothing to do
    assert len(ticks) == 3


def test_an_optimizer_that_trains_another_model_is_ignored() -> None:
    """Only the optimizer of the watched model's parameters ticks, even when another steps first."""
    model, other = nn.Linear(4, 1), nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other_optimizer = torch.optim.Adam(other.parameters(), lr=0.1)
    ticks: list[None] = []
    clock = OptimizerClock(model, lambda: ticks.append(None))
    for _ in range(2):
        for _ in range(3):  # before the watched optimizer, and more often
            _step(other, other_optimizer)
        _step(model, optimizer)
    clock.remove()
    assert len(ticks) == 2


def test_a_step_the_grad_scaler_skips_is_not_counted() -> None:
    """An fp16 overflow (inf gradients) makes GradScaler skip the optimizer step: no tick."""
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    ticks: list[None] = []
    clock = OptimizerClock(model, lambda: ticks.append(None))
    for factor in (1.0, float("inf"), 1.0):
        scaler.scale(model(torch.randn(2, 4)).sum() * factor).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    clock.remove()
    assert len(ticks) == 2
    assert scaler.get_scale() < 2.0**10  # the overflow did happen: the scale backed off


def test_the_clock_does_not_keep_the_model_alive() -> None:
    """The clock holds the model weakly: a deleted model is collected, and no step counts then."""
    model = nn.Linear(4, 1)
    reference = weakref.ref(model)
    ticks: list[None] = []
    clock = OptimizerClock(model, lambda: ticks.append(None))
    del model
    gc.collect()
    assert reference() is None
    other = nn.Linear(4, 1)
    _step(other, torch.optim.SGD(other.parameters(), lr=0.1))
    clock.remove()
    assert ticks == []
