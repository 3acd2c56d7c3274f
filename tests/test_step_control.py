"""The step-driven control that trainer adapters use instead of a sampler."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from helpers import CountingReducer, mlp
from torchinstruments_core import AlwaysSampler, inject_observer
from torchinstruments_core.testing import RecordingSink

if TYPE_CHECKING:
    from collections.abc import Callable


def test_announced_steps_are_sampled_with_their_step_and_micro_batches() -> None:
    """Every root forward of a step announced for sampling is a sample carrying that step."""
    model = mlp()
    sink = RecordingSink()
    reducer = CountingReducer()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, reducers=[reducer]) as observer:
        for step in range(4):
            observer.begin_step(step, sample=step % 2 == 0)
            for _ in range(3):  # gradient accumulation: three micro-batches per step
                model(torch.randn(2, 4)).sum().backward()
            observer.end_step()
        model(torch.randn(2, 4))  # after end_step, outside any step: not sampled
    assert [(s.sample_id, s.step) for s in sink.samples] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (3, 2),
        (4, 2),
        (5, 2),
    ]
    assert reducer.calls == 6 * 3 * 2


def test_end_step_closes_the_samples_of_that_step() -> None:
    """Samples still waiting for a backward are delivered when their step ends."""
    model = mlp()
    sink = RecordingSink()
    with inject_observer(model, sink=sink) as observer:
        observer.begin_step(7, sample=True)
        kept = model(torch.randn(2, 4))  # the graph stays alive, no backward
        assert sink.samples == []
        observer.end_step()
        assert [(s.step, s.forward_only) for s in sink.samples] == [(7, True)]
        assert kept.requires_grad
    assert sink.run is not None
    assert sink.run.sampling_policy == "step-driven by the trainer adapter"


def test_flush_delivers_open_samples() -> None:
    """flush() closes samples whose graph is still alive and hands them to the sink."""
    model = mlp()
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink) as observer:
        out = model(torch.randn(2, 4))
        assert sink.samples == []
        observer.flush()
        assert len(sink.samples) == 1
        out.sum().backward()  # the closed sample takes no late gradient
    assert len(sink.samples) == 1
    assert sink.samples[0].forward_only


def test_explicit_samples_cover_submodule_calls_without_a_root_forward() -> None:
    """open_sample/finish_forward sample a step whose code calls submodules, not the root."""
    from torchinstruments_core import Signal

    model = mlp()
    sink = RecordingSink()
    with inject_observer(model, sink=sink) as observer:
        observer.begin_step(0, sample=False)  # no root forward samples by itself
        assert observer.open_sample(5)
        hidden = model[1](model[0](torch.randn(2, 4)))  # the root is never called
        loss = model[2](hidden).sum()
        observer.finish_forward()
        model(torch.randn(2, 4))  # after finish_forward: not observed
        loss.backward()
        observer.end_step()
    (sample,) = sink.samples
    assert sample.step == 5
    assert not sample.forward_only
    layers = {(r.layer, r.signal) for r in sample.rows}
    assert layers == {
        (n, s) for n in ("0", "1", "2") for s in (Signal.OUTPUT, Signal.OUTPUT_GRADIENT)
    }
    assert sink.value("2", "output_gradient", "mean") == pytest.approx(1.0)


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.children())  # the root keeps its own


def test_a_lazy_sample_starts_at_the_first_module_that_runs() -> None:
    """open_sample(lazy=True): the sample starts when a selected module runs, not before.

    Between the open and that module a sample started and closed (the step's first phase)
    and a step record took an id: the lazy sample takes the next id, and its gradients are
    matched to it as usual.
    """
    from torchinstruments_core import Signal

    model = mlp()
    sink = RecordingSink()
    with inject_observer(model, sink=sink) as observer:
        observer.begin_step(0, sample=False)
        observer.open_sample(3)
        first = model[0](torch.randn(2, 4)).sum()
        observer.finish_forward()
        first.backward()
        assert observer.open_sample(3, lazy=True)
        armed = _hooks(model)
        assert armed > 0  # the hooks stay while it waits
        assert observer.next_sample_id == 1  # no id taken yet
        second = model[2](model[1](torch.randn(2, 8))).sum()
        observer.finish_forward()
        second.backward()
        observer.end_step()
        assert _hooks(model) < armed  # disarmed once nothing needs them
    assert [(s.sample_id, s.step) for s in sink.samples] == [(0, 3), (1, 3)]
    layers = {(r.layer, r.signal) for r in sink.samples[1].rows}
    # the ReLU's input needs no gradient: only the last layer's output gets one
    assert layers == {("1", Signal.OUTPUT), ("2", Signal.OUTPUT), ("2", Signal.OUTPUT_GRADIENT)}


def test_a_lazy_sample_nothing_runs_in_is_no_sample() -> None:
    """No selected module runs before finish_forward: nothing delivered, no id taken, disarmed."""
    model = mlp()
    sink = RecordingSink()
    with inject_observer(model, sink=sink) as observer:
        observer.begin_step(0, sample=False)
        assert observer.open_sample(0, lazy=True)
        torch.randn(3).sum()  # the rest of the step runs no selected module
        observer.finish_forward()
        observer.end_step()
        assert _hooks(model) == 0
        assert observer.next_sample_id == 0
        observer.begin_step(1, sample=False)
        observer.open_sample(1)  # an ordinary one after it: id 0
        model(torch.randn(2, 4)).sum().backward()
        observer.finish_forward()
        observer.end_step()
    assert [(s.sample_id, s.step) for s in sink.samples] == [(0, 1)]


def test_a_lazy_sample_is_served_by_a_root_forward_the_plan_samples() -> None:
    """A root forward that samples by itself while a lazy open waits is that sample.

    It ends with ``finish_forward``, as an explicit sample does, and the lazy open leaves
    nothing behind.
    """
    model = mlp()
    sink = RecordingSink()
    with inject_observer(model, sink=sink) as observer:
        observer.begin_step(4, sample=True)
        assert observer.open_sample(4, lazy=True)
        model(torch.randn(2, 4)).sum().backward()
        model(torch.randn(2, 4)).sum().backward()  # explicit: the same sample goes on
        observer.finish_forward()
        observer.end_step()
        assert _hooks(model) == 0
    assert [(s.sample_id, s.step) for s in sink.samples] == [(0, 4)]


def test_gradient_scale_divides_the_recorded_gradients() -> None:
    """With set_gradient_scale(s), gradients are recorded divided by s; outputs are untouched."""
    from torchinstruments_core import ConfigurationError

    model = mlp()
    sink = RecordingSink()
    x = torch.randn(3, 4)
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink) as observer:
        (model(x).sum() * 1024.0).backward()  # as a loss scaler would
        observer.set_gradient_scale(1024.0)
        (model(x).sum() * 1024.0).backward()
        with pytest.raises(ConfigurationError, match="scale=0"):
            observer.set_gradient_scale(0)
    assert sink.value("2", "output_gradient", "max", sample_id=0) == pytest.approx(1024.0)
    assert sink.value("2", "output_gradient", "max", sample_id=1) == pytest.approx(1.0)
    assert sink.value("0", "output", "std", sample_id=0) == sink.value(
        "0", "output", "std", sample_id=1
    )


def test_gradient_scale_may_be_a_tensor_or_read_when_each_sample_opens() -> None:
    """A tensor scale divides on the device; a function is called as each sample opens.

    The function form is what the adapters pass: it sees a scaler's growth between the call to
    ``set_gradient_scale`` and the sample's forward.
    """
    from torchinstruments_core import ConfigurationError

    model = mlp()
    sink = RecordingSink()
    x = torch.randn(3, 4)
    scale = torch.tensor(512.0)
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink) as observer:
        observer.set_gradient_scale(torch.tensor([256.0]))
        (model(x).sum() * 256.0).backward()
        observer.set_gradient_scale(lambda: scale)
        scale.mul_(2)  # the scaler grew after the call: the sample must use 1024
        (model(x).sum() * 1024.0).backward()
        observer.set_gradient_scale(lambda: None)
        model(x).sum().backward()
        for bad in ("2", torch.ones(2), True):
            with pytest.raises(ConfigurationError, match="scale="):
                observer.set_gradient_scale(bad)  # type: ignore[arg-type]
    for sample_id in range(3):
        assert sink.value("2", "output_gradient", "max", sample_id=sample_id) == pytest.approx(1.0)


def _broken() -> float:
    raise RuntimeError("scaler gone")


@pytest.mark.parametrize(
    "reader", [_broken, lambda: torch.ones(2), lambda: 0.0, lambda: -4.0, lambda: "8"]
)
def test_a_failing_scale_reader_warns_and_keeps_training(reader: Callable[[], object]) -> None:
    """A scale function that raises or returns no valid scale is reported; training goes on.

    Its samples record the gradients as they are.
    """
    from torchinstruments_core import ObservationWarning

    model = mlp()
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink) as observer:
        observer.set_gradient_scale(reader)  # type: ignore[arg-type]
        with pytest.warns(ObservationWarning, match="gradient scale could not be read"):
            (model(torch.randn(3, 4)).sum() * 8.0).backward()
    assert sink.value("2", "output_gradient", "max") == pytest.approx(8.0)
