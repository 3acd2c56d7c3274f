"""TelemetryCallback: the Trainer's optimizer steps reach TensorBoard at the loss's global step.

A tiny random GPT-2 trained by a real ``Trainer`` on the CPU; TensorBoard read back with
EventAccumulator, the run directory with polars; the expected values come from the test's own
hooks on the torch optimizer the Trainer steps (``StepReference``) and the Trainer's own
``grad_norm`` log.
"""

from __future__ import annotations

import pathlib

import polars as pl
import pytest
import torch
import transformers
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from step_references import StepReference
from test_transformers import _data, _model
from torchinstruments_transformers import TelemetryCallback

LAYER = "transformer.h.0.mlp.c_fc"
GRADIENT_RMS = f"telemetry/{LAYER}/parameter_gradient/weight/rms"
UPDATE_TO_WEIGHT = f"telemetry/{LAYER}/update/weight/update_to_weight"
GRADIENT_NORM = "telemetry/model/parameter_gradient/l2_norm"


def _scalars(folder: pathlib.Path, tag: str) -> dict[int, float]:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


def _arguments(
    tmp_path: pathlib.Path, *, max_steps: int, accumulation: int, max_grad_norm: float
) -> transformers.TrainingArguments:
    """A short CPU run logging to TensorBoard at every step, without checkpoints or progress."""
    return transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=max_steps,
        report_to=["tensorboard"],
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        max_grad_norm=max_grad_norm,
    )


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_optimizer_steps_land_at_the_global_step_of_the_loss(
    tmp_path: pathlib.Path, accumulation: int
) -> None:
    """Gradient rms, update_to_weight and the global norm sit beside ``train/loss``.

    Five optimizer steps, ``every_n_steps=2``: global steps 1, 2 and 4 are sampled (the first and
    the multiples of 2). Their routed values equal the test's float64 hooks on the optimizer the
    Trainer steps (inside Accelerate's wrapper), and the global norm the Trainer's own
    ``train/grad_norm`` (nothing is clipped); the Parquet rows carry the same steps.
    """
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference = StepReference(model, optimizer)
    args = _arguments(tmp_path, max_steps=5, accumulation=accumulation, max_grad_norm=1e6)
    telemetry = TelemetryCallback(every_n_steps=2)
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=_data(),
        callbacks=[telemetry],
        optimizers=(optimizer, None),
    )
    trainer.train()
    (events_dir,) = (tmp_path / "out" / "runs").iterdir()
    loss = _scalars(events_dir, "train/loss")
    grad_norm = _scalars(events_dir, "train/grad_norm")
    rms, ratio, norm = (
        _scalars(events_dir, t) for t in (GRADIENT_RMS, UPDATE_TO_WEIGHT, GRADIENT_NORM)
    )
    sampled = [1, 2, 4]
    assert sorted(rms) == sorted(ratio) == sorted(norm) == sampled
    assert set(sampled) <= set(loss)
    for step in sampled:
        k = step - 1  # the optimizer step the Trainer logs as global step k + 1
        assert rms[step] == pytest.approx(reference.gradient_rms[k][f"{LAYER}.weight"], rel=1e-4)
        assert ratio[step] == pytest.approx(
            reference.update_to_weight[k][f"{LAYER}.weight"], rel=1e-4
        )
        assert norm[step] == pytest.approx(reference.gradient_norm[k], rel=1e-4)
        assert norm[step] == pytest.approx(grad_norm[step], rel=1e-4)
    assert telemetry.run_directory is not None
    history = pl.read_parquet(telemetry.run_directory / "history.parquet")
    model_rows = history.filter(
        (pl.col("signal") == "parameter_gradient") & (pl.col("metric") == "l2_norm")
        & (pl.col("layer") == "<model>")
    )  # fmt: skip
    assert model_rows["step"].to_list() == sampled


def test_clipped_gradients_are_recorded_as_the_optimizer_uses_them(tmp_path: pathlib.Path) -> None:
    """Under ``max_grad_norm`` the recorded global norm is the clipped one, the Trainer's before.

    With a bound far below the gradients' norm, ``train/grad_norm`` (before clipping) is above it
    while ``telemetry/model/parameter_gradient/l2_norm`` is the bound the optimizer stepped with.
    """
    bound = 1e-3
    args = _arguments(tmp_path, max_steps=2, accumulation=1, max_grad_norm=bound)
    telemetry = TelemetryCallback(every_n_steps=1)
    trainer = transformers.Trainer(
        model=_model(), args=args, train_dataset=_data(), callbacks=[telemetry]
    )
    trainer.train()
    (events_dir,) = (tmp_path / "out" / "runs").iterdir()
    before = _scalars(events_dir, "train/grad_norm")
    recorded = _scalars(events_dir, GRADIENT_NORM)
    assert sorted(recorded) == sorted(before) == [1, 2]
    assert all(value > 10 * bound for value in before.values())
    assert all(value == pytest.approx(bound, rel=1e-3) for value in recorded.values())
