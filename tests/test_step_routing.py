"""Routing of step records: exactly the focus layers' gradient rms and update_to_weight.

Plus the whole-model rows, read back from a real TensorBoard event file and an offline W&B run.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

from torchinstruments_core import (
    LayerInfo,
    RecordKind,
    RunInfo,
    SampleRecord,
    Signal,
    StatRow,
)
from torchinstruments_core._signals import ALL_PARAMETERS, MODEL_LAYER
from torchinstruments_core.routing import LoggerRouter, SummaryWriterTarget, WandbRunTarget
from torchinstruments_core.run_directory import RunDirectorySink
from wandb_records import history_rows

STEP = 7
LAYER_METRICS = ("rms", "max_abs", "nonfinite_fraction", "mean", "update_to_weight", "l2_norm")
MODEL_METRICS = ("l2_norm", "nonfinite_count", "zero_count", "rms", "max_abs")

EXPECTED = {
    "telemetry/first/parameter_gradient/weight/rms": 1.0,
    "telemetry/first/parameter_gradient/bias/rms": 2.0,
    "telemetry/first/update/weight/update_to_weight": 3.0,
    "telemetry/first/update/bias/update_to_weight": 4.0,
    "telemetry/model/parameter_gradient/l2_norm": 5.0,
    "telemetry/model/parameter_gradient/nonfinite_count": 6.0,
    "telemetry/model/parameter_gradient/zero_count": 7.0,
    "telemetry/model/update/l2_norm": 8.0,
    "telemetry/step/nonfinite_tensors": 0.0,
    "telemetry/step/collection_duration_ms": 1.5,
}
"""What a router with its defaults makes of ``_step_record()``, key by key."""


def _run() -> RunInfo:
    layers = (
        LayerInfo("first", "Linear", 40, True, ("weight", "bias")),
        LayerInfo("last", "Linear", 18, False, ("weight", "bias")),
    )
    return RunInfo("r", 0, 1, "rank0", "Net", "every 1", layers, ("rms", "max_abs"))


def _value(signal: Signal, name: str, metric: str) -> float:
    """The value ``EXPECTED`` holds for a routed row; filler for the others (finite ones)."""
    if metric == "nonfinite_fraction":
        return 0.0
    owner = "first" if name != ALL_PARAMETERS else "model"
    path = f"/{name}" if name != ALL_PARAMETERS else ""
    return EXPECTED.get(f"telemetry/{owner}/{signal}{path}/{metric}", 100.0)


def _at_step(values: dict[str, float]) -> dict[str, list[tuple[int, float]]]:
    """Each value as TensorBoard holds it: once, at ``STEP``, in float32."""
    return {key: [(STEP, float(np.float32(value)))] for key, value in values.items()}


def _step_record() -> SampleRecord:
    """A step record holding more than is routed: every metric, a non-focus layer, parameters."""
    rows = [
        StatRow(layer, 0, signal, name, metric, _value(signal, name, metric), None)
        for layer in ("first", "last")
        for signal in (Signal.PARAMETER, Signal.PARAMETER_GRADIENT, Signal.UPDATE)
        for name in ("weight", "bias")
        for metric in LAYER_METRICS
    ]
    rows += [
        StatRow(MODEL_LAYER, 0, signal, ALL_PARAMETERS, m, _value(signal, ALL_PARAMETERS, m), None)
        for signal in (Signal.PARAMETER_GRADIENT, Signal.UPDATE)
        for m in MODEL_METRICS
    ]
    rows.append(StatRow("first", 0, Signal.UPDATE, "scale", "update_to_weight", None, "empty"))
    return SampleRecord("r", 0, 3, STEP, 0.0, False, 1.5, tuple(rows), (), kind=RecordKind.STEP)


def _forward_record() -> SampleRecord:
    """The forward sample of the same step (its keys must not collide with the step's)."""
    rows = (StatRow("first", 0, Signal.OUTPUT, "output", "rms", 0.5, None),)
    return SampleRecord("r", 0, 2, STEP, 0.0, False, 1.0, rows, ())


def _scalars(folder: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_router_sends_exactly_the_step_keys_to_tensorboard(tmp_path: pathlib.Path) -> None:
    """A trainer's TensorBoard gets exactly the routed step keys, at the record's step.

    The focus layer's gradient rms and update_to_weight per parameter and the whole-model rows:
    nothing else of the step record, and the forward sample's keys beside them.
    """
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    router = LoggerRouter([SummaryWriterTarget(writer)])
    router.open(_run())
    router.write(_forward_record())
    router.write(_step_record())
    writer.close()
    scalars = _scalars(tmp_path)
    forward = {"telemetry/first/output/rms", "telemetry/nonfinite_tensors"}
    assert set(scalars) == set(EXPECTED) | forward | {"telemetry/collection_duration_ms"}
    assert {key: scalars[key] for key in EXPECTED} == _at_step(EXPECTED)
    assert not any("<" in key or "*" in key for key in scalars)


def test_router_sends_the_step_keys_to_an_offline_wandb_run(tmp_path: pathlib.Path) -> None:
    """The offline .wandb file holds the same step keys and values, in the row of the step."""
    import wandb

    os.environ["WANDB_SILENT"] = "true"
    run = wandb.init(mode="offline", dir=str(tmp_path), project="telemetry-test")
    router = LoggerRouter([WandbRunTarget(run, step_key="trainer/global_step")])
    router.open(_run())
    router.write(_step_record())
    run.finish()
    wandb.teardown()  # without it the offline file holds only its header
    (row,) = [r for r in history_rows(tmp_path) if "telemetry/step/nonfinite_tensors" in r]
    assert row["trainer/global_step"] == STEP
    routed = {key: value for key, value in row.items() if key.startswith("telemetry/")}
    assert routed == pytest.approx(EXPECTED)


def test_step_keys_follow_the_chosen_layers_and_signals() -> None:
    """The layer and signal choices apply to step keys.

    ``scalar_layers="all"`` adds the other layers' step keys; the whole-model rows of a signal
    left out of ``signals`` are left out too; ``parameter`` routes ``scalar_metrics`` if asked.
    """
    everything = _routed(scalar_layers="all")
    assert "telemetry/last/parameter_gradient/weight/rms" in everything
    assert "telemetry/last/update/bias/update_to_weight" in everything
    gradients = _routed(signals=["parameter_gradient"])
    assert set(gradients) == {key for key in EXPECTED if "/update/" not in key}
    parameters = _routed(signals=["parameter"], scalar_metrics=["max_abs"])
    assert set(parameters) == {
        "telemetry/first/parameter/weight/max_abs",
        "telemetry/first/parameter/bias/max_abs",
        "telemetry/step/nonfinite_tensors",
        "telemetry/step/collection_duration_ms",
    }


def test_documented_keys_are_the_keys_routed() -> None:
    """Every key a step record is routed under is one ``scalar_keys`` documents."""
    router = LoggerRouter(())
    documented = router.scalar_keys(_run())
    assert set(_routed()) <= set(documented)
    assert set(EXPECTED) <= set(documented)


def test_run_directory_tensorboard_uses_the_routed_step_keys(tmp_path: pathlib.Path) -> None:
    """The run directory's own event file holds the same step keys, at the step."""
    sink = RunDirectorySink(tmp_path / "run")
    sink.open(_run())
    sink.write(_step_record())
    sink.close()
    scalars = _scalars(tmp_path / "run" / "tensorboard")
    assert set(scalars) == set(EXPECTED)
    assert scalars == _at_step(EXPECTED)


class _Keys:
    """A target keeping the scalars it was given."""

    def __init__(self) -> None:
        self.scalars: dict[str, float] = {}

    def log(self, scalars: object, histograms: object, step: int) -> None:
        self.scalars.update(scalars)  # type: ignore[call-overload]


def _routed(**options: object) -> dict[str, float]:
    target = _Keys()
    router = LoggerRouter([target], **options)  # type: ignore[arg-type]
    router.open(_run())
    router.write(_step_record())
    return target.scalars
