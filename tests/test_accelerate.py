"""TelemetryTracker in one process, with real Accelerate training and real readers."""

from __future__ import annotations

import gc
import logging
import pathlib
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import polars as pl
import pytest
import torch
from accelerate import Accelerator
from accelerate.tracking import LOGGER_TYPE_TO_CLASS, register_tracker_class

import torchinstruments_accelerate
from accelerate_helpers import (
    RecordingTracker,
    Regressor,
    events,
    hooks,
    loader,
    reset_accelerate_state,
    samples,
    setup,
    train,
)
from torchinstruments_accelerate import TelemetryTracker
from torchinstruments_core import ConfigurationError, ObservationWarning
from torchinstruments_core._signals import MODEL_LAYER


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Each test builds its Accelerator from scratch; Accelerate's state is process-wide."""
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def test_exported_names() -> None:
    """The package exports exactly the tracker; it is the GeneralTracker Accelerate expects."""
    assert torchinstruments_accelerate.__all__ == ["TelemetryTracker"]
    telemetry = TelemetryTracker()
    assert telemetry.name == "torchinstruments"
    assert telemetry.requires_logging_directory is True
    assert telemetry.tracker is None


def test_tensorboard_and_scalar_trackers_get_the_sampled_steps(tmp_path: pathlib.Path) -> None:
    """TensorBoard holds histograms and scalars at the sampled steps, other trackers scalars."""
    telemetry = TelemetryTracker(every_n_steps=3)
    recorder = RecordingTracker()
    accelerator, model, optimizer, data = setup(
        tmp_path, telemetry, log_with=["tensorboard", telemetry, recorder]
    )
    train(accelerator, model, optimizer, data, steps=8)
    accelerator.end_training()
    tensorboard = events(tmp_path / "exp")
    histogram = "telemetry/net.0/output/histogram"
    assert "telemetry/net.2/output_gradient/histogram" in tensorboard.Tags()["histograms"]
    assert [e.step for e in tensorboard.Histograms(histogram)] == [0, 3, 6]
    rms = tensorboard.Scalars("telemetry/net.0/output_gradient/rms")
    assert [e.step for e in rms] == [0, 3, 6]
    assert all(e.value > 0 for e in rms)
    routed = [
        (step, values) for values, step in recorder.calls if "telemetry/nonfinite_tensors" in values
    ]
    assert [step for step, _ in routed] == [0, 3, 6]
    assert not any(key.endswith("/histogram") for _, values in routed for key in values)
    history = pl.read_parquet(tmp_path / "telemetry" / "history.parquet")
    assert sorted(history["step"].unique()) == [0, 3, 6]
    assert set(history["layer"]) == {"net.0", "net.1", "net.2", MODEL_LAYER}
    assert hooks(model) == 0
    # the TensorBoard tracker holds the tags: the run directory writes no second copy of them
    assert not (tmp_path / "telemetry" / "tensorboard").exists()


@pytest.mark.parametrize("routed", [True, False])
def test_the_run_directory_writes_tensorboard_where_no_tracker_gets_it(
    tmp_path: pathlib.Path, routed: bool
) -> None:
    """No TensorBoard tracker (or no routing): the run directory's own ``tensorboard/``."""
    telemetry = TelemetryTracker(every_n_steps=3, log_to_loggers=routed)
    log_with: list[Any] = [telemetry, RecordingTracker()] if routed else ["tensorboard", telemetry]
    accelerator, model, optimizer, data = setup(tmp_path, telemetry, log_with=log_with)
    train(accelerator, model, optimizer, data, steps=4)
    accelerator.end_training()
    own = events(tmp_path / "telemetry" / "tensorboard")
    histograms = own.Histograms("telemetry/net.0/output/histogram")
    assert [event.step for event in histograms] == [0, 3]


def test_every_micro_batch_of_an_accumulated_step_is_sampled(tmp_path: pathlib.Path) -> None:
    """Under gradient_accumulation_steps=3 a sampled optimizer step gives three samples."""
    telemetry = TelemetryTracker(every_n_steps=2)
    accelerator, model, optimizer, data = setup(
        tmp_path, telemetry, log_with=[telemetry], gradient_accumulation_steps=3
    )
    train(accelerator, model, optimizer, data, steps=5)
    accelerator.end_training()
    frame = samples(tmp_path / "telemetry")
    assert frame["step"].to_list() == [0, 0, 0, 2, 2, 2, 4, 4, 4]
    assert frame["forward_only"].to_list() == [False] * 9


