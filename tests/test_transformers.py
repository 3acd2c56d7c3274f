"""TelemetryCallback in a real Transformers ``Trainer``: a tiny random GPT-2 on the CPU."""

from __future__ import annotations

import pathlib
from typing import Any

import polars as pl
import pytest
import torch
import transformers
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from torchinstruments_transformers import TelemetryCallback
from wandb_records import history_rows

HISTOGRAM = "telemetry/transformer.h.0.mlp.c_fc/output/histogram"
GRADIENT_RMS = "telemetry/transformer.h.0.mlp.c_fc/output_gradient/rms"
# Transformers 5 renamed gradient_checkpointing (deprecated, it warns) to activation_checkpointing.
CHECKPOINTING = next(
    name
    for name in ("activation_checkpointing", "gradient_checkpointing")
    if name in transformers.TrainingArguments.__dataclass_fields__
)


def _model() -> Any:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _data(n: int = 64) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (n, 8))
    return [{"input_ids": row, "labels": row} for row in ids]


def _train(
    tmp_path: pathlib.Path,
    telemetry: TelemetryCallback,
    *,
    max_steps: int = 4,
    report_to: list[str] | None = None,
    resume: str | None = None,
    model: Any = None,
    **options: Any,
) -> Any:
    options = {"save_strategy": "no", "logging_steps": 1, **options}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=max_steps,
        report_to=report_to or [],
        use_cpu=True,
        per_device_train_batch_size=2,
        disable_tqdm=True,
        **options,
    )
    trainer = transformers.Trainer(
        model=model or _model(), args=args, train_dataset=_data(), callbacks=[telemetry]
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _loss_steps(trainer: Any) -> list[int]:
    return [entry["step"] for entry in trainer.state.log_history if "loss" in entry]


def _samples(folder: pathlib.Path | None, kind: str | None = "forward") -> pl.DataFrame:
    """``samples.parquet``: the forward samples (``kind=None``: the step records too)."""
    assert folder is not None
    frame = pl.read_parquet(folder / "samples.parquet")
    return frame if kind is None else frame.filter(pl.col("kind") == kind)


def test_tensorboard_holds_the_telemetry_at_the_global_step_of_the_sampled_steps_loss(
    tmp_path: pathlib.Path,
) -> None:
    """Histograms and scalars land in the TensorBoardCallback's event file at ``global_step``.

    Four optimizer steps with ``every_n_steps=3``: global steps 1 (the first) and 3 are sampled;
    the Trainer logs their losses at global steps 1 and 3, and the telemetry sits at exactly
    those steps, in the
    same event file as ``train/loss``. The run directory is under ``args.output_dir`` and holds
    no ``tensorboard/`` of its own.
    """
    telemetry = TelemetryCallback(every_n_steps=3)
    trainer = _train(tmp_path, telemetry, report_to=["tensorboard"])
    assert _loss_steps(trainer) == [1, 2, 3, 4]
    (events_dir,) = (tmp_path / "out" / "runs").iterdir()
    events = EventAccumulator(str(events_dir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    histograms = events.Histograms(HISTOGRAM)
    assert [h.step for h in histograms] == [1, 3]
    assert all(h.histogram_value.num == 2 * 8 * 128 for h in histograms)  # batch x seq x 4*32
    assert [e.step for e in events.Scalars(GRADIENT_RMS)] == [1, 3]
    assert all(e.value > 0 for e in events.Scalars(GRADIENT_RMS))
    assert telemetry.run_directory == (tmp_path / "out" / "telemetry").absolute()
    assert _samples(telemetry.run_directory)["step"].to_list() == [1, 3]
    assert not (telemetry.run_directory / "tensorboard").exists()
    assert telemetry.observer is None  # removed at train end


def test_wandb_offline_rows_hold_the_telemetry_beside_the_loss(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The offline ``.wandb`` file holds our histograms at ``train/global_step`` 1 and 3.

    The WandbCallback logs the loss of optimizer step k with ``train/global_step`` k + 1; our rows
    carry the same key and value for the sampled global steps 1 and 3.
    """
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    telemetry = TelemetryCallback(every_n_steps=3)
    _train(tmp_path, telemetry, report_to=["wandb"])
    wandb.finish()
    wandb.teardown()  # without it the offline file holds only its header
    rows = history_rows(tmp_path)
    ours = [r for r in rows if f"{HISTOGRAM}/_type" in r]
    assert [r["train/global_step"] for r in ours] == [1, 3]
    assert all(r[f"{HISTOGRAM}/_type"] == "histogram" for r in ours)
    assert all(r[GRADIENT_RMS] > 0 for r in ours)
    losses = [r["train/global_step"] for r in rows if "train/loss" in r]
    assert losses == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "options",
    [
        {"gradient_accumulation_steps": 2},
        {CHECKPOINTING: True},
        {"bf16": True, "gradient_accumulation_steps": 2},
    ],
    ids=["accumulation", "checkpointing", "bf16"],
)
def test_each_micro_batch_of_a_sampled_step_is_a_sample_at_its_global_step(
    tmp_path: pathlib.Path, options: dict[str, Any]
) -> None:
    """Under accumulation, checkpointing and bf16 the samples sit at the loss's global steps.

    Every micro-batch of a sampled step is one sample (two under ``gradient_accumulation_steps=2``)
    with the step's output gradients measured, and all carry the global step at which the Trainer
    logged that step's loss; checkpointing's recomputed forwards add no samples.
    """
    telemetry = TelemetryCallback(every_n_steps=3)
    trainer = _train(tmp_path, telemetry, **options)
    assert _loss_steps(trainer) == [1, 2, 3, 4]
    micro_batches = options.get("gradient_accumulation_steps", 1)
    samples = _samples(telemetry.run_directory)
    assert samples["step"].to_list() == [1] * micro_batches + [3] * micro_batches
    assert samples["forward_only"].to_list() == [False] * 2 * micro_batches
    history = pl.read_parquet(telemetry.run_directory / "history.parquet")  # type: ignore[operator]
    gradients = history.filter(
        (pl.col("layer") == "transformer.h.0.mlp.c_fc")
        & (pl.col("signal") == "output_gradient")
        & (pl.col("metric") == "rms")
    )
    assert gradients["sample_id"].to_list() == samples["sample_id"].to_list()
    assert (gradients["value"] > 0).all()


def test_a_resumed_run_gets_a_new_run_id_and_folder_and_continues_the_schedule(
    tmp_path: pathlib.Path,
) -> None:
    """Resuming from ``checkpoint-2`` starts a new run in ``telemetry-resumed-1``.

    The first ``train()`` samples global steps 1 and 2 and saves at global step 2; the resumed
    one samples global step 4 on the same schedule (multiples of 2), under a new run id, so
    ``(run_id, rank, sample_id)`` stays unique across both folders.
    """
    first = TelemetryCallback(every_n_steps=2)
    _train(tmp_path, first, max_steps=2, save_strategy="steps", save_steps=2)
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert checkpoint.is_dir()
    second = TelemetryCallback(every_n_steps=2)
    trainer = _train(tmp_path, second, max_steps=5, resume=str(checkpoint))
    assert _loss_steps(trainer) == [1, 2, 3, 4, 5]  # the checkpoint's history, then ours
    assert second.run_directory == (tmp_path / "out" / "telemetry-resumed-1").absolute()
    both = pl.concat([_samples(first.run_directory), _samples(second.run_directory)])
    assert both["step"].to_list() == [1, 2, 4]
    assert both["run_id"].n_unique() == 2
    assert both.select("run_id", "rank", "sample_id").is_unique().all()


def test_a_second_train_writes_beside_the_first(tmp_path: pathlib.Path) -> None:
    """A fresh ``train()`` into the same ``output_dir`` never writes over the earlier run."""
    telemetry = TelemetryCallback(every_n_steps=1)
    _train(tmp_path, telemetry, max_steps=1)
    first = telemetry.run_directory
    _train(tmp_path, telemetry, max_steps=1)
    assert first == (tmp_path / "out" / "telemetry").absolute()
    assert telemetry.run_directory is not None
    assert telemetry.run_directory.name.startswith("telemetry-")
    assert _samples(first)["run_id"].item() != _samples(telemetry.run_directory)["run_id"].item()


class Recorder(transformers.TrainerCallback):
    """A callback that keeps each ``on_log`` call: the step and the logs."""

    def __init__(self) -> None:
        self.logs: list[tuple[int, dict[str, float]]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self.logs.append((state.global_step, dict(logs or {})))


class RecordingIntegration(Recorder):
    """An integration of ``report_to`` that takes scalars only."""


def test_other_integrations_get_the_scalars_at_the_global_step(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An integration without histograms receives our scalars through ``on_log``, at the step.

    Its own log calls carry the Trainer's loss at global steps 1 … 4; ours carry the focus
    layers' scalars (no histograms) at global steps 1 and 3. A callback that is not an
    integration receives nothing.
    """
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    monkeypatch.setitem(INTEGRATION_TO_CALLBACK, "recording", RecordingIntegration)
    integration, bystander = RecordingIntegration(), Recorder()
    telemetry = TelemetryCallback(every_n_steps=3)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=4, logging_steps=1, report_to=[],
        use_cpu=True, save_strategy="no", per_device_train_batch_size=2, disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=_model(),
        args=args,
        train_dataset=_data(),
        callbacks=[integration, bystander, telemetry],
    )
    trainer.train()
    ours = [(step, logs) for step, logs in integration.logs if GRADIENT_RMS in logs]
    assert [step for step, _ in ours] == [1, 3]
    assert not any(key.endswith("histogram") for _, logs in ours for key in logs)
    assert [step for step, logs in integration.logs if "loss" in logs] == [1, 2, 3, 4]
    assert [step for step, logs in bystander.logs if "loss" in logs] == [1, 2, 3, 4]
    assert not any(GRADIENT_RMS in logs for _, logs in bystander.logs)


def test_sampled_steps_fall_on_the_trainers_loss_logs(tmp_path: pathlib.Path) -> None:
    """With ``logging_steps`` dividing ``every_n_steps`` every loss log has the telemetry beside it.

    The sampled steps are the first and the multiples of n.
    """
    telemetry = TelemetryCallback(every_n_steps=2)
    trainer = _train(tmp_path, telemetry, max_steps=6, logging_steps=2, report_to=["tensorboard"])
    assert _loss_steps(trainer) == [2, 4, 6]
    assert _samples(telemetry.run_directory)["step"].to_list() == [1, 2, 4, 6]


def test_a_non_finite_step_stops_training_under_on_nonfinite_stop(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A NaN from the third step on: the warning names where it began, and training stops there.

    The poisoned output is the MLP block's (not a leaf): the first observed layer after it, the
    next block's first LayerNorm, is named as where it started (or in unobserved code before it).
    """
    model = _model()
    calls = {"n": 0}

    def poison(module: Any, args: Any, output: Any) -> Any:
        calls["n"] += 1
        return output * float("nan") if calls["n"] >= 3 else output

    model.transformer.h[0].mlp.register_forward_hook(poison)
    telemetry = TelemetryCallback(every_n_steps=1, on_nonfinite="stop")
    with caplog.at_level("WARNING", logger="torchinstruments"):
        trainer = _train(tmp_path, telemetry, max_steps=6, model=model)
    assert trainer.state.global_step == 3
    warnings = [r.getMessage() for r in caplog.records if r.name == "torchinstruments"]
    assert any("forward: first at 'transformer.h.1.ln_1' output" in m for m in warnings)
