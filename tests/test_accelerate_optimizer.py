"""TelemetryTracker: the optimizer step signals reach the trackers at the step of the user's loss.

A real Accelerate loop on the CPU with the TensorBoard tracker, read back with EventAccumulator,
and the run directory read with polars; the expected values are taken by the test's own hooks on
the torch optimizer (``StepReference``) and by ``accelerator.clip_grad_norm_``.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import polars as pl
import pytest
import torch
from accelerate import Accelerator

from accelerate_helpers import (
    Regressor,
    events,
    loader,
    reset_accelerate_state,
    tensorboard_accelerator,
)
from optimizer_helpers import WIDE, queued_copies, wide_net
from step_references import StepReference
from torchinstruments_accelerate import TelemetryTracker
from torchinstruments_core import ConfigurationError, ObservationWarning

GRADIENT_RMS = "telemetry/net.0/parameter_gradient/weight/rms"
UPDATE_TO_WEIGHT = "telemetry/net.2/update/weight/update_to_weight"
GRADIENT_NORM = "telemetry/model/parameter_gradient/l2_norm"
FIRST = 100  # the loop logs optimizer step k at FIRST + k


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Each test builds its Accelerator from scratch; Accelerate's state is process-wide."""
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def _loop(
    accelerator: Accelerator,
    model: Any,
    optimizers: list[Any],
    data: Any,
    steps: int,
    *,
    log_before_step: bool = False,
) -> list[float]:
    """Accelerate's loop, each optimizer stepped in turn; logs step k at ``FIRST + k``.

    The log comes after the optimizer steps, or just before them (``log_before_step``).

    Returns:
        The total gradient norm ``clip_grad_norm_`` gave at each step (nothing clipped).
    """
    norms: list[float] = []
    for x, y in data:
        with accelerator.accumulate(model):
            loss = (model(x) - y).square().mean()
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1e6)))
                if log_before_step:
                    accelerator.log({"loss": loss.item()}, step=FIRST + len(norms) - 1)
            for optimizer in optimizers:
                optimizer.step()
            for optimizer in optimizers:
                optimizer.zero_grad()
        if accelerator.sync_gradients:
            if not log_before_step:
                accelerator.log({"loss": loss.item()}, step=FIRST + len(norms) - 1)
            if len(norms) == steps:
                return norms
    raise AssertionError("the loader ran out")


def _scalar(events_: Any, tag: str) -> dict[int, float]:
    return {event.step: event.value for event in events_.Scalars(tag)}


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("given", [True, False], ids=["optimizer=", "found"])
@pytest.mark.parametrize("log_before_step", [False, True], ids=["log_after", "log_before"])
def test_step_signals_land_at_the_logged_step_with_the_optimizers_values(
    tmp_path: pathlib.Path, accumulation: int, given: bool, log_before_step: bool
) -> None:
    """Gradient rms, update_to_weight and the global norm are in TensorBoard at the user's step.

    Sampled optimizer steps 0, 2, 4 are logged at 100, 102, 104, where the loop's own ``loss``
    is; the gradient rms and update_to_weight match the test's float64 hooks on the torch
    optimizer, the global norm what ``clip_grad_norm_`` returned; the run directory holds the
    same rows at the same steps. Under accumulation the gradient is the one of the whole step.
    The optimizer is passed to ``watch`` or found as torch steps it, its first step included;
    the loop logs before or after ``optimizer.step()``.
    """
    telemetry = TelemetryTracker(every_n_steps=2, max_focus_layers=2)
    accelerator = tensorboard_accelerator(tmp_path, telemetry, accumulation)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    reference = StepReference(model, optimizer)
    prepared, prepared_optimizer, data = accelerator.prepare(model, optimizer, loader(64))
    telemetry.watch(
        prepared, accelerator=accelerator, optimizer=prepared_optimizer if given else None
    )
    norms = _loop(
        accelerator, prepared, [prepared_optimizer], data, steps=6, log_before_step=log_before_step
    )
    accelerator.end_training()
    logged = events(tmp_path / "exp")
    sampled = [FIRST, FIRST + 2, FIRST + 4]
    assert set(sampled) <= set(_scalar(logged, "loss"))
    rms, ratio, norm = (
        _scalar(logged, tag) for tag in (GRADIENT_RMS, UPDATE_TO_WEIGHT, GRADIENT_NORM)
    )
    assert sorted(rms) == sorted(ratio) == sorted(norm) == sampled
    for k in (0, 2, 4):
        assert rms[FIRST + k] == pytest.approx(reference.gradient_rms[k]["net.0.weight"], rel=1e-5)
        assert ratio[FIRST + k] == pytest.approx(
            reference.update_to_weight[k]["net.2.weight"], rel=1e-5
        )
        assert norm[FIRST + k] == pytest.approx(norms[k], rel=1e-5)
        assert norm[FIRST + k] == pytest.approx(reference.gradient_norm[k], rel=1e-5)
    assert telemetry.run_directory is not None
    history = pl.read_parquet(telemetry.run_directory / "history.parquet")
    rows = history.filter(
        (pl.col("signal") == "parameter_gradient") & (pl.col("layer") == "net.0")
        & (pl.col("tensor_path") == "weight") & (pl.col("metric") == "rms")
    )  # fmt: skip
    assert rows["step"].to_list() == sampled
    assert rows["value"].to_list() == pytest.approx(
        [reference.gradient_rms[k]["net.0.weight"] for k in (0, 2, 4)], rel=1e-5
    )


