"""Float64 references for the optimizer step signals, taken by the tests' own optimizer hooks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Iterable

    from torchinstruments_core import SampleRecord

Key = tuple[str, str, str, str]  # layer, signal, tensor_path, metric


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
