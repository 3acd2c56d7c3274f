"""TelemetryTracker: the telemetry of an optimizer step lands on the step the user logs it under."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from accelerate import Accelerator

from accelerate_helpers import (
    Tagged,
    events,
    reset_accelerate_state,
    samples,
    tagged_loader,
    tensorboard_accelerator,
)
from torchinstruments_accelerate import TelemetryTracker


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Each test builds its Accelerator from scratch; Accelerate's state is process-wide."""
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def start(
    root: pathlib.Path, telemetry: TelemetryTracker, accumulation: int
) -> tuple[Accelerator, Any, Any, Any]:
    """Accelerate's examples: log_with and project_dir, init_trackers, prepare; then watch."""
    accelerator = tensorboard_accelerator(root, telemetry, accumulation)
    model = Tagged()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, data = accelerator.prepare(model, optimizer, tagged_loader())
    telemetry.watch(model, accelerator=accelerator)
    return accelerator, model, optimizer, data


def run_loop(
    accelerator: Accelerator, model: Any, optimizer: Any, data: Any, *, log: str, first: int
) -> list[tuple[int, float]]:
    """The loop of the issue, logging ``step=first + i`` before or after ``optimizer.step()``.

    Returns:
        For each optimizer step, the step it was logged at and the loss logged.
    """
    logged: list[tuple[int, float]] = []
    for i, (x, y) in enumerate(data):
        with accelerator.accumulate(model):
            loss = (model(x) - y).square().mean()
            accelerator.backward(loss)
            if log == "before" and accelerator.sync_gradients:
                accelerator.log({"loss": loss.item()}, step=first + i)
                logged.append((first + i, loss.item()))
            optimizer.step()
            optimizer.zero_grad()
        if log == "after" and accelerator.sync_gradients:
            accelerator.log({"loss": loss.item()}, step=first + i)
            logged.append((first + i, loss.item()))
        if len(logged) == 7:
            return logged
    raise AssertionError("the loader ran out")


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("log", ["before", "after"])
@pytest.mark.parametrize("first", [0, 1, 1000])
def test_each_histogram_sits_at_the_step_the_user_logged_the_sampled_batch_under(
    tmp_path: pathlib.Path, first: int, log: str, accumulation: int
) -> None:
    """TensorBoard: every histogram is at a step where the user logged the sampled batch's step.

    Batch ``i`` carries ``i``, so the routed ``telemetry/tag/output/max_abs`` names the batch each
    sample saw. Its optimizer step must be the one the user logged at that TensorBoard step, with
    the loss the loop logged for it: 0-based (``first=0``), 1-based, from 1000; logging before or
    after ``optimizer.step()``; every micro-batch of the sampled steps 0, 3 and 6, the first too.
    """
    telemetry = TelemetryTracker(every_n_steps=3, scalar_layers=["tag", "net.*"])
    accelerator, model, optimizer, data = start(tmp_path, telemetry, accumulation)
    logged = run_loop(accelerator, model, optimizer, data, log=log, first=first)
    accelerator.end_training()
    tensorboard = events(tmp_path / "exp")
    batches = [(e.step, int(e.value)) for e in tensorboard.Scalars("telemetry/tag/output/max_abs")]
    histograms = [e.step for e in tensorboard.Histograms("telemetry/net.0/output/histogram")]
    losses = {e.step: e.value for e in tensorboard.Scalars("loss")}
    assert sorted(histograms) == sorted(step for step, _ in batches)
    sampled = [0, 3, 6]
    assert sorted(batch for _, batch in batches) == [
        k * accumulation + j for k in sampled for j in range(accumulation)
    ]
    for step, batch in batches:
        user_step, loss = logged[batch // accumulation]
        assert step == user_step
        assert losses[step] == pytest.approx(loss)
    frame = samples(tmp_path / "telemetry")
    assert frame["optimizer_step"].to_list() == [k for k in sampled for _ in range(accumulation)]
    assert frame["step"].to_list() == [logged[k][0] for k in frame["optimizer_step"]]


def test_an_evaluation_before_the_log_and_a_second_log_leave_the_numbering_alone(
    tmp_path: pathlib.Path,
) -> None:
    """Evaluation before a step's log, a second log, an unlogged step: the numbering holds.

    No-grad evaluation between a step and its log does not end the step's window; a second log in
    a window (an epoch summary at step=epoch) does not renumber it; unlogged steps count on. The
    loop logs 100 + i after each step except step 4. After step 2 it evaluates (a
    forward-only sample of step 3) before logging 102; after step 3's 103 it logs an epoch at 1.
    """
    telemetry = TelemetryTracker(every_n_steps=1)
    accelerator, model, optimizer, data = start(tmp_path, telemetry, 1)
    for i, (x, y) in enumerate(data):
        loss = (model(x) - y).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if i == 2:
            with torch.no_grad():
                model(x)
        if i != 4:
            accelerator.log({"loss": loss.item()}, step=100 + i)
        if i == 3:
            accelerator.log({"epoch": 1.0}, step=1)
        if i == 5:
            break
    accelerator.end_training()
    frame = samples(tmp_path / "telemetry")
    assert frame.select("step", "optimizer_step", "forward_only").rows() == [
        (100, 0, False),
        (101, 1, False),
        (102, 2, False),
        (103, 3, True),
        (103, 3, False),
        (104, 4, False),
        (105, 5, False),
    ]
    tensorboard = events(tmp_path / "exp")
    histograms = tensorboard.Histograms("telemetry/net.0/output/histogram")
    assert [e.step for e in histograms] == [100, 101, 102, 103, 104, 105]
    # the evaluation's forward-only sample has keys of its own, at the same step
    evaluated = tensorboard.Histograms("telemetry/forward_only/net.0/output/histogram")
    assert [e.step for e in evaluated] == [103]
