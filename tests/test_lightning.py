"""TelemetryMonitor with real Lightning training, real loggers and real readers."""

from __future__ import annotations

import csv
import json
import pathlib
import warnings
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import polars as pl_
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_helpers import Regressor, loader, telemetry_dir, trainer
from torchinstruments_core import ConfigurationError, ObservationWarning
from torchinstruments_core._background import ReductionWorker
from torchinstruments_core._measure import Measurer
from torchinstruments_core._native_worker import NativeWorker, ProfileJob
from torchinstruments_lightning import TelemetryMonitor

SAMPLED = [0, 3, 6, 9]


def _events(folder: pathlib.Path) -> EventAccumulator:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return events


def _history(root: pathlib.Path) -> pl_.DataFrame:
    return pl_.read_parquet(telemetry_dir(root) / "history.parquet")


def _hooks(module: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


def test_tensorboard_and_csv_loggers_get_the_sampled_steps(tmp_path: pathlib.Path) -> None:
    """TensorBoard holds histograms and scalars at exactly the sampled steps; CSV the scalars."""
    tensorboard = TensorBoardLogger(tmp_path, name="tb")
    csv_logger = CSVLogger(tmp_path, name="csv")
    monitor = TelemetryMonitor(every_n_steps=3)
    trainer(tmp_path, max_steps=10, logger=[tensorboard, csv_logger], callbacks=[monitor]).fit(
        Regressor(), loader()
    )
    events = _events(pathlib.Path(tensorboard.log_dir))
    histogram_tags = events.Tags()["histograms"]
    assert "telemetry/net.0/output/histogram" in histogram_tags
    assert "telemetry/net.2/output_gradient/histogram" in histogram_tags
    assert [e.step for e in events.Histograms("telemetry/net.0/output/histogram")] == SAMPLED
    rms = events.Scalars("telemetry/net.0/output_gradient/rms")
    assert [e.step for e in rms] == SAMPLED
    assert all(e.value > 0 for e in rms)
    assert [e.step for e in events.Scalars("telemetry/nonfinite_tensors")] == SAMPLED
    with open(pathlib.Path(csv_logger.log_dir) / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    column = "telemetry/net.2/output/max_abs"
    assert sorted({int(r["step"]) for r in rows if r.get(column)}) == SAMPLED
    history = pl_.read_parquet(pathlib.Path(tensorboard.log_dir) / "telemetry" / "history.parquet")
    assert sorted(history["step"].unique()) == SAMPLED
    assert set(history["layer"]) == {"net.0", "net.1", "net.2", "<model>"}  # <model>: step rows


def _telemetry_tags(root: pathlib.Path) -> dict[pathlib.Path, set[str]]:
    """Every folder under ``root`` whose event files hold telemetry tags, with those tags."""
    found = {}
    for folder in {p.parent for p in root.rglob("events.out.tfevents.*")}:
        tags = _events(folder).Tags()
        ours = {t for t in tags["scalars"] + tags["histograms"] if t.startswith("telemetry/")}
        if ours:
            found[folder] = ours
    return found


def test_a_tensorboard_logger_holds_the_only_copy_of_the_telemetry(tmp_path: pathlib.Path) -> None:
    """With a TensorBoardLogger, one event-file folder of the version dir holds telemetry tags."""
    logger = TensorBoardLogger(tmp_path, name="tb")
    monitor = TelemetryMonitor(every_n_steps=2)
    trainer(tmp_path, max_steps=6, logger=logger, callbacks=[monitor], limit_val_batches=0).fit(
        BoringModel()
    )
    version = pathlib.Path(logger.log_dir)
    found = _telemetry_tags(version)
    assert list(found) == [version]
    assert "telemetry/layer/output/histogram" in found[version]
    assert monitor.run_directory == version / "telemetry"
    assert (version / "telemetry" / "history.parquet").exists()
    assert not (version / "telemetry" / "tensorboard").exists()


def test_directory_tensorboard_writes_the_logger_tags(tmp_path: pathlib.Path) -> None:
    """directory_tensorboard=True beside a TensorBoardLogger: same tags, steps and values."""
    logger = TensorBoardLogger(tmp_path, name="tb")
    monitor = TelemetryMonitor(every_n_steps=2, directory_tensorboard=True)
    trainer(tmp_path, max_steps=6, logger=logger, callbacks=[monitor], limit_val_batches=0).fit(
        BoringModel()
    )
    version = pathlib.Path(logger.log_dir)
    found = _telemetry_tags(version)
    directory = version / "telemetry" / "tensorboard"
    assert set(found) == {version, directory}
    assert found[version] == found[directory]
    logged, ours = _events(version), _events(directory)
    for tag in found[version] - {t for t in found[version] if t.endswith("/histogram")}:
        expected = [(e.step, e.value) for e in logged.Scalars(tag)]
        assert [(e.step, e.value) for e in ours.Scalars(tag)] == expected
        assert [step for step, _ in expected] == [0, 2, 4]


def test_without_a_tensorboard_logger_the_run_directory_writes_one(tmp_path: pathlib.Path) -> None:
    """A CSVLogger only: the run directory's tensorboard/ holds the histograms (auto is on)."""
    logger = CSVLogger(tmp_path, name="csv")
    trainer(
        tmp_path, max_steps=4, logger=logger, callbacks=[TelemetryMonitor(every_n_steps=2)]
    ).fit(Regressor(), loader())
    directory = pathlib.Path(logger.log_dir) / "telemetry" / "tensorboard"
    assert "telemetry/net.0/output/histogram" in _telemetry_tags(directory)[directory]


def test_every_micro_batch_of_an_accumulated_step_is_sampled(tmp_path: pathlib.Path) -> None:
    """Under accumulate_grad_batches=3 a sampled step gives three samples, all at that step."""
    monitor = TelemetryMonitor(every_n_steps=2)
    trainer(tmp_path, max_steps=5, accumulate_grad_batches=3, callbacks=[monitor]).fit(
        Regressor(), loader(batches=32)
    )
    samples = pl_.read_parquet(telemetry_dir(tmp_path) / "samples.parquet")
    forward = samples.filter(pl_.col("kind") == "forward")
    assert forward["step"].to_list() == [0, 0, 0, 2, 2, 2, 4, 4, 4]
    assert forward["forward_only"].to_list() == [False] * 9
    # one optimizer step per accumulated step: one step record each
    assert samples.filter(pl_.col("kind") == "step")["step"].to_list() == [0, 2, 4]


def test_validation_and_sanity_check_do_not_shift_the_schedule(tmp_path: pathlib.Path) -> None:
    """Sanity check and validation take no sample by default and move no training sample."""
    monitor = TelemetryMonitor(every_n_steps=3)
    trainer(
        tmp_path, max_steps=10, num_sanity_val_steps=2, val_check_interval=4, callbacks=[monitor]
    ).fit(Regressor(), loader(), loader(batches=4))
    samples = pl_.read_parquet(telemetry_dir(tmp_path) / "samples.parquet")
    assert samples.filter(pl_.col("kind") == "forward")["step"].to_list() == SAMPLED
    assert samples.filter(pl_.col("kind") == "step")["step"].to_list() == SAMPLED
    assert not any(samples["forward_only"])


def test_sample_validation_adds_forward_only_samples(tmp_path: pathlib.Path) -> None:
    """sample_validation=True adds forward-only samples at the step Lightning logs them at.

    That is the step of the validation loss (3 after the fourth training batch, while
    ``global_step`` is 4 already). In TensorBoard they have keys of their own
    (``telemetry/forward_only/...``): the training keys keep one point per sampled training
    step, not the validation batches' beside it.
    """
    tensorboard = TensorBoardLogger(tmp_path, name="tb")
    monitor = TelemetryMonitor(every_n_steps=2, sample_validation=True)
    trainer(
        tmp_path, max_steps=4, val_check_interval=4, logger=tensorboard, callbacks=[monitor]
    ).fit(Regressor(), loader(), loader(batches=2))
    samples = pl_.read_parquet(telemetry_dir(tmp_path) / "samples.parquet")
    forward = samples.filter(pl_.col("kind") == "forward")
    assert forward.select("step", "forward_only").rows() == [
        (0, False),
        (2, False),
        (3, True),
        (3, True),
    ]
    # a validation sample (no gradients) records no optimizer step
    assert samples.filter(pl_.col("kind") == "step")["step"].to_list() == [0, 2]
    events = _events(pathlib.Path(tensorboard.log_dir))
    assert [e.step for e in events.Scalars("telemetry/net.0/output/rms")] == [0, 2]
    assert [e.step for e in events.Histograms("telemetry/net.0/output/histogram")] == [0, 2]
    validation = events.Scalars("telemetry/forward_only/net.0/output/rms")
    assert [e.step for e in events.Scalars("val_loss")] == [3]
    assert [e.step for e in validation] == [3, 3]
    assert [e.step for e in events.Scalars("telemetry/forward_only/nonfinite_tensors")] == [3, 3]
    histograms = events.Histograms("telemetry/forward_only/net.0/output/histogram")
    assert [e.step for e in histograms] == [3, 3]
    assert not [
        t
        for t in events.Tags()["scalars"]
        if t.startswith("telemetry/forward_only/") and "gradient" in t
    ]


class _ValidatingOnce(Regressor):
    """Validation batch 1 runs no forward: it returns, or raises, before it."""

    def __init__(self, raises: bool) -> None:
        super().__init__()
        self.raises = raises

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1 and self.raises:
            raise ValueError("failure before the validation forward")
        if batch_idx != 1:
            super().validation_step(batch, batch_idx)


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_a_validation_batch_without_a_forward_leaves_no_sample(
    tmp_path: pathlib.Path, raises: bool
) -> None:
    """A sampled validation batch that returns or raises before its forward has no sample."""
    monitor = TelemetryMonitor(every_n_steps=2, sample_validation=True)
    fitting = trainer(tmp_path, max_steps=4, val_check_interval=4, callbacks=[monitor])
    with pytest.raises(ValueError, match="before the validation") if raises else nullcontext():
        fitting.fit(_ValidatingOnce(raises), loader(), loader(batches=3))
    forward = _samples(monitor).filter(pl_.col("kind") == "forward")
    validation = [(3, True), (3, True)] if not raises else [(3, True)]
    assert forward.select("step", "forward_only").rows() == [(0, False), (2, False), *validation]
    assert all(rows > 0 for rows in forward["rows"])


def test_manual_optimization(tmp_path: pathlib.Path) -> None:
    """With manual optimization, sampled steps have forward and gradient rows.

    After the only manual_backward nothing runs: one sample a step, the ids without a gap.
    """

    class Manual(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
            optimizer = self.optimizers()
            x, y = batch
            loss = (self.net(x) - y).square().mean()
            optimizer.zero_grad()  # type: ignore[union-attr]
            self.manual_backward(loss)
            optimizer.step()  # type: ignore[union-attr]

    trainer(tmp_path, max_steps=4, callbacks=[TelemetryMonitor(every_n_steps=2)]).fit(
        Manual(), loader()
    )
    history = _history(tmp_path)
    assert sorted(history["step"].unique()) == [0, 2]
    # the manual optimizer.step() is recorded too (plain SGD holds no state)
    assert set(history["signal"]) == {
        "output",
        "output_gradient",
        "parameter",
        "parameter_gradient",
        "update",
    }
    records = pl_.read_parquet(telemetry_dir(tmp_path) / "samples.parquet").sort("sample_id")
    assert records.select("sample_id", "step", "kind").rows() == [
        (0, 0, "forward"),
        (1, 0, "step"),
        (2, 2, "forward"),
        (3, 2, "step"),
    ]


class _TwoPhases(pl.LightningModule):
    """A GAN's shape: two optimizers, each phase its own forward and manual_backward.

    The critic runs in both phases, the generator's output detached in the second.
    """

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
        self.critic = torch.nn.Sequential(torch.nn.Linear(8, 1))
        self.score = torch.nn.Sigmoid()  # a metric-like module after the last step

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        generator_opt, critic_opt = self.optimizers()  # type: ignore[attr-defined]
        fake = self.generator(x)
        generator_opt.zero_grad()
        self.manual_backward(-self.critic(fake).mean())
        generator_opt.step()
        critic_opt.zero_grad()
        real = torch.tanh(x.repeat(1, 2))
        critic_loss = self.critic(fake.detach()).mean() - self.critic(real).mean()
        self.manual_backward(critic_loss)
        critic_opt.step()
        self.log("critic_loss", critic_loss)
        self.log("score", self.score(critic_loss.detach()))

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.SGD(self.generator.parameters(), lr=0.01),
            torch.optim.SGD(self.critic.parameters(), lr=0.01),
        ]


def test_manual_optimization_samples_every_phase_of_a_sampled_step(tmp_path: pathlib.Path) -> None:
    """A second forward and manual_backward in one training_step is a sample of its own.

    The generator phase and the critic phase (two critic calls) are both recorded at the
    batch's step; no phase, no sample: the sample ids run without a gap. The step is the one
    Lightning logs the batch's losses at, which counts batches (``global_step`` counts both
    optimizers' steps: 0, 2, 4, 6), so the telemetry and the losses share their x-axis.
    """
    tensorboard = TensorBoardLogger(tmp_path, name="tb")
    monitor = TelemetryMonitor(every_n_steps=2)
    trainer(tmp_path, max_steps=8, logger=tensorboard, callbacks=[monitor]).fit(
        _TwoPhases(), loader()
    )
    folder = telemetry_dir(tmp_path)
    records = pl_.read_parquet(folder / "samples.parquet").sort("sample_id")
    forward = records.filter(pl_.col("kind") == "forward")
    # the generator's phase, the critic's, and the score's (forward only) of steps 0 and 2
    assert forward.select("step", "forward_only").rows() == [
        (0, False),
        (0, False),
        (0, True),
        (2, False),
        (2, False),
        (2, True),
    ]
    assert records["sample_id"].to_list() == list(range(records.height))
    # each optimizer's step recorded once a sampled step, and no step taken for a skipped one
    steps = records.filter(pl_.col("kind") == "step")
    assert steps["step"].to_list() == [0, 0, 2, 2]
    assert steps["note"].to_list() == [None] * 4
    events = _events(pathlib.Path(tensorboard.log_dir))
    assert [e.step for e in events.Scalars("critic_loss")] == [0, 1, 2, 3]
    # each phase under keys of its own: the critic's gradient is another quantity in each
    gradient = "critic.0/output_gradient/rms"
    assert [e.step for e in events.Scalars(f"telemetry/{gradient}")] == [0, 2]
    assert [e.step for e in events.Scalars(f"telemetry/phase_2/{gradient}")] == [0, 2]
    score = "telemetry/forward_only/phase_3/score/output/rms"
    assert [e.step for e in events.Scalars(score)] == [0, 2]
    history = _history(tmp_path)
    phases = (
        history.filter(pl_.col("signal") == "output_gradient", pl_.col("step") == 0)
        .group_by("sample_id")
        .agg(pl_.col("layer").unique().sort(), pl_.col("call_index").max())
        .sort("sample_id")
    )
    first, second = phases.rows()[0], phases.rows()[1]
    assert first[1:] == (["critic.0", "generator.0", "generator.1"], 0)
    assert second[1:] == (["critic.0"], 1)  # two critic calls, the generator's output detached


class _Skipping(Regressor):
    """Batch 2 of each epoch runs no forward: ``training_step`` returns ``None`` before it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:  # type: ignore[override]
        return None if batch_idx == 2 else super().training_step(batch, batch_idx)


class _EndingEpochs(Regressor):
    """``on_train_batch_start`` returns -1 at batch 2: each epoch ends before its forward."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if batch_idx == 2 else None


class _SkippingByHand(Regressor):
    """Batch 2 of each epoch runs no forward, under manual optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        if batch_idx != 2:
            optimizer = self.optimizers()
            optimizer.zero_grad()  # type: ignore[union-attr]
            self.manual_backward(super().training_step(batch, batch_idx))
            optimizer.step()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("model", "forwards"),
    [(_Skipping(), [0, 4, 6, 8]), (_EndingEpochs(), [0, 2]), (_SkippingByHand(), [0, 4, 6, 8])],
    ids=["training_step_returns_none", "on_train_batch_start_returns_-1", "manual_optimization"],
)
@pytest.mark.filterwarnings("ignore:`training_step` returned `None`")
def test_a_sampled_batch_without_a_forward_leaves_no_sample(
    tmp_path: pathlib.Path, model: Regressor, forwards: list[int]
) -> None:
    """A sampled step that runs no forward (a skipped batch) has no sample, empty or forward-only.

    Batch 2 is sampled and skipped: ``training_step`` returns ``None`` (step 2 still has the
    optimizer step Lightning takes), or ``on_train_batch_start`` returns -1 (the epoch ends,
    and the next one's first batch is step 2 again, sampled with its forward; the second
    epoch ends at step 4). The samples are the forwards that ran,
    with their rows; ``result.json`` counts no forward-only sample and the CSV logger gets no
    ``telemetry/forward_only/`` key.
    """
    csv_logger = CSVLogger(tmp_path, name="csv")
    monitor = TelemetryMonitor(every_n_steps=2)
    trainer(tmp_path, max_epochs=2, logger=csv_logger, callbacks=[monitor]).fit(
        model, loader(batches=5)
    )
    samples = _samples(monitor)
    forward = samples.filter(pl_.col("kind") == "forward")
    assert forward["step"].to_list() == forwards
    assert not any(forward["forward_only"])
    assert all(rows > 0 for rows in forward["rows"])
    assert samples["sample_id"].to_list() == list(range(samples.height))
    assert monitor.run_directory is not None
    result = json.loads((monitor.run_directory / "result.json").read_text())
    assert (result["samples"]["count"], result["samples"]["forward_only"]) == (len(forwards), 0)
    with open(pathlib.Path(csv_logger.log_dir) / "metrics.csv") as handle:
        columns = next(csv.reader(handle))
    assert "telemetry/net.0/output/rms" in columns
    assert not [c for c in columns if c.startswith("telemetry/forward_only/")]


class _Minimized(Regressor):
    """LBFGS, whose closure re-evaluates ``training_step``; it calls the LightningModule itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return (self(x) - y).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


def test_an_lbfgs_closure_s_re_evaluations_stay_unsampled(tmp_path: pathlib.Path) -> None:
    """A sampled step is its first forward and backward and its optimizer step, once each."""
    monitor = TelemetryMonitor(every_n_steps=2)
    trainer(tmp_path, max_steps=4, callbacks=[monitor]).fit(_Minimized(), loader())
    samples = _samples(monitor)
    assert samples.select("step", "kind", "forward_only").rows() == [
        (step, kind, False) for step in (0, 2) for kind in ("forward", "step")
    ]


def test_exception_mid_fit_removes_hooks_and_finalizes(tmp_path: pathlib.Path) -> None:
    """An exception in training_step: hooks removed, the run directory finalized with samples."""
    model = Regressor(fail_at_step=5)
    with pytest.raises(RuntimeError, match="failure in training_step"):
        trainer(tmp_path, max_steps=10, callbacks=[TelemetryMonitor(every_n_steps=2)]).fit(
            model, loader()
        )
    assert _hooks(model) == 0
    assert sorted(_history(tmp_path)["step"].unique()) == [0, 2, 4]
    assert (telemetry_dir(tmp_path) / "result.json").read_text().count('"status": "complete"') == 1


def test_keyboard_interrupt_removes_hooks_and_finalizes(tmp_path: pathlib.Path) -> None:
    """Ctrl-C during fit (Lightning's graceful interrupt) still finalizes the run directory."""
    model = Regressor(interrupt_at_step=3)
    fit = trainer(tmp_path, max_steps=10, callbacks=[TelemetryMonitor(every_n_steps=1)])
    with pytest.raises(SystemExit):
        fit.fit(model, loader())
    assert _hooks(model) == 0
    assert sorted(_history(tmp_path)["step"].unique()) == [0, 1, 2]


def test_resume_continues_sample_ids_and_steps_without_overwriting(tmp_path: pathlib.Path) -> None:
    """A resumed fit continues sample ids and steps in telemetry-resumed-1/ under a new run id."""
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    first = trainer(
        tmp_path, max_steps=4, logger=logger, callbacks=[TelemetryMonitor(every_n_steps=2)]
    )
    first.fit(Regressor(), loader())
    checkpoint = next((tmp_path / "run" / "version_0" / "checkpoints").glob("*.ckpt"))
    before = (tmp_path / "run" / "version_0" / "telemetry" / "history.parquet").read_bytes()
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    second = trainer(
        tmp_path, max_steps=8, logger=logger, callbacks=[TelemetryMonitor(every_n_steps=2)]
    )
    with pytest.warns(UserWarning, match="Checkpoint directory .* exists and is not empty"):
        second.fit(Regressor(), loader(), ckpt_path=checkpoint)
    folder = tmp_path / "run" / "version_0"
    assert (folder / "telemetry" / "history.parquet").read_bytes() == before
    first_samples = pl_.read_parquet(folder / "telemetry" / "samples.parquet")
    resumed = pl_.read_parquet(folder / "telemetry-resumed-1" / "samples.parquet")
    # a forward sample and a step record per sampled step, sharing one id sequence
    assert first_samples.select("sample_id", "step").rows() == [(0, 0), (1, 0), (2, 2), (3, 2)]
    assert resumed.select("sample_id", "step").rows() == [(4, 4), (5, 4), (6, 6), (7, 6)]
    assert resumed["run_id"].n_unique() == first_samples["run_id"].n_unique() == 1
    assert resumed["run_id"][0] != first_samples["run_id"][0]


class _Evaluated(Regressor):
    """A Regressor that can also be tested and predicted with."""

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])


