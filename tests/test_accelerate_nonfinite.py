"""TelemetryTracker names the first non-finite layer, samples densely after it, stops, raises."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import polars as pl
import pytest
import torch

from accelerate_helpers import events, reset_accelerate_state, samples, setup
from torchinstruments_accelerate import TelemetryTracker
from torchinstruments_core import NonFiniteError

if TYPE_CHECKING:
    import pathlib
    from collections.abc import Iterator


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Each test builds its Accelerator from scratch; Accelerate's state is process-wide."""
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def _run(root: pathlib.Path, telemetry: TelemetryTracker, *, poison_at: int, steps: int) -> int:
    """Train ``steps`` steps, ``net.2``'s weight NaN from ``poison_at``; the steps completed."""
    accelerator, model, optimizer, data = setup(
        root, telemetry, log_with=["tensorboard", telemetry]
    )
    net: Any = model
    for step, (x, y) in enumerate(data):
        if step == poison_at:
            with torch.no_grad():
                net.net[2].weight.fill_(float("nan"))
        loss = (model(x) - y).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.detach()}, step=step)
        if telemetry.should_stop or step + 1 == steps:
            accelerator.end_training()
            return step + 1
    raise AssertionError("the loader ran out")


def test_a_non_finite_sample_is_named_routed_and_sampled_densely(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The sampled step where ``net.2`` turns NaN is named, routed to TensorBoard, then dense.

    The WARNING names ``net.2`` as started there; TensorBoard holds the onset scalar at the
    user's step. Dense sampling starts at step 6: the sample is numbered (so delivered) at
    the log after step 4's optimizer step, when step 5 has begun; the NaN loss logged there,
    read at the next step, keeps step 7 sampled.
    """
    telemetry = TelemetryTracker(every_n_steps=4, sample_after_nonfinite=2)
    with caplog.at_level(logging.INFO, logger="torchinstruments"):
        assert _run(tmp_path, telemetry, poison_at=4, steps=10) == 10
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "TelemetryTracker: non-finite values at step 4" in warning
    assert "forward: first at 'net.2' output, 100% non-finite (started there" in warning
    assert telemetry.run_directory is not None
    forward = samples(telemetry.run_directory).filter(pl.col("kind") == "forward")
    assert sorted(forward["step"].to_list()) == [0, 4, 6, 7, 8]
    (folder,) = {
        p.parent for p in tmp_path.rglob("events.out.tfevents.*") if "telemetry" not in str(p)
    }
    onset = events(folder).Scalars("telemetry/nonfinite_onset")
    assert [(e.step, e.value) for e in onset] == [(4, 1.0)]


def test_stop_sets_should_stop_for_the_loop(tmp_path: pathlib.Path) -> None:
    """``on_nonfinite="stop"``: ``should_stop`` turns true at the log of the onset's step."""
    telemetry = TelemetryTracker(every_n_steps=4, on_nonfinite="stop")
    assert telemetry.should_stop is False
    assert _run(tmp_path, telemetry, poison_at=4, steps=10) == 5


def test_raise_comes_out_of_log_with_a_complete_run_directory(tmp_path: pathlib.Path) -> None:
    """``on_nonfinite="raise"``: ``accelerator.log`` raises; ``finish`` finalizes the run."""
    telemetry = TelemetryTracker(every_n_steps=4, on_nonfinite="raise")
    with pytest.raises(NonFiniteError, match=r"step 4.*'net.2' output"):
        _run(tmp_path, telemetry, poison_at=4, steps=10)
    telemetry.finish()
    assert telemetry.run_directory is not None
    history = pl.read_parquet(telemetry.run_directory / "history.parquet")
    nan_rows = history.filter((pl.col("metric") == "nonfinite_fraction") & (pl.col("value") > 0))
    assert set(nan_rows["step"].to_list()) == {4}
