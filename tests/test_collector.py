"""Python's garbage collector, paused while a recorded optimizer step's record is built.

``_collector.collector_paused`` and the optimizer hooks that use it. Checked: the collector is off
during the call and as it was after (on, off, after an exception, nested); a recorded step's record
reaches the sink with the collector paused, with and without a closure (Lightning's ``Trainer.fit``
too), and the program finds it on after the step; an unsampled step's hooks never touch it; a
program that turned it off finds it off; with collections made frequent, none starts inside the
observer's optimizer hooks while forward and backward still see them; the record's objects leave no
cyclic garbage behind, which is what makes the pause safe (nothing the collector alone could free
piles up).
"""

from __future__ import annotations

import gc
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from optimizer_helpers import closure_for, float64_mlp, step_records, train
from torchinstruments_core import (
    AlwaysSampler,
    RecordKind,
    SampleRecord,
    _optimizer_probe,
    _step_tensors,
    inject_observer,
)
from torchinstruments_core._collector import collector_paused
from torchinstruments_core.testing import RecordingSink


@pytest.fixture
def collector_on() -> Iterator[None]:
    """The collector on for the test, and as it was after it."""
    enabled = gc.isenabled()
    gc.enable()
    yield
    if not enabled:
        gc.disable()


class _StateSink(RecordingSink):
    """A recording sink that notes whether the collector was on as each record arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.collector: list[tuple[RecordKind, bool]] = []

    def write(self, sample: SampleRecord) -> None:
        self.collector.append((sample.kind, gc.isenabled()))
        super().write(sample)


def test_the_collector_is_off_during_the_call_and_as_it_was_after(collector_on: None) -> None:
    """On before: off inside, on after, also after an exception; off before: off throughout."""
    seen: list[bool] = []

    @collector_paused
    def note(fail: bool = False) -> int:
        seen.append(gc.isenabled())
        if fail:
            raise RuntimeError("inside")
        return 7

    assert note() == 7
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"):
        note(fail=True)
    assert gc.isenabled()
    outer = collector_paused(lambda: (note(), gc.isenabled())[1])
    assert outer() is False
    assert gc.isenabled()
    gc.disable()
    try:
        note()
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert seen == [False] * 4
    assert note.__name__ == "note"


@pytest.mark.parametrize("closure", [False, True], ids=["plain", "closure"])
def test_a_step_record_is_delivered_with_the_collector_paused(
    collector_on: None, monkeypatch: pytest.MonkeyPatch, closure: bool
) -> None:
    """The pre-hook's work and the post-hook's delivery run paused; the step after them not.

    With a closure the "before" measurements run inside ``step``, when the closure returns.
    """
    before_step = _step_tensors.before_step
    during: list[bool] = []

    def noted(*args: Any) -> Any:
        during.append(gc.isenabled())
        return before_step(*args)

    monkeypatch.setattr(_optimizer_probe, "before_step", noted)
    model = float64_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = _StateSink()
    stepped: list[bool] = []
    loss = closure_for(model, optimizer)
    with inject_observer(model, sink=sink, optimizer=optimizer) as observer:
        for index in range(3):
            observer.begin_step(index, sample=True)
            if closure:
                optimizer.step(loss)
            else:
                loss()
                optimizer.step()
            stepped.append(gc.isenabled())
            observer.end_step()
            assert len(step_records(sink)) == index + 1
    assert during == [False, False, False]
    assert [enabled for kind, enabled in sink.collector if kind is RecordKind.STEP] == [False] * 3
    assert stepped == [True, True, True]
    assert gc.isenabled()


def test_lightning_s_closure_step_is_recorded_with_the_collector_paused(
    collector_on: None, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """Under ``Trainer.fit`` (automatic optimization, a closure): paused in the hooks only.

    ``TelemetryMonitor`` records every step's optimizer signals; the "before" measurements run
    when Lightning's closure returns, with the collector off, and a callback after each batch
    finds it on again.
    """
    from lightning.pytorch.callbacks import Callback

    from lightning_helpers import Regressor, loader, trainer
    from torchinstruments_lightning import TelemetryMonitor

    before_step = _step_tensors.before_step
    during: list[bool] = []
    after_batches: list[bool] = []

    def noted(*args: Any) -> Any:
        during.append(gc.isenabled())
        return before_step(*args)

    class AfterBatch(Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            after_batches.append(gc.isenabled())

    monkeypatch.setattr(_optimizer_probe, "before_step", noted)
    monitor = TelemetryMonitor(every_n_steps=1, output_dir=tmp_path / "run", log_to_loggers=False)
    fit = trainer(tmp_path, callbacks=[monitor, AfterBatch()], logger=False, max_steps=4)
    fit.fit(Regressor(), loader())
    assert during == [False] * 4
    assert after_batches == [True] * 4
    assert gc.isenabled()


def test_a_collector_the_program_turned_off_stays_off() -> None:
    """A program that runs without the collector finds it off after recorded steps."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        model = float64_mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        sink = RecordingSink()
        with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer):
            train(model, [optimizer], steps=2)
            assert not gc.isenabled()
        assert len(step_records(sink)) == 2
        assert not gc.isenabled()
    finally:
        if enabled:
            gc.enable()