def _samples(monitor: TelemetryMonitor) -> pl_.DataFrame:
    assert monitor.run_directory is not None
    return pl_.read_parquet(monitor.run_directory / "samples.parquet").sort("sample_id")


@pytest.mark.parametrize(
    ("stage", "option"),
    [("validate", "sample_validation"), ("test", "sample_test"), ("predict", "sample_predict")],
)
def test_a_checkpoint_saved_after_a_sampled_evaluation_resumes_the_fit(
    tmp_path: pathlib.Path, stage: str, option: str
) -> None:
    """A sampled validate, test or predict run is a run of its own, never the checkpoint's.

    Saved after it, the checkpoint holds the fit's run id and next sample id: the fit resumed
    from it continues the fit's ids (4 on), not the evaluation's (0, 1).
    """
    monitor = TelemetryMonitor(every_n_steps=2)
    setattr(monitor, option, True)
    quiet = {"logger": False, "enable_checkpointing": False}
    fitting = trainer(tmp_path, max_steps=4, callbacks=[monitor], **quiet)
    model = _Evaluated()
    fitting.fit(model, loader())
    fit_run = _samples(monitor)["run_id"][0]
    getattr(fitting, stage)(model, loader(batches=2))
    evaluated = _samples(monitor)
    assert evaluated["sample_id"].to_list() == [0, 1]
    assert evaluated["run_id"][0] != fit_run
    fitting.save_checkpoint(tmp_path / "after.ckpt")
    (state,) = torch.load(tmp_path / "after.ckpt", weights_only=False)["callbacks"].values()
    assert (state["run_id"], state["next_sample_id"]) == (fit_run, 4)
    resumed = TelemetryMonitor(every_n_steps=2)
    later = trainer(tmp_path, max_steps=6, callbacks=[resumed], **quiet)
    later.fit(_Evaluated(), loader(), ckpt_path=tmp_path / "after.ckpt")
    assert _samples(resumed).select("sample_id", "step").rows() == [(4, 4), (5, 4)]


