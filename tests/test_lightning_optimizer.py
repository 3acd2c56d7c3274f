"""TelemetryMonitor's optimizer step signals, against the optimizer's own view in float64.

The test's optimizer hooks (registered in ``configure_optimizers``, before the monitor's) copy
what the optimizer used. Lightning turns ``precision="16-mixed"`` into ``bf16-mixed`` on the CPU
(it warns that fp16 AMP is not supported there), so the fp16 tests pass Lightning's own
``MixedPrecision("16-mixed", "cpu")`` plugin: fp16 autocast with torch's CPU GradScaler, through
the same ``MixedPrecision.optimizer_step`` that ``16-mixed`` runs on a GPU.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import polars as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_helpers import Regressor, loader, trainer
from optimizer_helpers import (
    WIDE,
    Key,
    Reference,
    assert_matches,
    queued_copies,
    split,
    stats,
    wide_net,
)
from torchinstruments_core import ConfigurationError
from torchinstruments_lightning import TelemetryMonitor

STEP_SIGNALS = ["parameter", "parameter_gradient", "update", "optimizer_state"]


class Recorded(Regressor):
    """``Regressor`` whose optimizer is followed by a ``Reference``; optionally poisoned."""

    def __init__(self, poison_step: int | None = None) -> None:
        super().__init__()
        self.poison_step = poison_step
        self.reference: Reference | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_step == self.poison_step:  # inf gradients: the scaler skips the step
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        self.reference = Reference(optimizer, {id(p): n for n, p in self.named_parameters()})
        return optimizer


def _fit(tmp_path: pathlib.Path, model: Recorded, **kwargs: Any) -> pathlib.Path:
    monitor = TelemetryMonitor(
        every_n_steps=kwargs.pop("every_n_steps", 1),
        output_dir=tmp_path / "run",
        log_to_loggers=False,
        step_signals=kwargs.pop("step_signals", STEP_SIGNALS),
    )
    fit = trainer(tmp_path, callbacks=[monitor], logger=False, enable_checkpointing=False, **kwargs)
    fit.fit(model, loader())
    assert monitor.run_directory is not None
    return monitor.run_directory


def _fit_fp16(tmp_path: pathlib.Path, model: Recorded, **kwargs: Any) -> pathlib.Path:
    """Three steps under Lightning's fp16 ``MixedPrecision`` plugin with a CPU GradScaler."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    return _fit(tmp_path, model, plugins=[plugin], max_steps=3, **kwargs)


def _step_rows(run: pathlib.Path) -> dict[int, dict[Key, float | None]]:
    """The step records' rows by trainer step."""
    history = pl.read_parquet(run / "history.parquet")
    signals = history.filter(pl.col("signal").is_in(STEP_SIGNALS))
    found: dict[int, dict[Key, float | None]] = {}
    for step, layer, signal, path, metric, value in signals.select(
        "step", "layer", "signal", "tensor_path", "metric", "value"
    ).iter_rows():
        found.setdefault(step, {})[(layer, signal, path, metric)] = value
    return found


def _check(rows: dict[Key, float | None], copies: Any, rel: float) -> None:
    for name, before in copies.before.items():
        layer, path = split(name)
        assert_matches(rows, layer, "parameter", path, stats(before), rel=rel)
        gradient = stats(copies.gradient[name])
        assert_matches(rows, layer, "parameter_gradient", path, gradient, rel=rel)
        update = stats(copies.after[name] - before)
        assert_matches(rows, layer, "update", path, update, rel=max(rel, 1e-6))
        momentum = stats(copies.state[name]["momentum_buffer"])
        assert_matches(rows, layer, "optimizer_state", f"{path}.momentum_buffer", momentum, rel=rel)


def test_float64_rows_under_clipping_and_accumulation(tmp_path: pathlib.Path) -> None:
    """64-true, clipping and accumulation: sampled steps' rows match the float64 optimizer view.

    The gradient is the accumulated, clipped one (its whole-model norm is the clip value); the
    unsampled steps have no step record.
    """
    model = Recorded()
    run = _fit(
        tmp_path,
        model,
        precision="64-true",
        gradient_clip_val=0.05,
        accumulate_grad_batches=2,
        max_steps=4,
        every_n_steps=2,
    )
    assert model.reference is not None
    rows = _step_rows(run)
    assert sorted(rows) == [0, 2]  # the unsampled steps have no step record
    for step, found in rows.items():
        _check(found, model.reference.steps[step], rel=1e-9)
        assert found[("<model>", "parameter_gradient", "*", "l2_norm")] == pytest.approx(0.05)