@pytest.mark.parametrize("order", ["before_prepare", "after_prepare"])
def test_watch_before_or_after_prepare_under_mixed_precision(
    tmp_path: pathlib.Path, order: str
) -> None:
    """bf16 autocast wraps forward; both orders sample, and removal leaves Accelerate's forward."""
    telemetry = TelemetryTracker(every_n_steps=2)
    accelerator = Accelerator(
        cpu=True, mixed_precision="bf16", log_with=[telemetry], project_dir=tmp_path
    )
    accelerator.init_trackers("exp")
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if order == "before_prepare":
        telemetry.watch(model, accelerator=accelerator)
    prepared, optimizer, data = accelerator.prepare(model, optimizer, loader())
    autocast_forward = model.__dict__["forward"]  # Accelerate's wrapper
    if order == "after_prepare":
        telemetry.watch(prepared, accelerator=accelerator)
    train(accelerator, prepared, optimizer, data, steps=4)
    accelerator.end_training()
    assert hooks(model) == 0
    assert model.__dict__["forward"] is autocast_forward
    history = pl.read_parquet(tmp_path / "telemetry" / "history.parquet")
    assert sorted(history["step"].unique()) == [0, 2]
    assert set(history["layer"]) == {"net.0", "net.1", "net.2", MODEL_LAYER}
    # plain SGD holds no state: no optimizer_state rows
    forward, step = {"output", "output_gradient"}, {"parameter", "parameter_gradient", "update"}
    assert set(history["signal"]) == forward | step
    assert history["value"].null_count() == 0


def test_a_log_before_watch_numbers_the_steps_until_the_loop_logs(tmp_path: pathlib.Path) -> None:
    """A resumed run logs 1000 before watch(): steps count on from it until a step logs its own.

    The schedule stays on the tracker's steps 0, 2, 4 (two micro-batches each). The loop logs
    only after step 3, at 2003: step 4 counts on from there. The tracker's count stays in
    ``optimizer_step``.
    """
    telemetry = TelemetryTracker(every_n_steps=2)
    accelerator, model, optimizer, data = setup(
        tmp_path,
        telemetry,
        log_with=["tensorboard", telemetry],
        watch=False,
        gradient_accumulation_steps=2,
    )
    accelerator.log({"lr": 0.05}, step=1000)
    telemetry.watch(model, accelerator=accelerator)
    completed = 0
    for x, y in data:
        with accelerator.accumulate(model):
            accelerator.backward((model(x) - y).square().mean())
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed += 1
            if completed == 4:
                accelerator.log({"lr": 0.05}, step=2003)
            if completed == 6:
                break
    accelerator.end_training()
    frame = samples(tmp_path / "telemetry")
    assert frame["step"].to_list() == [1000, 1000, 1002, 1002, 2004, 2004]
    assert frame["optimizer_step"].to_list() == [0, 0, 2, 2, 4, 4]
    histograms = events(tmp_path / "exp").Histograms("telemetry/net.0/output/histogram")
    assert [e.step for e in histograms] == [1000, 1000, 1002, 1002, 2004, 2004]


def test_registered_by_name_with_the_logging_directory(tmp_path: pathlib.Path) -> None:
    """register_tracker_class: Accelerate builds it with init_kwargs and its logging_dir.

    watch(model) finds the accelerator through its trackers and routes into TensorBoard.
    """
    register_tracker_class(TelemetryTracker)
    try:
        accelerator = Accelerator(
            cpu=True, log_with=["tensorboard", "torchinstruments"], project_dir=tmp_path
        )
        accelerator.init_trackers("exp", init_kwargs={"torchinstruments": {"every_n_steps": 2}})
        telemetry = accelerator.get_tracker("torchinstruments")
        model = Regressor()
        model, optimizer, data = accelerator.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.05), loader()
        )
        telemetry.watch(model)  # found in accelerator.trackers (log_with holds only its name)
        assert accelerator.get_tracker("torchinstruments", unwrap=True) is telemetry.tracker
        train(accelerator, model, optimizer, data, steps=4)  # step 3 ends step 2's window
        accelerator.end_training()
    finally:
        LOGGER_TYPE_TO_CLASS.pop("torchinstruments", None)
    assert samples(tmp_path / "telemetry")["step"].to_list() == [0, 2]
    steps = [e.step for e in events(tmp_path / "exp").Scalars("telemetry/nonfinite_tensors")]
    assert steps == [0, 2]