class _Sized(Regressor):
    """A Regressor with what the tuner adjusts: a learning rate and the loader's batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.lr = 0.05
        self.batch_size = 4

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> Any:
        return loader(batches=64 // self.batch_size, batch_size=self.batch_size)

    def val_dataloader(self) -> Any:
        return loader(batches=2, batch_size=self.batch_size)


@pytest.mark.parametrize("finder", ["lr", "batch_size"])
def test_a_tuner_callback_does_not_make_a_fresh_fit_a_resumed_one(
    tmp_path: pathlib.Path, finder: str, caplog: pytest.LogCaptureFixture
) -> None:
    """LearningRateFinder and BatchSizeFinder restore a checkpoint of their own as fitting starts.

    That leaves ``trainer.ckpt_path`` set; the fit is still a new run, in ``telemetry/``, its
    sample ids from 0 and the tuner's own steps not in it. Fitting the same callback again
    starts another new run (its state from the first fit is in the tuner's checkpoint too).
    """
    from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder

    def tuner() -> pl.Callback:
        if finder == "lr":
            return LearningRateFinder(num_training_steps=5)
        return BatchSizeFinder(mode="power", max_trials=2, steps_per_trial=2)

    def fit(version: int, steps: int) -> None:
        logger = TensorBoardLogger(tmp_path, name="run", version=version)
        fitting = trainer(tmp_path, max_steps=steps, logger=logger, callbacks=[tuner(), monitor])
        with warnings.catch_warnings(record=True) as caught:  # the tuner's own warn, or not
            warnings.simplefilter("always")
            fitting.fit(_Sized())
        assert not [w for w in caught if issubclass(w.category, ObservationWarning)]

    monitor = TelemetryMonitor(every_n_steps=2)
    caplog.set_level("INFO")
    fit(0, 4)
    folder = tmp_path / "run" / "version_0"
    assert sorted(p.name for p in folder.glob("telemetry*")) == ["telemetry"]
    records = pl_.read_parquet(folder / "telemetry" / "samples.parquet").sort("sample_id")
    assert records.select("sample_id", "kind").rows() == [
        (0, "forward"),
        (1, "step"),
        (2, "forward"),
        (3, "step"),
    ]
    # at the steps Lightning logs the loss at (BatchSizeFinder leaves them 1-based)
    logged = [e.step for e in _events(folder).Scalars("loss")]
    sampled = [step for step in logged if step % 2 == 0]
    assert records["step"].to_list() == [step for step in sampled for _ in ("forward", "step")]
    assert "TelemetryMonitor: new run" in caplog.text
    assert "resumed run" not in caplog.text
    fit(1, 2)
    assert sorted(p.name for p in (tmp_path / "run" / "version_1").glob("telemetry*")) == [
        "telemetry"
    ]
    assert "resumed run" not in caplog.text


def test_a_fit_after_validating_a_checkpoint_is_a_new_run(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """validate(ckpt_path=...) restores the callback's state; the fit after it resumes nothing."""
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)
    first = TelemetryMonitor(every_n_steps=2)
    trainer(tmp_path, max_steps=4, logger=False, callbacks=[first, saver]).fit(
        Regressor(), loader()
    )
    checkpoint = next((tmp_path / "ckpt").glob("*.ckpt"))
    monitor = TelemetryMonitor(every_n_steps=2)
    later = tmp_path / "later"
    fitting = trainer(later, max_steps=2, logger=False, callbacks=[monitor])
    model = Regressor()
    with pytest.warns(UserWarning, match="callbacks used to create the checkpoint"):
        fitting.validate(model, loader(batches=2), ckpt_path=checkpoint)
    caplog.set_level("INFO")
    fitting.ckpt_path = None  # Lightning's own: the fit that follows starts afresh
    fitting.fit(model, loader())
    assert "resumed run" not in caplog.text
    assert not list(later.rglob("*-resumed-*"))
    records = pl_.read_parquet(telemetry_dir(later) / "samples.parquet").sort("sample_id")
    assert records["sample_id"].to_list() == [0, 1]


