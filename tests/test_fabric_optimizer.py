"""FabricTelemetry: the optimizer step signals reach the loggers at the step of the user's loss.

Real Fabric loops on the CPU with a TensorBoardLogger, read back with EventAccumulator, and the
run directory read with polars; the expected values come from the test's own hooks on the torch
optimizers (``StepReference``) and ``fabric.clip_gradients``' total norm.
"""

from __future__ import annotations

import pathlib
from typing import Any

import polars as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers.tensorboard import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from step_references import StepReference
from torchinstruments_core import ConfigurationError
from torchinstruments_lightning import FabricTelemetry

GRADIENT_NORM = "telemetry/model/parameter_gradient/l2_norm"


STEP_TAGS = {
    *(
        f"telemetry/{layer}/{key}"
        for layer in ("0", "2")
        for name in ("weight", "bias")
        for key in (f"parameter_gradient/{name}/rms", f"update/{name}/update_to_weight")
    ),
    "telemetry/model/parameter_gradient/l2_norm",
    "telemetry/model/parameter_gradient/nonfinite_count",
    "telemetry/model/parameter_gradient/zero_count",
    "telemetry/model/update/l2_norm",
    "telemetry/step/nonfinite_tensors",
    "telemetry/step/collection_duration_ms",
}
"""Every scalar an optimizer step routes with the defaults, for focus layers ``0`` and ``2``."""


def _step_tags(folder: str) -> set[str]:
    """The scalar tags of the event file that are not the loop's nor a forward sample's."""
    events = EventAccumulator(folder, size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    summaries = {"telemetry/nonfinite_tensors", "telemetry/collection_duration_ms"}
    return {
        tag
        for tag in events.Tags()["scalars"]
        if tag.startswith("telemetry/")
        and tag not in summaries
        and not any(f"/{signal}/" in tag for signal in ("output", "output_gradient"))
    }


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _scalars(folder: str, tag: str) -> dict[int, float]:
    events = EventAccumulator(folder, size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


def _loop(fabric: Fabric, model: Any, optimizers: list[Any], steps: int) -> list[float]:
    """Fabric's loop, each optimizer stepped in turn; the loss logged at the step count.

    Returns:
        The total gradient norm ``fabric.clip_gradients`` gave at each step (nothing clipped).
    """
    norms = []
    for step in range(steps):
        loss = model(torch.randn(4, 4)).square().mean()
        fabric.backward(loss)
        total = fabric.clip_gradients(model, optimizers[0], max_norm=1e6)
        assert total is not None  # max_norm given: the total norm
        norms.append(float(total))
        fabric.log("loss", loss.item(), step=step)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return norms


def test_setup_alone_records_the_optimizer_at_the_logged_steps(tmp_path: pathlib.Path) -> None:
    """With ``fabric.setup`` alone, the one optimizer is found and its steps are routed.

    Steps 0, 2, 4 of six are sampled: TensorBoard holds the gradient rms and update_to_weight of
    the focus layers and the global norm at those steps, beside the loop's ``loss``, with the
    values of the test's float64 hooks and of ``clip_gradients``; the Parquet rows agree.
    """
    telemetry = FabricTelemetry(every_n_steps=2, max_focus_layers=2)
    logger = TensorBoardLogger(tmp_path / "tb")
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[telemetry], loggers=[logger])
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference = StepReference(model, optimizer)
    model, fabric_optimizer = fabric.setup(model, optimizer)
    norms = _loop(fabric, model, [fabric_optimizer], steps=6)
    telemetry.finish()
    logger.finalize("success")
    rms = _scalars(logger.log_dir, "telemetry/0/parameter_gradient/weight/rms")
    ratio = _scalars(logger.log_dir, "telemetry/2/update/bias/update_to_weight")
    norm = _scalars(logger.log_dir, GRADIENT_NORM)
    sampled = [0, 2, 4]
    assert sorted(rms) == sorted(ratio) == sorted(norm) == sampled
    assert set(sampled) <= set(_scalars(logger.log_dir, "loss"))
    assert _step_tags(logger.log_dir) == STEP_TAGS
    for k in sampled:
        assert rms[k] == pytest.approx(reference.gradient_rms[k]["0.weight"], rel=1e-5)
        assert ratio[k] == pytest.approx(reference.update_to_weight[k]["2.bias"], rel=1e-5)
        assert norm[k] == pytest.approx(norms[k], rel=1e-5)
    assert telemetry.run_directory is not None
    history = pl.read_parquet(telemetry.run_directory / "history.parquet")
    rows = history.filter((pl.col("layer") == "<model>") & (pl.col("metric") == "l2_norm"))
    assert sorted(set(rows["step"])) == sampled


def test_two_optimizers_handed_over_are_one_step_each_recorded(tmp_path: pathlib.Path) -> None:
    """``watch_optimizers`` with what ``fabric.setup`` returned: a step is one loop iteration.

    SGD trains the first layer, Adam the last; both are stepped in each iteration. The samples
    stay on steps 0, 2, 4 and both layers' gradient rms are at those steps with the values the
    optimizers used.
    """
    telemetry = FabricTelemetry(every_n_steps=2, max_focus_layers=2)
    logger = TensorBoardLogger(tmp_path / "tb")
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[telemetry], loggers=[logger])
    model = _model()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    last = torch.optim.Adam(model[2].parameters(), lr=0.01)
    references = {"0": StepReference(model, first), "2": StepReference(model, last)}
    model, *optimizers = fabric.setup(model, first, last)
    telemetry.watch_optimizers(*optimizers)
    _loop(fabric, model, optimizers, steps=5)
    telemetry.finish()
    logger.finalize("success")
    sampled = [0, 2, 4]
    for layer, reference in references.items():
        rms = _scalars(logger.log_dir, f"telemetry/{layer}/parameter_gradient/weight/rms")
        assert sorted(rms) == sampled
        for k in sampled:
            assert rms[k] == pytest.approx(reference.gradient_rms[k][f"{layer}.weight"], rel=1e-5)
    assert telemetry.run_directory is not None
    samples = pl.read_parquet(telemetry.run_directory / "samples.parquet")
    assert samples.filter(pl.col("kind") == "forward")["step"].to_list() == sampled


def test_watch_optimizers_needs_a_watched_model_and_optimizers(tmp_path: pathlib.Path) -> None:
    """Before any model is watched, or with something else than an optimizer, it raises."""
    telemetry = FabricTelemetry(every_n_steps=2, output_dir=tmp_path / "run")
    optimizer = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match=r"fabric\.setup first"):
        telemetry.watch_optimizers(optimizer)
    with pytest.raises(ConfigurationError, match="optimizer"):
        telemetry.watch_optimizers("sgd")  # type: ignore[arg-type]