def test_two_optimizers_are_one_step_each_recorded(tmp_path: pathlib.Path) -> None:
    """Two optimizers passed to ``watch``: one step per loop iteration, both recorded at it.

    Each steps half of the model (SGD the first layer, Adam the last); the samples stay on the
    sampled steps, and both layers' gradient rms are at those steps with the optimizers' values.
    """
    telemetry = TelemetryTracker(every_n_steps=2, max_focus_layers=2)
    accelerator = tensorboard_accelerator(tmp_path, telemetry, 1)
    model = Regressor()
    first = torch.optim.SGD(model.net[0].parameters(), lr=0.05)
    last = torch.optim.Adam(model.net[2].parameters(), lr=0.01)
    references = [StepReference(model, first), StepReference(model, last)]
    prepared, *optimizers, data = accelerator.prepare(model, first, last, loader(64))
    telemetry.watch(prepared, accelerator=accelerator, optimizer=optimizers)
    _loop(accelerator, prepared, optimizers, data, steps=5)
    accelerator.end_training()
    logged = events(tmp_path / "exp")
    sampled = [FIRST, FIRST + 2, FIRST + 4]
    for layer, reference in zip(("net.0", "net.2"), references, strict=True):
        rms = _scalar(logged, f"telemetry/{layer}/parameter_gradient/weight/rms")
        assert sorted(rms) == sampled
        for k in (0, 2, 4):
            expected = reference.gradient_rms[k][f"{layer}.weight"]
            assert rms[FIRST + k] == pytest.approx(expected, rel=1e-5)
    assert telemetry.run_directory is not None
    samples = pl.read_parquet(telemetry.run_directory / "samples.parquet")
    assert samples.filter(pl.col("kind") == "forward")["step"].to_list() == sampled


def test_a_second_optimizer_found_warns(tmp_path: pathlib.Path) -> None:
    """Without ``optimizer=``, a second optimizer of the model warns, naming the fix."""
    telemetry = TelemetryTracker(every_n_steps=2, output_dir=tmp_path / "run")
    accelerator = tensorboard_accelerator(tmp_path, telemetry, 1)
    model = Regressor()
    first = torch.optim.SGD(model.net[0].parameters(), lr=0.05)
    last = torch.optim.SGD(model.net[2].parameters(), lr=0.05)
    prepared, *optimizers, data = accelerator.prepare(model, first, last, loader(64))
    telemetry.watch(prepared, accelerator=accelerator)
    with pytest.warns(ObservationWarning, match=r"optimizer=\[\.\.\.\]"):
        _loop(accelerator, prepared, optimizers, data, steps=2)
    accelerator.end_training()