def test_no_collection_starts_inside_the_optimizer_hooks(
    collector_on: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a collection every 20 net objects, none starts in the hooks' recorded-step work.

    Forward and backward, where the samples' objects are made, still see collections: the count
    would find one in the hooks too if they ran with the collector on.
    """
    inside = [False]
    started = {"inside": 0, "outside": 0}
    for name in ("_before", "_after"):
        original = getattr(_optimizer_probe.OptimizerProbe, name)

        def flagged(self: Any, *args: Any, _original: Any = original) -> Any:
            # a young collection here, outside: the few objects of the calls in between
            # (this one's arguments, the decorator's) cannot start one before it pauses
            gc.collect(0)
            inside[0] = True
            try:
                return _original(self, *args)
            finally:
                inside[0] = False

        monkeypatch.setattr(_optimizer_probe.OptimizerProbe, name, flagged)

    def count(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started["inside" if inside[0] else "outside"] += 1

    threshold = gc.get_threshold()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)]).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    sink = RecordingSink()
    gc.callbacks.append(count)
    gc.set_threshold(20)
    try:
        with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer):
            for _ in range(5):
                model(torch.randn(8, 16, dtype=torch.float64)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(count)
    assert len(step_records(sink)) == 5
    assert started["outside"] > 0
    assert started["inside"] == 0


def test_an_unsampled_step_leaves_the_collector_alone(
    collector_on: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a recorded step pauses the collector: an unsampled one's hooks never touch it."""
    switched: list[str] = []
    disable, enable = gc.disable, gc.enable

    def counted_disable() -> None:
        switched.append("off")
        disable()

    def counted_enable() -> None:
        switched.append("on")
        enable()

    monkeypatch.setattr(gc, "disable", counted_disable)
    monkeypatch.setattr(gc, "enable", counted_enable)
    model = float64_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = RecordingSink()
    closure = closure_for(model, optimizer)
    with inject_observer(model, sink=sink, optimizer=optimizer) as observer:
        for step in range(4):
            observer.begin_step(step, sample=step == 2)
            closure()
            optimizer.step()
            observer.end_step()
            if step < 2:
                assert switched == []
    assert [record.step for record in step_records(sink)] == [2]
    assert switched == ["off", "on", "off", "on"]  # the pre-hook's, then the post-hook's


def test_a_recorded_step_leaves_no_cyclic_garbage(collector_on: None) -> None:
    """Every object of a recorded step goes with its last reference: the collector finds none.

    What makes pausing it safe: nothing that only the collector could free accumulates. The
    record covers the parameters, their gradients, updates and the momentum buffers.
    """
    model = float64_mlp()
    # SGD: torch's Adam asks for an accelerator at every step, which can load a library
    # (``torch.cuda.device_count`` through NVML) and leave a ctypes class behind
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer):
        train(model, [optimizer], steps=2)
        gc.collect()
        gc.disable()
        try:
            train(model, [optimizer], steps=2)
            gc.set_debug(gc.DEBUG_SAVEALL)
            found = gc.collect()
            garbage = [type(o).__name__ for o in gc.garbage]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert len(step_records(sink)) == 4
    assert found == 0, garbage[:20]