def test_watch_without_accelerator_uses_the_one_that_holds_the_tracker(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """watch(model) alone finds the Accelerator with the tracker in log_with and routes into it.

    The run directory goes to its project directory, not the working directory, and its
    absolute path is logged at INFO. The loop logs k + 1 after step k, so steps 0 and 2 are 1, 3.
    """
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO, logger="torchinstruments_accelerate")
    telemetry = TelemetryTracker(every_n_steps=2)
    accelerator = Accelerator(cpu=True, log_with=["tensorboard", telemetry], project_dir="project")
    accelerator.init_trackers("exp")
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    telemetry.watch(model)
    prepared, optimizer, data = accelerator.prepare(model, optimizer, loader())
    train(accelerator, prepared, optimizer, data, steps=3, user_step=0)
    accelerator.end_training()
    folder = tmp_path / "project" / "telemetry"
    assert f"writing the run directory to {folder}" in caplog.text
    assert not (tmp_path / "telemetry").exists()
    assert samples(folder)["step"].to_list() == [1, 3]
    histograms = events(tmp_path / "project" / "exp").Histograms("telemetry/net.0/output/histogram")
    assert [e.step for e in histograms] == [1, 3]
    assert hooks(model) == 0
    telemetry.finish()  # again: nothing left to do


@pytest.mark.parametrize("holders", [0, 2])
def test_watch_without_accelerator_warns_when_not_exactly_one_holds_the_tracker(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, holders: int
) -> None:
    """With none or two Accelerators holding the tracker, watch(model) warns and routes nothing.

    The warning names the fix and the absolute folder written (the working directory's).
    """
    monkeypatch.chdir(tmp_path)
    telemetry = TelemetryTracker(every_n_steps=2)
    trackers: list[Any] = ["tensorboard"] if holders == 0 else ["tensorboard", telemetry]
    accelerator = Accelerator(cpu=True, log_with=trackers, project_dir=tmp_path / "project")
    accelerator.init_trackers("exp")
    # a second Accelerator holding the tracker too, kept alive until the end of the test
    _second = Accelerator(cpu=True, log_with=[telemetry]) if holders == 2 else None
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.warns(ObservationWarning) as warned:
        telemetry.watch(model)
    message = str(warned[0].message)
    found = "no Accelerator holds" if holders == 0 else "2 Accelerators hold"
    assert f"got no accelerator and {found} this tracker in log_with" in message
    assert "nothing is routed into the other trackers" in message
    assert f"writing the run directory to {tmp_path / 'telemetry'}." in message
    assert message.endswith("Pass watch(model, accelerator=accelerator).")
    prepared, optimizer, data = accelerator.prepare(model, optimizer, loader())
    train(accelerator, prepared, optimizer, data, steps=3)
    accelerator.end_training()
    telemetry.finish()
    assert samples(tmp_path / "telemetry")["step"].to_list() == [0, 2]
    assert events(tmp_path / "project" / "exp").Tags()["histograms"] == []


def test_watch_warns_when_the_accelerator_given_lacks_the_tracker_in_log_with(
    tmp_path: pathlib.Path,
) -> None:
    """accelerator.log never reaches a tracker left out of log_with: watch says so.

    The run still goes to the run directory, numbered by the tracker's own count (not the
    loop's 1-based steps), and reaches it in full at finish().
    """
    accelerator = Accelerator(cpu=True, log_with=["tensorboard"], project_dir=tmp_path / "project")
    accelerator.init_trackers("exp")
    telemetry = TelemetryTracker(every_n_steps=2)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    prepared, optimizer, data = accelerator.prepare(model, optimizer, loader())
    with pytest.warns(ObservationWarning) as warned:
        telemetry.watch(prepared, accelerator=accelerator, optimizer=optimizer)
    message = str(warned[0].message)
    assert "that Accelerator's log_with does not hold this tracker" in message
    assert "its steps keep the tracker's own count" in message
    assert f"writing the run directory to {tmp_path / 'project' / 'telemetry'}." in message
    assert message.endswith("Pass it in Accelerator(log_with=[..., telemetry]).")
    train(accelerator, prepared, optimizer, data, steps=3, user_step=0)
    accelerator.end_training()
    telemetry.finish()
    records = samples(tmp_path / "project" / "telemetry", kind=None).sort("sample_id")
    assert records.select("step", "kind").rows() == [
        (0, "forward"),
        (0, "step"),
        (2, "forward"),
        (2, "step"),
    ]


def test_finish_leaves_no_hook_and_nothing_holding_the_tracker(tmp_path: pathlib.Path) -> None:
    """After finish() no module hook is left and no hook (the optimizer's) holds the tracker."""
    telemetry = TelemetryTracker(every_n_steps=1, output_dir=tmp_path / "run")
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.warns(ObservationWarning, match="no Accelerator holds this tracker"):
        telemetry.watch(model)
    with pytest.raises(ConfigurationError, match="already watches a model"):
        telemetry.watch(model)
    for _ in range(2):
        model(torch.randn(4, 4)).sum().backward()
        optimizer.step()
    telemetry.finish()
    reference = weakref.ref(telemetry)
    del telemetry
    gc.collect()
    assert reference() is None
    assert hooks(model) == 0
    assert samples(tmp_path / "run")["step"].to_list() == [0, 1]


