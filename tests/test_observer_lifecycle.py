"""Attaching, removing and configuring an observer; the model is never changed."""

from __future__ import annotations

import copy
import gc
import io
import weakref

import pytest
import torch
from torch import nn

from helpers import CountingReducer, mlp
from torchinstruments_core import (
    AlwaysSampler,
    ConfigurationError,
    EveryNForwardsSampler,
    ObserverAlreadyAttachedError,
    by_name,
    inject_observer,
    remove_observer,
)
from torchinstruments_core.testing import RecordingSink


def _hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks)
        + len(m._forward_pre_hooks)
        + len(m._backward_hooks)
        + len(m._forward_hooks_always_called)
        for m in model.modules()
    )


def _train_step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    out = model(x)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_outputs_gradients_and_state_are_bit_identical() -> None:
    """Observation never changes outputs, gradients, parameters, buffers or modules."""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    x = torch.randn(32, 4)
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    expected_out, expected_grads = _train_step(reference, x)
    names_before = [n for n, _ in model.named_modules()]
    keys_before = list(model.state_dict())
    with inject_observer(model, sampler=AlwaysSampler(), sink=RecordingSink()):
        torch.manual_seed(1)  # dropout draws the same mask only if we never touch the RNG
        out, grads = _train_step(model, x)
        assert [n for n, _ in model.named_modules()] == names_before
        assert list(model.state_dict()) == keys_before
    assert torch.equal(out, expected_out)
    for got, expected in zip(grads, expected_grads, strict=True):
        assert torch.equal(got, expected)
    for (name, got), expected in zip(
        model.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        assert torch.equal(got, expected), name


def test_removal_leaves_no_hook_and_no_reference() -> None:
    """After remove_observer no hook remains and the observer keeps neither model nor tensors."""
    model = mlp()
    before = _hook_count(model)
    sink = RecordingSink()
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    out = model(torch.randn(2, 4))
    out.sum().backward()
    out_ref = weakref.ref(out)
    remove_observer(model)
    assert _hook_count(model) == before
    assert not observer.attached
    model_ref = weakref.ref(model)
    del model, out
    gc.collect()
    assert model_ref() is None, "the observer (or its sink) still references the model"
    assert out_ref() is None
    assert sink.closed


def test_remove_is_idempotent_and_accepts_model_or_observer() -> None:
    """remove_observer may be called repeatedly, with the model or the observer, or on nothing."""
    model = mlp()
    remove_observer(model)  # never observed: nothing happens
    observer = inject_observer(model, sink=RecordingSink())
    remove_observer(observer)
    remove_observer(model)
    observer.remove()
    inject_observer(model, sink=RecordingSink()).remove()  # a fresh one can attach again


def test_second_injection_raises() -> None:
    """A model observed twice would double-count: the second injection raises."""
    model = mlp()
    with inject_observer(model, sink=RecordingSink()), pytest.raises(ObserverAlreadyAttachedError):
        inject_observer(model, sink=RecordingSink())


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"interval": 5.0, "sampler": AlwaysSampler()}, ("interval", "sampler")),
        ({"output_dir": "x", "sink": RecordingSink()}, ("output_dir", "sink")),
    ],
)
def test_exclusive_arguments_name_both(kwargs: dict[str, object], names: tuple[str, str]) -> None:
    """Giving both of two exclusive arguments raises a ValueError naming both."""
    with pytest.raises(ValueError, match=f"`{names[0]}` and `{names[1]}`"):
        inject_observer(mlp(), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"rank_policy": "rank1"}, r"rank_policy='rank1' is not valid; expected 'rank0', 'all'"),
        ({"error_policy": "ignore"}, r"error_policy='ignore' is not valid; expected 'warn'"),
        ({"max_focus_layers": -1}, r"max_focus_layers=-1"),
        ({"histogram_bins": 0}, r"histogram_bins=0"),
        ({"interval": 0}, r"interval=0"),
        ({"selector": by_name("nothing.*")}, r"selects no module"),
        ({"sampler": object()}, r"sampler=<object"),
        ({"reducers": [CountingReducer(), CountingReducer()]}, r"distinct metric names"),
    ],
)
def test_bad_configuration_raises_at_once(kwargs: dict[str, object], fragment: str) -> None:
    """Bad configuration fails in inject_observer, naming the argument, value and choices."""
    model = mlp()
    with pytest.raises(ConfigurationError, match=fragment):
        inject_observer(model, sink=RecordingSink(), **kwargs)  # type: ignore[arg-type]
    inject_observer(model, sink=RecordingSink()).remove()  # nothing was left attached