def test_fp16_gradients_are_unscaled_and_clipped(tmp_path: pathlib.Path) -> None:
    """fp16 with a GradScaler and clipping: gradients are the unscaled, clipped ones used."""
    model = Recorded()
    run = _fit_fp16(tmp_path, model, gradient_clip_val=0.05)
    assert model.reference is not None
    rows = _step_rows(run)
    assert sorted(rows) == [0, 1, 2]
    for step, found in rows.items():
        _check(found, model.reference.steps[step], rel=1e-5)
        norm = found[("<model>", "parameter_gradient", "*", "l2_norm")]
        assert norm == pytest.approx(0.05, rel=1e-4)


def test_a_skipped_fp16_step_is_a_note(tmp_path: pathlib.Path) -> None:
    """A step the GradScaler skips (inf gradients) has no step rows, only a note."""
    model = Recorded(poison_step=1)
    run = _fit_fp16(tmp_path, model)
    assert sorted(_step_rows(run)) == [0, 2]
    samples = pl.read_parquet(run / "samples.parquet").filter(pl.col("kind") == "step")
    assert samples.sort("step").select("step", "note").rows() == [
        (0, None),
        (1, "optimizer_step_skipped"),
        (2, None),
    ]


def test_step_signals_option_reaches_the_monitor(tmp_path: pathlib.Path) -> None:
    """``step_signals`` chooses the recorded signals; a bad value fails in the constructor."""
    run = _fit(tmp_path, Recorded(), max_steps=1, step_signals=["update"])
    history = pl.read_parquet(run / "history.parquet").filter(pl.col("signal").is_in(STEP_SIGNALS))
    assert set(history["signal"]) == {"update"}
    with pytest.raises(ConfigurationError, match=r"step_signals=\['weights'\]"):
        TelemetryMonitor(step_signals=["weights"])


class Wide(Recorded):
    """``Recorded`` with a 512 x 512 weight (1 MiB): its copy goes to the kernels' queue."""

    def __init__(self) -> None:
        super().__init__()
        self.net = wide_net()