def test_watch_refuses_what_is_not_an_optimizer(tmp_path: pathlib.Path) -> None:
    """``optimizer=`` that is not an optimizer fails at once, naming the argument."""
    telemetry = TelemetryTracker(every_n_steps=2, output_dir=tmp_path / "run")
    with pytest.raises(ConfigurationError, match="optimizer"):
        telemetry.watch(Regressor(), optimizer="adam")  # type: ignore[arg-type]


class _Wide(Regressor):
    """``Regressor`` whose ``net.2`` has a 512 x 512 weight (1 MiB), copied on the queue."""

    def __init__(self) -> None:
        super().__init__()
        self.net = wide_net()


def test_a_large_weight_copied_on_the_kernels_queue_gives_the_optimizers_update(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accelerate's loop: a 1 MiB weight's copy goes to the kernels' queue on each sampled step.

    On one torch thread the CPU reductions, and so the large copies, go to the queue; the
    ``update_to_weight`` in TensorBoard is the test's float64 hooks' value all the same.
    """
    with queued_copies(monkeypatch) as copied:
        telemetry = TelemetryTracker(every_n_steps=2)
        accelerator = tensorboard_accelerator(tmp_path, telemetry, 1)
        model = _Wide()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        reference = StepReference(model, optimizer)
        prepared, prepared_optimizer, data = accelerator.prepare(model, optimizer, loader(64))
        telemetry.watch(prepared, accelerator=accelerator, optimizer=prepared_optimizer)
        _loop(accelerator, prepared, [prepared_optimizer], data, steps=4)
        accelerator.end_training()
    assert copied == [WIDE * WIDE] * 2  # sampled steps 0 and 2
    ratio = _scalar(events(tmp_path / "exp"), UPDATE_TO_WEIGHT)
    assert sorted(ratio) == [FIRST, FIRST + 2]
    for k in (0, 2):
        expected = reference.update_to_weight[k]["net.2.weight"]
        assert ratio[FIRST + k] == pytest.approx(expected, rel=1e-5)


class _OwnAdamW(torch.optim.AdamW):
    """A user's subclass whose ``step`` calls the one it overrides."""

    def step(self, closure: Any = None) -> Any:
        return super().step(closure)


@pytest.mark.parametrize("given", [True, False], ids=["optimizer=", "found"])
def test_a_subclass_step_calling_its_parent_s_is_one_step(
    tmp_path: pathlib.Path, given: bool
) -> None:
    """With ``AdamW.step`` hooked too, torch runs both calls' hooks; the tracker counts one step.

    ``every_n_steps=2`` samples steps 0, 2 and 4 of six (counted twice a step, every step was
    sampled), each with one whole step record.
    """
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # torch hooks ``AdamW.step``
    telemetry = TelemetryTracker(every_n_steps=2, output_dir=tmp_path / "run")
    accelerator = tensorboard_accelerator(tmp_path, telemetry, 1)
    model = Regressor()
    optimizer = _OwnAdamW(model.parameters(), lr=0.01)
    prepared, prepared_optimizer, data = accelerator.prepare(model, optimizer, loader(64))
    telemetry.watch(
        prepared, accelerator=accelerator, optimizer=prepared_optimizer if given else None
    )
    _loop(accelerator, prepared, [prepared_optimizer], data, steps=6)
    accelerator.end_training()
    assert telemetry.run_directory is not None
    samples = pl.read_parquet(telemetry.run_directory / "samples.parquet")
    sampled = [FIRST, FIRST + 2, FIRST + 4]
    for kind in ("forward", "step"):
        rows = samples.filter(pl.col("kind") == kind).sort("step")
        assert rows["step"].to_list() == sampled
        assert rows["optimizer_step"].to_list() == [0, 2, 4]
    history = pl.read_parquet(telemetry.run_directory / "history.parquet")
    for step in sampled:
        signals = set(history.filter(pl.col("step") == step)["signal"])
        assert {"parameter", "parameter_gradient", "update", "optimizer_state"} <= signals
