"""``record_inputs=True``: each call's input tensors and the gradients flowing back into them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import mlp, rows_of
from test_correlation import CheckpointedNet
from torchinstruments_core import AlwaysSampler, Signal, inject_observer
from torchinstruments_core.testing import RecordingSink


class Mixer(nn.Module):
    """Takes a positional tensor, a nested pair and a keyword tensor."""

    def forward(
        self,
        x: torch.Tensor,
        pair: tuple[torch.Tensor, dict[str, torch.Tensor]],
        *,
        scale: torch.Tensor,
    ) -> torch.Tensor:
        return x * scale + pair[0] + pair[1]["b"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = Mixer()
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: torch.Tensor):
        return self.head(self.mix(x, (a, {"b": b}), scale=s))


def _value(sink: RecordingSink, layer: str, signal: Signal, path: str, metric: str) -> float:
    value = sink.value(layer, signal, metric, tensor_path=path)
    assert value is not None
    return value


def test_input_statistics_match_float64_references() -> None:
    """Positional, nested and keyword inputs have statistics equal to float64 references.

    Their rows sit under ``input.0``, ``input.1.0``, ``input.1.1.b`` and ``input.scale``.
    """
    torch.manual_seed(0)
    tensors = {
        "input.0": torch.randn(5, 6),
        "input.1.0": torch.randn(5, 6) * 3 + 1,
        "input.1.1.b": torch.rand(5, 6),
        "input.scale": torch.randn(6),
    }
    sink = RecordingSink()
    model = Net()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, record_inputs=True):
        model(*tensors.values())
    for path, tensor in tensors.items():
        exact = tensor.double()
        assert _value(sink, "mix", Signal.INPUT, path, "mean") == pytest.approx(exact.mean().item())
        assert _value(sink, "mix", Signal.INPUT, path, "std") == pytest.approx(
            exact.std(correction=0).item()
        )
        assert _value(sink, "mix", Signal.INPUT, path, "max_abs") == pytest.approx(
            exact.abs().max().item()
        )
        assert _value(sink, "mix", Signal.INPUT, path, "rms") == pytest.approx(
            exact.square().mean().sqrt().item()
        )


def test_input_gradients_equal_autograd_gradients() -> None:
    """``input_gradient`` of positional and keyword inputs equals ``torch.autograd.grad``."""
    torch.manual_seed(0)
    x, a, b, s = (torch.randn(5, 6, requires_grad=True) for _ in range(4))
    model = Net()
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, record_inputs=True):
        model(x, a, b, s).square().sum().backward()
    reference = Net()
    reference.load_state_dict(model.state_dict())
    copies = [t.detach().clone().requires_grad_() for t in (x, a, b, s)]
    loss = reference(*copies).square().sum()
    grads = torch.autograd.grad(loss, copies)
    for path, grad in zip(
        ("input.0", "input.1.0", "input.1.1.b", "input.scale"), grads, strict=True
    ):
        exact = grad.double()
        assert _value(sink, "mix", Signal.INPUT_GRADIENT, path, "mean") == pytest.approx(
            exact.mean().item()
        )
        assert _value(sink, "mix", Signal.INPUT_GRADIENT, path, "max_abs") == pytest.approx(
            exact.abs().max().item()
        )


def test_input_gradient_of_an_inner_layer_equals_retain_grad() -> None:
    """An inner layer's input gradient equals ``.retain_grad()`` on the tensor it was given.

    Its input statistics equal the previous layer's output statistics.
    """
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    sink = RecordingSink()
    x = torch.randn(16, 4)
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, record_inputs=True):
        model(x).square().mean().backward()
    hidden = model[0](x)
    hidden.retain_grad()
    model[2](model[1](hidden)).square().mean().backward()
    assert hidden.grad is not None
    exact = hidden.grad.double()
    assert _value(sink, "1", Signal.INPUT_GRADIENT, "input.0", "std") == pytest.approx(
        exact.std(correction=0).item()
    )
    assert _value(sink, "1", Signal.INPUT, "input.0", "std") == _value(
        sink, "0", Signal.OUTPUT, "output", "std"
    )


def test_inputs_without_gradient_get_no_gradient_rows_and_integers_are_unavailable() -> None:
    """Token ids are recorded as ``unsupported_dtype``, and get no ``input_gradient`` rows.

    Like a batch that does not require a gradient (and like outputs without one).
    """
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, record_inputs=True):
        model(torch.tensor([[1, 2, 3]])).sum().backward()
    rows = [r for r in sink.rows if r.layer == "0" and r.signal is Signal.INPUT]
    assert rows
    assert {(r.value, r.unavailable_reason) for r in rows} == {(None, "unsupported_dtype")}
    observed = rows_of(sink)
    assert ("0", 0, "input_gradient", "input.0") not in observed
    assert ("1", 0, "input_gradient", "input.0") in observed


def test_an_in_place_module_records_the_input_it_was_given() -> None:
    """``ReLU(inplace=True)``: its input rows hold the values before it overwrote them.

    Its input gradient is the gradient of the tensor it was given.
    """
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(inplace=True), nn.Linear(16, 1))
    sink = RecordingSink()
    x = torch.randn(64, 4)
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, record_inputs=True):
        model(x).sum().backward()
    before = model[0](x)
    before.retain_grad()
    model[2](torch.relu(before)).sum().backward()
    assert _value(sink, "1", Signal.INPUT, "input.0", "min") == pytest.approx(before.min().item())
    assert before.grad is not None
    assert _value(sink, "1", Signal.INPUT_GRADIENT, "input.0", "mean") == pytest.approx(
        before.grad.double().mean().item()
    )


def _checkpointed_values(use_reentrant: bool) -> dict[tuple[str, str, str], float | None]:
    torch.manual_seed(0)
    model = CheckpointedNet(use_reentrant)
    sink = RecordingSink()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with inject_observer(
        model,
        sampler=AlwaysSampler(),
        sink=sink,
        record_inputs=True,
        profile=True,
        error_policy="raise",
    ):
        model(x).sum().backward()
    assert len(sink.samples) == 1
    keys = [(r.layer, r.call_index, r.signal, r.tensor_path, r.metric) for r in sink.rows]
    assert len(keys) == len(set(keys))  # the recomputation adds no row twice
    return {(r.layer, str(r.signal), r.metric): r.value for r in sink.rows}


def test_reentrant_checkpointing_records_input_gradients_from_the_recomputation() -> None:
    """Reentrant checkpointing: input gradients come from the recomputation, and are right.

    Inside the checkpoint the inputs are computed without autograd; their gradients equal
    those of the non-reentrant form. With ``profile`` on too, nothing fails and no row repeats.
    """
    reentrant, plain = _checkpointed_values(True), _checkpointed_values(False)
    for layer in ("block.inner", "block.act"):
        key = (layer, "input_gradient", "mean")
        assert reentrant[key] is not None
        assert reentrant[key] == pytest.approx(plain[key])


def test_observation_with_inputs_and_profile_changes_nothing() -> None:
    """Outputs and gradients are bit-identical with ``record_inputs`` and ``profile`` on."""
    observed, reference = mlp(), mlp()
    x = torch.randn(8, 4, requires_grad=True)
    x_reference = x.detach().clone().requires_grad_()
    sink = RecordingSink()
    with inject_observer(
        observed, sampler=AlwaysSampler(), sink=sink, record_inputs=True, profile=True
    ):
        out = observed(x)
        out.square().sum().backward()
    out_reference = reference(x_reference)
    out_reference.square().sum().backward()
    assert torch.equal(out, out_reference)
    assert x.grad is not None
    assert x_reference.grad is not None
    assert torch.equal(x.grad, x_reference.grad)
    for p, q in zip(observed.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None
        assert q.grad is not None
        assert torch.equal(p.grad, q.grad)
    assert any(r.signal is Signal.INPUT_GRADIENT for r in sink.rows)


def test_inputs_time_and_memory_are_off_by_default() -> None:
    """Without the options no ``input``, ``input_gradient``, ``time`` or ``memory`` row exists."""
    model = mlp()
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        model(torch.randn(8, 4, requires_grad=True)).sum().backward()
    off = {Signal.INPUT, Signal.INPUT_GRADIENT, Signal.TIME, Signal.MEMORY}
    assert sink.rows
    assert not [r for r in sink.rows if r.signal in off]


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.children())


@pytest.mark.parametrize(("record_inputs", "profile"), [(True, False), (False, True)])
def test_an_unsampled_forward_runs_no_per_module_hook(record_inputs: bool, profile: bool) -> None:
    """The pre-hooks exist only while a sampled step runs: an unsampled one finds none."""
    model = mlp()
    seen: list[int] = []
    with inject_observer(
        model, sink=RecordingSink(), record_inputs=record_inputs, profile=profile
    ) as observer:
        for step, sample in enumerate((False, True, False)):
            observer.begin_step(step, sample=sample)
            model(torch.randn(2, 4))
            seen.append(_hook_count(model))
            observer.end_step()
    assert seen[0] == seen[2] == 0
    assert seen[1] == 2 * len(model)  # one forward hook and one pre-hook per layer


def test_direct_forward_calls_record_inputs_too() -> None:
    """With ``capture_direct_forwards`` a ``module.forward(x)`` call records its inputs."""
    model = mlp()
    sink = RecordingSink()
    x = torch.randn(8, 4)
    with inject_observer(
        model,
        sampler=AlwaysSampler(),
        sink=sink,
        record_inputs=True,
        capture_direct_forwards=True,
    ):
        model.forward(x)
    assert _value(sink, "0", Signal.INPUT, "input.0", "mean") == pytest.approx(
        x.double().mean().item()
    )