def test_run_id_rank_sample_id_is_a_unique_key_across_fits_and_resumes(
    tmp_path: pathlib.Path,
) -> None:
    """Fitting twice with one callback and resuming from an earlier checkpoint repeat no key.

    The checkpoint at step 4 says 2 samples were taken while the run went on to 4: the resumed
    fits (with the same callback, and with a new one as in a new process) take sample ids 2 and
    3 again, under run ids of their own. All folders are read together.
    """
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_train_steps=2)
    monitor = TelemetryMonitor(every_n_steps=2)
    trainer(tmp_path, max_steps=8, logger=False, callbacks=[monitor, saver]).fit(
        Regressor(), loader()
    )
    quiet = {"logger": False, "enable_checkpointing": False}
    trainer(tmp_path, max_steps=4, callbacks=[monitor], **quiet).fit(Regressor(), loader())
    earlier = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    for callback in (monitor, TelemetryMonitor(every_n_steps=2)):
        resumed = trainer(tmp_path, max_steps=8, callbacks=[callback], **quiet)
        with pytest.warns(UserWarning, match="callbacks used to create the checkpoint"):
            resumed.fit(Regressor(), loader(), ckpt_path=earlier)
    folders = sorted(p.parent for p in (tmp_path / "telemetry").glob("*/samples.parquet"))
    assert len(folders) == 4
    assert sum(f.name.endswith(("-resumed-1", "-resumed-2")) for f in folders) == 2
    samples = pl_.read_parquet([f / "samples.parquet" for f in folders])
    assert samples.height == 2 * (4 + 2 + 2 + 2)  # a sample and a step record per sampled step
    assert not samples.select("run_id", "rank", "sample_id").is_duplicated().any()
    assert samples["run_id"].n_unique() == 4
    history = pl_.read_parquet([f / "history.parquet" for f in folders])
    key = ["run_id", "rank", "sample_id", "layer", "call_index", "signal", "tensor_path", "metric"]
    assert not history.select(key).is_duplicated().any()