def test_a_large_parameter_copied_on_the_kernels_queue_gives_the_optimizer_s_rows(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In ``Trainer.fit``, a weight of 1 MiB is copied on the kernels' queue before each step.

    Lightning steps the optimizer with a closure, so the copies are queued when it returns; on
    one torch thread the reductions (and the copies) go to the queue. The rows match the float64
    copies the test's own hooks took, as every other parameter's do.
    """
    with queued_copies(monkeypatch) as copied:
        model = Wide()
        run = _fit(tmp_path, model, max_steps=3)
    assert copied == [WIDE * WIDE] * 3
    assert model.reference is not None
    rows = _step_rows(run)
    assert sorted(rows) == [0, 1, 2]
    for step, found in rows.items():
        _check(found, model.reference.steps[step], rel=1e-5)


class Listed(Recorded):
    """``Recorded`` whose param group lists the first layer's weight twice (torch warns)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        weight = self.net[0].weight
        assert isinstance(weight, torch.nn.Parameter)
        with pytest.warns(UserWarning, match="duplicate parameters"):
            optimizer = torch.optim.SGD([weight, *self.parameters()], lr=0.05, momentum=0.9)
        self.reference = Reference(optimizer, {id(p): n for n, p in self.named_parameters()})
        return optimizer


def test_a_parameter_listed_twice_has_one_set_of_rows_in_fit(tmp_path: pathlib.Path) -> None:
    """In ``Trainer.fit``, a parameter listed twice has one row per metric, of the whole step.

    Its update is its change over the whole step (torch's SGD applies both entries), as the
    test's own hooks saw it.
    """
    model = Listed()
    run = _fit(tmp_path, model, max_steps=2)
    history = pl.read_parquet(run / "history.parquet").filter(pl.col("signal").is_in(STEP_SIGNALS))
    keys = history.select("step", "layer", "signal", "tensor_path", "metric")
    assert keys.height == keys.unique().height
    assert model.reference is not None
    rows = _step_rows(run)
    assert sorted(rows) == [0, 1]
    for step, found in rows.items():
        _check(found, model.reference.steps[step], rel=1e-5)


class FailingSGD(torch.optim.SGD):
    """SGD whose third step raises after its hooks' pre-step work (its closure has run)."""

    steps = 0

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        type(self).steps += 1
        if type(self).steps == 3:
            raise RuntimeError("the third step failed")
        super().step()
        return loss


class FailsAtStep(Recorded):
    """``Recorded`` with ``FailingSGD``."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return FailingSGD(self.parameters(), lr=0.05, momentum=0.9)


def test_a_step_that_raises_in_fit_keeps_what_was_measured_before_it(
    tmp_path: pathlib.Path,
) -> None:
    """``optimizer.step()`` raising ends ``fit``; the run keeps that step's record all the same.

    Its record holds the parameters and gradients measured before the step, and no update or
    optimizer state (its post-hook never ran); the steps before it are whole, nothing is lost.
    """
    model = FailsAtStep()
    monitor = TelemetryMonitor(every_n_steps=1, output_dir=tmp_path / "run", log_to_loggers=False)
    fit = trainer(
        tmp_path, callbacks=[monitor], logger=False, enable_checkpointing=False, max_steps=5
    )
    with pytest.raises(RuntimeError, match="the third step failed"):
        fit.fit(model, loader())
    assert monitor.run_directory is not None
    run = monitor.run_directory
    history = pl.read_parquet(run / "history.parquet").filter(pl.col("signal").is_in(STEP_SIGNALS))
    signals = {
        step: set(rows["signal"]) for (step,), rows in history.group_by("step", maintain_order=True)
    }
    assert signals == {
        0: set(STEP_SIGNALS),
        1: set(STEP_SIGNALS),
        2: {"parameter", "parameter_gradient"},
    }
    failed = _step_rows(run)[2]
    for name, parameter in model.named_parameters():  # as the failed step found them
        layer, path = split(name.removeprefix("net."))
        assert_matches(failed, f"net.{layer}", "parameter", path, stats(parameter), rel=1e-5)
    result = json.loads((run / "result.json").read_text())
    assert result["lost"]["samples"] == 0
    assert result["step_records"]["count"] == 3


class _AccumulatedByHand(Recorded):
    """Manual optimization accumulating two batches by hand (Lightning's documented pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        x, y = batch
        optimizer = self.optimizers()
        self.manual_backward((self.net(x) - y).square().mean() / 2)
        if (batch_idx + 1) % 2 == 0:
            optimizer.step()  # type: ignore[union-attr]
            optimizer.zero_grad()  # type: ignore[union-attr]


def test_manual_accumulation_records_the_step_that_ends_a_sampled_batch_s(
    tmp_path: pathlib.Path,
) -> None:
    """Under manual optimization the optimizer step a sampled batch's gradients go into is recorded.

    Batches 0, 3 and 6 are sampled (every 3 of Lightning's batch count); the optimizer steps
    after batches 1, 3, 5 and 7. Batch 3's own step is recorded, and batches 0 and 6, which
    step nothing, have the next step recorded at their step: optimizer steps 0, 1 and 3, with
    the accumulated gradients they used, and no step noted skipped.
    """
    model = _AccumulatedByHand()
    run = _fit(tmp_path, model, precision="64-true", max_steps=4, every_n_steps=3)
    assert model.reference is not None
    assert len(model.reference.steps) == 4
    rows = _step_rows(run)
    assert sorted(rows) == [0, 3, 6]
    for step, optimizer_step in [(0, 0), (3, 1), (6, 3)]:
        _check(rows[step], model.reference.steps[optimizer_step], rel=1e-9)
    records = pl.read_parquet(run / "samples.parquet").sort("sample_id")
    assert records.select("step", "kind", "note").rows() == [
        (step, kind, None) for step in (0, 3, 6) for kind in ("forward", "step")
    ]


def test_manual_accumulation_sampled_every_batch_notes_no_skipped_step(
    tmp_path: pathlib.Path,
) -> None:
    """Every batch sampled, the optimizer stepping after every second one: nothing is skipped.

    The batches that step no optimizer (0, 2, 4, 6) are the loop's own accumulation, not a
    step the GradScaler skipped: they have no step record, and each optimizer step is recorded
    at the batch that took it (1, 3, 5, 7), with the gradients of both batches.
    """
    model = _AccumulatedByHand()
    run = _fit(tmp_path, model, precision="64-true", max_steps=4, every_n_steps=1)
    assert model.reference is not None
    rows = _step_rows(run)
    assert sorted(rows) == [1, 3, 5, 7]
    for index, step in enumerate((1, 3, 5, 7)):
        _check(rows[step], model.reference.steps[index], rel=1e-9)
    records = pl.read_parquet(run / "samples.parquet")
    steps = records.filter(pl.col("kind") == "step").sort("step")
    assert steps.select("step", "note").rows() == [(step, None) for step in (1, 3, 5, 7)]
    forwards = records.filter(pl.col("kind") == "forward")
    assert sorted(forwards["step"]) == list(range(8))
