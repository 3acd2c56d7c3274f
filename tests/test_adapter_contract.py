"""The adapter contract of ``torchinstruments_core.adapter`` is enough to write an adapter."""

from __future__ import annotations

import copy
import pathlib
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import polars as pl
import pytest
import torch
from accelerate.tracking import GeneralTracker
from torch import nn

import torchinstruments_core.adapter
from torchinstruments_accelerate import TelemetryTracker
from torchinstruments_core import ConfigurationError, HistogramRecord, Observer
from torchinstruments_core.adapter import (
    OptimizerClock,
    RunFolder,
    TelemetryOptions,
    run_folder,
)
from torchinstruments_core.routing import Target
from torchinstruments_lightning import TelemetryMonitor


@dataclass(eq=False)
class LoopTelemetry(TelemetryOptions):
    """A third adapter, for a plain torch loop: steps from the optimizer, logs into ``target``."""

    target: Target | None = None

    def attach(self, model: nn.Module, root: pathlib.Path) -> None:
        folder, run_id = self.agree_on_run(
            lambda value: value, main=True, choose=lambda i: run_folder(root / "telemetry", i)
        )
        targets = [self.target] if self.target and self.routes(main=True) else []
        self.observer: Observer = self.inject(model, sink=self.sink(folder, targets), run_id=run_id)
        self.step = 0
        self.clock = OptimizerClock(model, self.stepped)
        self.observer.begin_step(0, sample=self.is_sampled(0))

    def stepped(self) -> None:
        self.observer.end_step()
        self.step += 1
        self.observer.begin_step(self.step, sample=self.is_sampled(self.step))

    def detach(self) -> None:
        self.clock.remove()
        self.observer.remove()