def test_fp16_gradients_are_unscaled_even_when_the_scaler_grows(tmp_path: pathlib.Path) -> None:
    """Gradients are divided by the loss scale the backward used, also right after it grew.

    The GradScaler updates its scale after the optimizer step that ticks the clock; with
    growth_interval=2 it doubles before steps 2 and 4, both sampled. The loop is Accelerate's
    order (scale, backward, step, update); the accelerator is the part the tracker reads.
    """
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    accelerator = SimpleNamespace(scaler=scaler, trackers=[], logging_dir=tmp_path)
    telemetry = TelemetryTracker(every_n_steps=2)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    telemetry.watch(model, accelerator=accelerator)
    for x, _ in list(loader())[:5]:
        scaler.scale(model(x).sum()).backward()  # d(loss)/d(net.2 output) is exactly 1
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    telemetry.finish()
    assert scaler.get_scale() == 1024.0 * 4
    history = pl.read_parquet(tmp_path / "telemetry" / "history.parquet")
    means = history.filter(
        (pl.col("layer") == "net.2")
        & (pl.col("signal") == "output_gradient")
        & (pl.col("metric") == "mean")
    ).sort("step")
    assert means["step"].to_list() == [0, 2, 4]
    assert means["value"].to_list() == pytest.approx([1.0, 1.0, 1.0])


def test_an_exception_mid_loop_leaves_a_readable_history(tmp_path: pathlib.Path) -> None:
    """A script without end_training that dies of an exception still ends with its history."""
    script = textwrap.dedent(
        """
        import sys, torch
        from accelerate import Accelerator
        from accelerate_helpers import Regressor, loader
        from torchinstruments_accelerate import TelemetryTracker

        telemetry = TelemetryTracker(every_n_steps=2)
        accelerator = Accelerator(cpu=True, log_with=["tensorboard", telemetry],
                                  project_dir=sys.argv[1])
        accelerator.init_trackers("exp")
        model = Regressor()
        model, optimizer, data = accelerator.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.05), loader())
        telemetry.watch(model, accelerator=accelerator)
        for step, (x, y) in enumerate(data):
            loss = (model(x) - y).square().mean()
            if step == 5:
                raise RuntimeError("failure in the training loop")
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        """
    )
    tests = pathlib.Path(__file__).parent
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=tests,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "failure in the training loop" in result.stderr
    history = pl.read_parquet(tmp_path / "telemetry" / "history.parquet")
    assert sorted(history["step"].unique()) == [0, 2, 4]
    assert not (tmp_path / "telemetry" / "history.parts").exists()  # compacted at exit


def test_bad_arguments_raise_naming_the_argument() -> None:
    """Configuration errors name the argument, the value and the choices."""
    with pytest.raises(ConfigurationError, match="every_n_steps=0"):
        TelemetryTracker(every_n_steps=0)
    with pytest.raises(ConfigurationError, match="rank_policy='some'"):
        TelemetryTracker(rank_policy="some")
    with pytest.raises(ConfigurationError, match="error_policy='loud'"):
        TelemetryTracker(error_policy="loud")
    with pytest.raises(ConfigurationError, match="scalar_layers='first'"):
        TelemetryTracker(scalar_layers="first")
    with pytest.raises(ConfigurationError, match="run_name=50"):
        TelemetryTracker(50)
    with pytest.raises(ConfigurationError, match="rank_policy='all' needs a tracker on every"):
        TelemetryTracker("exp", "runs", rank_policy="all")
    with pytest.raises(ConfigurationError, match="model='Tensor'"):
        TelemetryTracker().watch(torch.zeros(1))  # type: ignore[arg-type]


def test_a_fresh_run_in_a_used_project_directory_gets_a_folder_named_after_it(
    tmp_path: pathlib.Path,
) -> None:
    """Two fresh runs in one project_dir: telemetry/, then telemetry-<run_id>/, never "resumed"."""
    ids = []
    for _ in range(2):
        reset_accelerate_state()
        telemetry = TelemetryTracker(every_n_steps=2)
        accelerator, model, optimizer, data = setup(tmp_path, telemetry, log_with=[telemetry])
        assert telemetry.tracker is not None
        ids.append(telemetry.tracker.run_id)
        train(accelerator, model, optimizer, data, steps=3)
        accelerator.end_training()
    folders = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("telemetry"))
    assert folders == sorted(["telemetry", f"telemetry-{ids[1]}"])
    for folder, run_id in zip(["telemetry", f"telemetry-{ids[1]}"], ids, strict=True):
        assert pl.read_parquet(tmp_path / folder / "history.parquet")[
            "run_id"
        ].unique().to_list() == [run_id]
