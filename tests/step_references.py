"""The values an optimizer step's routed signals should have, taken by the test's own hooks.

``StepReference`` hooks a torch optimizer (its own step pre- and post-hooks, the same public API
the core uses, but registered by the test) and keeps, in float64, each step's gradient rms and
update-to-weight ratio per parameter and the global gradient norm, for comparison with what the
loggers and the Parquet files received.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class StepReference:
    """Float64 references for every step of ``optimizer``, keyed by parameter name.

    Args:
        model: The model whose parameters are named (the original, unwrapped module).
        optimizer: The torch optimizer (not a wrapper): hooked for the test's lifetime.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._optimizer = optimizer
        self._before: dict[str, torch.Tensor] = {}
        self.gradient_rms: list[dict[str, float]] = []
        self.update_to_weight: list[dict[str, float]] = []
        self.gradient_norm: list[float] = []
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    def _parameters(self) -> list[tuple[str, torch.Tensor]]:
        return [
            (self._names[id(p)], p)
            for group in self._optimizer.param_groups
            for p in group["params"]
            if id(p) in self._names
        ]

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        gradients = {
            name: p.grad.detach().double() for name, p in self._parameters() if p.grad is not None
        }
        self.gradient_rms.append({n: _rms(g) for n, g in gradients.items()})
        squares = sum(float(g.square().sum()) for g in gradients.values())
        self.gradient_norm.append(math.sqrt(squares))
        self._before = {name: p.detach().double().clone() for name, p in self._parameters()}

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        after = dict(self._parameters())
        self.update_to_weight.append(
            {
                name: _rms(after[name].detach().double() - before) / _rms(before)
                for name, before in self._before.items()
                if _rms(before) > 0  # a zero-initialized bias has no ratio
            }
        )


def _rms(tensor: torch.Tensor) -> float:
    return float(tensor.square().mean().sqrt())
