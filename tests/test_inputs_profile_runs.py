"""Inputs and profile in real runs: through the Lightning adapter, and read by the analysis."""

from __future__ import annotations

import pathlib

import polars as pl
import torch

from analysis_runs import Blowup, blowup_model, run_step
from lightning_helpers import Regressor, loader, telemetry_dir, trainer
from torchinstruments_analysis import first_nonfinite, open_run
from torchinstruments_core import EveryNForwardsSampler, inject_observer
from torchinstruments_core.run_directory import RunDirectorySink
from torchinstruments_lightning import TelemetryMonitor


def test_lightning_options_reach_the_observer_and_history(tmp_path: pathlib.Path) -> None:
    """Lightning's ``record_inputs``/``profile`` options reach the observer and the run.

    history.parquet holds input, input-gradient and time rows at the sampled steps, and none
    without the options.
    """
    rows: dict[str, pl.DataFrame] = {}
    for name, enabled in (("on", True), ("off", False)):
        root = tmp_path / name
        monitor = TelemetryMonitor(
            every_n_steps=2, log_to_loggers=False, record_inputs=enabled, profile=enabled
        )
        trainer(root, max_steps=4, logger=False, callbacks=[monitor]).fit(Regressor(), loader())
        history = pl.read_parquet(telemetry_dir(root) / "history.parquet")
        rows[name] = history.filter(pl.col("signal").is_in(["input", "input_gradient", "time"]))
    on = rows["on"]
    assert set(on["signal"]) == {"input", "input_gradient", "time"}
    assert set(on["step"]) == {0, 2}
    times = on.filter(pl.col("signal") == "time", pl.col("tensor_path") == "forward")
    assert set(times["layer"]) == {"net.0", "net.1", "net.2"}
    assert (times["value"] > 0).all()
    assert rows["off"].height == 0


def test_first_nonfinite_tells_origin_from_passed_on_with_recorded_inputs(
    tmp_path: pathlib.Path,
) -> None:
    """With inputs recorded, ``first_nonfinite`` compares a layer's own input.

    A layer whose input is finite and output is not is the origin (``started``, evidence
    ``input``); a non-finite batch makes the first layer's output non-finite, passed on.
    """
    runs = {"origin": 1.0, "batch": float("nan")}
    for name, scale in runs.items():
        model = blowup_model()
        blowup = model[2]
        assert isinstance(blowup, Blowup)
        blowup.armed = name == "origin"
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        sink = RunDirectorySink(tmp_path / name, tensorboard=False)
        sampler = EveryNForwardsSampler(1)
        with inject_observer(model, sampler=sampler, sink=sink, record_inputs=True):
            run_step(model, optimizer, scale)
    origin = first_nonfinite(open_run(tmp_path / "origin")).filter(direction="forward")
    assert origin.select("layer", "started", "evidence").row(0) == ("2", True, "input")
    passed = first_nonfinite(open_run(tmp_path / "batch")).filter(direction="forward")
    assert passed.select("layer", "started", "evidence").row(0) == ("0", False, "input")