def test_an_occupied_output_dir_gives_a_fresh_run_a_folder_of_its_own(
    tmp_path: pathlib.Path,
) -> None:
    """output_dir holding a run: a fresh fit writes <output_dir>-<run_id>, never -resumed-."""
    out = tmp_path / "stats"
    monitors = [TelemetryMonitor(every_n_steps=2, output_dir=out) for _ in range(2)]
    for monitor in monitors:
        trainer(
            tmp_path, max_steps=2, logger=False, enable_checkpointing=False, callbacks=[monitor]
        ).fit(Regressor(), loader())
    first, second = (m.run_directory for m in monitors)
    assert first == out
    assert second is not None
    run_id = pl_.read_parquet(second / "samples.parquet")["run_id"][0]
    assert second == tmp_path / f"stats-{run_id}"


def test_fp16_gradients_are_reported_unscaled(tmp_path: pathlib.Path) -> None:
    """Under 16-mixed with a GradScaler, gradients are recorded divided by the loss scale."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    class SumLoss(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, _ = batch
            return self.net(x).float().sum()  # d(loss)/d(output of net.2) is exactly 1

    means = {}
    for unscale in (True, False):
        root = tmp_path / str(unscale)
        plugin = MixedPrecision(
            "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0)
        )
        monitor = TelemetryMonitor(every_n_steps=1, unscale_gradients=unscale)
        trainer(root, max_steps=1, plugins=[plugin], callbacks=[monitor]).fit(SumLoss(), loader())
        history = _history(root)
        means[unscale] = history.filter(
            (pl_.col("layer") == "net.2")
            & (pl_.col("signal") == "output_gradient")
            & (pl_.col("metric") == "mean")
        )["value"].item()
    assert means[True] == pytest.approx(1.0)
    assert means[False] == pytest.approx(1024.0)


def test_bf16_mixed_works(tmp_path: pathlib.Path) -> None:
    """Under bf16-mixed the statistics are finite and the gradients present."""
    trainer(
        tmp_path, max_steps=2, precision="bf16-mixed", callbacks=[TelemetryMonitor(every_n_steps=1)]
    ).fit(Regressor(), loader())
    history = _history(tmp_path)
    assert history["value"].null_count() == 0
    forward = {"output", "output_gradient"}
    assert set(history["signal"]) == forward | {"parameter", "parameter_gradient", "update"}


def test_beside_weight_averaging_checkpointing_and_anomaly_detection(
    tmp_path: pathlib.Path,
) -> None:
    """SWA, EMA weight averaging, ModelCheckpoint and detect_anomaly work beside the monitor."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    callbacks: list[pl.Callback] = [
        TelemetryMonitor(every_n_steps=2),
        StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1),
        ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_train_steps=2),
    ]
    model = Regressor()
    trainer(tmp_path, max_epochs=2, callbacks=callbacks, detect_anomaly=True).fit(
        model, loader(batches=4)
    )
    assert sorted(_history(tmp_path)["step"].unique()) == [0, 2, 4, 6]
    assert _hooks(model) == 0
    ema_root = tmp_path / "ema"
    ema = [TelemetryMonitor(every_n_steps=2), EMAWeightAveraging(decay=0.9)]
    trainer(ema_root, max_steps=4, callbacks=ema).fit(Regressor(), loader())
    assert sorted(_history(ema_root)["step"].unique()) == [0, 2]


