"""Float64 references for the optimizer step signals, taken by the tests' own optimizer hooks."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchinstruments_core import AlwaysSampler, RecordKind, inject_observer
from torchinstruments_core.testing import RecordingSink

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    import pytest

    from torchinstruments_core import SampleRecord
    from torchinstruments_core.reducers._host import HostSummary

Key = tuple[str, str, str, str]  # layer, signal, tensor_path, metric
MODEL = "<model>"


@dataclass
class StepCopies:
    """One optimizer step as the optimizer saw it, in float64, keyed by parameter name."""

    before: dict[str, torch.Tensor] = field(default_factory=dict)
    gradient: dict[str, torch.Tensor] = field(default_factory=dict)
    after: dict[str, torch.Tensor] = field(default_factory=dict)
    state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    step: dict[str, float] = field(default_factory=dict)


class Reference:
    """Copies what an optimizer uses, from hooks registered before the observer's.

    The parameters are copied in the pre-hook (the step has not touched them, with or without a
    closure); the gradients, the parameters after the update and the state in the post-hook (the
    built-in optimizers never modify ``.grad``, so it still holds what the update used).

    Args:
        optimizer: The optimizer to follow.
        names: The name each of its parameters is known by in the test (``"0.weight"``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> None:
        self.steps: list[StepCopies] = []
        self._names = names
        self._handles = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_step_post_hook(self._post),
        ]

    def _parameters(self, optimizer: torch.optim.Optimizer) -> Iterable[tuple[str, Any]]:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                yield self._names[id(parameter)], parameter

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        copies = StepCopies()
        for name, parameter in self._parameters(optimizer):
            copies.before[name] = parameter.detach().to(torch.float64, copy=True)
        self.steps.append(copies)

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        copies = self.steps[-1]
        for name, parameter in self._parameters(optimizer):
            if parameter.grad is not None:
                copies.gradient[name] = parameter.grad.detach().to(torch.float64, copy=True)
            copies.after[name] = parameter.detach().to(torch.float64, copy=True)
            state = optimizer.state.get(parameter, {})
            copies.state[name] = {
                key: value.detach().to(torch.float64, copy=True)
                for key, value in state.items()
                if isinstance(value, torch.Tensor) and value.shape == parameter.shape
            }
            if "step" in state:
                copies.step[name] = float(state["step"])

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def stats(tensor: torch.Tensor) -> dict[str, float]:
    """The reducers' metrics that a test compares, computed in float64."""
    values = tensor.detach().to(torch.float64).reshape(-1)
    return {
        "mean": values.mean().item(),
        "std": values.std(unbiased=False).item(),
        "min": values.min().item(),
        "max": values.max().item(),
        "rms": values.square().mean().sqrt().item(),
        "max_abs": values.abs().max().item(),
    }


def values_of(record: SampleRecord) -> dict[Key, float | None]:
    """The rows of one record, by (layer, signal, tensor_path, metric)."""
    return {(r.layer, str(r.signal), r.tensor_path, r.metric): r.value for r in record.rows}


def split(name: str) -> tuple[str, str]:
    """``"0.weight"`` as its module's clean name and the parameter's name."""
    layer, _, parameter = name.rpartition(".")
    return layer, parameter


def assert_matches(
    rows: dict[Key, float | None],
    layer: str,
    signal: str,
    path: str,
    expected: dict[str, float],
    *,
    rel: float,
) -> None:
    """Every metric in ``expected`` is in ``rows`` with that value (relative tolerance)."""
    import pytest

    for metric, value in expected.items():
        got = rows[(layer, signal, path, metric)]
        assert got == pytest.approx(value, rel=rel, abs=1e-12), (layer, signal, path, metric)


def adam_ratio(gradient: torch.Tensor, second: torch.Tensor, step: float, beta2: float) -> float:
    """rms(g / sqrt(v_hat)), v_hat the bias-corrected second moment, floored at eps**2."""
    v_hat = second / (1 - beta2**step)
    return (gradient.square() / v_hat.clamp(min=1e-16)).mean().sqrt().item()


def float64_mlp() -> nn.Sequential:
    """A seeded float64 MLP: Linear(4, 8), Tanh, Linear(8, 3)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def parameter_names(model: nn.Module) -> dict[int, str]:
    """Each parameter's name in ``model``, by the parameter's id (what ``Reference`` takes)."""
    return {id(p): name for name, p in model.named_parameters()}


def train(model: nn.Module, optimizers: list[torch.optim.Optimizer], steps: int) -> None:
    """``steps`` plain-loop iterations of ``float64_mlp``: forward, backward, every optimizer."""
    for index in range(steps):
        torch.manual_seed(100 + index)
        loss = model(torch.randn(16, 4, dtype=torch.float64)).square().mean()
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def closure_for(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], torch.Tensor]:
    """A closure for ``optimizer.step``: gradients zeroed, a float64 batch's loss, backward."""

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(torch.randn(8, 4, dtype=torch.float64)).square().mean()
        loss.backward()
        return loss

    return closure


def step_records(sink: RecordingSink) -> list[SampleRecord]:
    """The step records ``sink`` received, in order."""
    return [s for s in sink.samples if s.kind is RecordKind.STEP]


def one_adam_step(**arguments: Any) -> SampleRecord:
    """The step record of one sampled Adam step, observed with ``arguments`` besides."""
    model = float64_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    sink = RecordingSink()
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer, **arguments
    ):
        train(model, [optimizer], steps=1)
    (record,) = step_records(sink)
    return record


def count_summed_gradients(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the gradients the whole-model row sums itself, one a call, from now on.

    Counts ``_step_math._finite_summary``: a gradient whose own reduction left the kernels'
    summary (``Measurement.summary``) is not summed again.
    """
    from torchinstruments_core import _step_math

    summed: list[int] = []
    finite_summary = _step_math._finite_summary

    def counted(gradient: torch.Tensor) -> HostSummary | None:
        summed.append(gradient.numel())
        return finite_summary(gradient)

    monkeypatch.setattr(_step_math, "_finite_summary", counted)
    return summed


WIDE = 512
"""A ``WIDE`` x ``WIDE`` float32 weight is 1 MiB, past ``_step_tensors.QUEUED_COPY_BYTES``."""


def wide_net() -> nn.Sequential:
    """4 -> WIDE -> WIDE -> 1; ``2.weight`` is copied on the kernels' queue (``queued_copies``)."""
    return nn.Sequential(nn.Linear(4, WIDE), nn.ReLU(), nn.Linear(WIDE, WIDE), nn.Linear(WIDE, 1))


@contextlib.contextmanager
def queued_copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Count the parameter copies queued on the kernels' queue (their entries), one torch thread.

    On one thread a core is free, so the CPU reductions, and with them the large parameters'
    copies before a recorded step, go to the queue by default. Skips where there is no queue.
    """
    import pytest

    from torchinstruments_core import _step_tensors
    from torchinstruments_core.reducers import _native

    if not _native.QUEUE:
        pytest.skip("the kernels have no queue here")
    assert _step_tensors.QUEUED_COPY_BYTES <= WIDE * WIDE * 4
    copied: list[int] = []
    queue_copy = _native.queue_copy

    def counted(queue: object, source: torch.Tensor, destination: torch.Tensor) -> int:
        copied.append(source.numel())
        return queue_copy(queue, source, destination)

    monkeypatch.setattr(_native, "queue_copy", counted)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield copied
    finally:
        torch.set_num_threads(threads)
