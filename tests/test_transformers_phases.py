"""TelemetryCallback shared by several Trainers on one model: each ``train()`` routes into its own.

Two training phases, each a ``Trainer`` of its own with the same model and the same callback, the
first still referenced: the callback finds the handler of the Trainer that is training, not the
earlier one, whose TensorBoard writer is closed. TensorBoard is read back with EventAccumulator.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import transformers
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

from test_transformers import GRADIENT_RMS, HISTOGRAM, _data, _model, _train
from torchinstruments_core import ObservationWarning
from torchinstruments_transformers import TelemetryCallback


def _events(output_dir: pathlib.Path) -> EventAccumulator:
    """The TensorBoardCallback's event file under ``output_dir``, read back."""
    (events_dir,) = (output_dir / "runs").iterdir()
    events = EventAccumulator(str(events_dir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return events


def test_a_second_trainer_on_the_same_model_and_callback_routes_into_its_own_tensorboard(
    tmp_path: pathlib.Path,
) -> None:
    """Each phase's event file holds its telemetry beside its loss, at global steps 1 and 3.

    The first Trainer stays referenced, so its handler, holding the same model and callback,
    is still alive while the second one trains; neither run directory writes a ``tensorboard/``
    of its own.
    """
    telemetry, model = TelemetryCallback(every_n_steps=3), _model()
    trainers, folders = [], []
    for phase in ("phase-0", "phase-1"):
        trainers.append(_train(tmp_path / phase, telemetry, report_to=["tensorboard"], model=model))
        folders.append(telemetry.run_directory)
    for phase, folder in zip(("phase-0", "phase-1"), folders, strict=True):
        events = _events(tmp_path / phase / "out")
        assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
        assert [h.step for h in events.Histograms(HISTOGRAM)] == [1, 3]
        assert [e.step for e in events.Scalars(GRADIENT_RMS)] == [1, 3]
        assert folder == (tmp_path / phase / "out" / "telemetry").absolute()
        assert not (folder / "tensorboard").exists()
    assert [trainer.state.global_step for trainer in trainers] == [4, 4]


class Twin(transformers.TrainerCallback):
    """Builds, at train begin, a second handler holding the callback and the event's objects."""

    def __init__(self, telemetry: TelemetryCallback) -> None:
        self.telemetry = telemetry
        self.handler: CallbackHandler | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.handler = CallbackHandler(
            [DefaultFlowCallback(), self.telemetry],
            kwargs["model"],
            kwargs["processing_class"],
            kwargs["optimizer"],
            kwargs["lr_scheduler"],
        )
        self.handler.train_dataloader = kwargs["train_dataloader"]


def test_handlers_that_cannot_be_told_apart_route_nothing_and_warn(
    tmp_path: pathlib.Path,
) -> None:
    """Two handlers holding the callback with the same objects: the telemetry stays in the folder.

    Nothing says which one trains, so nothing reaches the Trainer's TensorBoard; the warning
    names the run directory, which writes its own ``tensorboard/`` instead.
    """
    telemetry = TelemetryCallback(every_n_steps=3)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=4, logging_steps=1, report_to=["tensorboard"],
        use_cpu=True, save_strategy="no", per_device_train_batch_size=2, disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=_model(), args=args, train_dataset=_data(), callbacks=[Twin(telemetry), telemetry]
    )
    with pytest.warns(ObservationWarning, match="2 Trainers hold this callback") as caught:
        trainer.train()
    assert str(telemetry.run_directory) in str(caught[0].message)
    assert HISTOGRAM not in _events(tmp_path / "out").Tags()["histograms"]
    assert telemetry.run_directory is not None
    assert (telemetry.run_directory / "tensorboard").is_dir()