def test_bad_arguments_raise_in_the_constructor() -> None:
    """Configuration errors name the argument, the value and the choices."""
    with pytest.raises(ConfigurationError, match="every_n_steps=0"):
        TelemetryMonitor(every_n_steps=0)
    with pytest.raises(ConfigurationError, match="rank_policy='some'"):
        TelemetryMonitor(rank_policy="some")


def test_the_reduction_worker_gives_lightning_the_same_values(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BoringModel under a real Trainer: history and logger values equal with the worker on/off."""
    handed: list[int] = []
    submit = ReductionWorker.submit

    def counted(self: ReductionWorker, nbytes: int, make: Any, **options: Any) -> int | None:
        handed.append(nbytes)
        return submit(self, nbytes, make, **options)

    monkeypatch.setattr(ReductionWorker, "submit", counted)
    shared: list[bool] = []  # per tensor handed over: read where it lies, not copied
    job = Measurer._job

    def watched_job(self: Measurer, plain: Any, measurement: Any, *args: Any, **kwargs: Any) -> Any:
        made = job(self, plain, measurement, *args, **kwargs)
        shared.append(measurement.shared is not None)
        return made

    monkeypatch.setattr(Measurer, "_job", watched_job)
    found = {}
    for background in (False, True):
        root = tmp_path / str(background)
        pl.seed_everything(0)
        logger = TensorBoardLogger(root, name="tb")
        monitor = TelemetryMonitor(every_n_steps=2, background_reductions=background)
        trainer(root, max_steps=6, logger=logger, callbacks=[monitor], limit_val_batches=0).fit(
            BoringModel()
        )
        assert bool(handed) == background  # every tensor through the worker, or none
        history = _history(root).sort(["step", "layer", "signal", "tensor_path", "metric"])
        scalars = _events(pathlib.Path(logger.log_dir))
        tag = "telemetry/layer/output/rms"
        found[background] = (
            history.select(["step", "layer", "signal", "tensor_path", "metric", "value"]),
            [(e.step, e.value) for e in scalars.Scalars(tag)],
        )
    assert any(shared)  # gradients, and outputs after the first sample
    assert not all(shared)  # the first sample's outputs are copied
    assert found[True][0].height > 0
    assert found[True][0].equals(found[False][0])
    assert found[True][1] == found[False][1]
    assert [step for step, _ in found[True][1]] == [0, 2, 4]


def test_a_small_model_goes_to_the_kernels_queue_after_its_first_sample(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BoringModel under a real Trainer, a core free, ``background_reductions=None`` (default).

    Its samples are small (``SMALL_SAMPLE_ENTRIES``): the first goes to the worker, the later
    ones to the kernels' reduction queue (in the hooks where the kernels have none); the step
    records' tensors go to the queue from the first on. The history equals the one reduced in
    the hooks throughout.
    """
    import torchinstruments_core._measure as measure_module

    monkeypatch.setattr(measure_module, "free_core", lambda: True)
    per_sample: list[int] = []
    queued: list[int] = []
    submit, new_sample = ReductionWorker.submit, Measurer.new_sample
    start = ProfileJob.start

    def counted(self: ReductionWorker, nbytes: int, make: Any, **options: Any) -> int | None:
        per_sample[-1] += 1
        return submit(self, nbytes, make, **options)

    def counted_queue(job: ProfileJob, queue: object | None) -> int | None:
        queued[-1] += 1  # every job handed to the kernels' queue starts once
        return start(job, queue)

    def starting(self: Measurer, *, forward: bool = False) -> None:
        if forward:
            per_sample.append(0)
            queued.append(0)
        new_sample(self, forward=forward)

    monkeypatch.setattr(ReductionWorker, "submit", counted)
    monkeypatch.setattr(ProfileJob, "start", counted_queue)
    monkeypatch.setattr(Measurer, "new_sample", starting)
    found = {}
    for background in (None, False):
        root = tmp_path / str(background)
        per_sample.clear()
        queued.clear()
        pl.seed_everything(0)
        monitor = TelemetryMonitor(every_n_steps=2, background_reductions=background)
        trainer(root, max_steps=6, callbacks=[monitor], limit_val_batches=0).fit(BoringModel())
        if background is None:
            assert len(per_sample) == 3
            assert per_sample[0] > 0
            assert per_sample[1:] == [0, 0]
            if NativeWorker.available():
                forward, step = per_sample[0], queued[0]  # the first sample's, the step's
                assert step == 6  # the weight and the bias, their gradients and updates
                assert queued == [step, forward + step, forward + step]
            else:  # the first step record's tensors on the worker, the later ones in the hooks
                assert queued == [0, 0, 0]
        history = _history(root).sort(["step", "layer", "signal", "tensor_path", "metric"])
        found[background] = history.select(
            ["step", "layer", "signal", "tensor_path", "metric", "value"]
        )
    assert found[None].height > 0
    assert found[None].equals(found[False])