class RecordingTarget:
    """A routing target that keeps what it is given: the step, the scalar and histogram keys."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float], set[str]]] = []

    def log(
        self, scalars: Mapping[str, float], histograms: Mapping[str, HistogramRecord], step: int
    ) -> None:
        self.calls.append((step, dict(scalars), set(histograms)))


def _train(model: nn.Module, steps: int, micro_batches: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        for _ in range(micro_batches):
            model(torch.randn(8, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_minimal_adapter_samples_routes_and_finalizes(tmp_path: pathlib.Path) -> None:
    """An adapter written against the contract alone: right steps, routed keys, finished run.

    Seven optimizer steps of two micro-batches with ``every_n_steps=3``: steps 0, 3 and 6 are
    sampled (two samples each) in the run directory and in the target, the target gets the
    focus layers' scalars and histograms under the prefix, and ``remove`` leaves a finalized run.
    """
    target = RecordingTarget()
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    telemetry = LoopTelemetry(every_n_steps=3, max_focus_layers=2, prefix="loop", target=target)
    telemetry.attach(model, tmp_path)
    _train(model, steps=7, micro_batches=2)
    telemetry.detach()
    assert [step for step, _, _ in target.calls] == [0, 0, 3, 3, 6, 6]
    _, scalars, histograms = target.calls[0]
    assert "loop/0/output_gradient/rms" in scalars
    assert "loop/1/output/rms" not in scalars  # not a focus layer
    assert histograms == {
        f"loop/{layer}/{signal}/histogram"
        for layer in ("0", "2")
        for signal in ("output", "output_gradient")
    }
    run = tmp_path / "telemetry"
    samples = pl.read_parquet(run / "samples.parquet")
    assert samples["step"].to_list() == [0, 0, 3, 3, 6, 6]
    assert samples["forward_only"].to_list() == [False] * 6
    assert (run / "result.json").is_file()
    assert (run / "index.md").is_file()
    assert not (run / "history.parts").exists()  # compacted: the run is finalized
    assert not telemetry.observer.attached


def test_a_second_run_beside_the_first_gets_a_folder_of_its_own(tmp_path: pathlib.Path) -> None:
    """``run_folder`` never writes over an earlier run; without write_directory there is none."""
    ids = []
    for write_directory in (True, True, False):
        telemetry = LoopTelemetry(every_n_steps=1, write_directory=write_directory)
        model = nn.Linear(4, 1)
        telemetry.attach(model, tmp_path)
        ids.append(telemetry.observer.run_id)
        _train(model, steps=2, micro_batches=1)
        telemetry.detach()
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert folders == sorted(["telemetry", f"telemetry-{ids[1]}"])


def test_the_run_is_the_one_the_main_process_chose() -> None:
    """agree_on_run: the main process chooses, every process gets its folder and run id."""
    chosen: list[str] = []

    def choose(run_id: str) -> RunFolder:
        chosen.append(run_id)
        return RunFolder(pathlib.Path("/runs") / run_id, run_id)

    options = TelemetryOptions()
    main = options.agree_on_run(lambda value: value, main=True, choose=choose)
    assert main == (RunFolder(pathlib.Path("/runs") / chosen[0], chosen[0]), chosen[0])
    other = options.agree_on_run(lambda value: main, main=False, choose=choose)
    assert other == main
    assert len(chosen) == 1  # only the main process chooses
    unwritten = TelemetryOptions(write_directory=False)
    folder, run_id = unwritten.agree_on_run(lambda value: value, main=True, choose=choose)
    assert folder is None
    assert run_id
    assert len(chosen) == 1


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"every_n_steps": 0}, r"every_n_steps=0"),
        ({"rank_policy": "some"}, r"rank_policy='some' is not valid; expected 'rank0', 'all'"),
        ({"error_policy": "loud"}, r"error_policy='loud'"),
        ({"scalar_layers": "first"}, r"scalar_layers='first'"),
        ({"max_focus_layers": -1}, r"max_focus_layers=-1"),
        ({"focus_selector": "blocks.*"}, r"focus_selector='blocks.\*'"),
        ({"selector": 3}, r"selector=3"),
        ({"reducers": [object()]}, r"reducers=<object"),
    ],
)
def test_every_option_is_checked_when_the_adapter_is_built(
    options: dict[str, Any], fragment: str
) -> None:
    """A bad option raises in the constructor of every adapter, naming it and the value."""
    for adapter in (TelemetryOptions, LoopTelemetry, TelemetryMonitor, TelemetryTracker):
        with pytest.raises(ConfigurationError, match=fragment):
            adapter(**options)


def test_the_adapters_add_only_what_differs() -> None:
    """Both adapters inherit every shared option and declare only their own few fields."""
    shared = {f.name for f in fields(TelemetryOptions)}
    own = {
        TelemetryMonitor: {
            "directory_tensorboard",
            "sample_validation",
            "sample_test",
            "sample_predict",
        },
        TelemetryTracker: {"run_name", "logging_dir", "log_to_trackers"},
    }
    for adapter, names in own.items():
        assert issubclass(adapter, TelemetryOptions)
        assert {f.name for f in fields(adapter)} - shared == names


def test_the_adapters_keep_identity_hashing_positional_arguments_and_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As before the dataclasses: hashable by identity, TelemetryMonitor(50), copies, pickles.

    Lightning and Accelerate hold callbacks and trackers in sets and lists compared by identity,
    and ``ddp_spawn`` pickles the callbacks; Accelerate builds a tracker registered by name as
    ``Tracker(run_name, logging_dir, ...)`` and checks it in ``GeneralTracker.__init__``.
    """
    monitor = TelemetryMonitor(50, sample_validation=True)
    assert monitor.every_n_steps == 50
    assert monitor != TelemetryMonitor(50, sample_validation=True)
    assert len({monitor, TelemetryMonitor(50)}) == 2
    for twin in (copy.deepcopy(monitor), pickle.loads(pickle.dumps(monitor))):
        assert (twin.every_n_steps, twin.sample_validation) == (50, True)
        assert twin.observer is None
    checked: list[object] = []
    original = GeneralTracker.__init__

    def recording_init(self: GeneralTracker) -> None:
        checked.append(self)
        original(self)

    monkeypatch.setattr(GeneralTracker, "__init__", recording_init)
    tracker = TelemetryTracker("exp", "runs", every_n_steps=5)
    assert checked == [tracker]
    assert (tracker.run_name, tracker.logging_dir, tracker.every_n_steps) == ("exp", "runs", 5)
    assert len({tracker, TelemetryTracker()}) == 2


def test_exported_names() -> None:
    """The contract module exports exactly these names, sorted."""
    assert torchinstruments_core.adapter.__all__ == [
        "ErrorPolicy",
        "HoldingSink",
        "NonFinitePolicy",
        "NonFiniteWatch",
        "OptimizerClock",
        "RankPolicy",
        "RunFolder",
        "StepNumbering",
        "TelemetryOptions",
        "TriggeredSchedule",
        "loss_scale_reader",
        "new_run_id",
        "run_folder",
    ]
