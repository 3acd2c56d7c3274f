"""One FabricTelemetry watching again after ``finish()``: a k-fold loop, each fold a new Fabric.

Each fold is a run of its own, counted from step 0 and sample id 0 under a new run id, unless a
saved state is handed to ``load_state_dict``, which the next run then continues.
"""

from __future__ import annotations

import pathlib

import polars as pl
import pytest
import torch

from test_fabric import _fabric, _model, _samples, _train
from torchinstruments_lightning import FabricTelemetry


def _fold(telemetry: FabricTelemetry, steps: int, *, load: dict[str, int] | None = None) -> None:
    """One fold: a new Fabric and model, ``steps`` optimizer steps, then ``on_train_end``.

    ``load`` is handed to ``load_state_dict`` after ``fabric.setup`` (which watches the model).
    """
    fabric = _fabric(telemetry)
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if load is not None:
        telemetry.load_state_dict(load)
    _train(fabric, model, optimizer, steps=steps)
    fabric.call("on_train_end")


def test_each_fold_after_finish_counts_from_step_0_and_sample_id_0(tmp_path: pathlib.Path) -> None:
    """The second fold samples steps 0, 3, 6 again, its ids from 0, under a new run id.

    Its folder is a new one beside the first; ``state_dict`` after ``finish`` holds the
    finished fold's count.
    """
    telemetry = FabricTelemetry(every_n_steps=3, output_dir=tmp_path / "run")
    folders = []
    for _ in range(2):
        _fold(telemetry, steps=7)
        assert telemetry.state_dict() == {"step": 7, "next_sample_id": 6}
        folders.append(telemetry.run_directory)
    assert folders[0] is not None
    assert folders[1] is not None
    assert folders[1] != folders[0]
    first, second = _samples(folders[0], None), _samples(folders[1], None)
    for fold in (first, second):
        assert fold.filter(pl.col("kind") == "forward")["step"].to_list() == [0, 3, 6]
        assert fold["sample_id"].to_list() == list(range(6))  # each step: forward, step record
    assert first["run_id"].n_unique() == second["run_id"].n_unique() == 1
    assert first["run_id"].item(0) != second["run_id"].item(0)


@pytest.mark.parametrize("load", ["before setup", "after setup"])
def test_a_state_loaded_for_the_next_fold_is_continued(tmp_path: pathlib.Path, load: str) -> None:
    """``load_state_dict`` between ``finish`` and the next setup, or after it, continues the count.

    The first fold's state, saved after ``finish``, is handed back: the second run samples
    steps 4 and 6 with ids going on from 4, then a third fold, given nothing, starts at 0.
    """
    telemetry = FabricTelemetry(every_n_steps=2, output_dir=tmp_path / "run")
    _fold(telemetry, steps=4)
    saved = telemetry.state_dict()
    assert saved == {"step": 4, "next_sample_id": 4}
    if load == "before setup":
        telemetry.load_state_dict(saved)
    _fold(telemetry, steps=4, load=saved if load == "after setup" else None)
    assert telemetry.run_directory is not None
    resumed = _samples(telemetry.run_directory, None)
    assert resumed.filter(pl.col("kind") == "forward")["step"].to_list() == [4, 6]
    assert resumed["sample_id"].to_list() == [4, 5, 6, 7]
    _fold(telemetry, steps=1)
    assert telemetry.run_directory is not None
    assert _samples(telemetry.run_directory, None)["sample_id"].to_list() == [0, 1]
    assert _samples(telemetry.run_directory)["step"].to_list() == [0]


def test_a_fold_after_a_stopped_one_does_not_stop(tmp_path: pathlib.Path) -> None:
    """``should_stop`` set by a non-finite fold is false again once the next fold is watched."""
    telemetry = FabricTelemetry(every_n_steps=1, on_nonfinite="stop", output_dir=tmp_path / "r")
    fabric = _fabric(telemetry)
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(model(torch.full((4, 4), float("nan"))).sum())
    optimizer.step()
    fabric.call("on_train_end")
    assert telemetry.should_stop
    _fold(telemetry, steps=2)
    assert not telemetry.should_stop