def test_unsampled_forwards_run_no_reducer_and_no_module_hook() -> None:
    """Outside a sample no reducer runs and no per-module hook is registered."""
    model = mlp()
    reducer = CountingReducer()
    sink = RecordingSink()
    seen_hooks: list[int] = []
    probe = model[1].register_forward_pre_hook(
        lambda m, a: seen_hooks.append(len(m._forward_hooks))
    )
    with inject_observer(model, sampler=EveryNForwardsSampler(3), reducers=[reducer], sink=sink):
        for _ in range(7):
            model(torch.randn(2, 4)).sum().backward()
            if len(sink.samples) == 0:
                break
        calls_after_sampled = reducer.calls
    probe.remove()
    assert [s.sample_id for s in sink.samples] == [0, 1, 2]  # forwards 0, 3 and 6
    assert reducer.calls == calls_after_sampled
    # 3 layers x (output + output_gradient) per sample
    assert reducer.calls == 3 * 2 * 3
    assert seen_hooks == [1, 0, 0, 1, 0, 0, 1]


def test_context_manager_and_sink_lifecycle() -> None:
    """The observer is a context manager; the sink is opened once with the catalog and closed."""
    model = mlp()
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, run_id="r1") as observer:
        model(torch.randn(2, 4))
        assert observer.attached
    assert sink.closed
    assert sink.run is not None
    assert sink.run.run_id == "r1"
    assert [layer.name for layer in sink.run.layers] == ["0", "1", "2"]
    assert [layer.parameter_count for layer in sink.run.layers] == [40, 0, 27]
    assert sink.run.sampling_policy == "AlwaysSampler()"
    assert sink.samples[0].run_id == "r1"


def test_sink_opened_and_closed_even_without_samples() -> None:
    """A run that took no sample still opens and closes its sink, so the catalog is written."""
    sink = RecordingSink()
    inject_observer(mlp(), sink=sink).remove()
    assert sink.run is not None
    assert sink.closed
    assert sink.samples == []


def test_default_sampler_takes_the_first_forward_then_waits_an_interval() -> None:
    """By default the first root forward is sampled and the next only after 60 seconds."""
    model = mlp()
    sink = RecordingSink()
    with inject_observer(model, sink=sink):
        for _ in range(5):
            model(torch.randn(2, 4))
    assert [s.sample_id for s in sink.samples] == [0]
    assert sink.run is not None
    assert sink.run.sampling_policy == "IntervalSampler(seconds=60)"


def test_collection_duration_and_timestamp_are_recorded() -> None:
    """Each sample records how long observing it took, so the cost of telemetry is visible."""
    sink = RecordingSink()
    model = mlp()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        model(torch.randn(2, 4)).sum().backward()
    sample = sink.samples[0]
    assert 0.0 < sample.collection_duration_ms < 10_000
    assert sample.timestamp > 1.6e9


def test_torch_save_and_deepcopy_while_observed() -> None:
    """A model can be deep-copied and pickled while observed; the copy is not observed."""
    model = mlp()
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        twin = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        x = torch.randn(2, 4)
        with torch.no_grad():
            expected = model(x)
            for other in (twin, loaded):
                assert torch.equal(other(x), expected)
        assert len(sink.samples) == 1  # only the original's forward was sampled
        with inject_observer(twin, sampler=AlwaysSampler(), sink=RecordingSink()):
            twin(x)
    assert len(sink.samples) == 1


def test_observer_reports_layers_and_focus() -> None:
    """The observer says which modules it observes and which get histograms."""
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(20)])
    with inject_observer(model, sink=RecordingSink()) as observer:
        assert len(observer.layer_names) == 20
        assert observer.focus_layer_names == ("0", "3", "5", "8", "11", "14", "16", "19")
    with inject_observer(model, sink=RecordingSink(), focus_selector=by_name("1*")) as observer:
        assert observer.focus_layer_names == ("1", "10", "11", "12", "13", "14", "15", "16")
    with inject_observer(model, sink=RecordingSink(), max_focus_layers=0) as observer:
        assert observer.focus_layer_names == ()
